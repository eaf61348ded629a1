"""The row pass on CuTe DSL (Hopper, sm_90): each row of fp32 logits s, t read once, held on a thread-block
cluster, for the softmax divergences whose gradient needs a row scalar (JSD's K, TVD's masses) or none
(forward KL), with the CE beside them. The contract and the results are `triton_rows.rows`'s
(`flashkd.backends`), for the calls `fits` takes.

A Triton program cannot see another's registers, so the Triton rows read a row of s and t two or three
times: once for the softmax statistics (or take them from the logits GEMMs, `rows(..., tiles=)`), once
for the loss and the row scalars, once for dL/ds. Here a row is split over the C CTAs of a cluster
(`shape`): each thread loads its columns of s and t once (coalesced: column rank·slice + tid +
i·threads), into registers (t's into registers or shared memory, `LAYOUTS`), and the CTAs exchange
their partial sums through distributed shared memory behind cluster barriers (release / acquire), twice:

    phase A  load; per-CTA max and sum-exp of s/τ, t/τ (and of s for the CE when τ ≠ 1)
    -- exchange 1: the row's statistics --
    phase B  from registers: log2 q, log2 p, the loss terms and the sums the gradient needs
             (`triton_rows`' pass 2, the same formulas), keeping per column what dL/ds takes
    -- exchange 2: the row's sums --
    phase C  from registers: dL/ds, written once (bf16 into `triton_rows.grad_view(s, ...)`: s's own
             bytes, safe as every CTA of the row has read its columns before the first exchange)

Bytes an element: 4 + 4 read, 2 written (the Triton rows with the GEMMs' tile statistics: 16 read, 2
written). Rows whose label is `ignore_index` write zeros. Math as the Triton rows': log2 units, the row
maxima subtracted first, JSD's log(q/M) by `_mixture`'s log-add-exp, TVD's σ − Σ q σ from the masses
below, above and at p.

Needs nvidia-cutlass-dsl (`pip install 'flashkd[cute]'`) and an sm_90 GPU; compiles once per variant
(loss, CE, C, threads) in a process.
"""

import math

import torch

from ..losses import LossSpec

# A thread's columns and a CTA's threads at most, by where t's columns are held (`shape`, T_SMEM):
#   registers:      32 of s and 32 of t in registers, 512 threads: 128 registers a thread, one CTA an SM
#   shared memory:  64 of s in registers, t's 64 a thread in 64 KiB of shared memory, 256 threads: two CTAs
#                   an SM, so that one loads while the other waits at a cluster barrier
LAYOUTS = {False: (32, 512), True: (64, 256)}
T_SMEM = True
MAX_CLUSTER = 8  # the portable cluster size
MAX_V = MAX_CLUSTER * 32 * 512  # 131072 either way: wider rows run on the Triton rows
KINDS = ("jsd", "tvd", "forward_kl")
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
M_START = -3.0e38  # a running max's start: finite, so that a CTA with no column in the vocab adds 0, not NaN
LOG2_MIN = -(2.0**100)  # `triton_rows._mixture`'s floor of a log2 probability

_compiled = {}


def fits(spec: LossSpec, grad: bool, stats: bool, v: int) -> bool:
    """Whether this kernel takes the call: a dense-teacher divergence of KINDS (JSD's endpoints are the
    KLs: reverse KL is not here), heads without transforms, no stats, 1 <= V <= MAX_V."""
    return (spec.want_soft and spec.kind in KINDS and not stats and 1 <= v <= MAX_V and spec.tail is None
            and spec.student_logit_scale == 1.0 and spec.teacher_logit_scale == 1.0
            and spec.student_softcap is None and spec.teacher_softcap is None)


