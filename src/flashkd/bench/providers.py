"""The providers: each a `make(workload, inputs)` that returns a zero-argument closure computing the loss.

The closure is all that is timed: it returns a scalar loss whose `.backward()` fills `xs.grad` and
`ws.grad` (for teacher_topk: the (ids, logprobs) pair, run without autograd). Setup (imports,
preallocation) happens in `make`, outside the timed region. A provider that does not cover a
workload raises `Skip` with a one-line reason.

    flashkd   the flashkd function of the workload's form, backend "auto" (the Triton kernels on CUDA; on sm_90
              with nvidia-cutlass-dsl, JSD, TVD and forward KL with grad on the CuTe DSL logits GEMMs):
              fused_linear_distill, fused_linear_distill_logits, fused_linear_distill_topk, teacher_topk
    flashkd-triton  the same on backend "triton" (cuBLAS logits GEMMs wherever "auto" would take CuTe's)
    flashkd-cute  the same on backend "cute" (sm_90 with nvidia-cutlass-dsl; missing elsewhere)
    torch     the naive formula: the full (N, V) student logits, flashkd.losses.row_losses (or
              topk_row_losses), autograd; teacher_topk: full logits, log_softmax in fp32, torch.topk
    liger     Liger-Kernel 0.8.5 chunked losses (jsd, cosine; heads form only), torch.compile'd on CUDA
              as Liger runs them
    trl       TRL's ChunkedDivergenceFunction (trl.kernels.chunked_divergence, TRL >= 1.16, when
              installed), the loss TRL's DistillationTrainer runs: soft-only (weight_hard 0) jsd,
              forward_kl and reverse_kl of the heads form, its per-token divergence averaged as flashkd's
    orda      orda-kernel 0.1.0's fused loss (`orda_kernel.distillation_loss`, when installed): the heads form
              as its SeparateTeacher, dense logits as its PrecomputedTeacher; every divergence it shares with
              flashkd, its parameters mapped to flashkd's (its KL term always carries τ², so its weight is
              divided by τ² here); student CE as the hard term
    floor     the GEMMs alone, no loss math at all: student logits forward, dX and dW backward, plus the
              teacher's share (its logits GEMM, or one read of its dense logits); teacher_topk: its GEMM

PROVIDERS is a plain dict: a test (or a user) adds a provider with `PROVIDERS["name"] = Provider(...)`.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from typing import Callable

import torch

import flashkd
from ..losses import LossSpec, logit_transform, parameter, row_losses, topk_row_losses
from .workloads import Inputs, Workload

LossFn = Callable[[], torch.Tensor]


class Skip(Exception):
    """The provider does not cover this workload (or is not installed); the message says why, in one line."""


@dataclasses.dataclass(frozen=True)
class Provider:
    make: Callable[[Workload, Inputs], LossFn]
    version: Callable[[], str]  # written to the CSV's last column
    has_loss: bool = True  # False: its value is not the operation's result, so it is not held to the reference
    # True: the loss computes its gradients in the forward call (as flashkd and Liger's fused losses do),
    # so its "backward" mode only scales saved gradients and its cost shows in "forward" and "full".
    grads_in_forward: bool = False
    # Why the provider cannot run on this machine at all (its package missing), in one line; None when it can.
    missing: Callable[[], str | None] = lambda: None


def teacher_block(x: Inputs, c: slice = slice(None)):
    """The teacher's part for rows c as the row losses take it: (R, V) logits (heads: Xt[c] @ Wt^T,
    computed here; logits: a view of T[c]), or (ids, logprobs), (R, K) each, for a top-k teacher."""
    if x.ids is not None:
        return x.ids[c], x.lp[c]
    if x.tl is not None:
        return x.tl[c]
    return x.xt[c] @ x.wt.t()


def naive_loss(xs, ws, t, y, spec: LossSpec, count=None) -> torch.Tensor:
    """The loss over full logits, differentiable w.r.t. xs and ws; `count` is the mean's divisor.

    xs (R, Hs), ws (V, Hs), t the teacher's block (see teacher_block), y (R,). count defaults to the
    valid rows of y; the reference passes the global count when it goes block by block.
    """
    s = xs @ ws.t()  # (R, V), input dtype
    row_fn = row_losses if spec.tail is None else topk_row_losses
    soft, hard = row_fn(s, t, y, spec)  # (R,) each, fp32
    if count is None:
        count = (y != spec.ignore_index).sum().clamp_min(1)
    return spec.total(soft.sum(), hard.sum()) / count


def naive_teacher_topk(xt, wt, k: int, temperature: float, softcap: float | None = None):
    """teacher_topk over the full logits: (ids, logprobs), (N, K) int64 and fp32, by decreasing log-prob."""
    logits = xt @ wt.t()  # (N, V), input dtype
    logprobs = torch.log_softmax(logit_transform(logits.float(), 1.0, softcap) / temperature, dim=-1)  # (N, V) fp32
    values, ids = torch.topk(logprobs, k, dim=-1)
    return ids, values


def _flashkd(w: Workload, x: Inputs, backend: str = "auto") -> LossFn:
    if w.form == "teacher_topk":
        return lambda: flashkd.teacher_topk(x.xt, x.wt, w.k, temperature=w.temperature, backend=backend,
                                            teacher_softcap=w.softcap, teacher_precision=w.teacher_precision)
    options = dict(
        loss=w.loss, beta=w.beta if parameter("beta", w.loss) else None, temperature=w.temperature,
        weight_hard_loss=w.weight_hard,
        weight_soft_loss=w.weight_soft, ignore_index=w.ignore_index, backend=backend, student_softcap=w.softcap,
    )
    if w.form == "topk":
        return lambda: flashkd.fused_linear_distill_topk(x.xs, x.ws, x.ids, x.lp, x.y, tail=w.tail, **options)
    options["teacher_softcap"] = w.softcap
    if w.form == "logits":
        return lambda: flashkd.fused_linear_distill_logits(x.xs, x.ws, x.tl, x.y, **options)
    return lambda: flashkd.fused_linear_distill(x.xs, x.ws, x.xt, x.wt, x.y, teacher_precision=w.teacher_precision,
                                                **options)


def _cute_missing() -> str | None:
    from ..backends import cute_gemm

    if not cute_gemm.available():
        return "nvidia-cutlass-dsl is not installed (pip install 'flashkd[cute]')"
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return "backend 'cute' needs an sm_90 GPU"
    return None


def _no_fp8(name: str, w: Workload):
    if w.teacher_precision is not None:
        raise Skip(f"{name} has no FP8 teacher (teacher_precision={w.teacher_precision})")


def _torch(w: Workload, x: Inputs) -> LossFn:
    _no_fp8("torch", w)
    if w.form == "teacher_topk":
        return lambda: naive_teacher_topk(x.xt, x.wt, w.k, w.temperature, w.softcap)
    spec = w.spec()
    return lambda: naive_loss(x.xs, x.ws, teacher_block(x), x.y, spec)


def _liger(w: Workload, x: Inputs) -> LossFn:
    _no_fp8("liger", w)
    if w.form != "heads":
        what = {"logits": "dense-logits teacher", "topk": "top-k teacher", "teacher_topk": "teacher_topk"}[w.form]
        raise Skip(f"liger has no {what} (its distillation losses take the teacher's hidden states and head)")
    if why := _liger_missing():
        raise Skip(why)
    from liger_kernel.chunked_loss import cosine_similarity_loss, jsd_loss
    functions = {
        "jsd": jsd_loss.LigerFusedLinearJSDFunction,
        "cosine": cosine_similarity_loss.LigerFusedLinearCosineSimilarityFunction,
    }
    if w.loss not in functions:
        raise Skip(f"liger has no fused {w.loss} loss (it has {', '.join(functions)})")
    if w.softcap is not None:
        raise Skip("liger's distillation losses have no logit softcap")
    fn = functions[w.loss]
    # Liger's own benchmark runs its chunk function under torch.compile; on CPU compiling would
    # dominate a short run (and needs a C++ toolchain), so it runs eagerly there.
    compiled = x.xs.is_cuda
    # Positional: Function.apply takes no keywords. Chunk size stays Liger's default (1024).
    args = (x.xs, x.ws, x.xt, x.wt, x.y, None, None, w.weight_hard, w.weight_soft, w.beta, w.ignore_index,
            w.temperature, compiled)
    return lambda: fn.apply(*args)


def _trl(w: Workload, x: Inputs) -> LossFn:
    _no_fp8("trl", w)
    if w.form != "heads":
        raise Skip("trl's ChunkedDivergenceFunction takes the teacher's hidden states and head only")
    betas = {"jsd": w.beta, "forward_kl": 0.0, "reverse_kl": 1.0}  # TRL's β: 0 forward KL, 1 reverse KL
    if w.loss not in betas:
        raise Skip(f"trl has no {w.loss} loss (its kernel has jsd, forward_kl, reverse_kl)")
    if w.weight_hard != 0.0:
        raise Skip("trl's kernel computes the soft term only: a soft-only workload needs --weight-hard 0")
    if why := _trl_missing():
        raise Skip(why)
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction
    # flashkd's "mean": the rows whose label is not ignore_index (the mask and count made here, untimed)
    valid = (x.y != w.ignore_index).to(torch.float32)
    scale = w.weight_soft / valid.sum().clamp_min(1)
    # (β, τ, student scale, softcap, teacher scale, softcap): the workload's softcap is both heads'
    args = (x.xs, x.ws, None, x.xt, x.wt[: w.v], None, betas[w.loss], w.temperature, 1.0, w.softcap, 1.0, w.softcap)
    return lambda: (ChunkedDivergenceFunction.apply(*args)[0] * valid).sum() * scale


# flashkd's loss -> orda-kernel's name and (kl_alpha, kl_beta) from flashkd's LossSpec. Its skew losses and skew JS
# weigh the student by β where flashkd's weigh the teacher by α (skew_kl) or β (jsd); its ABKD's α is the student's
# exponent, flashkd's ab_divergence's α the teacher's (tests/test_bench_orda.py holds each off its defaults)
ORDA_LOSSES = {
    "forward_kl": ("forward", lambda s: (None, None)),
    "reverse_kl": ("reverse", lambda s: (None, None)),
    "jeffreys": ("jeffreys", lambda s: (None, None)),
    "triangular": ("triangular", lambda s: (None, None)),
    "jsd": ("skew_js", lambda s: (None, 1.0 - s.beta)),
    "skew_kl": ("skew_forward", lambda s: (None, 1.0 - s.alpha)),
    "skew_reverse_kl": ("skew_reverse", lambda s: (None, s.alpha)),
    "alpha_divergence": ("alpha_divergence", lambda s: (s.alpha, None)),
    "renyi": ("renyi", lambda s: (s.alpha, None)),
    "renyi_reverse": ("renyi_reverse", lambda s: (s.alpha, None)),
    "ab_divergence": ("abkd", lambda s: (s.beta, s.alpha)),
    "dkd": ("dkd", lambda s: (s.alpha, s.beta)),
    "entropy_adaptive": ("entropy_adaptive", lambda s: (None, None)),
}


def orda_options(spec: LossSpec) -> dict:
    """orda_kernel.distillation_loss's keywords for flashkd's loss `spec` (no τ² on the soft term, as flashkd's
    default: orda's KL always carries it, so its weight is divided by τ²)."""
    import orda_kernel

    name, params = ORDA_LOSSES[spec.loss]
    kl_alpha, kl_beta = params(spec)
    gate = None
    if spec.loss == "entropy_adaptive":
        gate = orda_kernel.EntropyGate(spec.gate_min, spec.gate_max, spec.gate_center, spec.gate_width)
    tau = spec.temperature
    return dict(student_ce_weight=spec.weight_hard, teacher_ce_weight=0.0,
                kl_weight=spec.weight_soft * (1.0 if spec.temperature_squared else 1.0 / tau**2), kl_temperature=tau,
                kl_divergence=name, kl_alpha=kl_alpha, kl_beta=kl_beta, entropy_gate=gate,
                ignore_index=spec.ignore_index)


def _orda(w: Workload, x: Inputs) -> LossFn:
    _no_fp8("orda", w)
    if w.form not in ("heads", "logits"):
        raise Skip(f"orda has no {w.form} form here (its teachers: hidden states and head, or dense logits)")
    if w.loss not in ORDA_LOSSES:
        raise Skip(f"orda has no {w.loss} loss")
    if w.softcap is not None:
        raise Skip("orda's loss has no logit softcap")
    if why := _orda_missing():
        raise Skip(why)
    import orda_kernel

    options = orda_options(w.spec())
    teacher = (orda_kernel.SeparateTeacher(x.xt, x.wt[: w.v]) if w.form == "heads"
               else orda_kernel.PrecomputedTeacher(logits=x.tl[:, : w.v]))
    return lambda: orda_kernel.distillation_loss(x.xs, x.ws, x.y, teacher, **options).loss


class Floor(torch.autograd.Function):
    """The GEMMs of a fused distillation step and nothing else: the time no loss can beat.

    Forward: the student's logits and `teacher()`, the teacher's share. Backward: dX and dW from a
    stand-in dL/dS.
    """

    @staticmethod
    def forward(ctx, xs, ws, ds, teacher):
        ctx.save_for_backward(xs, ws, ds)
        s = xs @ ws.t()  # (N, V)
        t = teacher()  # made while s is alive, as a loss needs both: the peak counts both
        del s, t
        return xs.new_zeros(())

    @staticmethod
    def backward(ctx, _grad):
        xs, ws, ds = ctx.saved_tensors
        return ds @ ws, ds.t() @ xs, None, None  # dX (N, Hs), dW (V, Hs)


def _floor(w: Workload, x: Inputs) -> LossFn:
    """heads: 4 GEMMs (both logits, dX, dW). topk: the 3 student GEMMs; its (N, K) targets are too
    small to count. logits: the 3 student GEMMs plus one read of the dense teacher logits (an amax
    over them): a fused loss must read each of those N·V values once, and at N·V·E bytes that read
    is a real share of the time, so the target is "≤ 1.10× its 3-GEMM floor plus one read of the
    teacher logits". teacher_topk: its one GEMM, the teacher's logits (no grad)."""
    if w.form == "teacher_topk":
        return lambda: x.xt @ x.wt.t()
    teacher = {
        "heads": lambda: x.xt @ x.wt.t(),  # (N, V)
        "logits": lambda: x.tl.amax(),
        "topk": lambda: None,
    }[w.form]
    # A stand-in for dL/dS, allocated once outside the timed region (a fused loss writes dS over
    # its logits). Random rather than zero: GPU clocks under load depend on the data multiplied.
    ds = torch.randn(w.n, w.v, device=x.xs.device, dtype=x.xs.dtype) * 1e-3  # (N, V)
    return lambda: Floor.apply(x.xs, x.ws, ds, teacher)


def _liger_missing() -> str | None:
    try:
        import liger_kernel.chunked_loss  # noqa: F401
    except ImportError as e:
        return f"liger-kernel is not importable ({e}); pip install liger-kernel==0.8.5"
    return None


def _trl_missing() -> str | None:
    try:
        import trl.kernels.chunked_divergence  # noqa: F401
    except ImportError as e:
        return f"trl is not importable ({e}); pip install trl==1.16.0"
    return None


def _orda_missing() -> str | None:
    try:
        import orda_kernel  # noqa: F401
    except ImportError as e:
        return f"orda-kernel is not importable ({e}); pip install orda-kernel==0.1.0"
    return None


def _orda_version() -> str:
    try:
        return importlib.metadata.version("orda-kernel")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _liger_version() -> str:
    try:
        return importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _trl_version() -> str:
    try:
        return importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


PROVIDERS: dict[str, Provider] = {
    "flashkd": Provider(_flashkd, lambda: flashkd.__version__, grads_in_forward=True),
    "flashkd-triton": Provider(lambda w, x: _flashkd(w, x, "triton"), lambda: flashkd.__version__,
                               grads_in_forward=True),
    # backend "cute": the CuTe DSL logits GEMMs with the row statistics in their epilogue, where they fit
    "flashkd-cute": Provider(lambda w, x: _flashkd(w, x, "cute"), lambda: flashkd.__version__, grads_in_forward=True,
                             missing=_cute_missing),
    "torch": Provider(_torch, lambda: torch.__version__),
    "liger": Provider(_liger, _liger_version, grads_in_forward=True, missing=_liger_missing),
    # its backward recomputes the logits: gradients are not made in forward
    "trl": Provider(_trl, _trl_version, missing=_trl_missing),
    # its backward (Triton on CUDA) computes the gradients from saved row statistics
    "orda": Provider(_orda, _orda_version, missing=_orda_missing),
    "floor": Provider(_floor, lambda: torch.__version__, has_loss=False),
}
