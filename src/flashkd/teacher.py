"""teacher_topk's core: a teacher's top-k log-probs, one chunk of logits at a time (for offline targets).

`flashkd.teacher_topk` (in flashkd.distill) makes a TopKCall of its keywords (`parse`) and runs it here, or on a
vocab slice through `flashkd.distributed`, which passes `run` its `shard`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch

from . import chunks, fp8
from .losses import LossSpec, check_logit_transform, logit_transform


@dataclasses.dataclass(frozen=True)
class TopKCall:
    """One call of `flashkd.teacher_topk`, made by `parse` (see its docstring for the keywords)."""

    sharded_by: ClassVar[str] = "teacher_weight"  # the head whose rows are a rank's vocab slice (FSDP)
    teacher: chunks.Heads
    k: int
    temperature: float = 1.0
    vocab_size: int | None = None
    teacher_logit_scale: float = 1.0
    teacher_softcap: float | None = None
    options: chunks.Options = chunks.Options()  # chunk_size, backend, teacher_precision

    @property
    def parts(self) -> tuple:
        """The groups that hold the call's tensors."""
        return (self.teacher,)


def parse(teacher: chunks.Heads, k, *, temperature, vocab_size, teacher_logit_scale, teacher_softcap, chunk_size,
          backend, teacher_precision) -> TopKCall:
    """The TopKCall of `flashkd.teacher_topk`'s keywords, checked where they need no tensor (k and
    vocab_size are checked against the vocab by `run`)."""
    LossSpec(temperature=temperature)  # the losses' rule: a finite float > 0 (inf would give uniform log-probs)
    check_logit_transform("teacher_logit_scale", teacher_logit_scale, "teacher_softcap", teacher_softcap)
    chunks.check_backend(backend)
    chunks.check_chunk_size(chunk_size)
    fp8.check_precision(teacher_precision)
    options = chunks.Options(chunk_size=chunk_size, backend=backend, teacher_precision=teacher_precision)
    return TopKCall(teacher, k, temperature, vocab_size, teacher_logit_scale, teacher_softcap, options)


