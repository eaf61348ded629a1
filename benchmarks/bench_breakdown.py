"""Where the fused step's time goes beyond its GEMM floor: JSD with teacher heads, bf16, seed shape.

Each item is timed in this process (median, p20–p80):
    floor             the four GEMMs over all N rows at once: S = Xs Ws^T, T = Xt Wt^T, dX = dS Ws, dW = dS^T Xs
                      (dS a stand-in, as in the bench's floor)
    chunked, fp32     the same GEMMs chunk by chunk as flashkd's chunk loop runs them (its rows per chunk),
                      dW accumulated in fp32 and cast to bf16 once at the end; no row kernel
    chunked, bf16     the same with a bf16 dW accumulator: the cost of accumulating in fp32
    k chunks          the chunked fp32 GEMMs over k chunks of equal rows (--chunks, default 2 and 3)
    each GEMM         alone, over all rows in one call and chunk by chunk
    row kernel        triton_rows.rows on the chunks' (R, V) logits, summed over the chunks
    whole op          flashkd.fused_linear_distill forward + backward
then the whole op's time over the floor in parts (chunking the GEMMs, the row kernel, the rest), and a
bytes model of the fp32 accumulator's extra traffic at the measured copy bandwidth.
With --plans R:Rt ..., only the floor and the whole op under each plan (R rows per chunk, teacher
logits Rt rows at a time), for --loss, with each plan's peak extra memory.
Usage: python benchmarks/bench_breakdown.py [--rows 8192] [--vocab 128256] [--hidden 4096] [--chunks 2 3]
       python benchmarks/bench_breakdown.py --plans 2048:2048 4096:2048 [--loss cosine] [--rows 4096]
"""

import argparse
import collections

import torch
import triton

import flashkd
from flashkd.backends import triton_rows
from flashkd.bench.workloads import Workload, make_inputs
from flashkd import core
from flashkd.losses import LossSpec

from bench_memory import time_and_extra  # this folder is on sys.path when a script here runs

DEVICE = "cuda"
COPY_BYTES = 2 << 30  # size of each tensor of the bandwidth copy
LOSS = dict(loss="jsd", beta=0.5, weight_hard_loss=0.5, weight_soft_loss=0.5)
SPEC = LossSpec(loss="jsd", beta=0.5, weight_hard=0.5, weight_soft=0.5, want_hard=True)  # what LOSS plans


def bench(fn, **kw):
    """[median, p20, p80] ms."""
    return triton.testing.do_bench(fn, warmup=100, rep=500, quantiles=[0.5, 0.2, 0.8], **kw)


def line(name, ms):
    print(f"{name:<40}{ms[0]:>9.3f}{ms[1]:>9.3f}{ms[2]:>9.3f}")


def floor(xs, ws, xt, wt, ds):
    s = xs @ ws.t()
    t = xt @ wt.t()
    del s, t
    return ds @ ws, ds.t() @ xs


def chunked(xs, ws, xt, wt, ds, rows, accum):
    """The chunk loop's GEMMs alone: (dX, dW), dW summed over chunks in an `accum` accumulator."""
    n = xs.shape[0]
    accum = accum if n > rows else ws.dtype  # as the loop: one chunk has nothing to accumulate
    dx = torch.empty_like(xs)
    acc = torch.empty(ws.shape, device=ws.device, dtype=accum)
    for start in range(0, n, rows):
        c = slice(start, min(start + rows, n))
        s = core.loop.linear(xs[c], ws, None)
        t = core.loop.linear(xt[c], wt, None)
        del s, t
        torch.mm(ds[c], ws, out=dx[c])
        core.loop.accumulate_mm(acc, ds[c].t(), xs[c], beta=0.0 if start == 0 else 1.0)
    return dx, acc.to(ws.dtype)


def sizes(n, rows):
    return [min(rows, n - start) for start in range(0, n, rows)]


