"""Vocab-parallel and FSDP2 timing on the seed JSD workload (N = 8192, Hs = 2048, Ht = 4096,
V = 128256, bf16, 0.5·CE + 0.5·JSD), forward + backward, NCCL. Run with two (or more) GPUs:

    torchrun --nproc_per_node=2 benchmarks/bench_dist.py [--out dist.json]

Measures, per call (median of --reps after --warmup, CUDA events on rank 0, a barrier around each; one-gpu,
one-gpu-torch and vocab-parallel in 5 interleaved rounds):
  one-gpu        rank 0 alone, the whole heads (default backend: the Triton row kernel)
  one-gpu-torch  the same with backend="torch": the row definition the sharded calls use for now
  vocab-parallel every rank its slice of both heads, the same rows (target: <= 0.55x one-gpu on two
                 GPUs; at one rank, <= 1.03x one-gpu: the Triton rows' phases and their collectives),
                 and the bytes its collectives carry, counted, beside the formula in docs/distributed.md
  agreement      the vocab-parallel call with chunk_size set (--chunk-size, default 2048), check_shards
                 None (its checks' status, layout and options read on the host: one host sync) against
                 False (no read, no sync), each right after ~5 ms of other GPU work is queued (what a
                 sync then waits for: the CPU cannot queue the loss's kernels behind it). Runs on one
                 GPU too: torchrun --nproc_per_node=1 benchmarks/bench_dist.py --only-agreement
  fsdp-rows      FSDP2-sharded heads (DTensor, Shard(0)), each rank N / world of the rows: the rows route
  fsdp-heads     the same inputs, the heads gathered instead
and for the FSDP routes the bytes each rank receives by the formulas of flashkd.distributed.fsdp,
and those bytes over the measured time. Peak memory per rank: torch.cuda.max_memory_allocated.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist

import flashkd
from flashkd.bench.workloads import PRESETS, make_inputs
from flashkd import core
from flashkd.distributed import fsdp
from flashkd.losses import LossSpec, parameter


def timed(fn, reps, warmup, rank):
    """Median ms of fn() over reps (every rank runs the same calls: they hold collectives)."""
    times = []
    for i in range(warmup + reps):
        dist.barrier()
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(stop))
    return statistics.median(times)


def agreement(x, ws_r, wt_r, lo, opts, a, rank):
    """ms of a vocab-parallel fwd+bwd behind ~5 ms of queued GPU work, with and without the host read."""
    m = torch.randn(8192, 8192, device=x.xs.device, dtype=torch.bfloat16)
    out = {}
    for check in (None, False):
        def run():
            for _ in range(3):  # other work queued ahead of the loss (a model's forward)
                m @ m
            xs = x.xs.detach().requires_grad_()
            ws = ws_r.detach().requires_grad_()
            flashkd.fused_linear_distill(xs, ws, x.xt, wt_r, x.y, process_group=dist.group.WORLD, vocab_start=lo,
                                         check_shards=check, **opts).backward()
        out[f"check_shards={check}"] = timed(run, a.reps, a.warmup, rank)
    out["read costs ms"] = out["check_shards=None"] - out["check_shards=False"]
    if rank == 0:
        print("agreement:", out)
    return out


def count_collectives(run) -> dict:
    """{collective: bytes} that one run() hands to torch.distributed (the payloads: an all-gather's
    output, an all-reduce's tensor), counted by wrapping the functions the library calls."""
    counts = {"all_gather_into_tensor": 0, "all_reduce": 0}
    # the function the library calls under each counted name (torch 2.13 renamed the all-gather)
    called = {"all_gather_into_tensor": "all_gather_single" if hasattr(dist, "all_gather_single")
              else "all_gather_into_tensor", "all_reduce": "all_reduce"}
    originals = {fn: getattr(dist, fn) for fn in called.values()}

    def wrap(name):
        def counted(tensor_or_out, *args, **kw):
            counts[name] += tensor_or_out.numel() * tensor_or_out.element_size()
            return originals[called[name]](tensor_or_out, *args, **kw)
        return counted

    for name, fn in called.items():
        setattr(dist, fn, wrap(name))
    try:
        run()
        torch.cuda.synchronize()
    finally:
        for fn, original in originals.items():
            setattr(dist, fn, original)
    return counts


def formula_bytes(w, x, world) -> dict:
    """The bytes of docs/distributed.md for the seed call on the Triton rows (dense JSD + CE, grad): per row 12 fp32 of
    statistics from each rank and 4 fp32 of pass-2 sums; dX's all-reduce N·Hs·E; the layout's all-gather
    of 88 int64 a rank."""
    n, hs, e = w.n, x.xs.shape[1], x.xs.element_size()
    return {"all_gather_into_tensor": n * 12 * 4 * world + 88 * 8 * world, "all_reduce": n * 4 * 4 + n * hs * e}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--only-agreement", action="store_true")
    a = parser.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device())
    w = PRESETS["seed"][0]
    x = make_inputs(w, device)  # the same seeded inputs on every rank
    beta = w.beta if parameter("beta", w.loss) is not None else None  # a loss that does not read beta refuses it
    opts = dict(loss=w.loss, beta=beta, temperature=w.temperature, weight_hard_loss=w.weight_hard,
                weight_soft_loss=w.weight_soft, chunk_size=a.chunk_size)
    v = x.ws.shape[0]
    bounds = [v * r // world for r in range(world + 1)]
    lo, hi = bounds[rank], bounds[rank + 1]
    results = {"world": world, "workload": w.describe(), "chunk_size": a.chunk_size}

    def step(fn):
        def run():
            xs = x.xs.detach().requires_grad_()
            ws = fn.ws.detach().requires_grad_()
            fn(xs, ws).backward()
        return run

    def one_gpu(backend):
        def fn(xs, ws):
            return flashkd.fused_linear_distill(xs, ws, x.xt, x.wt, x.y, backend=backend, **opts)
        fn.ws = x.ws
        return fn

    ws_r, wt_r = x.ws[lo:hi].contiguous(), x.wt[lo:hi].contiguous()
    results["agreement"] = agreement(x, ws_r, wt_r, lo, dict(opts, chunk_size=a.chunk_size or 2048), a, rank)
    if a.only_agreement:
        if rank == 0:
            print(json.dumps(results, indent=2))
            if a.out:
                with open(a.out, "w") as f:
                    json.dump(results, f, indent=2)
        dist.destroy_process_group()
        return

    def parallel(xs, ws):
        return flashkd.fused_linear_distill(xs, ws, x.xt, wt_r, x.y, process_group=dist.group.WORLD,
                                            vocab_start=lo, **opts)
    parallel.ws = ws_r

    # one-gpu (rank 0 alone), one-gpu-torch and vocab-parallel (every rank) in turn, round by round, each
    # round's order reversed from the last: the GPU's clock drifts by a few % over a run, more than the
    # world-1 target's 3 % margin, so the three are timed under the same conditions
    runs = {"one-gpu": step(one_gpu("auto")), "one-gpu-torch": step(one_gpu("torch")), "vocab-parallel": step(parallel)}
    ms = {name: [] for name in runs}
    peak = {name: 0.0 for name in runs}
    rounds = 5
    for r in range(rounds):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            alone = name != "vocab-parallel"
            torch.cuda.reset_peak_memory_stats()
            for i in range(a.warmup + -(-a.reps // rounds)):
                dist.barrier()
                if alone and rank != 0:
                    continue
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                runs[name]()
                e1.record()
                torch.cuda.synchronize()
                if i >= a.warmup:
                    ms[name].append(e0.elapsed_time(e1))
            peak[name] = max(peak[name], torch.cuda.max_memory_allocated() / 2**20)
    for name in runs:
        if rank == 0 or name == "vocab-parallel":
            q = statistics.quantiles(ms[name], n=5)
            results[name] = {"ms": statistics.median(ms[name]), "p20_p80": [q[0], q[-1]], "n": len(ms[name]),
                             "peak_mib": peak[name]}
    counted = count_collectives(runs["vocab-parallel"])
    results["vocab-parallel"]["collective_bytes"] = counted
    results["vocab-parallel"]["formula_bytes"] = formula_bytes(w, x, world)

    # FSDP2: the heads as DTensors sharded on dim 0, each rank its N / world rows
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cuda", (world,))
    ws_d = distribute_tensor(x.ws.detach(), mesh, [Shard(0)])
    wt_d = distribute_tensor(x.wt.detach(), mesh, [Shard(0)])
    rows = slice(w.n * rank // world, w.n * (rank + 1) // world)
    for gather in ("rows", "heads"):
        def run():
            head = ws_d.detach().requires_grad_()
            xs = x.xs[rows].detach().requires_grad_()
            flashkd.fused_linear_distill(xs, head, x.xt[rows], wt_d, x.y[rows], fsdp_gather=gather, **opts).backward()
        torch.cuda.reset_peak_memory_stats()
        ms = timed(run, a.reps, a.warmup, rank)
        call = core.call.Call(LossSpec(), core.call.Student(x.xs, ws_d), core.call.Heads(x.xt, wt_d))
        cost = fsdp.route_bytes(call, {"student_weight": ws_d, "teacher_weight": wt_d}, w.n, world)
        results[f"fsdp-{gather}"] = {"ms": ms, "peak_mib": torch.cuda.max_memory_allocated() / 2**20,
                                     "formula_bytes": cost[gather], "formula_gb_per_s": cost[gather] / ms / 1e6}
    if rank == 0:
        base = results["one-gpu"]["ms"]
        results["vocab-parallel"]["vs_one_gpu"] = results["vocab-parallel"]["ms"] / base
        results["vocab-parallel"]["vs_one_gpu_torch"] = results["vocab-parallel"]["ms"] / results["one-gpu-torch"]["ms"]
        print(json.dumps(results, indent=2))
        if a.out:
            with open(a.out, "w") as f:
                json.dump(results, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
