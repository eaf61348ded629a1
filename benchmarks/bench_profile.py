"""Kernel by kernel, where one step of the fused op spends its GPU time, next to its GEMM floor.

For each item (the op forward + backward, its no-grad forward, and their GEMM floors), --steps
steps are profiled after warm-up (torch.profiler); printed per step: every kernel's calls and ms
(the GEMMs under their cuBLAS names), the GPU's busy time (the union of its kernels' intervals) and
the step's span from first kernel start to last kernel end. Span − busy is the time the GPU waited
for the host. The calls are `flashkd bench`'s own (its flashkd and floor providers, its modes), on the
first workload of a bench preset (seed: JSD, N = 8192, bf16, V = 128256, Hs = 2048, Ht = 4096; topk,
logits: the top-k and dense-logits teachers), its loss and rows replaced by --loss and --rows.
Usage: python benchmarks/bench_profile.py [--preset seed] [--index 0] [--loss jsd] [--rows 8192] [--steps 10] [--top 12]
       [--providers floor flashkd] [--modes full no-grad-forward]
"""

import argparse
import collections
import dataclasses

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from flashkd.bench import measure
from flashkd.bench.providers import PROVIDERS
from flashkd.bench.workloads import PRESETS, make_inputs


def kernels(step, steps):
    """[(name, start µs, end µs)] of the GPU kernels, copies and fills of `steps` calls of step."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]


def report(title, events, steps, top):
    per = collections.defaultdict(lambda: [0, 0.0])
    for name, start, end in events:
        per[name][0] += 1
        per[name][1] += end - start
    busy, reach = 0.0, float("-inf")  # union of the intervals
    for _, start, end in sorted(events, key=lambda e: e[1]):
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    span = max(e for _, _, e in events) - min(s for _, s, _ in events)
    print(f"\n{title}: busy {busy / steps / 1e3:.3f} ms a step, span {span / steps / 1e3:.3f} ms")
    for name, (calls, us) in sorted(per.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {us / steps / 1e3:8.3f} ms {calls / steps:6.1f}×  {name[:110]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="seed", choices=[p for p in PRESETS if p != "teacher-topk"])
    ap.add_argument("--loss", default=None, help="default: the preset's")
    ap.add_argument("--rows", type=int, default=None, help="default: the preset's")
    ap.add_argument("--index", type=int, default=0, help="which workload of the preset (default: its first)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--providers", nargs="+", default=["floor", "flashkd"], choices=sorted(PROVIDERS))
    ap.add_argument("--modes", nargs="+", default=["full", "no-grad-forward"], choices=["full", "no-grad-forward"])
    args = ap.parse_args()
    w = PRESETS[args.preset][args.index]
    w = dataclasses.replace(w, loss=args.loss or w.loss, n=args.rows or w.n)
    x = make_inputs(w, torch.device("cuda"))
    print(f"{w.tag}, N={w.n}, {w.describe()}; {args.steps} steps each; {torch.cuda.get_device_name()}")
    for mode in args.modes:
        for name in args.providers:
            call = measure._step(PROVIDERS[name].make(w, x), x, mode)

            def step():
                x.xs.grad = x.ws.grad = None  # as the bench times it
                call()

            report(f"{name}, {mode}", kernels(step, args.steps), args.steps, args.top)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
