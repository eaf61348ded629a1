"""Logits GEMMs on CuTe DSL (Hopper, sm_90): z = x · wᵀ written at fp32 (the WGMMA accumulator), with each
(row, vocab tile)'s softmax statistics formed in the epilogue from the same registers, so the row kernels
skip the pass that reads every logit to find them (`triton_rows.rows(..., tiles=...)`).

A persistent, warp-specialised kernel, one CTA an SM: warpgroup 0 loads tiles of x and w by TMA into a
STAGES-deep shared-memory pipeline; warpgroups 1 and 2 take the CTA's TILE_M × TILE_N output tiles in turn
("pingpong": each multiplies its tile with WGMMA, then runs its epilogue while the other multiplies the
next), and the epilogue for each row of the tile forms
  m  = max_j z_j                     (over the tile's columns inside the vocab)
  l1 = Σ_j 2^((z_j − m) · k1)        (k1 = log2(e)·fold/τ: softmax(z/τ)'s numerator, in log2 units)
  l2 = Σ_j 2^((z_j − m) · k2)        (2 sums only: the untempered CE's, k2 = log2(e)·fold)
into (R, n_tiles) planes, and writes z: a TILE_M × EPI_N piece at a time through shared memory and a TMA
bulk store, the piece's statistics (merged online over the pieces, then over a row's quad of lanes by two
shuffles) computed while the TMA unit reads it. Where z's rows are not 16-byte aligned, plain stores.
The same kernel without statistics and with TMA reduce-add stores makes the weight gradient's chunk GEMM,
dW += dSᵀ · X, added in L2 (`accumulate`). Here: the host side (checks, launches, compiled kernels kept);
the kernel, in pieces, in `cute_gemm_sm90`.

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

# The variants `logits` and `accumulate` run (`_build`'s parameters; the tile's rows, K step and z's pieces are
# the kernel's own: `cute_gemm_sm90`'s TILE_M, TILE_K, EPI_N)
TILE_N = 128
STAGES = 6  # (128 + 128) · 64 · 2 = 32 KiB a stage
EPI_STAGES = 1  # pieces in flight a warpgroup: 6 · 32 + 2 · 1 · 16 KiB fits the 227 KiB an SM has
LOGITS = dict(tile_n=TILE_N, stages=STAGES, epi_stages=EPI_STAGES)
# the weight gradient's chunk GEMM (`accumulate`): a warpgroup a 128 × 128 tile, the other's reduce-add stores
# under its main loop
ACCUMULATE = dict(tile_n=128, stages=5, epi_stages=2)

_compiled = {}  # `_executor`'s key (dtype and `_build`'s arguments) -> compiled executor
compile_seconds = {}  # the same keys -> seconds spent in cute.compile (first call of a process)
load_seconds = {}  # the same keys -> seconds spent loading the kernel compiled by an earlier process (`cute_cache`)


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
           epi_stages: int = EPI_STAGES, raster: str = "m"):
    """The kernel of one variant (`cute_gemm_sm90.Gemm`), its parameters checked before CuTe DSL is imported.
    sums: 1 or 2 statistics sums (module doc), or 0 for the bare GEMM (`accumulate`); the kernel persistent on
    `sms` CTAs. store: how z leaves the registers:
      "tma"    through shared memory, a TILE_M × EPI_N piece at a time, by TMA bulk stores that run on while
               the warpgroups go on (z's rows 16-byte aligned: `logits` checks);
      "add"    the same, by TMA reduce-add stores (z added to what the output holds, in L2: `accumulate`);
      "direct" each thread's values by plain stores (any row stride; the warpgroups wait on them).
    epi_stages: "tma"'s pieces in flight, a warpgroup (shared memory: stages · (128 + tile_n) · 128 B + the
    pieces' 16 KiB each, of 227 KiB).
    The schedule is "pingpong": each multiplying warpgroup a tile of its own, every other tile of the CTA's,
    so one runs its epilogue while the other multiplies; the cooperative one it was measured against (both
    warpgroups on one tile, then both in its epilogue) is in the history (BENCHMARKS.md, "Ping-pong").
    raster: which output tile index runs fastest over the CTAs working at once, "m" (they share tiles of
    the second operand) or "n" (of the first)."""
    if tile_n > 128:  # a warpgroup holds its whole tile: tile_n fp32 registers a thread
        raise ValueError(f"tile_n: schedule 'pingpong' takes at most 128 columns, got {tile_n}")
    if store not in ("tma", "add", "direct"):
        raise ValueError(f"store: expected 'tma', 'add' or 'direct', got {store!r}")
    if store == "add" and sums:
        raise ValueError(f"sums: store 'add' takes no statistics, got {sums}")
    if raster not in ("m", "n"):
        raise ValueError(f"raster: expected 'm' or 'n', got {raster!r}")
    from .cute_gemm_sm90 import Gemm

    return Gemm(sums, tile_n, stages, sms, store, epi_stages, raster)


def _as_cute(t: torch.Tensor, align: int = 16, leading: int = 1):
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t, assumed_align=align).mark_layout_dynamic(leading_dim=leading)


def _stream(device):
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)


def _executor(dtype: torch.dtype, sums: int, config: dict, sms: int, store: str, raster: str, majors: tuple,
              args, device):
    key = (dtype, sums, config["tile_n"], config["stages"], sms, store, config["epi_stages"], raster, majors)
    fn = _compiled.get(key)
    if fn is None:
        import cutlass.cute as cute

        from . import cute_cache, cute_gemm_sm90

        t0 = time.perf_counter()
        on_disk = (str(dtype),) + key[1:] + (torch.cuda.get_device_capability(device),)  # the key, and the GPU
        kernel = _build(sums, config["tile_n"], config["stages"], sms, store, config["epi_stages"], raster)
        fn, how = cute_cache.load_or_compile(on_disk, (Path(__file__), Path(cute_gemm_sm90.__file__)),
                                             lambda: cute.compile(kernel, *args))
        (compile_seconds if how == "compiled" else load_seconds)[key] = time.perf_counter() - t0
        _compiled[key] = fn
    return fn


def _launch(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, planes: torch.Tensor | None, k1: float,
            k2: float | None, store: str, config: dict, raster: str = "m", majors: tuple = (1, 1)) -> torch.Tensor:
    """out = a · bᵀ (store "add": out += a · bᵀ) and, unless planes is None, the statistics into planes
    (`logits`), by the kernel of `config` (LOGITS, ACCUMULATE: tile_n, stages, epi_stages; the probes try
    others), its operands checked by the caller. Asynchronous on the current stream."""
    sums = 0 if planes is None else 1 if k2 is None else 2
    if planes is None:  # the bare GEMM: never written
        planes = torch.empty(1, 1, 1, device=a.device)
    # (rows, K, 1) and (N, K, 1) operands, each of its major; (M, N, 1) output: the kernel's batch mode is 1
    # the planes take scalar stores: 4-byte aligned is enough; a, b and a TMA-stored out go through TMA
    a, b = a.detach(), b.detach()  # DLPack exports no tensor that requires grad; the kernel reads them only
    args = [_as_cute(a[:, :, None], leading=majors[0]), _as_cute(b[:, :, None], leading=majors[1]),
            _as_cute(out[:, :, None], 16 if store in ("tma", "add") else 4), _as_cute(planes[0], 4),
            _as_cute(planes[min(1, sums)], 4), _as_cute(planes[sums], 4), float(k1), float(k1 if k2 is None else k2),
            _stream(a.device)]
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    _executor(a.dtype, sums, config, sms, store, raster, majors, args, a.device)(*args)
    return out


def logits(x: torch.Tensor, w: torch.Tensor, planes: torch.Tensor, k1: float = 1.0, k2: float | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """z = x · wᵀ in fp32 (R, V), and each (row, vocab tile)'s (m, l1[, l2]) (module doc) into
    planes[0], planes[1][, planes[2]]: planes is (2 or 3, R, n_tiles(V)) fp32 (any plane stride, rows
    contiguous). k2 None: two planes. Asynchronous on the current stream. z leaves by TMA stores where its rows
    are 16-byte aligned (V a multiple of 4), else by plain ones (`_build`'s store)."""
    r, v = x.shape[0], w.shape[0]
    sums = 1 if k2 is None else 2
    nt = n_tiles(v)
    if planes.shape != (sums + 1, r, nt) or planes.dtype != torch.float32 or planes.stride(2) != 1:
        raise ValueError(f"planes: expected ({sums + 1}, {r}, {nt}) fp32 with unit last stride, "
                         f"got {tuple(planes.shape)} {planes.dtype}")
    if out is None:
        out = torch.empty(r, v, device=x.device, dtype=torch.float32)
    elif out.shape != (r, v) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out: expected ({r}, {v}) fp32 with unit last stride, got {tuple(out.shape)} {out.dtype}")
    if r == 0 or v == 0:
        return out
    store = "tma" if out.stride(0) % 4 == 0 and out.data_ptr() % 16 == 0 else "direct"
    return _launch(x, w, out, planes, k1, k2, store, LOGITS)


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
    return _launch(a, b, out, None, 1.0, None, "add" if add else "tma", ACCUMULATE, raster="n",
                   majors=(_operand_major(a), _operand_major(b)))
