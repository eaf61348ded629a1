"""teacher_topk: a teacher's top-k log-probs, one chunk of logits at a time (for offline targets)."""

from __future__ import annotations

import torch

from . import fp8
from .distill import (_FLOATS, _LOGITS_BUDGET, _any_dtensor, _autocast_off, _check_tensors, _distributed, _even_chunks,
                      _pick_backend)
from .losses import LossSpec, check_logit_transform, logit_transform


@torch.no_grad()
def teacher_topk(
    teacher_input: torch.Tensor,  # (..., H)
    teacher_weight: torch.Tensor,  # (Vt, H)
    k: int,
    *,
    temperature: float = 1.0,
    teacher_bias: torch.Tensor | None = None,  # (Vt,)
    vocab_size: int | None = None,
    chunk_size: int | None = None,
    backend: str = "auto",
    teacher_logit_scale: float = 1.0,
    teacher_softcap: float | None = None,
    process_group=None,
    vocab_start: int | None = None,
    check_shards: bool | None = None,
    fsdp_gather: str = "auto",
    teacher_precision: str | None = None,
):
    """The teacher's k most likely ids per row and their log-probs at `temperature`.

    Returns (ids, logprobs): (..., k) int64 and (..., k) float32 (float64 for float64
    inputs, computed in float64), sorted by decreasing log-prob,
    log p = z/τ − logsumexp(z/τ) over the whole vocab, z the logits as the teacher's head transforms
    them (z = c · tanh(σ · logits / c) with σ = `teacher_logit_scale`, c = `teacher_softcap`; z = σ ·
    logits without a cap; as in `fused_linear_distill`), the ids those of the k largest z (a negative σ
    reverses the order) — the targets of `fused_linear_distill_topk(..., temperature=τ)`. Never holds more than one chunk of logits
    (R·Vt·E bytes, R rows per chunk, plus fp32 temporaries of the same size on the torch backend).

    vocab_size: the student's vocab V when the teacher head is padded (Vt > V): ids >= V are
    dropped before the softmax, as in `fused_linear_distill`.

    temperature: a finite float > 0 (LossSpec's rule). A row with a NaN or +inf logit (NaN or inf in
    the hidden states, weight or bias; −inf logits, a masked id, are fine) raises ValueError naming
    the row of teacher_input: no NaN targets come back. torch.autocast changes nothing: the logits come
    from a GEMM in the inputs' dtype.

    On the Triton backend each chunk costs the GEMM, two reads of its logits and one host sync (rows
    whose top-k candidates overflowed, normally none, are redone with torch.topk; the same sync finds
    non-finite rows); on the torch backend one host sync a chunk, for the non-finite rows.

    process_group, vocab_start: a vocab-parallel teacher head, this rank holding its rows
    [vocab_start, vocab_start + V_r); every rank passes the same teacher_input and gets the same
    global top-k (vocab_size is then the whole vocab's). A DTensor head (FSDP2): `fsdp_gather`. See
    `flashkd.distributed`.

    teacher_precision: None, or "fp8" / "fp8-rowwise" / "fp8-1x128", the logits from an e4m3 GEMM
    (as in `fused_linear_distill`; `flashkd.fp8`): the top-k targets are then those of the
    FP8 teacher.
    """
    if _any_dtensor(teacher_weight, teacher_bias):
        return _distributed("teacher_topk", locals())
    _check_tensors({"teacher_input": teacher_input})
    x, w, b = teacher_input, teacher_weight, teacher_bias
    if x.dtype not in _FLOATS:
        raise TypeError(f"teacher_input: expected a floating dtype (float16, bfloat16, float32, float64), got {x.dtype}")
    _check_tensors({"teacher_weight": w, "teacher_bias": b}, x.dtype, x.device, like="teacher_input")
    if w.dim() != 2 or 0 in w.shape:  # an empty vocab or hidden size has no distribution
        raise ValueError(f"teacher_weight: expected a 2-D (vocab, hidden) tensor, both >= 1, got shape {tuple(w.shape)}")
    if x.dim() < 1 or x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"teacher_input: expected shape (..., {w.shape[1]}) (teacher_weight is {tuple(w.shape)}), got {tuple(x.shape)}"
        )
    if b is not None and b.shape != (w.shape[0],):
        raise ValueError(f"teacher_bias: expected shape ({w.shape[0]},), got {tuple(b.shape)}")
    v = w.shape[0]
    vocab = None
    if process_group is not None:
        from .distributed import parallel

        vocab = parallel.shard(parallel._check_group(process_group), vocab_start, v, x.device,
                               True if check_shards is None else check_shards, None)
        v = vocab.total  # ids and vocab_size are the whole vocab's
    elif vocab_start is not None:
        raise ValueError(f"vocab_start: expected None without process_group, got {vocab_start!r}")
    if fsdp_gather not in ("auto", "rows", "heads"):
        raise ValueError(f"fsdp_gather: expected 'auto', 'rows' or 'heads', got {fsdp_gather!r}")
    if vocab_size is not None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 1 <= vocab_size <= v:
            raise ValueError(f"vocab_size: expected an int in [1, {v}] (teacher_weight's vocab), got {vocab_size!r}")
        v = vocab_size
        keep = v if vocab is None else max(0, min(w.shape[0], v - vocab.start))  # this slice's ids < vocab_size
        w, b = w[:keep], None if b is None else b[:keep]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= v:
        raise ValueError(f"k: expected an int in [1, {v}] (the vocab size), got {k!r}")
    LossSpec(temperature=temperature)  # the losses' rule: a finite float > 0 (inf would give uniform log-probs)
    check_logit_transform("teacher_logit_scale", teacher_logit_scale, "teacher_softcap", teacher_softcap)
    backend = _pick_backend(backend, x)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size: expected a positive int or None, got {chunk_size!r}")

    scaling = fp8.scaling_of(teacher_precision, x.device)
    if scaling is not None:
        fp8.check_dtype(x.dtype)
        w = fp8.head(w, scaling)
    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])
    n = x.shape[0]
    if vocab is not None:
        v, backend = vocab.plan_size, "torch"  # every rank plans the same chunks
    transformed = teacher_logit_scale != 1.0 or teacher_softcap is not None
    per_row = v * x.element_size() + (v * 4 * (3 if transformed else 2) if backend == "torch" else 0)
    chunk = chunk_size or _even_chunks(n, _LOGITS_BUDGET[backend] // per_row)
    work = torch.promote_types(x.dtype, torch.float32)
    ids = torch.empty(n, k, dtype=torch.int64, device=x.device)
    logprobs = torch.empty(n, k, dtype=work, device=x.device)
    for start in range(0, n, chunk):
        c = slice(start, min(start + chunk, n))
        with _autocast_off(x.device):  # the GEMM in the inputs' dtype, as in the losses
            if scaling is not None:
                logits = fp8.linear(x[c], w, b).contiguous()  # the top-k kernel reads unit-stride rows (a padded vocab is a view)
            else:
                logits = x[c] @ w.t() if b is None else torch.addmm(b, x[c], w.t())
        if vocab is None:
            ids[c], logprobs[c], nonfinite = _topk(logits, k, temperature, backend, teacher_logit_scale, teacher_softcap)
        else:  # the merged top-k's log-probs are NaN or infinite where any rank's row had a NaN or inf logit
            ids[c], logprobs[c] = vocab.topk(logits, k, temperature, teacher_logit_scale, teacher_softcap)
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
