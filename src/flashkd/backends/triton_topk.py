"""The Triton row backend for a sparse (top-k) teacher, `topk_rows`; and teacher_topk's `row_topk`.

Contract: `flashkd.backends`, t = (ids, logprobs); results of `torch_rows.topk_rows` (autograd of
`flashkd.losses.topk_row_losses`). The loss lives on K (+ 1) categories, so the work splits into two
passes over the vocab around a small dense problem on (R, K + 1):

    stats kernel    per row: gather s at the ids (and keep it), write −inf over them, then stream the
                    row once: online max / sum-exp of s/τ off the ids (the bucket's logit
                    z_rest = logsumexp_rest(s/τ)) and of s at τ = 1 off the ids (the CE)
    (R, K + 1)      category log-probs with `losses.category_logprobs` (the same code as the torch
                    definition), then the dense row kernel of `triton_rows` at τ = 1 on them: the
                    divergence and g = dL/dz per category
    expand kernel   per row: dL/ds_j = g_rest/τ · exp(s_j/τ − z_rest) + c_ce (softmax(s)_j − [j = y])
                    over the row (zero on the ids, which hold −inf), then the ids' own values stored
                    over their columns: g_k/τ + c_ce (softmax(s)_k − [k = y])

The chain rule behind it: q over the categories is softmax of z_C = (s_ids/τ, z_rest), and
∂z_rest/∂s_j = softmax_rest(s/τ)_j / τ. Bytes per element: one read (stats) and one read + one
write (expand) of s, as for forward KL on dense logits, but without a teacher row.
Under tail="renormalize" nothing off the ids enters the divergence: without the CE (or stats) the
stats kernel only gathers and the expand kernel writes zeros and the ids' values.
The student's logit scale and softcap are applied as in `triton_rows` (folded into the constants, and z / fold
made at load by `triton_common.head` where needed, dz/ds = σ (1 − tanh²) applied where dL/ds is written); the ids'
z and dz/ds are made in torch from the gathered logits. With `stats` the stats kernel also streams
the gaps below the max off the ids (`triton_common.lane_gap`): the entropy of q and its mass on the ids
follow on (R, K + 1) in `_topk_stats`; the teacher's entropy over the categories is taken there in torch.
With a tail clamp (TRL's bucket, `losses.category_logprobs`) the categories are not a softmax of anything,
so the dense kernel gives way to autograd of the torch definition on the (R, K + 1) categories
(`_torch_categories`); the passes over the vocab are the same. So do skew KL, skew reverse KL and AKL
(`losses.TORCH_ONLY_LOSSES`): on a top-k teacher they run on this backend, their category math in torch.
For verl's integration (`flashkd.integrations.verl`) three kernels more: the expand kernel's OWN keeps the
candidates for each id's membership of the student's top K as it streams, `rank_kernel` counts the ids'
ranks among them, and `_clamped_kl_kernel` is verl's per-row forward KL with its clamps and weights.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..losses import TORCH_ONLY_LOSSES, LossSpec, category_entropy, category_logprobs, divergence, logit_transform
from . import triton_common, triton_rows

# Tiles of the kernels here (measured on an H200, benchmarks/bench_rows.py: the top-k row kernels at
# 8192 × 128256 bf16 take 1.85 ms with 1024 columns over 4 warps, 1.97 with 512, 1.92 with 2048 over 8).
BLOCK_V = 256 if triton_common.INTERPRET else 1024
NUM_WARPS = 4
OWN_CAP = 512  # the expand kernel's kept elements a row (OWN): θ leaves about K of them
_LN2 = math.log(2.0)


@triton.jit
def stats_kernel(
    s_ptr,  # (R, V) student logits; −inf written over the ids when STREAM
    ids_ptr,  # (R, K) int32 / int64 ids, −1 unused
    s_k_ptr,  # (R, K) fp32 out: s at the ids, −inf in unused slots
    m_ptr,  # (R,) fp32 out: max of s off the ids (−3e38 if none)
    l_tau_ptr,  # (R,) fp32 out: log2 Σ_off-ids 2^((s − m)·log2(e)/τ)
    l_one_ptr,  # (R,) fp32 out: log2 Σ_off-ids 2^((s − m)·log2(e))      (written when ONE)
    gap_ptr,  # (R,) fp32 out: E[s − m] off the ids under softmax(z/τ)     (written when STATS)
    V,
    K,
    log2e_tau,  # log2(e)·fold / τ (fold: σ folded, c with a softcap, else 1: triton_common.head_mode)
    log2e_one,  # log2(e)·fold
    mul,  # triton_common.head's
    STREAM: tl.constexpr,  # stream the row (else only gather)
    ONE: tl.constexpr,  # also the sum at τ = 1 (the CE's, when τ ≠ 1)
    HEAD: tl.constexpr,  # the student's transform at load (triton_common.head)
    STATS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    theta_ptr=None,  # (R,) fp32 out: the K-th largest lane max off the ids (OWN: `expand_kernel`'s threshold)
    OWN: tl.constexpr = False,
):
    row = tl.program_id(0)
    s_row = s_ptr + row.to(tl.int64) * V
    kk = tl.arange(0, BLOCK_K)
    ids = tl.load(ids_ptr + row.to(tl.int64) * K + kk, mask=kk < K, other=-1).to(tl.int64)
    used = (ids >= 0) & (ids < V)
    s_k = tl.load(s_row + tl.where(used, ids, 0), mask=used, other=-float("inf")).to(tl.float32)
    tl.store(s_k_ptr + row.to(tl.int64) * K + kk, s_k, mask=kk < K)
    if STREAM:
        tl.store(s_row + ids, tl.full([BLOCK_K], -float("inf"), tl.float32).to(s_row.dtype.element_ty), mask=used)
        tl.debug_barrier()  # the row's other threads read those columns below
        cols = tl.arange(0, BLOCK_V)
        m = tl.full([BLOCK_V], triton_common.M_START, tl.float32)
        l_tau = tl.zeros([BLOCK_V], tl.float32)
        l_one = tl.zeros([BLOCK_V], tl.float32)
        gap = tl.zeros([BLOCK_V], tl.float32)
        for start in range(0, V, 2 * BLOCK_V):  # two tiles' loads in flight before either is summed
            offs = start + cols
            x0 = tl.load(s_row + offs, mask=offs < V, other=-float("inf"))
            x1 = tl.load(s_row + offs + BLOCK_V, mask=offs + BLOCK_V < V, other=-float("inf"))
            for u in tl.static_range(2):
                a = triton_common.head((x0 if u == 0 else x1).to(tl.float32), mul, HEAD)[0]
                if STATS:
                    gap = triton_common.lane_gap(gap, l_tau, m, a, log2e_tau)
                l_tau = triton_common.lane_sum(l_tau, m, a, log2e_tau)
                if ONE:
                    l_one = triton_common.lane_sum(l_one, m, a, log2e_one)
                m = tl.maximum(m, a)
        m_row = tl.max(m, 0)
        tl.store(m_ptr + row, m_row)
        if OWN:  # K lanes hold an element >= it each: at most the row's K-th largest (K <= BLOCK_V)
            tl.store(theta_ptr + row, tl.sum(tl.where(cols == K - 1, tl.sort(m, descending=True), 0.0), 0))
        f = tl.exp2((m - m_row) * log2e_tau)
        if STATS:
            l_row = tl.sum(l_tau * f, 0)
            tl.store(gap_ptr + row, tl.sum(triton_common.times(f, gap + l_tau * (m - m_row)), 0) / l_row)
        tl.store(l_tau_ptr + row, tl.log2(tl.sum(l_tau * f, 0)))
        if ONE:
            tl.store(l_one_ptr + row, tl.log2(tl.sum(l_one * tl.exp2((m - m_row) * log2e_one), 0)))


@triton.jit
def expand_kernel(
    s_ptr,  # (R, V) student logits, −inf at the ids
    g_ptr,  # (R, V) dL/ds out, rows G_STRIDE apart: s itself, a narrower buffer (bf16 dL/ds of fp32 logits),
    # or (ALIASED) the first half of each row of s, read as the narrower dtype
    ids_ptr,  # (R, K) ids, −1 unused
    id_grad_ptr,  # (R, K) fp32: dL/ds at the ids
    coef_ptr,  # (R,) fp32: g_rest / τ (REST)
    m_ptr,  # (R,) fp32: max of s off the ids (REST)
    l_tau_ptr,  # (R,) fp32: log2 of the off-ids sum at τ, relative to m (REST)
    c_ce_ptr,  # (R,) fp32: scale · w_hard · σ on rows with a CE gradient, else 0 (CE)
    l_one_ptr,  # (R,) fp32: (logsumexp(z) over the row − fold · m)·log2(e): softmax(z) = 2^((s − m)·log2e_one − it) (CE)
    labels_ptr,  # (R,) int labels (CE)
    V,
    K,
    G_STRIDE,  # g's row stride, elements
    log2e_tau,  # log2(e)·fold / τ
    log2e_one,  # log2(e)·fold
    mul,
    REST: tl.constexpr,
    CE: tl.constexpr,
    HEAD: tl.constexpr,
    RTNE_BITS: tl.constexpr,  # triton_common.store_grad's
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ALIASED: tl.constexpr = False,  # g lies over s's row: a tile is stored once every thread has read it
    theta_ptr=None,  # (R,) fp32: `stats_kernel`'s threshold (OWN)
    scratch_ptr=None,  # (R, CAP) int64 out: the row's kept elements, packed (OWN)
    count_ptr=None,  # (R,) int32, zeros: the row's kept elements so far (OWN)
    OWN: tl.constexpr = False,  # the membership's candidates, on the loads of the REST pass (HEAD 0: s itself)
    CAP: tl.constexpr = 256,
):
    """dL/ds over the row (module doc). With OWN, also the candidates for each id's membership of the row's
    top K (K the ids' number; ties to the larger id, as `_topk_kernel`), in the same read: every element >=
    θ, the K-th largest lane max off the ids (a lower bound of the row's K-th largest value), is kept as it
    streams by (its (value, id) key in the row's next scratch slot); `rank_kernel` then counts id i's rank
    as the kept elements and other ids whose key exceeds its own. An id below θ has K elements above it,
    and every element above an id at or over θ is kept or an id: the rank is exact where it matters."""
    row = tl.program_id(0)
    s_row = s_ptr + row.to(tl.int64) * V
    g_row = g_ptr + row.to(tl.int64) * G_STRIDE
    cols = tl.arange(0, BLOCK_V)
    theta = 0.0
    buf = scratch_ptr
    if OWN:
        tl.static_assert(HEAD == 0 and REST)
        theta = tl.load(theta_ptr + row)
        buf = scratch_ptr + row.to(tl.int64) * CAP
    coef = 0.0
    m = 0.0
    l_tau = 0.0
    if REST or CE:
        m = tl.load(m_ptr + row)
    if REST:
        coef = tl.load(coef_ptr + row)
        l_tau = tl.load(l_tau_ptr + row)
    c_ce = 0.0
    l_one = 0.0
    label = -1
    if CE:
        c_ce = tl.load(c_ce_ptr + row)
        l_one = tl.load(l_one_ptr + row)
        label = tl.load(labels_ptr + row).to(tl.int64)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        mask = offs < V
        g = tl.zeros([BLOCK_V], tl.float32)
        if REST or CE:
            a, da = triton_common.head(tl.load(s_row + offs, mask=mask, other=-float("inf")).to(tl.float32), mul, HEAD)
            if REST:
                # the ids' columns hold −inf: 0 there (and no −inf + inf when the rest is empty)
                g += tl.where(a > -float("inf"), coef * tl.exp2((a - m) * log2e_tau - l_tau), 0.0)
            if OWN:  # a kept element takes the row's next slot (an atomic a kept element: about K a row)
                keep = (a >= theta) & (a > -float("inf"))
                slot = tl.atomic_add(count_ptr + row + cols * 0, 1, mask=keep)
                tl.store(buf + slot, _signed_key(a, offs), mask=keep & (slot < CAP))
            if CE:
                g += c_ce * (tl.exp2((a - m) * log2e_one - l_one) - tl.where(offs == label, 1.0, 0.0))
            g = triton_common.head_grad(g, da, HEAD)
        if ALIASED:
            # a narrow tile at column c lies over s's columns c/2 … (c + BLOCK_V)/2, read at this tile or
            # an earlier one, perhaps by another warp: every warp's reads so far come before any store
            tl.debug_barrier()
        triton_common.store_grad(g_row + offs, g, mask, RTNE_BITS)
    tl.debug_barrier()  # the ids' values go over what the row's threads stored above
    kk = tl.arange(0, BLOCK_K)
    ids = tl.load(ids_ptr + row.to(tl.int64) * K + kk, mask=kk < K, other=-1).to(tl.int64)
    used = (ids >= 0) & (ids < V)
    id_grad = tl.load(id_grad_ptr + row.to(tl.int64) * K + kk, mask=used, other=0.0)
    triton_common.store_grad(g_row + ids, id_grad, used, RTNE_BITS)


@triton.jit
def rank_kernel(
    ids_ptr,  # (R, K) ids, −1 unused
    s_k_ptr,  # (R, K) fp32: s at the ids
    theta_ptr,  # (R,) fp32: `stats_kernel`'s threshold
    own_ptr,  # (R, K) int8 out: each id in the row's K largest logits
    redo_ptr,  # (R,) int8 out: 1 where the candidates did not fit (the row is settled elsewhere)
    scratch_ptr,  # (R, CAP) int64: the row's kept elements, packed (`expand_kernel`'s OWN)
    count_ptr,  # (R,) int32: the row's kept elements
    V,
    K,
    CAP: tl.constexpr,
    CH: tl.constexpr,  # the comparisons, this many columns at a time (<= BLOCK_K, CAP)
    BLOCK_K: tl.constexpr,
):
    """Each id's membership of its row's top K from what `expand_kernel` kept (OWN): id i's rank is the
    number of kept elements and other ids whose (value, id) key exceeds its own (ties to the larger id, an
    id repeated in the row counted once). A kernel of its own, after the expand kernel's: its (BLOCK_K, CH)
    comparisons' registers would otherwise be the streaming loop's too (120 a thread at K 128 against 31
    without: a quarter of the warps an SM to hide the loads' latency)."""
    row = tl.program_id(0)
    kk = tl.arange(0, BLOCK_K)
    ids = tl.load(ids_ptr + row.to(tl.int64) * K + kk, mask=kk < K, other=-1).to(tl.int64)
    used = (ids >= 0) & (ids < V)
    theta = tl.load(theta_ptr + row)
    buf = scratch_ptr + row.to(tl.int64) * CAP
    n = tl.load(count_ptr + row)  # the kept elements (more than CAP: the row is redone)
    s_k = tl.load(s_k_ptr + row.to(tl.int64) * K + kk, mask=used, other=-float("inf"))
    key = _signed_key(s_k, ids)
    # CH at a time: a (BLOCK_K, CH) comparison stays in registers where (BLOCK_K, CAP) would spill
    rank = tl.zeros([BLOCK_K], tl.int32)
    ch = tl.arange(0, CH)
    for j in range(0, tl.minimum(n, CAP), CH):  # the kept ones only (about K)
        kept = tl.load(buf + j + ch, mask=j + ch < n, other=_EMPTY)
        rank += tl.sum((kept[None, :] > key[:, None]).to(tl.int32), 1)
    for j in tl.static_range(0, BLOCK_K, CH):
        jj = j + ch
        ids_j = tl.load(ids_ptr + row.to(tl.int64) * K + jj, mask=jj < K, other=-1).to(tl.int64)
        used_j = (ids_j >= 0) & (ids_j < V)
        key_j = _signed_key(tl.load(s_k_ptr + row.to(tl.int64) * K + jj, mask=used_j, other=-float("inf")), ids_j)
        repeat = tl.sum(((ids_j[:, None] == ids[None, :]) & (kk[None, :] < jj[:, None])).to(tl.int32), 1) > 0
        first_j = used_j & ~repeat
        rank += tl.sum(((key_j[None, :] > key[:, None]) & first_j[None, :]).to(tl.int32), 1)
    tl.store(own_ptr + row.to(tl.int64) * K + kk, (used & (s_k >= theta) & (rank < K)).to(tl.int8), mask=kk < K)
    bad = (n > CAP) | (theta <= triton_common.M_START) | (theta != theta)
    tl.store(redo_ptr + row, bad.to(tl.int8))


@triton.jit
def _clamped_kl_kernel(
    s_k_ptr,  # (R, K) fp32: s at the ids (`stats_kernel`'s)
    m_ptr,  # (R,) fp32: max of s off the ids
    log2_rest_ptr,  # (R,) fp32: log2 of the off-ids sum at τ, relative to m
    lp_ptr,  # (R, K) the teacher's log-probs at the ids, any float dtype
    const_ptr,  # (3,) fp64: τ, ln 2, the clamp (read where CLAMP)
    shift_ptr,  # (R,) fp32 out: m, or the largest s at the ids where no logit is off them
    loss_ptr, q_mass_ptr, p_mass_ptr,  # (R,) out, the caller's dtype ("wide": the verl outputs')
    kl_ptr,  # (R, K) out: the token KL terms
    weight_ptr,  # (R,): the rows' weights (WEIGHTS 1), or the predicted weights before the bounds (2)
    bounds_ptr,  # (2,) wide: the bounds the loss must lie in for a predicted weight (LO, HI)
    pred_ptr, u_ptr, kept_ptr,  # (R,) wide, wide, int8 out (WEIGHTS 2): the prediction, u, pred ≠ 0
    id_grad_ptr,  # (R, K) fp32 out (GRAD): d loss / d s at the ids, times u / τ
    rest_grad_ptr,  # (R,) fp32 out (GRAD): d loss / d logsumexp of the rest, times u / τ
    R, K,
    CLAMP: tl.constexpr, GRAD: tl.constexpr, WEIGHTS: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """verl's top-k forward KL (`flashkd.integrations.verl`'s per-row math) on BLOCK_R rows, float64: with
    rel_k = (s_k − shift)/τ and rel_rest = ln 2 · log2_rest, log q = rel_k − logaddexp(rel_rest, logsumexp
    rel_k); lq, lp clamped from below where CLAMP; the terms e^lp (lp − lq), their sum, Σ q, Σ e^lp (lp
    unclamped). With GRAD the gradient in rel_k and rel_rest as torch's autograd of those formulas gives it
    (clamp_min passes it where its input is at or over the clamp): g = −e^lp [log q >= clamp], G = Σ g,
    d rel_k = g − q G (at the row's largest q, g (1 − q) − q (G − g) with 1 − q summed from the other q's),
    d rel_rest = −q_rest G; each row's times u / τ, u: 1 (WEIGHTS 0), the given weight
    (1), or (2) pred = the weight where the loss (rounded to wide) lies in the bounds else 0, u = pred where
    pred ≠ 0 else 1 (`integrations.verl._sweep`'s prediction)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    kk = tl.arange(0, BLOCK_K)
    in_row = rows < R
    at = in_row[:, None] & (kk[None, :] < K)
    idx = rows.to(tl.int64)[:, None] * K + kk[None, :]
    tau = tl.load(const_ptr)
    ln2 = tl.load(const_ptr + 1)
    s_k = tl.load(s_k_ptr + idx, mask=at, other=-float("inf"))
    m = tl.load(m_ptr + rows, mask=in_row, other=0.0)
    rel_rest = ln2 * tl.load(log2_rest_ptr + rows, mask=in_row, other=0.0).to(tl.float64)
    shift = tl.where(rel_rest == -float("inf"), tl.max(s_k, 1), m)
    tl.store(shift_ptr + rows, shift, mask=in_row)
    a = (s_k.to(tl.float64) - shift.to(tl.float64)[:, None]) / tau
    a_max = tl.max(a, 1)
    a_max = tl.where(a_max == -float("inf"), 0.0, a_max)
    lse = a_max + tl.log(tl.sum(tl.where(at, tl.exp(a - a_max[:, None]), 0.0), 1))
    top = tl.maximum(rel_rest, lse)
    low = tl.minimum(rel_rest, lse)
    total = tl.where(low == -float("inf"), top, top + tl.log(1.0 + tl.exp(low - top)))
    log_q = a - total[:, None]
    lp = tl.load(lp_ptr + idx, mask=at, other=0.0).to(tl.float64)
    lq = log_q
    lpc = lp
    if CLAMP:
        clamp = tl.load(const_ptr + 2)
        lq = tl.where(log_q != log_q, log_q, tl.maximum(log_q, clamp))  # torch's clamp_min: NaN stays NaN
        lpc = tl.where(lp != lp, lp, tl.maximum(lp, clamp))
    w = tl.exp(lpc)
    kl = tl.where(at, w * (lpc - lq), 0.0)
    q = tl.exp(log_q)
    loss = tl.sum(kl, 1)
    tl.store(kl_ptr + idx, kl, mask=at)
    tl.store(loss_ptr + rows, loss, mask=in_row)
    tl.store(q_mass_ptr + rows, tl.sum(tl.where(at, q, 0.0), 1), mask=in_row)
    tl.store(p_mass_ptr + rows, tl.sum(tl.where(at, tl.exp(lp), 0.0), 1), mask=in_row)
    if GRAD:
        g = -w
        if CLAMP:
            g = tl.where(log_q >= tl.load(const_ptr + 2), g, 0.0)
        g = tl.where(at, g, 0.0)
        big_g = tl.sum(g, 1)
        # g − q G at the row's largest q as g (1 − q) − q (G − g), 1 − q summed from the rest's and the other
        # ids' q: where one id holds nearly all of q, 1 − q from q itself keeps a few digits (log q = a − total
        # rounds to ulp(a))
        top = kk[None, :] == tl.argmax(tl.where(at, a, -float("inf")), 1)[:, None]
        rest_q = tl.exp(rel_rest - total)
        not_top = rest_q + tl.sum(tl.where(at & ~top, q, 0.0), 1)
        g_not_top = tl.sum(tl.where(~top, g, 0.0), 1)
        d_a = tl.where(top, g * not_top[:, None] - q * g_not_top[:, None], g - q * big_g[:, None])
        u = tl.full([BLOCK_R], 1.0, tl.float64)
        if WEIGHTS == 1:
            u = tl.load(weight_ptr + rows, mask=in_row, other=1.0).to(tl.float64)
        elif WEIGHTS == 2:
            wide = loss_ptr.dtype.element_ty
            loss_w = loss.to(wide)  # the value verl's clamps compare, as returned
            inside = in_row
            if LO:
                inside = inside & (loss_w >= tl.load(bounds_ptr))
            if HI:
                inside = inside & (loss_w <= tl.load(bounds_ptr + 1))
            pred = tl.where(inside, tl.load(weight_ptr + rows, mask=in_row, other=0.0).to(wide), 0.0)
            keep = pred != 0.0
            u_w = tl.where(keep, pred, 1.0)
            tl.store(pred_ptr + rows, pred, mask=in_row)
            tl.store(u_ptr + rows, u_w, mask=in_row)
            tl.store(kept_ptr + rows, keep.to(tl.int8), mask=in_row)
            u = u_w.to(tl.float64)
        scale = u / tau
        tl.store(id_grad_ptr + idx, (d_a * scale[:, None]).to(tl.float32), mask=at)
        tl.store(rest_grad_ptr + rows, (-rest_q * big_g * scale).to(tl.float32), mask=in_row)


def clamped_kl_constants(tau: float, clamp, device) -> torch.Tensor:
    """`clamped_kl`'s constants (τ, ln 2, the clamp) in float64 on the device, made there (no copy from the
    host): once a call."""
    const = torch.full((3,), float(tau), dtype=torch.float64, device=device)
    const[1] = _LN2
    const[2] = 0.0 if clamp is None else float(clamp)
    return const


def clamped_kl(s_k, m, log2_rest, lp, const: torch.Tensor, clamp, grad: bool, wide: torch.dtype, out=None,
               weight=None, base=None, bounds=(None, None), pred_u=None):
    """verl's per-row forward KL (`_clamped_kl_kernel`) of a chunk: (shift, loss, q_mass, p_mass, token_kl,
    id_grad, rest_grad, keep); const: `clamped_kl_constants`; out: (loss, q_mass, p_mass, token_kl) to write,
    contiguous, of dtype wide (else new ones). With grad, id_grad (R, K) and rest_grad (R,) fp32 carry the
    rows' u / τ: u = weight (R,) where given, else predicted from base (R,) and bounds (lo, hi, None for
    none) into pred_u = (pred, u) (R,) wide, with keep (R,) bool = pred ≠ 0 (else None), else 1."""
    r, k = s_k.shape
    dev = s_k.device
    if out is None:
        out = (torch.empty(r, dtype=wide, device=dev), torch.empty(r, dtype=wide, device=dev),
               torch.empty(r, dtype=wide, device=dev), torch.empty(r, k, dtype=wide, device=dev))
    shift = torch.empty(r, dtype=torch.float32, device=dev)
    id_grad = torch.empty(r, k, dtype=torch.float32, device=dev) if grad else None
    rest_grad = torch.empty(r, dtype=torch.float32, device=dev) if grad else None
    mode = 1 if weight is not None else 2 if base is not None else 0
    keep = torch.empty(r, dtype=torch.int8, device=dev) if grad and mode == 2 else None
    lo, hi = bounds
    bound = torch.full((2,), 0.0 if lo is None else float(lo), dtype=wide, device=dev) if mode == 2 else shift
    if mode == 2 and hi is not None:
        bound[1] = float(hi)
    pred, u = pred_u if mode == 2 else (shift, shift)
    block_k = triton.next_power_of_2(max(k, 1))
    block_r = max(1, min(16, 2048 // block_k))
    if r:
        with triton_common.launching():
            _clamped_kl_kernel[(triton.cdiv(r, block_r),)](
                s_k, m, log2_rest, lp.contiguous(), const, shift, *out,
                shift if mode == 0 else (weight if mode == 1 else base).contiguous(), bound, pred, u,
                shift if keep is None else keep, id_grad if grad else s_k, rest_grad if grad else shift, r, k,
                CLAMP=clamp is not None, GRAD=grad, WEIGHTS=mode, LO=lo is not None, HI=hi is not None,
                BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4)
    return (shift, *out, id_grad, rest_grad, None if keep is None else keep.view(torch.bool))


def topk_rows(s, t, labels, spec: LossSpec, scale: torch.Tensor, grad: bool, stats: bool = False, *, ds=None):
    """`sliced_topk_rows` of whole rows, with nothing to exchange."""
    return triton_rows.unexchanged(sliced_topk_rows(s, t, labels, spec, scale, grad, stats, ds=ds))


def sliced_topk_rows(s, t, labels, spec: LossSpec, scale: torch.Tensor, grad: bool, stats: bool = False, *, ds=None,
                     start=None, total=None):
    """Per-row (soft, hard) for a top-k teacher t = (ids, logprobs); with `grad`, s is overwritten
    with dL/ds (or ds, contiguous, of s's shape: `triton_rows.rows`'s); with `stats` also (entropy,
    mass). See `flashkd.backends` for the contract. A generator, as `triton_rows.sliced_rows`.
    start, total: None (whole rows), or the global id of a rank's slice's first column and the vocab's
    size V (an int, or a 0-d device tensor): s holds the columns [start, start + V_r) of each row, ids
    and labels are global. The stats kernel runs on the slice; its outputs, yielded as ("gather",
    parts) and taken back from every rank, merge into the whole row's (`_merged`); the (R, K + 1)
    categories are then the same on every rank, and the expand kernel writes the slice's dL/ds."""
    if not spec.want_soft:  # the CE alone: the dense kernel does it without a teacher (no stats then)
        return (yield from triton_rows.sliced_rows(s, None, labels, spec, scale, grad, ds=ds, start=start))
    if ds is None:
        ds = s
    elif not isinstance(ds, torch.Tensor) or ds.shape != s.shape or not ds.is_contiguous() or ds.device != s.device:
        got = f"a {ds.dtype} tensor of shape {tuple(ds.shape)} on {ds.device}" if isinstance(ds, torch.Tensor) else repr(ds)
        raise ValueError(f"ds: expected a contiguous tensor of shape {tuple(s.shape)} on {s.device}, got {got}")
    ids, logprobs = t
    R, V = s.shape
    sliced = start is not None
    lo, total = (0, V) if not sliced else (start, total)  # total: an int, or a 0-d device tensor
    K = ids.shape[1]
    if R == 0:
        return (s.new_zeros(0, dtype=torch.float32),) * (5 if stats else 2)
    ids = ids.contiguous()
    if labels is not None:
        labels = labels.contiguous()  # the expand kernel reads them at row: R integers, a negligible copy
    tau = spec.temperature
    bucket = spec.tail == "bucket"
    ce = spec.want_hard and labels is not None
    grad_ce = grad and ce and spec.weight_hard != 0.0
    stream = bucket or ce or stats
    work = torch.promote_types(s.dtype, torch.float32)
    f32 = dict(device=s.device, dtype=torch.float32)
    # the student's head: σ folded into the constants (fold), or z / fold made at load (triton_common.head_mode)
    head, fold, mul = triton_common.head_mode(spec.student_logit_scale, spec.student_softcap)
    sigma = float(spec.student_logit_scale)
    log2e = math.log2(math.e)

    used = (ids >= 0) & (ids < total)
    # the kernels read the slice's own columns: an id (a label) elsewhere is an unused slot (no label) here
    here_ids = ids if not sliced else torch.where((ids >= lo) & (ids < lo + V), ids - lo, -1)
    if labels is not None:
        valid = labels != spec.ignore_index
        in_range = (labels >= 0) & (labels < total)
        here_labels = labels if not sliced else labels - lo
        here = (here_labels >= 0) & (here_labels < V)
        s_y = s.gather(1, torch.where(here, here_labels, 0).long()[:, None])[:, 0].to(torch.float32)  # before the stats kernel writes −inf
    s_k = torch.empty(R, K, **f32)
    m = torch.empty(R, **f32)
    l_tau = torch.empty(R, **f32)
    one = ce and tau != 1.0  # with τ = 1 the off-ids sum at τ is the CE's
    l_one = torch.empty(R, **f32) if one else l_tau
    gap = torch.empty(R if stats else 0, **f32)
    block_k = triton.next_power_of_2(K)
    block_v, num_warps = BLOCK_V, NUM_WARPS
    with triton_common.launching():
        stats_kernel[(R,)](
            s, here_ids, s_k, m, l_tau, l_one, gap if stats else m, V, K, log2e * fold / tau, log2e * fold, mul,
            STREAM=stream, ONE=one, HEAD=head, STATS=stats, BLOCK_V=block_v, BLOCK_K=block_k, num_warps=num_warps,
        )
    if sliced:
        mine = [s_k, m, l_tau, l_one if one else None, gap if stats else None, torch.where(here, s_y, 0.0) if ce else None]
        every = yield "gather", torch.cat([mine[0]] + [x[:, None] for x in mine[1:] if x is not None], 1)
        s_k, m, l_tau, l_one, gap, s_y = _merged(every, *mine[3:], log2e * fold / tau, log2e * fold)
        l_one = l_one if one else l_tau

    # the categories, in the loss math's precision, with the torch definition's code; m is in the
    # kernels' units (s, or z / fold where made at load), m_z = fold · m in z's
    z_ids = torch.where(used, spec.student(s_k), -torch.inf)  # z at the ids, fp32
    z_k = z_ids.to(work) / tau
    m_z = m * fold
    z_rest = rest_empty = None
    if bucket:
        z_rest = (m_z.to(work) / tau + _LN2 * l_tau.to(work))[:, None]
        rest_empty = (used.sum(1) == total)[:, None]  # the ids are distinct (checked on CPU; documented)
    valid_rows = None if labels is None else valid
    if spec.tail_clamp is not None or spec.kind in TORCH_ONLY_LOSSES:
        soft, log_p, g = _torch_categories(z_k, z_rest, logprobs.to(work), used,
                                           None if spec.tail_clamp is not None else rest_empty, valid_rows, spec,
                                           scale, grad)
    else:
        log_q, log_p = category_logprobs(z_k, z_rest, logprobs.to(work), used, rest_empty, spec.tail)
        # The dense kernel at τ = 1 on the categories: softmax(log q) is q, so its dL/d(logits) is dL/dz_C.
        cat_spec = LossSpec(
            loss=spec.loss, beta=spec.beta, temperature=1.0, weight_hard=0.0, weight_soft=spec.soft_scale,
            ignore_index=spec.ignore_index, reduction=spec.reduction, want_hard=False, want_soft=True,
        )
        g = log_q.to(torch.float32).contiguous()
        soft, _ = triton_rows.rows(g, log_p.to(torch.float32).contiguous(), labels, cat_spec, scale, grad)
    # an id outside the vocab, or a NaN log-prob at a used slot (the kernel's max would skip it): NaN,
    # as in the torch definition
    bad = ((ids < -1) | (ids >= total) | (used & logprobs.isnan())).any(1)
    soft = torch.where(bad if labels is None else bad & valid, torch.nan, soft)

    hard = torch.zeros(R, **f32)
    if ce:
        lse_rest = m_z + _LN2 * l_one
        lse1 = torch.logaddexp(lse_rest, torch.logsumexp(z_ids, 1))
        hard = torch.where(in_range, lse1 - spec.student(s_y), torch.nan)
        hard = torch.where(valid, hard, 0.0)
    out = (soft, hard)
    if stats:
        teacher_entropy = category_entropy(log_p, used).float()
        if labels is not None:
            teacher_entropy = torch.where(valid, teacher_entropy, 0.0)
        out += _topk_stats(z_ids / tau, m_z / tau, l_tau, gap * (fold / tau), used, labels, spec) + (teacher_entropy,)
    if not grad:
        return out

    id_grad = g[:, :K] / tau  # dL/dz at the ids
    c_ce = None
    if grad_ce:
        c_ce = torch.where(valid & in_range, scale.to(torch.float32) * spec.weight_hard, 0.0)
        softmax_k = torch.exp(z_ids - lse1[:, None])
        id_grad = id_grad + c_ce[:, None] * (softmax_k - (ids == labels[:, None]).to(torch.float32))
        l_one_rel = (lse1 - m_z) * log2e  # softmax(z)_j = 2^((s_j − m)·log2(e)·fold − l_one_rel)
    # dz/ds at the ids: σ, times 1 − tanh² = cosh⁻² (in fp64: exact where tanh saturates) with a cap
    dz = sigma if head < 2 else (sigma * torch.cosh(s_k.double() * (sigma / spec.student_softcap)).pow(-2)).float()
    coef = g[:, K] / tau * sigma if bucket else None
    with triton_common.launching():
        expand_kernel[(R,)](
            s, ds, here_ids, (id_grad * dz).contiguous(), coef if bucket else m, m, l_tau,
            c_ce * sigma if grad_ce else m, l_one_rel if grad_ce else m,
            here_labels if grad_ce else ids, V, K, ds.stride(0), log2e * fold / tau, log2e * fold, mul,
            REST=bucket, CE=grad_ce, HEAD=head, RTNE_BITS=triton_common.rtne_bits(ds), BLOCK_V=block_v,
            BLOCK_K=block_k, num_warps=num_warps,
        )
    return out


def _merged(every, l_one, gap, s_y, k_tau, k_one):
    """The stats kernel's outputs over each rank's slice (s at the ids, −inf where an id is another
    rank's; the off-ids max, the log2 sums relative to it, the gap; the label's logit, 0 where another
    rank holds it), every: (world, R, K + 3..6) fp32, every rank's in rank order, merged into the whole
    row's: the sums moved to the row's max and added, as `triton_rows` merges a program's lanes (l_one,
    gap, s_y: this rank's, None where not computed)."""
    k = every.shape[2] - 2 - sum(x is not None for x in (l_one, gap, s_y))
    m_r = every[:, :, k]
    m = m_r.amax(0)
    w_tau = torch.exp2(every[:, :, k + 1] + (m_r - m) * k_tau)  # each slice's sum at τ, relative to the row's max
    out = [every[:, :, :k].amax(0), m, torch.log2(w_tau.sum(0))]
    at = k + 2
    if l_one is not None:
        out.append(torch.log2(torch.exp2(every[:, :, at] + (m_r - m) * k_one).sum(0)))
        at += 1
    else:
        out.append(None)
    if gap is not None:  # E[s − max] over the row: the slices' gaps moved to the row's max, weighted by their sums
        out.append(torch.where(w_tau > 0, w_tau * (every[:, :, at] + (m_r - m)), 0.0).sum(0) / w_tau.sum(0))
        at += 1
    else:
        out.append(None)
    out.append(every[:, :, at].sum(0) if s_y is not None else None)
    return out


def _torch_categories(z_k, z_rest, logprobs, used, rest_empty, valid, spec: LossSpec, scale, grad):
    """(soft (R,), log p (R, C), g = dL/dz_C (R, C) fp32 or None) of the categories (C = K + 1 with the
    bucket, K without) from their parts: z_k (R, K) z/τ at the ids (−inf unused), z_rest (R, 1) the off-ids
    logsumexp of z/τ (None under "renormalize"), rest_empty (R, 1) whether the ids cover the vocab (None
    with the clamp or "renormalize"). For what the dense kernel on the categories does not do: TRL's
    clamped bucket (`spec.tail_clamp`; its categories are no softmax, nothing is renormalised) and the
    skew and adaptive losses (`losses.TORCH_ONLY_LOSSES`): the torch definition on these R · C
    numbers, differentiated by autograd (a few small launches a block; no pass over the vocab).
    valid: (R,) or None."""
    if valid is not None:
        # an ignored row's log-probs stand in as 1 / (2K) at each id: finite, and a rest of mass ½. Its own (a NaN,
        # or a mass of 1 on the ids: p_rest = 0, where reverse KL, Jeffreys' and AKL's are +inf) would reach the
        # gradient through the masked row as 0 · NaN (as would 0 in every slot: K times the mass)
        logprobs = torch.where(valid[:, None], logprobs, -math.log(2 * logprobs.shape[1]))
    with torch.enable_grad():
        parts = [z_k.detach().requires_grad_(grad)] + ([] if z_rest is None else [z_rest.detach().requires_grad_(grad)])
        log_q, log_p = category_logprobs(*parts[:1], parts[1] if z_rest is not None else None, logprobs, used,
                                         rest_empty, spec.tail, spec.tail_clamp)
        soft = divergence(log_q, log_p, spec)
        if valid is not None:
            soft = torch.where(valid, soft, 0.0)
        g = None
        if grad:
            w = scale.to(soft.dtype) * spec.soft_scale  # () or (R,): as the dense kernel's scale and weight
            g = torch.cat(torch.autograd.grad((soft * w).sum(), parts), 1).float().contiguous()
    return soft.detach().float(), log_p.detach(), g


def _topk_stats(z_k, z_max, log2_l, gap, used, labels, spec: LossSpec):
    """(entropy, mass on the ids) per row of q = softmax(z/τ) over the whole vocab, from the parts the
    stats kernel left: z_k (R, K) z/τ at the ids (−inf unused), z_max (R,) max of z/τ off the ids,
    log2_l (R,) log2 Σ_off 2^((z − max)/τ·log2 e) (−inf when the ids cover the vocab), gap (R,)
    E[(z − max)/τ] off the ids. Everything is taken relative to z_max, so no two large logits are
    subtracted."""
    off = log2_l > -torch.inf
    shift = torch.where(off, z_max, z_k.amax(1))
    rel_k = z_k - shift[:, None]
    rel_rest = torch.where(off, _LN2 * log2_l, -torch.inf)
    lse = torch.logaddexp(rel_rest, torch.logsumexp(rel_k, 1))
    q_k = torch.where(used, torch.exp(rel_k - lse[:, None]), 0.0)
    q_rest = torch.exp(rel_rest - lse)
    entropy = torch.where(used, q_k * (lse[:, None] - rel_k), 0.0).sum(1)
    entropy = entropy + torch.where(off, q_rest * (lse - torch.where(off, gap, 0.0)), 0.0)
    mass = q_k.sum(1)
    if labels is not None:
        valid = labels != spec.ignore_index
        entropy, mass = torch.where(valid, entropy, 0.0), torch.where(valid, mass, 0.0)
    return entropy, mass


# ------------------------------------------------------------------------------------------ teacher top-k

# Candidate slots per lane for teacher_topk (a lane holds BLOCK_V-th of the row; the ~k candidates,
# elements at or above the k-th largest lane max, rarely put more than one in a lane), and the most
# candidates per row that are sorted on chip.
_SLOTS = 4
_CAP = 256
# Lanes (BLOCK_V) of the teacher top-k kernel by k: the threshold needs at least k lanes, and with
# about 4 lanes per wanted id few rows overflow a lane's slots. Fewer lanes are faster (H200, 8192 ×
# 128256 bf16, k = 64: 256 lanes 1.69 ms, 512 lanes 1.97 ms; 48 and 64 registers a thread on sm_90).
# The interpreter runs the on-chip sorts as numpy steps: small tiles there.
_INTERPRET_LANES = 64


def _topk_lanes(k: int) -> int:
    if triton_common.INTERPRET:
        return _INTERPRET_LANES
    return 256 if k <= 64 else 512 if k <= 128 else 1024


TOPK_MAX_K = _INTERPRET_LANES if triton_common.INTERPRET else _CAP  # the sort keeps CAP candidates


@triton.jit
def _packed_key(x, ids):
    """An int64 that orders like the fp32 x (ties by id): the float's bits as a signed int with the
    magnitude bits flipped for negative x, in the high half; the id in the low half."""
    i = x.to(tl.int32, bitcast=True)
    return ((i ^ ((i >> 31) & 0x7FFFFFFF)).to(tl.int64) << 32) | ids.to(tl.int64)


_EMPTY: tl.constexpr = tl.constexpr(-(2**63))  # below every packed key: an unused slot


@triton.jit
def _signed_key(x, ids):
    """`_packed_key` with −0.0 taken as +0.0 (equal logits tie by id, as torch compares them)."""
    return (triton_common.order_key(x).to(tl.int64) << 32) | ids.to(tl.int64)


@triton.jit
def _candidate(x_row, col, c, slot: tl.constexpr, mul, HEAD: tl.constexpr):
    """The packed keys of each lane's candidate in `slot` (re-read from the row: a few per row)."""
    used = c > slot
    a = triton_common.head(tl.load(x_row + col, mask=used, other=0.0).to(tl.float32), mul, HEAD)[0]
    return tl.where(used, _packed_key(a, col), _EMPTY)


@triton.jit
def _compact(buf, keys, n, CAP: tl.constexpr):
    """Store the used keys at buf[n:], in lane order (up to CAP); returns n + their number."""
    used = keys != _EMPTY
    pos = n + tl.cumsum(used.to(tl.int32), 0) - 1
    tl.store(buf + pos, keys, mask=used & (pos < CAP))
    return n + tl.sum(used.to(tl.int32), 0)


@triton.jit
def _load_tile(x_row, offs, V, mul, HEAD: tl.constexpr):
    """A tile of z, the transformed logits where the kernel makes them (−inf past V)."""
    return triton_common.head(tl.load(x_row + offs, mask=offs < V, other=-float("inf")).to(tl.float32), mul,
                              HEAD)[0]


@triton.jit
def _four_tiles(x_row, o, V, mul, HEAD: tl.constexpr, BLOCK_V: tl.constexpr):
    """The tiles at o, o + BLOCK_V, ... o + 3·BLOCK_V, loaded before any is used: more bytes in flight
    per thread than one tile a loop step (−inf past V)."""
    return (_load_tile(x_row, o, V, mul, HEAD), _load_tile(x_row, o + BLOCK_V, V, mul, HEAD),
            _load_tile(x_row, o + 2 * BLOCK_V, V, mul, HEAD), _load_tile(x_row, o + 3 * BLOCK_V, V, mul, HEAD))


@triton.jit
def _keep(a, offs, theta, c, col0, col1, col2, col3):
    """Each lane's columns of its first four elements >= θ (a is −inf past V: never kept)."""
    keep = a >= theta
    col0 = tl.where(keep & (c == 0), offs, col0)
    col1 = tl.where(keep & (c == 1), offs, col1)
    col2 = tl.where(keep & (c == 2), offs, col2)
    col3 = tl.where(keep & (c == 3), offs, col3)
    return c + keep.to(tl.int32), col0, col1, col2, col3


@triton.jit
def _topk_kernel(
    x_ptr,  # (R, V) logits, any float dtype
    ids_ptr,  # (R, k) int64 out: the k largest, by decreasing value
    vals_ptr,  # (R, k) fp32 out: their values (the loaded ones: x, or z / fold where made at load)
    redo_ptr,  # (R,) int8 out: 1 where the candidates could not hold the top k (the row is redone)
    lse_ptr,  # (R,) fp32 out: logsumexp(x / τ)
    scratch_ptr,  # (R, CAP) int64: the row's candidates, packed, compacted
    V,
    k,
    log2e_tau,  # log2(e)·fold / τ (triton_common.head_mode: the scale folded, or z / fold made at load)
    mul,
    HEAD: tl.constexpr,
    SLOTS: tl.constexpr,
    CAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Pass 1: per-lane max (and the row's logsumexp). The k-th largest lane max θ bounds the row's k-th
    largest value from below: the k lanes whose maxima are >= θ hold k distinct elements >= θ.
    Pass 2: each lane keeps the columns of its first SLOTS elements >= θ in registers (no cross-lane
    work in the loop). Then the candidates are packed as (value, id) keys, compacted to CAP and sorted
    on chip. A lane with more than SLOTS candidates, more than CAP in the row, or fewer than k (fewer
    than k values above −3e38) flags the row."""
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * V
    cols = tl.arange(0, BLOCK_V)
    m = tl.full([BLOCK_V], triton_common.M_START, tl.float32)
    l = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, V, 4 * BLOCK_V):
        o = start + cols
        a0, a1, a2, a3 = _four_tiles(x_row, o, V, mul, HEAD, BLOCK_V)
        l = triton_common.lane_sum(l, m, a0, log2e_tau)
        m = tl.maximum(m, a0)
        l = triton_common.lane_sum(l, m, a1, log2e_tau)
        m = tl.maximum(m, a1)
        l = triton_common.lane_sum(l, m, a2, log2e_tau)
        m = tl.maximum(m, a2)
        l = triton_common.lane_sum(l, m, a3, log2e_tau)
        m = tl.maximum(m, a3)
    m_row = tl.max(m, 0)
    l_row = tl.sum(l * tl.exp2((m - m_row) * log2e_tau), 0)
    tl.store(lse_ptr + row, (m_row * log2e_tau + tl.log2(l_row)) * triton_common.LN2)
    theta = tl.sum(tl.where(cols == k - 1, tl.sort(m, descending=True), 0.0), 0)

    tl.static_assert(SLOTS == 4)
    c = tl.zeros([BLOCK_V], tl.int32)  # candidates seen per lane
    col0 = tl.zeros([BLOCK_V], tl.int32)
    col1 = tl.zeros([BLOCK_V], tl.int32)
    col2 = tl.zeros([BLOCK_V], tl.int32)
    col3 = tl.zeros([BLOCK_V], tl.int32)
    for start in range(0, V, 4 * BLOCK_V):
        o = start + cols
        a0, a1, a2, a3 = _four_tiles(x_row, o, V, mul, HEAD, BLOCK_V)
        c, col0, col1, col2, col3 = _keep(a0, o, theta, c, col0, col1, col2, col3)
        c, col0, col1, col2, col3 = _keep(a1, o + BLOCK_V, theta, c, col0, col1, col2, col3)
        c, col0, col1, col2, col3 = _keep(a2, o + 2 * BLOCK_V, theta, c, col0, col1, col2, col3)
        c, col0, col1, col2, col3 = _keep(a3, o + 3 * BLOCK_V, theta, c, col0, col1, col2, col3)
    # compacted slot by slot: four scans of BLOCK_V keys (one SLOTS·BLOCK_V tensor would spill)
    buf = scratch_ptr + row.to(tl.int64) * CAP
    n = _compact(buf, _candidate(x_row, col0, c, 0, mul, HEAD), 0, CAP)
    n = _compact(buf, _candidate(x_row, col1, c, 1, mul, HEAD), n, CAP)
    n = _compact(buf, _candidate(x_row, col2, c, 2, mul, HEAD), n, CAP)
    n = _compact(buf, _candidate(x_row, col3, c, 3, mul, HEAD), n, CAP)
    tl.debug_barrier()  # the sort below reads what other threads stored
    slots = tl.arange(0, CAP)
    top = tl.sort(tl.load(buf + slots, mask=slots < n, other=_EMPTY), descending=True)
    tl.store(ids_ptr + row.to(tl.int64) * k + slots, top & 0xFFFFFFFF, mask=slots < k)
    hi = (top >> 32).to(tl.int32)  # the key's value, unpacked: the bits the sort ordered
    tl.store(vals_ptr + row.to(tl.int64) * k + slots, (hi ^ ((hi >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True),
             mask=slots < k)
    tl.store(redo_ptr + row, ((tl.max(c, 0) > SLOTS) | (n > CAP) | (n < k)).to(tl.int8))


def row_topk(x: torch.Tensor, k: int, temperature: float, scale: float = 1.0, softcap: float | None = None, *,
             with_lse: bool = False, lanes: int | None = None):
    """The k largest entries per row of z, the (R, V) contiguous logits x under a head's transform
    (`losses.logit_transform`: scale, softcap), and their log-probs log softmax(z/τ): (ids (R, k)
    int64, logprobs (R, k) fp32, nonfinite), sorted by decreasing value; k <= TOPK_MAX_K. nonfinite:
    the rows (int64) whose logsumexp is NaN or infinite (a NaN or inf in z, or z/τ overflowing fp32);
    their log-probs are NaN.

    One kernel, two reads of x. A row whose candidates did not fit (many ties at the threshold, or
    top values clustered in a few lanes) or that has fewer than k finite values is redone with
    torch.topk over the full row: finding out, and finding the non-finite rows, costs one host sync
    per call. with_lse: also the rows' logsumexp of z/τ (R,) fp32, the kernel's (a vocab slice's
    candidates are merged with it, `flashkd.distributed.ShardedVocab.topk`). lanes: the kernel's width,
    None for `_topk_lanes(k)` (benchmarks/bench_rows.py compares others).
    """
    if not 1 <= k <= TOPK_MAX_K:
        raise ValueError(f"k: expected 1 <= k <= {TOPK_MAX_K} for the kernel, got {k}")
    ids, vals, redo, lse = kernel_topk(x, k, temperature, scale, softcap, lanes=lanes)
    # the log-probs from the values the kernel sorted (a softcap's tanh there is not torch's: taking
    # torch's here could break the order of near ties by an ulp)
    logprobs = vals * (triton_common.head_mode(scale, softcap)[1] / temperature) - lse[:, None]
    rows = (redo.bool() | ~torch.isfinite(lse)).nonzero()[:, 0]  # the one host sync
    nonfinite = rows[:0]
    if rows.numel():
        z = logit_transform(x[rows].float(), scale, softcap) / temperature
        top = torch.topk(z, k, dim=-1)
        ids[rows], logprobs[rows] = top.indices, top.values - torch.logsumexp(z, -1, keepdim=True)
        nonfinite = rows[~torch.isfinite(lse[rows])]
    return (ids, logprobs, nonfinite, lse) if with_lse else (ids, logprobs, nonfinite)


def kernel_topk(x: torch.Tensor, k: int, temperature: float, scale: float = 1.0, softcap: float | None = None, *,
                 lanes: int | None = None):
    """The kernel alone on a contiguous (R, V) x: (ids (R, k) int64, vals (R, k) fp32, redo (R,) int8,
    lse (R,) fp32); lanes: `row_topk`'s."""
    R, V = x.shape
    ids = torch.empty(R, k, dtype=torch.int64, device=x.device)
    vals = torch.empty(R, k, dtype=torch.float32, device=x.device)
    redo = torch.empty(R, dtype=torch.int8, device=x.device)
    lse = torch.empty(R, dtype=torch.float32, device=x.device)
    scratch = torch.empty(R, _CAP, dtype=torch.int64, device=x.device)
    head, fold, mul = triton_common.head_mode(scale, softcap)
    if R:
        with triton_common.launching():
            _topk_kernel[(R,)](
                x, ids, vals, redo, lse, scratch, V, k, math.log2(math.e) * fold / temperature, mul, HEAD=head,
                SLOTS=_SLOTS, CAP=_CAP, BLOCK_V=_topk_lanes(k) if lanes is None else lanes, num_warps=NUM_WARPS,
            )
    return ids, vals, redo, lse
