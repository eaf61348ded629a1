"""The CuTe DSL logits GEMM (`flashkd.backends.cute_gemm`) on this GPU: its fp32 logits and per-(row, vocab
tile) statistics against float64, at irregular shapes and the chunk shapes, and its time against cuBLAS
(`torch.mm`, bf16 and fp32 output) in the same process, CUDA events, median of --reps with p20-p80; tile
configurations other than the product's (`cute_gemm.LOGITS`, `ACCUMULATE`) through `variant`. The
cooperative schedule and the main loop without stores (`store="none"`) it once compared are in the history
(BENCHMARKS.md, "Ping-pong"). GPU only; needs nvidia-cutlass-dsl.

    python probes/probe_cute_gemm.py [--reps 30] [--out FILE.json]
    python probes/probe_cute_gemm.py --compile-only   # one small call: import and compile seconds (run it twice
                                                      # with one FLASHKD_CACHE_DIR: the second loads the kernel)
"""

import argparse
import json
import math
import statistics
import sys
import time

import torch


LOG2E = 1.4426950408889634



def median_ms(fn, reps):
    from flashkd.bench.measure import event_times

    times = event_times(fn, reps)
    q = statistics.quantiles(times, n=5)
    return statistics.median(times), q[0], q[-1]


def finish(result, out, failure=None):
    """A probe's end: its result as JSON to `out` (the --out path, if given), then exit 0, or with the
    one-line `failure` (non-zero)."""
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
    sys.exit(failure or 0)


def variant(cg, x, w, planes, k1=1.0, k2=None, out=None, **config):
    """`cg.logits` by the kernel of another tile configuration (`cg.LOGITS`'s keys); planes None: the bare
    GEMM, z alone."""
    out = torch.empty(x.shape[0], w.shape[0], device="cuda") if out is None else out
    store = "tma" if out.stride(0) % 4 == 0 and out.data_ptr() % 16 == 0 else "direct"
    return cg._launch(x, w, out, planes, k1, k2, store, dict(cg.LOGITS, **config))


def check(cg, r, v, h, dtype, sums, gen, tile_n, stages, scale=1.0):
    x = (torch.randn(r, h, device="cuda", generator=gen) * scale).to(dtype)
    w = (torch.randn(v, h, device="cuda", generator=gen) / math.sqrt(h) * 4).to(dtype)
    planes = torch.full((sums + 1, r, cg.n_tiles(v, tile_n)), float("nan"), device="cuda")
    k1, k2 = LOG2E / 0.7, LOG2E
    z = variant(cg, x, w, planes, k1, k2 if sums == 2 else None, tile_n=tile_n, stages=stages)
    torch.cuda.synchronize()
    # float64 GEMM on 128 rows (the chunk shape's whole would take minutes), drawn over every row of a tile
    sub = torch.randperm(r, device="cuda", generator=gen)[:128]
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


def check_accumulate(cg, r, v, h, gen):
    """dW (V, H) = dSᵀ · X, then += a second chunk's, as the chunk loop runs it: dS (R, V) the bf16 half of
    each fp32 row of S (`triton_rows.grad_view`, row stride 2V), X (R, H) contiguous; against float64."""
    ds = [torch.randn(r, 2 * v, device="cuda", generator=gen).to(torch.bfloat16)[:, :v] for _ in range(2)]
    x = [torch.randn(r, h, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2)]
    out = torch.full((v, h), float("nan"), device="cuda")
    res = {"accumulate": [r, v, h], **cg.ACCUMULATE}
    want = torch.zeros(v, h, device="cuda", dtype=torch.float64)
    for i in range(2):
        cg.accumulate(out, ds[i].t(), x[i].t(), add=i > 0)
        want += ds[i].t().double() @ x[i].double()
        torch.cuda.synchronize()
        res[f"rel_{i}"] = ((out.double() - want).abs().max() / want.abs().max()).item()
    res["ok"] = res["rel_0"] < 1e-5 and res["rel_1"] < 1e-5
    return res


