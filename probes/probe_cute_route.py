"""Which GEMMs the row pass on a cluster (`flashkd.backends.cute_rows`) should follow: the whole call
(forward + backward) at the seed workload on backend "cute" as it is (CuTe DSL logits GEMMs without
statistics), with torch.mm (cuBLAS, fp32 output) in their place, on backend "triton", and the four-GEMM
floor, in one process, in turn, CUDA events, median of --reps (p20–p80). GPU only; needs
nvidia-cutlass-dsl.

    python probes/probe_cute_route.py [--n 8192] [--loss jsd] [--reps 10] [--out FILE.json]
"""

import argparse
import json

import torch

from probe_cute_rows import finish, median_ms  # beside this file: run as a script from probes/


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--loss", default="jsd")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from flashkd.backends import cute_gemm
    from flashkd.bench import providers, workloads

    w = workloads.Workload(a.loss, a.n, h=4096, v=128256, dtype="bfloat16")
    x = workloads.make_inputs(w, torch.device("cuda"))
    real = cute_gemm.logits

    def cublas(x_, w_, planes, *args, **kw):  # the GEMM alone, as the Triton backend's `linear` makes it
        assert planes is None
        return torch.mm(x_, w_.t(), out_dtype=torch.float32)

    def step(fn):
        def run():
            x.xs.grad = x.ws.grad = None
            fn().backward()
        return run

    calls = {"cute": step(providers.PROVIDERS["flashkd-cute"].make(w, x)),
             "triton": step(providers.PROVIDERS["flashkd-triton"].make(w, x)),
             "floor": step(providers.PROVIDERS["floor"].make(w, x))}
    result = {"n": a.n, "loss": a.loss}
    for _ in range(2):  # the cuBLAS variant in turn with the others
        for name, fn in calls.items():
            fn()
            ms, p20, p80 = median_ms(fn, a.reps)
            result.setdefault(name, []).append([round(ms, 3), round(p20, 3), round(p80, 3)])
        cute_gemm.logits = cublas
        calls["cute, cuBLAS GEMMs"] = calls.pop("cute")
        fn = calls["cute, cuBLAS GEMMs"]
        fn()
        ms, p20, p80 = median_ms(fn, a.reps)
        result.setdefault("cute, cuBLAS GEMMs", []).append([round(ms, 3), round(p20, 3), round(p80, 3)])
        cute_gemm.logits = real
        calls["cute"] = calls.pop("cute, cuBLAS GEMMs")
    print(json.dumps(result))
    finish(result, a.out)


if __name__ == "__main__":
    main()
