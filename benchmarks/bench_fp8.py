"""The FP8 teacher head (flashkd.fp8) on one GPU: the teacher GEMM's time and the accuracy of its logits.

    python benchmarks/bench_fp8.py [--out DIR] [--rows 1024] [--skip-timing] [--head-only]

1. Time (triton.testing.do_bench, median and p20–p80, ms) of the teacher logits X·Wᵀ at M = 2048, 4096,
   8192, K = 4096, V = 128256: bf16 (cuBLAS) against torch._scaled_mm with e4m3 operands, rowwise and
   1x128 scales (flashkd.fp8), and 1x128 (X) × 128x128 (W) blocks; each with its X quantisation
   (flashkd's fused kernel) and without; the fused kernel against the same quantisation in torch ops.
2. The head's quantisation, made anew on every call (flashkd.fp8's doc): fp8.head(W) at V = 128256,
   K = 4096 bf16 (a read of V·K·2 bytes, a write of V·K), against the teacher GEMM it speeds up, at
   M = 2048, 4096, 8192: bf16 GEMM, FP8 GEMM with X's quantisation, and the two added up with the head's.
   `--head-only` runs this part alone.
3. Accuracy on `--rows` rows against the fp32 GEMM of the same bf16 inputs (TF32 off): KL(p_true ‖ p),
   Σ|p_true − p| (L1) per row, mean over rows, and the JSD loss's relative error against a student
   distribution, for bf16 logits and each FP8 scaling, on three inputs:
     bench     the bench's inputs: X = rand (uniform [0, 1)), W as nn.Linear initialises it
     peaky     X ~ N(0, 1), W ~ N(0, σ²) with σ set so the teacher's entropy is 1.5 nats (a trained
               model's is 1–2 nats on text)
     outliers  peaky, and 4 of the K channels 50× larger in X (the massive activations of real LLM
               hidden states)
Prints a table and writes fp8.json under --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from flashkd import fp8  # noqa: E402


def _bench(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=50, rep=400, quantiles=[0.5, 0.2, 0.8])


def _block128x128(w):
    """(q (V, K) e4m3, scale_b) for 128x128 blocks of w (V, K), in the layout _scaled_mm reads."""
    v, k = w.shape
    vb, kb = -(-v // 128), -(-k // 128)
    pad = torch.zeros(vb * 128, kb * 128, device=w.device, dtype=torch.float32)
    pad[:v, :k] = w
    g = pad.reshape(vb, 128, kb, 128)
    amax = g.abs().amax((1, 3), keepdim=True).clamp_min(2.0**-100)
    q = (g * (448.0 / amax)).to(torch.float8_e4m3fn).reshape(vb * 128, kb * 128)[:v, :k].contiguous()
    s = (amax / 448.0).reshape(vb, kb)  # (V/128, K/128) contiguous; scale_b is its transpose
    return q, s.t()


def _gemm_variants(w):
    """name -> fn(x) giving the teacher logits, and name -> fn(xq...) for the GEMM alone."""
    out = {"bf16": (lambda x: x @ w.t(), None)}
    for scaling in ("rowwise", "1x128"):
        h = fp8.head(w, scaling)

        def full(x, h=h):
            return fp8.linear(x, h, None)

        def prep(x, h=h):
            xq, sx = fp8.quantize(x, h.scaling)
            if h.scaling == "1x128":
                sx = sx.t().contiguous().t()
            return lambda: torch._scaled_mm(xq, h.q.t(), sx, h.scale, out_dtype=x.dtype)

        out[f"fp8-{scaling}"] = (full, prep)
    try:
        q, sb = _block128x128(w)

        def full_b(x):
            xq, sx = fp8.quantize(x, "1x128")
            return torch._scaled_mm(xq, q.t(), sx.t().contiguous().t(), sb, out_dtype=x.dtype)

        out["fp8-1x128-w128x128"] = (full_b, None)
    except Exception as e:  # noqa: BLE001
        print("128x128 weights:", type(e).__name__, e)
    return out


def layouts(results):
    """fp8.linear against the fp32 product of its own dequantised operands: the scales' layouts."""
    torch.manual_seed(2)
    for v, k in ((128256, 4096), (1000, 200)):  # the second: a vocab and a hidden size needing padding
        w = torch.randn(v, k, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(300, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(v, device="cuda", dtype=torch.bfloat16)
        for scaling in ("rowwise", "1x128"):
            h = fp8.head(w, scaling)
            xq, sx = fp8.quantize(x, scaling)
            ref = fp8.dequantize(xq, sx) @ fp8.dequantize(h.q, h.scale.t()).t()[:, :v] + b.float()
            got = fp8.linear(x, h, b).float()
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            results["layouts"][f"{v}x{k} {scaling}"] = err
            print(f"layout {v}x{k} {scaling}: max rel err vs dequantised product {err:.2e} (bf16 rounding ~4e-3)")


def timing(results):
    v, k = 128256, 4096
    torch.manual_seed(0)
    w = (torch.rand(v, k, device="cuda") * 2 - 1).mul_(1 / math.sqrt(k)).to(torch.bfloat16)
    variants = _gemm_variants(w)
    for m in (2048, 4096, 8192):
        x = torch.rand(m, k, device="cuda", dtype=torch.bfloat16)
        row = {}
        for name, (full, prep) in variants.items():
            try:
                full(x)
                row[name] = _bench(lambda: full(x))
                if prep is not None:
                    row[name + " (GEMM only)"] = _bench(prep(x))
            except Exception as e:  # noqa: BLE001
                row[name] = f"{type(e).__name__}: {str(e)[:200]}"
        for scaling in ("rowwise", "1x128"):
            row[f"quantize {scaling} (fused)"] = _bench(lambda: fp8.quantize(x, scaling))
            row[f"quantize {scaling} (torch ops)"] = _bench(lambda: fp8.quantize_reference(x, scaling))
            q1, s1 = fp8.quantize(x, scaling)
            q2, s2 = fp8.quantize_reference(x, scaling)
            row[f"quantize {scaling} bit-exact"] = bool(torch.equal(q1.view(torch.uint8), q2.view(torch.uint8))
                                                        and torch.equal(s1, s2))
        results["timing"][str(m)] = row
        base = row["bf16"][0]
        print(f"M={m}: " + ", ".join(
            f"{n} {r[0]:.3f} ms ({r[0] / base:.2f}x)" if isinstance(r, list) else f"{n} {r}" for n, r in row.items()))


def head_cost(results):
    """The per-call quantisation of the head against the GEMM time it saves."""
    v, k = 128256, 4096
    torch.manual_seed(0)
    w = (torch.rand(v, k, device="cuda") * 2 - 1).mul_(1 / math.sqrt(k)).to(torch.bfloat16)
    for scaling in ("rowwise", "1x128"):
        quant = _bench(lambda: fp8.head(w, scaling))
        gbs = (v * k * 3) / (quant[0] * 1e-3) / 1e9  # bf16 read + e4m3 write
        row = {"head quantise ms": quant, "head quantise GB/s": gbs}
        h = fp8.head(w, scaling)
        for m in (2048, 4096, 8192):
            x = torch.rand(m, k, device="cuda", dtype=torch.bfloat16)
            bf16 = _bench(lambda: x @ w.t())[0]
            gemm = _bench(lambda: fp8.linear(x, h, None))[0]
            call = _bench(lambda: fp8.linear(x, fp8.head(w, scaling), None))[0]
            row[str(m)] = {"bf16 ms": bf16, "fp8 (X quantised) ms": gemm, "fp8 + head quantise ms": call,
                           "saved ms": bf16 - call, "head share of the saving": quant[0] / (bf16 - gemm)}
            print(f"{scaling} M={m}: head quantise {quant[0]:.3f} ms ({gbs:.0f} GB/s); bf16 {bf16:.3f}, "
                  f"fp8 {gemm:.3f}, fp8 + head {call:.3f} ms ({call / bf16:.2f}x bf16)")
        results["head"][scaling] = row


def _case(name, rows, k, v, gen):
    if name == "bench":
        x = torch.rand(rows, k, device="cuda", generator=gen)
        w = (torch.rand(v, k, device="cuda", generator=gen) * 2 - 1) / math.sqrt(k)
        return x.bfloat16(), w.bfloat16()
    x = torch.randn(rows, k, device="cuda", generator=gen)
    if name == "outliers":
        x[:, :4] *= 50
    w0 = torch.randn(v, k, device="cuda", generator=gen) / math.sqrt(k)
    z0 = x[:256] @ w0.t()

    def entropy(a):
        lp = torch.log_softmax(a * z0, -1)
        return -(lp.exp() * lp).sum(-1).mean().item()

    lo, hi = 0.1, 100.0  # entropy falls as the scale grows: bisect for 1.5 nats
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if entropy(mid) > 1.5 else (lo, mid)
    return x.bfloat16(), (w0 * lo).bfloat16()


def accuracy(results, rows):
    k, v = 4096, 128256
    gen = torch.Generator(device="cuda").manual_seed(1)
    torch.backends.cuda.matmul.allow_tf32 = False
    for case in ("bench", "peaky", "outliers"):
        x, w = _case(case, rows, k, v, gen)
        truth = x.float() @ w.float().t()
        lp_true = torch.log_softmax(truth, -1)
        ent = -(lp_true.exp() * lp_true).sum(-1).mean().item()
        student = torch.log_softmax(truth + torch.randn_like(truth) * truth.std(), -1)

        def jsd(lp):  # β = 0.5 JSD per row between the student and a teacher
            m = torch.logsumexp(torch.stack([lp, student]), 0) - math.log(2)
            return 0.5 * ((lp.exp() * (lp - m)).sum(-1) + (student.exp() * (student - m)).sum(-1))

        j_true = jsd(lp_true).mean()
        row = {"teacher entropy (nats)": ent}
        for name, (full, _) in _gemm_variants(w).items():
            try:
                lp = torch.log_softmax(full(x).float(), -1)
            except Exception as e:  # noqa: BLE001
                row[name] = f"{type(e).__name__}: {str(e)[:200]}"
                continue
            row[name] = {
                "KL(p_true||p)": (lp_true.exp() * (lp_true - lp)).sum(-1).mean().item(),
                "L1": (lp_true.exp() - lp.exp()).abs().sum(-1).mean().item(),
                "JSD rel err": ((jsd(lp).mean() - j_true).abs() / j_true).item(),
            }
            del lp
        # Where the error comes from: each operand quantised alone (the other exact), in fp32 math
        for side in ("X only", "W only"):
            xq = fp8.dequantize(*fp8.quantize(x, "rowwise"))[:, :k] if side == "X only" else x.float()
            wq = fp8.dequantize(*fp8.quantize(w, "rowwise"))[:, :k] if side == "W only" else w.float()
            lp = torch.log_softmax(xq @ wq.t(), -1)
            row[f"fp8-rowwise, {side}"] = {
                "KL(p_true||p)": (lp_true.exp() * (lp_true - lp)).sum(-1).mean().item(),
                "L1": (lp_true.exp() - lp.exp()).abs().sum(-1).mean().item(),
                "JSD rel err": ((jsd(lp).mean() - j_true).abs() / j_true).item(),
            }
            del lp, xq, wq
        results["accuracy"][case] = row
        print(f"{case} (teacher entropy {ent:.2f} nats):")
        for name, r in row.items():
            if isinstance(r, dict):
                print(f"  {name:22s} " + "  ".join(f"{a} {b:.3g}" for a, b in r.items()))
            elif name != "teacher entropy (nats)":
                print(f"  {name:22s} {r}")
        del truth, lp_true, student


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".")
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--head-only", action="store_true", help="only the head's per-call quantisation against the GEMM")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "timing": {}, "accuracy": {}, "layouts": {}, "head": {},
               "commit": os.environ.get("FLASHKD_COMMIT")}
    if a.head_only:
        head_cost(results)
    else:
        layouts(results)
        if not a.skip_timing:
            timing(results)
            head_cost(results)
        accuracy(results, a.rows)
    with open(os.path.join(a.out, "fp8.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
