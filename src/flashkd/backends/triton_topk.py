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
Under tail="renormalize" nothing off the ids enters the divergence: without the CE the stats kernel
only gathers and the expand kernel writes zeros and the ids' values.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..losses import LossSpec, category_logprobs
from . import triton_rows

# Tiles of the kernels here (measured on an H200, benchmarks/bench_rows.py: the top-k row kernels at
# 8192 × 128256 bf16 take 1.85 ms with 1024 columns over 4 warps, 1.97 with 512, 1.92 with 2048 over 8).
BLOCK_V = 256 if triton_rows._INTERPRET else 1024
NUM_WARPS = 4
_LOG2E: tl.constexpr = tl.constexpr(math.log2(math.e))
_M_START: tl.constexpr = tl.constexpr(-3.0e38)  # finite start of a running max (see triton_rows)
_LN2 = math.log(2.0)


@triton.jit
def _stats_kernel(
    s_ptr,  # (R, V) student logits; −inf written over the ids when STREAM
    ids_ptr,  # (R, K) int32 / int64 ids, −1 unused
    s_k_ptr,  # (R, K) fp32 out: s at the ids, −inf in unused slots
    m_ptr,  # (R,) fp32 out: max of s off the ids (−3e38 if none)
    l_tau_ptr,  # (R,) fp32 out: log2 Σ_off-ids 2^((s − m)·log2(e)/τ)
    l_one_ptr,  # (R,) fp32 out: log2 Σ_off-ids 2^((s − m)·log2(e))      (written when ONE)
    V,
    K,
    log2e_tau,
    STREAM: tl.constexpr,  # stream the row (else only gather)
    ONE: tl.constexpr,  # also the sum at τ = 1 (the CE's, when τ ≠ 1)
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
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
        m = tl.full([BLOCK_V], _M_START, tl.float32)
        l_tau = tl.zeros([BLOCK_V], tl.float32)
        l_one = tl.zeros([BLOCK_V], tl.float32)
        for start in range(0, V, BLOCK_V):
            offs = start + cols
            a = tl.load(s_row + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
            l_tau = triton_rows._lane_sum(l_tau, m, a, log2e_tau)
            if ONE:
                l_one = triton_rows._lane_sum(l_one, m, a, _LOG2E)
            m = tl.maximum(m, a)
        m_row = tl.max(m, 0)
        tl.store(m_ptr + row, m_row)
        tl.store(l_tau_ptr + row, tl.log2(tl.sum(l_tau * tl.exp2((m - m_row) * log2e_tau), 0)))
        if ONE:
            tl.store(l_one_ptr + row, tl.log2(tl.sum(l_one * tl.exp2((m - m_row) * _LOG2E), 0)))


@triton.jit
def _expand_kernel(
    s_ptr,  # (R, V) student logits, −inf at the ids; overwritten with dL/ds
    ids_ptr,  # (R, K) ids, −1 unused
    id_grad_ptr,  # (R, K) fp32: dL/ds at the ids
    coef_ptr,  # (R,) fp32: g_rest / τ (REST)
    m_ptr,  # (R,) fp32: max of s off the ids (REST)
    l_tau_ptr,  # (R,) fp32: log2 of the off-ids sum at τ, relative to m (REST)
    c_ce_ptr,  # (R,) fp32: scale · w_hard on rows with a CE gradient, else 0 (CE)
    m1_ptr,  # (R,) fp32: max of s over the whole row (CE)
    l_one_ptr,  # (R,) fp32: log2 Σ_row 2^((s − m1)·log2(e)) (CE)
    labels_ptr,  # (R,) int labels (CE)
    V,
    K,
    log2e_tau,
    REST: tl.constexpr,
    CE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    s_row = s_ptr + row.to(tl.int64) * V
    cols = tl.arange(0, BLOCK_V)
    coef = 0.0
    m = 0.0
    l_tau = 0.0
    if REST:
        coef = tl.load(coef_ptr + row)
        m = tl.load(m_ptr + row)
        l_tau = tl.load(l_tau_ptr + row)
    c_ce = 0.0
    m1 = 0.0
    l_one = 0.0
    label = -1
    if CE:
        c_ce = tl.load(c_ce_ptr + row)
        m1 = tl.load(m1_ptr + row)
        l_one = tl.load(l_one_ptr + row)
        label = tl.load(labels_ptr + row).to(tl.int64)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        mask = offs < V
        g = tl.zeros([BLOCK_V], tl.float32)
        if REST or CE:
            a = tl.load(s_row + offs, mask=mask, other=-float("inf")).to(tl.float32)
            if REST:
                # the ids' columns hold −inf: 0 there (and no −inf + inf when the rest is empty)
                g += tl.where(a > -float("inf"), coef * tl.exp2((a - m) * log2e_tau - l_tau), 0.0)
            if CE:
                g += c_ce * (tl.exp2((a - m1) * _LOG2E - l_one) - tl.where(offs == label, 1.0, 0.0))
        tl.store(s_row + offs, g.to(s_row.dtype.element_ty), mask=mask)
    tl.debug_barrier()  # the ids' values go over what the row's threads stored above
    kk = tl.arange(0, BLOCK_K)
    ids = tl.load(ids_ptr + row.to(tl.int64) * K + kk, mask=kk < K, other=-1).to(tl.int64)
    used = (ids >= 0) & (ids < V)
    id_grad = tl.load(id_grad_ptr + row.to(tl.int64) * K + kk, mask=used, other=0.0)
    tl.store(s_row + ids, id_grad.to(s_row.dtype.element_ty), mask=used)


def topk_rows(s, t, labels, spec: LossSpec, scale: torch.Tensor, grad: bool, stats: bool = False):
    """Per-row (soft, hard) for a top-k teacher t = (ids, logprobs); with `grad`, s is overwritten
    with dL/ds. See `flashkd.backends` for the contract."""
    if stats or spec.student_logit_scale != 1.0 or spec.student_softcap is not None:
        raise NotImplementedError("the triton backend has no logit transforms or stats yet: use backend='torch'")
    if not spec.want_soft:  # the CE alone: the dense kernel does it without a teacher
        return triton_rows.rows(s, None, labels, spec, scale, grad)
    ids, logprobs = t
    R, V = s.shape
    K = ids.shape[1]
    if R == 0:
        return s.new_zeros(0, dtype=torch.float32), s.new_zeros(0, dtype=torch.float32)
    ids = ids.contiguous()
    tau = spec.temperature
    bucket = spec.tail == "bucket"
    ce = spec.want_hard and labels is not None
    grad_ce = grad and ce and spec.weight_hard != 0.0
    stream = bucket or ce
    work = torch.promote_types(s.dtype, torch.float32)
    f32 = dict(device=s.device, dtype=torch.float32)

    used = (ids >= 0) & (ids < V)
    if labels is not None:
        valid = labels != spec.ignore_index
        in_range = (labels >= 0) & (labels < V)
        s_y = s.gather(1, torch.where(in_range, labels, 0).long()[:, None])[:, 0].to(torch.float32)  # before the stats kernel writes −inf
    s_k = torch.empty(R, K, **f32)
    m = torch.empty(R, **f32)
    l_tau = torch.empty(R, **f32)
    one = ce and (tau != 1.0 or not bucket)  # with τ = 1 the bucket's sum is the CE's
    l_one = torch.empty(R, **f32) if one else l_tau
    block_k = triton.next_power_of_2(K)
    _stats_kernel[(R,)](
        s, ids, s_k, m, l_tau, l_one, V, K, math.log2(math.e) / tau,
        STREAM=stream, ONE=one, BLOCK_V=BLOCK_V, BLOCK_K=block_k, num_warps=NUM_WARPS,
    )

    # the categories, in the loss math's precision, with the torch definition's code
    z_k = s_k.to(work) / tau
    z_rest = rest_empty = None
    if bucket:
        z_rest = (m.to(work) / tau + _LN2 * l_tau.to(work))[:, None]
        rest_empty = (used.sum(1) == V)[:, None]  # the ids are distinct (checked on CPU; documented)
    log_q, log_p = category_logprobs(z_k, z_rest, logprobs.to(work), used, rest_empty, spec.tail)
    # The dense kernel at τ = 1 on the categories: softmax(log q) is q, so its dL/d(logits) is dL/dz_C.
    cat_spec = LossSpec(
        loss=spec.loss, beta=spec.beta, temperature=1.0, weight_hard=0.0, weight_soft=spec.soft_scale,
        ignore_index=spec.ignore_index, reduction=spec.reduction, want_hard=False, want_soft=True,
    )
    g = log_q.to(torch.float32).contiguous()
    soft, _ = triton_rows.rows(g, log_p.to(torch.float32).contiguous(), labels, cat_spec, scale, grad)
    bad = ((ids < -1) | (ids >= V)).any(1)  # an id outside the vocab: NaN, as in the torch definition
    soft = torch.where(bad if labels is None else bad & valid, torch.nan, soft)

    hard = torch.zeros(R, **f32)
    if ce:
        lse_rest = m + _LN2 * l_one
        m1 = torch.maximum(m, s_k.amax(1))
        lse1 = torch.logaddexp(lse_rest, torch.logsumexp(s_k, 1))
        hard = torch.where(in_range, lse1 - s_y, torch.nan)
        hard = torch.where(valid, hard, 0.0)
    if not grad:
        return soft, hard

    id_grad = g[:, :K] / tau
    c_ce = None
    if grad_ce:
        c_ce = torch.where(valid & in_range, scale.to(torch.float32) * spec.weight_hard, 0.0)
        softmax_k = torch.exp(s_k - lse1[:, None])
        id_grad = id_grad + c_ce[:, None] * (softmax_k - (ids == labels[:, None]).to(torch.float32))
        l_one_full = (lse1 - m1) * math.log2(math.e)
    coef = g[:, K] / tau if bucket else None
    _expand_kernel[(R,)](
        s, ids, id_grad.contiguous(), coef if bucket else m, m, l_tau,
        c_ce if grad_ce else m, m1 if grad_ce else m, l_one_full if grad_ce else m,
        labels if grad_ce else ids, V, K, math.log2(math.e) / tau,
        REST=bucket, CE=grad_ce, BLOCK_V=BLOCK_V, BLOCK_K=block_k, num_warps=NUM_WARPS,
    )
    return soft, hard


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
    if triton_rows._INTERPRET:
        return _INTERPRET_LANES
    return 256 if k <= 64 else 512 if k <= 128 else 1024


TOPK_MAX_K = _INTERPRET_LANES if triton_rows._INTERPRET else _CAP  # the sort keeps CAP candidates


@triton.jit
def _packed_key(x, ids):
    """An int64 that orders like the fp32 x (ties by id): the float's bits as a signed int with the
    magnitude bits flipped for negative x, in the high half; the id in the low half."""
    i = x.to(tl.int32, bitcast=True)
    return ((i ^ ((i >> 31) & 0x7FFFFFFF)).to(tl.int64) << 32) | ids.to(tl.int64)


_EMPTY: tl.constexpr = tl.constexpr(-(2**63))  # below every packed key: an unused slot


@triton.jit
def _candidate(x_row, col, c, slot: tl.constexpr):
    """The packed keys of each lane's candidate in `slot` (re-read from the row: a few per row)."""
    used = c > slot
    a = tl.load(x_row + col, mask=used, other=0.0).to(tl.float32)
    return tl.where(used, _packed_key(a, col), _EMPTY)


@triton.jit
def _compact(buf, keys, n, CAP: tl.constexpr):
    """Store the used keys at buf[n:], in lane order (up to CAP); returns n + their number."""
    used = keys != _EMPTY
    pos = n + tl.cumsum(used.to(tl.int32), 0) - 1
    tl.store(buf + pos, keys, mask=used & (pos < CAP))
    return n + tl.sum(used.to(tl.int32), 0)


@triton.jit
def _load_tile(x_row, offs, V):
    return tl.load(x_row + offs, mask=offs < V, other=-float("inf")).to(tl.float32)


@triton.jit
def _four_tiles(x_row, o, V, BLOCK_V: tl.constexpr):
    """The tiles at o, o + BLOCK_V, ... o + 3·BLOCK_V, loaded before any is used: more bytes in flight
    per thread than one tile a loop step (−inf past V)."""
    return (_load_tile(x_row, o, V), _load_tile(x_row, o + BLOCK_V, V), _load_tile(x_row, o + 2 * BLOCK_V, V),
            _load_tile(x_row, o + 3 * BLOCK_V, V))


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
    redo_ptr,  # (R,) int8 out: 1 where the candidates could not hold the top k (the row is redone)
    lse_ptr,  # (R,) fp32 out: logsumexp(x / τ)
    scratch_ptr,  # (R, CAP) int64: the row's candidates, packed, compacted
    V,
    k,
    log2e_tau,
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
    m = tl.full([BLOCK_V], _M_START, tl.float32)
    l = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, V, 4 * BLOCK_V):
        o = start + cols
        a0, a1, a2, a3 = _four_tiles(x_row, o, V, BLOCK_V)
        l = triton_rows._lane_sum(l, m, a0, log2e_tau)
        m = tl.maximum(m, a0)
        l = triton_rows._lane_sum(l, m, a1, log2e_tau)
        m = tl.maximum(m, a1)
        l = triton_rows._lane_sum(l, m, a2, log2e_tau)
        m = tl.maximum(m, a2)
        l = triton_rows._lane_sum(l, m, a3, log2e_tau)
        m = tl.maximum(m, a3)
    m_row = tl.max(m, 0)
    l_row = tl.sum(l * tl.exp2((m - m_row) * log2e_tau), 0)
    tl.store(lse_ptr + row, (m_row * log2e_tau + tl.log2(l_row)) * triton_rows._LN2)
    theta = tl.sum(tl.where(cols == k - 1, tl.sort(m, descending=True), 0.0), 0)

    tl.static_assert(SLOTS == 4)
    c = tl.zeros([BLOCK_V], tl.int32)  # candidates seen per lane
    col0 = tl.zeros([BLOCK_V], tl.int32)
    col1 = tl.zeros([BLOCK_V], tl.int32)
    col2 = tl.zeros([BLOCK_V], tl.int32)
    col3 = tl.zeros([BLOCK_V], tl.int32)
    for start in range(0, V, 4 * BLOCK_V):
        o = start + cols
        a0, a1, a2, a3 = _four_tiles(x_row, o, V, BLOCK_V)
        c, col0, col1, col2, col3 = _keep(a0, o, theta, c, col0, col1, col2, col3)
        c, col0, col1, col2, col3 = _keep(a1, o + BLOCK_V, theta, c, col0, col1, col2, col3)
        c, col0, col1, col2, col3 = _keep(a2, o + 2 * BLOCK_V, theta, c, col0, col1, col2, col3)
        c, col0, col1, col2, col3 = _keep(a3, o + 3 * BLOCK_V, theta, c, col0, col1, col2, col3)
    # compacted slot by slot: four scans of BLOCK_V keys (one SLOTS·BLOCK_V tensor would spill)
    buf = scratch_ptr + row.to(tl.int64) * CAP
    n = _compact(buf, _candidate(x_row, col0, c, 0), 0, CAP)
    n = _compact(buf, _candidate(x_row, col1, c, 1), n, CAP)
    n = _compact(buf, _candidate(x_row, col2, c, 2), n, CAP)
    n = _compact(buf, _candidate(x_row, col3, c, 3), n, CAP)
    tl.debug_barrier()  # the sort below reads what other threads stored
    slots = tl.arange(0, CAP)
    top = tl.sort(tl.load(buf + slots, mask=slots < n, other=_EMPTY), descending=True)
    tl.store(ids_ptr + row.to(tl.int64) * k + slots, top & 0xFFFFFFFF, mask=slots < k)
    tl.store(redo_ptr + row, ((tl.max(c, 0) > SLOTS) | (n > CAP) | (n < k)).to(tl.int8))


def row_topk(x: torch.Tensor, k: int, temperature: float, scale: float = 1.0, softcap: float | None = None):
    """The k largest entries per row of a contiguous (R, V) tensor and their log-probs
    log softmax(x/τ): (ids (R, k) int64, logprobs (R, k) fp32), sorted by decreasing value;
    k <= TOPK_MAX_K.

    One kernel, two reads of x. A row whose candidates did not fit (many ties at the threshold, or
    top values clustered in a few lanes) or that has fewer than k finite values is redone with
    torch.topk over the full row: finding out costs one host sync per call.
    """
    if scale != 1.0 or softcap is not None:
        raise NotImplementedError("the triton backend has no logit transforms yet: use backend='torch'")
    if not 1 <= k <= TOPK_MAX_K:
        raise ValueError(f"k: expected 1 <= k <= {TOPK_MAX_K} for the kernel, got {k}")
    ids, redo, lse = _kernel_topk(x, k, temperature)
    rows = redo.nonzero()[:, 0]
    if rows.numel():
        ids[rows] = torch.topk(x[rows], k, dim=-1).indices
    return ids, x.gather(1, ids).float() / temperature - lse[:, None]


def _kernel_topk(x: torch.Tensor, k: int, temperature: float):
    """The kernel alone on a contiguous (R, V) x: (ids (R, k) int64, redo (R,) int8, lse (R,) fp32)."""
    R, V = x.shape
    ids = torch.empty(R, k, dtype=torch.int64, device=x.device)
    redo = torch.empty(R, dtype=torch.int8, device=x.device)
    lse = torch.empty(R, dtype=torch.float32, device=x.device)
    scratch = torch.empty(R, _CAP, dtype=torch.int64, device=x.device)
    if R:
        _topk_kernel[(R,)](
            x, ids, redo, lse, scratch, V, k, math.log2(math.e) / temperature,
            SLOTS=_SLOTS, CAP=_CAP, BLOCK_V=_topk_lanes(k), num_warps=NUM_WARPS,
        )
    return ids, redo, lse
