"""A teacher that learns (`losses.LEARNING_LOSSES` with the teacher's tensors requiring grad): its gradient
buffers, where the row function writes dL/dt, and the two GEMMs a block of it adds (`flashkd.core.loop`).

    buffers   (dxt, dwt, dbt), as the student's dX, dW, db
    grad_out  dL/dt's place: over the teacher's logits, or rounded in half their bytes (the Triton rows)
    gemms     dXt[b] = dT Wt, dWt += dTᵀ Xt[b], db_t += Σ dT of a block b
"""

from __future__ import annotations

import torch

from .checks import NARROW
from .gemms import accumulate_mm, gemm_rows


def buffers(plan, teacher, v, learn, want_dxt, want_dwt, want_dbt, f32):
    """A learning teacher's (dxt, dwt, dbt) buffers (None: not wanted; dbt over the V ids); zeros without dL/dt,
    else filled by the blocks' GEMMs (dwt in the plan's accumulator dtype over more than one block)."""
    xt, wt, _ = teacher
    n = xt.shape[0]
    new, filled = (torch.empty, True) if learn and n else (torch.zeros, False)
    accum_t = plan.grad_accum_dtype if n > plan.teacher_chunk and filled else wt.dtype
    return (new(xt.shape, device=xt.device, dtype=xt.dtype) if want_dxt else None,
            new(wt.shape, device=xt.device, dtype=accum_t) if want_dwt else None,
            torch.zeros(v, **f32) if want_dbt else None)


def grad_out(plan, t, dtype, grad, want_dbt):
    """Where a learning teacher's dL/dt goes: over t (`torch_rows.rows`); on the Triton rows, rounded once to the
    inputs' bf16 / fp16 into half the fp32 logits' bytes (`grad_view`), as dL/ds: no cast of R·V·6 bytes before
    the teacher's GEMMs. Not where the teacher's bias learns: db_t sums dL/dt in fp32, before it is rounded."""
    if plan.backend == "triton" and t.dtype == torch.float32 and dtype in NARROW and not want_dbt:
        from ..backends import triton_rows

        return triton_rows.grad_view(t, dtype, plan.spec, grad)
    return t


def gemms(grads, t, xt, wt, b: slice, counted) -> None:
    """A learning teacher's block b, as the student's chunk: t holds dL/dt (`torch_rows.rows`; bf16 already where
    the Triton rows rounded it), and
    dXt[b] = dT Wt, dWt += dTᵀ Xt[b] (its accumulator written, not read, at the first block), dbt += Σ_rows
    dT, into grads = (dxt, dwt, dbt) (None: not wanted). counted: the block's rows whose label is not ignored."""
    dxt, dwt, dbt = grads
    dt = t.to(wt.dtype)  # rounded once to the inputs' dtype for the GEMMs, as dL/ds is
    if dxt is not None:
        torch.mm(gemm_rows(dt), wt, out=dxt[b])
    if dwt is not None:
        # ignored rows' dT is 0, and their hidden states zeroed, as the student's: no 0 · NaN in dWt
        x = xt[b] if counted is None else torch.where(counted[:, None], xt[b], 0.0)
        accumulate_mm(dwt, dt.t(), x, beta=0.0 if b.start == 0 else 1.0)
    if dbt is not None:
        dbt += t.sum(0, dtype=dbt.dtype)
