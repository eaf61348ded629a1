"""TRL's distillation trainers with flashkd's loss: `patch()` swaps TRL's loss helpers for flashkd's.

Two helpers, each looked up by name in its module on every call:
- `trl.trainer.distillation_trainer._chunked_divergence_loss` (dense teacher: DistillationTrainer)
  becomes `chunked_divergence_loss` below;
- `trl.experimental.async_distillation.async_distillation_trainer._chunked_jsd_loss` (a served
  teacher's top-k log-probs: AsyncDistillationTrainer, on-policy) becomes `chunked_jsd_loss`, the
  top-k form (`fused_linear_distill_topk`); see its docstring for what is the same and what differs.
and two methods:
- `trl.experimental.server_distillation.ServerDistillationTrainer.compute_loss` (a served teacher's
  top-1 / top-k log-probs, computed by TRL from the student's full (B, T, V) logits) becomes
  `server_compute_loss`: the student's backbone only, and the same top-k form on its hidden states.
- `trl.experimental.gold.GOLDTrainer.compute_loss`, with a teacher of another tokenizer
  (`use_uld_loss=True`: ULD and its hybrid mode), becomes `gold_compute_loss`: both models' backbones
  only, and `flashkd.fused_linear_uld` on their hidden states and heads (a chunk of aligned rows'
  logits at a time, where TRL's `ULDLoss` takes both models' full (B, T, V) logits).

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
import sys

import torch

from .. import fp8
from ..core.checks import renamed
from ..cross_vocab import fused_linear_uld, uld_alignment
from ..distill import fused_linear_distill, fused_linear_distill_topk
from . import announce, compute_dtype, full_head, is_replaced, original, per_item, replace, restore

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

# ServerDistillationTrainer: its compute_loss, and the methods of TRL's the patched one calls.
_SERVER_MODULE = "trl.experimental.server_distillation.server_distillation_trainer"
_SERVER_METHODS = ("_compute_prompt_length", "_get_teacher_token_logprobs_from_server", "_get_last_hidden_state")

# GOLDTrainer: its compute_loss, and what of TRL's the patched one reads.
_GOLD_MODULE = "trl.experimental.gold.gold_trainer"
_ULD_ATTRIBUTES = ("crossentropy_weight", "distillation_weight", "student_temperature", "teacher_temperature",
                   "skip_student_eos", "skip_teacher_eos", "use_extended_uld", "token_merge_strategy",
                   "use_hybrid_loss", "hybrid_matched_weight", "hybrid_unmatched_weight", "beta", "_vocab_mapping")

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

    # the rows' shapes before the mask picks them (indexing failed with an IndexError that named nothing)
    for name, x in (("student_hidden_states", student_hidden_states), ("teacher_hidden_states", teacher_hidden_states),
                    ("completion_mask", completion_mask)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if student_hidden_states.dim() < 2:
        raise ValueError(f"student_hidden_states: expected shape (B, K, H), got {tuple(student_hidden_states.shape)}")
    lead = tuple(student_hidden_states.shape[:-1])
    if tuple(teacher_hidden_states.shape[:-1]) != lead:
        raise ValueError(f"teacher_hidden_states: expected leading dims {lead} (those of student_hidden_states), "
                         f"got shape {tuple(teacher_hidden_states.shape)}")
    if tuple(completion_mask.shape) != lead:
        raise ValueError(f"completion_mask: expected shape {lead} (student_hidden_states' leading dims), "
                         f"got {tuple(completion_mask.shape)}")
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
    with maybe_gather_lm_head_ctx(ws, bs), maybe_gather_lm_head_ctx(wt, bt), _named(_DIVERGENCE_NAMES):
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

    What differs: speed and memory, and the gradients' rounding. flashkd's GEMMs take the hidden
    states' dtype (the weight cast to it: a bf16 model's own) and form the logits as their fp32
    accumulator, which is TRL's fp32 product of the same values up to the order of the sums; the loss
    math is fp32 as in TRL. dL/ds is rounded to that dtype for the gradient GEMMs (TRL's are fp32, its
    gradients rounded once at the end). The student's rest mass is taken from the logsumexp of the
    logits off the candidates rather than TRL's 1 − Σ in fp32, which cancels where the candidates hold
    nearly all the mass (fp32 log-probs of a peaked row near 30 carry ~2e-6 of absolute error).
    """
    for name, x in (("target_ids", target_ids), ("valid_candidate_mask", valid_candidate_mask)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    # the mask picks the slots: one of another shape was broadcast over them (a loss TRL does not compute)
    if valid_candidate_mask.dtype != torch.bool:
        raise TypeError(f"valid_candidate_mask: expected dtype torch.bool, got {valid_candidate_mask.dtype}")
    if valid_candidate_mask.shape != target_ids.shape:
        raise ValueError(f"valid_candidate_mask: expected shape {tuple(target_ids.shape)} (that of target_ids), "
                         f"got {tuple(valid_candidate_mask.shape)}")
    dtype = compute_dtype(hidden_valid)
    ws, bs = full_head(lm_head_weight, lm_head_bias, dtype)
    ids = torch.where(valid_candidate_mask, target_ids, -1)  # flashkd's unused slot
    tail = dict(tail="bucket", tail_clamp=TRL_TAIL_CLAMP) if add_tail_bucket else dict(tail="renormalize")
    with _named(_JSD_NAMES):
        loss, stats = fused_linear_distill_topk(
            hidden_valid.to(dtype), ws.to(dtype), ids, teacher_target_logps, None,
            student_bias=None if bs is None else bs.to(dtype),
            loss="jsd", beta=float(beta), temperature=float(temperature), reduction="sum",
            student_logit_scale=float(logit_scale), student_softcap=_cap(final_logit_softcapping),
            return_stats=True, teacher_index=teacher_id_idx,
            num_teachers=None if teacher_id_idx is None else num_teachers, **tail,
        )
    if teacher_id_idx is None:
        per_teacher = loss.new_zeros(3 * num_teachers)
    else:
        per_teacher = stats.per_teacher.reshape(-1)
    return loss, stats.soft_sum, stats.entropy_sum, stats.teacher_entropy_sum, per_teacher


def server_compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """ServerDistillationTrainer.compute_loss, with the student's backbone in place of its whole forward
    and flashkd's top-k form in place of TRL's loss on the (B, T, V) log-softmax.

    The same as TRL's: the batch layout, the teacher server's request (TRL's own method), its checks of
    missing log-probs (ValueError, as TRL), the support (β = 0: the teacher's top-`loss_top_k` ids
    with a finite log-prob; β > 0: the teacher's top-1 and the sampled token, counted once when they
    are one token; β = 1: the sampled token), `loss_add_tail` (TRL's clamped tail bucket, else the
    support renormalised), the temperature on the student's logits, the mean over the completion
    tokens the teacher scored (not `num_items_in_batch`, as TRL), the division by the gradient
    accumulation steps in training. The logits' transform comes from the config as TRL reads it
    (`flashkd.integrations.transformers.head_transform`) where TRL's server path takes the model's own
    logits. `return_outputs=True` (the model's outputs asked for) is TRL's own method."""
    if return_outputs:
        return _own_compute_loss(_SERVER_MODULE, "ServerDistillationTrainer")(self, model, inputs, return_outputs,
                                                                              num_items_in_batch)
    # TRL's layout of the batch, as its compute_loss rebuilds it
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    completion_labels = torch.where(completion_mask.bool(), completion_ids, torch.full_like(completion_ids, -100))
    labels = torch.cat([torch.full_like(prompt_ids, -100), completion_labels], dim=1)
    inputs = {**inputs, "input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
              "prompt_attention_mask": prompt_mask}
    prompt_length = self._compute_prompt_length(inputs)
    teacher = self._get_teacher_token_logprobs_from_server(inputs, prompt_length)
    comp_len = teacher["actual_logprobs"].shape[1]
    labels = labels[:, prompt_length:][:, :comp_len]
    ids, logprobs = _server_support(self, teacher, input_ids[:, prompt_length:][:, :comp_len], labels)
    unwrapped = self.accelerator.unwrap_model(model)
    # inside the student wrapper's forward, as DistillationTrainer's loss: DDP and FSDP hooks fire, FSDP keeps
    # the head gathered for the projection
    loss = self._forward_redirection(model, unwrapped, _server_loss, self, unwrapped, input_ids, attention_mask,
                                     input_ids.shape[1] - prompt_length, comp_len, ids, logprobs, labels)
    if self.model.training:
        loss = loss / self.current_gradient_accumulation_steps
    return loss


def _server_support(trainer, teacher, tokens, labels):
    """(ids, logprobs) (B, T, K) of ServerDistillationTrainer's sparse support, −1 at a slot not in it."""
    top_lp, top_ids, actual_lp = teacher["topk_logprobs"], teacher["topk_token_ids"], teacher["actual_logprobs"]
    required = labels != -100
    if trainer.beta == 0:
        valid = top_lp > float("-inf")
        return torch.where(valid, top_ids, -1), top_lp
    # TRL's checks, word for word (host syncs, as in TRL)
    missing_actual = required & ~torch.isfinite(actual_lp)
    if missing_actual.any():
        raise ValueError(
            "Teacher server is missing actual-token logprobs for required reverse-KL positions: "
            f"{int(missing_actual.sum().item())}/{int(required.sum().item())}."
        )
    if trainer.beta < 1:
        missing_top1 = required & ~torch.isfinite(top_lp[..., 0])
        if missing_top1.any():
            raise ValueError(
                "Teacher server is missing top-1 logprobs for required forward-KL positions: "
                f"{int(missing_top1.sum().item())}/{int(required.sum().item())}."
            )
    if trainer.beta == 1:
        return tokens[..., None], actual_lp[..., None]
    top1 = top_ids[..., 0]
    ids = torch.stack([top1, torch.where(tokens != top1, tokens, -1)], -1)
    return ids, torch.stack([top_lp[..., 0], actual_lp], -1)


def _server_loss(trainer, unwrapped, input_ids, attention_mask, keep, comp_len, ids, logprobs, labels):
    """The student's hidden states at the completion positions the teacher scored, and the top-k form's
    mean over those whose label is not -100."""
    from trl.trainer.utils import maybe_gather_lm_head_ctx

    from .transformers import head_transform

    hidden = trainer._get_last_hidden_state(unwrapped, input_ids, attention_mask, keep)[:, :comp_len]
    head = unwrapped.get_output_embeddings()
    dtype = compute_dtype(hidden)
    ws, bs = full_head(head.weight, head.bias, dtype)
    hidden = hidden.to(ws.device)
    scale, cap = head_transform(unwrapped.config)
    tail = dict(tail="bucket", tail_clamp=TRL_TAIL_CLAMP) if trainer.loss_add_tail else dict(tail="renormalize")
    # an unscored position's -inf log-probs (TRL zeroes them) never reach the loss: its label is -100
    with maybe_gather_lm_head_ctx(ws, bs):
        return fused_linear_distill_topk(
            hidden.to(dtype), ws.to(dtype), ids.to(ws.device), logprobs.to(ws.device), labels.to(ws.device),
            student_bias=None if bs is None else bs.to(dtype), loss="jsd", beta=float(trainer.beta),
            temperature=float(trainer.temperature), weight_hard_loss=0.0, weight_soft_loss=1.0, reduction="mean",
            student_logit_scale=scale, student_softcap=cap, **tail,
        )


def gold_compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """GOLDTrainer.compute_loss with a teacher of another tokenizer (`use_uld_loss=True`), from both
    models' backbones and `flashkd.fused_linear_uld`, in place of their whole forwards and TRL's
    `ULDLoss` on the two (B, T, V) logits.

    The same as TRL's, for every ULDLoss option: the teacher's inputs (TRL's own
    `build_teacher_inputs_from_texts` on the batch's original texts), the answer spans, the byte
    alignment and its merge strategy ("observed" / "bayesian", extended or positional), both
    temperatures, the sorted-L1 ULD loss or the hybrid (JSD at β over the ids TRL's vocabulary mapping
    matches, sorted L1 over the others, TRL's fixed or adaptive weights), the distillation and
    cross-entropy weights, the logged matched / unmatched terms (the batch's last item, as TRL), and
    each model's logit transform (from its config, `head_transform`). What differs: speed and memory,
    the loss math in fp32 where a bf16 model's logits would be (TRL softmaxes them as they come), and a
    batch without any labelled token, whose CE term TRL makes NaN and this 0. Without
    `use_uld_loss` (a teacher of the student's tokenizer), for a vision-language teacher, batches with
    multimodal inputs and `return_outputs=True`, TRL's own method runs."""
    uld = getattr(self, "uld_loss_fn", None)
    if (return_outputs or not self.use_uld_loss or self.teacher_tokenizer is None or uld is None
            or self._teacher_processor is not None or self._get_model_forward_kwargs(inputs)):
        return _own_compute_loss(_GOLD_MODULE, "GOLDTrainer")(self, model, inputs, return_outputs,
                                                              num_items_in_batch)
    from trl.experimental.gold.gold_trainer import build_teacher_inputs_from_texts

    from .transformers import in_forward

    t_ids, t_labels, t_mask, t_offsets = build_teacher_inputs_from_texts(
        self.teacher_tokenizer, inputs["original_prompt_text"], inputs["original_completion_text"],
        use_extended_uld=uld.use_extended_uld)
    device = self.accelerator.device
    t_ids, t_labels, t_mask = t_ids.to(device), t_labels.to(device), t_mask.to(device)
    s_offsets = inputs.get("byte_offsets")
    if uld.use_extended_uld and s_offsets is None:
        raise ValueError("Input batches must include `byte_offsets` when `use_extended_uld=True`.")
    alignment = uld_alignment(
        inputs["labels"], t_labels, inputs["input_ids"], t_ids, s_offsets, t_offsets,
        merge=uld.token_merge_strategy, extended=uld.use_extended_uld, skip_student_eos=uld.skip_student_eos,
        skip_teacher_eos=uld.skip_teacher_eos, weight=float(uld.distillation_weight))
    unwrapped = self.accelerator.unwrap_model(model)
    loss, matched, unmatched = in_forward(model, unwrapped, lambda: _gold_loss(
        self, unwrapped, inputs, t_ids, t_mask, alignment))
    if matched is not None and len(alignment):
        last = alignment.item == alignment.item[-1]  # TRL keeps the terms of the batch's last item
        uld.last_matched_loss = matched[last.to(matched.device)].mean()
        uld.last_unmatched_loss = unmatched[last.to(matched.device)].mean()
    if hasattr(uld, "last_matched_loss") and hasattr(uld, "last_unmatched_loss"):  # TRL's logging, as it is
        step_eq = 1.0 / max(1, int(self.args.gradient_accumulation_steps))
        self._matched_sum += uld.last_matched_loss.item() if uld.last_matched_loss is not None else 0.0
        self._unmatched_sum += uld.last_unmatched_loss.item() if uld.last_unmatched_loss is not None else 0.0
        self._matched_step_eq += step_eq
        self._unmatched_step_eq += step_eq
    return loss


def _gold_loss(trainer, unwrapped, inputs, t_ids, t_mask, alignment):
    """GOLD's ULD loss from the two backbones' hidden states; runs as the student wrapper's forward."""
    from .transformers import backbone, causal_lm, in_forward, zero3_gathered, head_transform

    uld = trainer.uld_loss_fn
    lm = causal_lm(unwrapped, "model")
    hs = backbone(lm, "model")(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                use_cache=False).last_hidden_state
    dtype = compute_dtype(hs)
    t_unwrapped = trainer.accelerator.unwrap_model(trainer.teacher_model)
    teacher = causal_lm(t_unwrapped, "teacher_model")
    trainer.teacher_model.eval()
    with torch.no_grad():
        ht = in_forward(trainer.teacher_model, t_unwrapped, lambda: backbone(teacher, "teacher_model")(
            input_ids=t_ids, attention_mask=t_mask).last_hidden_state)
        dtype = torch.promote_types(dtype, compute_dtype(ht))
    head, t_head = lm.get_output_embeddings(), teacher.get_output_embeddings()
    ws, bs = full_head(head.weight, head.bias, dtype)
    with torch.no_grad():
        wt, bt = full_head(t_head.weight, t_head.bias, dtype)
    s_scale, s_cap = head_transform(lm.config)
    t_scale, t_cap = head_transform(teacher.config)
    matched = None
    if uld.use_hybrid_loss and uld._vocab_mapping is not None:
        matched = getattr(trainer, "_flashkd_matched", None)
        if matched is None:  # TRL's own vocabulary mapping (teacher id -> student id), once per trainer
            pairs = sorted(uld._vocab_mapping.items())
            matched = (torch.tensor([s for _, s in pairs], dtype=torch.int64),
                       torch.tensor([t for t, _ in pairs], dtype=torch.int64))
            trainer._flashkd_matched = matched
        matched = tuple(m.to(ws.device) for m in matched)
    labels = None
    if uld.crossentropy_weight > 0:  # TRL's CE: row t against the label of t + 1
        y = inputs["labels"]
        labels = torch.cat([y[:, 1:], torch.full_like(y[:, :1], -100)], 1)
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    with zero3_gathered(ws, bs, wt, bt):
        loss, matched_parts, unmatched_parts = fused_linear_uld(
            cast(hs), cast(ws), cast(ht).to(hs.device), cast(wt).to(ws.device), alignment.to(ws.device),
            student_bias=cast(bs), teacher_bias=None if bt is None else cast(bt).to(ws.device), student_temperature=float(uld.student_temperature),
            teacher_temperature=float(uld.teacher_temperature), matched=matched,
            matched_weight=uld.hybrid_matched_weight if matched is not None else None,
            unmatched_weight=uld.hybrid_unmatched_weight if matched is not None else None,
            beta=float(uld.beta) if matched is not None else None, labels=labels, ce_weight=float(uld.crossentropy_weight),
            student_logit_scale=s_scale, student_softcap=s_cap, teacher_logit_scale=t_scale, teacher_softcap=t_cap,
            return_parts=True)
    return loss, matched_parts, unmatched_parts


def patch(*, teacher_precision: str | None = None):
    """Make TRL's distillation trainers (DistillationTrainer, AsyncDistillationTrainer,
    ServerDistillationTrainer, and GOLDTrainer with use_uld_loss) compute their loss with flashkd; returns a context manager whose exit
    undoes this call's patch (`with patch(): ...`). Patching twice is a no-op (but for
    teacher_precision, which the latest call sets; as a context, its exit puts back the options it replaced).
    teacher_precision: `fused_linear_distill`'s,
    e.g. "fp8" for an FP8 teacher GEMM (docs/api.md, "FP8 teacher": faster, and not TRL's numbers); it
    applies to DistillationTrainer's teacher head (the on-policy trainers' teachers are served)."""
    fp8.check_precision(teacher_precision)
    module = _check()  # the TRL checks first: a refused patch leaves the options of the last one as they were
    jsd_module = _check_jsd()
    server = _check_server()
    gold = _check_gold()
    before = dict(_options)
    _options.clear()
    if teacher_precision is not None:
        _options["teacher_precision"] = teacher_precision
    if is_replaced(module, _HELPER):
        return _Undo(None, before)
    from trl.extras.profiling import profiling_decorator

    record = replace(module, _HELPER, chunked_divergence_loss)
    replace(jsd_module, _JSD_HELPER, chunked_jsd_loss)
    replace(server, "compute_loss", profiling_decorator(server_compute_loss))  # TRL's timing of the method, kept
    replace(gold, "compute_loss", gold_compute_loss)
    announce("TRL's DistillationTrainer, AsyncDistillationTrainer, ServerDistillationTrainer and GOLDTrainer "
             "(use_uld_loss) compute their loss with flashkd (flashkd.integrations.trl.patch; unpatch() undoes it)")
    return _Undo(record)


def _patched_places():
    """(module or class, attribute) of each place patch() replaces, among the TRL modules imported so far
    (the originals are kept on them: `flashkd.integrations.replace`)."""
    places = [(sys.modules.get(_MODULE), _HELPER), (sys.modules.get(_JSD_MODULE), _JSD_HELPER),
              (getattr(sys.modules.get(_SERVER_MODULE), "ServerDistillationTrainer", None), "compute_loss"),
              (getattr(sys.modules.get(_GOLD_MODULE), "GOLDTrainer", None), "compute_loss")]
    return [(target, name) for target, name in places if target is not None]


def unpatch() -> None:
    """Put TRL's own helpers and methods back, exactly as they were (nothing to do when not patched)."""
    for target, name in _patched_places():
        restore(target, name)


def is_patched() -> bool:
    module = sys.modules.get(_MODULE)
    return module is not None and is_replaced(module, _HELPER)


def _own_compute_loss(module_name, class_name):
    """TRL's own compute_loss of one of its trainers (the saved one while patched)."""
    return original(getattr(sys.modules[module_name], class_name), "compute_loss")


class _Undo(contextlib.AbstractContextManager):
    """Undoes its patch() call's install, if that install is still the one in place: after an unpatch()
    and a later, independent patch(), a stale context's exit leaves the later patch alone. `record`: what
    the install's `replace` returned, which `restore` empties (None: the call installed nothing). options:
    those in place before a call that installed nothing (it only set them), put back at its exit: a nested
    `with patch(teacher_precision="fp8"):` left the outer patch on FP8 after it."""

    def __init__(self, record, options=None):
        self._record = record
        self._options = options

    def __exit__(self, *exc):
        if self._record:
            unpatch()
        elif self._options is not None and is_patched():
            _options.clear()
            _options.update(self._options)


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
    helper = original(module, _HELPER)
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
    helper = original(module, _JSD_HELPER)
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


_COMPUTE_LOSS = ("self", "model", "inputs", "return_outputs", "num_items_in_batch")  # Trainer.compute_loss's parameters


def _compute_loss(module_name, class_name):
    """(module, trainer class, its compute_loss's parameters, the names that method's code uses) of one of TRL's
    experimental trainers, as TRL defines them (its own compute_loss while patched)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*trl.experimental.*")
        module = importlib.import_module(module_name)
    trainer = getattr(module, class_name, None)
    method = None if trainer is None else original(trainer, "compute_loss")
    found = None if method is None else tuple(inspect.signature(method).parameters)
    called = getattr(getattr(inspect.unwrap(method), "__code__", None), "co_names", ()) if method else ()
    return module, trainer, found, called


def _check_server():
    """ServerDistillationTrainer, once its compute_loss and the methods the patched one calls are as tested."""
    _, trainer, found, called = _compute_loss(_SERVER_MODULE, "ServerDistillationTrainer")
    expected = _COMPUTE_LOSS
    missing = [m for m in _SERVER_METHODS if not callable(getattr(trainer, m, None))]
    if found != expected or missing or "_get_teacher_token_logprobs_from_server" not in called:
        raise RuntimeError(
            f"flashkd.integrations.trl.patch: TRL {importlib.metadata.version('trl')}'s "
            f"{_SERVER_MODULE}.ServerDistillationTrainer is not what the patch was written for (tested with TRL "
            f"{', '.join(TESTED_TRL_VERSIONS)}): expected compute_loss{expected} calling "
            f"_get_teacher_token_logprobs_from_server, and methods {', '.join(_SERVER_METHODS)}; got {found}, "
            f"missing {missing}"
        )
    return trainer


def _check_gold():
    """GOLDTrainer, once its compute_loss, ULDLoss's options and the teacher-input builder the patched
    method reads are as tested."""
    module, trainer, found, called = _compute_loss(_GOLD_MODULE, "GOLDTrainer")
    expected = _COMPUTE_LOSS
    uld = getattr(module, "ULDLoss", None)
    init = inspect.getsource(uld.__init__) if uld is not None else ""
    missing = [a for a in _ULD_ATTRIBUTES if f"self.{a} =" not in init]
    builder = getattr(module, "build_teacher_inputs_from_texts", None)
    if (found != expected or "uld_loss_fn" not in called or "build_teacher_inputs_from_texts" not in called
            or missing or builder is None):
        raise RuntimeError(
            f"flashkd.integrations.trl.patch: TRL {importlib.metadata.version('trl')}'s {_GOLD_MODULE}.GOLDTrainer "
            f"is not what the patch was written for (tested with TRL {', '.join(TESTED_TRL_VERSIONS)}): expected "
            f"compute_loss{expected} calling uld_loss_fn and build_teacher_inputs_from_texts, and ULDLoss setting "
            f"{', '.join(_ULD_ATTRIBUTES)}; got {found}, missing {missing}"
        )
    return trainer


# flashkd's arguments, as TRL's helpers name them: an error of the call names what TRL passed
_DIVERGENCE_NAMES = {
    "student_input": "student_hidden_states", "teacher_input": "teacher_hidden_states",
    "student_weight": "student_lm_head_weight", "teacher_weight": "teacher_lm_head_weight",
    "student_bias": "student_lm_head_bias", "teacher_bias": "teacher_lm_head_bias",
    "student_softcap": "student_final_logit_softcapping", "teacher_softcap": "teacher_final_logit_softcapping",
}
_JSD_NAMES = {
    "student_input": "hidden_valid", "student_weight": "lm_head_weight", "student_bias": "lm_head_bias",
    "student_logit_scale": "logit_scale", "student_softcap": "final_logit_softcapping", "teacher_ids": "target_ids",
    "teacher_logprobs": "teacher_target_logps", "teacher_index": "teacher_id_idx",
}


@contextlib.contextmanager
def _named(names: dict):
    """A TypeError / ValueError of the call inside, with its argument renamed by `names`."""
    try:
        yield
    except (TypeError, ValueError) as e:
        raise renamed(e, names) from None


def _cap(softcap):
    return None if softcap is None else float(softcap)
