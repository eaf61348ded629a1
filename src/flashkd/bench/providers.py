"""The providers: each a `make(workload, inputs)` that returns a zero-argument closure computing the loss.

The closure is all that is timed: it returns a scalar loss whose `.backward()` fills `xs.grad` and
`ws.grad`. Setup (imports, preallocation) happens in `make`, outside the timed region. A provider
that does not cover a workload raises `Skip` with a one-line reason.

    flashkd   flashkd.fused_linear_distill, backend "auto" (the Triton row kernel on CUDA)
    torch     the naive formula: both full (N, V) logits, flashkd.losses.row_losses, autograd
    liger     Liger-Kernel 0.8.5 chunked losses (jsd, cosine), torch.compile'd on CUDA as Liger runs them
    floor     the GEMMs alone: both logits forward, dX and dW backward; no loss math at all

PROVIDERS is a plain dict: a test (or a user) adds a provider with `PROVIDERS["name"] = Provider(...)`.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from typing import Callable

import torch

import flashkd
from ..losses import LossSpec, row_losses
from .workloads import Inputs, Workload

LossFn = Callable[[], torch.Tensor]


class Skip(Exception):
    """The provider does not cover this workload (or is not installed); the message says why, in one line."""


@dataclasses.dataclass(frozen=True)
class Provider:
    make: Callable[[Workload, Inputs], LossFn]
    version: Callable[[], str]  # written to the CSV's last column
    has_loss: bool = True  # False: its value is not a loss, so it is not held to the reference


def naive_loss(xs, ws, xt, wt, y, spec: LossSpec, count=None) -> torch.Tensor:
    """The loss over full logits, differentiable w.r.t. xs and ws; `count` is the mean's divisor.

    xs (R, Hs), ws (V, Hs), xt (R, Ht), wt (V, Ht), y (R,). count defaults to the valid rows of y;
    the reference passes the global count when it goes block by block.
    """
    s = xs @ ws.t()  # (R, V), input dtype
    t = xt @ wt.t()  # (R, V), input dtype, no grad (the teacher is a constant)
    soft, hard = row_losses(s, t, y, spec)  # (R,) each, fp32
    if count is None:
        count = (y != spec.ignore_index).sum().clamp_min(1)
    return spec.total(soft.sum(), hard.sum()) / count


def _flashkd(w: Workload, x: Inputs) -> LossFn:
    options = dict(
        loss=w.loss, beta=w.beta, temperature=w.temperature, weight_hard_loss=w.weight_hard,
        weight_soft_loss=w.weight_soft, ignore_index=w.ignore_index, backend="auto",
    )
    return lambda: flashkd.fused_linear_distill(x.xs, x.ws, x.xt, x.wt, x.y, **options)


def _torch(w: Workload, x: Inputs) -> LossFn:
    spec = w.spec()
    return lambda: naive_loss(x.xs, x.ws, x.xt, x.wt, x.y, spec)


def _liger(w: Workload, x: Inputs) -> LossFn:
    try:
        from liger_kernel.chunked_loss import cosine_similarity_loss, jsd_loss
    except ImportError as e:
        raise Skip(f"liger-kernel is not importable ({e}); pip install liger-kernel==0.8.5") from None
    functions = {
        "jsd": jsd_loss.LigerFusedLinearJSDFunction,
        "cosine": cosine_similarity_loss.LigerFusedLinearCosineSimilarityFunction,
    }
    if w.loss not in functions:
        raise Skip(f"liger has no fused {w.loss} loss (it has {', '.join(functions)})")
    fn = functions[w.loss]
    # Liger's own benchmark runs its chunk function under torch.compile; on CPU compiling would
    # dominate a short run (and needs a C++ toolchain), so it runs eagerly there.
    compiled = x.xs.is_cuda
    # Positional: Function.apply takes no keywords. Chunk size stays Liger's default (1024).
    args = (x.xs, x.ws, x.xt, x.wt, x.y, None, None, w.weight_hard, w.weight_soft, w.beta, w.ignore_index,
            w.temperature, compiled)
    return lambda: fn.apply(*args)


class _Floor(torch.autograd.Function):
    """The four GEMMs of a fused distillation step and nothing else: the time no loss can beat."""

    @staticmethod
    def forward(ctx, xs, ws, xt, wt, ds):
        ctx.save_for_backward(xs, ws, ds)
        s = xs @ ws.t()  # (N, V)
        t = xt @ wt.t()  # (N, V), made while s is alive, as a loss needs both: the peak counts both
        del s, t
        return xs.new_zeros(())

    @staticmethod
    def backward(ctx, _grad):
        xs, ws, ds = ctx.saved_tensors
        return ds @ ws, ds.t() @ xs, None, None, None  # dX (N, Hs), dW (V, Hs)


def _floor(w: Workload, x: Inputs) -> LossFn:
    # A stand-in for dL/dS, allocated once outside the timed region (a fused loss writes dS over
    # its logits). Random rather than zero: GPU clocks under load depend on the data multiplied.
    ds = torch.randn(w.n, w.v, device=x.xs.device, dtype=x.xs.dtype) * 1e-3  # (N, V)
    return lambda: _Floor.apply(x.xs, x.ws, x.xt, x.wt, ds)


def _liger_version() -> str:
    try:
        return importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


PROVIDERS: dict[str, Provider] = {
    "flashkd": Provider(_flashkd, lambda: flashkd.__version__),
    "torch": Provider(_torch, lambda: torch.__version__),
    "liger": Provider(_liger, _liger_version),
    "floor": Provider(_floor, lambda: torch.__version__, has_loss=False),
}
