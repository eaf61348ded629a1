"""An FP8 teacher head: the teacher's logits from an e4m3 GEMM (`teacher_precision="fp8"`).

The teacher is frozen, and its GEMM is the largest of the four (Ht > Hs); Hopper runs e4m3 GEMMs at
about twice the bf16 rate. Only the teacher's logits change: the student's GEMMs and all the loss math
stay as they are (bf16 GEMMs, fp32 math).

    head(Wt)        once per call (see below): Wq = e4m3(Wt / sw), sw its scales
    per block of teacher rows c:
        Xq, sx = quantize(Xt[c])                  one fused read of Xt[c], Xq (R, Kp) e4m3, sx fp32
        T = (Xq · sx) @ (Wq · sw)ᵀ (+ bt)          torch._scaled_mm, fp32 accumulation, T in Xt's dtype

Quantisation (`quantize_reference` is the definition, the Triton kernel its twin bit for bit): for each
group of a row — the whole row ("rowwise") or 128 consecutive hidden units ("1x128") — a = max |x|
(at least 2^-100, so a row of zeros gets a finite scale and zeros), q = e4m3_rn(x · (448 / a)) (an
IEEE division, then the product rounded to fp32), scale a · fp32(1/448). |x · 448 / a| <= 448 for
finite x, so nothing saturates. A group holding a NaN or inf gets a = inf: its q is 0 · x (NaN where x
is NaN or inf), its scale inf, and that row's logits NaN, where the bf16 GEMM's would be NaN or inf. Hidden sizes are zero-padded to a multiple of 16 and the
vocab to a multiple of 16 (the FP8 GEMM's alignment); zero columns add nothing, padded vocab rows are
sliced off.

Scaling: "rowwise" (one scale a row of Xt and of Wt; `teacher_precision="fp8"`) runs on every FP8 GPU
(sm_89+); "1x128" (one scale per 128 hidden units of every row, DeepSeek-V3's activation recipe on both
operands) needs cuBLAS's block-scaled GEMM, Hopper only (sm_90). Measured on an H200 (BENCHMARKS.md):
the teacher GEMM at 8192 × 4096 × 128256 takes 0.55× bf16's time rowwise, 0.73× with 1x128 blocks;
their errors are the same on Gaussian hidden states (e4m3's 3-bit mantissa sets them, not the scales'
range), and 1x128 halves the rowwise error when a few channels carry outliers 50× the rest (the
massive activations of LLM hidden states). Hence rowwise by default, 1x128 on request.

The head is quantised anew on every call (once per call, not per block), never cached: no check of
a cached copy can see every way a weight changes (fused optimizer steps, `.data` updates, numpy views
and other tensors sharing the storage all leave the version counter as it was), and reading the whole
weight to compare it costs as much as quantising it. What it costs: one read of Wt and a write of
    Vp·Kp bytes (e4m3) + Vp·4 (rowwise) or Vp·ceil(Kp/128)·4 (1x128),   Vp, Kp: V, Ht rounded up to 16
(128256 × 4096: 1.05 GB read, 525 MB + 0.5 or 16 MB written, ~0.4 ms at an H200's copy speed against
the ~5 ms the FP8 GEMM saves at 8192 rows; `benchmarks/bench_fp8.py --head-only` measures both), held
for the call and freed with it. No host sync.
Per block the quantised rows add R·Kp bytes + their scales (R·Kp/128·4) to the call's memory.
"""

from __future__ import annotations

import dataclasses

import torch

PRECISIONS = (None, "fp8", "fp8-rowwise", "fp8-1x128")
E4M3_MAX = 448.0
_TINY = 2.0**-100  # the smallest group max: a group of zeros gets a finite scale (and zeros)
_ALIGN = 16  # the FP8 GEMM's alignment of the hidden size and of the vocab


@dataclasses.dataclass(frozen=True)
class Head:
    """A teacher head quantised to e4m3: q (Vp, Kp) row-major, scale the GEMM's scale_b ((1, Vp)
    rowwise; (ceil(Kp/128), Vp) contiguous for 1x128), v the vocab rows used."""

    q: torch.Tensor
    scale: torch.Tensor
    v: int
    scaling: str

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()


def check_precision(precision) -> None:
    """A `teacher_precision` value is one of PRECISIONS; else ValueError naming it."""
    if not (precision is None or isinstance(precision, str)) or precision not in PRECISIONS:
        raise ValueError(f"teacher_precision: expected one of {PRECISIONS}, got {precision!r}")


