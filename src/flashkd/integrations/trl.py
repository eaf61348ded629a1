"""TRL's distillation trainers with flashkd's loss: `patch()` swaps TRL's loss helpers for flashkd's.

Two helpers, each looked up by name in its module on every call:
- `trl.trainer.distillation_trainer._chunked_divergence_loss` (dense teacher: DistillationTrainer)
  becomes `chunked_divergence_loss` below;
- `trl.experimental.async_distillation.async_distillation_trainer._chunked_jsd_loss` (a served
  teacher's top-k log-probs: AsyncDistillationTrainer, on-policy) becomes `chunked_jsd_loss`, the
  top-k form (`fused_linear_distill_topk`); see its docstring for what is the same and what differs.
TRL's ServerDistillationTrainer computes its sparse loss inside its `compute_loss` from the model's
full logits and is not affected (README, "On-policy distillation with TRL", says why).

TRL 1.16's `trl.trainer.distillation_trainer.DistillationTrainer` (and any subclass that keeps its
`_compute_loss`) computes its loss in the module-level helper
`_chunked_divergence_loss(student_hidden_states, teacher_hidden_states, student_lm_head_weight,
teacher_lm_head_weight, completion_mask, beta, ...)`, which `_compute_loss` looks up by name in that
module on every call. `patch()` puts `chunked_divergence_loss` below in its place:

    import flashkd.integrations.trl
    flashkd.integrations.trl.patch()            # or: with flashkd.integrations.trl.patch(): trainer.train()
    trainer = DistillationTrainer(...)          # built before or after, it now calls flashkd
    ...
    flashkd.integrations.trl.unpatch()          # TRL's own helper again

What is the same as TRL's helper, for every argument TRL passes:
- the returned triple: the loss (Σ over completion tokens of the per-token divergence, divided by
  `num_items_in_batch`, or by the local token count clamped to ≥ 1 when it is None), the sum of the
  student's per-token entropy at the temperature, and the number of completion tokens (int64);
- β in TRL's convention (0 forward KL(teacher‖student), 1 reverse KL, between: the generalized JSD
  with mixture (1 − β) p_student + β p_teacher), which is flashkd's `loss="jsd"` convention;
- temperature, both logit scales and both final-logit softcaps (scale first, then the cap, then τ),
  both LM-head biases, the completion mask (only its nonzero entries count);
- the gradients, to the student's hidden states, LM-head weight and bias;
- FSDP2: a DTensor head is gathered once with `full_tensor()` and cast to its hidden states' dtype;
  DeepSpeed ZeRO-3: the heads are gathered for the call with TRL's own `maybe_gather_lm_head_ctx`.

What differs: the speed and memory, and the dtype of the GEMMs. flashkd computes the logits in the
inputs' dtype (bf16 in a bf16 run) where TRL's kernel rounds nothing before fp32; its loss math is
fp32 like TRL's. Student and teacher must share a dtype in flashkd: the call runs in the wider of
the two sides' compute dtypes (each side's is the autocast dtype when autocast is on, as in TRL, else
its hidden states' dtype), so a bf16 teacher beside an fp32 student is upcast, exactly.

`patch()` refuses, with an error naming both, a TRL version other than the tested ones
(`TESTED_TRL_VERSIONS`) or a helper whose signature or use differs from what this was written for.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import inspect
import math

import torch

from .. import fp8
from ..distill import fused_linear_distill, fused_linear_distill_topk
from . import compute_dtype, full_head, per_item

TESTED_TRL_VERSIONS = ("1.16.0",)

# TRL's helper, parameter by parameter: the patch takes the same names, in the same order.
_SIGNATURE = (
    "student_hidden_states", "teacher_hidden_states", "student_lm_head_weight", "teacher_lm_head_weight",
    "completion_mask", "beta", "num_items_in_batch", "student_lm_head_bias", "teacher_lm_head_bias",
    "student_logit_scale", "teacher_logit_scale", "student_final_logit_softcapping",
    "teacher_final_logit_softcapping", "temperature",
)
_MODULE = "trl.trainer.distillation_trainer"
_HELPER = "_chunked_divergence_loss"

# AsyncDistillationTrainer's top-k helper, likewise.
_JSD_SIGNATURE = (
    "hidden_valid", "lm_head_weight", "lm_head_bias", "logit_scale", "final_logit_softcapping", "target_ids",
    "teacher_target_logps", "valid_candidate_mask", "beta", "temperature", "add_tail_bucket", "teacher_id_idx",
    "num_teachers", "chunk_size",
)
_JSD_MODULE = "trl.experimental.async_distillation.async_distillation_trainer"
_JSD_HELPER = "_chunked_jsd_loss"
# TRL's `_add_tail_bucket` clamps the log of the ids' summed probability at -1e-7 (checked by `_check_jsd`).
TRL_TAIL_CLAMP = 1e-7

_original = None  # TRL's helper while patched
_original_jsd = None  # TRL's top-k helper while patched
_options: dict = {}  # fused_linear_distill keywords the patch was given


def chunked_divergence_loss(
    student_hidden_states: torch.Tensor,  # (B, K, Hs)
    teacher_hidden_states: torch.Tensor,  # (B, K, Ht)
    student_lm_head_weight: torch.Tensor,  # (V, Hs)
    teacher_lm_head_weight: torch.Tensor,  # (V, Ht)
    completion_mask: torch.Tensor,  # (B, K), nonzero where the token counts
    beta: float,
    num_items_in_batch: torch.Tensor | int | None = None,
    student_lm_head_bias: torch.Tensor | None = None,
    teacher_lm_head_bias: torch.Tensor | None = None,
    student_logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    student_final_logit_softcapping: float | None = None,
    teacher_final_logit_softcapping: float | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's `_chunked_divergence_loss`, computed by flashkd: (loss, entropy sum, token count)."""
    from trl.trainer.utils import maybe_gather_lm_head_ctx

    ws, bs = full_head(student_lm_head_weight, student_lm_head_bias, student_hidden_states.dtype)
    with torch.no_grad():  # the teacher is a constant (TRL's kernel gives it no gradient either)
        wt, bt = full_head(teacher_lm_head_weight, teacher_lm_head_bias, teacher_hidden_states.dtype)
    dtype = torch.promote_types(compute_dtype(student_hidden_states), compute_dtype(teacher_hidden_states))
    valid = completion_mask.reshape(-1) != 0
    n_valid = valid.sum()
    # Only the completion tokens go in (a host sync on GPU, as in TRL's Triton path): masked rows
    # would cost their GEMMs for nothing.
    xs = student_hidden_states.reshape(-1, student_hidden_states.shape[-1])[valid]
    xt = teacher_hidden_states.reshape(-1, teacher_hidden_states.shape[-1])[valid]
    with maybe_gather_lm_head_ctx(ws, bs), maybe_gather_lm_head_ctx(wt, bt):
        loss, stats = fused_linear_distill(
            xs.to(dtype), ws.to(dtype), xt.to(dtype), wt.to(dtype), None,
            student_bias=None if bs is None else bs.to(dtype),
            teacher_bias=None if bt is None else bt.to(dtype),
            loss="jsd", beta=float(beta), temperature=float(temperature),
            weight_hard_loss=0.0, weight_soft_loss=1.0, reduction="sum",
            student_logit_scale=float(student_logit_scale), teacher_logit_scale=float(teacher_logit_scale),
            student_softcap=_cap(student_final_logit_softcapping),
            teacher_softcap=_cap(teacher_final_logit_softcapping),
            return_stats=True, **_options,
        )
    return per_item(loss, n_valid, num_items_in_batch), stats.entropy_sum, n_valid


