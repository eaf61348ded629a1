"""flashkd inside the trainers people use. Each submodule imports its peer library only when imported:

    flashkd.integrations.trl           patch(): TRL's distillation trainers (DistillationTrainer, and the
                                       on-policy AsyncDistillationTrainer and ServerDistillationTrainer)
                                       compute their loss with flashkd
    flashkd.integrations.transformers  DistillationTrainer / DistillationLossMixin: an HF Trainer's
                                       compute_loss from a live teacher or flashkd.data top-k targets
    flashkd.integrations.verl          patch(): verl 0.9.1's top-k distillation loss and diagnostics on
                                       the FSDP engine, from the student's hidden states and LM head
    flashkd.integrations.axolotl       FusedLinearKLTopKLogprobLoss, FlashKDPlugin, patch(): axolotl
                                       0.19's KD loss

This package itself imports neither; the helpers below are the pieces they share. A patch keeps its state
with what it patches, not in module globals: `replace` sets a module's or a class's attribute and keeps
the original on that same target (`_flashkd_saved`), `original` reads it back and `restore` puts it back.
"""

from __future__ import annotations

import logging
import sys

import torch


class _Stderr(logging.StreamHandler):
    """A handler writing to the sys.stderr of the moment (one replaced after import included)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def announce(message: str) -> None:
    """One line on the "flashkd" logger, at INFO, when a patch installs: that the trainer now runs flashkd
    is worth seeing. Shown on stderr unless the application configured that logger itself (its level or
    handlers): `logging.getLogger("flashkd").setLevel(logging.WARNING)` silences it."""
    logger = logging.getLogger("flashkd")
    if not logger.handlers and logger.level == logging.NOTSET:
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # the root logger's handlers would print it twice
    logger.info(message)


_SAVED = "_flashkd_saved"  # on a patched module or class: {attribute name: its own attribute before the patch}
_INHERITED = object()  # saved for an attribute the target did not have of its own (a class's from its bases)


def replace(target, name: str, value) -> dict:
    """Set `target.name` (an attribute of a module or a class) to `value`, and keep what the target held there
    in its `_flashkd_saved` record: only the first time, so that patching again keeps the library's own
    original. Returns the record, one object from the first `replace` until `restore` has put every name
    back and emptied it: a patch call that keeps it can tell whether its install is still the one in place
    (the record still holds names)."""
    saved = vars(target).get(_SAVED)
    if saved is None:
        saved = {}
        setattr(target, _SAVED, saved)
    saved.setdefault(name, vars(target).get(name, _INHERITED))
    setattr(target, name, value)
    return saved


def is_replaced(target, name: str) -> bool:
    """Whether `target.name` is flashkd's (set by `replace`, not restored since)."""
    return name in vars(target).get(_SAVED, ())


def original(target, name: str):
    """`target.name` as its library defines it: while replaced, the saved original (a class's inherited one
    from its bases), else the attribute itself; None where there is none."""
    saved = vars(target).get(_SAVED, {})
    if name not in saved:
        return getattr(target, name, None)
    if saved[name] is _INHERITED:
        return getattr(super(target, target), name, None) if isinstance(target, type) else None
    return saved[name]


def restore(target, *names: str) -> None:
    """Put back exactly what `replace` saved on `target` for `names` (an attribute the target had not of its
    own is deleted, the inherited one shows again), and drop the record once it is empty. A name not
    replaced is left alone."""
    saved = vars(target).get(_SAVED)
    if saved is None:
        return
    for name in names:
        if name in saved:
            value = saved.pop(name)
            if value is _INHERITED:
                delattr(target, name)
            else:
                setattr(target, name, value)
    if not saved:
        delattr(target, _SAVED)


def full_head(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
    """An FSDP2 DTensor LM head as one plain tensor, gathered once for all chunks (its backward
    reduce-scatters to the shards), cast to `dtype` (an fp32 master copy to the compute dtype);
    a plain head is returned as it is."""
    from torch.distributed.tensor import DTensor

    if isinstance(weight, DTensor):
        weight = weight.full_tensor().to(dtype)
        if isinstance(bias, DTensor):
            bias = bias.full_tensor()
    return weight, bias


def per_item(loss: torch.Tensor, count: torch.Tensor, num_items_in_batch) -> torch.Tensor:
    """A loss summed over rows, per item: divided by the trainer's `num_items_in_batch` (the items of
    the whole accumulated batch, so that accumulation matches one large batch), or without it by
    the rows that counted (at least 1)."""
    if num_items_in_batch is None:
        return loss / count.clamp(min=1)
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype an op on `x` computes in: autocast's on x's device when it is on, else x's own."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype

