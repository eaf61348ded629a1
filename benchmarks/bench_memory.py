"""Speed and extra memory of flashkd for the memory knobs (chunk rows, dW accumulator): the seed JSD
workload (teacher heads) and the same student with a top-k teacher (K = 64, forward KL, soft only).

Extra memory = max_memory_allocated during one forward+backward minus what was allocated before it.
Usage: python benchmarks/bench_memory.py
"""

import itertools

import torch
import triton

import flashkd
from flashkd.bench.workloads import PRESETS, make_inputs

SETTINGS = [  # (chunk_size, grad_accum_dtype)
    (None, None),
    (1024, None),
    (4096, None),
    (1024, torch.bfloat16),
    (512, torch.bfloat16),
]
K = 64


def main():
    w = PRESETS["seed"][0]
    x = make_inputs(w, torch.device("cuda"))
    ids, logprobs = flashkd.teacher_topk(x.xt, x.wt, K)
    forms = {
        "jsd": lambda **kw: flashkd.fused_linear_distill(x.xs, x.ws, x.xt, x.wt, x.y, **kw),
        f"topk{K}": lambda **kw: flashkd.fused_linear_distill_topk(x.xs, x.ws, ids, logprobs, **kw),
    }
    print(f"N={w.n} H={w.h} V={w.v} {w.dtype}")
    print(f"{'form':>8}{'chunk':>7}{'dW accum':>12}{'ms p50':>9}{'p20':>8}{'p80':>8}{'extra MiB':>11}")
    for (form, run), (chunk, accum) in itertools.product(forms.items(), SETTINGS):
        def step():
            run(chunk_size=chunk, grad_accum_dtype=accum).backward()

        ms, extra = time_and_extra(step, [x.xs, x.ws])
        name = "fp32" if accum is None else str(accum).removeprefix("torch.")
        print(f"{form:>8}{str(chunk or 'auto'):>7}{name:>12}{ms[0]:>9.2f}{ms[1]:>8.2f}{ms[2]:>8.2f}{extra:>11.0f}")


def time_and_extra(step, grads):
    """([median, p20, p80] ms, extra MiB) of a forward+backward `step` whose grads land on `grads`."""
    ms = triton.testing.do_bench(step, quantiles=[0.5, 0.2, 0.8], rep=500, grad_to_none=grads)
    for g in grads:
        g.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - before) / 2**20
    for g in grads:
        g.grad = None
    return ms, extra


if __name__ == "__main__":
    main()
