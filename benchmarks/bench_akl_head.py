"""AKL's head kernels alone (`flashkd.backends.triton_rows.akl_head_keys`) on one chunk of teacher logits, fp32
(R 1024, V 128256, μ 0.5): a trained teacher (every row peaked at 30 over std 4: the first read settles it),
three rows in four unpeaked at std 4 (a head of tens of ids: settled from the lanes' four largest keys), and a
flat one (std 0.5: a head of a quarter of the vocabulary, the bins). Median of 12 CUDA-event timings.

Usage: python benchmarks/bench_akl_head.py   (one GPU)
"""

import torch

from flashkd.backends import triton_rows
from flashkd.losses import LossSpec

R, V = 1024, 128256


def teacher(kind: str, gen: torch.Generator) -> torch.Tensor:
    if kind == "flat":
        return torch.randn(R, V, device="cuda", generator=gen) * 0.5
    t = torch.randn(R, V, device="cuda", generator=gen) * 4
    rows = torch.arange(0, R, 4 if kind == "mixed" else 1, device="cuda")  # mixed: every 4th row peaked
    t[rows, torch.randint(V, (rows.numel(),), device="cuda", generator=gen)] = 30.0
    return t


def main() -> None:
    spec = LossSpec(loss="akl", head_mass=0.5)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for kind in ("trained", "mixed", "flat"):
        t = teacher(kind, gen)
        out = triton_rows.akl_head_keys(t, spec)  # compiled and warmed
        times = []
        for _ in range(12):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            triton_rows.akl_head_keys(t, spec)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        times.sort()
        print(f"{kind:8s} head keys {times[len(times) // 2]:.3f} ms (min {times[0]:.3f}); rows the search settled "
              f"{int((out[:, 3] != 0).sum())} of {R}")


if __name__ == "__main__":
    main()