def time_in_turn(fns, rounds, reps, row):
    """Each of fns (name -> call) once, then all in turn `rounds` times, median of `reps` with p20-p80 into
    row[name]; an error goes into row["error"]. Returns whether all ran."""
    try:
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        for _ in range(rounds):
            for name, fn in fns.items():
                ms, p20, p80 = median_ms(fn, reps)
                row.setdefault(name, []).append([round(ms, 4), round(p20, 4), round(p80, 4)])
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
        return False
    return True



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
        c = check(cg, 300, 3000, 600, torch.bfloat16, 2, gen, cg.TILE_N, cg.STAGES)
        print(json.dumps({"import_s": result["import_s"], "first_call_s": time.perf_counter() - t0,
                          "compile_s": list(cg.compile_seconds.values()),
                          "loaded_from_disk_s": list(cg.load_seconds.values()), "ok": c["ok"]}))
        sys.exit(0 if c["ok"] else "probe_cute_gemm: the check failed")
    ok = True
    # one tile a CTA, none for some, several (odd and even counts a warpgroup), K of 1 to 64 k tiles of 64
    for r, v, h, dtype, sums, tn, st in (
            (77, 1000, 72, torch.bfloat16, 2, 128, 5), (128, 128, 64, torch.bfloat16, 1, 128, 5),
            (300, 3001, 600, torch.float16, 2, 128, 5), (1, 257, 8, torch.bfloat16, 1, 128, 5),
            (257, 5000, 2560, torch.bfloat16, 1, 128, 5), (1000, 30001, 600, torch.bfloat16, 2, 128, 5),
            (300, 3001, 600, torch.bfloat16, 2, 128, 6), (1000, 30001, 600, torch.bfloat16, 1, 64, 6),
            (1024, 128256, 4096, torch.bfloat16, 1, 128, 5), (2048, 128256, 2048, torch.bfloat16, 2, 128, 5)):
        try:
            c = check(cg, r, v, h, dtype, sums, gen, tn, st)
        except Exception as e:  # a compile or launch error: reported, the rest still run
            c = {"shape": [r, v, h], "error": f"{type(e).__name__}: {e}"[:2000], "ok": False}
        print(json.dumps(c), flush=True)
        result["checks"].append(c)
        ok &= c["ok"]
    # the weight gradient's chunk GEMM: one tile a CTA or fewer, several (odd and even a warpgroup), the chunk's
    for r, v, h in ((77, 1000, 72), (1, 260, 8), (300, 5000, 600), (1000, 30000, 2560), (1024, 128256, 2048)):
        try:
            c = check_accumulate(cg, r, v, h, gen)
        except Exception as e:
            c = {"accumulate": [r, v, h], "error": f"{type(e).__name__}: {e}"[:2000], "ok": False}
        print(json.dumps(c), flush=True)
        result["checks"].append(c)
        ok &= c["ok"]
    result["compile_s"] = {str(k): s for k, s in cg.compile_seconds.items()}
    for r, h in ((1024, 2048), (2048, 2048)):  # dW (V, H) += dSᵀ · X, against cuBLAS's addmm into fp32
        v = 128256
        ds = torch.randn(r, 2 * v, device="cuda").to(torch.bfloat16)[:, :v]
        x = torch.randn(r, h, device="cuda", dtype=torch.bfloat16)
        acc = torch.zeros(v, h, device="cuda")
        row = {"dw_shape": [r, v, h]}
        fns = {
            "pp_add": lambda: cg.accumulate(acc, ds.t(), x.t(), add=True),
            "pp_store": lambda: cg.accumulate(acc, ds.t(), x.t(), add=False),
            "cublas_addmm_fp32": lambda: torch.addmm(acc, ds.t(), x, beta=1.0, out_dtype=torch.float32, out=acc),
            "cublas_bf16": lambda: ds.t() @ x,
        }
        ok &= time_in_turn(fns, 3, a.reps, row)
        print(json.dumps(row), flush=True)
        result["timing"].append(row)
        del ds, x, acc
    for r, h in ((1024, 2048), (1024, 4096), (2048, 2048), (2048, 4096)):
        v = 128256
        x = torch.randn(r, h, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(v, h, device="cuda", dtype=torch.bfloat16) / math.sqrt(h)
        p128 = torch.empty(3, r, cg.n_tiles(v, 128), device="cuda")
        z = torch.empty(r, v, device="cuda")
        row = {"shape": [r, v, h]}
        e2 = dict(tile_n=128, stages=5, epi_stages=2)
        fns = {
            # a warpgroup a 128 × 128 tile, the other's epilogue under its main loop; 5 stages and two pieces
            # in flight, or 6 and one (the product's, `cg.LOGITS`)
            "pp_stats1": lambda: variant(cg, x, w, p128[:2], 1.0, out=z, **e2),
            "pp_stats2": lambda: variant(cg, x, w, p128, 1.0, 1.0, out=z, **e2),
            "pp_bare": lambda: variant(cg, x, w, None, out=z, **e2),
            "pp_stats1_e1": lambda: cg.logits(x, w, p128[:2], 1.0, out=z),
            "cublas_bf16": lambda: torch.mm(x, w.t()),
            "cublas_fp32": lambda: torch.mm(x, w.t(), out_dtype=torch.float32),
        }
        ok &= time_in_turn(fns, 2, a.reps, row)
        print(json.dumps(row), flush=True)
        result["timing"].append(row)
        del x, w, p128, z
    finish(result, a.out, None if ok else "probe_cute_gemm: a check failed")


if __name__ == "__main__":
    main()
