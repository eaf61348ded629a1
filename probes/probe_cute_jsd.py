"""A JSD row pass that reads each row of S and T once: the row split over a thread-block cluster, its
slices held in registers across the three passes, the row constants exchanged between the cluster's
CTAs. GPU only; needs nvidia-cutlass-dsl (`pip install 'flashkd[cute]'`, or the carried .cute/).

The Triton row kernels read S and T three times (statistics, K = Σ q log(q/M), the gradient), as a
program cannot see another's registers or shared memory. A cluster's CTAs run together, so a row can
be split over C of them: each loads its slice of S and T once (fp32, 8 bytes an element), the C partial
(max, sum-exp) pairs and then the C partial K sums go through global or distributed shared memory behind
a cluster barrier (release / acquire), and each CTA writes its slice's dL/ds in bf16 (2 bytes an element),
into a buffer or over S's own bytes: 10 bytes an element against the Triton kernel's 26.

JSD(β) soft term alone, τ = 1, per row: loss (R,) fp32 and dL/ds (R, V) bf16. Checked against float64
autograd on a sample of rows, and against flashkd's Triton rows on all of them; timed against those
rows and a copy (median of --reps, CUDA events).

    python probes/probe_cute_jsd.py [--rows 8192] [--vocab 128256] [--reps 30] [--out FILE.json]
"""

import argparse
import json
import math
import sys
import time

import torch

from probe_cute_rows import finish, median_ms, merge, warp_merge  # beside this file: run as a script from probes/

# (CTAs a row, threads a CTA, elements a thread holds of each of S and T, T's slice in shared memory, the
# partials exchanged through distributed shared memory rather than global memory). A CTA of 512 threads
# holding S and T in 32 + 32 registers fills half the SM's register file, so one CTA runs an SM at a time,
# and its barriers and partial exchanges leave the SM's loads idle. 256 threads holding S in 64 registers
# and T's slice in 64 KiB of shared memory let two CTAs share an SM. Each exchange through global memory
# is a store and a load at L2's latency behind a cluster barrier; through distributed shared memory each
# CTA stores its partials into its own shared memory, the barrier's release / acquire makes them visible to
# the cluster, and every CTA loads each peer's (CuTe DSL stores into a peer's shared memory only
# asynchronously, on an mbarrier).
CONFIGS = ((8, 512, 32, False, False), (8, 512, 32, False, True), (8, 256, 64, True, True),
           (16, 256, 32, False, True))
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
LOWEST = -3.0e38  # padding and the max's start: finite, so that differences of two stay finite
BETA = 0.5


