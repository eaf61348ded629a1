"""Distillation in a Hugging Face `transformers.Trainer`, with flashkd's fused loss.

    from flashkd.integrations.transformers import DistillationTrainer

    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=TrainingArguments(...),
                                  train_dataset=..., data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
                                  loss="jsd", beta=0.5, temperature=1.0, weight_hard_loss=0.5, weight_soft_loss=0.5)
    trainer.train()

`DistillationLossMixin` is the same `compute_loss` for any other Trainer subclass (put it first:
`class MyTrainer(DistillationLossMixin, SomeTrainer)`); `DistillationTrainer` is the mixin on
`transformers.Trainer`.

The teacher is either
- a live model, `teacher_model=` (a causal LM with the student's tokenizer; its vocab may be a padded
  superset of the student's): `flashkd.fused_linear_distill` on both models' last hidden states; or
- top-k targets in the batch, `teacher_ids` / `teacher_logprobs` (B, T, K) as `flashkd.TopKCollator`
  puts them there (from `flashkd.data` targets on disk; keep its key column with
  `remove_unused_columns=False`): `flashkd.fused_linear_distill_topk`. Their temperature must be the
  one you distill at (see that function).

What one step computes, per batch (B, T):
- the student's backbone (`model.base_model`, not the LM head: no (B, T, V) logits) gives hidden
  states h (B, T, H); the teacher's likewise under `torch.no_grad()`;
- row t predicts token t + 1: the loss takes h[:, :-1] against labels[:, 1:] (the batch's `labels`,
  else its `input_ids`), and a row does not count (neither term, no gradient) where that label is
  -100, where `attention_mask` is 0 at t + 1 (padding), or, with top-k targets, where row t has no
  teacher id;
- loss = Σ over counted rows of (w_hard · CE + w_soft · soft), divided by `num_items_in_batch` when
  the Trainer passes it (the counted labels of the whole accumulated batch, across processes: exact
  under gradient accumulation; keep padding at -100 in `labels`, as HF's collators do, so that its
  count and these rows agree) and multiplied by the number of processes as `Trainer.compute_loss`
  does, else by the batch's own count of counted rows;
- each model's logit transform comes from its config as TRL 1.16 reads it (`head_transform`);
- mixed precision: the backbones run under the accelerator's autocast; the loss runs in one dtype,
  the wider of the two sides' compute dtypes (autocast's when on), with fp32 loss math; an fp32
  master head is cast for the call and its gradient flows back in fp32;
- sharded heads: an FSDP2 DTensor head is gathered once with `full_tensor()`; under DeepSpeed ZeRO-3
  the heads are gathered (`deepspeed.zero.GatheredParameters`) for the call; the whole loss runs inside
  the student wrapper's forward (DDP / FSDP / DeepSpeed hooks fire as for a plain forward). The
  teacher is placed on the device here; under FSDP or DeepSpeed, prepare (shard) it yourself.

flashkd's remaining keywords (`chunk_size`, `backend`, `tail`, `temperature_squared`,
`grad_accum_dtype`, ...) go in `distill_options`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch

try:
    import transformers
except ModuleNotFoundError as e:  # only transformers itself missing gets the hint; a broken install raises as it is
    if e.name != "transformers":
        raise
    raise ImportError('flashkd.integrations.transformers needs transformers (and accelerate, which its Trainer '
                      'uses): pip install "flashkd[hf]"', name="transformers") from None

from ..core.checks import check_teacher_vocab, check_vocab_size
from ..distill import KEYWORDS, check_options, fused_linear_distill, fused_linear_distill_topk
from . import compute_dtype, full_head, per_item

IGNORE_INDEX = -100  # HF's label for "no loss here"
# Keywords the trainer sets itself; they cannot come through distill_options.
_OWN = {"ignore_index", "reduction", "student_bias", "teacher_bias", "return_soft_hard_loss", "return_stats",
        "student_logit_scale", "teacher_logit_scale", "student_softcap", "teacher_softcap", "row_weight"}

# What distill_options may hold: the keyword options of either loss (a live teacher, or top-k targets).
_KEYWORDS = frozenset(KEYWORDS["fused_linear_distill"]) | frozenset(KEYWORDS["fused_linear_distill_topk"])


def head_transform(config) -> tuple[float, float | None]:
    """(logit scale, final-logit softcap) of a model, from its (text) config, as TRL 1.16 reads them.

    Scale: `logit_scale` (Cohere), else `output_multiplier`, else `lm_head_multiplier` (Falcon-H1),
    else 1 / `logits_scaling` (Granite, MiniCPM3; times it for HyperCLOVA X), else 1. An attribute
    set to None counts as absent. Softcap: `final_logit_softcapping` (Gemma 2/3) or None.
    """
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    scale = None
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        scale = getattr(config, name, None)
        if scale is not None:
            break
    scaling = getattr(config, "logits_scaling", None)
    if scale is None and scaling is not None:
        scale = scaling if getattr(config, "model_type", None) == "hyperclovax" else 1 / scaling
    softcap = getattr(config, "final_logit_softcapping", None)
    return float(1.0 if scale is None else scale), None if softcap is None else float(softcap)


class DistillationLossMixin:
    """`compute_loss` of knowledge distillation for a `transformers.Trainer` subclass (see the module doc).

    teacher_model: a causal LM, or None to distil from the batch's `teacher_ids` / `teacher_logprobs`.
    loss, beta, temperature, weight_hard_loss, weight_soft_loss: flashkd's; None keeps the default
    of the form used (a live teacher: "jsd", 0.5 / 0.5; top-k targets: "forward_kl", 0 / 1).
    distill_options: any other keyword of `fused_linear_distill` / `fused_linear_distill_topk`.
    """

    def __init__(self, *args, teacher_model=None, loss: str | None = None, beta: float | None = None,
                 temperature: float | None = None, weight_hard_loss: float | None = None,
                 weight_soft_loss: float | None = None, distill_options: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if teacher_model is not None and not isinstance(teacher_model, torch.nn.Module):
            raise TypeError(f"teacher_model: expected a torch.nn.Module (a causal LM) or None, got {type(teacher_model).__name__}")
        if distill_options is not None and not isinstance(distill_options, Mapping):
            raise TypeError(f"distill_options: expected a dict of keyword options or None, got "
                            f"{type(distill_options).__name__}")
        options = dict(distill_options or {})
        own = sorted(_OWN.intersection(options))
        if own:
            raise ValueError(f"distill_options: {', '.join(own)} are set by the trainer itself, got them in {options!r}")
        unknown = sorted(set(options) - _KEYWORDS)  # a misspelt option fails here, not at the first step
        if unknown:
            raise TypeError(f"distill_options: expected keyword options of flashkd.fused_linear_distill or "
                            f"fused_linear_distill_topk, got {', '.join(map(repr, unknown))} in {options!r}")
        given = dict(loss=loss, beta=beta, temperature=temperature, weight_hard_loss=weight_hard_loss,
                     weight_soft_loss=weight_soft_loss)
        twice = [k for k, v in given.items() if v is not None and k in options]  # one would be dropped unseen
        if twice:
            k = twice[0]
            raise TypeError(f"{k}: expected once, as a keyword or in distill_options, got {k}={given[k]!r} and "
                            f"distill_options[{k!r}]={options[k]!r}")
        self.distill_options = {**options, **{k: v for k, v in given.items() if v is not None}}
        # What the first step would refuse, refused here: the options by the call's own parse, the heads' vocabs
        function = "fused_linear_distill" if teacher_model is not None else "fused_linear_distill_topk"
        wrong = sorted(set(options) - set(KEYWORDS[function]))
        if wrong:
            what = "is not a keyword option" if len(wrong) == 1 else "are not keyword options"
            raise TypeError(f"distill_options: {', '.join(map(repr, wrong))} {what} of flashkd.{function} (the loss "
                            f"of a {'live teacher' if teacher_model is not None else 'top-k teacher'})")
        check_options(self.distill_options, function)
        if teacher_model is not None:
            _check_heads(self.model, teacher_model, self.distill_options.get("vocab_size"))
        if teacher_model is not None:
            teacher_model.eval()
            if not (self.is_deepspeed_enabled or self.is_fsdp_enabled):
                teacher_model.to(self.args.device)
        self.teacher_model = teacher_model
        # The loss is normalised by num_items_in_batch; the Trainer counts it only for models that
        # "accept loss kwargs", and then leaves the loss unscaled by the accumulation steps.
        self.model_accepts_loss_kwargs = True

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        labels = inputs.pop("labels", None)
        ids, logprobs = inputs.pop("teacher_ids", None), inputs.pop("teacher_logprobs", None)
        if (ids is None) != (logprobs is None):
            raise ValueError("inputs: expected both teacher_ids and teacher_logprobs (top-k targets) or neither, "
                             f"got only {'teacher_ids' if logprobs is None else 'teacher_logprobs'}")
        if ids is None and self.teacher_model is None:
            raise ValueError("teacher_model: expected a model, or top-k targets (teacher_ids, teacher_logprobs) in "
                             "every batch (flashkd.TopKCollator), got neither")
        y = _shifted_labels(inputs, labels, ids, logprobs)
        student = self.accelerator.unwrap_model(model)
        loss, count = in_forward(model, student, lambda: self._loss(student, inputs, y, ids, logprobs))
        loss = per_item(loss, count, num_items_in_batch)
        if num_items_in_batch is not None and self.args.average_tokens_across_devices:
            # num_items_in_batch counts every process's rows, and DDP averages the gradients.
            loss = loss * self.accelerator.num_processes
        return (loss, {"loss": loss}) if return_outputs else loss

    def _loss(self, student, inputs, y, ids, logprobs):
        """Σ loss over the counted rows and their count; runs as the student wrapper's forward."""
        lm = causal_lm(student, "model")
        with self.accelerator.autocast():
            hs = backbone(lm, "model")(**inputs, use_cache=False).last_hidden_state[:, :-1]
            dtype = compute_dtype(hs)  # autocast's: the final norm may well return fp32
        head = lm.get_output_embeddings()
        ws, bs = full_head(head.weight, head.bias, hs.dtype)
        scale, cap = head_transform(lm.config)
        transform = dict(student_logit_scale=scale, student_softcap=cap)
        if ids is None:
            unwrapped = self.accelerator.unwrap_model(self.teacher_model)
            teacher = causal_lm(unwrapped, "teacher_model")
            teacher.eval()
            with torch.no_grad(), self.accelerator.autocast():
                ht = in_forward(self.teacher_model, unwrapped,
                                 lambda: backbone(teacher, "teacher_model")(**inputs, use_cache=False).last_hidden_state)
                dtype = torch.promote_types(dtype, compute_dtype(ht))
            ht = ht[:, :-1]
            t_head = teacher.get_output_embeddings()
            with torch.no_grad():  # the teacher is a constant: no graph through its gathered head
                wt, bt = full_head(t_head.weight, t_head.bias, ht.dtype)
            t_scale, t_cap = head_transform(teacher.config)
            transform.update(teacher_logit_scale=t_scale, teacher_softcap=t_cap)
            params = (ws, bs, wt, bt)
        else:
            params = (ws, bs)
        y = y.to(hs.device)
        cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
        with zero3_gathered(*params):
            if ids is None:
                loss = fused_linear_distill(cast(hs), cast(ws), cast(ht), cast(wt), y, student_bias=cast(bs),
                                            teacher_bias=cast(bt), reduction="sum", **transform,
                                            **self.distill_options)
            else:
                loss = fused_linear_distill_topk(cast(hs), cast(ws), ids[:, :-1].to(hs.device),
                                                 logprobs[:, :-1].to(hs.device), y, student_bias=cast(bs),
                                                 reduction="sum", **transform, **self.distill_options)
        return loss, (y != IGNORE_INDEX).sum()


