"""The chunk plan's cost model against measurement: one fused call (forward + backward, trained-head inputs)
at given chunk sizes, beside its four-GEMM floor, at the model heads where the plan matters.

For each head (Hs, Ht, V) and N: the floor's ms; then per chunk size (auto: the default plan) the call's
ms, its ratio to the floor, its chunks, the dW accumulator's share of a chunk's GEMM time that the cost
model gives (`core.plan.accum_share`), the ms the model predicts over the auto plan's from the accumulator's
traffic alone (chunks × 2·V·Hs·4 bytes at --bandwidth), and its peak extra memory against `peak_bytes`.
Usage: python benchmarks/bench_plan.py [--heads Gemma Phi-4] [-n 8192] [--chunks auto 512 1024] [--loss jsd cosine]
       [--no-grad] [--reps 10] [--accum bf16]
"""

import argparse
import dataclasses
import statistics

import torch

import flashkd
from flashkd import core
from flashkd.bench import measure
from flashkd.bench.providers import PROVIDERS
from flashkd.bench.workloads import MODEL_HEADS, Workload, make_inputs


def timed(step, reps):
    """Median ms of `reps` calls after 3 warm-up calls, with CUDA events."""
    for _ in range(3):
        step()
    return statistics.median(measure.event_times(step, reps))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", nargs="+", default=["Gemma-3 4B", "Phi-4", "Llama-3.2 1B <- Llama-3.2 3B"],
                    help="MODEL_HEADS pairs whose label starts with one of these")
    ap.add_argument("-n", type=int, nargs="+", default=[8192])
    ap.add_argument("--chunks", nargs="+", default=["auto", "512", "1024", "2048"])
    ap.add_argument("--loss", nargs="+", default=["jsd"])
    ap.add_argument("--no-grad", action="store_true", help="also each loss's no-grad forward against the floor's")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s for the accumulator's predicted ms")
    ap.add_argument("--accum", choices=["fp32", "bf16"], default="fp32",
                    help="grad_accum_dtype: bf16 halves the dW accumulator (V·Hs·2 bytes) and costs dW accuracy")
    args = ap.parse_args()
    heads = [h for h in MODEL_HEADS if any(h[0].startswith(p) for p in args.heads)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, flashkd {flashkd.__version__}; "
          f"full forward + backward (no-grad: forward alone), trained-head inputs, median of {args.reps}")
    print(f"{'head':44} {'N':>6} {'loss':>10} {'chunk':>6} {'chunks':>6} {'share':>6} {'ms':>8} {'xfloor':>7} {'acc ms':>7} "
          f"{'peak MiB':>9} {'formula':>8}")
    for label, hs, ht, v in heads:
        for n in args.n:
            w = Workload("jsd", n, h=ht, student_h=hs, v=v, inputs="trained")
            x = make_inputs(w, torch.device("cuda"))
            floor = timed(measure._step(PROVIDERS["floor"].make(w, x), x, "full"), args.reps)
            print(f"{label[:44]:44} {n:6} {'':>10} {'floor':>6} {'':>6} {'':>6} {floor:8.2f} {1.0:7.3f}")
            if args.no_grad:
                floor_ng = timed(measure._step(PROVIDERS["floor"].make(w, x), x, "no-grad-forward"), args.reps)
                print(f"{label[:44]:44} {n:6} {'':>10} {'floor-ng':>6} {'':>6} {'':>6} {floor_ng:8.2f} {1.0:7.3f}")
            torch.cuda.empty_cache()
            for loss, c in ((loss, c) for loss in args.loss for c in args.chunks):
                size = None if c == "auto" else int(c)
                accum = 4 if args.accum == "fp32" else 2
                rows, _ = core.plan.chunk_rows(size, x.xs, x.ws, "triton", "heads", accum, v, ht)
                count = -(-n // rows)
                options = dict(loss=loss, chunk_size=size, grad_accum_dtype=None if accum == 4 else torch.bfloat16)

                def step():
                    x.xs.grad = x.ws.grad = None
                    flashkd.fused_linear_distill(x.xs, x.ws, x.xt, x.wt, x.y, **options).backward()

                ms = timed(step, args.reps)
                x.xs.grad = x.ws.grad = None
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                step()
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - before) / 2**20
                bound = core.plan.peak_bytes(n, v, hs, 2, rows, rows, form="heads", accum_bytes=accum) / 2**20
                acc_ms = count * 2 * v * hs * accum / args.bandwidth * 1e3
                share = core.plan.accum_share(rows, v, hs, ht, accum)
                print(f"{label[:44]:44} {n:6} {loss:>10} {c:>6} {count:6} {share:6.3f} {ms:8.2f} {ms / floor:7.3f} {acc_ms:7.2f} "
                      f"{peak:9.0f} {bound:8.0f}", flush=True)
                if args.no_grad:
                    with torch.no_grad():
                        ng = timed(lambda: flashkd.fused_linear_distill(x.xs, x.ws, x.xt, x.wt, x.y, **options), args.reps)
                    print(f"{label[:44]:44} {n:6} {loss:>10} {c + '-ng':>6} {'':>6} {'':>6} {ng:8.2f} {ng / floor_ng:7.3f}")
                torch.cuda.empty_cache()
            del x
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