def scaling_of(precision: str, device: torch.device) -> str | None:
    """The scaling a `teacher_precision` means on `device` (None: the teacher's own dtype), after
    checking that the device has FP8 tensor cores. Raises ValueError naming teacher_precision."""
    check_precision(precision)
    if precision is None:
        return None
    if device.type != "cuda":
        raise ValueError(f"teacher_precision: {precision!r} needs a CUDA GPU with FP8 tensor cores (sm_89 or newer); "
                         f"got tensors on {device}")
    cc = torch.cuda.get_device_capability(device)
    if cc < (8, 9):
        raise ValueError(f"teacher_precision: {precision!r} needs a GPU with FP8 tensor cores (sm_89 or newer); "
                         f"{torch.cuda.get_device_name(device)} is sm_{cc[0]}{cc[1]}")
    if precision == "fp8-1x128" and cc[0] != 9:
        raise ValueError(f"teacher_precision: 'fp8-1x128' needs a Hopper GPU (sm_90, cuBLAS's block-scaled FP8 GEMM); "
                         f"{torch.cuda.get_device_name(device)} is sm_{cc[0]}{cc[1]}: use 'fp8' or 'fp8-rowwise'")
    return "rowwise" if precision == "fp8" else precision.removeprefix("fp8-")


def check_dtype(dtype: torch.dtype):
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"teacher_precision: an FP8 teacher needs float16, bfloat16 or float32 inputs, got {dtype}")


# ---- the head -------------------------------------------------------------------------------------


def head(w: torch.Tensor, scaling: str) -> Head:
    """The quantised teacher weight w (V, K) (a tensor or a view of one: its rows [0, V) of a padded
    head, or a rank's slice), made from w's values as they are now (see the module's doc)."""
    with torch.no_grad():
        wq, sw = quantize(w, scaling, rows_to=_ALIGN)
    # scaled_mm's scale_b: (1, Vp) for rowwise; (Kp/128, Vp) contiguous for 1x128 (its transpose is
    # the (Vp, Kp/128) outer-dim-major layout cuBLAS reads)
    return Head(wq, sw.reshape(1, -1) if scaling == "rowwise" else sw.t().contiguous(), w.shape[0], scaling)


def clear_cache() -> int:
    """Deprecated, does nothing: heads are no longer cached (see the module's doc). Returns 0, the
    bytes freed."""
    return 0


def cache_bytes() -> int:
    """Deprecated: heads are no longer cached; always 0."""
    return 0


# ---- quantisation ---------------------------------------------------------------------------------


def _padded(n: int, to: int) -> int:
    return -(-n // to) * to


def quantize(x: torch.Tensor, scaling: str, rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of the rows of x (M, K): q (Mp, Kp) e4m3 with Kp = K rounded up to 16 and Mp = M
    rounded up to `rows_to` (zero rows), scale (Mp, 1) rowwise or (Mp, ceil(Kp/128)) for 1x128, fp32.
    The Triton kernel on CUDA, `quantize_reference` elsewhere."""
    if x.is_cuda:
        from .backends import triton_fp8

        return triton_fp8.quantize(x, scaling, _padded(x.shape[0], rows_to), _padded(x.shape[1], _ALIGN))
    return quantize_reference(x, scaling, rows_to)


def quantize_reference(x: torch.Tensor, scaling: str, rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition of `quantize` in torch ops (the module's doc)."""
    m, k = x.shape
    mp, kp = _padded(m, rows_to), _padded(k, _ALIGN)
    group = kp if scaling == "rowwise" else 128
    padded = torch.zeros(mp, _padded(kp, group), dtype=torch.float32, device=x.device)
    padded[:m, :k] = x
    g = padded.reshape(mp, -1, group)
    amax = torch.where(g.isnan(), float("inf"), g.abs()).amax(-1, keepdim=True).clamp_min(_TINY)
    q = (g * (torch.full_like(amax, E4M3_MAX) / amax)).to(torch.float8_e4m3fn).reshape(mp, -1)[:, :kp]
    return q, (amax * (1.0 / E4M3_MAX)).reshape(mp, -1)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q · scale in fp32 ((M, Kp) and its (M, 1) or (M, groups) scales), for references and tests."""
    groups = scale.shape[1]
    group = q.shape[1] if groups == 1 else 128
    full = torch.zeros(q.shape[0], groups * group, dtype=torch.float32, device=q.device)
    full[:, : q.shape[1]] = q.float()
    return (full.reshape(q.shape[0], groups, group) * scale[:, :, None]).reshape(q.shape[0], -1)[:, : q.shape[1]]


# ---- the GEMM -------------------------------------------------------------------------------------


def linear(x: torch.Tensor, h: Head, bias: torch.Tensor | None) -> torch.Tensor:
    """The teacher logits (R, v) in fp32 (the GEMM's accumulator, as `core.loop.linear` gives them) from
    the FP8 GEMM: x (R, K), bias (v,) or None. The result is a view of (R, Vp) rows when the vocab was
    padded (rows Vp apart)."""
    xq, sx = quantize(x, h.scaling)
    if h.scaling == "1x128":
        sx = sx.t().contiguous().t()  # (R, K/128), outer-dim-major: strides (1, R)
    # scaled_mm fuses a bias only into a narrow output: the fp32 logits take it in one add
    t = torch._scaled_mm(xq, h.q.t(), sx, h.scale, out_dtype=torch.float32)
    if h.q.shape[0] != h.v:
        t = t[:, : h.v]
    if bias is not None:
        t += bias
    return t
