"""axolotl's top-k knowledge distillation with flashkd's loss: a drop-in for
`axolotl.integrations.kd.kernels.liger.LigerFusedLinearKLTopKLogprobLoss`, and the plugin that installs it.

In an axolotl config, after axolotl's own KD plugin:

    plugins:
      - axolotl.integrations.kd.KDPlugin
      - flashkd.integrations.axolotl.FlashKDPlugin

or in a script, before the trainer is built: `flashkd.integrations.axolotl.patch()`.

axolotl 0.19's KD trainer (`AxolotlKDTrainer`) builds its loss once, as
`LigerFusedLinearKLTopKLogprobLoss(kd_ce_alpha, kd_alpha, kd_temperature, kd_beta, compute_ce_loss=...,
normalize_topk=kd_normalize_topk)`, and calls it on the LM head's weight, the last hidden states (B, T, H),
the teacher's top-k ids, log-probs and mask (B, T, K) and the labels (B, T). What it computes (Liger's
chunked base, bf16 logits a chunk), and what `FusedLinearKLTopKLogprobLoss` below computes the same:

    loss = kd_alpha · τ² · Σ_rows soft + kd_ce_alpha · Σ_rows CE      (sums: the trainer divides)

- q_k = softmax(student logits / τ) at the teacher's ids; with normalize_topk, q̃ = q renormalised
  over the row's K ids; p_k = exp(teacher log-probs) as given (at τ, as axolotl's data holds them),
  over the slots whose mask is 1;
- soft, beta 0: Σ p (log p − log q̃)   (forward KL; log q over the whole vocab without normalize_topk)
        beta 1: Σ q̃ (log q̃ − log p)   (reverse KL over the ids)
        between: β KL(p‖M) + (1 − β) KL(q̃‖M), M = β p + (1 − β) q̃   (Liger's "JSD")
  beta 0.5 is that JSD, not the mean of the two KLs axolotl's docs call "symmetric";
- CE: the untempered cross-entropy of the labels shifted by one (label t + 1 at row t), rows whose
  label is ignore_index skipped, only with compute_ce_loss and kd_ce_alpha > 0.

How flashkd computes each (`flashkd.fused_linear_distill_topk`, reduction "sum"), exactly:
- beta 0: Σ p (log p − log q̃) = P (KL(p̃‖q̃) + log P) with P = Σ p and p̃ = p / P: the top-k form
  tail="renormalize" with row_weight P, plus Σ P log P (a constant); without normalize_topk the same
  with tail="bucket" (the rest of the vocab as one category, with no teacher mass in it);
- beta 1: Σ q̃ (log q̃ − log p) = KL(q̃‖p̃) − log P: tail="renormalize", minus Σ log P;
- between: tail="renormalize" JSD; flashkd renormalises p over the ids, so this equals axolotl's
  where p sums to 1 over them, as axolotl's collators normalise them (`normalize_logprobs`).
- beta > 0 without normalize_topk (q at the ids not summing to 1) is no divergence flashkd's top-k
  form takes: refused with a ValueError rather than computed differently.
- The CE is in the same flashkd call where it can be (beta > 0, and every row with teacher slots
  has a label: one host sync to find out); otherwise a second call (beta 0 weighs rows by P, which
  must not weigh their CE).
- A slot whose mask is 0 is absent from both sides (id −1 for flashkd). axolotl's kernel keeps its id
  in the student's normaliser under normalize_topk; its collators mask whole rows (all K slots or
  none), where the two are the same.

What differs: the logits are never materialised (flashkd's chunk loop, at fp32 accuracy from bf16
inputs), the result is fp32 (fp64 for fp64 inputs) where Liger accumulates in the inputs' dtype, and
`compiled` / `chunk_size` are accepted and unused (flashkd plans its own chunks).
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
import sys

import torch
import torch.nn.functional as F

from ..core import checks as core_checks
from ..distill import KEYWORDS, check_options, fused_linear_distill_topk
from . import announce, is_replaced, replace, restore

TESTED_AXOLOTL_VERSIONS = ("0.19.0",)
_TRAINER = "axolotl.integrations.kd.trainer"
_KERNEL = "axolotl.integrations.kd.kernels.liger"
_NAME = "LigerFusedLinearKLTopKLogprobLoss"

# Lifts the renormalised targets' sum just past 1, so that the bucket (tail="bucket", beta 0 without
# normalize_topk) holds no teacher mass; flashkd renormalises it away.
_ABOVE_ONE = 2.0**-12
# the keywords of fused_linear_distill_topk that forward sets itself
_SET_HERE = frozenset({"loss", "tail", "beta", "temperature", "temperature_squared", "ignore_index", "student_bias",
                       "reduction", "weight_soft_loss", "weight_hard_loss", "row_weight"})
# flashkd's argument names in its errors, as this loss's forward names them (row_weight: P, from the log-probs)
_NAMES = {"student_input": "student_hidden_states", "student_weight": "lm_head_weight",
          "teacher_ids": "target_token_ids", "teacher_logprobs": "target_logprobs", "labels": "true_labels",
          "row_weight": "target_logprobs"}


def _flag(name, value):
    # axolotl reads these with `if`: None (kd_normalize_topk unset) is False; a string or a tensor would be
    # taken by its truth value unseen
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool (or None: False), got {value!r}")
    return bool(value)


def _weight(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{name}: expected a finite float, got {value!r}")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}: expected a value in [0, 1] (as axolotl's kernel requires), got {value!r}")
    return float(value)


class FusedLinearKLTopKLogprobLoss(torch.nn.Module):
    """axolotl's `LigerFusedLinearKLTopKLogprobLoss`, same constructor and forward, computed by flashkd
    (the module docstring says what is the same and what differs). `flashkd_options` go to
    `flashkd.fused_linear_distill_topk` (backend, grad_accum_dtype, check_teacher, ...)."""

    def __init__(
        self,
        weight_hard_loss: float = 0.5,
        weight_soft_loss: float = 0.5,
        temperature: float = 1.0,
        beta: float = 1.0,
        ignore_index: int = -100,
        compiled: bool = True,
        chunk_size: int = 1024,
        compute_ce_loss: bool = True,
        normalize_topk: bool = True,
        **flashkd_options,
    ):
        super().__init__()
        self.weight_hard_loss = _weight("weight_hard_loss", weight_hard_loss)
        self.weight_soft_loss = _weight("weight_soft_loss", weight_soft_loss)
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
            raise ValueError(f"temperature: expected a float > 0, got {temperature!r}")
        self.temperature = float(temperature)
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta: expected a float in [0, 1] (0 forward KL, 1 reverse KL), got {beta!r}")
        self.beta = float(beta)
        self.compute_ce_loss = _flag("compute_ce_loss", compute_ce_loss)
        self.normalize_topk = _flag("normalize_topk", normalize_topk)
        if not self.normalize_topk and self.beta > 0.0:
            raise ValueError(f"normalize_topk: expected True with beta={beta!r} (without it axolotl's reverse KL and "
                             f"JSD take the student's unnormalised probabilities at the K ids, which is no "
                             f"divergence flashkd computes); got {normalize_topk!r}. Use kd_normalize_topk: true, or "
                             f"kd_beta: 0")
        # unused here (flashkd plans its own chunks), checked all the same: a wrong one is a wrong config
        if not isinstance(compiled, bool):
            raise TypeError(f"compiled: expected a bool, got {compiled!r}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size: expected an int >= 1, got {chunk_size!r}")
        # flashkd's own options, checked here by the call's parse (not at the first training step)
        wrong = sorted(set(flashkd_options) & _SET_HERE | set(flashkd_options) - set(KEYWORDS["fused_linear_distill_topk"]))
        if wrong:
            raise TypeError(f"{wrong[0]}: expected a keyword of axolotl's loss or an option of "
                            f"flashkd.fused_linear_distill_topk that this loss does not set itself, got "
                            f"{wrong[0]}={flashkd_options[wrong[0]]!r}")
        check_options({**flashkd_options, "ignore_index": ignore_index}, "fused_linear_distill_topk")
        self.ignore_index = ignore_index
        self.compiled, self.chunk_size = compiled, chunk_size
        self.flashkd_options = flashkd_options
        self.__dict__["_built"] = True

    _CHECKED = ("weight_hard_loss", "weight_soft_loss", "temperature", "beta", "ignore_index", "compiled", "chunk_size",
                "compute_ce_loss", "normalize_topk")

    def __setattr__(self, name, value):
        # forward reads these attributes (as Liger's module's are read); set after construction they skipped its
        # checks: `loss.beta = 0.5` beside normalize_topk False computed a loss axolotl does not, a flag "no" read
        # as True. Set now, they are checked by the constructor's own checks (its value kept as it made it).
        if self.__dict__.get("_built") and name in self._CHECKED:
            settings = {k: getattr(self, k) for k in self._CHECKED}
            value = getattr(type(self)(**{**settings, name: value}, **self.flashkd_options), name)
        elif self.__dict__.get("_built") and name == "flashkd_options":
            if not isinstance(value, dict):
                raise TypeError(f"flashkd_options: expected a dict of keyword options, got {type(value).__name__}")
            type(self)(**{k: getattr(self, k) for k in self._CHECKED}, **value)
        super().__setattr__(name, value)

    def forward(
        self,
        lm_head_weight: torch.Tensor,  # (V, H)
        student_hidden_states: torch.Tensor,  # (B, T, H)
        target_token_ids: torch.Tensor,  # (B, T, K)
        target_logprobs: torch.Tensor,  # (B, T, K)
        target_mask: torch.Tensor,  # (B, T, K)
        true_labels: torch.Tensor,  # (B, T)
        student_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        try:
            return self._forward(lm_head_weight, student_hidden_states, target_token_ids, target_logprobs,
                                 target_mask, true_labels, student_bias)
        except (TypeError, ValueError) as e:  # errors name the argument as axolotl's signature calls it
            raise core_checks.renamed(e, _NAMES) from None

    def _forward(self, lm_head_weight, student_hidden_states, target_token_ids, target_logprobs, target_mask,
                 true_labels, student_bias):
        # what flashkd's call does not see as it is given here (it gets the ids masked, the log-probs cast
        # and shifted, the labels shifted): the type, dtype, device and shape of each, checked first
        core_checks.check_tensors({"student_hidden_states": student_hidden_states})
        if student_hidden_states.dtype not in core_checks.FLOATS:
            raise TypeError(f"student_hidden_states: expected a floating dtype (float16, bfloat16, float32, float64), "
                            f"got {student_hidden_states.dtype}")
        core_checks.check_tensors({"lm_head_weight": lm_head_weight, "student_bias": student_bias},
                                  student_hidden_states.dtype, student_hidden_states.device, like="student_hidden_states")
        core_checks.check_tensors({"target_token_ids": target_token_ids, "target_logprobs": target_logprobs,
                                   "target_mask": target_mask, "true_labels": true_labels},
                                  device=student_hidden_states.device, like="student_hidden_states")
        if student_hidden_states.dim() != 3:
            raise ValueError(f"student_hidden_states: expected shape (B, T, H), got "
                             f"{tuple(student_hidden_states.shape)}")
        b, t, h = student_hidden_states.shape
        if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != h:
            raise ValueError(f"lm_head_weight: expected shape (V, {h}) (student_hidden_states' H), got "
                             f"{tuple(lm_head_weight.shape)}")
        if target_token_ids.dim() != 3 or target_token_ids.shape[:2] != (b, t) or target_token_ids.shape[-1] < 1:
            raise ValueError(f"target_token_ids: expected shape ({b}, {t}, K) with K >= 1 (student_hidden_states' "
                             f"B, T), got {tuple(target_token_ids.shape)}")
        for name, x in (("target_logprobs", target_logprobs), ("target_mask", target_mask)):
            if x.shape != target_token_ids.shape:  # not broadcast: a (B, T, 1) mask is no per-slot mask
                raise ValueError(f"{name}: expected shape {tuple(target_token_ids.shape)} (that of target_token_ids), "
                                 f"got {tuple(x.shape)}")
        if true_labels.shape != (b, t):
            raise ValueError(f"true_labels: expected shape ({b}, {t}), got {tuple(true_labels.shape)}")
        # the ids are masked and widened below (.long() would truncate a float id unseen); the log-probs
        # cast to the compute dtype (an int or bool tensor would be taken as numbers unseen)
        if target_token_ids.dtype.is_floating_point or target_token_ids.dtype.is_complex \
                or target_token_ids.dtype == torch.bool:
            raise TypeError(f"target_token_ids: expected an integer dtype, got {target_token_ids.dtype}")
        if target_logprobs.dtype not in core_checks.FLOATS:
            raise TypeError(f"target_logprobs: expected a floating dtype (float16, bfloat16, float32, float64), got "
                            f"{target_logprobs.dtype}")
        k = target_token_ids.shape[-1]
        x = student_hidden_states.reshape(-1, h)
        mask = target_mask.reshape(-1, k) != 0
        check = self.flashkd_options.get("check_teacher")
        if check if check is not None else x.device.type == "cpu":  # as flashkd checks values: on CPU by default
            # at the slots the mask keeps: a negative id would read as flashkd's unused slot (-1), and the
            # log-probs are renormalised below (tail "bucket") before flashkd's own check sees them
            raw, raw_lp = target_token_ids.reshape(-1, k), target_logprobs.reshape(-1, k)
            bad = mask & (raw < 0)
            if bad.any():
                raise ValueError(f"target_token_ids: expected ids >= 0 where target_mask is set, got "
                                 f"{raw[bad][0].item()} in row {int(bad.any(-1).nonzero()[0, 0])}")
            bad = mask & ~(raw_lp <= 0)
            if bad.any():
                raise ValueError(f"target_logprobs: expected log-probabilities <= 0 (not NaN) where target_mask is "
                                 f"set, got {raw_lp[bad][0].item()} in row {int(bad.any(-1).nonzero()[0, 0])}")
        ids = torch.where(mask, target_token_ids.reshape(-1, k).long(), -1)
        wide = torch.float64 if x.dtype == torch.float64 else torch.float32
        lp = torch.where(mask, target_logprobs.reshape(-1, k).to(wide), -torch.inf)
        has = mask.any(-1)
        log_mass = torch.where(has, torch.logsumexp(lp, -1), 0.0)  # log P, 0 on rows without slots
        beta, tau = self.beta, self.temperature
        if beta == 0.0:
            loss, row = "forward_kl", torch.where(has, log_mass.exp(), 0.0)
            const = (row * log_mass).sum()
        else:
            loss, row = ("reverse_kl" if beta == 1.0 else "jsd"), None
            const = -log_mass.sum() if beta == 1.0 else None
        tail = "renormalize" if self.normalize_topk else "bucket"
        if tail == "bucket":  # forward KL only: the teacher renormalised, just past 1 (no rest mass)
            target = lp - log_mass[:, None]
            shift = (-target.max(-1, keepdim=True).values).clamp(0.0, _ABOVE_ONE)
            lp = torch.where(mask, target + shift, 0.0)
        labels = F.pad(true_labels, (0, 1), value=self.ignore_index)[:, 1:].reshape(-1)
        want_ce = self.compute_ce_loss and self.weight_hard_loss > 0.0
        common = dict(loss=loss, tail=tail, beta=beta if loss == "jsd" else None, temperature=tau,
                      temperature_squared=True, ignore_index=self.ignore_index, student_bias=student_bias,
                      reduction="sum", **self.flashkd_options)
        # one call for both terms where the CE's rows hold every soft row and no row weight is needed
        together = want_ce and row is None and not bool((has & (labels == self.ignore_index)).any())
        soft_only = dict(weight_soft_loss=self.weight_soft_loss, weight_hard_loss=0.0)
        if together:
            total = fused_linear_distill_topk(x, lm_head_weight, ids, lp, labels, weight_soft_loss=self.weight_soft_loss,
                                              weight_hard_loss=self.weight_hard_loss, **common)
        else:
            total = fused_linear_distill_topk(x, lm_head_weight, ids, lp, None, row_weight=row, **soft_only,
                                              **common)
            if want_ce:
                total = total + fused_linear_distill_topk(x, lm_head_weight, ids, lp, labels, weight_soft_loss=0.0,
                                                          weight_hard_loss=self.weight_hard_loss, **common)
        if const is not None and self.weight_soft_loss > 0.0:
            total = total + (self.weight_soft_loss * tau * tau) * const.to(total.dtype)
        return total


def _check_version():
    try:
        version = importlib.metadata.version("axolotl")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError("flashkd.integrations.axolotl.patch(): axolotl is not installed "
                          '(pip install "flashkd[axolotl]")')
    if version not in TESTED_AXOLOTL_VERSIONS:
        raise RuntimeError(f"flashkd.integrations.axolotl.patch(): axolotl {version} is installed; this patch is "
                           f"tested with axolotl {', '.join(TESTED_AXOLOTL_VERSIONS)} only (its KD trainer and loss "
                           f"may differ): install one of those, or leave it unpatched")


def patch() -> None:
    """axolotl's KD trainer builds `FusedLinearKLTopKLogprobLoss` where it built Liger's (trainers built
    after this call). Refuses an axolotl version other than TESTED_AXOLOTL_VERSIONS. Idempotent: axolotl's
    class is kept on its modules while patched, for `unpatch()`."""
    _check_version()
    import importlib

    modules = [importlib.import_module(name) for name in (_TRAINER, _KERNEL)]
    if not is_replaced(modules[0], _NAME):
        announce("axolotl's KD trainers built from now on compute their loss with flashkd "
                 "(flashkd.integrations.axolotl.patch; unpatch() undoes it)")
    for module in modules:
        replace(module, _NAME, FusedLinearKLTopKLogprobLoss)


def unpatch() -> None:
    """axolotl's own loss class again, exactly as it was (nothing when not patched)."""
    for name in (_TRAINER, _KERNEL):
        if name in sys.modules:
            restore(sys.modules[name], _NAME)


