"""The torch row backend: differentiates the torch definitions in `flashkd.losses` with autograd.

Runs on any device; its temporaries are a few fp32 copies of the block, O(R × V).
"""

from __future__ import annotations

import torch

from ..losses import LossSpec, row_losses, topk_row_losses


def rows(s, t, labels, spec: LossSpec, scale: torch.Tensor, grad: bool, stats: bool = False, *, vocab=None,
         teacher_grad: bool = False):
    """Dense teacher logits t (R, V). vocab: the block's `flashkd.losses.Vocab` (None: the whole vocab).
    teacher_grad (a learning teacher, `losses.LEARNING_LOSSES`): dL/dt too, written over t as dL/ds is over s."""
    return _differentiate(row_losses, s, t, labels, spec, scale, grad, stats, vocab, teacher_grad)


def topk_rows(s, t, labels, spec: LossSpec, scale: torch.Tensor, grad: bool, stats: bool = False, *, vocab=None):
    """Sparse teacher t = (ids, logprobs), (R, K) each."""
    return _differentiate(topk_row_losses, s, t, labels, spec, scale, grad, stats, vocab)


def _differentiate(row_fn, s, t, labels, spec, scale, grad, stats, vocab, teacher_grad=False):
    if not grad:
        return row_fn(s, t, labels, spec, vocab, stats=stats)
    work = torch.promote_types(s.dtype, torch.float32)
    with torch.enable_grad():
        a = s.detach().to(work).requires_grad_()
        b = t.detach().to(work).requires_grad_() if teacher_grad else t
        out = row_fn(a, b, labels, spec, vocab, stats=stats)
        total = spec.total(out[0].sum(), out[1].sum())
        if vocab is not None and vocab.copies != 1:
            total = total / vocab.copies  # each rank's copy of a replicated loss (`losses.Vocab.copies`)
        grads = torch.autograd.grad(total, (a, b) if teacher_grad else (a,))
    factor = scale[:, None] if scale.dim() else scale  # per-row factors: (R,) scale
    for block, g in zip((s, t), grads):
        block.copy_(g.mul_(factor))
    return tuple(x.detach() for x in out)
