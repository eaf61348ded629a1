"""verl's top-k distillation loss against flashkd's: forward + backward from the student's last hidden
states, in one process on the same inputs.

verl 0.9.1's own path, as its FSDP engine runs it without fused kernels: the LM-head GEMM to bf16 logits
(1, N, V), then `verl.trainer.distillation.fsdp.losses.compute_forward_kl_topk` (log-softmax, the
student's top-K, the gather; "verl"), or the same with `use_chunked_topk` ("verl chunked"); flashkd:
`flashkd.integrations.verl.topk_outputs` from the hidden states and the head ("flashkd": the same five
per-token outputs, no (N × V) logits, with the per-token weight the patch predicts for verl's
token-mean, so that its gradients come from the forward's sweep: three GEMMs; "flashkd fallback": a
gradient that is no multiple of the prediction, so the backward sweeps again for dW: five GEMMs;
"flashkd unpredicted": no prediction, dW swept in the backward: four GEMMs), and flashkd's top-k form
alone ("flashkd top-k form": the loss and its gradient without verl's per-token values and
diagnostics). Each: the per-token losses clamped at 0 and averaged over the tokens (verl's
token-mean; the fallback adds 1e-3 × a random weight per token), then the gradient to the hidden
states and the head.

The integration's time split ("split" in results.json, the summary's second table): one forward +
backward of "flashkd" under torch.profiler, its GPU kernels summed by what they do: the GEMMs (cuBLAS),
the row pass (flashkd's stats kernel, its expand kernel), the diagnostics (the top-k kernel, or the
membership's rank kernel), the rest (the (R, K + 1) row math: one kernel for verl's forward KL, torch for the
other losses; copies, the backward's scaling); and the backward's check
(`_proportional` and its host read), timed alone with CUDA events.

Shapes (default): N tokens 32768 and 65536, K 32 and 128, V 151936, H 2048 (Qwen's vocab), bf16, τ 1,
no log_prob_min_clamp. Teacher: the top-K ids and log-probs of random logits of std 3; student logits of
std about 4. Timed: CUDA events, median and 20th / 80th percentiles over --reps after --warmup.
Memory: peak allocated during one forward + backward minus what was allocated before it (inputs and
parameters; their gradients freed). A variant that runs out of memory is reported as such.

Usage: python benchmarks/bench_verl.py [--out DIR]          (one GPU)
       python benchmarks/bench_verl.py --smoke [--out DIR]  (tiny shapes, fp32, CPU: checks only)
results.json and summary.md go into --out (default: a new bench-verl-YYYYmmdd-HHMMSS/).
Needs verl==0.9.1 (pip install --no-deps verl==0.9.1 omegaconf antlr4-python3-runtime==4.9.3 is enough).
"""

import argparse
import json
import statistics
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _trl_common import out_dir, seconds, stamp, sync, timed_steps, write_summary  # noqa: E402
from _verl_losses import load_verl_losses  # noqa: E402

import flashkd  # noqa: E402
import flashkd.integrations.verl as fk_verl  # noqa: E402


VARIANTS = ["verl", "verl chunked", "flashkd", "flashkd chunk x0.5", "flashkd fallback", "flashkd unpredicted",
            "flashkd top-k form"]  # and "flashkd chunk xF" for any factor F


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="tiny shapes in fp32 (CPU where there is no GPU): checks only")
    p.add_argument("--tokens", type=int, nargs="+", default=[32768, 65536])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--k", type=int, nargs="+", default=[32, 128])
    p.add_argument("--variants", nargs="+", default=VARIANTS)
    p.add_argument("--no-split", action="store_true", help="skip the integration's time split")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.smoke:
        args.tokens, args.vocab, args.hidden, args.k, args.warmup, args.reps = [37, 64], 301, 24, [8, 80], 1, 2
    return args


def inputs(n, v, h, k, dtype, device, g):
    x = (torch.randn(n, h, generator=g, device=device)).to(dtype)
    w = (torch.randn(v, h, generator=g, device=device) * (4.0 / h**0.5)).to(dtype)
    ids = torch.empty(n, k, dtype=torch.long, device=device)
    lp = torch.empty(n, k, dtype=torch.float32, device=device)
    for s in range(0, n, 4096):  # the teacher's top-k of random logits, a block of rows at a time
        t = torch.randn(min(4096, n - s), v, generator=g, device=device) * 3.0
        lp[s:s + t.shape[0]], ids[s:s + t.shape[0]] = torch.log_softmax(t, -1).topk(k, -1)
    return x, w, ids, lp


