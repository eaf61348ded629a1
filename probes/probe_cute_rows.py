"""Can the row pass run inside the logits GEMM's CTAs? (issue "the row work under the GEMMs")

The CuTe DSL logits GEMM (`flashkd.backends.cute_gemm_sm90.Gemm`) holds every SM with one CTA of three
warpgroups: warpgroup 0 loads (only its warp 0 issues TMA copies; warps 1-3 idle), warpgroups 1 and 2
multiply. Here warps 1-3 of warpgroup 0 run a JSD row pass (β ½, τ 1, no CE) over another block's fp32 logits
while the GEMM runs: per row, pass 1 reads s and t and sums KL(p‖M) and KL(q‖M) (log2 units), pass 2 reads
them again and writes dJ/ds = ½ q ln2 (log2(q/M) − KL(q‖M)) in bf16: the row kernel's 18 bytes an element.
The row statistics (max and log2 of the sum-exp of each side) are given, as the GEMM epilogue's planes give
them. Warpgroup 0 gets `side_regs` registers a thread (the GEMM's 40 are too few for a row loop), the
multiplying warpgroups 252 less half of that (setmaxnreg moves registers within the CTA's 3 × 168 a thread).

What it measures (one chunk of the JSD seed: R 1024, V 128256, the student's K 2048 and the teacher's 4096),
CUDA events, lines in turn, median and p20-p80 of --reps:
  gemm          the product kernel (40 / 232 registers)
  gemm+regs     this kernel, no rows: the register split's own cost
  rows          this kernel's rows alone (no GEMM tiles: every CTA only rows)
  gemm+rows     both at once: hidden = (gemm + rows − both) / rows
  triton rows   flashkd's row kernel on the same block (JSD, the statistics found by its own pass), for scale
The rows' output is checked against float64 first (loss and dJ/ds).

--loop: the whole JSD seed call (N 8192, R 1024, 8 chunks, forward + backward, no CE) scheduled so that each
chunk's rows run inside the next chunk's student logits GEMM (`--inside t`: its teacher GEMM; the last chunk's
alone): S(c+1)+rows(c), T(c+1),
dX(c) (cuBLAS), dW(c) (CuTe reduce-add), the row statistics merged from the GEMMs' planes by torch, dJ/ds in a
buffer of its own (one more R·V·2 bytes, not in s's bytes) — against `flashkd.fused_linear_distill(...,
backend="cute")` on the same inputs and the floor (cuBLAS: both logits GEMMs, dX, dW), in turn. A projection of
the design: the rows are the probe's (JSD without CE), the losses checked against flashkd's.

    python probes/probe_cute_rows.py [--reps 20] [--side-regs 56] [--unroll 2]
    python probes/probe_cute_rows.py --compile-only      # sm_90a, no GPU needed (CUTE_DSL_ARCH=sm_90a)
"""

import argparse
import math
import os
import statistics
import sys

LN2 = math.log(2.0)
LOG2E = 1.0 / LN2
THREADS = 96  # warps 1-3 of warpgroup 0
ROWS_BAR = 5  # named barrier: the GEMM's epilogue takes 1-2, its ping-pong 3-4