def row_kernel(xs, ws, xt, wt, y, rows):
    """ms of triton_rows.rows summed over the chunks, each on its rows' real logits. The kernel writes
    dL/dS over s, so each call first restores s from a copy, whose own time is subtracted."""
    counts = collections.Counter(sizes(xs.shape[0], rows))
    s0, t = xs[:rows] @ ws.t(), xt[:rows] @ wt.t()
    s = torch.empty_like(s0)
    scale = torch.tensor(1.0 / xs.shape[0], device=xs.device)
    total = [0.0, 0.0, 0.0]
    for r, count in counts.items():
        copy = bench(lambda: s[:r].copy_(s0[:r]))[0]
        ms = bench(lambda: (s[:r].copy_(s0[:r]), triton_rows.rows(s[:r], t[:r], y[:r], SPEC, scale, True)))
        total = [a + count * (m - copy) for a, m in zip(total, ms)]
    return total, " + ".join(f"{count}×{r}" for r, count in counts.items())


def plans(x, loss, specs):
    """The floor, then the whole op (forward + backward) under each plan "R:Rt", in one process."""
    xs, ws, xt, wt, y = x.xs, x.ws, x.xt, x.wt, x.y
    ds = torch.randn(xs.shape[0], ws.shape[0], device=xs.device, dtype=xs.dtype) * 1e-3
    line("floor: 4 GEMMs, all rows", bench(lambda: floor(xs.detach(), ws.detach(), xt, wt, ds)))
    del ds
    torch.cuda.empty_cache()
    spec = LossSpec(loss=loss, beta=0.5, temperature=1.0, weight_hard=0.5, weight_soft=0.5)
    for text in specs:
        rows, teacher = (int(part) for part in text.split(":"))
        plan = core.plan.Plan(spec, rows, "triton", torch.float32, "heads", teacher)

        def step():
            core.loop.apply(xs, ws, None, y, None, plan, xt, wt, None)[0].backward()

        ms, extra = time_and_extra(step, [xs, ws])
        line(f"plan {rows}:{teacher} ({extra:.0f} MiB)", ms)


