"""The gradient pass inside the dX GEMM: what it costs, measured at the chunk loop's shapes.

Today each 2048-row chunk of the JSD seed runs (BENCHMARKS.md, "Where the time goes"):

    S, T GEMMs -> row kernel: pass 1 (statistics), pass 2 (loss, K), pass 3 (dS over S) -> dX = dS·W, dW += dSᵀ·X

Two designs move the gradient's math into the dX GEMM, dX[M, H] = dS[M, V] · W[V, H], whose A operand
is then formed in registers between its load and the tensor-core MMA (wgmma takes A from registers):

    full        phase 2 as first proposed: the A tile is dS itself, formed from the S and T tiles and the
                row constants (JSD + CE at τ = 1: q, p, the mixture's log2(1 + 2^−|z|), the label's −1);
                no pass 3, no dS write. Each dS tile is formed once per dX column tile: H / BN times.
    correction  pass 2 writes the K-free part of dS, A = q·(f1·log2(q/M) + f0') − [label] (JSD's K is
                not known until pass 2 ends); the GEMM forms dS = A − r·q, r = the row's K factor and
                q = 2^(s·k − c) from S: one exp2 and two loads an element, again H / BN times; with
                `side`, its first column tile also writes dS for the dW GEMM. Passes 2 and 3 become one.

Lines (M = 2048 rows, V = 128256, H = 2048, bf16, the student head of the seed; median ms of CUDA-event
timed calls, the lines interleaved round by round):

    cublas            torch.mm(dS, W): the floor's dX
    triton plain      this file's kernel with A loaded as is: the Triton GEMM's own cost
    triton correction / correction+side / full
    rows jsd          flashkd's row kernel, JSD + CE with grad (3 passes), on the same 2048 × V block
    rows forward_kl   the same for forward KL (2 passes: statistics, then loss and dS): what a JSD with
                      passes 2 and 3 merged would cost at best

A design pays if (its GEMM − cublas) < what it removes from the row kernel (rows jsd − rows forward_kl
for `correction`; pass 3, at most rows jsd − rows forward_kl + its write, for `full`).

Usage: python benchmarks/bench_fused_grad.py [--rows 2048] [--vocab 128256] [--hidden 2048]
       [--tiles 128x256x64x8 ...] [--rep 30] [--out DIR]
Dry run on a CPU: TRITON_INTERPRET=1 python benchmarks/bench_fused_grad.py --device cpu --rows 32 --vocab 96
       --hidden 64 --tiles 16x32x16x4 --rep 1 (what tests/test_bench_fused_grad.py checks, with the math)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import torch
import triton
import triton.language as tl

from flashkd.backends import triton_rows
from flashkd.losses import LossSpec

_LOG2E = 1.4426950408889634
MODES = {"plain": 0, "correction": 1, "full": 2}
# Triton 3.6's interpreter multiplies bf16 dot operands as their raw bits: on the CPU the operands
# (already rounded to bf16) are widened to fp32 first, which gives the same products.
_DOT_F32: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _dx_kernel(
    a_ptr, s_ptr, t_ptr, w_ptr, out_ptr, side_ptr,  # (M, V) A or dS; (M, V) S; (M, V) T; (V, H) W; (M, H); (M, V)
    ks_ptr, cs_ptr, kt_ptr, ct_ptr,  # (M,) fp32: log2 q = s·ks − cs, log2 p = t·kt − ct
    r_ptr, f0_ptr, lab_ptr,  # (M,) fp32 K factor (correction), f0 with K in it (full); (M,) int64 labels
    M, V, H,
    f1, c_ce, log2_beta, log2_1mbeta,
    MODE: tl.constexpr,  # 0 plain, 1 correction, 2 full
    SIDE: tl.constexpr,  # write the A it formed (dS) to side_ptr, each column tile 1 / (H / BN) of the steps
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
    WS: tl.constexpr,  # Triton's automatic warp specialization of the loop (its Hopper pass)
):
    # column tiles of a row block are adjacent program ids: they run together and share the A-side
    # tiles in L2 (at the probe's shape all 128 programs are one wave anyway)
    pid = tl.program_id(0)
    n_cols = tl.cdiv(H, BN)
    pid_n = pid % n_cols
    off_m = (pid // n_cols) * BM
    off_n = pid_n * BN
    rows = off_m + tl.arange(0, BM)
    a_desc = tl.make_tensor_descriptor(a_ptr, [M, V], [V, 1], [BM, BK])
    w_desc = tl.make_tensor_descriptor(w_ptr, [V, H], [H, 1], [BK, BN])
    s_desc = tl.make_tensor_descriptor(s_ptr, [M, V], [V, 1], [BM, BK])
    t_desc = tl.make_tensor_descriptor(t_ptr, [M, V], [V, 1], [BM, BK])
    side_desc = tl.make_tensor_descriptor(side_ptr, [M, V], [V, 1], [BM, BK])
    rmask = rows < M
    ks = tl.load(ks_ptr + rows, mask=rmask, other=0.0)[:, None]
    cs = tl.load(cs_ptr + rows, mask=rmask, other=0.0)[:, None]
    kt = tl.load(kt_ptr + rows, mask=rmask, other=0.0)[:, None]
    ct = tl.load(ct_ptr + rows, mask=rmask, other=0.0)[:, None]
    r = tl.load(r_ptr + rows, mask=rmask, other=0.0)[:, None]
    f0 = tl.load(f0_ptr + rows, mask=rmask, other=0.0)[:, None]
    lab = tl.load(lab_ptr + rows, mask=rmask, other=-1)[:, None]
    acc = tl.zeros([BM, BN], tl.float32)
    for k in tl.range(0, V, BK, num_stages=STAGES, warp_specialize=WS):
        if MODE == 0:
            a = a_desc.load([off_m, k])
        elif MODE == 1:
            s = s_desc.load([off_m, k]).to(tl.float32)
            a = (a_desc.load([off_m, k]).to(tl.float32) + r * tl.exp2(s * ks - cs)).to(a_ptr.dtype.element_ty)
        else:
            lq = s_desc.load([off_m, k]).to(tl.float32) * ks - cs
            lp = t_desc.load([off_m, k]).to(tl.float32) * kt - ct
            z, w = triton_rows._mixture(lq, lp, log2_beta, log2_1mbeta)
            g = tl.exp2(lq) * (f1 * (w + tl.maximum(z, 0.0)) + f0)
            cols = k + tl.arange(0, BK)[None, :]
            a = (g - tl.where(cols == lab, c_ce, 0.0)).to(a_ptr.dtype.element_ty)
        if SIDE:  # spread over the column tiles: one wave, so one tile storing every step would be its tail
            if (k // BK) % n_cols == pid_n:
                side_desc.store([off_m, k], a)
        b = w_desc.load([k, off_n])
        if _DOT_F32:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        else:
            acc = tl.dot(a, b, acc)
    out_desc = tl.make_tensor_descriptor(out_ptr, [M, H], [H, 1], [BM, BN])
    out_desc.store([off_m, off_n], acc.to(out_ptr.dtype.element_ty))


def _alloc(size, alignment, stream):  # scratch for the kernel's own TMA descriptors
    return torch.empty(size, dtype=torch.int8, device="cuda")


class Problem:
    """One chunk's operands and its JSD + CE (τ = 1, β, w_hard = w_soft = 0.5, mean over rows) row constants."""

    def __init__(self, m, v, h, device, beta=0.5, seed=0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        bf = torch.bfloat16
        self.s = (torch.randn(m, v, generator=g) * 3).to(device, bf)
        self.t = (torch.randn(m, v, generator=g) * 3).to(device, bf)
        self.w = (torch.randn(v, h, generator=g) / math.sqrt(h)).to(device, bf)
        self.labels = torch.randint(0, v, (m,), generator=g).to(device)
        self.beta = beta
        s, t = self.s.double(), self.t.double()
        lse_s, lse_t = torch.logsumexp(s, -1), torch.logsumexp(t, -1)
        # log2 q = s·log2e − lse_s·log2e: one FMA an element, as in the row kernel
        self.ks = torch.full((m,), _LOG2E, dtype=torch.float64, device=device)
        self.cs = lse_s * _LOG2E
        self.kt = self.ks.clone()
        self.ct = lse_t * _LOG2E
        q, p = torch.softmax(s, -1), torch.softmax(t, -1)
        mix = beta * p + (1 - beta) * q
        k_jsd = (q * (torch.log(q) - torch.log(mix))).sum(-1)
        c_soft, c_ce = 0.5 / m, 0.5 / m  # w · (1 / rows) of "mean"
        # the row kernel's pass-3 factors (triton_rows._one_row): dS = q (f1 (w + max(z, 0)) + f0) − c_ce [label]
        self.f1 = -c_soft * (1 - beta) * math.log(2)
        self.c_ce = c_ce
        self.f0 = c_ce + self.f1 * math.log2(1 - beta) - c_soft * (1 - beta) * k_jsd
        self.r = -c_soft * (1 - beta) * k_jsd  # dS = A + r·q, A the part without K
        onehot = torch.nn.functional.one_hot(self.labels, v).double()
        self.ds = c_soft * (1 - beta) * q * (torch.log(q) - torch.log(mix) - k_jsd[:, None]) + c_ce * (q - onehot)
        self.a_kfree = (self.ds - self.r[:, None] * q).to(bf)  # what a merged pass 2 would write
        self.ds_bf = self.ds.to(bf)
        self.dx_ref = self.ds @ self.w.double()  # float64 truth of dX
        del q, p, mix, onehot
        for name in ("ks", "cs", "kt", "ct", "f0", "r"):
            setattr(self, name, getattr(self, name).float())
        self.scale = torch.tensor(1.0 / m, device=device)


STAGES_USED = {}  # (mode, side, tiles, ws) -> the pipeline depth that fit in shared memory
SPLIT = {}  # (mode, side, tiles, ws) -> whether the compiled loop has warp-specialised partitions


def dx_triton(pb: Problem, mode: str, side: bool = False, tiles=(128, 256, 64, 8), stages=3, ws=False):
    bm, bn, bk, warps = tiles
    m, v = pb.s.shape
    h = pb.w.shape[1]
    out = torch.empty(m, h, device=pb.s.device, dtype=pb.s.dtype)
    side_out = torch.empty_like(pb.s) if side else pb.s
    a = pb.ds_bf if mode == "plain" else pb.a_kfree
    grid = (triton.cdiv(m, bm) * triton.cdiv(h, bn),)
    key = (mode, side, tiles, ws)
    stages = STAGES_USED.get(key, stages)
    while True:
        try:
            compiled = _dx_kernel[grid](a, pb.s, pb.t, pb.w, out, side_out, pb.ks, pb.cs, pb.kt, pb.ct, pb.r, pb.f0, pb.labels,
                             m, v, h, pb.f1, pb.c_ce, math.log2(pb.beta), math.log2(1 - pb.beta),
                             MODE=MODES[mode], SIDE=side, BM=bm, BN=bn, BK=bk, STAGES=stages, WS=ws,
                             num_warps=warps)
            break
        except triton.runtime.errors.OutOfResources:  # the operands of three loads at 3 stages may not fit
            if stages == 1:
                raise
            stages -= 1
    STAGES_USED[key] = stages
    if key not in SPLIT and hasattr(compiled, "asm") and "ttgir" in compiled.asm:
        # did the compiler split the loop into warp-specialised partitions?
        SPLIT[key] = "ttg.warp_specialize" in compiled.asm["ttgir"]
    return out, (side_out if side else None)


def _name(mode, side, tiles, ws):
    return f"{mode}{'+side' if side else ''} {'x'.join(map(str, tiles))}{' ws' if ws else ''}"


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
    ap.add_argument("--tiles", nargs="+", default=["128x256x64x8", "128x128x64x8", "64x256x64x4"],
                    help="BMxBNxBKxWARPS")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--ws", type=int, nargs="+", default=[0], choices=[0, 1],
                    help="warp specialization off (0) and / or on (1)")
    ap.add_argument("--rep", type=int, default=30, help="rounds; each round times every line once")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = args.device
    if dev == "cuda":
        triton.set_allocator(_alloc)
    pb = Problem(args.rows, args.vocab, args.hidden, dev)
    tiles = [tuple(map(int, t.split("x"))) for t in args.tiles]
    variants = [(mode, side, tl_, ws) for ws in args.ws for tl_ in tiles
                for mode, side in (("plain", False), ("correction", False), ("correction", True), ("full", False))]

    # correctness first: every variant's dX (and side output) against the float64 truth, beside the
    # error of torch.mm on the rounded dS (the plain bf16 pipeline); a variant that does not compile
    # (warp specialization is young on Hopper) is reported and left out
    ref = pb.dx_ref
    def err(x):
        return ((x.double() - ref).abs().max() / ref.abs().max()).item()
    checks = {"cublas": err(pb.ds_bf @ pb.w)}
    failed = {}
    lines = {"cublas": lambda: torch.mm(pb.ds_bf, pb.w)}
    for mode, side, tl_, ws in variants:
        key = _name(mode, side, tl_, ws)
        try:
            out, so = dx_triton(pb, mode, side, tl_, args.stages, ws)
        except Exception as e:  # noqa: BLE001 -- a compiler failure is a result here
            failed[key] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            print(f"failed         {key:<40} {failed[key]}")
            continue
        checks[key] = err(out)
        if so is not None:
            checks[key + " side dS"] = ((so.double() - pb.ds).abs().max() / pb.ds.abs().max()).item()
        lines["triton " + key] = lambda v=(mode, side, tl_, args.stages, ws): dx_triton(pb, *v)
    for k, e in checks.items():  # a variant 4× past torch.mm's error is computing something else
        print(f"max rel error  {k:<40} {e:.3e}{'  WRONG' if not e <= 4 * checks['cublas'] else ''}")

    s_work = pb.s.clone()
    for loss in ("jsd", "forward_kl"):
        spec = LossSpec(loss=loss, beta=pb.beta, weight_hard=0.5, want_hard=True)
        # the kernel writes dS over its s: time it on a copy refreshed outside the timed region
        lines[f"rows {loss}"] = (lambda spec=spec: triton_rows.rows(s_work, pb.t, pb.labels, spec, pb.scale, True))
    if dev != "cuda":
        for f in lines.values():
            f()
        print("dry run: every line ran once")
        return
    for f in lines.values():  # compile and warm up
        f(), f()
    times = {k: [] for k in lines}
    for _ in range(args.rep):
        for k, f in lines.items():
            if k.startswith("rows"):
                s_work.copy_(pb.s)
            times[k].append(_ms(f))
    base = statistics.median(times["cublas"])
    print(f"{'line':<44}{'ms':>9}{'p20':>9}{'p80':>9}{'- cublas':>10}")
    result = {"rows": args.rows, "vocab": args.vocab, "hidden": args.hidden, "stages": args.stages,
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "commit": os.environ.get("FLASHKD_COMMIT", "unknown"), "errors": checks, "ms": {},
              "stages_used": {_name(m, sd, t, w): n for (m, sd, t, w), n in STAGES_USED.items()},
              "failed": failed,
              "warp_specialized": {_name(*k): v for k, v in SPLIT.items()}}
    for k, ts in times.items():
        ts = sorted(ts)
        med, p20, p80 = statistics.median(ts), ts[len(ts) // 5], ts[(4 * len(ts)) // 5]
        result["ms"][k] = {"p50": med, "p20": p20, "p80": p80}
        print(f"{k:<44}{med:>9.3f}{p20:>9.3f}{p80:>9.3f}{med - base:>+10.3f}")
    print("pipeline stages used:", result["stages_used"])
    print("loop split into warp-specialised partitions:", result["warp_specialized"])
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fused_grad.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"done in {time.time() - t0:.0f} s")
