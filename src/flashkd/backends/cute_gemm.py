"""Logits GEMMs on CuTe DSL (Hopper, sm_90): z = x · wᵀ written at fp32 (the WGMMA accumulator), with each
(row, vocab tile)'s softmax statistics formed in the epilogue from the same registers, so the row kernels
skip the pass that reads every logit to find them (`triton_rows.rows(..., tiles=...)`).

A persistent, warp-specialised kernel, one CTA an SM: warpgroup 0 loads tiles of x and w by TMA into a
STAGES-deep shared-memory pipeline; warpgroups 1 and 2 take the CTA's TILE_M × TILE_N output tiles in turn
("pingpong": each multiplies its tile with WGMMA, then runs its epilogue while the other multiplies the
next), and the epilogue for each row of the tile forms
  m  = max_j z_j                     (over the tile's columns inside the vocab)
  l1 = Σ_j 2^((z_j − m) · k1)        (k1 = log2(e)·fold/τ: softmax(z/τ)'s numerator, in log2 units)
  l2 = Σ_j 2^((z_j − m) · k2)        (SUMS = 2 only: the untempered CE's, k2 = log2(e)·fold)
into (R, n_tiles) planes, and writes z: a TILE_M × EPI_N piece at a time through shared memory and a TMA
bulk store, the piece's statistics (merged online over the pieces, then over a row's quad of lanes by two
shuffles) computed while the TMA unit reads it. Where z's rows are not 16-byte aligned, plain stores.
The same kernel without statistics and with TMA reduce-add stores makes the weight gradient's chunk GEMM,
dW += dSᵀ · X, added in L2 (`accumulate`).

Needs nvidia-cutlass-dsl (`pip install 'flashkd[cute]'`) and an sm_90 GPU; compiles once per variant (JIT,
1.5–2 s on an H200; `compile_seconds`), kept on disk for later processes (`cute_cache`; `load_seconds`).
Measured (BENCHMARKS.md, "The CuTe DSL logits GEMM" and "Ping-pong"): correct to fp32 at every shape
tried; in the JSD seed call the sixteen logits GEMMs take 18.2 ms against the floor's two bf16 GEMMs' 18.4,
with the fp32 z and the statistics, which spare the row pass a read of every logit; the eight dW GEMMs 7.3–7.5
against cuBLAS's fp32 addmm's 7.8.
"""

import math
import time
from pathlib import Path

import torch

TILE_M = 128  # "pingpong": one warpgroup's two 64-row WGMMA atoms; "cooperative": two warpgroups of 64 rows
TILE_N = 128
TILE_K = 64
STAGES = 6  # (128 + 128) · 64 · 2 = 32 KiB a stage
EPI_N = 32  # z leaves through shared memory in TILE_M × EPI_N fp32 pieces (16 KiB), by TMA stores
EPI_STAGES = 1  # pieces in flight a warpgroup: 6 · 32 + 2 · 1 · 16 KiB fits the 227 KiB an SM has
SCHEDULE = "pingpong"  # measured against "cooperative" (TILE_N 256, 4 stages, 2 pieces): BENCHMARKS.md

_compiled = {}  # `_executor`'s key (dtype and `_build`'s arguments) -> compiled executor
compile_seconds = {}  # the same keys -> seconds spent in cute.compile (first call of a process)
load_seconds = {}  # the same keys -> seconds spent loading the kernel compiled by an earlier process (`cute_cache`)
calls = 0  # `logits` launches in this process (tests check which calls ran here)
accumulate_calls = 0  # `accumulate` launches