class DistillationTrainer(DistillationLossMixin, transformers.Trainer):
    """`transformers.Trainer` that distils `teacher_model` (or the batch's top-k targets) into `model`
    with flashkd's fused loss; keywords as `DistillationLossMixin`'s, then the Trainer's own."""


def _check_heads(model, teacher_model, vocab_size):
    """The two LM heads' vocabs, as the loss will check them (under ZeRO-3 a parameter's full shape is its
    ds_shape)."""
    rows = []
    for module, name in ((model, "model"), (teacher_model, "teacher_model")):
        weight = causal_lm(module, name).get_output_embeddings().weight
        rows.append(tuple(getattr(weight, "ds_shape", None) or weight.shape)[0])
    v, vt = rows
    keyword = 'distill_options={{"vocab_size": {v}}}'
    check_teacher_vocab("teacher_model", vt, v, vocab_size, "LM-head rows", keyword)
    check_vocab_size(vocab_size, v)


def _shifted_labels(inputs, labels, ids, logprobs=None):
    """labels[:, 1:], -100 where the next token is padding or, with top-k targets, the row has none."""
    input_ids = inputs.get("input_ids")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"inputs: expected input_ids of shape (batch, length), got {got}")
    mask = inputs.get("attention_mask")
    # the batch's other tensors, as the batch holds them: a mask of another shape was broadcast (or failed in
    # masked_fill), top-k log-probs of another shape were reported at the shapes shifted by one
    for name, x in (("labels", labels), ("attention_mask", mask), ("teacher_ids", ids), ("teacher_logprobs", logprobs)):
        if x is not None and not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    labels = input_ids if labels is None else labels
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels: expected shape {tuple(input_ids.shape)} (that of input_ids), got {tuple(labels.shape)}")
    if mask is not None and mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask: expected shape {tuple(input_ids.shape)} (that of input_ids), "
                         f"got {tuple(mask.shape)}")
    y = labels[:, 1:]
    if mask is not None:
        y = y.masked_fill(mask[:, 1:] == 0, IGNORE_INDEX)
    if ids is not None:
        if ids.dim() != 3 or ids.shape[:2] != input_ids.shape:
            raise ValueError(f"teacher_ids: expected shape ({', '.join(map(str, input_ids.shape))}, K), got {tuple(ids.shape)}")
        if logprobs is not None and logprobs.shape != ids.shape:
            raise ValueError(f"teacher_logprobs: expected shape {tuple(ids.shape)} (that of teacher_ids), "
                             f"got {tuple(logprobs.shape)}")
        y = y.masked_fill(~(ids[:, :-1] >= 0).any(-1).to(y.device), IGNORE_INDEX)
    return y