def is_patched() -> bool:
    return _TRAINER in sys.modules and is_replaced(sys.modules[_TRAINER], _NAME)


def from_liger(module) -> FusedLinearKLTopKLogprobLoss:
    """The flashkd loss with the settings of an axolotl `LigerFusedLinearKLTopKLogprobLoss` instance."""
    return FusedLinearKLTopKLogprobLoss(
        module.weight_hard_loss, module.weight_soft_loss, module.temperature, module.beta,
        ignore_index=module.ignore_index, compiled=module.compiled, chunk_size=module.chunk_size,
        compute_ce_loss=module.compute_ce_loss, normalize_topk=module.normalize_topk,
    )


@functools.cache
def _plugin_class():
    try:
        from axolotl.integrations.base import BasePlugin
    except ImportError as error:
        raise ImportError(f'flashkd.integrations.axolotl.FlashKDPlugin needs axolotl ({error}): pip install '
                          f'"flashkd[axolotl]"') from error

    class FlashKDPlugin(BasePlugin):
        """`plugins: [..., flashkd.integrations.axolotl.FlashKDPlugin]`: patches at registration, and
        swaps the loss of a KD trainer built before it (`post_trainer_create`)."""

        def register(self, cfg):
            patch()

        def post_trainer_create(self, cfg, trainer):
            loss = getattr(trainer, "_kd_loss_fn", None)
            if loss is not None and not isinstance(loss, FusedLinearKLTopKLogprobLoss):
                trainer._kd_loss_fn = from_liger(loss)

    FlashKDPlugin.__module__ = __name__
    return FlashKDPlugin


def __getattr__(name):  # the plugin class needs axolotl: made on first access, not at import
    if name == "FlashKDPlugin":
        return _plugin_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
