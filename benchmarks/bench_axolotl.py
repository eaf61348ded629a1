"""axolotl's top-k KD loss against flashkd's drop-in: forward + backward from the student's last hidden
states, in one process on the same inputs.

axolotl 0.19's `LigerFusedLinearKLTopKLogprobLoss` (Liger's chunked distillation base: bf16 logits a
chunk, each chunk's gradient by torch.func, `compiled` as axolotl's trainer leaves it: True on GPU)
against `flashkd.integrations.axolotl.FusedLinearKLTopKLogprobLoss`, with the same settings: kd_beta 0
(forward KL), kd_temperature 1, kd_normalize_topk true, kd_alpha 1 and kd_ce_alpha 0 (--ce: 0.5 and
0.5, the CE of the shifted labels too), every slot valid.

Shapes (the issue's): N tokens 8192, V 128256, H 2048 (Llama-3's vocab, Llama-3.2-1B's width), K 64, bf16.
Teacher: the top-K ids of random logits of std 3, their log-probs renormalised over the K (as axolotl's
collators store them); student logits of std about 4. Timed: CUDA events, median and 20th / 80th
percentiles over --reps after --warmup. Memory: peak allocated during one forward + backward minus
what was allocated before it. The losses of the two are printed side by side.

Usage: python benchmarks/bench_axolotl.py [--ce] [--out DIR]          (one GPU)
       python benchmarks/bench_axolotl.py --smoke [--out DIR]         (tiny shapes, fp32, CPU: checks only)
results.json and summary.md go into --out (default: a new bench-axolotl-YYYYmmdd-HHMMSS/).
Needs axolotl==0.19.0, liger-kernel, peft and addict (pip install --no-deps axolotl==0.19.0 peft addict).
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _trl_common import out_dir, timed_steps, write_summary  # noqa: E402

from axolotl.integrations.kd.kernels.liger import LigerFusedLinearKLTopKLogprobLoss  # noqa: E402

import flashkd.integrations.axolotl as fk_ax  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="tiny shapes in fp32 (CPU where there is no GPU): checks only")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--ce", action="store_true", help="kd_ce_alpha 0.5 and kd_alpha 0.5 (else 0 and 1)")
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.smoke:
        args.tokens, args.vocab, args.hidden, args.k, args.warmup, args.reps = 48, 257, 32, 8, 1, 2
    return args


def inputs(n, v, h, k, dtype, device, g):
    x = torch.randn(1, n, h, generator=g, device=device).to(dtype)
    w = (torch.randn(v, h, generator=g, device=device) * (4.0 / h**0.5)).to(dtype)
    ids = torch.empty(n, k, dtype=torch.long, device=device)
    lp = torch.empty(n, k, dtype=torch.float32, device=device)
    for s in range(0, n, 4096):
        t = torch.randn(min(4096, n - s), v, generator=g, device=device) * 3.0
        lp[s:s + t.shape[0]], ids[s:s + t.shape[0]] = torch.log_softmax(t, -1).topk(k, -1)
    lp = lp - lp.logsumexp(-1, keepdim=True)
    labels = torch.randint(0, v, (1, n), generator=g, device=device)
    return x, w, ids[None], lp[None], torch.ones_like(ids)[None], labels


def run_one(module, x, w, ids, lp, mask, labels, args, device):
    lp = lp.to(x.dtype) if isinstance(module, LigerFusedLinearKLTopKLogprobLoss) else lp

    def step(xs, ws):
        loss = module(ws, xs, ids, lp, mask, labels)
        return loss, loss

    result, loss = timed_steps(step, (x, w), args, device)
    return {**result, "loss": loss.item()}


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = out_dir(args, "axolotl")
    g = torch.Generator(device=device).manual_seed(args.seed)
    data = inputs(args.tokens, args.vocab, args.hidden, args.k, dtype, device, g)
    w_hard, w_soft = (0.5, 0.5) if args.ce else (0.0, 1.0)
    settings = dict(weight_hard_loss=w_hard, weight_soft_loss=w_soft, temperature=1.0, beta=args.beta,
                    compute_ce_loss=args.ce, normalize_topk=True)
    modules = {
        # axolotl's trainer leaves compiled at its default (True); torch.compile is for the GPU run
        "axolotl (Liger)": LigerFusedLinearKLTopKLogprobLoss(**settings, compiled=device.type == "cuda"),
        "flashkd": fk_ax.FusedLinearKLTopKLogprobLoss(**settings),
    }
    rows = []
    for name, module in modules.items():
        try:
            rows.append({"variant": name, **run_one(module, *data, args, device)})
        except torch.OutOfMemoryError:
            rows.append({"variant": name, "oom": True})
            torch.cuda.empty_cache()
    summary = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": str(dtype),
               "torch": torch.__version__, "tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden,
               "k": args.k, "settings": settings, "rows": rows}
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    lines = ["| variant | median ms | p20–p80 ms | peak extra GB | loss |", "|---|---:|---|---:|---:|"]
    for r in rows:
        if r.get("oom"):
            lines.append(f"| {r['variant']} | OOM | | | |")
            continue
        mem = "" if r["peak_extra_bytes"] is None else f"{r['peak_extra_bytes'] / 1e9:.2f}"
        lines.append(f"| {r['variant']} | {r['median_s'] * 1e3:.1f} | {r['p20_s'] * 1e3:.1f}–{r['p80_s'] * 1e3:.1f} | "
                     f"{mem} | {r['loss']:.6g} |")
    table = "\n".join(lines)
    return write_summary(out, f"axolotl top-k KD loss, {summary['device']}, {dtype}, N {args.tokens}, V {args.vocab}, "
                              f"H {args.hidden}, K {args.k}, {settings}", table)


if __name__ == "__main__":
    sys.exit(main())
