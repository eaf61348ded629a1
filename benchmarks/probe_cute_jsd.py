"""A JSD row pass that reads each row of S and T once: the row split over a thread-block cluster, its
slices held in registers across the three passes, the row constants exchanged between the cluster's
CTAs. GPU only; needs nvidia-cutlass-dsl (`pip install 'flashkd[cute]'`, or the carried .cute/).

The Triton row kernels read S and T three times (statistics, K = Σ q log(q/M), the gradient), as a
program cannot see another's registers or shared memory. A cluster's CTAs run together, so a row can
be split over C of them: each loads its slice of S and T once (fp32, 8 bytes an element), the C partial
(max, sum-exp) pairs and then the C partial K sums go through global memory behind a cluster barrier
(release / acquire), and each CTA writes its slice's dL/ds in bf16 (2 bytes an element): 10 bytes an
element against the Triton kernel's 26.

JSD(β) soft term alone, τ = 1, per row: loss (R,) fp32 and dL/ds (R, V) bf16. Checked against float64
autograd on a sample of rows, and against flashkd's Triton rows on all of them; timed against those
rows and a copy (median of --reps, CUDA events).

    python benchmarks/probe_cute_jsd.py [--rows 8192] [--vocab 128256] [--reps 30] [--out FILE.json]
"""

import argparse
import json
import math
import sys
import time

import torch

from probe_cute_rows import median_ms, merge, warp_merge  # beside this file: run as a script from benchmarks/

THREADS = 512
EPT = 32  # elements a thread holds of each of S and T (64 registers of the 128 a thread has at 512)
SLICE = THREADS * EPT  # columns a CTA holds
WARPS = THREADS // 32
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
LOWEST = -3.0e38  # padding and the max's start: finite, so that differences of two stay finite
BETA = 0.5