def causal_lm(module, name):
    """The causal LM itself: under PEFT the base model, whose layers carry the adapters."""
    if hasattr(module, "get_base_model"):
        module = module.get_base_model()
    if not hasattr(module, "get_output_embeddings") or module.get_output_embeddings() is None:
        raise TypeError(f"{name}: expected a causal LM with an output embedding (LM head), got {type(module).__name__}")
    return module


def backbone(lm, name):
    base = lm.base_model
    if base is lm:
        raise TypeError(f"{name}: expected a model whose base_model is its backbone without the LM head, "
                        f"got {type(lm).__name__} (base_model_prefix {lm.base_model_prefix!r})")
    return base


def in_forward(wrapper, module, fn):
    """fn(), run as `module`'s forward called through `wrapper` (DDP, FSDP, a DeepSpeed engine, or
    module itself): their forward hooks fire (gradient sync, parameter gathering) as for a forward."""
    had = "forward" in module.__dict__
    original = module.forward

    def restore():
        if had:
            module.forward = original
        else:
            module.__dict__.pop("forward", None)

    def forward(*_args, **_kwargs):
        restore()  # fn may call the real forward
        return fn()

    module.forward = forward
    try:
        return wrapper()
    finally:
        restore()


def zero3_gathered(*params):
    """Under DeepSpeed ZeRO-3 the heads' parameters, gathered for the loss (their module is not called)."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        return contextlib.nullcontext()
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    # Already gathered (e.g. a head tied to the input embedding, in use): leave them to their owner.
    todo = [p for p in params if p is not None and getattr(p, "ds_status", None) == ZeroParamStatus.NOT_AVAILABLE]
    return deepspeed.zero.GatheredParameters(todo, modifier_rank=None) if todo else contextlib.nullcontext()
