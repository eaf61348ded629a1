"""How much of the row pass hides under the GEMMs when the two run at once from two streams (spare SMs).

One chunk of the JSD seed (R rows, V 128256, Hs 2048, Ht 4096, bf16, fp32 logits at a trained head's
magnitudes): the Triton row kernel (JSD + CE with grad, dL/dS into a bf16 buffer of its own) against the
chunk's other kernels, alone, one after the other on one stream, and at once on two streams (the rows on a
side stream, high or normal priority):

    gradient GEMMs   dX = dS·Ws and dW += dSᵀ·X (fp32 accumulator) of another chunk's dS: what the chunk
                     loop could run beside chunk c's rows (chunk c − 1's, one more chunk of dS alive)
    logits GEMMs     S and T of the next chunk (two more chunks of fp32 logits alive)
    half dX          dX = dS·Ws of the chunk's first half rows beside the rows of its second half (no more
                     memory: the chunk split in two blocks, dW's GEMM after both)

Each line is the median of --reps timed rounds (CUDA events around the whole round), the lines interleaved
round by round. hidden = (sequential − overlapped) / rows alone: the share of the row pass the second
stream hides.

Measured on an H100 (BENCHMARKS.md, "The row pass beside the GEMMs, measured"): nothing hidden; beside the gradient
GEMMs the pair runs slower than one after the other, and a carveout slows the GEMMs more than it frees.
Usage: python probes/probe_overlap.py [--rows 1024 2048] [--reps 30] [--carveout 16 32] [--blas cublaslt]
"""

import argparse
import statistics

import torch

from flashkd.backends import triton_rows
from flashkd.losses import LossSpec


def timed(fn):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--teacher-hidden", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--carveout", type=int, nargs="*", default=[16, 32], help="SMs the GEMMs leave (cuBLASLt)")
    ap.add_argument("--blas", default=None, choices=["cublas", "cublaslt"], help="torch's preferred BLAS library")
    args = ap.parse_args()
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    dev, bf = "cuda", torch.bfloat16
    v, hs, ht = args.vocab, args.hidden, args.teacher_hidden
    torch.manual_seed(0)
    # a trained head's logits: std ~4 (w's std chosen for it), a few peaks
    ws = (torch.randn(v, hs, device=dev) * (4 / hs**0.5)).to(bf)
    wt = (torch.randn(v, ht, device=dev) * (4 / ht**0.5)).to(bf)
    dw = torch.zeros(v, hs, device=dev)
    main_stream = torch.cuda.current_stream()
    side = {"normal": torch.cuda.Stream(), "high": torch.cuda.Stream(priority=-1)}
    spec = LossSpec(loss="jsd", beta=0.5, weight_hard=0.5, want_hard=True)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, V {v}, Hs {hs}, Ht {ht}, bf16, JSD + CE")
    for r in args.rows:
        x, xt = torch.randn(r, hs, device=dev, dtype=bf), torch.randn(r, ht, device=dev, dtype=bf)
        s = torch.mm(x, ws.t(), out_dtype=torch.float32)
        t = torch.mm(xt, wt.t(), out_dtype=torch.float32)
        y = torch.randint(0, v, (r,), device=dev)
        scale = torch.tensor(1.0 / r, device=dev)
        ds = torch.empty(r, v, device=dev, dtype=bf)
        ds_prev = torch.randn(r, v, device=dev, dtype=bf) * 1e-6
        dx = torch.empty(r, hs, device=dev, dtype=bf)

        def rows():
            triton_rows.rows(s, t, y, spec, scale, True, ds=ds)

        def grads():
            torch.mm(ds_prev, ws, out=dx)
            torch.addmm(dw, ds_prev.t(), x, out_dtype=torch.float32, out=dw)

        def logits():
            torch.mm(x, ws.t(), out_dtype=torch.float32)
            torch.mm(xt, wt.t(), out_dtype=torch.float32)

        h = r // 2
        s2, t2, y2, ds2 = s[h:], t[h:], y[h:], ds[h:]

        def half_rows():
            triton_rows.rows(s2, t2, y2, spec, scale, True, ds=ds2)

        def half_dx():
            torch.mm(ds_prev[:h], ws, out=dx[:h])

        def at_once(work, other, stream):
            def run():
                stream.wait_stream(main_stream)
                with torch.cuda.stream(stream):
                    work()
                other()
                main_stream.wait_stream(stream)
            return run

        lines = {"rows": rows, "grad GEMMs": grads, "logits GEMMs": logits, "half rows": half_rows,
                 "half dX": half_dx,
                 "rows then grad GEMMs": lambda: (rows(), grads()),
                 "rows then logits GEMMs": lambda: (rows(), logits()),
                 "half rows then half dX": lambda: (half_rows(), half_dx())}
        for name, stream in side.items():
            lines[f"rows || grad GEMMs ({name})"] = at_once(rows, grads, stream)
            lines[f"rows || logits GEMMs ({name})"] = at_once(rows, logits, stream)
            lines[f"half rows || half dX ({name})"] = at_once(half_rows, half_dx, stream)
        # the GEMMs told to leave SMs to the rows (cuBLASLt's SM count target, torch's experimental carveout)
        for k in args.carveout:
            def carved(fn, k=k):
                def run():
                    torch._C._set_sm_carveout_experimental(k)
                    try:
                        fn()
                    finally:
                        torch._C._set_sm_carveout_experimental(None)
                return run
            lines[f"grad GEMMs (carveout {k})"] = carved(grads)
            lines[f"logits GEMMs (carveout {k})"] = carved(logits)
            lines[f"rows || grad GEMMs (high, carveout {k})"] = carved(at_once(rows, grads, side["high"]))
            lines[f"rows || logits GEMMs (high, carveout {k})"] = carved(at_once(rows, logits, side["high"]))
        for fn in lines.values():  # compile and warm
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        times = {name: [] for name in lines}
        for _ in range(args.reps):
            for name, fn in lines.items():
                times[name].append(timed(fn))
        med = {name: statistics.median(ts) for name, ts in times.items()}
        print(f"\nR {r}: median ms of {args.reps} rounds (p20–p80)")
        for name, ts in times.items():
            q = statistics.quantiles(ts, n=5)
            print(f"  {name:<34}{med[name]:8.3f}  ({q[0]:.3f}–{q[3]:.3f})")
        for work, other in (("rows", "grad GEMMs"), ("rows", "logits GEMMs"), ("half rows", "half dX")):
            seq = med[f"{work} then {other}"]
            for name in side:
                par = med[f"{work} || {other} ({name})"]
                print(f"  hidden beside the {other}, {name} priority: {(seq - par) / med[work]:.2f} of the {work} "
                      f"({seq - par:.3f} ms of {med[work]:.3f})")
            for k in args.carveout if work == "rows" else ():
                par = med[f"{work} || {other} (high, carveout {k})"]
                print(f"  hidden beside the {other}, carveout {k}: {(seq - par) / med[work]:.2f} of the {work} "
                      f"({seq - par:.3f} ms; the GEMMs alone {med[f'{other} (carveout {k})']:.3f} against "
                      f"{med[other]:.3f})")


if __name__ == "__main__":
    main()
