"""A teacher that learns (`losses.LEARNING_LOSSES` with the teacher's tensors requiring grad): its gradient
buffers, where the row function writes dL/dt, and the two GEMMs a block of it adds (`flashkd.core.loop`).

    buffers   (dxt, dwt, dbt, held), as the student's dX, dW, db; held: dL/dT of every row (`defers`)
    grad_out  dL/dt's place: over the teacher's logits, rounded in half their bytes (the Triton rows), or held
    gemms     dXt[b] = dT Wt, dWt += dTᵀ Xt[b] (not where held), db_t += Σ dT of a block b
    finish    (dxt, dwt, dbt), dWt = dTᵀ Xt in one GEMM where dL/dT is held
"""

from __future__ import annotations

import torch

from .checks import NARROW
from .gemms import accumulate_mm, gemm_rows


def defers(n: int, ht: int, e: int, accum_bytes: int, blocks: bool) -> bool:
    """Whether dWt is made once after the loop, from dL/dT of all N rows held in the inputs' dtype (N·V·E bytes),
    instead of accumulated a block at a time (V·Ht·A bytes, read and written by every block's GEMM: ~1.4 ms a
    block at Ht 4096, V 128256 on an H100): where there is more than one block (`blocks`) and holding it takes no
    more (N·E ≤ Ht·A). The one GEMM's inner dimension is N; its result is rounded once, as one block's is."""
    return blocks and accum_bytes > 0 and n * e <= ht * accum_bytes


def buffers(plan, teacher, v, learn, want_dxt, want_dwt, want_dbt, f32):
    """A learning teacher's (dxt, dwt, dbt, held) buffers (None: not wanted; dbt over the V ids); zeros without
    dL/dt, else filled by the blocks' GEMMs (dwt in the plan's accumulator dtype over more than one block, or
    made by `finish` from held, (N, V) in the inputs' dtype, where `defers`)."""
    xt, wt, _ = teacher
    n = xt.shape[0]
    new, filled = (torch.empty, True) if learn and n else (torch.zeros, False)
    blocks = n > plan.teacher_chunk and filled
    held = None
    if want_dwt and defers(n, xt.shape[1], xt.element_size(), plan.grad_accum_dtype.itemsize, blocks):
        held = torch.empty(n, v, device=xt.device, dtype=xt.dtype)
    accum_t = plan.grad_accum_dtype if blocks else wt.dtype
    return (new(xt.shape, device=xt.device, dtype=xt.dtype) if want_dxt else None,
            new(wt.shape, device=xt.device, dtype=accum_t) if want_dwt and held is None else None,
            torch.zeros(v, **f32) if want_dbt else None, held)


def grad_out(plan, t, dtype, grad, want_dbt, grads, b: slice):
    """Where a learning teacher's dL/dt of block b goes: over t (`torch_rows.rows`); on the Triton rows, rounded
    once to the inputs' bf16 / fp16 into its rows of `held` (grads[3]) or else into half the fp32 logits' bytes
    (`grad_view`), as dL/ds: no cast of R·V·6 bytes before the teacher's GEMMs. Not where the teacher's bias
    learns: db_t sums dL/dt in fp32, before it is rounded."""
    if plan.backend == "triton" and t.dtype == torch.float32 and dtype in NARROW and not want_dbt:
        if grads[3] is not None:
            return grads[3][b]
        from ..backends import triton_rows

        return triton_rows.grad_view(t, dtype, plan.spec, grad)
    return t


def gemms(grads, t, xt, wt, b: slice, counted) -> None:
    """A learning teacher's block b, as the student's chunk: t holds dL/dt (`grad_out`: bf16 already where the
    Triton rows rounded it), and dXt[b] = dT Wt, dWt += dTᵀ Xt[b] (its accumulator written, not read, at the first
    block; where dL/dT is held, its rows of held instead), dbt += Σ_rows dT, into grads = (dxt, dwt, dbt, held)
    (None: not wanted). counted: the block's rows whose label is not ignored."""
    dxt, dwt, dbt, held = grads
    if held is None:
        dt = t.to(wt.dtype)  # rounded once to the inputs' dtype for the GEMMs, as dL/ds is
    else:
        dt = held[b]
        if t.data_ptr() != dt.data_ptr():
            dt.copy_(t)  # rounded once, as above
    if dxt is not None:
        torch.mm(gemm_rows(dt), wt, out=dxt[b])
    if dwt is not None:
        # ignored rows' dT is 0, and their hidden states zeroed, as the student's: no 0 · NaN in dWt
        x = xt[b] if counted is None else torch.where(counted[:, None], xt[b], 0.0)
        accumulate_mm(dwt, dt.t(), x, beta=0.0 if b.start == 0 else 1.0)
    if dbt is not None:
        dbt += t.sum(0, dtype=dbt.dtype)


def finish(grads, xt, counted):
    """(dxt, dwt, dbt) after the loop: where dL/dT is held, dWt = dTᵀ Xt over all rows in one GEMM (ignored rows'
    hidden states zeroed: no 0 · NaN), in the head's dtype."""
    dxt, dwt, dbt, held = grads
    if held is not None:
        x = xt if counted is None else torch.where(counted[:, None], xt, 0.0)
        dwt = held.t() @ x
    return dxt, dwt, dbt
