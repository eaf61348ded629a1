"""The CuTe DSL logits GEMM (`flashkd.backends.cute_gemm`) on this GPU: its fp32 logits and per-(row, vocab
tile) statistics against float64, at irregular shapes and the chunk shapes, and its time against cuBLAS
(`torch.mm`, bf16 and fp32 output) in the same process, CUDA events, median of --reps with p20-p80.
GPU only; needs nvidia-cutlass-dsl.

    python probes/probe_cute_gemm.py [--reps 30] [--out FILE.json]
    python probes/probe_cute_gemm.py --compile-only   # one small call: import and compile seconds (run it twice
                                                      # with one FLASHKD_CACHE_DIR: the second loads the kernel)
"""

import argparse
import json
import math
import sys
import time

import torch

from probe_cute_rows import finish, median_ms  # beside this file: run as a script from probes/

LOG2E = 1.4426950408889634


def check(cg, r, v, h, dtype, sums, gen, tile_n, stages, scale=1.0):
    x = (torch.randn(r, h, device="cuda", generator=gen) * scale).to(dtype)
    w = (torch.randn(v, h, device="cuda", generator=gen) / math.sqrt(h) * 4).to(dtype)
    planes = torch.full((sums + 1, r, cg.n_tiles(v, tile_n)), float("nan"), device="cuda")
    k1, k2 = LOG2E / 0.7, LOG2E
    z = cg.logits(x, w, planes, k1, k2 if sums == 2 else None, tile_n=tile_n, stages=stages)
    torch.cuda.synchronize()
    sub = slice(0, min(r, 64))  # float64 GEMM on a few rows: the chunk shape's whole would take minutes
    want = x[sub].double() @ w.double().t()
    out = {"shape": [r, v, h], "dtype": str(dtype), "sums": sums, "tile_n": tile_n, "stages": stages}
    out["z_max_rel"] = ((z[sub].double() - want).abs().max() / want.abs().max()).item()
    m, (l1, l2) = cg.tile_stats(z.double(), (k1, k2), tile_n)  # of the logits the kernel wrote
    out["m_err"] = (planes[0].double() - m).abs().max().item()
    out["l1_rel"] = ((planes[1].double() - l1).abs() / l1).max().item()
    if sums == 2:
        out["l2_rel"] = ((planes[2].double() - l2).abs() / l2).max().item()
    out["ok"] = (out["z_max_rel"] < 1e-5 and out["m_err"] == 0.0 and out["l1_rel"] < 1e-5
                 and out.get("l2_rel", 0.0) < 1e-5 and not planes.isnan().any().item())
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default=None)
    p.add_argument("--compile-only", action="store_true")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_cute_gemm: needs a CUDA GPU")
    sys.path.insert(0, "src")
    t0 = time.perf_counter()
    try:
        from flashkd.backends import cute_gemm as cg
        import cutlass.cute  # noqa: F401
    except ImportError as e:
        sys.exit(f"probe_cute_gemm: needs nvidia-cutlass-dsl ({e})")
    result = {"import_s": time.perf_counter() - t0, "checks": [], "timing": []}
    gen = torch.Generator(device="cuda").manual_seed(0)
    if a.compile_only:
        t0 = time.perf_counter()
        c = check(cg, 300, 3000, 600, torch.bfloat16, 2, gen, 256, 4)
        print(json.dumps({"import_s": result["import_s"], "first_call_s": time.perf_counter() - t0,
                          "compile_s": list(cg.compile_seconds.values()),
                          "loaded_from_disk_s": list(cg.load_seconds.values()), "ok": c["ok"]}))
        sys.exit(0 if c["ok"] else "probe_cute_gemm: the check failed")
    ok = True
    # K of 1 to 40 tiles of TILE_K; up to 501 × 16 output tiles (several a CTA)
    for r, v, h, dtype, sums, tn, st in (
            (77, 1000, 72, torch.bfloat16, 2, 256, 4), (128, 256, 64, torch.bfloat16, 1, 256, 4),
            (300, 3001, 600, torch.float16, 2, 256, 4), (1, 257, 8, torch.bfloat16, 1, 256, 4),
            (257, 5000, 2560, torch.bfloat16, 1, 256, 4), (300, 3001, 600, torch.bfloat16, 2, 128, 6),
            (1000, 30001, 600, torch.bfloat16, 2, 256, 4), (2048, 128256, 2048, torch.bfloat16, 2, 256, 4)):
        try:
            c = check(cg, r, v, h, dtype, sums, gen, tn, st)
        except Exception as e:  # a compile or launch error: reported, the rest still run
            c = {"shape": [r, v, h], "error": f"{type(e).__name__}: {e}"[:2000], "ok": False}
        print(json.dumps(c), flush=True)
        result["checks"].append(c)
        ok &= c["ok"]
    result["compile_s"] = {str(k): s for k, s in cg.compile_seconds.items()}
    for r, h in ((2048, 2048), (2048, 4096)):
        v = 128256
        x = torch.randn(r, h, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(v, h, device="cuda", dtype=torch.bfloat16) / math.sqrt(h)
        p256 = torch.empty(3, r, cg.n_tiles(v), device="cuda")
        p128 = torch.empty(3, r, cg.n_tiles(v, 128), device="cuda")
        z = torch.empty(r, v, device="cuda")
        row = {"shape": [r, v, h]}
        fns = {
            "cute_stats2": lambda: cg.logits(x, w, p256, 1.0, 1.0, out=z),
            "cute_stats1": lambda: cg.logits(x, w, p256[:2], 1.0, out=z),
            "cute_stats2_direct": lambda: cg.logits(x, w, p256, 1.0, 1.0, out=z, store="direct"),
            "cute_stats2_s3e4": lambda: cg.logits(x, w, p256, 1.0, 1.0, out=z, stages=3, epi_stages=4),
            "cute_bare": lambda: cg.logits(x, w, None, out=z),
            "cute_bare_direct": lambda: cg.logits(x, w, None, out=z, store="direct"),
            "cute_no_store": lambda: cg.logits(x, w, None, out=z, store="none"),
            # 128-column tiles (6 stages): the main loop's cost of narrower tiles (more operand traffic)
            "cute_stats1_n128": lambda: cg.logits(x, w, p128[:2], 1.0, out=z, tile_n=128, stages=6),
            "cute_no_store_n128": lambda: cg.logits(x, w, None, out=z, store="none", tile_n=128, stages=6),
            "cublas_bf16": lambda: torch.mm(x, w.t()),
            "cublas_fp32": lambda: torch.mm(x, w.t(), out_dtype=torch.float32),
        }
        try:
            for name, fn in fns.items():
                fn()
            torch.cuda.synchronize()
            for rnd in range(2):  # providers in turn, twice
                for name, fn in fns.items():
                    ms, p20, p80 = median_ms(fn, a.reps)
                    row.setdefault(name, []).append([round(ms, 4), round(p20, 4), round(p80, 4)])
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            ok = False
        print(json.dumps(row), flush=True)
        result["timing"].append(row)
        del x, w, p256, p128, z
    finish(result, a.out, None if ok else "probe_cute_gemm: a check failed")


if __name__ == "__main__":
    main()
