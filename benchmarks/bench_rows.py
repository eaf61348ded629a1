"""The row kernels alone: ms per block and effective bandwidth, for each loss, bf16, V = 128256.

Bytes counted as the kernel's minimum traffic: one read of s and t and one write of dS (grad), or one
read of s and t (no grad); for a top-k teacher (K = 64) one read of s and one write of dS, or one read.
Then teacher_topk's work on a block of logits: torch.topk alone, and flashkd's top-k + log-softmax kernel.
Usage: python benchmarks/bench_rows.py [--rows 8192] [--vocab 128256] [--loss ...] [--k 64 ...]
       [--parts dense topk teacher] [--lanes 256 512 ...]
Each kernel runs with its module's tile (BLOCK_V, NUM_WARPS); the comparison of other tiles that chose them is
in the history (BENCHMARKS.md).
"""

import argparse

import torch
import triton

from flashkd.backends import triton_rows, triton_topk
from flashkd.losses import LossSpec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--loss", nargs="+", default=["jsd", "forward_kl", "reverse_kl", "tvd", "cosine"])
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--k", type=int, nargs="+", default=[64], help="top-k sizes (the first for the top-k losses)")
    ap.add_argument("--lanes", type=int, nargs="+", default=None, help="teacher_topk kernel widths to compare")
    ap.add_argument("--parts", nargs="+", default=["dense", "topk", "teacher"], choices=["dense", "topk", "teacher"])
    args = ap.parse_args()
    dense_config = f"{triton_rows.BLOCK_V}x{triton_rows.NUM_WARPS}"
    topk_config = f"{triton_topk.BLOCK_V}x{triton_topk.NUM_WARPS}"
    r, v = args.rows, args.vocab
    s0 = torch.randn(r, v, device="cuda", dtype=torch.bfloat16) * 3
    t = torch.randn(r, v, device="cuda", dtype=torch.bfloat16) * 3
    s = s0.clone()
    y = torch.randint(0, v, (r,), device="cuda")
    scale = torch.tensor(1.0 / r, device="cuda")
    copy_ms = triton.testing.do_bench(lambda: s.copy_(s0), rep=300)
    print(f"copy s <- s0 ({2 * s.numel() * 2 / 1e9:.2f} GB): {copy_ms:.3f} ms, "
          f"{2 * s.numel() * 2 / copy_ms / 1e6:.0f} GB/s")
    print(f"{'loss':<12}{'grad':>6}{'w_hard':>8}{'config':>12}{'ms':>9}{'GB/s':>8}")
    for loss in args.loss if "dense" in args.parts else ():
        for grad, w_hard in ((True, 0.5), (True, 0.0), (False, 0.5)):
            spec = LossSpec(loss=loss, beta=0.5, weight_hard=w_hard, want_hard=w_hard != 0,
                            temperature=args.temperature)
            ms = triton.testing.do_bench(lambda: triton_rows.rows(s, t, y, spec, scale, grad), rep=200)
            nbytes = (3 if grad else 2) * s.numel() * 2
            print(f"{loss:<12}{str(grad):>6}{w_hard:>8}{dense_config:>12}{ms:>9.3f}{nbytes / ms / 1e6:>8.0f}")
            s.copy_(s0)

    # top-k teacher: ids / log-probs of the block's t, shuffled slots
    lp_full = torch.log_softmax(t.float() / args.temperature, -1)
    top = lp_full.topk(args.k[0], -1)
    ids, logprobs = top.indices, top.values
    del lp_full
    for loss in ("forward_kl", "jsd") if "topk" in args.parts else ():
        for tail in ("bucket", "renormalize"):
            for grad, w_hard in ((True, 0.0), (True, 0.5), (False, 0.0)):
                spec = LossSpec(loss=loss, beta=0.5, weight_hard=w_hard, weight_soft=1.0, want_hard=w_hard != 0,
                                temperature=args.temperature, tail=tail)
                ms = triton.testing.do_bench(
                    lambda: (s.copy_(s0), triton_topk.topk_rows(s, (ids, logprobs), y, spec, scale, grad)), rep=200)
                ms -= copy_ms  # the copy restores the −inf the stats kernel writes over the ids
                nbytes = (3 if grad else 1) * s.numel() * 2
                print(f"{'topk-' + loss + '-' + tail:<28}{str(grad):>6}{w_hard:>8}{topk_config:>9}{ms:>9.3f}"
                      f"{nbytes / ms / 1e6:>8.0f}")
    s.copy_(s0)
    if "teacher" not in args.parts:
        return
    for k in args.k:
        ms = triton.testing.do_bench(lambda: torch.topk(s, k, dim=-1), rep=200)
        print(f"teacher_topk: torch.topk k={k}: {ms:.3f} ms")
        for lanes in args.lanes or [triton_topk._topk_lanes(k)]:
            ms = triton.testing.do_bench(lambda: triton_topk.row_topk(s, k, args.temperature, lanes=lanes), rep=200)
            # the kernel alone: without the redo check (a host sync) and the gather of the log-probs
            ms_kernel = triton.testing.do_bench(
                lambda: triton_topk.kernel_topk(s, k, args.temperature, lanes=lanes), rep=200)
            print(f"teacher_topk: row_topk k={k}, {lanes} lanes (ids, log-probs): {ms:.3f} ms "
                  f"({2 * s.numel() * 2 / ms / 1e6:.0f} GB/s over 2 reads)")
            print(f"teacher_topk: its kernel alone: {ms_kernel:.3f} ms")


if __name__ == "__main__":
    main()
