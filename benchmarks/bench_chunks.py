"""flashkd's seed JSD (bf16, N 8192, Ht 4096 / Hs 2048, V 128256, 0.5 CE + 0.5 JSD) forward + backward at
several chunk sizes, against the four GEMMs' floor, in one process: which plan the logits' bytes favour.

    python benchmarks/bench_chunks.py [--chunks 1024 2048 ...] [--n 8192]
"""

import argparse

import torch
import triton.testing

import flashkd


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--chunks", type=int, nargs="+", default=[0, 1024, 2048])  # 0: the default plan
    a = p.parse_args()
    torch.manual_seed(0)
    n, h, v, dt = a.n, 4096, 128256, torch.bfloat16
    xs = torch.rand(n, h // 2, device="cuda").to(dt).requires_grad_()
    xt = torch.rand(n, h, device="cuda").to(dt)
    ws = torch.nn.Linear(h // 2, v, bias=False, device="cuda").weight.detach().to(dt).requires_grad_()
    wt = torch.nn.Linear(h, v, bias=False, device="cuda").weight.detach().to(dt)
    y = torch.randint(0, v, (n,), device="cuda")

    def floor():
        s = xs @ ws.t()
        xt @ wt.t()
        s @ ws
        s.t() @ xs

    def step(chunk):
        def run():
            xs.grad = ws.grad = None
            flashkd.fused_linear_distill(xs, ws, xt, wt, y, chunk_size=chunk or None).backward()
        return run

    with torch.no_grad():
        t_floor = triton.testing.do_bench(floor, rep=500, quantiles=[0.5, 0.2, 0.8])
    print(f"floor {t_floor[0]:.2f} ms (p20-p80 {t_floor[1]:.2f}-{t_floor[2]:.2f})")
    for chunk in a.chunks:
        run = step(chunk)
        run()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        t = triton.testing.do_bench(run, rep=1000, quantiles=[0.5, 0.2, 0.8])
        print(f"chunk {chunk or 'default'}: {t[0]:.2f} ms (p20-p80 {t[1]:.2f}-{t[2]:.2f}) = {t[0] / t_floor[0]:.3f}x floor, "
              f"extra peak {peak:.0f} MiB")


if __name__ == "__main__":
    main()