def n_tiles(v: int, tile_n: int = TILE_N) -> int:
    """Vocab tiles of a row: the statistics planes' width."""
    return -(-v // tile_n)


def tile_stats(z: torch.Tensor, ks, tile_n: int = TILE_N):
    """What the epilogue makes of logits z (R, V), in torch and z's dtype (float64 for a reference): each
    (row, tile of tile_n columns)'s max m (R, n_tiles) and, for each k in ks, Σ 2^((z − m)·k) over the tile
    (columns past V absent). Returns (m, [sums])."""
    r, v = z.shape
    pad = torch.full((r, n_tiles(v, tile_n) * tile_n), -math.inf, dtype=z.dtype, device=z.device)
    pad[:, :v] = z
    pad = pad.view(r, -1, tile_n)
    m = pad.amax(-1)
    d = pad - m[..., None]
    return m, [torch.exp2(d * k).sum(-1) for k in ks]


def eligible(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Shapes and dtypes the kernel takes: bf16 / fp16 operands, K-contiguous, 16-byte aligned rows (TMA)."""
    return (
        x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype
        and x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1] and x.shape[1] % 8 == 0
        and x.stride(1) == 1 and w.stride(1) == 1 and x.stride(0) % 8 == 0 and w.stride(0) % 8 == 0
        and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0
        and torch.cuda.get_device_capability(x.device) == (9, 0)
    )


def available() -> bool:
    try:
        import cutlass.cute  # noqa: F401
    except ImportError:
        return False
    return True


def _build(sums: int, tile_n: int = TILE_N, stages: int = STAGES, sms: int = 132, store: str = "tma",
           epi_stages: int = EPI_STAGES, schedule: str = SCHEDULE, raster: str = "m"):
    """sums: 1 or 2 statistics sums (module doc), or 0 for the bare GEMM (z alone: for measuring); the
    kernel persistent on `sms` CTAs. store: how z leaves the registers:
      "tma"    through shared memory, a TILE_M × EPI_N piece at a time, by TMA bulk stores that run on while
               the warpgroups go on (z's rows 16-byte aligned: `logits` checks);
      "add"    the same, by TMA reduce-add stores (z added to what the output holds, in L2: `accumulate`);
      "direct" each thread's values by plain stores (any row stride; the warpgroups wait on them);
      "none"   not at all, for timing the main loop alone (a NaN test keeps the products live).
    epi_stages: "tma"'s pieces in flight, a warpgroup (shared memory: stages · (128 + tile_n) · 128 B + the
    pieces' 16 KiB each, of 227 KiB).
    schedule: "cooperative"  both multiplying warpgroups on one TILE_M × tile_n tile, 64 rows each, then
                             both run its epilogue while no WGMMA does;
              "pingpong"     each warpgroup a tile of its own, every other tile of the CTA's, so one runs its
                             epilogue while the other multiplies (the stages go to the warpgroups in turn).
    raster: which output tile index runs fastest over the CTAs working at once, "m" (they share tiles of
    the second operand) or "n" (of the first)."""
    if schedule not in ("cooperative", "pingpong"):
        raise ValueError(f"schedule: expected 'cooperative' or 'pingpong', got {schedule!r}")
    if schedule == "pingpong" and tile_n > 128:  # a warpgroup holds its whole tile: tile_n fp32 registers a thread
        raise ValueError(f"tile_n: schedule 'pingpong' takes at most 128 columns, got {tile_n}")
    if store not in ("tma", "add", "direct", "none"):
        raise ValueError(f"store: expected 'tma', 'add', 'direct' or 'none', got {store!r}")
    if store == "add" and sums:
        raise ValueError(f"sums: store 'add' takes no statistics, got {sums}")
    if raster not in ("m", "n"):
        raise ValueError(f"raster: expected 'm' or 'n', got {raster!r}")
    by_tma = store in ("tma", "add")
    if (tile_n // EPI_N) % epi_stages:
        raise ValueError(f"epi_stages: expected a divisor of {tile_n // EPI_N} (pieces a tile), got {epi_stages}")
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    from cutlass.memory import SmemAllocator
    from cutlass.tensor_utils import LayoutEnum
    import cutlass.utils.hopper_helpers as sm90

    f32 = cutlass.Float32
    lowest = -math.inf
    pingpong = schedule == "pingpong"

    def tile_mn(tile, m_tiles, n_tiles):
        """(bm, bn) of the persistent loop's tile-th output tile, `raster`'s index fastest (traced inline)."""
        if raster == "m":
            return tile % m_tiles, tile // m_tiles
        return tile // n_tiles, tile % n_tiles

    @cute.jit
    def epilogue(acc: cute.Tensor, tCgC: cute.Tensor, tCcC: cute.Tensor, mC: cute.Tensor, mM: cute.Tensor,
                 mL1: cute.Tensor, mL2: cute.Tensor, bn: cutlass.Int32, k1: cutlass.Float32, k2: cutlass.Float32,
                 sC: cute.Tensor, tma_c: cute.CopyAtom, gCt: cute.Tensor, warp: cutlass.Int32,
                 tiled_mma: cute.TiledMma, ctidx: cutlass.Int32, wg: cutlass.Int32):
        """z out and the statistics of each of the thread's rows of the tile (module doc), a piece of
        EPI_N columns at a time: wgmma gives a thread value c + 2r + 4j + A·a at row r of its two in the
        a-th of its 64-row atoms (A values an atom; one atom "cooperative", two "pingpong"), column
        8j + 2·(lane % 4) + c, so piece p is j in [p·EPI_N/8, (p+1)·EPI_N/8).
        store "tma" / "add": the tile's threads copy piece p (its values in the order of the copy's register
        tensor rD) into their warpgroup's buffer p % epi_stages by 8-byte stores; its first warp stores it
        by TMA (rows and columns past z's edge clipped) and, after this piece's statistics, waits until the
        store epi_stages − 1 before has read its buffer, the next piece's: the statistics' exp2s run while
        the TMA unit reads. Pieces a tile are a multiple of epi_stages, so buffer p % epi_stages is free
        across tiles too.
        The statistics are merged online over the pieces, then over the row's quad of lanes."""
        M, N = mC.shape[0], mC.shape[1]
        lane = cute.arch.lane_idx()
        n_values = cute.size(acc)
        per_atom = cute.size(acc, mode=[0])
        atoms = cute.size(acc, mode=[1])
        slots = [(a, r) for a in range(atoms) for r in range(2)]  # the thread's rows
        threads = 128 if cutlass.const_expr(schedule == "pingpong") else 256  # the tile's
        bar_id = 1 + wg  # a named barrier a warpgroup ("cooperative": one, wg = 0)
        first_buf = wg * epi_stages
        store_warp = 4 + 4 * wg
        pieces = tile_n // EPI_N
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
                            z = f32(lowest)
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
        if cutlass.const_expr(store == "direct"):
            for i in cutlass.range_constexpr(n_values):
                if cute.elem_less(tCcC[i], mC.shape):
                    tCgC[i] = acc[i]
        if cutlass.const_expr(store == "none"):
            if acc[0] != acc[0] and cute.elem_less(tCcC[0], mC.shape):
                tCgC[0] = acc[0]

    @cute.kernel
    def kernel_ws(
        tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor, tma_c: cute.CopyAtom,
        mCt: cute.Tensor, mC: cute.Tensor, mM: cute.Tensor, mL1: cute.Tensor, mL2: cute.Tensor, k1: cutlass.Float32,
        k2: cutlass.Float32, tiled_mma: cute.TiledMma, a_layout: cute.ComposedLayout, b_layout: cute.ComposedLayout,
        c_layout: cute.ComposedLayout, storage_type: cutlass.Constexpr, tx_bytes: cutlass.Constexpr,
    ):
        """Persistent and warp-specialised: warpgroup 0 loads (warp 0 issues the TMA copies), warpgroups 1
        and 2 multiply and run the epilogue (`_build`'s schedule), while the loads of the next tile already
        fill the stages."""
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        first, _, _ = cute.arch.block_idx()
        step, _, _ = cute.arch.grid_dim()
        if warp == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            if cutlass.const_expr(by_tma):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_c)
        smem = SmemAllocator()
        storage = smem.allocate(storage_type)
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.bars.data_ptr(),
            num_stages=stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            # the warps that release a stage: the tile's ("pingpong": one warpgroup's)
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 if pingpong else 8),
            tx_count=tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        )
        sA = storage.sA.get_tensor(a_layout.outer, swizzle=a_layout.inner)
        sB = storage.sB.get_tensor(b_layout.outer, swizzle=b_layout.inner)
        tiler = (TILE_M, tile_n, TILE_K)
        every = (None, None, None, 0)
        gA = cute.local_tile(mA, tiler, every, proj=(1, None, 1))  # (TILE_M, TILE_K, m tiles, k tiles)
        gB = cute.local_tile(mB, tiler, every, proj=(None, 1, 1))  # (tile_n, TILE_K, n tiles, k tiles)
        gC = cute.local_tile(mC, tiler, every, proj=(1, 1, None))  # (TILE_M, tile_n, m tiles, n tiles)
        cC = cute.local_tile(cute.make_identity_tensor(mC.shape), tiler, every, proj=(1, 1, None))
        gCt = cute.local_tile(mCt, tiler, every, proj=(1, 1, None))  # the TMA view of z (store "tma")
        m_tiles = cute.size(gC, mode=[2])
        nn_tiles = cute.size(gC, mode=[3])
        tiles = m_tiles * nn_tiles
        k_tiles = cute.size(gA, mode=[3])

        if warp < 4:
            cute.arch.setmaxregister_decrease(40)
            if warp == 0:
                tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                    tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
                tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
                    tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
                produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
                for tile in cutlass.range(first, tiles, step, unroll=1):
                    # raster "m": the CTAs running at once share few tiles of w, each read from memory once
                    bm, bn = tile_mn(tile, m_tiles, nn_tiles)
                    for kt in cutlass.range(k_tiles, unroll=1):
                        pipe.producer_acquire(produce)
                        bar = pipe.producer_get_barrier(produce)
                        cute.copy(tma_a, tAgA[(None, bm, kt)], tAsA[(None, produce.index)], tma_bar_ptr=bar)
                        cute.copy(tma_b, tBgB[(None, bn, kt)], tBsB[(None, produce.index)], tma_bar_ptr=bar)
                        pipe.producer_commit(produce)
                        produce.advance()
        else:
            cute.arch.setmaxregister_increase(232)
            ctidx = tidx - 128
            wg = 0
            start, stride = first, step
            if cutlass.const_expr(pingpong):  # warpgroup wg takes the CTA's tiles wg, wg + 2, ...
                wg = cute.arch.make_warp_uniform(ctidx // 128)
                ctidx = ctidx - 128 * wg
                start, stride = first + wg * step, 2 * step
            wg_mma = tiled_mma.get_slice(cute.arch.make_warp_uniform(ctidx // 128) * 128)
            tCrA = tiled_mma.make_fragment_A(wg_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(wg_mma.partition_B(sB))
            thr_mma = tiled_mma.get_slice(ctidx)
            acc = cute.make_rmem_tensor(thr_mma.partition_C(gC[(None, None, 0, 0)]).shape, f32)
            sC = storage.sC.get_tensor(c_layout.outer, swizzle=c_layout.inner)
            k_blocks = cute.size(tCrA, mode=[2])
            consume = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
            if cutlass.const_expr(pingpong):
                for _ in cutlass.range(wg * k_tiles, unroll=1):  # the other warpgroup's first tile's stages
                    consume.advance()
                    release.advance()
            for tile in cutlass.range(start, tiles, stride, unroll=1):
                bm, bn = tile_mn(tile, m_tiles, nn_tiles)
                if cutlass.const_expr(pingpong):
                    # the main loops take turns: this warpgroup's next stages are waited for only once the
                    # other's tile before has taken all of its own, so a stage's barrier is never two phases
                    # behind the phase asked for (its parity would pass the wait)
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
                if cutlass.const_expr(pingpong):
                    if tile + step < tiles:  # the other warpgroup's next tile may start
                        cute.arch.barrier_arrive(barrier_id=4 - wg, number_of_threads=256)
                epilogue(acc, thr_mma.partition_C(gC[(None, None, bm, bn)]),
                         thr_mma.partition_C(cC[(None, None, bm, bn)]), mC, mM, mL1, mL2, bn, k1, k2,
                         sC, tma_c, gCt[(None, None, bm, bn)], warp, tiled_mma, ctidx, wg)
                if cutlass.const_expr(pingpong):
                    for _ in cutlass.range(k_tiles, unroll=1):  # the other warpgroup's next tile's stages
                        consume.advance()
                        release.advance()
            if cutlass.const_expr(by_tma):
                if warp % 4 == 0:  # shared memory outlives the last stores' reads of it
                    cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def gemm(a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, m: cute.Tensor, l1: cute.Tensor, l2: cute.Tensor,
             k1: cutlass.Float32, k2: cutlass.Float32, stream: cuda.CUstream):
        ab = a.element_type
        rows = TILE_M
        # "cooperative": two warpgroups of 64 rows a tile; "pingpong": one, over the tile's two 64-row atoms
        tiled_mma = sm90.make_trivial_tiled_mma(
            ab, ab, LayoutEnum.from_tensor(a).sm90_mma_major_mode(),
            LayoutEnum.from_tensor(b).sm90_mma_major_mode(), f32, (1 if pingpong else rows // 64, 1, 1),
            tiler_mn=(64, tile_n))
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
        c_layout = sm90.make_smem_layout_epi(f32, LayoutEnum.from_tensor(c), epi, epi_stages * (2 if pingpong else 1))
        tma_c, tC = tma_a, c  # stand-ins where z takes plain stores: no descriptor (z's rows may be unaligned)
        if cutlass.const_expr(by_tma):
            op = (cute.nvgpu.cpasync.CopyReduceBulkTensorTileS2GOp() if store == "add"
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
        kernel_ws(*args).launch(grid=(cutlass.min(tiles, sms), 1, 1), block=(384, 1, 1), stream=stream)

    return gemm


def _as_cute(t: torch.Tensor, align: int = 16, leading: int = 1):
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t, assumed_align=align).mark_layout_dynamic(leading_dim=leading)


def _stream(device):
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)


def _executor(dtype: torch.dtype, sums: int, tile_n: int, stages: int, sms: int, store: str, epi_stages: int,
              schedule: str, args, device, raster: str = "m", majors: tuple = (1, 1)):
    key = (dtype, sums, tile_n, stages, sms, store, epi_stages, schedule, raster, majors)
    fn = _compiled.get(key)
    if fn is None:
        import cutlass.cute as cute

        from . import cute_cache

        t0 = time.perf_counter()
        on_disk = (str(dtype),) + key[1:] + (torch.cuda.get_device_capability(device),)  # the key, and the GPU
        fn, how = cute_cache.load_or_compile(
            on_disk, Path(__file__),
            lambda: cute.compile(_build(sums, tile_n, stages, sms, store, epi_stages, schedule, raster), *args))
        (compile_seconds if how == "compiled" else load_seconds)[key] = time.perf_counter() - t0
        _compiled[key] = fn
    return fn


def logits(x: torch.Tensor, w: torch.Tensor, planes: torch.Tensor | None, k1: float = 1.0, k2: float | None = None,
           out: torch.Tensor | None = None, *, tile_n: int = TILE_N, stages: int = STAGES,
           store: str | None = None, epi_stages: int = EPI_STAGES, schedule: str = SCHEDULE) -> torch.Tensor:
    """z = x · wᵀ in fp32 (R, V), and each (row, vocab tile)'s (m, l1[, l2]) (module doc) into
    planes[0], planes[1][, planes[2]]: planes is (2 or 3, R, n_tiles(V)) fp32 (any plane stride, rows
    contiguous). k2 None: two planes. Asynchronous on the current stream. store, schedule: `_build`'s; None takes
    "tma" where z's rows are 16-byte aligned (V a multiple of 4), else "direct"."""
    r, v = x.shape[0], w.shape[0]
    sums = 0 if planes is None else 1 if k2 is None else 2
    nt = n_tiles(v, tile_n)
    if planes is None:  # the bare GEMM: never written
        planes = torch.empty(1, 1, nt, device=x.device)
    elif planes.shape != (sums + 1, r, nt) or planes.dtype != torch.float32 or planes.stride(2) != 1:
        raise ValueError(f"planes: expected ({sums + 1}, {r}, {nt}) fp32 with unit last stride, "
                         f"got {tuple(planes.shape)} {planes.dtype}")
    if out is None:
        out = torch.empty(r, v, device=x.device, dtype=torch.float32)
    elif out.shape != (r, v) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out: expected ({r}, {v}) fp32 with unit last stride, got {tuple(out.shape)} {out.dtype}")
    aligned = out.stride(0) % 4 == 0 and out.data_ptr() % 16 == 0
    if store is None:
        store = "tma" if aligned else "direct"
    elif store == "tma" and not aligned:
        raise ValueError(f"store: 'tma' needs out's rows 16-byte aligned, got row stride {out.stride(0)} "
                         f"at address {out.data_ptr():#x}")
    if r == 0 or v == 0:
        return out
    # (rows, K, 1) and (V, K, 1) operands, K contiguous; (R, V, 1) output: the kernel's batch mode is 1
    # the planes take scalar stores: 4-byte aligned is enough; x, w (`eligible`) and a "tma" z go through TMA
    x, w = x.detach(), w.detach()  # DLPack exports no tensor that requires grad; the kernel reads them only
    args = [_as_cute(x[:, :, None]), _as_cute(w[:, :, None]), _as_cute(out[:, :, None], 16 if store == "tma" else 4),
            _as_cute(planes[0], 4), _as_cute(planes[min(1, sums)], 4), _as_cute(planes[sums], 4), float(k1), float(k1 if k2 is None else k2),
            _stream(x.device)]
    global calls
    calls += 1
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    _executor(x.dtype, sums, tile_n, stages, sms, store, epi_stages, schedule, args, x.device)(*args)
    return out


# the weight gradient's chunk GEMM (`accumulate`): a warpgroup a 128 × 128 tile, the other's reduce-add stores
# under its main loop
ACCUMULATE = dict(tile_n=128, stages=5, epi_stages=2, schedule="pingpong")


def _operand_major(t: torch.Tensor) -> int | None:
    """The dimension of a 2-D GEMM operand that is contiguous with the other's stride TMA-aligned (16 bytes),
    or None."""
    per = 16 // t.element_size()
    if t.stride(1) == 1 and (t.stride(0) % per == 0 or t.shape[0] == 1):
        return 1
    if t.stride(0) == 1 and (t.stride(1) % per == 0 or t.shape[1] == 1):
        return 0
    return None


def accumulate_eligible(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `accumulate` takes these: bf16 / fp16 a and b, each with one contiguous dimension and the other's
    stride a multiple of 16 bytes; out fp32 with contiguous, 16-byte aligned rows; an sm_90 GPU."""
    return (
        a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and b.dtype == a.dtype
        and out.dtype == torch.float32 and a.dim() == b.dim() == out.dim() == 2
        and a.shape[1] == b.shape[1] and out.shape == (a.shape[0], b.shape[0])
        and _operand_major(a) is not None and _operand_major(b) is not None
        and out.stride(1) == 1 and out.stride(0) % 4 == 0
        and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0 and out.data_ptr() % 16 == 0
        and torch.cuda.get_device_capability(a.device) == (9, 0)
    )


def accumulate(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, add: bool) -> torch.Tensor:
    """out = a · bᵀ (add False) or out += a · bᵀ (add True), out (M, N) fp32 from a (M, K), b (N, K) of
    either major (`accumulate_eligible`): the weight gradient's chunk GEMM, dW (V, H) += dSᵀ · X with dS
    (R, V) and X (R, H) as given. The sum is added by the TMA unit's reduce-add stores (in L2), so no
    warpgroup waits on a read of out; the tiles run n-fastest, so the CTAs at work share a tile of a (dS, the
    large operand, then read from memory once) and b (X) stays in L2. Asynchronous on the current stream."""
    if not accumulate_eligible(out, a, b):
        raise ValueError(
            f"accumulate: expected fp32 out (M, N) with 16-byte aligned rows and bf16 / fp16 a (M, K), b (N, K) "
            f"each with one contiguous dimension, got out {tuple(out.shape)} {out.dtype} strides {out.stride()}, "
            f"a {tuple(a.shape)} {a.dtype} strides {a.stride()}, b {tuple(b.shape)} {b.dtype} strides {b.stride()}")
    if out.numel() == 0:
        return out
    if a.shape[1] == 0:
        return out if add else out.zero_()
    majors = (_operand_major(a), _operand_major(b))
    a, b = a.detach(), b.detach()
    planes = torch.empty(1, 1, 1, device=a.device)
    args = [_as_cute(a[:, :, None], leading=majors[0]), _as_cute(b[:, :, None], leading=majors[1]),
            _as_cute(out[:, :, None]), _as_cute(planes[0], 4), _as_cute(planes[0], 4), _as_cute(planes[0], 4),
            1.0, 1.0, _stream(a.device)]
    global accumulate_calls
    accumulate_calls += 1
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    c = ACCUMULATE
    _executor(a.dtype, 0, c["tile_n"], c["stages"], sms, "add" if add else "tma", c["epi_stages"], c["schedule"],
              args, a.device, raster="n", majors=majors)(*args)
    return out