@torch.no_grad()
def run(call: TopKCall, shard=None):
    """`flashkd.teacher_topk` of a call without DTensors. shard(V_r, device, failed, rows): a vocab
    slice's ShardedVocab (`flashkd.distributed`), called once the local tensors are checked (failed:
    the exception a check raised, which it raises on every rank; rows: this rank's row count); None:
    the whole vocab is here."""
    x, w, b, k = call.teacher.teacher_input, call.teacher.teacher_weight, call.teacher.teacher_bias, call.k
    temperature, vocab_size, teacher_precision = call.temperature, call.vocab_size, call.options.teacher_precision
    teacher_logit_scale, teacher_softcap = call.teacher_logit_scale, call.teacher_softcap
    chunk_size, backend = call.options.chunk_size, call.options.backend
    failed = None
    try:  # vocab-parallel: a check that fails on this rank alone fails on every rank, in `shard`
        chunks.check_tensors({"teacher_input": x})
        if x.dtype not in chunks.FLOATS:
            raise TypeError(f"teacher_input: expected a floating dtype (float16, bfloat16, float32, float64), got {x.dtype}")
        chunks.check_tensors({"teacher_weight": w, "teacher_bias": b}, x.dtype, x.device, like="teacher_input")
        if w.dim() != 2 or 0 in w.shape:  # an empty vocab or hidden size has no distribution
            raise ValueError(f"teacher_weight: expected a 2-D (vocab, hidden) tensor, both >= 1, got shape {tuple(w.shape)}")
        if x.dim() < 1 or x.shape[-1] != w.shape[1]:
            raise ValueError(
                f"teacher_input: expected shape (..., {w.shape[1]}) (teacher_weight is {tuple(w.shape)}), got {tuple(x.shape)}"
            )
        if b is not None and b.shape != (w.shape[0],):
            raise ValueError(f"teacher_bias: expected shape ({w.shape[0]},), got {tuple(b.shape)}")
        if shard is not None:  # what the checks after the exchange read that can differ from rank to rank
            chunks.pick_backend(backend, x)
            if fp8.scaling_of(teacher_precision, x.device) is not None:
                fp8.check_dtype(x.dtype)
    except Exception as e:  # noqa: BLE001 (raised again as it came)
        if shard is None:
            raise
        failed = e
    v = 0 if failed is not None else w.shape[0]
    vocab = None
    if shard is not None:
        vocab = shard(v, x.device if failed is None else None, failed,
                      0 if failed is not None else math.prod(x.shape[:-1]))
        v = vocab.total  # ids and vocab_size are the whole vocab's
    if vocab_size is not None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 1 <= vocab_size <= v:
            raise ValueError(f"vocab_size: expected an int in [1, {v}] (teacher_weight's vocab), got {vocab_size!r}")
        v = vocab_size
        keep = v if vocab is None else max(0, min(w.shape[0], v - vocab.start))  # this slice's ids < vocab_size
        w, b = w[:keep], None if b is None else b[:keep]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= v:
        raise ValueError(f"k: expected an int in [1, {v}] (the vocab size), got {k!r}")
    backend = chunks.pick_backend(backend, x)

    scaling = fp8.scaling_of(teacher_precision, x.device)
    if scaling is not None:
        fp8.check_dtype(x.dtype)
        w = fp8.head(w, scaling)
    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])
    n = x.shape[0]
    plan = backend
    if vocab is not None:  # every rank plans the same chunks (backend and k are agreed between the ranks)
        v = vocab.plan_size
        if plan == "triton":
            from .backends import triton_topk

            if k > triton_topk.TOPK_MAX_K:  # past the top-k kernel's k the torch path's temporaries make the candidates
                plan = "torch"
    transformed = teacher_logit_scale != 1.0 or teacher_softcap is not None
    per_row = v * chunks.logit_size(x.dtype) + (v * 4 * (3 if transformed else 2) if plan == "torch" else 0)
    chunk = chunk_size or chunks.even_chunks(n, chunks.LOGITS_BUDGET[plan] // per_row)
    work = torch.promote_types(x.dtype, torch.float32)
    ids = torch.empty(n, k, dtype=torch.int64, device=x.device)
    logprobs = torch.empty(n, k, dtype=work, device=x.device)
    for start in range(0, n, chunk):
        c = slice(start, min(start + chunk, n))
        with chunks.autocast_off(x.device):  # the GEMM in the inputs' dtype, as in the losses
            if scaling is not None:
                logits = fp8.linear(x[c], w, b).contiguous()  # the top-k kernel reads unit-stride rows (a padded vocab is a view)
            else:
                logits = chunks.linear(x[c], w, b)  # fp32 accuracy: a bf16 logit near 30 is off by up to 1/16
        if vocab is None:
            ids[c], logprobs[c], nonfinite = _topk(logits, k, temperature, backend, teacher_logit_scale, teacher_softcap)
        else:  # the merged top-k's log-probs are NaN or infinite where any rank's row had a NaN or inf logit
            ids[c], logprobs[c] = vocab.topk(logits, k, temperature, teacher_logit_scale, teacher_softcap, backend)
            nonfinite = (~torch.isfinite(logprobs[c, 0])).nonzero()[:, 0]
        del logits
        if nonfinite.numel():
            raise ValueError(
                f"teacher_input: expected hidden states with finite logits, got a NaN or infinite logit in row "
                f"{start + int(nonfinite[0])} (NaN or inf in teacher_input, teacher_weight or teacher_bias, or "
                f"logits / temperature overflowing)"
            )
    return ids.reshape(*lead, k), logprobs.reshape(*lead, k)


def _topk(logits, k, temperature, backend, scale, softcap):
    """(ids, logprobs, rows whose logsumexp is not finite: their log-probs are NaN), one host sync."""
    if backend == "triton":  # fp64 is routed to torch (_pick_backend)
        from .backends import triton_topk

        if k <= triton_topk.TOPK_MAX_K:  # two reads of the logits, one host sync
            return triton_topk.row_topk(logits, k, temperature, scale, softcap)
    work = torch.promote_types(logits.dtype, torch.float32)
    if scale != 1.0 or softcap is not None:  # the transform in fp32, as the loss math reads it
        logits = logit_transform(logits.to(work), scale, softcap)
    top, ids = torch.topk(logits, k, dim=-1)
    lse = torch.logsumexp(logits.to(work) / temperature, dim=-1, keepdim=True)
    return ids, top.to(work) / temperature - lse, (~torch.isfinite(lse[:, 0])).nonzero()[:, 0]