def variant(name, verl_losses, ids, lp, n):
    offsets = torch.tensor([0, n], device=ids.device)
    nested_lp = torch.nested.nested_tensor_from_jagged(lp, offsets)
    nested_ids = torch.nested.nested_tensor_from_jagged(ids, offsets)

    def verl(x, w, chunked):
        cfg = types.SimpleNamespace(distillation_loss=types.SimpleNamespace(
            log_prob_min_clamp=None, use_chunked_topk=chunked, chunked_topk_chunk_size=4096))
        logits = x @ w.t()  # the LM head under bf16 autocast: bf16 logits
        out = verl_losses.compute_forward_kl_topk(logits[None], nested_lp, nested_ids, cfg, "thd")
        return out["distillation_losses"][0]

    if name in ("verl", "verl chunked"):
        return lambda x, w: verl(x, w, name == "verl chunked")
    ones = torch.ones(n, device=ids.device)  # token-mean over every row: the weight the patch predicts
    if name == "flashkd":
        return lambda x, w: fk_verl.topk_outputs(x, w, ids, lp, predicted_grad=ones,
                                                 predicted_clamp=(0.0, None))["distillation_losses"]
    if name.startswith("flashkd chunk x"):  # chunks of F times the default rows ("flashkd chunk x0.5"): the
        factor = float(name.removeprefix("flashkd chunk x"))  # chunk's memory against the chunks' number
        return lambda x, w: fk_verl.topk_outputs(
            x, w, ids, lp, predicted_grad=ones, predicted_clamp=(0.0, None),
            chunk_size=max(1, int(fk_verl._chunk_rows(n, w.shape[0], None, "triton", 4) * factor)))["distillation_losses"]
    if name == "flashkd fallback":  # the same call; run_one weighs its tokens by 1 + 1e-3 · a random number
        return lambda x, w: fk_verl.topk_outputs(x, w, ids, lp, predicted_grad=ones,
                                                 predicted_clamp=(0.0, None))["distillation_losses"]
    if name == "flashkd unpredicted":
        return lambda x, w: fk_verl.topk_outputs(x, w, ids, lp)["distillation_losses"]
    if name == "flashkd top-k form":  # the loss alone, one scalar: no per-token values
        return lambda x, w: flashkd.fused_linear_distill_topk(x, w, ids, lp, tail="bucket", reduction="sum")[None]
    raise SystemExit(f"--variants: unknown {name!r}")


def run_one(fn, x, w, args, device, token_weight=None):
    """Timed forward + backward of a variant: its per-token losses clamped at 0, (weighed and) averaged;
    (times and peak memory, the last run's per-token losses in float64 on the CPU)."""
    def step(xs, ws):
        per_token = fn(xs, ws)
        kept = per_token.clamp_min(0.0)
        return (kept if token_weight is None else kept * token_weight).sum() / x.shape[0], per_token

    return timed_steps(step, (x, w), args, device)


KINDS = (("GEMMs", ("gemm", "cutlass", "nvjet", "xmma", "sm90_", "sm80_", "cublas")),
         ("row pass: stats", ("stats_kernel",)), ("row pass: expand", ("expand_kernel",)),
         ("diagnostics", ("_topk_kernel", "rank_kernel")))