def build(cluster):
    import cutlass
    import cutlass.cute as cute

    l2b, l2nb = math.log2(BETA), math.log2(1.0 - BETA)

    def warp_sum(x):
        for width in (16, 8, 4, 2, 1):
            x = x + cute.arch.shuffle_sync_bfly(x, offset=width)
        return x

    def log2_mix(lq, lp):
        """log2(β 2^lp + (1 − β) 2^lq), stable: max + log2(1 + 2^−|a − b|)."""
        a, b = lp + l2b, lq + l2nb
        mx = cute.arch.fmax(a, b)
        return mx + cute.math.log2(1.0 + cute.arch.exp2((a + b - mx) - mx))

    @cute.kernel
    def jsd_kernel(s: cute.Tensor, t: cute.Tensor, ds: cute.Tensor, loss: cute.Tensor, part: cute.Tensor,
                   v: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        rank, row, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        smem = cutlass.memory.SmemAllocator()
        red = smem.allocate_tensor(cutlass.Float32, cute.make_layout(WARPS * 4))
        xs = cute.make_rmem_tensor(EPT, cutlass.Float32)
        xt = cute.make_rmem_tensor(EPT, cutlass.Float32)
        base = rank * SLICE + tid

        # pass 1, the only read of S and T: the slice into registers (log2 units), its max, then its sum-exp
        ms = cutlass.Float32(LOWEST)
        mt = cutlass.Float32(LOWEST)
        for i in cutlass.range_constexpr(EPT):
            c = base + i * THREADS
            if c < v:
                xs[i] = s[row, c] * cutlass.Float32(LOG2E)
                xt[i] = t[row, c] * cutlass.Float32(LOG2E)
            else:
                xs[i] = cutlass.Float32(LOWEST)
                xt[i] = cutlass.Float32(LOWEST)
            ms = cute.arch.fmax(ms, xs[i])
            mt = cute.arch.fmax(mt, xt[i])
        es = cutlass.Float32(0.0)
        et = cutlass.Float32(0.0)
        for i in cutlass.range_constexpr(EPT):
            es = es + cute.arch.exp2(xs[i] - ms)
            et = et + cute.arch.exp2(xt[i] - mt)
        ms, es = warp_merge(ms, es)
        mt, et = warp_merge(mt, et)
        if lane == 0:
            red[warp * 4 + 0] = ms
            red[warp * 4 + 1] = es
            red[warp * 4 + 2] = mt
            red[warp * 4 + 3] = et
        cute.arch.sync_threads()
        if warp == 0:
            ms = cutlass.Float32(LOWEST)
            es = cutlass.Float32(0.0)
            mt = cutlass.Float32(LOWEST)
            et = cutlass.Float32(0.0)
            if lane < WARPS:
                ms = red[lane * 4 + 0]
                es = red[lane * 4 + 1]
                mt = red[lane * 4 + 2]
                et = red[lane * 4 + 3]
            ms, es = warp_merge(ms, es)
            mt, et = warp_merge(mt, et)
            if lane == 0:
                part[row, rank, 0] = ms
                part[row, rank, 1] = es
                part[row, rank, 2] = mt
                part[row, rank, 3] = et
        cute.arch.cluster_arrive()  # release: this CTA's partials, to the cluster
        cute.arch.cluster_wait()  # acquire: every CTA's
        ms = cutlass.Float32(LOWEST)
        es = cutlass.Float32(0.0)
        mt = cutlass.Float32(LOWEST)
        et = cutlass.Float32(0.0)
        for j in cutlass.range_constexpr(cluster):
            ms, es = merge(ms, es, part[row, j, 0], part[row, j, 1])
            mt, et = merge(mt, et, part[row, j, 2], part[row, j, 3])
        lse_s = ms + cute.math.log2(es)
        lse_t = mt + cute.math.log2(et)

        # pass 2, from registers: the divergence and K's sums
        kl = cutlass.Float32(0.0)
        kq = cutlass.Float32(0.0)
        for i in cutlass.range_constexpr(EPT):
            lq = xs[i] - lse_s
            lp = xt[i] - lse_t
            lm = log2_mix(lq, lp)
            q = cute.arch.exp2(lq)
            p = cute.arch.exp2(lp)
            kq = kq + q * (lq - lm)
            kl = kl + cutlass.Float32(BETA) * p * (lp - lm) + cutlass.Float32(1.0 - BETA) * q * (lq - lm)
        kl = warp_sum(kl)
        kq = warp_sum(kq)
        if lane == 0:
            red[warp * 4 + 0] = kl
            red[warp * 4 + 1] = kq
        cute.arch.sync_threads()
        if warp == 0:
            kl = cutlass.Float32(0.0)
            kq = cutlass.Float32(0.0)
            if lane < WARPS:
                kl = red[lane * 4 + 0]
                kq = red[lane * 4 + 1]
            kl = warp_sum(kl)
            kq = warp_sum(kq)
            if lane == 0:
                part[row, rank, 4] = kl
                part[row, rank, 5] = kq
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        k_row = cutlass.Float32(0.0)
        l_row = cutlass.Float32(0.0)
        for j in cutlass.range_constexpr(cluster):
            l_row = l_row + part[row, j, 4]
            k_row = k_row + part[row, j, 5]
        k_row = k_row * cutlass.Float32(LN2)
        if rank == 0:
            if tid == 0:
                loss[row] = l_row * cutlass.Float32(LN2)

        # pass 3, from registers: dL/ds = (1 − β) q (ln(q / M) − K), written once in bf16
        for i in cutlass.range_constexpr(EPT):
            c = base + i * THREADS
            lq = xs[i] - lse_s
            lm = log2_mix(lq, xt[i] - lse_t)
            g = cutlass.Float32(1.0 - BETA) * cute.arch.exp2(lq) * ((lq - lm) * cutlass.Float32(LN2) - k_row)
            if c < v:
                ds[row, c] = g.to(cutlass.BFloat16)

    @cute.jit
    def jsd_rows(s: cute.Tensor, t: cute.Tensor, ds: cute.Tensor, loss: cute.Tensor, part: cute.Tensor,
                 v: cutlass.Int32):
        jsd_kernel(s, t, ds, loss, part, v).launch(grid=(cluster, s.shape[0], 1), block=(THREADS, 1, 1),
                                                    cluster=(cluster, 1, 1))

    return jsd_rows


def reference(s, t):
    """float64 JSD(β) per row and its gradient w.r.t. s."""
    s = s.double().requires_grad_()
    lq, lp = torch.log_softmax(s, -1), torch.log_softmax(t.double(), -1)
    lm = torch.logaddexp(lp + math.log(BETA), lq + math.log1p(-BETA))
    per_row = BETA * (lp.exp() * (lp - lm)).sum(-1) + (1 - BETA) * (lq.exp() * (lq - lm)).sum(-1)
    (g,) = torch.autograd.grad(per_row.sum(), s)
    return per_row.detach(), g


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_cute_jsd: needs a CUDA GPU (CuTe DSL compiles for the GPU only)")
    try:
        import cutlass.cute as cute
        from cutlass.cute.runtime import from_dlpack
    except ImportError as e:
        sys.exit(f"probe_cute_jsd: needs nvidia-cutlass-dsl ({e})")
    cluster = -(-a.vocab // SLICE)
    if cluster > 8:
        sys.exit(f"probe_cute_jsd: vocab {a.vocab} needs {cluster} CTAs a row, over the portable cluster size 8")
    R, V = a.rows, a.vocab
    gen = torch.Generator(device="cuda").manual_seed(0)
    s = 4.0 * torch.randn(R, V, device="cuda", generator=gen)  # a trained head's magnitudes
    t = 4.0 * torch.randn(R, V, device="cuda", generator=gen)
    s[::4, 11], t[::4, 11] = 30.0, 28.0
    ds = torch.empty(R, V, device="cuda", dtype=torch.bfloat16)
    loss = torch.empty(R, device="cuda")
    part = torch.empty(R, cluster, 8, device="cuda")
    args = [from_dlpack(x, assumed_align=16) for x in (s, t, ds, loss, part)]
    result = {"rows": R, "vocab": V, "cluster": cluster, "threads": THREADS, "per_thread": EPT}
    t0 = time.perf_counter()
    compiled = cute.compile(build(cluster), *args, V)
    result["compile_s"] = time.perf_counter() - t0
    compiled(*args, V)
    torch.cuda.synchronize()

    sample = torch.cat([torch.arange(0, 16), torch.arange(R - 16, R)]).cuda()
    want_loss, want_g = reference(s[sample], t[sample])
    # the sampled rows' summed loss, as a call reduces them: a row whose S and T share a peak has a JSD near 1e-5,
    # whose own fp32 relative error is ~1e-3 in any formulation (the Triton rows' too)
    result["loss_rel_err"] = (abs(loss[sample].double().sum() - want_loss.sum()) / want_loss.sum()).item()
    result["ds_rel_err"] = ((ds[sample].double() - want_g).norm(dim=-1) / want_g.norm(dim=-1)).max().item()

    from flashkd.backends import triton_rows
    from flashkd.losses import LossSpec

    spec = LossSpec(loss="jsd", beta=BETA, weight_hard=0.0, weight_soft=1.0, want_hard=False)
    one = torch.ones((), device="cuda")
    ds_tr = torch.empty_like(ds)

    def triton_call():
        return triton_rows.rows(s, t, None, spec, one, True, ds=ds_tr)

    soft, _ = triton_call()[:2]
    torch.cuda.synchronize()
    result["triton_loss_rel_err"] = (abs(soft[sample].double().sum() - want_loss.sum()) / want_loss.sum()).item()
    result["triton_ds_rel_err"] = ((ds_tr[sample].double() - want_g).norm(dim=-1) / want_g.norm(dim=-1)).max().item()
    result["cute_vs_triton_loss"] = (abs(loss.double().sum() - soft.double().sum()) / soft.double().sum()).item()

    gb = R * V * 10 / 1e9  # the one-read design's bytes: S and T read once (fp32), dL/ds written once (bf16)
    for name, fn in (("cute", lambda: compiled(*args, V)), ("triton", triton_call), ("copy of S", lambda: s.clone())):
        fn()
        ms, p20, p80 = median_ms(fn, a.reps)
        result[name] = {"ms": ms, "p20": p20, "p80": p80}
    result["copy_tb_per_s"] = R * V * 8 / 1e9 / result["copy of S"]["ms"]
    result["cute_tb_per_s_at_10_bytes"] = gb / result["cute"]["ms"]
    result["bound_ms_at_copy_speed"] = gb / result["copy_tb_per_s"]
    print(json.dumps(result, indent=2))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)
    ok = result["loss_rel_err"] <= 1e-5 and result["ds_rel_err"] <= 2 * max(result["triton_ds_rel_err"], 2.0**-9)
    sys.exit(0 if ok else "probe_cute_jsd: wrong result (loss_rel_err, ds_rel_err above)")


if __name__ == "__main__":
    main()
