"""The arithmetic mixture of teachers' distributions in Triton: one teacher's (R, V) fp32 logits mixed into the
running log-mixture of a block (`flashkd.core.mixture.block`), one program a row, two reads of z:

    pass 1   z          online max / sum-exp of z / τ, per lane, merged after  -> lse = logsumexp(z / τ)
    pass 2   z, acc     v = z / τ − lse + log w  (log of w · softmax(z / τ));   acc ← v (the first teacher) or
                        logaddexp(acc, v); the last teacher's pass writes τ · acc, the block's logits

where the torch form makes ~7 passes over the block (a division, logsumexp's, a subtraction, logaddexp's reads
of both, the final scaling). logaddexp(a, b) = max + log1p(e^−|a − b|) with an accurate log1p, −inf where both
are (a zero weight, a teacher that rules an id out): as `torch.logaddexp`. fp32 math throughout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import INTERPRET, LOG2E, M_START, lane_sum, launching, log1p

BLOCK_V = 256 if INTERPRET else 1024
NUM_WARPS = 8


@triton.jit
def _mix_kernel(z_ptr, acc_ptr, log_w_ptr, log_w, V, inv_tau, tau,
                FIRST: tl.constexpr, LAST: tl.constexpr, PER_ROW: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    z_row = z_ptr + row.to(tl.int64) * V
    acc_row = acc_ptr + row.to(tl.int64) * V
    cols = tl.arange(0, BLOCK_V)
    k = inv_tau * LOG2E
    m = tl.full([BLOCK_V], M_START, tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, V, BLOCK_V):
        x = tl.load(z_row + start + cols, mask=start + cols < V, other=-float("inf"))
        s = lane_sum(s, m, x, k)
        m = tl.maximum(m, x)
    m_row = tl.max(m, 0)
    l_row = tl.sum(s * tl.exp2((m - m_row) * k), 0)
    if PER_ROW:  # the row's own log w, else the one float for all rows
        log_w = tl.load(log_w_ptr + row)
    # log w − logsumexp(z / τ): −inf for a zero weight (the teacher adds nothing), or a row all −inf
    shift = log_w - (m_row * inv_tau + tl.log(l_row))
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        mask = offs < V
        v = tl.load(z_row + offs, mask=mask, other=0.0) * inv_tau + shift
        if not FIRST:
            a = tl.load(acc_row + offs, mask=mask, other=0.0)
            hi = tl.maximum(a, v)
            gap = tl.abs(a - v)
            v = tl.where(hi == -float("inf"), hi, hi + log1p(tl.exp(-tl.where(hi == -float("inf"), 0.0, gap))))
        if LAST:
            v = v * tau
        tl.store(acc_row + offs, v, mask=mask)


def mix_(acc: torch.Tensor | None, z: torch.Tensor, log_w: torch.Tensor | float, tau: float, last: bool) -> torch.Tensor:
    """acc ← logaddexp(acc, z / τ − logsumexp(z / τ) + log_w) row by row, in place (acc None: the first teacher,
    z itself becomes the mixture); `last`: the result times τ. z, acc: (R, V) fp32 contiguous on one CUDA device
    (or CPU under the interpreter); log_w: (R,) on it, or one float (−inf: a zero weight), passed by value.
    Returns the mixture (acc, or z the first time)."""
    if z.dtype != torch.float32 or not z.is_contiguous():
        raise ValueError(f"z: expected contiguous float32 logits, got {z.dtype} with strides {tuple(z.stride())}")
    if acc is not None and (acc.shape != z.shape or acc.dtype != z.dtype or not acc.is_contiguous()):
        raise ValueError(f"acc: expected a contiguous float32 tensor of shape {tuple(z.shape)}, got {acc.dtype} "
                         f"{tuple(acc.shape)}")
    out = z if acc is None else acc
    r, v = z.shape
    if r == 0 or v == 0:
        return out.mul_(tau) if last and tau != 1.0 else out
    per_row = isinstance(log_w, torch.Tensor)
    rows = log_w.to(torch.float32).contiguous() if per_row else z  # z: never read (PER_ROW off)
    with launching():
        _mix_kernel[(r,)](z, out, rows, 0.0 if per_row else float(log_w), v, 1.0 / tau, float(tau),
                          FIRST=acc is None, LAST=last, PER_ROW=per_row, BLOCK_V=BLOCK_V, num_warps=NUM_WARPS)
    return out
