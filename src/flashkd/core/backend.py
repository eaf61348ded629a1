"""The backend choice: which row backend runs a call (`pick_backend`), whether its logits GEMMs run on
CuTe DSL (`gemm_of`, `cute_fits`), and the row function of a plan (`row_function`), for the whole vocab
or a rank's slice of it.

Why a module of its own: the choice is made once, here, for every route (one process, a vocab slice,
teacher_topk); the distributed layer supplies a `VocabSlice` whose exchanges the sliced row
functions call between a kernel's phases, and chooses nothing itself.
"""

from __future__ import annotations

import functools
import os

import torch

from .. import fp8
from ..backends import torch_rows

def row_function(plan):
    """The row function of the plan's backend and teacher form (see `flashkd.backends`): for the whole
    vocab the backend's own; for a slice (`plan.vocab`) the Triton rows' steps with the statistics they
    yield exchanged over the slice's ranks (`VocabSlice.exchange`), or the torch rows on the slice's
    reductions, each block's (soft, hard) then handed to the slice (`VocabSlice.exchange("rows", ...)`)."""
    form, vocab = plan.form, plan.vocab
    # AKL's head is found over a whole row (`triton_rows.akl_head_keys`): a vocab slice's takes the torch rows
    if plan.backend == "triton" and not (vocab is not None and form != "topk" and plan.spec.kind == "akl"):
        from ..backends import triton_rows, triton_topk

        if vocab is None:
            return triton_topk.topk_rows if form == "topk" else triton_rows.rows

        def rows(s, t, labels, spec, scale, grad, stats=False, *, ds=None):
            if form == "topk":
                steps = triton_topk.sliced_topk_rows(s, t, labels, spec, scale, grad, stats, ds=ds, start=vocab.start,
                                                     total=vocab.total)
            else:
                steps = triton_rows.sliced_rows(s, t, labels, spec, scale, grad, stats, ds=ds, start=vocab.start)
            return vocab.exchange("rows", exchanged(steps, vocab))

        return rows
    fn = torch_rows.topk_rows if form == "topk" else torch_rows.rows
    if vocab is None:
        return fn
    return lambda s, t, labels, spec, scale, grad, stats=False: vocab.exchange(
        "rows", fn(s, t, labels, spec, scale, grad, stats, vocab=vocab))


def exchanged(steps, vocab):
    """The value of a sliced row function's steps (a generator: `triton_rows.sliced_rows`), each statistic
    it yields, (kind, tensor), exchanged over the slice's ranks and sent back in."""
    try:
        asked = next(steps)
        while True:
            asked = steps.send(vocab.exchange(*asked))
    except StopIteration as done:
        return done.value


def cute_fits(plan, xs, ws, bs, teacher, labels: bool, grad: bool) -> bool:
    """Whether this call's logits GEMMs run on CuTe DSL with pass 1's statistics in their epilogue
    (`Plan.gemm` "cute"): teacher heads without biases or an FP8 head, the whole vocab on this rank, a loss
    whose pass 1 takes nothing else (`triton_rows.tiles_fit`), operands the kernel takes
    (`cute_gemm.eligible`). Elsewhere backend "cute" runs as "triton": the same results either way."""
    if plan.gemm != "cute" or plan.form != "heads" or plan.vocab is not None or bs is not None:
        return False
    xt, wt, bt = teacher
    if bt is not None or isinstance(wt, fp8.Head) or xs.shape[0] == 0:
        return False
    from ..backends import cute_gemm, triton_rows

    return (triton_rows.tiles_fit(plan.spec, grad, plan.stats, labels) and cute_gemm.eligible(xs, ws)
            and cute_gemm.eligible(xt, wt) and cute_gemm.n_tiles(ws.shape[0]) <= triton_rows.MAX_TILES)


def check_backend(backend) -> None:
    if backend not in ("auto", "torch", "triton", "cute"):
        raise ValueError(f"backend: expected 'auto', 'torch', 'triton' or 'cute', got {backend!r}")


