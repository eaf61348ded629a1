"""The device side of `flashkd.backends.cute_gemm`: the persistent, warp-specialised ping-pong GEMM on CuTe DSL
(sm_90), z = a · bᵀ at fp32 with its epilogue's statistics (module doc of cute_gemm). Imported only where
nvidia-cutlass-dsl is installed (`cute_gemm._build`).

One `Gemm` a variant: its parameters are Python values, fixed when the kernel is traced. The pieces, each
traced inline into the one kernel:

    Gemm.__call__    host: the WGMMA tiling, shared-memory layouts, TMA descriptors; launches `kernel`
    Gemm.kernel      the CTA: shared memory, the TMA pipeline, the tiles' views; warpgroup 0 `load`s,
                     warpgroups 1 and 2 `multiply` (each its every other tile) and run `epilogue`
    Gemm.load        warp 0: the operands' tiles by TMA into the pipeline's stages
    Gemm.multiply    a warpgroup's tiles: its main loop (WGMMA over the stages), then `epilogue`
    Gemm.epilogue    z out (TMA or plain stores) and each row's statistics over the tile
"""

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

TILE_M = 128  # one warpgroup's two 64-row WGMMA atoms
TILE_K = 64
EPI_N = 32  # z leaves through shared memory in TILE_M × EPI_N fp32 pieces (16 KiB), by TMA stores

f32 = cutlass.Float32