def build(side: str, side_regs: int, unroll: int, sms: int, feed: str = "regs", depth: int = 8):
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils.hopper_helpers as sm90
    from cutlass.memory import SmemAllocator
    from cutlass.tensor_utils import LayoutEnum

    from flashkd.backends import cute_gemm
    from flashkd.backends.cute_gemm_sm90 import EPI_N, TILE_K, TILE_M, Gemm

    f32 = cutlass.Float32
    cfg = dict(cute_gemm.LOGITS)
    if feed == "async":  # the rows' ring (depth · 96 threads · 32 bytes) takes one operand stage's shared memory
        cfg["stages"] -= 1
    # setmaxnreg moves registers within the CTA's own: 384 threads at the launch's 168 each (65536 / 384, to
    # a multiple of 8); the multiplying warpgroups may take what warpgroup 0 gives up, no more (an increase past
    # the pool waits for registers that never come back while the other warpgroups run: a hang)
    mma_regs = (3 * 168 - side_regs) // 2 // 8 * 8

    class RowsBeside(Gemm):
        def terms(self, s, t, ms, ls, mt, lt):
            """One column's log2 q, log2 p, q, p and log2 M (M = (p + q) / 2), from the rows' statistics (traced
            inline)."""
            lq = (s - ms) * LOG2E - ls
            lp = (t - mt) * LOG2E - lt
            q = cute.math.exp2(lq, fastmath=True)
            p = cute.math.exp2(lp, fastmath=True)
            return lq, lp, q, p, cute.math.log2(0.5 * q + 0.5 * p, fastmath=True)

        @cute.jit
        def row_sums(self, a1: cutlass.Float32, a2: cutlass.Float32, w: cutlass.Int32, lane: cutlass.Int32,
                     parity: cutlass.Int32, sRed: cute.Tensor):
            """The 96 threads' two sums of a row: over each warp by shuffles, then the three warps' through
            sRed's half `parity` (a row's reads of one half finish before the row after next writes it: each
            row passes the barrier)."""
            for off in cutlass.range_constexpr(5):
                a1 = a1 + cute.arch.shuffle_sync_bfly(a1, offset=16 >> off)
                a2 = a2 + cute.arch.shuffle_sync_bfly(a2, offset=16 >> off)
            if lane == 0:
                sRed[parity * 8 + 2 * w] = a1
                sRed[parity * 8 + 2 * w + 1] = a2
            cute.arch.barrier(barrier_id=ROWS_BAR, number_of_threads=THREADS)
            return (sRed[parity * 8] + sRed[parity * 8 + 2] + sRed[parity * 8 + 4],
                    sRed[parity * 8 + 1] + sRed[parity * 8 + 3] + sRed[parity * 8 + 5])

        @cute.jit
        def rows(self, tidx: cutlass.Int32, first: cutlass.Int32, step: cutlass.Int32, mS: cute.Tensor,
                 mT: cute.Tensor, mStat: cute.Tensor, mG: cute.Tensor, mLoss: cute.Tensor, sRed: cute.Tensor):
            """Warps 1-3: rows first, first + step, ... of the (R, V/4, 4) blocks, 4 columns a thread a step."""
            i = tidx - 32
            w = cute.arch.make_warp_uniform(i // 32)
            lane = cute.arch.lane_idx()
            n_rows = mS.shape[0]
            groups = mS.shape[1]
            rs = cute.make_rmem_tensor((4,), f32)
            rt = cute.make_rmem_tensor((4,), f32)
            rg = cute.make_rmem_tensor((4,), f32)
            parity = 0
            for row in cutlass.range(first, n_rows, step, unroll=1):
                ms, ls, mt, lt = mStat[row, 0], mStat[row, 1], mStat[row, 2], mStat[row, 3]
                a1 = f32(0.0)
                a2 = f32(0.0)
                for g in cutlass.range(i, groups, THREADS, unroll=unroll):
                    cute.autovec_copy(mS[row, g, None], rs)
                    cute.autovec_copy(mT[row, g, None], rt)
                    for c in cutlass.range_constexpr(4):
                        lq, lp, q, p, lm = self.terms(rs[c], rt[c], ms, ls, mt, lt)
                        a1 = a1 + p * (lp - lm)
                        a2 = a2 + q * (lq - lm)
                k1, k2 = self.row_sums(a1, a2, w, lane, parity, sRed)
                parity = 1 - parity
                if i == 0:
                    mLoss[row] = 0.5 * LN2 * (k1 + k2)
                for g in cutlass.range(i, groups, THREADS, unroll=unroll):
                    cute.autovec_copy(mS[row, g, None], rs)
                    cute.autovec_copy(mT[row, g, None], rt)
                    for c in cutlass.range_constexpr(4):
                        lq, lp, q, p, lm = self.terms(rs[c], rt[c], ms, ls, mt, lt)
                        rg[c] = (0.5 * LN2) * q * ((lq - lm) - k2)
                    out = cute.make_rmem_tensor((4,), cutlass.BFloat16)
                    out.store(rg.load().to(cutlass.BFloat16))
                    cute.autovec_copy(out, mG[row, g, None])

        @cute.jit
        def rows_async(self, tidx: cutlass.Int32, first: cutlass.Int32, step: cutlass.Int32, mS: cute.Tensor,
                       mT: cute.Tensor, mStat: cute.Tensor, mG: cute.Tensor, mLoss: cute.Tensor,
                       sRed: cute.Tensor, sRing: cute.Tensor):
            """`rows` with each thread's next `depth` steps of s and t in flight by cp.async into its own slots
            of a shared-memory ring (no registers held by loads in flight; a thread reads only what it copied, so
            no barrier but its own wait)."""
            i = tidx - 32
            w = cute.arch.make_warp_uniform(i // 32)
            lane = cute.arch.lane_idx()
            n_rows = mS.shape[0]
            groups = mS.shape[1]
            atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cute.nvgpu.cpasync.LoadCacheMode.GLOBAL), f32,
                                        num_bits_per_copy=128)  # .cg: through L2 only
            rs = cute.make_rmem_tensor((4,), f32)
            rt = cute.make_rmem_tensor((4,), f32)
            rg = cute.make_rmem_tensor((4,), f32)
            steps = (groups - i + THREADS - 1) // THREADS
            parity = 0
            for row in cutlass.range(first, n_rows, step, unroll=1):
                ms, ls, mt, lt = mStat[row, 0], mStat[row, 1], mStat[row, 2], mStat[row, 3]
                k2 = f32(0.0)
                for phase in cutlass.range_constexpr(2):
                    a1 = f32(0.0)
                    a2 = f32(0.0)
                    for d in cutlass.range_constexpr(depth):
                        g = cutlass.min(i + THREADS * d, groups - 1)
                        cute.copy(atom, mS[row, g, None], sRing[(None, i, 0, d)])
                        cute.copy(atom, mT[row, g, None], sRing[(None, i, 1, d)])
                        cute.arch.cp_async_commit_group()
                    for it in cutlass.range(steps, unroll=1):
                        slot = it % depth
                        cute.arch.cp_async_wait_group(depth - 1)
                        rs.store(sRing[(None, i, 0, slot)].load())
                        rt.store(sRing[(None, i, 1, slot)].load())
                        for c in cutlass.range_constexpr(4):
                            lq, lp, q, p, lm = self.terms(rs[c], rt[c], ms, ls, mt, lt)
                            if cutlass.const_expr(phase == 0):
                                a1 = a1 + p * (lp - lm)
                                a2 = a2 + q * (lq - lm)
                            else:
                                rg[c] = (0.5 * LN2) * q * ((lq - lm) - k2)
                        if cutlass.const_expr(phase == 1):
                            out = cute.make_rmem_tensor((4,), cutlass.BFloat16)
                            out.store(rg.load().to(cutlass.BFloat16))
                            cute.autovec_copy(out, mG[row, i + THREADS * it, None])
                        g = cutlass.min(i + THREADS * (it + depth), groups - 1)  # this slot's next step
                        cute.copy(atom, mS[row, g, None], sRing[(None, i, 0, slot)])
                        cute.copy(atom, mT[row, g, None], sRing[(None, i, 1, slot)])
                        cute.arch.cp_async_commit_group()
                    cute.arch.cp_async_wait_group(0)  # the ring's last copies landed before the next pass's
                    if cutlass.const_expr(phase == 0):
                        k1, k2 = self.row_sums(a1, a2, w, lane, parity, sRed)
                        parity = 1 - parity
                        if i == 0:
                            mLoss[row] = 0.5 * LN2 * (k1 + k2)

        @cute.kernel
        def kernel_side(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
                        tma_c: cute.CopyAtom, mCt: cute.Tensor, mC: cute.Tensor, mM: cute.Tensor, mL1: cute.Tensor,
                        mL2: cute.Tensor, k1: cutlass.Float32, k2: cutlass.Float32, tiled_mma: cute.TiledMma,
                        a_layout: cute.ComposedLayout, b_layout: cute.ComposedLayout,
                        c_layout: cute.ComposedLayout, storage_type: cutlass.Constexpr,
                        tx_bytes: cutlass.Constexpr, mS: cute.Tensor, mT: cute.Tensor, mStat: cute.Tensor,
                        mG: cute.Tensor, mLoss: cute.Tensor):
            """`Gemm.kernel_ws` with warps 1-3 running `rows` (side "both" / "rows"), or idle ("none")."""
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            tidx, _, _ = cute.arch.thread_idx()
            first, _, _ = cute.arch.block_idx()
            step, _, _ = cute.arch.grid_dim()
            if warp == 0:
                cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_c)
            smem = SmemAllocator()
            storage = smem.allocate(storage_type)
            pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.bars.data_ptr(), num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4),
                tx_count=tx_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
            sA = storage.sA.get_tensor(a_layout.outer, swizzle=a_layout.inner)
            sB = storage.sB.get_tensor(b_layout.outer, swizzle=b_layout.inner)
            sRed = storage.red.get_tensor(cute.make_layout(16))
            # (4 columns, thread, s or t, step): a thread's 16 bytes of s beside its neighbours' (no bank conflict)
            sRing = storage.ring.get_tensor(cute.make_layout((4, THREADS, 2, depth),
                                                             stride=(1, 4, 4 * THREADS, 8 * THREADS)))
            tiler = (TILE_M, self.tile_n, TILE_K)
            every = (None, None, None, 0)
            gA = cute.local_tile(mA, tiler, every, proj=(1, None, 1))
            gB = cute.local_tile(mB, tiler, every, proj=(None, 1, 1))
            gC = cute.local_tile(mC, tiler, every, proj=(1, 1, None))
            cC = cute.local_tile(cute.make_identity_tensor(mC.shape), tiler, every, proj=(1, 1, None))
            gCt = cute.local_tile(mCt, tiler, every, proj=(1, 1, None))
            m_tiles = cute.size(gC, mode=[2])
            n_tiles = cute.size(gC, mode=[3])
            tiles = m_tiles * n_tiles
            k_tiles = cute.size(gA, mode=[3])
            if warp < 4:
                cute.arch.setmaxregister_decrease(side_regs)
                if warp == 0:
                    if cutlass.const_expr(side != "rows"):
                        self.load(tma_a, tma_b, sA, sB, gA, gB, pipe, first, step, tiles, m_tiles, n_tiles,
                                  k_tiles)
                else:
                    if cutlass.const_expr(side != "none" and feed == "async"):
                        self.rows_async(tidx, first, step, mS, mT, mStat, mG, mLoss, sRed, sRing)
                    if cutlass.const_expr(side != "none" and feed == "regs"):
                        self.rows(tidx, first, step, mS, mT, mStat, mG, mLoss, sRed)
            else:
                cute.arch.setmaxregister_increase(mma_regs)
                if cutlass.const_expr(side != "rows"):
                    sC = storage.sC.get_tensor(c_layout.outer, swizzle=c_layout.inner)
                    self.multiply(tidx, warp, first, step, tiles, m_tiles, n_tiles, k_tiles, pipe, tiled_mma, sA,
                                  sB, sC, gC, cC, gCt, mC, mM, mL1, mL2, k1, k2, tma_c)

        @cute.jit
        def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, m: cute.Tensor, l1: cute.Tensor,
                     l2: cute.Tensor, k1: cutlass.Float32, k2: cutlass.Float32, s: cute.Tensor, t: cute.Tensor,
                     stat: cute.Tensor, g: cute.Tensor, loss: cute.Tensor, stream):
            tile_n, stages, epi_stages = self.tile_n, self.stages, self.epi_stages
            ab = a.element_type
            tiled_mma = sm90.make_trivial_tiled_mma(
                ab, ab, LayoutEnum.from_tensor(a).sm90_mma_major_mode(),
                LayoutEnum.from_tensor(b).sm90_mma_major_mode(), f32, (1, 1, 1), tiler_mn=(64, tile_n))
            tile = (TILE_M, tile_n, TILE_K)
            a_layout = sm90.make_smem_layout_a(LayoutEnum.from_tensor(a), tile, ab, stages)
            b_layout = sm90.make_smem_layout_b(LayoutEnum.from_tensor(b), tile, ab, stages)
            op = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
            tma_a, tA = cute.nvgpu.cpasync.make_tiled_tma_atom(op, a, cute.slice_(a_layout, (None, None, 0)),
                                                               (TILE_M, TILE_K))
            tma_b, tB = cute.nvgpu.cpasync.make_tiled_tma_atom(op, b, cute.slice_(b_layout, (None, None, 0)),
                                                               (tile_n, TILE_K))
            tx_bytes = (TILE_M + tile_n) * TILE_K * ab.width // 8
            epi = (TILE_M, EPI_N)
            c_layout = sm90.make_smem_layout_epi(f32, LayoutEnum.from_tensor(c), epi, epi_stages * 2)
            tma_c, tC = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), c, cute.slice_(c_layout, (None, None, 0)), epi)

            @cute.struct
            class Storage:
                bars: cute.struct.MemRange[cutlass.Int64, stages * 2]
                red: cute.struct.MemRange[f32, 16]
                ring: cute.struct.Align[cute.struct.MemRange[f32, 8 * THREADS * depth if feed == "async" else 4], 128]
                sA: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(a_layout)], 1024]
                sB: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(b_layout)], 1024]
                sC: cute.struct.Align[cute.struct.MemRange[f32, cute.cosize(c_layout)], 1024]

            tiles = cute.ceil_div(c.shape[0], TILE_M) * cute.ceil_div(c.shape[1], tile_n)
            self.kernel_side(tma_a, tA, tma_b, tB, tma_c, tC, c, m, l1, l2, k1, k2, tiled_mma, a_layout,
                             b_layout, c_layout, Storage, tx_bytes, s, t, stat, g, loss).launch(
                grid=(cutlass.min(tiles, self.sms), 1, 1), block=(384, 1, 1), stream=stream)

    return RowsBeside(1, cfg["tile_n"], cfg["stages"], sms, "tma", cfg["epi_stages"], "m")


