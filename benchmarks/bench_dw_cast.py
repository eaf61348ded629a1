"""The last chunk's dW GEMM with the fp32 accumulator's cast in its epilogue, against cuBLAS + a cast.

With more than one chunk the chunk loop accumulates dW = Σ_c dS_cᵀ X_c in an fp32 (V, Hs) buffer and
casts it once at the end (`flashkd.distill._chunk_loop`). The profile of the JSD seed (BENCHMARKS.md)
puts the last chunk's `addmm` (beta = 1) at 1.64 ms and the cast at 0.36: the cast reads the 1 GB
the GEMM has just written and writes 0.5 GB. A GEMM whose epilogue adds the accumulator and stores
dW in the weight's dtype writes 0.5 GB instead of 1 GB and needs no cast.

Lines (M = 2048 chunk rows, V = 128256, Hs = 2048, bf16; median ms of CUDA-event timed calls, the
lines interleaved round by round):
    cublas + cast   torch.addmm(acc, dSᵀ, X, out_dtype=fp32, out=acc); acc.to(bf16)  (today's path)
    cublas          the addmm alone
    triton T        this file's kernel at tiles T (BMxBNxBKxWARPSxSTAGES)

Usage: python benchmarks/bench_dw_cast.py [--tiles 128x256x64x8x3 ...] [--rep 40]
Dry run on a CPU: TRITON_INTERPRET=1 python benchmarks/bench_dw_cast.py --device cpu --rows 40 --vocab 200
       --hidden 48 --tiles 16x32x16x4x2 --rep 1
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import triton
import triton.language as tl

# Triton 3.6's interpreter multiplies bf16 dot operands as their raw bits: on the CPU they are widened
# to fp32 first, which gives the same products.
_DOT_F32: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _dw_kernel(
    a_ptr, b_ptr, acc_ptr, out_ptr,  # (M, V) dS; (M, H) X; (V, H) fp32 accumulator; (V, H) output
    M, V, H,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, GROUP: tl.constexpr,
):
    # grouped order: GROUP vocab tiles share their X column tiles in L2
    pid = tl.program_id(0)
    n_v, n_h = tl.cdiv(V, BM), tl.cdiv(H, BN)
    per_group = GROUP * n_h
    first = (pid // per_group) * GROUP
    size = tl.minimum(n_v - first, GROUP)
    off_v = (first + (pid % per_group) % size) * BM
    off_h = ((pid % per_group) // size) * BN
    a_desc = tl.make_tensor_descriptor(a_ptr, [M, V], [V, 1], [BK, BM])
    b_desc = tl.make_tensor_descriptor(b_ptr, [M, H], [H, 1], [BK, BN])
    acc_desc = tl.make_tensor_descriptor(acc_ptr, [V, H], [H, 1], [BM, BN])
    out_desc = tl.make_tensor_descriptor(out_ptr, [V, H], [H, 1], [BM, BN])
    acc = tl.zeros([BM, BN], tl.float32)
    for k in tl.range(0, M, BK, num_stages=STAGES):
        a = a_desc.load([k, off_v]).T  # (BM, BK): dSᵀ
        b = b_desc.load([k, off_h])
        if _DOT_F32:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        else:
            acc = tl.dot(a, b, acc)
    acc += acc_desc.load([off_v, off_h])
    out_desc.store([off_v, off_h], acc.to(out_ptr.dtype.element_ty))


def _alloc(size, alignment, stream):  # scratch for the kernel's own TMA descriptors
    return torch.empty(size, dtype=torch.int8, device="cuda")


def dw_last(ds, x, acc, tiles=(128, 256, 64, 8, 3), group=8):
    """(acc + dsᵀ @ x) in x's dtype: ds (M, V), x (M, H), acc (V, H) fp32."""
    bm, bn, bk, warps, stages = tiles
    m, v = ds.shape
    h = x.shape[1]
    out = torch.empty(v, h, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(v, bm) * triton.cdiv(h, bn),)
    _dw_kernel[grid](ds, x, acc, out, m, v, h, BM=bm, BN=bn, BK=bk, STAGES=stages, GROUP=group, num_warps=warps)
    return out


def _ms(fn):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--tiles", nargs="+", default=["128x256x64x8x3", "128x256x64x8x4", "256x128x64x8x3",
                                                   "128x128x64x4x4", "128x128x64x8x4"])
    ap.add_argument("--rep", type=int, default=40)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    dev = args.device
    if dev == "cuda":
        triton.set_allocator(_alloc)
    g = torch.Generator(device="cpu").manual_seed(0)
    m, v, h = args.rows, args.vocab, args.hidden
    ds = (torch.randn(m, v, generator=g) / m).to(dev, torch.bfloat16)
    x = torch.randn(m, h, generator=g).to(dev, torch.bfloat16)
    acc0 = (torch.randn(v, h, generator=g) * 3 / m).to(dev)
    want = (acc0.double() + ds.double().t() @ x.double())
    def err(out):
        return ((out.double() - want).abs().max() / want.abs().max()).item()

    acc = acc0.clone()
    def today():
        torch.addmm(acc, ds.t(), x, out_dtype=torch.float32, out=acc) if acc.is_cuda else acc.addmm_(ds.t().float(), x.float())
        return acc.to(x.dtype)
    lines = {"cublas + cast": today}
    checks = {"cublas + cast": err(today())}
    if dev == "cuda":
        lines["cublas"] = lambda: torch.addmm(acc, ds.t(), x, out_dtype=torch.float32, out=acc)
    for t in args.tiles:
        tiles = tuple(map(int, t.split("x")))
        try:
            checks[f"triton {t}"] = err(dw_last(ds, x, acc0, tiles))
        except Exception as e:  # noqa: BLE001 -- a tile that does not compile or fit is a result here
            print(f"failed  {t}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
            continue
        lines[f"triton {t}"] = lambda tiles=tiles: dw_last(ds, x, acc0, tiles)
    for k, e in checks.items():  # 4× today's error: computing something else
        print(f"max rel error  {k:<28} {e:.3e}{'  WRONG' if not e <= 4 * checks['cublas + cast'] else ''}")
    if dev != "cuda":
        print("dry run: every line ran once")
        return
    for f in lines.values():
        f(), f()
    times = {k: [] for k in lines}
    for _ in range(args.rep):
        for k, f in lines.items():
            if k.startswith("cublas"):
                acc.copy_(acc0)  # outside the timed call: the addmm accumulates into it
            times[k].append(_ms(f))
    base = statistics.median(times["cublas + cast"])
    print(f"{'line':<30}{'ms':>9}{'p20':>9}{'p80':>9}{'- today':>10}")
    for k, ts in times.items():
        ts = sorted(ts)
        med = statistics.median(ts)
        print(f"{k:<30}{med:>9.3f}{ts[len(ts) // 5]:>9.3f}{ts[(4 * len(ts)) // 5]:>9.3f}{med - base:>+10.3f}")


if __name__ == "__main__":
    main()