class Gemm:
    """The kernel for one variant (`cute_gemm._build` checks the parameters and says what each means):
    sums statistics sums (0, 1 or 2), TILE_M × tile_n output tiles, `stages` operand stages, persistent on
    `sms` CTAs, z stored by `store` ("tma", "add" or "direct"), `epi_stages` pieces of z in flight a
    warpgroup, tiles `raster`-index fastest ("m" or "n")."""

    def __init__(self, sums: int, tile_n: int, stages: int, sms: int, store: str, epi_stages: int, raster: str):
        self.sums, self.tile_n, self.stages, self.sms = sums, tile_n, stages, sms
        self.store, self.epi_stages, self.raster = store, epi_stages, raster
        self.by_tma = store in ("tma", "add")
        if (tile_n // EPI_N) % epi_stages:
            raise ValueError(f"epi_stages: expected a divisor of {tile_n // EPI_N} (pieces a tile), got {epi_stages}")

    def tile_mn(self, tile, m_tiles, n_tiles):
        """(bm, bn) of the persistent loop's tile-th output tile, `raster`'s index fastest (traced inline)."""
        if self.raster == "m":
            return tile % m_tiles, tile // m_tiles
        return tile // n_tiles, tile % n_tiles

    @cute.jit
    def epilogue(self, acc: cute.Tensor, tCgC: cute.Tensor, tCcC: cute.Tensor, mC: cute.Tensor, mM: cute.Tensor,
                 mL1: cute.Tensor, mL2: cute.Tensor, bn: cutlass.Int32, k1: cutlass.Float32, k2: cutlass.Float32,
                 sC: cute.Tensor, tma_c: cute.CopyAtom, gCt: cute.Tensor, warp: cutlass.Int32,
                 tiled_mma: cute.TiledMma, ctidx: cutlass.Int32, wg: cutlass.Int32):
        """z out and the statistics of each of the thread's rows of the tile (module doc of cute_gemm), a piece
        of EPI_N columns at a time: wgmma gives a thread value c + 2r + 4j + A·a at row r of its two in the
        a-th of its two 64-row atoms (A values an atom), column 8j + 2·(lane % 4) + c, so piece p is j in
        [p·EPI_N/8, (p+1)·EPI_N/8).
        store "tma" / "add": the warpgroup's threads copy piece p (its values in the order of the copy's
        register tensor rD) into their warpgroup's buffer p % epi_stages by 8-byte stores; its first warp
        stores it by TMA (rows and columns past z's edge clipped) and, after this piece's statistics, waits
        until the store epi_stages − 1 before has read its buffer, the next piece's: the statistics' exp2s run
        while the TMA unit reads. Pieces a tile are a multiple of epi_stages, so buffer p % epi_stages is free
        across tiles too.
        The statistics are merged online over the pieces, then over the row's quad of lanes."""
        sums, epi_stages, by_tma = self.sums, self.epi_stages, self.by_tma
        M, N = mC.shape[0], mC.shape[1]
        lane = cute.arch.lane_idx()
        n_values = cute.size(acc)
        per_atom = cute.size(acc, mode=[0])
        atoms = cute.size(acc, mode=[1])
        slots = [(a, r) for a in range(atoms) for r in range(2)]  # the thread's rows
        threads = 128  # the tile's: one warpgroup's
        bar_id = 1 + wg  # a named barrier a warpgroup
        first_buf = wg * epi_stages
        store_warp = 4 + 4 * wg
        pieces = self.tile_n // EPI_N
        per = EPI_N // 8  # j's a piece
        floor = f32(-3.0e38)  # a running max's floor: no -inf − -inf before a row's first column in the vocab
        if cutlass.const_expr(by_tma):
            bS, bG = cute.nvgpu.cpasync.tma_partition(
                tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2),
                cute.zipped_divide(gCt, (TILE_M, EPI_N)))
            r2s = cute.make_tiled_copy_S(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), f32),
                cute.make_tiled_copy_C_atom(
                    cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), f32), tiled_mma))
            thr = r2s.get_slice(ctidx)
            tRS_s = thr.partition_D(sC)
            rD = cute.make_rmem_tensor(cute.shape(thr.partition_S(sC))[:3], f32)
            assert cute.size(rD) == 4 * atoms * per, "a piece's values a thread: 4 a j, per j's an atom"
        ks = (k1, k2)[:sums]  # each sum's constant
        m = [floor for _ in slots]  # [row]
        ls = [[f32(0.0) for _ in slots] for _ in ks]  # [sum][row]
        for p in cutlass.range_constexpr(pieces):
            buf = first_buf + p % epi_stages
            if cutlass.const_expr(by_tma):
                # rD is (4 values, atoms, per j's), compact: value c + 2r of atom a at j = p·per + n
                for n in cutlass.range_constexpr(per):
                    for at in cutlass.range_constexpr(atoms):
                        for c in cutlass.range_constexpr(4):
                            rD[c + 4 * at + 4 * atoms * n] = acc[c + 4 * (p * per + n) + per_atom * at]
                cute.copy(r2s, rD, tRS_s[(None, None, None, buf)])
                cute.arch.fence_proxy("async.shared", space="cta")  # the stores, seen by the TMA unit
                cute.arch.barrier(barrier_id=bar_id, number_of_threads=threads)
                if warp == store_warp:
                    cute.copy(tma_c, bS[(None, buf)], bG[(None, p)])
                    cute.arch.cp_async_bulk_commit_group()
            for r in cutlass.range_constexpr(len(slots) if sums else 0):
                zs = []
                mp = m[r]
                for j in cutlass.range_constexpr(p * per, (p + 1) * per):
                    for c in cutlass.range_constexpr(2):
                        i = c + 2 * slots[r][1] + 4 * j + per_atom * slots[r][0]
                        z = acc[i]
                        if tCcC[i][1] >= N:  # past the vocab: out of the statistics (and never stored)
                            z = f32(-math.inf)
                        zs.append(z)
                        mp = cute.arch.fmax(mp, z)
                for l, k in zip(ls, ks):
                    l[r] = l[r] * cute.math.exp2((m[r] - mp) * k, fastmath=True)
                    for z in zs:
                        l[r] = l[r] + cute.math.exp2((z - mp) * k, fastmath=True)
                m[r] = mp
            if cutlass.const_expr(by_tma):
                if warp == store_warp:
                    cute.arch.cp_async_bulk_wait_group(epi_stages - 1, read=True)
                cute.arch.barrier(barrier_id=bar_id, number_of_threads=threads)
        for r in cutlass.range_constexpr(len(slots) if sums else 0):
            mq = m[r]
            for width in cutlass.range_constexpr(1, 3):
                mq = cute.arch.fmax(mq, cute.arch.shuffle_sync_bfly(mq, offset=width))
            row_sums = []
            for l, k in zip(ls, ks):
                a = l[r] * cute.math.exp2((m[r] - mq) * k, fastmath=True)
                for width in cutlass.range_constexpr(1, 3):
                    a = a + cute.arch.shuffle_sync_bfly(a, offset=width)
                row_sums.append(a)
            row = tCcC[2 * slots[r][1] + per_atom * slots[r][0]][0]
            if lane % 4 == 0 and row < M:
                mM[row, bn] = mq
                for plane, a in zip((mL1, mL2), row_sums):
                    plane[row, bn] = a
        if cutlass.const_expr(self.store == "direct"):
            for i in cutlass.range_constexpr(n_values):
                if cute.elem_less(tCcC[i], mC.shape):
                    tCgC[i] = acc[i]

    @cute.jit
    def load(self, tma_a: cute.CopyAtom, tma_b: cute.CopyAtom, sA: cute.Tensor, sB: cute.Tensor, gA: cute.Tensor,
             gB: cute.Tensor, pipe, first: cutlass.Int32, step: cutlass.Int32, tiles: cutlass.Int32,
             m_tiles: cutlass.Int32, n_tiles: cutlass.Int32, k_tiles: cutlass.Int32):
        """Warp 0: each of the CTA's tiles' k tiles of a and b by TMA into the next free stage."""
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
        produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        for tile in cutlass.range(first, tiles, step, unroll=1):
            # raster "m": the CTAs running at once share few tiles of w, each read from memory once
            bm, bn = self.tile_mn(tile, m_tiles, n_tiles)
            for kt in cutlass.range(k_tiles, unroll=1):
                pipe.producer_acquire(produce)
                bar = pipe.producer_get_barrier(produce)
                cute.copy(tma_a, tAgA[(None, bm, kt)], tAsA[(None, produce.index)], tma_bar_ptr=bar)
                cute.copy(tma_b, tBgB[(None, bn, kt)], tBsB[(None, produce.index)], tma_bar_ptr=bar)
                pipe.producer_commit(produce)
                produce.advance()

    @cute.jit
    def multiply(self, tidx: cutlass.Int32, warp: cutlass.Int32, first: cutlass.Int32, step: cutlass.Int32,
                 tiles: cutlass.Int32, m_tiles: cutlass.Int32, n_tiles: cutlass.Int32, k_tiles: cutlass.Int32,
                 pipe, tiled_mma: cute.TiledMma, sA: cute.Tensor, sB: cute.Tensor, sC: cute.Tensor, gC: cute.Tensor,
                 cC: cute.Tensor, gCt: cute.Tensor, mC: cute.Tensor, mM: cute.Tensor, mL1: cute.Tensor,
                 mL2: cute.Tensor, k1: cutlass.Float32, k2: cutlass.Float32, tma_c: cute.CopyAtom):
        """Warpgroups 1 and 2: warpgroup wg takes the CTA's tiles wg, wg + 2, ...: for each, its main loop over
        the stages the loads fill, then `epilogue`, while the other warpgroup runs its main loop (the stages
        go to the warpgroups in turn)."""
        stages = self.stages
        ctidx = tidx - 128
        wg = cute.arch.make_warp_uniform(ctidx // 128)
        ctidx = ctidx - 128 * wg
        start, stride = first + wg * step, 2 * step
        wg_mma = tiled_mma.get_slice(cute.arch.make_warp_uniform(ctidx // 128) * 128)
        tCrA = tiled_mma.make_fragment_A(wg_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(wg_mma.partition_B(sB))
        thr_mma = tiled_mma.get_slice(ctidx)
        acc = cute.make_rmem_tensor(thr_mma.partition_C(gC[(None, None, 0, 0)]).shape, f32)
        k_blocks = cute.size(tCrA, mode=[2])
        consume = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
        for _ in cutlass.range(wg * k_tiles, unroll=1):  # the other warpgroup's first tile's stages
            consume.advance()
            release.advance()
        for tile in cutlass.range(start, tiles, stride, unroll=1):
            bm, bn = self.tile_mn(tile, m_tiles, n_tiles)
            # the main loops take turns: this warpgroup's next stages are waited for only once the other's
            # tile before has taken all of its own, so a stage's barrier is never two phases behind the phase
            # asked for (its parity would pass the wait)
            if tile != first:
                cute.arch.barrier(barrier_id=3 + wg, number_of_threads=256)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
            for kt in cutlass.range(k_tiles, unroll=1):
                pipe.consumer_wait(consume)
                cute.nvgpu.warpgroup.fence()
                for kb in cutlass.range(k_blocks, unroll_full=True):
                    at = (None, None, kb, consume.index)
                    cute.gemm(tiled_mma, acc, tCrA[at], tCrB[at], acc)
                    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                cute.nvgpu.warpgroup.commit_group()
                cute.nvgpu.warpgroup.wait_group(1)
                if kt > 0:  # the previous k tile's batch has retired: its stage goes back to the loads
                    pipe.consumer_release(release)
                    release.advance()
                consume.advance()
            cute.nvgpu.warpgroup.wait_group(0)
            pipe.consumer_release(release)
            release.advance()
            if tile + step < tiles:  # the other warpgroup's next tile may start
                cute.arch.barrier_arrive(barrier_id=4 - wg, number_of_threads=256)
            self.epilogue(acc, thr_mma.partition_C(gC[(None, None, bm, bn)]),
                          thr_mma.partition_C(cC[(None, None, bm, bn)]), mC, mM, mL1, mL2, bn, k1, k2,
                          sC, tma_c, gCt[(None, None, bm, bn)], warp, tiled_mma, ctidx, wg)
            for _ in cutlass.range(k_tiles, unroll=1):  # the other warpgroup's next tile's stages
                consume.advance()
                release.advance()
        if cutlass.const_expr(self.by_tma):
            if warp % 4 == 0:  # shared memory outlives the last stores' reads of it
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.kernel
    def kernel_ws(
        self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor, tma_c: cute.CopyAtom,
        mCt: cute.Tensor, mC: cute.Tensor, mM: cute.Tensor, mL1: cute.Tensor, mL2: cute.Tensor, k1: cutlass.Float32,
        k2: cutlass.Float32, tiled_mma: cute.TiledMma, a_layout: cute.ComposedLayout, b_layout: cute.ComposedLayout,
        c_layout: cute.ComposedLayout, storage_type: cutlass.Constexpr, tx_bytes: cutlass.Constexpr,
    ):
        """Persistent and warp-specialised: warpgroup 0 loads (warp 0 issues the TMA copies), warpgroups 1
        and 2 multiply and run the epilogue, while the loads of the next tile already fill the stages."""
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        first, _, _ = cute.arch.block_idx()
        step, _, _ = cute.arch.grid_dim()
        if warp == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            if cutlass.const_expr(self.by_tma):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_c)
        smem = SmemAllocator()
        storage = smem.allocate(storage_type)
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.bars.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            # the warps that release a stage: one warpgroup's
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4),
            tx_count=tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        )
        sA = storage.sA.get_tensor(a_layout.outer, swizzle=a_layout.inner)
        sB = storage.sB.get_tensor(b_layout.outer, swizzle=b_layout.inner)
        tiler = (TILE_M, self.tile_n, TILE_K)
        every = (None, None, None, 0)
        gA = cute.local_tile(mA, tiler, every, proj=(1, None, 1))  # (TILE_M, TILE_K, m tiles, k tiles)
        gB = cute.local_tile(mB, tiler, every, proj=(None, 1, 1))  # (tile_n, TILE_K, n tiles, k tiles)
        gC = cute.local_tile(mC, tiler, every, proj=(1, 1, None))  # (TILE_M, tile_n, m tiles, n tiles)
        cC = cute.local_tile(cute.make_identity_tensor(mC.shape), tiler, every, proj=(1, 1, None))
        gCt = cute.local_tile(mCt, tiler, every, proj=(1, 1, None))  # the TMA view of z (store "tma")
        m_tiles = cute.size(gC, mode=[2])
        n_tiles = cute.size(gC, mode=[3])
        tiles = m_tiles * n_tiles
        k_tiles = cute.size(gA, mode=[3])

        if warp < 4:
            cute.arch.setmaxregister_decrease(40)
            if warp == 0:
                self.load(tma_a, tma_b, sA, sB, gA, gB, pipe, first, step, tiles, m_tiles, n_tiles, k_tiles)
        else:
            cute.arch.setmaxregister_increase(232)
            sC = storage.sC.get_tensor(c_layout.outer, swizzle=c_layout.inner)
            self.multiply(tidx, warp, first, step, tiles, m_tiles, n_tiles, k_tiles, pipe, tiled_mma, sA, sB, sC,
                          gC, cC, gCt, mC, mM, mL1, mL2, k1, k2, tma_c)

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, m: cute.Tensor, l1: cute.Tensor,
                 l2: cute.Tensor, k1: cutlass.Float32, k2: cutlass.Float32, stream: cuda.CUstream):
        """z = a · bᵀ into c, the statistics into m, l1, l2 (`cute_gemm._launch`'s arguments); asynchronous on
        `stream`."""
        tile_n, stages, epi_stages = self.tile_n, self.stages, self.epi_stages
        ab = a.element_type
        rows = TILE_M
        # one warpgroup a tile, over its two 64-row atoms
        tiled_mma = sm90.make_trivial_tiled_mma(
            ab, ab, LayoutEnum.from_tensor(a).sm90_mma_major_mode(),
            LayoutEnum.from_tensor(b).sm90_mma_major_mode(), f32, (1, 1, 1), tiler_mn=(64, tile_n))
        tile = (rows, tile_n, TILE_K)
        a_layout = sm90.make_smem_layout_a(LayoutEnum.from_tensor(a), tile, ab, stages)
        b_layout = sm90.make_smem_layout_b(LayoutEnum.from_tensor(b), tile, ab, stages)
        op = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_a, tA = cute.nvgpu.cpasync.make_tiled_tma_atom(
            op, a, cute.slice_(a_layout, (None, None, 0)), (rows, TILE_K))
        tma_b, tB = cute.nvgpu.cpasync.make_tiled_tma_atom(
            op, b, cute.slice_(b_layout, (None, None, 0)), (tile_n, TILE_K))
        tx_bytes = (rows + tile_n) * TILE_K * ab.width // 8
        epi = (rows, EPI_N)
        c_layout = sm90.make_smem_layout_epi(f32, LayoutEnum.from_tensor(c), epi, epi_stages * 2)
        tma_c, tC = tma_a, c  # stand-ins where z takes plain stores: no descriptor (z's rows may be unaligned)
        if cutlass.const_expr(self.by_tma):
            op = (cute.nvgpu.cpasync.CopyReduceBulkTensorTileS2GOp() if self.store == "add"
                  else cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp())
            tma_c, tC = cute.nvgpu.cpasync.make_tiled_tma_atom(op, c, cute.slice_(c_layout, (None, None, 0)), epi)

        @cute.struct
        class Storage:
            bars: cute.struct.MemRange[cutlass.Int64, stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(a_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(b_layout)], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[f32, cute.cosize(c_layout)], 1024]

        tiles = cute.ceil_div(c.shape[0], rows) * cute.ceil_div(c.shape[1], tile_n)
        args = (tma_a, tA, tma_b, tB, tma_c, tC, c, m, l1, l2, k1, k2, tiled_mma, a_layout, b_layout, c_layout,
                Storage, tx_bytes)
        self.kernel_ws(*args).launch(grid=(cutlass.min(tiles, self.sms), 1, 1), block=(384, 1, 1), stream=stream)