def fake_args(r, v, h, r2):
    """CuTe fake tensors of the chunk's shapes: the GEMM's as `cute_gemm._launch` hands them (dynamic), the rows'
    block static (R2, V/4, 4), 16-byte aligned."""
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass.cute.runtime import make_fake_tensor
    from cutlass.cute.typing import sym_int

    m, n, t = sym_int(), sym_int(), sym_int()
    k = sym_int(divisibility=8)
    a = make_fake_tensor(cutlass.BFloat16, (m, k, 1), (sym_int(divisibility=8), 1, 1), assumed_align=16)
    b = make_fake_tensor(cutlass.BFloat16, (n, k, 1), (sym_int(divisibility=8), 1, 1), assumed_align=16)
    c = make_fake_tensor(cutlass.Float32, (m, n, 1), (sym_int(divisibility=4), 1, 1), assumed_align=16)
    p = make_fake_tensor(cutlass.Float32, (m, t), (sym_int(), 1), assumed_align=4)
    blk = (r2, v // 4, 4)
    s = make_fake_tensor(cutlass.Float32, blk, (v, 4, 1), assumed_align=16)
    stat = make_fake_tensor(cutlass.Float32, (r2, 4), (4, 1), assumed_align=16)
    g = make_fake_tensor(cutlass.BFloat16, blk, (v, 4, 1), assumed_align=16)
    loss = make_fake_tensor(cutlass.Float32, (r2,), (1,), assumed_align=16)
    return (a, b, c, p, p, p, 1.0, 1.0, s, s, stat, g, loss, cuda.CUstream(0))


def compile_only(a):
    import cutlass.cute as cute

    for side in a.sides:
        kernel = build(side, a.side_regs, a.unroll, 132, a.feed, a.depth)
        cute.compile(kernel, *fake_args(a.rows, a.vocab, 2048, a.rows))
        print("compiled", side, "side_regs", a.side_regs, "unroll", a.unroll, "feed", a.feed, "depth", a.depth)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--side-regs", type=int, default=56)
    p.add_argument("--unroll", type=int, default=2)
    p.add_argument("--feed", choices=["regs", "async"], default="regs",
                   help="the rows' loads: into registers (unrolled), or cp.async into a shared-memory ring")
    p.add_argument("--depth", type=int, default=8, help="--feed async: steps in flight a thread")
    p.add_argument("--sides", nargs="+", default=["none", "rows", "both"])
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--loop", action="store_true")
    p.add_argument("--inside", choices=["s", "t"], default="s",
                   help="--loop: the GEMM each chunk's rows run in, the next chunk's student (s) or teacher (t) GEMM")
    a = p.parse_args()
    if a.compile_only:
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
        return compile_only(a)
    run(a)
    if a.loop:
        loop(a)


def run(a):
    import torch

    if not torch.cuda.is_available():
        sys.exit("probe_cute_rows: needs a CUDA GPU")
    try:
        import cutlass.cute as cute
        from cutlass.cute.runtime import from_dlpack
    except ImportError as e:
        sys.exit(f"probe_cute_rows: needs nvidia-cutlass-dsl ({e})")

    from flashkd.backends import cute_gemm
    from flashkd.bench.measure import event_times

    torch.manual_seed(0)
    r, v = a.rows, a.vocab
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    dev = "cuda"
    # the rows' block: a trained head's magnitudes (std 4)
    s2 = torch.randn(r, v, device=dev) * 4
    t2 = torch.randn(r, v, device=dev) * 4
    lse = lambda z: (z.amax(1), torch.log2(torch.exp2((z - z.amax(1, keepdim=True)) * LOG2E).sum(1)))
    (ms, ls), (mt, lt) = lse(s2), lse(t2)
    stat = torch.stack([ms, ls, mt, lt], 1).contiguous()
    g2 = torch.empty(r, v, device=dev, dtype=torch.bfloat16)
    loss2 = torch.empty(r, device=dev)
    blk = lambda z: from_dlpack(z.view(r, v // 4, 4), assumed_align=16)
    side_args = [blk(s2), blk(t2), from_dlpack(stat, assumed_align=16), blk(g2), from_dlpack(loss2, assumed_align=16)]

    lines = {}
    for hk in (2048, 4096):  # the student's GEMM and the teacher's
        x = torch.randn(r, hk, device=dev).to(torch.bfloat16)
        w = (torch.randn(v, hk, device=dev) / math.sqrt(hk) * 4).to(torch.bfloat16)
        z = torch.empty(r, v, device=dev)
        planes = torch.empty(2, r, cute_gemm.n_tiles(v), device=dev)
        gemm_args = [cute_gemm._as_cute(x[:, :, None]), cute_gemm._as_cute(w[:, :, None]),
                     cute_gemm._as_cute(z[:, :, None]), cute_gemm._as_cute(planes[0], 4),
                     cute_gemm._as_cute(planes[1], 4), cute_gemm._as_cute(planes[1], 4), LOG2E, LOG2E,
                     cute_gemm._stream(x.device)]
        lines[f"gemm K{hk}"] = lambda x=x, w=w, z=z, planes=planes: cute_gemm.logits(x, w, planes, LOG2E, None, z)
        for side in a.sides:
            kernel = build(side, a.side_regs, a.unroll, sms, a.feed, a.depth)
            args = gemm_args[:8] + side_args + gemm_args[8:]
            fn = cute.compile(kernel, *args)
            if side == "rows" and hk == 4096:
                continue
            name = "rows" if side == "rows" else f"gemm+{'regs' if side == 'none' else 'rows'} K{hk}"
            lines[name] = lambda fn=fn, args=args: fn(*args)
    # the rows' output against float64
    lines["rows"]()
    torch.cuda.synchronize()
    lq = torch.log_softmax(s2.double(), 1)
    lp = torch.log_softmax(t2.double(), 1)
    lm = torch.logaddexp(lq, lp) - math.log(2.0)
    kq = (lq.exp() * (lq - lm)).sum(1)
    want_loss = 0.5 * ((lp.exp() * (lp - lm)).sum(1) + kq)
    want_g = 0.5 * lq.exp() * ((lq - lm) - kq[:, None])
    err_loss = ((loss2.double() - want_loss).abs() / want_loss.abs()).max().item()
    err_g = ((g2.double() - want_g).abs().max() / want_g.abs().max()).item()
    print(f"rows vs float64: loss max rel {err_loss:.2e}, dJ/ds max err / max {err_g:.2e}")
    if not (err_loss < 1e-4 and err_g < 1e-2):
        sys.exit("WRONG: the rows' output is off")
    from flashkd.backends import triton_rows
    from flashkd.losses import LossSpec

    spec = LossSpec(loss="jsd", beta=0.5, temperature=1.0, weight_hard=0.0, weight_soft=1.0)
    labels = torch.full((r,), -100, device=dev)
    one = torch.tensor(1.0, device=dev)
    s3 = s2.clone()
    lines["triton rows"] = lambda: triton_rows.rows(s3, t2, labels, spec, one, True)
    times = {k: [] for k in lines}
    for _ in range(3):  # warm-up
        for fn in lines.values():
            fn()
    for _ in range(a.reps):  # the lines in turn, round by round
        for k, fn in lines.items():
            times[k] += event_times(fn, 1)
    med = {}
    for k, ts in times.items():
        q = statistics.quantiles(ts, n=5)
        med[k] = statistics.median(ts)
        print(f"{k:22s} {med[k]:8.3f} ms  ({q[0]:.3f}-{q[-1]:.3f})")
    for hk in (2048, 4096):
        if f"gemm+rows K{hk}" in med and "rows" in med:
            base = med[f"gemm+regs K{hk}"]
            hidden = (base + med["rows"] - med[f"gemm+rows K{hk}"]) / med["rows"]
            print(f"K{hk}: regs cost {base - med[f'gemm K{hk}']:+.3f} ms; rows hidden {hidden:.2f} of {med['rows']:.3f} ms")


def loop(a):
    import torch
    import cutlass.cute as cute
    from cutlass.cute.runtime import from_dlpack

    import flashkd
    from flashkd.backends import cute_gemm
    from flashkd.bench.measure import event_times

    torch.manual_seed(1)
    n, r, v, hs, ht = 8192, a.rows, a.vocab, 2048, 4096
    dev = "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    xs = torch.randn(n, hs, device=dev).to(torch.bfloat16)
    xt = torch.randn(n, ht, device=dev).to(torch.bfloat16)
    ws = (torch.randn(v, hs, device=dev) / math.sqrt(hs) * 4).to(torch.bfloat16)
    wt = (torch.randn(v, ht, device=dev) / math.sqrt(ht) * 4).to(torch.bfloat16)
    chunks = n // r
    s_buf = [torch.empty(r, v, device=dev) for _ in range(2)]  # S(c) and S(c+1)
    t_buf = [torch.empty(r, v, device=dev) for _ in range(2)]  # T(c) read by rows(c) while T(c+1) is written
    planes = [torch.empty(2, r, cute_gemm.n_tiles(v), device=dev) for _ in range(4)]  # S, T planes, two chunks
    g = torch.empty(r, v, device=dev, dtype=torch.bfloat16)
    loss_rows = torch.empty(chunks, r, device=dev)
    stat = torch.empty(r, 4, device=dev)
    dx = torch.empty(n, hs, device=dev, dtype=torch.bfloat16)
    dw = torch.empty(v, hs, device=dev)
    dw_floor = torch.empty(v, hs, device=dev, dtype=torch.bfloat16)
    blk = lambda z: from_dlpack(z.view(r, v // 4, 4), assumed_align=16)
    compiled = {}

    def merge(ps, pt):  # the row statistics from the planes: (max, log2 Σ 2^((z − max)·log2 e)) each side
        out = []
        for pl in (ps, pt):
            m = pl[0].amax(1)
            out += [m, torch.log2((pl[1] * torch.exp2((pl[0] - m[:, None]) * LOG2E)).sum(1))]
        torch.stack(out, 1, out=stat)

    def gemm_rows(side, x, w, z, pl, c_rows):
        x, w = x.detach(), w.detach()  # DLPack exports no tensor that requires grad (the product's timing sets it)
        args = [cute_gemm._as_cute(x[:, :, None]), cute_gemm._as_cute(w[:, :, None]), cute_gemm._as_cute(z[:, :, None]),
                cute_gemm._as_cute(pl[0], 4), cute_gemm._as_cute(pl[1], 4), cute_gemm._as_cute(pl[1], 4), LOG2E, LOG2E,
                blk(s_buf[c_rows % 2]), blk(t_buf[c_rows % 2]), from_dlpack(stat, assumed_align=16), blk(g),
                from_dlpack(loss_rows[c_rows], assumed_align=16), cute_gemm._stream(x.device)]
        if side not in compiled:
            compiled[side] = cute.compile(build(side, a.side_regs, a.unroll, sms, a.feed, a.depth), *args)
        compiled[side](*args)

    def pipelined():
        for c in range(chunks + 1):
            if c < chunks:
                rows_c = slice(c * r, (c + 1) * r)
                if c == 0 or a.inside == "t":
                    cute_gemm.logits(xs[rows_c].detach(), ws.detach(), planes[c % 2 * 2], LOG2E, None, s_buf[c % 2])
                if c > 0:  # S(c) or T(c) with rows(c − 1)
                    merge(planes[(c - 1) % 2 * 2], planes[(c - 1) % 2 * 2 + 1])
                    if a.inside == "s":
                        gemm_rows("both", xs[rows_c], ws, s_buf[c % 2], planes[c % 2 * 2], c - 1)
                    else:
                        gemm_rows("both", xt[rows_c], wt, t_buf[c % 2], planes[c % 2 * 2 + 1], c - 1)
                if c == 0 or a.inside == "s":
                    cute_gemm.logits(xt[rows_c], wt, planes[c % 2 * 2 + 1], LOG2E, None, t_buf[c % 2])
            else:  # the last chunk's rows alone
                merge(planes[(c - 1) % 2 * 2], planes[(c - 1) % 2 * 2 + 1])
                gemm_rows("rows", xs[:r], ws, s_buf[c % 2], planes[c % 2 * 2], c - 1)
            if c > 0:
                prev = slice((c - 1) * r, c * r)
                torch.mm(g, ws.detach(), out=dx[prev])
                cute_gemm.accumulate(dw, g.t(), xs[prev].detach().t(), add=c > 1)
        return loss_rows.sum()

    def product():
        return flashkd.fused_linear_distill(xs, ws, xt, wt, weight_hard_loss=0.0, weight_soft_loss=1.0,
                                            loss="jsd", beta=0.5, reduction="sum", chunk_size=r, backend="cute")

    xs.requires_grad_(True)
    ws.requires_grad_(True)

    def product_step():
        xs.grad = ws.grad = None
        product().backward()

    def floor():
        sl = xs.detach() @ ws.detach().t()
        tl = xt @ wt.t()
        gs = sl.to(torch.bfloat16)
        torch.mm(gs, ws.detach(), out=dx)
        torch.mm(gs.t(), xs.detach(), out=dw_floor)
        del tl

    with torch.no_grad():
        got = pipelined()
        want = product()
    torch.cuda.synchronize()
    rel = abs(got.item() - want.item()) / abs(want.item())
    print(f"loop: loss {got.item():.6f} against flashkd's {want.item():.6f} (rel {rel:.1e})")
    if rel > 1e-4:
        sys.exit("WRONG: the pipelined loop's loss is off")
    lines = {"flashkd cute": product_step, "pipelined": lambda: pipelined() and None, "floor": floor}
    times = {k: [] for k in lines}
    for fn in lines.values():
        fn()
    for _ in range(max(3, a.reps // 4)):
        for k, fn in lines.items():
            times[k] += event_times(fn, 1)
    for k, ts in times.items():
        print(f"{k:14s} {statistics.median(ts):8.2f} ms  ({min(ts):.2f}-{max(ts):.2f})")


if __name__ == "__main__":
    main()