def split(x, w, ids, lp, n, args, device):
    """The integration's time split: one forward + backward of "flashkd" under torch.profiler, its GPU
    kernels' time summed by KINDS (the rest: "other"), ms; and the backward's check alone (CUDA events)."""
    from torch.profiler import ProfilerActivity, profile

    fn = variant("flashkd", None, ids, lp, n)
    xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()
    run_one(fn, x, w, argparse.Namespace(warmup=0, reps=1), device)  # compiled, allocated
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        per_token = fn(xs, ws)
        (per_token.clamp_min(0.0).sum() / n).backward()
        sync()
    times = {name: 0.0 for name, _ in KINDS}
    times["other"] = 0.0
    other = {}
    for event in prof.key_averages():
        if "CUDA" not in str(getattr(event, "device_type", "CUDA")):  # kernels only: no op counted twice
            continue
        total = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)
        if not total:
            continue
        kind = next((k for k, keys in KINDS if any(key in event.key.lower() for key in keys)), "other")
        times[kind] += total / 1e3
        if kind == "other":
            other[event.key[:60]] = (other.get(event.key[:60], (0.0, 0))[0] + total / 1e3, event.count)
    for key, (ms, count) in sorted(other.items(), key=lambda kv: -kv[1][0])[:8]:  # where "other" goes
        print(f"  other: {ms:8.3f} ms  {count:4d} calls  {key}")
    g = torch.full((n,), 1.0 / n, device=device)
    pred = torch.ones(n, device=device)
    checks = []
    for _ in range(args.reps + 1):
        a = stamp()
        bool(fk_verl._proportional(g, pred)[1])
        b = stamp()
        sync()
        checks.append(seconds(a, b) * 1e3)
    times["check"] = statistics.median(checks[1:])
    return {k: round(v, 3) for k, v in times.items()}


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    verl_losses = load_verl_losses()
    out = out_dir(args, "verl")
    rows, splits = [], []
    for k in args.k:
        for n in args.tokens:
            g = torch.Generator(device=device).manual_seed(args.seed)
            x, w, ids, lp = inputs(n, args.vocab, args.hidden, k, dtype, device, g)
            noise = 1.0 + 1e-3 * torch.rand(n, generator=g, device=device)
            ref = None
            for name in args.variants:
                try:
                    result, losses = run_one(variant(name, verl_losses, ids, lp, n), x, w, args, device,
                                             noise if name == "flashkd fallback" else None)
                except torch.OutOfMemoryError:
                    rows.append({"k": k, "tokens": n, "variant": name, "oom": True})
                    torch.cuda.empty_cache()
                    continue
                if losses.numel() == n:  # per-token values: against verl's (its bf16 log-softmax rounds them)
                    ref = losses if ref is None else ref
                    result["max_abs_diff_vs_first"] = (losses - ref).abs().max().item()
                rows.append({"k": k, "tokens": n, "variant": name, **result})
            if device.type == "cuda" and not args.no_split and "flashkd" in args.variants:
                try:
                    splits.append({"k": k, "tokens": n, **split(x, w, ids, lp, n, args, device)})
                except torch.OutOfMemoryError:
                    torch.cuda.empty_cache()
            del x, w, ids, lp
    summary = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": str(dtype),
               "torch": torch.__version__, "vocab": args.vocab, "hidden": args.hidden, "k": args.k, "rows": rows,
               "split": splits}
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    lines = ["| K | tokens | variant | median ms | p20–p80 ms | peak extra GB | max |Δ| per-token loss |",
             "|---:|---:|---|---:|---|---:|---:|"]
    for r in rows:
        if r.get("oom"):
            lines.append(f"| {r['k']} | {r['tokens']} | {r['variant']} | OOM | | | |")
            continue
        mem = "" if r["peak_extra_bytes"] is None else f"{r['peak_extra_bytes'] / 1e9:.2f}"
        diff = f"{r['max_abs_diff_vs_first']:.2e}" if "max_abs_diff_vs_first" in r else ""
        lines.append(f"| {r['k']} | {r['tokens']} | {r['variant']} | {r['median_s'] * 1e3:.1f} | "
                     f"{r['p20_s'] * 1e3:.1f}–{r['p80_s'] * 1e3:.1f} | {mem} | {diff} |")
    if splits:
        kinds = [name for name, _ in KINDS] + ["other", "check"]
        lines += ["", "flashkd's GPU time by kind, ms (one forward + backward, profiled; check: the backward's, alone)",
                  "", "| K | tokens | " + " | ".join(kinds) + " |", "|---:|---:|" + "---:|" * len(kinds)]
        for s in splits:
            cells = (f"{s[name]:.3f}" if name == "check" else f"{s[name]:.1f}" for name in kinds)
            lines.append(f"| {s['k']} | {s['tokens']} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    title = f"verl top-k loss, {summary['device']}, {dtype}, V {args.vocab}, H {args.hidden}"
    return write_summary(out, title, table)


if __name__ == "__main__":
    sys.exit(main())
