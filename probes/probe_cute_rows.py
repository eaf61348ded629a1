"""The CuTe DSL toolchain on this GPU: a row kernel's JIT compile time (first call; the cute-probe stage of
scripts/gpu_check.sh runs it twice, in fresh processes, with CUTE_DSL_CACHE_DIR set), its result, and its
read speed. GPU only (CuTe DSL has no CPU path); needs
nvidia-cutlass-dsl (`pip install 'flashkd[cute]'`, or `bash .cute/install.sh` where PyPI is out of reach).

The kernel: each row's (max, log-sum-exp) of fp32 logits (R, V), what pass 1 of the row kernels makes,
written plainly: one CTA of 512 threads a row, each thread an online (max, sum of 2^(x·log2 e − max))
over the columns it strides, merged across a warp by butterfly shuffles and across warps in shared
memory. Checked against torch.logsumexp in float64; timed against torch.logsumexp and a copy of the
block (the bytes' floor), CUDA events, median of --reps.

    python probes/probe_cute_rows.py [--rows 8192] [--vocab 128256] [--reps 50] [--out FILE.json]
"""


import argparse
import json
import math
import statistics
import sys
import time

import torch

THREADS = 512
WARPS = THREADS // 32
LOG2E = 1.4426950408889634
LOWEST = -3.0e38  # a finite start for the running max: −inf − (−inf) would be NaN


# Trace-time helpers of the kernels here and in probe_cute_jsd.py: plain Python, called while a kernel is traced.
def merge(m, s, m_o, s_o):
    """Two (max, sum of 2^(x − max)) pairs into one."""
    import cutlass.cute as cute

    n = cute.arch.fmax(m, m_o)
    return n, s * cute.arch.exp2(m - n) + s_o * cute.arch.exp2(m_o - n)


def warp_merge(m, s):
    """A warp's (max, sum-exp) pairs merged by five butterfly-shuffle rounds: every lane gets the warp's."""
    import cutlass.cute as cute

    for width in (16, 8, 4, 2, 1):
        m, s = merge(m, s, cute.arch.shuffle_sync_bfly(m, offset=width), cute.arch.shuffle_sync_bfly(s, offset=width))
    return m, s


def build():
    import cutlass
    import cutlass.cute as cute

    @cute.kernel
    def row_lse_kernel(z: cute.Tensor, out: cute.Tensor, v: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        smem = cutlass.memory.SmemAllocator()
        sm = smem.allocate_tensor(cutlass.Float32, cute.make_layout(WARPS))
        ss = smem.allocate_tensor(cutlass.Float32, cute.make_layout(WARPS))
        m = cutlass.Float32(LOWEST)
        s = cutlass.Float32(0.0)
        for c in cutlass.range(tid, v, THREADS):
            x = z[row, c] * cutlass.Float32(LOG2E)
            n = cute.arch.fmax(m, x)
            s = s * cute.arch.exp2(m - n) + cute.arch.exp2(x - n)
            m = n
        m, s = warp_merge(m, s)
        if lane == 0:
            sm[warp] = m
            ss[warp] = s
        cute.arch.sync_threads()
        if warp == 0:
            m = cutlass.Float32(LOWEST)
            s = cutlass.Float32(0.0)
            if lane < WARPS:
                m = sm[lane]
                s = ss[lane]
            m, s = warp_merge(m, s)
            if lane == 0:
                out[row, 0] = m / cutlass.Float32(LOG2E)
                out[row, 1] = (m + cute.math.log2(s)) / cutlass.Float32(LOG2E)

    @cute.jit
    def row_lse(z: cute.Tensor, out: cute.Tensor, v: cutlass.Int32):
        row_lse_kernel(z, out, v).launch(grid=(z.shape[0], 1, 1), block=(THREADS, 1, 1))

    return row_lse


def median_ms(fn, reps):
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    q = statistics.quantiles(times, n=5)
    return statistics.median(times), q[0], q[-1]


def finish(result, out, failure=None):
    """A probe's end: its result as JSON to `out` (the --out path, if given), then exit 0, or with the
    one-line `failure` (non-zero)."""
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
    sys.exit(failure or 0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_cute_rows: needs a CUDA GPU (CuTe DSL compiles for the GPU only)")
    t0 = time.perf_counter()
    try:
        import cutlass.cute as cute
        from cutlass.cute.runtime import from_dlpack
    except ImportError as e:
        sys.exit(f"probe_cute_rows: needs nvidia-cutlass-dsl ({e})")
    result = {"import_s": time.perf_counter() - t0, "rows": a.rows, "vocab": a.vocab}
    gen = torch.Generator(device="cuda").manual_seed(0)
    z = 4.0 * torch.randn(a.rows, a.vocab, device="cuda", generator=gen)
    z[::4, 7] = 30.0
    out = torch.empty(a.rows, 2, device="cuda")
    zc, oc = from_dlpack(z, assumed_align=16), from_dlpack(out, assumed_align=16)
    t0 = time.perf_counter()
    compiled = cute.compile(build(), zc, oc, a.vocab)
    result["compile_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled(zc, oc, a.vocab)
    torch.cuda.synchronize()
    result["first_call_s"] = time.perf_counter() - t0
    want_max, want_lse = z.double().amax(-1), torch.logsumexp(z.double(), -1)
    # the max comes back through x·log2(e) / log2(e): a rounding each way
    result["max_rel_err"] = ((out[:, 0].double() - want_max).abs() / want_max.abs()).max().item()
    result["lse_rel_err"] = ((out[:, 1].double() - want_lse).abs() / want_lse.abs()).max().item()
    gb = z.numel() * 4 / 1e9
    for name, fn in (("cute", lambda: compiled(zc, oc, a.vocab)), ("torch.logsumexp", lambda: torch.logsumexp(z, -1)),
                     ("copy", lambda: z.clone())):
        fn()
        ms, p20, p80 = median_ms(fn, a.reps)
        bytes_moved = gb * (2 if name == "copy" else 1)
        result[name] = {"ms": ms, "p20": p20, "p80": p80, "tb_per_s": bytes_moved / ms}
    print(json.dumps(result, indent=2))
    ok = result["max_rel_err"] <= 4 * 2.0**-24 and result["lse_rel_err"] <= 1e-6
    finish(result, a.out, None if ok else f"probe_cute_rows: wrong result {result['max_rel_err']}, {result['lse_rel_err']}")


if __name__ == "__main__":
    main()
