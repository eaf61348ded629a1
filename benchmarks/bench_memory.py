"""Speed, extra memory and accuracy of flashkd for the memory knobs (chunk rows, dW accumulator): the
seed JSD workload (teacher heads) and the same student with a top-k teacher (K = 64, forward KL, soft
only).

Extra memory = max_memory_allocated during one forward+backward minus what was allocated before it.
Errors: relative L2 of dX and dW against the same call on fp32 copies of the inputs (TF32 off), so
that a bf16 accumulator's roundings of dW show against the fp32 one's.
Usage: python benchmarks/bench_memory.py
"""


import torch
import triton

import flashkd
from flashkd.bench.measure import cuda_peak
from flashkd.bench.workloads import PRESETS, make_inputs

SETTINGS = [  # (chunk_size, grad_accum_dtype)
    (None, None),
    (1024, None),
    (4096, None),
    (None, torch.bfloat16),
    (2048, torch.bfloat16),
    (1639, torch.bfloat16),  # 5 chunks: just under 1 GB with a top-k teacher
    (1024, torch.bfloat16),
    (512, torch.bfloat16),
]
K = 64


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    w = PRESETS["seed"][0]
    x = make_inputs(w, torch.device("cuda"))
    ids, logprobs = flashkd.teacher_topk(x.xt, x.wt, K)
    forms = {
        "jsd": lambda xs, ws, **kw: flashkd.fused_linear_distill(xs, ws, x.xt.to(xs.dtype), x.wt.to(xs.dtype), x.y, **kw),
        f"topk{K}": lambda xs, ws, **kw: flashkd.fused_linear_distill_topk(xs, ws, ids, logprobs, **kw),
    }
    print(f"N={w.n} H={w.h} V={w.v} {w.dtype}")
    print(f"{'form':>8}{'chunk':>7}{'dW accum':>12}{'ms p50':>9}{'p20':>8}{'p80':>8}{'extra MiB':>11}{'dX err':>9}{'dW err':>9}")
    for form, run in forms.items():
        xs32, ws32 = (t.detach().float().requires_grad_() for t in (x.xs, x.ws))
        run(xs32, ws32).backward()
        truth = xs32.grad.double(), ws32.grad.double()
        del xs32, ws32
        torch.cuda.empty_cache()
        for chunk, accum in SETTINGS:
            def step():
                run(x.xs, x.ws, chunk_size=chunk, grad_accum_dtype=accum).backward()

            ms, extra = time_and_extra(step, [x.xs, x.ws], keep_grads=True)
            err = [((g.grad.double() - t).norm() / t.norm()).item() for g, t in zip((x.xs, x.ws), truth)]
            x.xs.grad = x.ws.grad = None
            name = "fp32" if accum is None else str(accum).removeprefix("torch.")
            print(f"{form:>8}{str(chunk or 'auto'):>7}{name:>12}{ms[0]:>9.2f}{ms[1]:>8.2f}{ms[2]:>8.2f}{extra:>11.0f}"
                  f"{err[0]:>9.2e}{err[1]:>9.2e}")
        del truth
        torch.cuda.empty_cache()


def time_and_extra(step, grads, keep_grads=False):
    """([median, p20, p80] ms, extra MiB) of a forward+backward `step` whose grads land on `grads`;
    with keep_grads, the measured step's grads are left on them."""
    ms = triton.testing.do_bench(step, quantiles=[0.5, 0.2, 0.8], rep=500, grad_to_none=grads)
    for g in grads:
        g.grad = None
    peak, before = cuda_peak(step)
    extra = (peak - before) / 2**20
    if not keep_grads:
        for g in grads:
            g.grad = None
    return ms, extra


if __name__ == "__main__":
    main()
