"""The row kernel alone: ms per block and effective bandwidth, for each loss, bf16, V = 128256.

Bytes counted as the kernel's minimum traffic: one read of s and t and one write of dS (grad), or one
read of s and t (no grad). Usage: python benchmarks/bench_rows.py [--rows 8192] [--vocab 128256]
"""

import argparse

import torch
import triton

from flashkd.backends import triton_rows
from flashkd.losses import LossSpec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--configs", nargs="+", default=[f"{triton_rows.BLOCK_V}x{triton_rows.NUM_WARPS}"],
                    help="BLOCK_VxNUM_WARPS tile configurations to compare, e.g. 4096x16 1024x4")
    ap.add_argument("--loss", nargs="+", default=["jsd", "forward_kl", "reverse_kl", "tvd", "cosine"])
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args()
    r, v = args.rows, args.vocab
    s0 = torch.randn(r, v, device="cuda", dtype=torch.bfloat16) * 3
    t = torch.randn(r, v, device="cuda", dtype=torch.bfloat16) * 3
    s = s0.clone()
    y = torch.randint(0, v, (r,), device="cuda")
    scale = torch.tensor(1.0 / r, device="cuda")
    copy_ms = triton.testing.do_bench(lambda: s.copy_(s0), rep=300)
    print(f"copy s <- s0 ({2 * s.numel() * 2 / 1e9:.2f} GB): {copy_ms:.3f} ms, "
          f"{2 * s.numel() * 2 / copy_ms / 1e6:.0f} GB/s")
    print(f"{'loss':<12}{'grad':>6}{'w_hard':>8}{'config':>9}{'ms':>9}{'GB/s':>8}")
    for loss in args.loss:
        for grad, w_hard in ((True, 0.5), (True, 0.0), (False, 0.5)):
            spec = LossSpec(loss=loss, beta=0.5, weight_hard=w_hard, want_hard=w_hard != 0,
                            temperature=args.temperature)
            for config in args.configs:
                triton_rows.BLOCK_V, triton_rows.NUM_WARPS = map(int, config.split("x"))
                ms = triton.testing.do_bench(lambda: triton_rows.rows(s, t, y, spec, scale, grad), rep=200)
                nbytes = (3 if grad else 2) * s.numel() * 2
                print(f"{loss:<12}{str(grad):>6}{w_hard:>8}{config:>9}{ms:>9.3f}{nbytes / ms / 1e6:>8.0f}")
                s.copy_(s0)


if __name__ == "__main__":
    main()