def shape(v: int, t_smem: bool = T_SMEM) -> tuple[int, int, int]:
    """(C, threads, columns a thread): the CTAs a row is split over and their threads (a multiple of 32),
    as few CTAs as hold the row at the layout's most threads, then as few threads as hold it."""
    ept, most = LAYOUTS[t_smem]
    cluster = max(1, -(-v // (ept * most)))
    threads = 32 * -(-v // (cluster * ept * 32))
    return cluster, threads, ept


def _build(kind: str, ce: bool, ce_is_q: bool, grad: bool, labels: bool, cluster: int, threads: int, ept: int,
           t_smem: bool):
    import cutlass
    import cutlass.cute as cute
    from cutlass._mlir.dialects import llvm, nvvm
    from cutlass.cutlass_dsl import T, dsl_user_op

    f32 = cutlass.Float32
    warps = threads // 32
    slice_ = threads * ept
    jsd, tvd, fkl = kind == "jsd", kind == "tvd", kind == "forward_kl"
    parts = 8  # floats a CTA exchanges: 5 statistics (slots 0–4), then 4 sums (slots 8–11)

    @dsl_user_op
    def peer_load(ptr, rank, *, loc=None, ip=None):
        """An fp32 of CTA `rank`'s shared memory at this CTA's address of it (ld.shared::cluster)."""
        far = nvvm.mapa(llvm.PointerType.get(cutlass.AddressSpace.dsmem), ptr.to_llvm_ptr(loc=loc, ip=ip),
                        cutlass.Int32(rank).ir_value(loc=loc, ip=ip), loc=loc, ip=ip)
        return f32(llvm.load(T.f32(), far, loc=loc, ip=ip))

    def merge(m, l, m_o, l_o, k):
        """Two (max, Σ 2^((x − max)·k)) pairs into one."""
        n = cute.arch.fmax(m, m_o)
        return n, l * cute.math.exp2((m - n) * k, fastmath=True) + l_o * cute.math.exp2((m_o - n) * k, fastmath=True)

    def at(i, tid):
        """Where the thread's i-th column of t is held: its own register, or its own word of shared memory."""
        return i * threads + tid if t_smem else i

    def warp_sum(x):
        for width in (16, 8, 4, 2, 1):
            x = x + cute.arch.shuffle_sync_bfly(x, offset=width)
        return x

    def warp_max(x):
        for width in (16, 8, 4, 2, 1):
            x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=width))
        return x

    @cute.kernel
    def rows_kernel(s: cute.Tensor, t: cute.Tensor, ds: cute.Tensor, y: cute.Tensor, scale: cute.Tensor,
                    soft_out: cute.Tensor, hard_out: cute.Tensor, v: cutlass.Int32, stride_scale: cutlass.Int32,
                    ignore_index: cutlass.Int64, k_s: f32, k_t: f32, inv_tau: f32, beta: f32, log2_beta: f32,
                    log2_1mbeta: f32, w_hard: f32, w_soft: f32):
        tid, _, _ = cute.arch.thread_idx()
        rank, row, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        smem = cutlass.memory.SmemAllocator()
        red = smem.allocate_tensor(f32, cute.make_layout(warps * parts))
        xch = smem.allocate_tensor(f32, cute.make_layout(2 * parts), byte_alignment=16)
        whole = smem.allocate_tensor(f32, cute.make_layout(2 * parts))  # the row's, as warp 0 merged them
        xs = cute.make_rmem_tensor(ept, f32)
        if cutlass.const_expr(t_smem):  # a warp's 32 threads read 32 consecutive words: no bank conflicts
            xt = smem.allocate_tensor(f32, cute.make_layout(ept * threads), byte_alignment=16)
        else:
            xt = cute.make_rmem_tensor(ept, f32)

        base = rank * slice_ + tid
        valid = True
        label = cutlass.Int64(-1)
        if cutlass.const_expr(labels):
            label = y[row]
            valid = label != ignore_index
        if valid:  # the same for every CTA of the row's cluster: their barriers match
            in_range = (label >= 0) and (label < v.to(cutlass.Int64))
            s_y = f32(0.0)
            if cutlass.const_expr(ce):
                if in_range:  # read before any CTA of the row writes dL/ds (after exchange 1)
                    s_y = s[row, label.to(cutlass.Int32)]
            # ---- phase A: the only read of the row; this CTA's statistics
            m_s = f32(M_START)
            m_t = f32(M_START)
            for i in cutlass.range_constexpr(ept):
                c = base + i * threads
                if c < v:
                    xs[i] = s[row, c]
                    xt[at(i, tid)] = t[row, c]
                else:
                    xs[i] = f32(-math.inf)
                    xt[at(i, tid)] = f32(-math.inf)
                m_s = cute.arch.fmax(m_s, xs[i])
                m_t = cute.arch.fmax(m_t, xt[at(i, tid)])
            m_s = warp_max(m_s)
            m_t = warp_max(m_t)
            if lane == 0:
                red[warp * parts + 0] = m_s
                red[warp * parts + 3] = m_t
            cute.arch.sync_threads()
            m_s = f32(M_START)
            m_t = f32(M_START)
            for j in cutlass.range_constexpr(warps):  # the CTA's maxima: one sum a column, no merges
                m_s = cute.arch.fmax(m_s, red[j * parts + 0])
                m_t = cute.arch.fmax(m_t, red[j * parts + 3])
            l_s = f32(0.0)
            l_c = f32(0.0)
            l_t = f32(0.0)
            for i in cutlass.range_constexpr(ept):
                l_s = l_s + cute.math.exp2((xs[i] - m_s) * k_s, fastmath=True)
                l_t = l_t + cute.math.exp2((xt[at(i, tid)] - m_t) * k_t, fastmath=True)
                if cutlass.const_expr(ce and not ce_is_q):
                    l_c = l_c + cute.math.exp2((xs[i] - m_s) * f32(LOG2E), fastmath=True)
            l_s = warp_sum(l_s)
            l_t = warp_sum(l_t)
            if cutlass.const_expr(ce and not ce_is_q):
                l_c = warp_sum(l_c)
            cute.arch.sync_threads()  # every warp has read red's maxima
            if lane == 0:
                red[warp * parts + 1] = l_s
                red[warp * parts + 2] = l_c
                red[warp * parts + 4] = l_t
            cute.arch.sync_threads()
            if tid == 0:
                l_s = f32(0.0)
                l_c = f32(0.0)
                l_t = f32(0.0)
                for j in cutlass.range_constexpr(warps):
                    l_s = l_s + red[j * parts + 1]
                    l_c = l_c + red[j * parts + 2]
                    l_t = l_t + red[j * parts + 4]
                xch[0] = m_s
                xch[1] = l_s
                xch[2] = l_c
                xch[3] = m_t
                xch[4] = l_t
            # ---- exchange 1: every CTA's statistics, read from its shared memory by warp 0 (lane j: CTA j's),
            # merged there and handed to the CTA's threads through `whole`
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            if warp == 0:
                m_s = f32(M_START)
                m_t = f32(M_START)
                l_s = f32(0.0)
                l_c = f32(0.0)
                l_t = f32(0.0)
                if lane < cluster:
                    m_s = peer_load(xch.iterator + 0, lane)
                    l_s = peer_load(xch.iterator + 1, lane)
                    l_c = peer_load(xch.iterator + 2, lane)
                    m_t = peer_load(xch.iterator + 3, lane)
                    l_t = peer_load(xch.iterator + 4, lane)
                m_row = warp_max(m_s)
                mt_row = warp_max(m_t)
                l_s = warp_sum(l_s * cute.math.exp2((m_s - m_row) * k_s, fastmath=True))
                if cutlass.const_expr(ce and not ce_is_q):
                    l_c = warp_sum(l_c * cute.math.exp2((m_s - m_row) * f32(LOG2E), fastmath=True))
                l_t = warp_sum(l_t * cute.math.exp2((m_t - mt_row) * k_t, fastmath=True))
                if lane == 0:
                    whole[0] = m_row
                    whole[1] = l_s
                    whole[2] = l_c
                    whole[3] = mt_row
                    whole[4] = l_t
            cute.arch.sync_threads()
            m_s = whole[0]
            l_s = whole[1]
            l_c = whole[2]
            m_t = whole[3]
            l_t = whole[4]
            log2_l_s = cute.math.log2(l_s)
            log2_l_t = cute.math.log2(l_t)
            log2_l_c = log2_l_s
            if cutlass.const_expr(ce and not ce_is_q):
                log2_l_c = cute.math.log2(l_c)
            hard = f32(0.0)
            if cutlass.const_expr(ce):
                hard = (m_s - s_y) + f32(LN2) * log2_l_c if in_range else f32(math.nan)
            row_scale = scale[row * stride_scale]
            c_ce = f32(0.0)
            if cutlass.const_expr(ce):
                c_ce = row_scale * w_hard if in_range else f32(0.0)  # an out-of-range label: NaN, no gradient
            c_st = row_scale * w_soft * inv_tau
            c_q = c_ce if cutlass.const_expr(ce and ce_is_q) else f32(0.0)  # the CE's softmax(s) is q
            # ---- phase B: from registers; xs keeps log2 q, xt what dL/ds needs besides
            acc = f32(0.0)
            acc2 = f32(0.0)
            acc3 = f32(0.0)
            acc4 = f32(0.0)
            for i in cutlass.range_constexpr(ept):
                lq = (xs[i] - m_s) * k_s - log2_l_s
                lp = (xt[at(i, tid)] - m_t) * k_t - log2_l_t
                p = cute.math.exp2(lp, fastmath=True)
                if cutlass.const_expr(fkl):
                    acc = acc + (p * (lp - lq) if p > f32(0.0) else f32(0.0))  # 0 · log 0 = 0
                    xt[at(i, tid)] = p
                elif cutlass.const_expr(jsd):
                    q = cute.math.exp2(lq, fastmath=True)
                    z = (cute.arch.fmax(lp, f32(LOG2_MIN)) - cute.arch.fmax(lq, f32(LOG2_MIN))) + (log2_beta - log2_1mbeta)
                    w = cute.math.log2(f32(1.0) + cute.math.exp2(-cute.math.absf(z), fastmath=True), fastmath=True)
                    acc = acc + p * (cute.arch.fmin(z, f32(0.0)) - w)
                    x = w + cute.arch.fmax(z, f32(0.0))
                    acc2 = acc2 - q * x
                    xt[at(i, tid)] = x
                else:
                    q = cute.math.exp2(lq, fastmath=True)
                    acc = acc + cute.math.absf(q - p)
                    lo = q if lq < lp else f32(0.0)
                    hi = q if lq > lp else f32(0.0)
                    acc2 = acc2 + lo
                    acc3 = acc3 + hi
                    acc4 = acc4 + (q if lq == lp else f32(0.0))
                    xt[at(i, tid)] = f32(1.0) if lq > lp else (f32(-1.0) if lq < lp else f32(0.0))
                xs[i] = lq
            acc = warp_sum(acc)
            acc2 = warp_sum(acc2)
            acc3 = warp_sum(acc3)
            acc4 = warp_sum(acc4)
            cute.arch.sync_threads()  # red's statistics read
            if lane == 0:
                red[warp * parts + 0] = acc
                red[warp * parts + 1] = acc2
                red[warp * parts + 2] = acc3
                red[warp * parts + 3] = acc4
            cute.arch.sync_threads()
            if tid == 0:
                acc = f32(0.0)
                acc2 = f32(0.0)
                acc3 = f32(0.0)
                acc4 = f32(0.0)
                for j in cutlass.range_constexpr(warps):
                    acc = acc + red[j * parts + 0]
                    acc2 = acc2 + red[j * parts + 1]
                    acc3 = acc3 + red[j * parts + 2]
                    acc4 = acc4 + red[j * parts + 3]
                xch[8] = acc  # beside exchange 1's slots, which other CTAs may still be reading
                xch[9] = acc2
                xch[10] = acc3
                xch[11] = acc4
            # ---- exchange 2: every CTA's sums, as exchange 1's
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            if warp == 0:
                acc = f32(0.0)
                acc2 = f32(0.0)
                acc3 = f32(0.0)
                acc4 = f32(0.0)
                if lane < cluster:
                    acc = peer_load(xch.iterator + 8, lane)
                    acc2 = peer_load(xch.iterator + 9, lane)
                    acc3 = peer_load(xch.iterator + 10, lane)
                    acc4 = peer_load(xch.iterator + 11, lane)
                acc = warp_sum(acc)
                acc2 = warp_sum(acc2)
                acc3 = warp_sum(acc3)
                acc4 = warp_sum(acc4)
                if lane == 0:
                    whole[5] = acc
                    whole[6] = acc2
                    whole[7] = acc3
                    whole[8] = acc4
            cute.arch.sync_threads()
            acc = whole[5]
            acc2 = whole[6]
            acc3 = whole[7]
            acc4 = whole[8]
            soft = f32(0.0)
            f1 = f32(0.0)
            f0 = f32(0.0)
            f_lo = f32(0.0)
            f_hi = f32(0.0)
            f_eq = f32(0.0)
            if cutlass.const_expr(fkl):
                soft = f32(LN2) * acc
            elif cutlass.const_expr(jsd):
                k_jsd = f32(LN2) * (acc2 - log2_1mbeta)  # K = Σ q log(q/M)
                soft = beta * f32(LN2) * (acc - log2_beta) + (f32(1.0) - beta) * k_jsd
                f1 = -c_st * (f32(1.0) - beta) * f32(LN2)
                f0 = c_q + f1 * log2_1mbeta - c_st * (f32(1.0) - beta) * k_jsd
            else:
                # σ − Σ q σ for σ = +1, −1, 0 from the masses of q below, above and at p: sums of
                # non-negative terms, accurate where Σ q σ is near ±1
                soft = f32(0.5) * acc
                f_lo = c_q - f32(0.5) * c_st * (f32(2.0) * acc3 + acc4)
                f_hi = c_q + f32(0.5) * c_st * (f32(2.0) * acc2 + acc4)
                f_eq = c_q + f32(0.5) * c_st * (acc2 - acc3)
            # ---- phase C: dL/ds from registers, written once
            if cutlass.const_expr(grad):
                k_ce = f32(0.0)
                if cutlass.const_expr(ce and not ce_is_q):
                    k_ce = log2_l_s / inv_tau - log2_l_c  # log2 softmax(s) = τ · log2 q + this
                for i in cutlass.range_constexpr(ept):
                    c = base + i * threads
                    q = cute.math.exp2(xs[i], fastmath=True)
                    g = f32(0.0)
                    if cutlass.const_expr(fkl):
                        g = q * (c_st + c_q) - xt[at(i, tid)] * c_st
                    elif cutlass.const_expr(jsd):
                        g = q * (f1 * xt[at(i, tid)] + f0)
                    else:
                        g = q * (f_hi if xt[at(i, tid)] > f32(0.0) else (f_lo if xt[at(i, tid)] < f32(0.0) else f_eq))
                    if cutlass.const_expr(ce and ce_is_q):
                        g = g - (c_ce if c.to(cutlass.Int64) == label else f32(0.0))
                    elif cutlass.const_expr(ce):
                        sm = cute.math.exp2(xs[i] / inv_tau + k_ce, fastmath=True)
                        g = g + c_ce * (sm - (f32(1.0) if c.to(cutlass.Int64) == label else f32(0.0)))
                    if c < v:
                        ds[row, c] = g.to(ds.element_type)
            if rank == 0:
                if tid == 0:
                    soft_out[row] = soft
                    hard_out[row] = hard
            # no CTA leaves while another may still read its shared memory
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            if cutlass.const_expr(grad):
                for i in cutlass.range_constexpr(ept):
                    c = base + i * threads
                    if c < v:
                        ds[row, c] = f32(0.0).to(ds.element_type)
            if rank == 0:
                if tid == 0:
                    soft_out[row] = f32(0.0)
                    hard_out[row] = f32(0.0)

    @cute.jit
    def launch(s: cute.Tensor, t: cute.Tensor, ds: cute.Tensor, y: cute.Tensor, scale: cute.Tensor,
               soft_out: cute.Tensor, hard_out: cute.Tensor, v: cutlass.Int32, stride_scale: cutlass.Int32,
               ignore_index: cutlass.Int64, k_s: f32, k_t: f32, inv_tau: f32, beta: f32, log2_beta: f32,
               log2_1mbeta: f32, w_hard: f32, w_soft: f32, stream):
        rows_kernel(s, t, ds, y, scale, soft_out, hard_out, v, stride_scale, ignore_index, k_s, k_t, inv_tau, beta,
                    log2_beta, log2_1mbeta, w_hard, w_soft).launch(
            grid=(cluster, s.shape[0], 1), block=(threads, 1, 1), cluster=(cluster, 1, 1), stream=stream)

    return launch


def rows(s, t, labels, spec: LossSpec, scale: torch.Tensor, grad: bool, stats: bool = False, *, ds=None,
         t_smem: bool = T_SMEM):
    """`triton_rows.rows`'s (soft, hard) and dL/ds into ds, for the calls `fits` takes: s (R, V) fp32
    contiguous, t (R, V) fp32 with unit column stride, labels (R,) int32 / int64 or None, scale () or (R,)
    fp32, ds (R, V) bf16 / fp16 with unit column stride (`triton_rows.grad_view(s, ...)` or a buffer of
    its own) when grad. t_smem: where t's columns are held (LAYOUTS). Asynchronous on the current stream."""
    r, v = s.shape
    if not fits(spec, grad, stats, v):
        raise ValueError(f"spec: the CuTe rows take {', '.join(KINDS)} without head transforms or stats, "
                         f"V <= {MAX_V} (`fits`), got loss {spec.kind!r} at V = {v}")
    if s.dtype != torch.float32 or t is None or t.dtype != torch.float32 or t.shape != s.shape or not s.is_contiguous() \
            or t.stride(1) != 1:
        raise ValueError(f"s, t: expected ({r}, {v}) fp32 logits, s contiguous, t with unit column stride")
    if grad and (ds is None or ds.shape != s.shape or ds.dtype not in (torch.bfloat16, torch.float16)
                 or ds.stride(1) != 1):
        raise ValueError(f"ds: expected an ({r}, {v}) bf16 / fp16 tensor with unit column stride")
    if scale.dtype != torch.float32 or scale.shape not in ((), (r,)):
        raise TypeError(f"scale: expected a 0-d or ({r},) float32 tensor, got {scale.dtype} {tuple(scale.shape)}")
    soft = torch.empty(r, dtype=torch.float32, device=s.device)
    hard = torch.empty(r, dtype=torch.float32, device=s.device)
    if r == 0:
        return soft, hard
    ce = spec.want_hard and labels is not None
    ce_is_q = ce and spec.temperature == 1.0
    cluster, threads, ept = shape(v, t_smem)
    y = labels.to(torch.int64) if labels is not None else torch.zeros(1, dtype=torch.int64, device=s.device)
    jsd = spec.kind == "jsd"
    if not grad:  # never written: a stand-in of the compiled signature's rank
        ds = torch.empty(1, 1, dtype=torch.bfloat16, device=s.device)
    args = [_as_cute(s, 4), _as_cute(t, 4), _as_cute(ds, 2),
            _as_cute(y, 8), _as_cute(scale.reshape(-1), 4), _as_cute(soft, 4), _as_cute(hard, 4),
            v, 1 if scale.dim() else 0, spec.ignore_index, LOG2E / spec.temperature, LOG2E / spec.temperature,
            1.0 / spec.temperature, float(spec.beta), math.log2(spec.beta) if jsd else 0.0,
            math.log1p(-spec.beta) / LN2 if jsd else 0.0, float(spec.weight_hard), float(spec.soft_scale),
            _stream(s.device)]
    key = (spec.kind, ce, ce_is_q, grad, labels is not None, cluster, threads, ept, t_smem, ds.dtype)
    fn = _compiled.get(key)
    if fn is None:
        import cutlass.cute as cute

        fn = _compiled[key] = cute.compile(
            _build(spec.kind, ce, ce_is_q, grad, labels is not None, cluster, threads, ept, t_smem), *args)
    fn(*args)
    return soft, hard


def _as_cute(x: torch.Tensor, align: int = 16):
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(x.detach(), assumed_align=align).mark_layout_dynamic(leading_dim=x.dim() - 1)


def _stream(device):
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)
