"""teacher_topk's loop: a teacher's top-k log-probs, one chunk of logits at a time (for offline targets).

Why a module of its own: teacher_topk runs no loss and no gradient, only the teacher's GEMM and a
top-k per chunk; the entry (`flashkd.core.run`) checks its call and agrees a slice's ranks as for the
losses, then runs this loop, on the whole vocab or on a `VocabSlice` (whose `topk` merges the ranks'
candidates).
"""

from __future__ import annotations

import torch

from .. import fp8
from ..losses import logit_transform
from . import loop, plan as plans


@torch.no_grad()
def run(call, rows, backend: str, vocab=None):
    """`flashkd.teacher_topk` of a checked call (rows: its hidden states flattened, head and bias; backend:
    the chosen row backend). vocab: None, the whole vocab; or this rank's slice, agreed by its ranks."""
    x, w, b, k = rows.xs, rows.ws, rows.bs, call.teacher.k
    spec, options = call.spec, call.options
    temperature, scale, softcap = spec.temperature, spec.teacher_logit_scale, spec.teacher_softcap
    vocab_size = options.vocab_size
    v = w.shape[0] if vocab is None else vocab.total  # ids and vocab_size are the whole vocab's
    if vocab_size is not None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 1 <= vocab_size <= v:
            raise ValueError(f"vocab_size: expected an int in [1, {v}] (teacher_weight's vocab), got {vocab_size!r}")
        v = vocab_size
        keep = v if vocab is None else max(0, min(w.shape[0], v - vocab.start))  # this slice's ids < vocab_size
        w, b = w[:keep], None if b is None else b[:keep]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= v:
        raise ValueError(f"k: expected an int in [1, {v}] (the vocab size), got {k!r}")
    scaling = fp8.scaling_of(options.teacher_precision, x.device)
    if scaling is not None:
        fp8.check_dtype(x.dtype)
        w = fp8.head(w, scaling)
    lead = call.teacher.teacher_input.shape[:-1]
    n = x.shape[0]
    plan = backend
    if vocab is not None:  # every rank plans the same chunks (backend and k are agreed between the ranks)
        v = vocab.plan_size
        if plan == "triton":
            from ..backends import triton_topk

            if k > triton_topk.TOPK_MAX_K:  # past the top-k kernel's k the torch path's temporaries make the candidates
                plan = "torch"
    transformed = scale != 1.0 or softcap is not None
    per_row = v * plans.logit_size(x.dtype) + (v * 4 * (3 if transformed else 2) if plan == "torch" else 0)
    chunk = options.chunk_size or plans.even_chunks(n, plans.LOGITS_BUDGET[plan] // per_row)
    work = torch.promote_types(x.dtype, torch.float32)
    ids = torch.empty(n, k, dtype=torch.int64, device=x.device)
    logprobs = torch.empty(n, k, dtype=work, device=x.device)
    for start in range(0, n, chunk):
        c = slice(start, min(start + chunk, n))
        with loop.autocast_off(x.device):  # the GEMM in the inputs' dtype, as in the losses
            if scaling is not None:
                logits = fp8.linear(x[c], w, b).contiguous()  # the top-k kernel reads unit-stride rows (a padded vocab is a view)
            else:
                logits = loop.linear(x[c], w, b)  # fp32 accuracy: a bf16 logit near 30 is off by up to 1/16
        if vocab is None:
            ids[c], logprobs[c], nonfinite = _topk(logits, k, temperature, backend, scale, softcap)
        else:  # the merged top-k's log-probs are NaN or infinite where any rank's row had a NaN or inf logit
            ids[c], logprobs[c] = vocab.topk(logits, k, temperature, scale, softcap, backend)
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
    if backend == "triton":  # fp64 is routed to torch (`backend.pick_backend`)
        from ..backends import triton_topk

        if k <= triton_topk.TOPK_MAX_K:  # two reads of the logits, one host sync
            return triton_topk.row_topk(logits, k, temperature, scale, softcap)
    work = torch.promote_types(logits.dtype, torch.float32)
    if scale != 1.0 or softcap is not None:  # the transform in fp32, as the loss math reads it
        logits = logit_transform(logits.to(work), scale, softcap)
    top, ids = torch.topk(logits, k, dim=-1)
    lse = torch.logsumexp(logits.to(work) / temperature, dim=-1, keepdim=True)
    return ids, top.to(work) / temperature - lse, (~torch.isfinite(lse[:, 0])).nonzero()[:, 0]
