"""Triton helpers that the row kernels share (`triton_rows`, `triton_topk`): the per-lane online
sum-exp, the heads' logit transforms at load (scale and softcap, the softcap's tanh), and the constants
they work in. The numerics of each are in its docstring; the kernels' own docs say where they use them.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings

import torch
import triton
import triton.language as tl

# Under TRITON_INTERPRET=1 every tile op is a numpy call on the CPU (the kernels pick small tiles).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# The hardware log2 (lg2.approx, abs. error ~2^-22 on [1, 2]) instead of libdevice's ~30-instruction
# log2f; the interpreter has no inline PTX.
FAST_LOG2: tl.constexpr = tl.constexpr(not INTERPRET)
LOG2E: tl.constexpr = tl.constexpr(math.log2(math.e))
LN2: tl.constexpr = tl.constexpr(math.log(2.0))
# Start of the running max: finite, so that a tile whose logits are all −inf (masked columns first in
# the row) gives 2^(−inf − m) = 0 instead of 2^(−inf + inf) = NaN.
M_START: tl.constexpr = tl.constexpr(-3.0e38)


@contextlib.contextmanager
def launching():
    """Around a launch of one of flashkd's kernels. Under TRITON_INTERPRET=1 the tile ops are numpy
    calls that also evaluate the masked lanes (−inf − (−inf), log2 0, an overflowing product past a
    row's end), which the kernels then discard; numpy's RuntimeWarnings about those lanes are dropped
    here, for the interpreter's frames and for the launch alone, so that a user of backend="triton" on
    CPU does not see them. Compiled kernels raise none: nothing is filtered on a GPU."""
    if not INTERPRET:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")
        yield


# ------------------------------------------------------------------------------ online sums per lane


@triton.jit
def lane_sum(l_i, m_i, x, k):
    """Per-lane online sum-exp: l_i = Σ 2^((x − m_i)·k) over the lane's elements so far, m_i the lane's
    max before x; the caller then moves m_i to max(m_i, x). One exp2 per element: of the smaller of x
    and m_i, 2^(−|x − m_i|·k) either scales the old sum (x is the new max) or is added to it.
    Masked lanes (x = −inf) add 2^−inf = 0. With k = log2(e)/τ, l_i = Σ e^((x − m_i)/τ); the max is
    subtracted before scaling, so an element near the max gets an exponent near 0 with no rounding
    error of the size of m_i·k."""
    e = tl.exp2(tl.abs(x - m_i) * -k)  # −k, not −|·|: the abs folds into the multiply (one instruction fewer)
    return tl.where(x > m_i, l_i * e + 1.0, l_i + e)


@triton.jit
def lane_kl(l_i, r_i, m_i, m_o, x, y, ratio, k, SCALED: tl.constexpr):
    """lane_sum of the weighting side x, and beside it r_i = Σ 2^((x − m_i)·k)·d for a KL, d each
    element's gaps below both sides' running maxima, d = (x − m_i) − ratio·(y − m_o) (m_i of x's side,
    m_o of the other side y, both as they were before this element; ratio only where SCALED), the gaps
    moved with the maxima as `lane_gap` moves its own. Then E_q[d]·fold/τ is the KL's
    E_q[z_s − z_t]/τ − (max z_s − max z_t)/τ with no large value subtracted from another: taken apart,
    both terms were ~|z| and their difference ~0 where the sides agree, its few ulp of |z| multiplied
    by 1/τ in the loss and again in its gradient (fp32 noise at τ ≤ 0.01 with unequal folds or one
    softcap). Masked lanes (x = −inf) add nothing; y = −inf where x is not makes the KL +inf."""
    m_o_new = tl.maximum(m_o, y)
    grew = m_o_new - m_o
    gap_y = y - m_o_new
    if SCALED:
        grew = grew * ratio
        gap_y = gap_y * ratio
    r_i = r_i + times(l_i, grew)  # the old terms' y-gaps grew with y's max
    gap = x - m_i
    e = tl.exp2(tl.abs(gap) * -k)
    new = x > m_i
    d = tl.where(new, 0.0, gap) - gap_y
    return (tl.where(new, l_i * e + 1.0, l_i + e),
            tl.where(new, times(e, r_i - l_i * gap) + d, r_i + times(e, d)))


@triton.jit
def lane_gap(r_i, l_i, m_i, x, k):
    """Beside `lane_sum` (called before it, with its l_i and m_i): r_i = Σ 2^((x − m_i)·k)·(x − m_i),
    the softmax-weighted sum of each element's gap below the lane's running max, moved with the max
    (when x is the new max, the old terms' gaps grow by x − m_i). No large value is ever subtracted
    from another, so E_q[s] − max(s), and the entropy from it, keep fp32's relative accuracy even
    where |s| is large. Its exp2 is the same expression as `lane_sum`'s: computed once."""
    d = x - m_i
    e = tl.exp2(tl.abs(d) * -k)
    return tl.where(x > m_i, e * (r_i - l_i * d), r_i + times(e, d))


@triton.jit
def log1p(x):
    """log(1 + x) for x > −1, accurate for small x: log of u = 1 + x corrected by u's rounding error, which
    (u − 1) − x gives exactly (libdevice's log, not lg2.approx, whose absolute error would be all of a
    small result)."""
    u = 1.0 + x
    return tl.log(u) - ((u - 1.0) - x) / u


@triton.jit
def order_key(x):
    """An int32 that orders like the fp32 x (−0.0 as +0.0, so that equal values tie): the float's bits as a
    signed int with the magnitude bits flipped for negative x."""
    i = (x + 0.0).to(tl.int32, bitcast=True)
    return i ^ ((i >> 31) & 0x7FFFFFFF)


@triton.jit
def times(w, d):
    """w · d, taken as 0 where w is 0 (0·log 0 = 0; masked lanes, where d is NaN, add nothing)."""
    return tl.where(w > 0.0, w * d, 0.0)



# ---------------------------------------------------------------------------- the heads' transforms


@triton.jit
def rcp(x):
    """1 / x: the hardware reciprocal (rcp.approx, within 1 ulp) instead of an IEEE division's ~10
    instructions; the interpreter has no inline PTX."""
    if FAST_LOG2:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    return 1.0 / x


# 1/u on u in [1, 2]: the minimax quadratic for the relative error, whose residual 1 − u·p(u) is
# T3(2u − 3)/99 (T3 the Chebyshev polynomial), at most 1/99; each Newton step squares it. In
# t = u − 1: p = (98 − 80 t + 32 t²)/99.
RCP_P0 = 98.0 / 99.0
RCP_P1 = -80.0 / 99.0
RCP_P2 = 32.0 / 99.0
_RCP_P0: tl.constexpr = tl.constexpr(RCP_P0)
_RCP_P1: tl.constexpr = tl.constexpr(RCP_P1)
_RCP_P2: tl.constexpr = tl.constexpr(RCP_P2)
@triton.jit
def softcap_tanh(x, k, NEG: tl.constexpr, RCP_FMA: tl.constexpr):
    """(tanh y, 1 − tanh² y) in fp32 for y = σ x / c, given k = −2 log2(e)·|σ|/c and NEG = σ < 0, from
    t = e^(−2|y|) = 2^(k·|x|) in [0, 1] alone: tanh |y| = (1 − t)/(1 + t), whose sign (x's, flipped for
    NEG) is set bitwise; odd by construction (−0 gives ∓0), exactly ±1 where tanh rounds to ±1
    (saturated: 1 + t rounds to 1, r = 1, and r − t·r to 1), and 1 − tanh² = 4t/(1 + t)², accurate
    there too. No overflow for any x. Absolute error ~2^-23 at most, mostly the exp2's (ex2.approx: ~2^-22 relative; 1 − t is
    exact near 0, the division within an ulp).
    The exp2 on the SFU (ex2.approx). The division:
    the hardware reciprocal r of u = 1 + t, then r − t·r, one FFMA; or with RCP_FMA on the FMA pipe
    alone: r from the quadratic start and one Newton step (relative error 2^-13), the quotient
    q = r − t·r, then one correction by its residual, q + r·((1 − t) − u·q), which squares the error
    (seven FFMA in all); a second Newton step gives r itself to fp32 accuracy for 4t·r², only where the
    derivative is used (elsewhere the compiler drops it)."""
    t = tl.exp2(tl.abs(x) * k)
    u = 1.0 + t
    # −v as v · −1, which the compiler turns into a negated operand; Triton's −v is 0 − v, an instruction
    nt = t * -1.0
    if RCP_FMA:
        nu = u * -1.0
        r = tl.fma(tl.fma(t, _RCP_P2, _RCP_P1), t, _RCP_P0)
        r = tl.fma(r, tl.fma(nu, r, 1.0), r)
        th = tl.fma(nt, r, r)
        th = tl.fma(r, tl.fma(nu, th, 1.0 - t), th)
        r = tl.fma(r, tl.fma(nu, r, 1.0), r)
    else:
        r = rcp(u)
        th = tl.fma(nt, r, r)  # (1 − t)·r rounded once
    sign = x.to(tl.int32, bitcast=True) & -2147483648
    if NEG:
        sign = sign ^ -2147483648
    th = (th.to(tl.int32, bitcast=True) ^ sign).to(tl.float32, bitcast=True)
    return th, 4.0 * t * r * r


@triton.jit
def head(x, mul, HEAD: tl.constexpr, RCP_FMA: tl.constexpr = False):
    """(z / fold, dz/dx / σ) of a head's transform of loaded logits x (`head_mode`): HEAD 0 none here,
    (x, 1) (the scale σ is the fold, in the caller's constants); 1 z = mul · x (a negative scale:
    mul = σ), (z, 1); 2 and 3 (σ < 0) z = c · tanh(σ x / c) with the cap c as the fold:
    (tanh(σ x / c), 1 − tanh²) (`softcap_tanh`, mul = −2 log2(e)·|σ|/c), its reciprocal where RCP_FMA says.
    The default, on the SFU, is the top-k kernels' (`triton_topk`): compiled
    for sm_90 their passes bind on the SFU by less than the FMA pipe's reciprocal adds to their issue
    (stats 157 instructions per 8 elements a thread with 24 MUFU, against 206 with 16). −inf (a masked
    lane, or a column the top-k kernels wrote −inf over) stays −inf: an absent column. The derivative
    is used only where dL/ds is written: elsewhere the compiler drops it."""
    if HEAD == 0:
        return x, 1.0
    elif HEAD == 1:
        return tl.where(x == -float("inf"), x, x * mul), 1.0
    else:
        th, d = softcap_tanh(x, mul, HEAD == 3, RCP_FMA)
        return tl.where(x == -float("inf"), x, th), d


@triton.jit
def head_grad(g, d, HEAD: tl.constexpr):
    """g · dz/dx without σ (folded into g's factors): times 1 − tanh² for a softcap, else g itself."""
    if HEAD >= 2:
        return g * d
    return g


def head_mode(scale: float, softcap: float | None):
    """(HEAD, fold, mul) of `head` for a head's σ and c: the kernels load x and make z / fold of it,
    and multiply fold into their constants (log2(e)·fold/τ for the softmax, ...), which must be > 0
    (a max stays a max). Without a cap and σ > 0: HEAD 0, fold σ, nothing made at load (the path
    without a transform is unchanged); σ < 0: HEAD 1, z = σ·x at load, fold 1; a softcap: HEAD 2, or
    3 where σ < 0 (a constexpr switch keyed on None and the sign), tanh(σ x / c) at load with
    mul = −2 log2(e)·|σ|/c, and fold c, so that c · tanh takes no multiply an element."""
    scale = float(scale)
    if softcap is not None:
        return 2 if scale >= 0.0 else 3, float(softcap), -2.0 * math.log2(math.e) * abs(scale) / softcap
    if scale < 0.0:
        return 1, 1.0, scale
    return 0, scale, 1.0


@triton.jit
def store_grad(ptr, g, mask, RTNE_BITS: tl.constexpr):
    """dL/ds stored, rounded to the nearest even of ptr's dtype. RTNE_BITS: round fp32 to bf16 on the bits
    first, for Triton's CPU interpreter, whose bf16 conversion truncates (the GPU's rounds to nearest
    even, and then equals this); a NaN is kept a NaN."""
    if RTNE_BITS:
        u = g.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        g = tl.where(g == g, u.to(tl.float32, bitcast=True), g)
    tl.store(ptr, g.to(ptr.dtype.element_ty), mask=mask)


def rtne_bits(ds) -> bool:
    """`store_grad`'s RTNE_BITS for a gradient buffer: bf16 under the interpreter."""
    return INTERPRET and ds.dtype == torch.bfloat16


# ------------------------------------------------------------------------------ scaled, rounded copies

@triton.jit
def _scaled_kernel(src_ptr, dst_ptr, c_ptr, n, RTNE_BITS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    c = tl.load(c_ptr).to(tl.float32)
    store_grad(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask) * c, mask, RTNE_BITS)


def scaled(src: torch.Tensor, c: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(src · c) rounded to `dtype`, src fp32 contiguous and c a 0-d device tensor (read by the kernel:
    no host sync), the product in fp32 as torch's `src * c.float()`: the bits of `(src * c).to(dtype)`
    in one pass. torch's own mixed-dtype `mul(out=)` takes its unvectorised path (a 1.24 GB fp32
    dW in 2.5 ms on an H100, against ~0.6 for this)."""
    out = torch.empty(src.shape, dtype=dtype, device=src.device)
    n = src.numel()
    block = 1024 if INTERPRET else 4096
    with launching():
        _scaled_kernel[(triton.cdiv(n, block),)](src, out, c.reshape(1), n, RTNE_BITS=INTERPRET and dtype == torch.bfloat16,
                                                 BLOCK=block, num_warps=8)
    return out
