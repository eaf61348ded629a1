"""The softcap's cost, variant by variant: the Triton row kernel alone and the whole op at the JSD seed.

Workload: the seed's JSD (`flashkd bench --preset seed -n 8192 --loss jsd --softcap C`: N = 8192,
V = 128256, student hidden 2048, teacher 4096, bf16, β = 0.5, CE weight 0.5), z = c·tanh(s/c) on both
heads. Per variant, in a fresh process (what it swaps in is in place before anything compiles):
    rows     triton_rows.rows on an (N, V) block of bf16 logits (randn · 3, as benchmarks/bench_rows.py),
             with grad (the kernel of `full`) and without (the kernel of `no-grad-forward`)
    full     fused_linear_distill forward + backward (the bench's `full` mode), and no-grad forward,
             p50 (p20–p80) ms, each as a ratio to the four-GEMM floor timed in the same run
    errors   loss, dX, dW against the bench's fp32 reference (measure.reference), as `flashkd bench`
             reports them; plain torch's on the same transformed logits come from the `torch` variant

Variants:
    floor     the GEMMs alone (providers' floor), full and no-grad
    torch     plain torch with the softcap: its errors only (not timed)
    none      no transform: must match what it measured before the softcap work
    old       the tanh before `_tanh`'s FMA-pipe options: y = x·σ/c, ±(1 − t)·rcp(1 + t) times c, with
              the sign and the cap applied at each load (a copy of that code, with c a compile-time
              constant here: if anything a little faster than it was)
    sfu       the current tanh with its exp2 and reciprocal on the SFU everywhere (masks 0, 0)
    default   the current tanh with triton_rows' default masks (the JSD's entries)
    fma       every softcapped load's reciprocal on the FMA pipe (mask 0b111111)
    KEY=V,... any masks / registers: rcp=MASK,exp2=MASK,regs=N (the JSD's entries of
              triton_rows.SOFTCAP_RCP_FMA, SOFTCAP_EXP2_FMA; MAX_REGS); masks in decimal or 0b…, bit
              2·(pass − 1) + side (0: s, 1: t)
Compare (same run): each variant's `full` and `no-grad` ratios against `none`'s (the cost of the
softcap: the target is at most +0.02× the floor) and `old`'s; its errors against `old`'s and torch's.

Usage: python benchmarks/bench_softcap.py [--variants floor torch none old sfu default fma ...]
       [--n 8192] [--softcap 30] [--rep 500] [--out DIR]
       (dry run on a CPU: TRITON_INTERPRET=1 ... --device cpu --n 16 --h 32 --v 300 --rep 1)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import triton
import triton.language as tl

from flashkd.backends import triton_rows

VARIANTS = ("floor", "torch", "none", "old", "sfu", "default", "fma", "rcp=0b001110", "rcp=0b101110,exp2=0b001000")
NAMED = {"sfu": "rcp=0,exp2=0", "default": "", "fma": "rcp=0b111111,exp2=0"}

# ------------------------------------------------------------------------------- the tanh it replaced

_OLD_CAP: tl.constexpr = tl.constexpr(30.0)  # set from --softcap before anything compiles


@triton.jit
def _old_tanh(y):
    t = tl.exp2(tl.abs(y) * (-2.0 * triton_rows._LOG2E))
    r = triton_rows._rcp(1.0 + t)
    th = (1.0 - t) * r
    return tl.where(y < 0.0, -th, th), 4.0 * t * r * r


@triton.jit
def _old_head(x, mul, HEAD: tl.constexpr, RCP_FMA: tl.constexpr = True, EXP2_FMA: tl.constexpr = False):
    if HEAD == 0:
        return x, 1.0
    elif HEAD == 1:
        return tl.where(x == -float("inf"), x, x * mul), 1.0
    else:
        th, d = _old_tanh(x * mul)
        return tl.where(x == -float("inf"), x, _OLD_CAP * th), d


def _old_head_mode(scale: float, softcap: float | None):
    scale = float(scale)
    if softcap is not None:
        return 2, 1.0, scale / softcap  # z made whole at load (fold 1), mul = σ / c
    if scale < 0.0:
        return 1, 1.0, scale
    return 0, scale, 1.0


def _apply(variant: str, softcap: float):
    """Swap the variant in; returns the softcap the workload runs with (None: no transform)."""
    if variant == "none" or variant == "floor":
        return None
    if variant == "torch":
        return softcap
    if variant == "old":
        global _OLD_CAP
        _OLD_CAP = tl.constexpr(softcap)
        triton_rows._head = _old_head
        triton_rows.head_mode = _old_head_mode
        return softcap
    for item in filter(None, NAMED.get(variant, variant).split(",")):
        key, _, value = item.partition("=")
        if key not in ("rcp", "exp2", "regs") or not value:
            raise SystemExit(f"variant: expected a name ({', '.join(VARIANTS[:7])}) or rcp=, exp2=, regs=, "
                             f"got {variant!r}")
        if key == "regs":
            triton_rows.MAX_REGS = int(value, 0)
        else:  # the JSD's entry of the mask tables
            getattr(triton_rows, {"rcp": "SOFTCAP_RCP_FMA", "exp2": "SOFTCAP_EXP2_FMA"}[key])["jsd"] = int(value, 0)
    return softcap


# ---------------------------------------------------------------------------------------- one variant


def _quantiles(times):
    q = torch.tensor(times).quantile(torch.tensor([0.5, 0.2, 0.8])).tolist()
    return [round(v, 3) for v in q]


def one(variant: str, args) -> dict:

    from flashkd.bench import measure
    from flashkd.bench.providers import PROVIDERS
    from flashkd.bench.workloads import Workload, make_inputs

    cap = _apply(variant, args.softcap)
    device = torch.device(args.device)
    out = {"variant": variant, "rcp": triton_rows.SOFTCAP_RCP_FMA.get("jsd", 0),
           "exp2": triton_rows.SOFTCAP_EXP2_FMA.get("jsd", 0), "regs": triton_rows.MAX_REGS}
    settings = measure.Settings(device, rep_ms=args.rep, warmup_ms=100.0, min_reps=10)
    w = Workload("jsd", args.n, h=args.h, v=args.v, dtype="bfloat16",
                 softcap=args.softcap if variant in ("floor", "torch") else cap)
    x = make_inputs(w, device)
    if variant == "floor":
        fn = PROVIDERS["floor"].make(w, x)
        for mode in ("full", "no-grad-forward"):
            measure._time(fn, x, mode, settings)  # warm-up
            out[mode] = _quantiles(measure._time(fn, x, mode, settings))
        return out
    if variant != "torch":
        out.update(_rows(w, args))
    ref = measure.reference(w, x)
    fn = PROVIDERS["torch" if variant == "torch" else "flashkd"].make(w, x)
    check = measure.gate(fn, x, ref, no_grad_too=variant != "torch")
    out["errors"] = {"loss": check.loss_err, "dx": check.dx_err, "dw": check.dw_err, "status": check.status}
    del ref
    torch.cuda.empty_cache()
    if variant == "torch":
        return out
    for mode in ("full", "no-grad-forward"):
        measure._time(fn, x, mode, settings)  # warm-up (compiles)
        out[mode] = _quantiles(measure._time(fn, x, mode, settings))
    return out


def _rows(w, args) -> dict:
    """The row kernel alone at (N, V), with grad and without: p50 (p20–p80) ms."""
    from flashkd.losses import LossSpec

    torch.manual_seed(0)
    s0 = torch.randn(w.n, w.v, device=args.device, dtype=torch.bfloat16) * 3
    t = torch.randn(w.n, w.v, device=args.device, dtype=torch.bfloat16) * 3
    s = s0.clone()
    y = torch.randint(0, w.v, (w.n,), device=args.device)
    scale = torch.tensor(1.0 / w.n, device=args.device)
    spec = LossSpec(loss="jsd", beta=w.beta, weight_hard=w.weight_hard, weight_soft=w.weight_soft, want_hard=True,
                    student_softcap=w.softcap, teacher_softcap=w.softcap)
    out = {}
    for grad in (True, False):
        def step():
            triton_rows.rows(s, t, y, spec, scale, grad)
        step()
        if args.device == "cuda":
            times = triton.testing.do_bench(step, warmup=100, rep=200, return_mode="all")
        else:  # a dry run of the script (the interpreter's times mean nothing)
            start = time.perf_counter()
            step()
            times = [1e3 * (time.perf_counter() - start)]
        out["rows_grad" if grad else "rows_nograd"] = _quantiles(times)
        s.copy_(s0)
    return out


# ------------------------------------------------------------------------------------------ the driver


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--softcap", type=float, default=30.0)
    ap.add_argument("--h", type=int, default=4096, help="teacher hidden size (the student's: half)")
    ap.add_argument("--v", type=int, default=128256)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run under TRITON_INTERPRET=1, tiny --n/--h/--v")
    ap.add_argument("--rep", type=float, default=500.0, help="timed ms per mode (do_bench's rep)")
    ap.add_argument("--out", default=None, help="a directory for results.json")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child process: one variant
    args = ap.parse_args()
    if args.one is not None:
        print("RESULT " + json.dumps(one(args.one, args)), flush=True)
        return 0
    results, status = [], 0
    for variant in args.variants:
        start = time.time()
        cmd = [sys.executable, os.path.abspath(__file__), "--one", variant, "--n", str(args.n), "--softcap",
               str(args.softcap), "--rep", str(args.rep), "--h", str(args.h), "--v", str(args.v), "--device",
               args.device]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            status = 1
            print(f"{variant}: failed (rc {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
            continue
        r = json.loads(lines[-1][len("RESULT "):])
        r["wall_s"] = round(time.time() - start, 1)
        results.append(r)
        print(json.dumps(r), flush=True)
    _table(results)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
    return status


def _table(results):
    """One line a variant: p50 (p20–p80) ms; the ratios to the floor, with the change against `none`."""
    floor = next((r for r in results if r["variant"] == "floor"), None)
    base = next((r for r in results if r["variant"] == "none"), None)

    def ms(r, key):
        return f"{r[key][0]:.3f} ({r[key][1]:.2f}–{r[key][2]:.2f})" if key in r else "—"

    def ratio(r, mode):
        if mode not in r or floor is None or r is floor:
            return "—"
        x = r[mode][0] / floor[mode][0]
        if base is None or r is base or mode not in base:
            return f"{x:.3f}×"
        return f"{x:.3f}× ({x - base[mode][0] / floor[mode][0]:+.3f})"

    print(f"\n{'variant':<28} | {'rows grad ms':<22} | {'rows no-grad ms':<22} | {'full ms':<22} | "
          f"{'full / floor':<16} | {'no-grad ms':<22} | {'no-grad / floor':<16} | errors loss / dX / dW")
    for r in results:
        e = r.get("errors")
        err = f"{e['loss']:.2e} / {e['dx']:.2e} / {e['dw']:.2e} {e['status']}" if e else "—"
        print(f"{r['variant']:<28} | {ms(r, 'rows_grad'):<22} | {ms(r, 'rows_nograd'):<22} | {ms(r, 'full'):<22} | "
              f"{ratio(r, 'full'):<16} | {ms(r, 'no-grad-forward'):<22} | {ratio(r, 'no-grad-forward'):<16} | {err}")


if __name__ == "__main__":
    sys.exit(main())