def copy_bandwidth():
    """GB/s of dst.copy_(src), bf16, read + write bytes over time."""
    src = torch.randn(COPY_BYTES // 2, device=DEVICE, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))[0]
    return 2 * COPY_BYTES / ms / 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=4096, help="teacher hidden size; the student's is half")
    ap.add_argument("--chunks", type=int, nargs="+", default=[2, 3],
                    help="chunk counts (of equal rows) to time the chunked GEMMs at")
    ap.add_argument("--plans", nargs="+", metavar="R:Rt", help="time the whole op under these plans only")
    ap.add_argument("--loss", default="jsd", help="the loss of --plans")
    args = ap.parse_args()
    x = make_inputs(Workload(args.loss, args.rows, h=args.hidden, v=args.vocab), torch.device(DEVICE))
    if args.plans:
        print(f"N={args.rows} Ht={args.hidden} V={args.vocab} bf16, {args.loss}; plans R:Rt")
        plans(x, args.loss, args.plans)
        return
    xs, ws, xt, wt, y = x.xs.detach(), x.ws.detach(), x.xt, x.wt, x.y  # GEMM items: no autograd
    n, (v, hs) = xs.shape[0], ws.shape
    rows, _ = core.plan.chunk_rows(None, xs, ws, "triton", "heads", 0)  # the chunked plan: as without grad
    k = len(sizes(n, rows))
    print(f"N={n} Hs={hs} Ht={xt.shape[1]} V={v} bf16; chunk loop: R={rows} rows per chunk, {k} chunks")
    print(f"{'item':<40}{'ms p50':>9}{'p20':>9}{'p80':>9}")

    # a stand-in dL/dS for the dX, dW GEMMs, as the bench's floor provider uses (clocks depend on the data)
    ds = torch.randn(n, v, device=xs.device, dtype=xs.dtype) * 1e-3
    ms_floor = bench(lambda: floor(xs, ws, xt, wt, ds))
    line("floor: 4 GEMMs, all rows", ms_floor)
    torch.cuda.empty_cache()
    ms_fp32 = bench(lambda: chunked(xs, ws, xt, wt, ds, rows, torch.float32))
    line(f"chunked GEMMs, {k}×R, dW fp32", ms_fp32)
    ms_bf16 = bench(lambda: chunked(xs, ws, xt, wt, ds, rows, torch.bfloat16))
    line(f"chunked GEMMs, {k}×R, dW bf16", ms_bf16)
    for chunks in args.chunks:
        r = -(-n // chunks)
        ms = bench(lambda: chunked(xs, ws, xt, wt, ds, r, torch.float32))
        line(f"chunked GEMMs, {len(sizes(n, r))}×{r}, dW {'fp32' if n > r else 'bf16'}", ms)
    # each GEMM alone: all rows in one call, then chunk by chunk (the dW one into an fp32 accumulator)
    acc, dx = torch.empty(ws.shape, device=ws.device, dtype=torch.float32), torch.empty_like(xs)
    chunks = [slice(a, min(a + rows, n)) for a in range(0, n, rows)]
    for name, whole, part in (
        ("S = Xs Ws^T", lambda: xs @ ws.t(), lambda c: xs[c] @ ws.t()),
        ("T = Xt Wt^T", lambda: xt @ wt.t(), lambda c: xt[c] @ wt.t()),
        ("dX = dS Ws", lambda: ds @ ws, lambda c: torch.mm(ds[c], ws, out=dx[c])),
        ("dW = dS^T Xs", lambda: ds.t() @ xs,
         lambda c: core.loop.accumulate_mm(acc, ds[c].t(), xs[c], beta=0.0 if c.start == 0 else 1.0)),
    ):
        one, per_chunk = bench(whole), bench(lambda: [part(c) for c in chunks])
        line(f"{name}, all rows", one)
        line(f"{name}, {k} chunks (+{per_chunk[0] - one[0]:.3f})", per_chunk)
    del ds, acc, dx
    torch.cuda.empty_cache()
    ms_rows, split = row_kernel(xs, ws, xt, wt, y, rows)
    line(f"row kernel, {split} rows", ms_rows)
    torch.cuda.empty_cache()

    def step():
        flashkd.fused_linear_distill(x.xs, x.ws, xt, wt, y, **LOSS).backward()

    ms_whole = bench(step, grad_to_none=[x.xs, x.ws])
    line("whole op: forward + backward", ms_whole)
    x.xs.grad = x.ws.grad = None
    del x, xs, ws, xt, wt, y
    torch.cuda.empty_cache()
    bandwidth = copy_bandwidth()
    torch.cuda.empty_cache()

    over, gemm, kernel = ms_whole[0] - ms_floor[0], ms_fp32[0] - ms_floor[0], ms_rows[0]
    print(f"\nwhole − floor                      {over:8.3f} ms  ({over / ms_floor[0]:.1%} of floor)")
    print(f"  chunked GEMMs fp32 − floor       {gemm:8.3f} ms  (fp32 − bf16 accumulator: "
          f"{ms_fp32[0] - ms_bf16[0]:.3f} ms)")
    print(f"  row kernel total                 {kernel:8.3f} ms")
    print(f"  remainder                        {over - gemm - kernel:8.3f} ms")
    e = v * hs
    # fp32 dW: written by the first chunk, read and written by each later one, then read by the cast to
    # bf16; the cast's bf16 write is the floor's own write of dW, so it cancels
    gb = (e * 4 + (k - 1) * 2 * e * 4 + e * 4 + e * 2 - e * 2) / 1e9
    print(f"bytes model: fp32 dW accumulator over {k} chunks moves {gb:.2f} GB beyond the floor's dW write "
          f"= {gb / bandwidth * 1e3:.3f} ms at {bandwidth:.0f} GB/s (copy of {COPY_BYTES / 1e9:.1f} GB bf16)")


if __name__ == "__main__":
    main()