def chunked_jsd_loss(
    hidden_valid: torch.Tensor,  # (N, H) the student's hidden states at the positions with teacher signal
    lm_head_weight: torch.Tensor,  # (V, H)
    lm_head_bias: torch.Tensor | None,  # (V,)
    logit_scale: float,
    final_logit_softcapping: float | None,
    target_ids: torch.Tensor,  # (N, K) candidate ids (any value where valid_candidate_mask is False)
    teacher_target_logps: torch.Tensor,  # (N, K) the teacher's log-probs at them
    valid_candidate_mask: torch.Tensor,  # (N, K) bool, True where a slot is a candidate
    beta: float,
    temperature: float,
    add_tail_bucket: bool,
    teacher_id_idx: torch.Tensor | None,  # (N,) each row's teacher, or None with one teacher
    num_teachers: int,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's `_chunked_jsd_loss`, computed by flashkd's top-k form: (loss, jsd sum, student entropy
    sum, teacher entropy sum, per-teacher stats (3 · num_teachers,)).

    The same as TRL's helper, for every argument TRL passes: the loss summed over the rows (not
    divided: the trainer divides), TRL's generalized JSD over the candidates (β = 0 forward KL, 1
    reverse KL, between: mixture (1 − β) q + β p), the tail bucket of `_add_tail_bucket` (each side's
    rest 1 − Σ with the log of the sum clamped at −1e-7, nothing renormalised: flashkd's
    `tail_clamp`) or without it the candidates renormalised, masked candidate slots, rows without any
    candidate (loss 0; counted in the statistics), logit scale then softcap then temperature on the
    student's logits, the bias; the student's entropy over the whole vocab, the teacher's over the
    support (the candidates and the bucket), and per teacher (count, JSD sum, teacher entropy sum);
    gradients to the hidden states, the head's weight and bias. `chunk_size` is not used (flashkd
    plans its own chunks).

    What differs: speed and memory, and the GEMM's dtype: flashkd computes the logits in the hidden
    states' dtype (the weight cast to it; bf16 in a bf16 model) where TRL's rounds nothing before
    fp32; the loss math is fp32 as in TRL. The student's rest mass is taken from the logsumexp of the
    logits off the candidates rather than TRL's 1 − Σ in fp32, which cancels where the candidates hold
    nearly all the mass (fp32 log-probs of a peaked row near 30 carry ~2e-6 of absolute error).
    """
    dtype = compute_dtype(hidden_valid)
    ws, bs = full_head(lm_head_weight, lm_head_bias, dtype)
    ids = torch.where(valid_candidate_mask, target_ids, -1)  # flashkd's unused slot
    tail = dict(tail="bucket", tail_clamp=TRL_TAIL_CLAMP) if add_tail_bucket else dict(tail="renormalize")
    loss, stats = fused_linear_distill_topk(
        hidden_valid.to(dtype), ws.to(dtype), ids, teacher_target_logps, None,
        student_bias=None if bs is None else bs.to(dtype),
        loss="jsd", beta=float(beta), temperature=float(temperature), reduction="sum",
        student_logit_scale=float(logit_scale), student_softcap=_cap(final_logit_softcapping),
        return_stats=True, teacher_index=teacher_id_idx, num_teachers=None if teacher_id_idx is None else num_teachers,
        **tail,
    )
    if teacher_id_idx is None:
        per_teacher = loss.new_zeros(3 * num_teachers)
    else:
        per_teacher = stats.per_teacher.reshape(-1)
    return loss, stats.soft_sum, stats.entropy_sum, stats.teacher_entropy_sum, per_teacher


def patch(*, teacher_precision: str | None = None):
    """Make TRL's distillation trainers compute their loss with flashkd; returns a context manager
    whose exit undoes this call's patch (`with patch(): ...`). Patching twice is a no-op (but for
    teacher_precision, which the latest call sets). teacher_precision: `fused_linear_distill`'s,
    e.g. "fp8" for an FP8 teacher GEMM (README, "FP8 teacher": faster, and not TRL's numbers)."""
    global _original
    fp8.check_precision(teacher_precision)
    _options.clear()
    if teacher_precision is not None:
        _options["teacher_precision"] = teacher_precision
    module = _check()
    jsd_module = _check_jsd()
    installed = _original is None
    if installed:
        global _original_jsd
        _original = getattr(module, _HELPER)
        _original_jsd = getattr(jsd_module, _JSD_HELPER)
        setattr(module, _HELPER, chunked_divergence_loss)
        setattr(jsd_module, _JSD_HELPER, chunked_jsd_loss)
    return _Undo(installed)


def unpatch() -> None:
    """Put TRL's own helpers back (nothing to do when not patched)."""
    global _original, _original_jsd
    if _original is not None:
        import sys

        setattr(sys.modules[_MODULE], _HELPER, _original)
        setattr(sys.modules[_JSD_MODULE], _JSD_HELPER, _original_jsd)
        _original = _original_jsd = None


def is_patched() -> bool:
    return _original is not None


class _Undo(contextlib.AbstractContextManager):
    def __init__(self, installed: bool):
        self._installed = installed

    def __exit__(self, *exc):
        if self._installed:
            unpatch()


def _check():
    """TRL's module, once its version, helper and the helper's one caller are as tested."""
    try:
        version = importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError("flashkd.integrations.trl: TRL is not installed; pip install \"flashkd[trl]\"") from None
    tested = ", ".join(TESTED_TRL_VERSIONS)
    if version not in TESTED_TRL_VERSIONS:
        raise RuntimeError(
            f"flashkd.integrations.trl.patch: installed TRL is {version}, the patch is tested with TRL {tested} "
            f"only (its loss helper is private and may change); install trl=={TESTED_TRL_VERSIONS[-1]}"
        )
    module = importlib.import_module(_MODULE)
    helper = getattr(module, _HELPER, None) if _original is None else _original
    trainer = getattr(module, "DistillationTrainer", None)
    found = None if helper is None else tuple(inspect.signature(helper).parameters)
    caller = getattr(getattr(trainer, "_compute_loss", None), "__code__", None)
    if found != _SIGNATURE or caller is None or _HELPER not in caller.co_names:
        raise RuntimeError(
            f"flashkd.integrations.trl.patch: TRL {version}'s {_MODULE}.{_HELPER} is not what the patch was "
            f"written for (tested with TRL {tested}): expected a helper taking ({', '.join(_SIGNATURE)}) and "
            f"called by DistillationTrainer._compute_loss, got {found}"
        )
    return module


def _check_jsd():
    """AsyncDistillationTrainer's module, once its top-k helper, that helper's caller and the tail
    bucket's clamp are as tested (the version was checked by `_check`)."""
    import warnings

    with warnings.catch_warnings():  # TRL warns on importing trl.experimental: flashkd imports it, not the user
        warnings.filterwarnings("ignore", message=".*trl.experimental.*")
        module = importlib.import_module(_JSD_MODULE)
    helper = getattr(module, _JSD_HELPER, None) if _original_jsd is None else _original_jsd
    trainer = getattr(module, "AsyncDistillationTrainer", None)
    found = None if helper is None else tuple(inspect.signature(helper).parameters)
    caller = getattr(getattr(trainer, "_compute_loss", None), "__code__", None)
    clamp = None
    bucket = getattr(module, "_add_tail_bucket", None)
    if bucket is not None:  # where the log of a sum of 1 lands: −ε, its tail log(1 − e^−ε)
        tail = bucket(torch.zeros(1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.bool))[0][0, 1].item()
        clamp = -math.log1p(-math.exp(tail))
    if (found != _JSD_SIGNATURE or caller is None or _JSD_HELPER not in caller.co_names
            or clamp is None or abs(clamp - TRL_TAIL_CLAMP) > 1e-6 * TRL_TAIL_CLAMP):
        raise RuntimeError(
            f"flashkd.integrations.trl.patch: TRL {importlib.metadata.version('trl')}'s {_JSD_MODULE}.{_JSD_HELPER} "
            f"is not what the patch was written for (tested with TRL {', '.join(TESTED_TRL_VERSIONS)}): expected a "
            f"helper taking ({', '.join(_JSD_SIGNATURE)}), called by AsyncDistillationTrainer._compute_loss, and "
            f"_add_tail_bucket clamping at -{TRL_TAIL_CLAMP:g}; got {found}, clamp {clamp}"
        )
    return module


def _cap(softcap):
    return None if softcap is None else float(softcap)