def build(cluster, threads, ept, t_smem, dsmem):
    import cutlass
    import cutlass.cute as cute
    from cutlass._mlir.dialects import llvm, nvvm
    from cutlass.cutlass_dsl import T, dsl_user_op

    @dsl_user_op
    def peer_load(ptr, rank, *, loc=None, ip=None):
        """An fp32 from CTA `rank`'s shared memory at `ptr` (this CTA's address of it): ld.shared::cluster."""
        far = nvvm.mapa(llvm.PointerType.get(cutlass.AddressSpace.dsmem), ptr.to_llvm_ptr(loc=loc, ip=ip),
                        cutlass.Int32(rank).ir_value(loc=loc, ip=ip), loc=loc, ip=ip)
        return cutlass.Float32(llvm.load(T.f32(), far, loc=loc, ip=ip))

    warps, slice_ = threads // 32, threads * ept

    def got(xch, part, row, j, k):
        """CTA j's k-th partial of the row: from CTA j's shared memory (dsmem), or from global memory."""
        return peer_load(xch.iterator + k, j) if dsmem else part[row, j, k]

    def t_slice(smem):
        if t_smem:
            return smem.allocate_tensor(cutlass.Float32, cute.make_layout(ept * threads), byte_alignment=16)
        return cute.make_rmem_tensor(ept, cutlass.Float32)

    def at(i, tid):
        """Where a thread's i-th element of T sits: its own register, or its own word of shared memory (a warp's
        32 threads read 32 consecutive words: no bank conflicts)."""
        return i * threads + tid if t_smem else i

    def warp_sum(x):
        for width in (16, 8, 4, 2, 1):
            x = x + cute.arch.shuffle_sync_bfly(x, offset=width)
        return x

    @cute.kernel
    def jsd_kernel(s: cute.Tensor, t: cute.Tensor, ds: cute.Tensor, loss: cute.Tensor, part: cute.Tensor,
                   v: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        rank, row, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        smem = cutlass.memory.SmemAllocator()
        red = smem.allocate_tensor(cutlass.Float32, cute.make_layout(warps * 4))
        xch = smem.allocate_tensor(cutlass.Float32, cute.make_layout(8), byte_alignment=16)
        xs = cute.make_rmem_tensor(ept, cutlass.Float32)
        xt = t_slice(smem)
        base = rank * slice_ + tid

        # pass 1, the only read of S and T: the slice into registers (log2 units), its max, then its sum-exp
        ms = cutlass.Float32(LOWEST)
        mt = cutlass.Float32(LOWEST)
        for i in cutlass.range_constexpr(ept):
            c = base + i * threads
            if c < v:
                xs[i] = s[row, c] * cutlass.Float32(LOG2E)
                xt[at(i, tid)] = t[row, c] * cutlass.Float32(LOG2E)
            else:
                xs[i] = cutlass.Float32(LOWEST)
                xt[at(i, tid)] = cutlass.Float32(LOWEST)
            ms = cute.arch.fmax(ms, xs[i])
            mt = cute.arch.fmax(mt, xt[at(i, tid)])
        es = cutlass.Float32(0.0)
        et = cutlass.Float32(0.0)
        for i in cutlass.range_constexpr(ept):
            es = es + cute.math.exp2(xs[i] - ms, fastmath=True)
            et = et + cute.math.exp2(xt[at(i, tid)] - mt, fastmath=True)
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
            if lane < warps:
                ms = red[lane * 4 + 0]
                es = red[lane * 4 + 1]
                mt = red[lane * 4 + 2]
                et = red[lane * 4 + 3]
            ms, es = warp_merge(ms, es)
            mt, et = warp_merge(mt, et)
            if cutlass.const_expr(dsmem):  # into this CTA's shared memory, where the cluster's CTAs read them
                if lane == 0:
                    xch[0] = ms
                    xch[1] = es
                    xch[2] = mt
                    xch[3] = et
            else:
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
            ms, es = merge(ms, es, got(xch, part, row, j, 0), got(xch, part, row, j, 1))
            mt, et = merge(mt, et, got(xch, part, row, j, 2), got(xch, part, row, j, 3))
        lse_s = ms + cute.math.log2(es)
        lse_t = mt + cute.math.log2(et)

        # pass 2, from registers: the divergence and K's sums. It leaves q in xs and log2(q / M) in xt, so pass 3
        # needs no exp2 or log2: 5 of the SFU's transcendentals an element in all, not 8. M = β p + (1 − β) q
        # is formed directly (p, q ≤ 1, no overflow) and held at 2^−126 or more: where fp32 flushes both to
        # zero, q and p multiply the log and the term is 0 either way.
        kl = cutlass.Float32(0.0)
        kq = cutlass.Float32(0.0)
        for i in cutlass.range_constexpr(ept):
            lq = xs[i] - lse_s
            lp = xt[at(i, tid)] - lse_t
            q = cute.math.exp2(lq, fastmath=True)
            p = cute.math.exp2(lp, fastmath=True)
            lm = cute.math.log2(cute.arch.fmax(cutlass.Float32(BETA) * p + cutlass.Float32(1.0 - BETA) * q,
                                               cutlass.Float32(2.0**-126)), fastmath=True)
            kq = kq + q * (lq - lm)
            kl = kl + cutlass.Float32(BETA) * p * (lp - lm) + cutlass.Float32(1.0 - BETA) * q * (lq - lm)
            xs[i] = q
            xt[at(i, tid)] = lq - lm
        kl = warp_sum(kl)
        kq = warp_sum(kq)
        if lane == 0:
            red[warp * 4 + 0] = kl
            red[warp * 4 + 1] = kq
        cute.arch.sync_threads()
        if warp == 0:
            kl = cutlass.Float32(0.0)
            kq = cutlass.Float32(0.0)
            if lane < warps:
                kl = red[lane * 4 + 0]
                kq = red[lane * 4 + 1]
            kl = warp_sum(kl)
            kq = warp_sum(kq)
            if cutlass.const_expr(dsmem):
                if lane == 0:
                    xch[4] = kl
                    xch[5] = kq
            else:
                if lane == 0:
                    part[row, rank, 4] = kl
                    part[row, rank, 5] = kq
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        k_row = cutlass.Float32(0.0)
        l_row = cutlass.Float32(0.0)
        for j in cutlass.range_constexpr(cluster):
            l_row = l_row + got(xch, part, row, j, 4)
            k_row = k_row + got(xch, part, row, j, 5)
        k_row = k_row * cutlass.Float32(LN2)
        if rank == 0:
            if tid == 0:
                loss[row] = l_row * cutlass.Float32(LN2)

        # pass 3, from registers: dL/ds = (1 − β) q (ln(q / M) − K), written once in bf16
        for i in cutlass.range_constexpr(ept):
            c = base + i * threads
            g = cutlass.Float32(1.0 - BETA) * xs[i] * (xt[at(i, tid)] * cutlass.Float32(LN2) - k_row)
            if c < v:
                ds[row, c] = g.to(cutlass.BFloat16)
        if cutlass.const_expr(dsmem):  # no CTA leaves while another may still read its shared memory
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    @cute.jit
    def jsd_rows(s: cute.Tensor, t: cute.Tensor, ds: cute.Tensor, loss: cute.Tensor, part: cute.Tensor,
                 v: cutlass.Int32):
        jsd_kernel(s, t, ds, loss, part, v).launch(grid=(cluster, s.shape[0], 1), block=(threads, 1, 1),
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
    R, V = a.rows, a.vocab
    gen = torch.Generator(device="cuda").manual_seed(0)
    s = 4.0 * torch.randn(R, V, device="cuda", generator=gen)  # a trained head's magnitudes
    t = 4.0 * torch.randn(R, V, device="cuda", generator=gen)
    s[::4, 11], t[::4, 11] = 30.0, 28.0
    sample = torch.cat([torch.arange(0, 16), torch.arange(R - 16, R)]).cuda()
    want_loss, want_g = reference(s[sample], t[sample])

    def errors(loss, ds):
        # the sampled rows' summed loss, as a call reduces them: a row whose S and T share a peak has a JSD near
        # 1e-5, whose own fp32 relative error is ~1e-3 in any formulation (the Triton rows' too)
        return {"loss_rel_err": (abs(loss[sample].double().sum() - want_loss.sum()) / want_loss.sum()).item(),
                "ds_rel_err": ((ds[sample].double() - want_g).norm(dim=-1) / want_g.norm(dim=-1)).max().item()}

    from flashkd.backends import cute_gemm, triton_rows
    from flashkd.losses import LossSpec

    spec = LossSpec(loss="jsd", beta=BETA, weight_hard=0.0, weight_soft=1.0, want_hard=False)
    one = torch.ones((), device="cuda")
    ds_tr = torch.empty(R, V, device="cuda", dtype=torch.bfloat16)

    def triton_call():
        return triton_rows.rows(s, t, None, spec, one, True, ds=ds_tr)

    # the rows as backend "cute" runs them today: each side's statistics per vocab tile from the GEMMs'
    # epilogues, so S and T are read twice (K, then the gradient)
    k_s, _, k_t = triton_rows.tile_constants(spec, False)
    tiles = torch.empty(5, R, cute_gemm.n_tiles(V), device="cuda")
    for plane, z, k in ((0, s, k_s), (3, t, k_t)):
        m, (l,) = cute_gemm.tile_stats(z, (k,))
        tiles[plane], tiles[plane + 1] = m, l

    def triton_tiles_call():
        return triton_rows.rows(s, t, None, spec, one, True, ds=ds_tr, tiles=tiles)

    soft, _ = triton_call()[:2]
    torch.cuda.synchronize()
    result = {"rows": R, "vocab": V, "triton": errors(soft, ds_tr)}
    triton_tiles_call()
    torch.cuda.synchronize()
    result["triton tiles"] = errors(soft, ds_tr)
    bar = 2 * max(result["triton"]["ds_rel_err"], 2.0**-9)
    ok = True
    calls = {"triton": triton_call, "triton tiles": triton_tiles_call, "copy of S": lambda: s.clone()}
    ds = torch.empty(R, V, device="cuda", dtype=torch.bfloat16)
    loss = torch.empty(R, device="cuda")
    # each config, and the second once more with dL/ds over the first half of each row of S (a bf16 view, row
    # stride 2V; its rows 16-byte aligned where V % 4 == 0): a row's CTAs have all read their slices of S before
    # the cluster barrier that precedes the first write, so no buffer of its own
    for (cluster, threads, ept, t_smem, dsmem), over_s in [(c, False) for c in CONFIGS] + [(CONFIGS[1], V % 4 == 0)]:
        name = f"cute {cluster}x{threads}x{ept}" + (" T in smem" if t_smem else "") + (" dsmem" if dsmem else "")
        name += " dL/ds over S" if over_s else ""
        if cluster * threads * ept < V or (cluster - 1) * threads * ept >= V or name in result:
            continue  # a cluster that does not hold the row, or holds it with a CTA to spare; or done
        s_in = s.clone() if over_s else s
        out = s_in.view(torch.bfloat16)[:, :V] if over_s else ds
        part = torch.empty(R, cluster, 8, device="cuda")
        args = [from_dlpack(x, assumed_align=16) for x in (s_in, t, out, loss, part)]
        t0 = time.perf_counter()
        compiled = cute.compile(build(cluster, threads, ept, t_smem, dsmem), *args, V)
        result[name] = {"compile_s": time.perf_counter() - t0}
        if not over_s:  # (zeroing the view would zero half of S)
            out.zero_()
        compiled(*args, V)
        torch.cuda.synchronize()
        result[name].update(errors(loss, out))
        result[name]["vs_triton_loss"] = (abs(loss.double().sum() - soft.double().sum()) / soft.double().sum()).item()
        ok = ok and result[name]["loss_rel_err"] <= 1e-5 and result[name]["ds_rel_err"] <= bar
        calls[name] = lambda compiled=compiled, args=args: compiled(*args, V)
    gb = R * V * 10 / 1e9  # the one-read design's bytes: S and T read once (fp32), dL/ds written once (bf16)
    for name, fn in calls.items():
        fn()
        ms, p20, p80 = median_ms(fn, a.reps)
        result.setdefault(name, {}).update({"ms": ms, "p20": p20, "p80": p80})
        if name.startswith("cute"):
            result[name]["tb_per_s_at_10_bytes"] = gb / ms
    result["copy_tb_per_s"] = R * V * 8 / 1e9 / result["copy of S"]["ms"]
    result["bound_ms_at_copy_speed"] = gb / result["copy_tb_per_s"]
    print(json.dumps(result, indent=2))
    finish(result, a.out, None if ok else "probe_cute_jsd: wrong result (loss_rel_err, ds_rel_err above)")


if __name__ == "__main__":
    main()