def pick_backend(backend, x):
    check_backend(backend)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if backend == "auto":
        return "triton" if x.is_cuda and _has_triton() else "torch"
    if backend == "cute":  # the Triton rows, with CuTe DSL logits GEMMs where they fit (`Plan.gemm`)
        from ..backends import cute_gemm

        if not cute_gemm.available():
            raise ValueError("backend: 'cute' was asked for, but nvidia-cutlass-dsl is not installed "
                             "(pip install 'flashkd[cute]')")
        if not _has_triton():
            raise ValueError(f"backend: 'cute' was asked for, but the triton package is not installed ({TRITON_HINT})")
        if not x.is_cuda or torch.cuda.get_device_capability(x.device) != (9, 0):
            where = x.device if not x.is_cuda else f"{x.device} (sm_{''.join(map(str, torch.cuda.get_device_capability(x.device)))})"
            raise ValueError(f"backend: 'cute' needs CUDA tensors on an sm_90 (Hopper) GPU, got tensors on {where}")
        return "torch" if x.dtype == torch.float64 else "triton"
    if backend == "triton":
        if not _has_triton():
            raise ValueError(
                f"backend: 'triton' was asked for, but the triton package is not installed ({TRITON_HINT})")
        if not (x.is_cuda or interpret):
            raise ValueError(
                f"backend: 'triton' needs CUDA tensors (or TRITON_INTERPRET=1), got tensors on {x.device}"
            )
        if interpret and not x.is_cuda and x.dtype != torch.float64 and (why := _interpreter_problem()):
            raise RuntimeError(why)
    # The Triton kernels compute in fp32: fp64 inputs (float64 gradcheck, references) get the torch rows'
    # fp64 math on every backend. Every loss has its dense rows in the kernel (`triton_rows.KERNEL_LOSSES`), a
    # learning teacher's dL/dt too (`triton_rows.rows(..., teacher_grad=True)`).
    return "torch" if x.dtype == torch.float64 else backend


# The losses "auto" runs with the CuTe DSL logits GEMMs where they fit (`_cute_fits`: of these, forward KL
# only with grad): each measured faster than the Triton backend's cuBLAS GEMMs in the same process (JSD at
# every N of the sweep, TVD and forward KL at the seed; Jeffreys, triangular, Amari's α and Rényi at the seed on
# an H100, 1.6-4 %: BENCHMARKS.md, "The CuTe DSL logits GEMM", "AKL's head from one read, ..."). Skew KL, skew reverse
# KL, reverse Rényi, the αβ-divergence and the entropy blend take the same path (the same GEMMs and epilogue
# statistics, the row kernel reading the row twice, `triton_rows.rows(..., tiles=...)`), not timed on their own.
AUTO_CUTE_LOSSES = ("jsd", "tvd", "forward_kl", "skew_kl", "skew_reverse_kl", "jeffreys", "triangular", "alpha_divergence",
                    "renyi", "renyi_reverse", "ab_divergence", "entropy_adaptive")


def gemm_of(call, backend: str, x) -> str:
    """`Plan.gemm`: "cute" where the call's logits GEMMs may run on CuTe DSL (backend "cute", or "auto" for
    teacher heads and a loss of AUTO_CUTE_LOSSES on a GPU that has it), else "cublas"."""
    asked, form, spec = call.options.backend, call.teacher.form, call.spec
    cute = backend == "triton" and (asked == "cute" or (
        asked == "auto" and form == "heads" and spec.kind in AUTO_CUTE_LOSSES and _cute_here(x)))
    return "cute" if cute else "cublas"


def pick(call, x) -> str:
    """The row backend of a call: `pick_backend` of its backend option on x's device and dtype."""
    return pick_backend(call.options.backend, x)


def _cute_here(x) -> bool:
    """Whether "auto" may take the CuTe DSL GEMMs for x: an sm_90 GPU with nvidia-cutlass-dsl installed. The
    first such call imports it (seconds, once a process)."""
    return x.is_cuda and _cute_on(torch.cuda.get_device_capability(x.device))


@functools.cache
def _cute_on(capability) -> bool:  # once a process: the package lookup walks sys.path
    import importlib.util

    if capability != (9, 0) or importlib.util.find_spec("cutlass") is None:  # without importing it
        return False
    from ..backends import cute_gemm

    return cute_gemm.available()


TRITON_HINT = 'pip install -e ".[triton]"'


@functools.cache
def _interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run the kernels in this process, or None. Triton 3.6's fails under
    numpy 2.4 (triton-lang/triton#9171) with an InterpreterError from deep inside the first kernel; said
    here in one line instead, once a process."""
    import re

    import numpy
    import triton

    def minor(v):
        found = re.match(r"(\d+)\.(\d+)", v)
        return (int(found[1]), int(found[2])) if found else (0, 0)

    if minor(numpy.__version__) >= (2, 4) and minor(triton.__version__) <= (3, 6):
        return (f"backend: 'triton' under TRITON_INTERPRET=1: Triton {triton.__version__}'s interpreter fails under "
                f"numpy {numpy.__version__} (triton-lang/triton#9171); pip install \"numpy<2.4\"")
    return None


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


