"""The chunk loop: the student's LM head + a distillation loss, chunked over rows, grads computed in forward.

The package's internal API of a loss call (the public functions in `flashkd.distill` make and route it;
`flashkd.distributed` runs it on a vocab slice):

    parse(Student, Heads | Logits | TopK, *, keywords) -> Call
                        the one parse of a public function's keywords (but the sharding ones): a
                        frozen Call of LossSpec, the student's tensors, the teacher's form and tensors,
                        and Options (chunking, backend, precision, checks, what it returns); an error
                        is raised here, where it is found
    check(call) -> Rows the tensors checked and flattened;  check_teacher_values(call, rows, v)
    run(call, rows, vocab=None)                               plan and run (vocab: a rank's VocabSlice)
    compute(call)       check + run, on this process alone
    tensors(call, part) and with_tensors(call, named)   a call's tensors by part (HEAD, TEACHER_HEAD,
                        ROWS), under their public names (the distributed layer's errors name them)

Three input forms of the teacher share one chunk loop:

    fused_linear_distill         teacher hidden states and LM head: T[c] = Xt[c] @ Wt[:V]^T (+ bt[:V])
    fused_linear_distill_logits  precomputed dense teacher logits:  T[c] = teacher_logits[c, :V]
    fused_linear_distill_topk    sparse teacher: (ids, logprobs)[c], K per row (losses.topk_row_losses)

    validate + flatten (..., H) -> (N, H)
    plan: rows per chunk R, and teacher rows at a time Rt <= R, from a memory budget
    for each chunk c of rows:
        S = Xs[c] @ Ws^T (+ bs)                     (R, V) in the input dtype
        for each block b of Rt rows of c:
            T = the teacher's block for b           only when the soft term is wanted
            soft, hard = backend.rows(S[b], T, ...) dL/dS[b] written (rounded to the inputs' dtype)
            a learning teacher (`learns`): dL/dT written over T too, then dXt[b] = dT @ Wt;  dWt += dT^T @ Xt[b];
                                              dbt += Σ_rows dT   (two more GEMMs; losses.LEARNING_LOSSES)
        dXs[c] = dS @ Ws;  dWs += dS^T @ Xs[c] (fp32);  dbs += Σ_rows dS (fp32)
    loss = scale · (w_hard Σ hard + w_soft Σ soft);   backward multiplies the saved grads by grad_output

Logits at fp32 accuracy: S and T of bf16 / fp16 inputs are the GEMMs' fp32 accumulators (`linear`),
never rounded to the inputs' dtype; the loss math reads them in fp32, and dL/dS is rounded once, to
the inputs' dtype, for the dX and dW GEMMs (bf16: 2^-9 relative, as any bf16 gradient GEMM's input).
Dense teacher logits are read as the caller passes them (bf16 ones carry their own rounding).

Extra memory, bytes, beyond the inputs (E = element size of the inputs, L = 4 for bf16 / fp16 inputs,
else E: the logits' element size):
    logits:  R·V·L + Rt·V·L with teacher heads (Rt = R unless the plan splits a chunk's teacher
             logits); R·V·L for dense teacher logits, which are read in place, and for a top-k
             teacher; + R·V·E for dL/dS in the inputs' dtype when L ≠ E and the teacher is top-k (else
             dL/dS takes half of S's own bytes, `triton_rows.grad_view`); + backend temporaries (torch:
             ≈ 6·R·V·4, + R·V·4 with labels; triton: none beyond O(R·K); cute: + 20·R·⌈V/128⌉ for the vocab
             tiles' statistics, 1/26 of R·V·L); + R·Hs·E with labels (the chunk's rows of Xs, ignored rows
             zeroed)
    grads:   N·Hs·E (dXs) + V·Hs·A (dWs accumulator: A = 4 for fp32, A = E when all rows fit one
             chunk or grad_accum_dtype is the weight's dtype), made for the first chunk's dW GEMM,
             once its teacher logits are freed; rounded to V·Hs·E after the loop (no copy when A = E)
    peak:    one chunk   N·Hs·E + max(logits, D)   (D: dL/dS and dW. dL/dS in its own buffer: R·V·E + V·Hs·E;
                         inside S's bytes: min(R·V·L + V·Hs·E, R·V·E + max(R·V·L, V·Hs·E)), as it
                         is moved out of them, freeing S before dW is made, where V·Hs·E > R·V·E)
             chunks      N·Hs·E + max(logits + V·Hs·A,  V·Hs·(A + E))    (second term only when A ≠ E)
             (`peak_bytes`; without dW wanted, V·Hs terms are 0)
    a learning teacher (losses.LEARNING_LOSSES, teacher tensors requiring grad; always the torch rows), on top:
             N·Ht·E (dXt) + V·Ht·A (dWt accumulator; A = E when all rows fit one block) + V·4 (dbt), held for
             the loop, + Rt·V·E for a block's dL/dT rounded to the inputs' dtype when L ≠ E (an upper bound:
             made once the rows' temporaries are freed); no autograd temporaries beyond the loss's own with a
             constant teacher (co_jeffreys: jeffreys' peak; mutual: less). `peak_bytes(..., learning=(Ht, A))`
The default plan (triton) keeps R·V·L + Rt·V·L within 1 GiB, in equal chunks with R = Rt; or, when that
takes more than one chunk and the weight's gradient is wanted, all N rows in one chunk (with teacher
heads, their logits in two blocks of ceil(N/2) rows) if its peak is no higher: its dW is then one
GEMM, with no accumulation. With teacher heads and a dW accumulator, a cost model then weighs each
chunk's accumulator traffic (2·V·Hs·A bytes, read and written) against its GEMMs (2·R·V·(3·Hs + Ht)
FLOPs) at the GPU's FLOPs per byte (`ACCUM_BALANCE`): where the traffic is over `ACCUM_SHARE` of the
GEMMs' time, chunks grow, in whole row tiles, up to `ACCUM_GROWTH` × the budget, until it is not
(`accum_share`). A narrow student under a wide vocab pays it most: Gemma-3's 2560 ← 3840 at V = 262144,
16 chunks of 512 rows → 8 of 1024.
Backward scales the saved grads by grad_output in place (no host sync, no copy); only when the graph
is retained (retain_graph=True, gradcheck) does it return new tensors, another
N·Hs·E + V·Hs·E. Nothing of size N × V is ever allocated. The gradients are first order: a backward
with create_graph=True raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
from typing import ClassVar

import torch

from . import fp8
from .losses import (LABEL_LOSSES, LEARNING_LOSSES, DistillStats, LossSpec, VocabSlice, check_finite_float,
                     check_ignore_index, loss_parameters)
from .backends import torch_rows

# Default memory for one chunk's logits. Bigger chunks make the GEMMs more efficient; past a few
# thousand rows they stop getting faster. The torch backend also keeps fp32 autograd temporaries.
LOGITS_BUDGET = {"triton": 1 << 30, "torch": 512 << 20}
# The cost model of the chunk plan (`accum_share`): an H200's bf16 GEMM rate over its copy bandwidth
# (≈ 700 TFLOP/s over ≈ 4.3 TB/s, as measured there), the share of a chunk's GEMM time its dW
# accumulator's traffic may take before chunks grow, and how far (× LOGITS_BUDGET) they may grow for it.
ACCUM_BALANCE, ACCUM_SHARE, ACCUM_GROWTH = 160.0, 0.15, 2
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
NARROW = (torch.float16, torch.bfloat16)  # inputs whose logits are formed in fp32 (`linear`)


@dataclasses.dataclass(frozen=True)
class Plan:
    spec: LossSpec
    chunk: int
    backend: str
    grad_accum_dtype: torch.dtype
    form: str  # the teacher's input form: "heads" (Xt, Wt, bt), "logits" (T,) or "topk" (ids, logprobs)
    teacher_chunk: int  # rows of teacher logits computed at a time within a chunk (heads only)
    stats: bool = False  # also sum the DistillStats
    vocab: VocabSlice | None = None  # a rank's slice of the vocab (flashkd.distributed.ShardedVocab); None: all of it
    # top-k with teacher_index: DistillStats.per_teacher's (N,) index (−1: no teacher) and its number of teachers
    teacher_index: torch.Tensor | None = dataclasses.field(default=None, compare=False)
    num_teachers: int = 0
    # "cute": the logits GEMMs of teacher heads on CuTe DSL, with pass 1's statistics in their epilogue,
    # and the fp32 dW's chunk GEMMs (`flashkd.backends.cute_gemm`), where `_cute_fits`; else (and "cublas")
    # torch.mm
    gemm: str = "cublas"
    # the teacher learns (`learns`): its heads' tensors are the autograd function's differentiable inputs
    learns: bool = False



# ------------------------------------------------------------------------------------------ the call
# A call's tensors are marked by their part, so that the distributed layer can treat the forms alike
# (their field names are the public keywords, which its errors name): HEAD, the student's head (V rows,
# it gets a gradient); TEACHER_HEAD, the teacher's; ROWS, one per row of the batch (TRAILING: with a
# trailing dim).
HEAD, TEACHER_HEAD, ROWS = "head", "teacher head", "rows"


def tensor_field(part: str, trailing: bool = False, default=dataclasses.MISSING):
    """A call's tensor field, marked with its part."""
    return dataclasses.field(default=default, metadata={"part": part, "trailing": trailing})


@dataclasses.dataclass(frozen=True)
class Student:
    """The student's tensors, as passed."""

    student_input: torch.Tensor = tensor_field(ROWS, trailing=True)  # (..., Hs): the first ROWS field
    student_weight: torch.Tensor = tensor_field(HEAD)  # (V, Hs)
    labels: torch.Tensor | None = tensor_field(ROWS, default=None)  # (...)
    student_bias: torch.Tensor | None = tensor_field(HEAD, default=None)  # (V,)
    row_weight: torch.Tensor | None = tensor_field(ROWS, default=None)  # (...)


@dataclasses.dataclass(frozen=True)
class Heads:
    """The teacher as hidden states and an LM head: its logits made a chunk at a time."""

    form: ClassVar[str] = "heads"
    teacher_input: torch.Tensor = tensor_field(ROWS, trailing=True)  # (..., Ht)
    teacher_weight: torch.Tensor = tensor_field(TEACHER_HEAD)  # (Vt, Ht)
    teacher_bias: torch.Tensor | None = tensor_field(TEACHER_HEAD, default=None)  # (Vt,)


@dataclasses.dataclass(frozen=True)
class Logits:
    """The teacher as precomputed dense logits, read in place."""

    form: ClassVar[str] = "logits"
    teacher_logits: torch.Tensor = tensor_field(ROWS, trailing=True)  # (..., Vt)


@dataclasses.dataclass(frozen=True)
class TopK:
    """A sparse teacher: its top-k ids and log-probs per row."""

    form: ClassVar[str] = "topk"
    teacher_ids: torch.Tensor = tensor_field(ROWS, trailing=True)  # (..., K)
    teacher_logprobs: torch.Tensor = tensor_field(ROWS, trailing=True)  # (..., K)
    teacher_index: torch.Tensor | None = tensor_field(ROWS, default=None)  # (...) each row's teacher, for the stats
    num_teachers: int | None = None


@dataclasses.dataclass(frozen=True)
class Options:
    """How a call runs and what it returns: chunking, backend, precision, checks (`parse` checks them)."""

    chunk_size: int | None = None
    backend: str = "auto"
    grad_accum_dtype: torch.dtype | None = None
    teacher_precision: str | None = None  # teacher heads only
    vocab_size: int | None = None  # a dense teacher (heads, logits): its rows from V on declared padding
    check_labels: bool | None = None
    check_teacher: bool | None = None  # top-k teacher only
    return_soft_hard_loss: bool = False
    return_stats: bool = False


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of a public loss function, made by `parse` (so its options are valid): the loss spec,
    the student's tensors, the teacher in one of the three forms, and the options. How it is sharded
    over ranks is not the core's: `flashkd.distributed` takes that beside the call."""

    sharded_by: ClassVar[str] = "student_weight"  # the head whose rows are a rank's vocab slice (FSDP)
    spec: LossSpec
    student: Student
    teacher: Heads | Logits | TopK
    options: Options = Options()

    @property
    def parts(self) -> tuple:
        """The groups that hold the call's tensors."""
        return self.student, self.teacher


def parse(
    student: Student | None,
    teacher: Heads | Logits | TopK | None,
    *,
    loss: str,
    beta: float | None,  # the losses' parameters (losses.PARAMETERS): None, the loss's default
    alpha: float | None,
    head_mass: float | None,
    gate_min: float | None = None,
    gate_max: float | None = None,
    gate_center: float | None = None,
    gate_width: float | None = None,
    temperature: float,
    weight_hard_loss: float,
    weight_soft_loss: float,
    ignore_index: int,
    reduction: str,
    temperature_squared: bool,
    student_logit_scale: float,
    student_softcap: float | None,
    teacher_logit_scale: float = 1.0,  # a top-k teacher has none: its log-probs are its distribution
    teacher_softcap: float | None = None,
    tail: str | None = None,  # only the top-k form has one
    tail_clamp: float | None = None,
    chunk_size: int | None,
    backend: str,
    grad_accum_dtype: torch.dtype | None,
    teacher_precision: str | None = None,
    vocab_size: int | None = None,
    check_labels: bool | None,
    check_teacher: bool | None = None,
    return_soft_hard_loss: bool,
    return_stats: bool,
) -> Call:
    """The Call of a public function's keywords: its LossSpec (the one place where the public weights'
    names meet LossSpec's fields, checked under the public names first) and its Options, checked. The
    tensors are checked by `check`, on the local or the distributed route. student and teacher None: a
    module's options alone (labels counted as given, as the usual forward has them); the Call that comes
    back holds no tensors."""
    for flag, value, optional in (("return_soft_hard_loss", return_soft_hard_loss, False),
                                  ("return_stats", return_stats, False),
                                  ("temperature_squared", temperature_squared, False),
                                  ("check_labels", check_labels, True), ("check_teacher", check_teacher, True)):
        if not isinstance(value, bool) and not (optional and value is None):
            raise TypeError(f"{flag}: expected a bool{' or None' if optional else ''}, got {value!r}")
    for name, value in (("weight_hard_loss", weight_hard_loss), ("weight_soft_loss", weight_soft_loss)):
        check_finite_float(name, value)
    check_chunk_size(chunk_size)
    check_backend(backend)
    # the dtype alone (a module's options have no weight); `run` checks it against student_weight's
    if grad_accum_dtype is not None and grad_accum_dtype not in FLOATS:
        raise TypeError(f"grad_accum_dtype: expected None or a floating dtype (float16, bfloat16, float32, float64), "
                        f"got {grad_accum_dtype!r}")
    labels = None if student is None else student.labels
    has_labels = student is None or labels is not None
    w_hard, w_soft = weight_hard_loss, weight_soft_loss
    logged = return_soft_hard_loss or return_stats
    spec = LossSpec(
        loss=loss,
        **loss_parameters(loss, dict(beta=beta, alpha=alpha, head_mass=head_mass, gate_min=gate_min, gate_max=gate_max,
                                     gate_center=gate_center, gate_width=gate_width)),
        temperature=temperature,
        weight_hard=w_hard,
        weight_soft=w_soft,
        temperature_squared=temperature_squared,
        ignore_index=ignore_index,
        reduction=reduction,
        want_hard=has_labels and (w_hard != 0.0 or logged),
        # With both weights 0 the soft term is still computed, so the loss and grads are true zeros.
        want_soft=w_soft != 0.0 or logged or not has_labels or w_hard == 0.0,
        tail=tail,
        tail_clamp=tail_clamp,
        student_logit_scale=student_logit_scale,
        student_softcap=student_softcap,
        teacher_logit_scale=teacher_logit_scale,
        teacher_softcap=teacher_softcap,
    )
    if not has_labels and spec.loss in LABEL_LOSSES:
        raise ValueError(f"labels: loss={spec.loss!r} reads each row's target class (labels), got labels=None")
    if not has_labels and w_hard != 0.0:
        raise ValueError(f"weight_hard_loss: expected 0 when labels is None (no hard labels to train on), got {w_hard!r}")
    check_ignore_index(labels, spec.ignore_index)
    fp8.check_precision(teacher_precision)
    if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1):
        raise TypeError(f"vocab_size: expected None or an int >= 1 (the student's vocab size), got {vocab_size!r}")
    options = Options(chunk_size, backend, grad_accum_dtype, teacher_precision, vocab_size, check_labels, check_teacher,
                      return_soft_hard_loss, return_stats)
    return Call(spec, student, teacher, options)


def tensors(call, part: str) -> dict:
    """The tensors of one part (HEAD, TEACHER_HEAD, ROWS) of a call (a Call, or a
    `flashkd.teacher.TopKCall`), by their public names, None where not given."""
    return {f.name: getattr(group, f.name) for group in call.parts for f in dataclasses.fields(group)
            if f.metadata.get("part") == part}


def trailing(call, name: str) -> bool:
    """Whether the call's ROWS tensor `name` has a trailing dim beyond the rows (hidden, vocab or K)."""
    for group in call.parts:
        for f in dataclasses.fields(group):
            if f.name == name:
                return f.metadata["trailing"]
    raise KeyError(name)


def with_tensors(call, named: dict):
    """The call with some of its tensors replaced: named, {public name: tensor}."""
    changes = {}
    for role, group in zip(("student", "teacher"), call.parts) if isinstance(call, Call) else (("teacher", call.teacher),):
        mine = {f.name: named[f.name] for f in dataclasses.fields(group) if f.name in named}
        if mine:
            changes[role] = dataclasses.replace(group, **mine)
    return dataclasses.replace(call, **changes)


@dataclasses.dataclass(frozen=True)
class Rows:
    """A call's tensors checked and flattened to rows: what the chunk loop reads."""

    xs: torch.Tensor  # (N, Hs)
    ws: torch.Tensor  # (V, Hs)
    bs: torch.Tensor | None  # (V,)
    y: torch.Tensor | None  # (N,)
    teacher: tuple  # heads (Xt (N, Ht), Wt[:V], bt[:V]); logits (T[:, :V],); topk (ids, logprobs) (N, K)


def check(call: Call, sliced: bool = False) -> Rows:
    """The call's tensors checked (types, dtypes, devices, shapes) and flattened to rows; sliced: the heads
    are a rank's vocab slice (vocab_size, where a hint names it, is then the whole vocab's)."""
    student, t = call.student, call.teacher
    xs, ws, bs, y = check_student(student.student_input, student.student_weight, student.student_bias, student.labels)
    vocab_size = call.options.vocab_size
    hint = {"keyword": "vocab_size=<the whole vocab's size, not this rank's slice's>"} if sliced else {}
    if isinstance(t, Heads):
        teacher = check_teacher_heads(xs, student.student_input, ws, t.teacher_input, t.teacher_weight, t.teacher_bias,
                                      vocab_size, **hint)
    elif isinstance(t, Logits):
        teacher = (check_teacher_logits(xs, student.student_input, ws, t.teacher_logits, vocab_size, **hint),)
    else:
        teacher = check_teacher_topk(xs, student.student_input, ws, t.teacher_ids, t.teacher_logprobs)
    return Rows(xs, ws, bs, y, teacher)


def check_teacher_values(call: Call, rows: Rows, v) -> None:
    """A top-k teacher's values, as `check_teacher` asks (default: on CPU tensors), against a vocab of
    v ids (an int, or a device tensor, read only when checking)."""
    if not isinstance(call.teacher, TopK):
        return
    check = call.options.check_teacher
    if check if check is not None else rows.xs.device.type == "cpu":
        check_topk_values(*rows.teacher, int(v), call.spec, rows.y)


def compute(call: Call):
    """A call on this process alone (no process group, no DTensor head): checked, planned and run."""
    rows = check(call)
    check_vocab_size(call.options.vocab_size, rows.ws.shape[0])
    check_teacher_values(call, rows, rows.ws.shape[0])
    return run(call, rows)


def check_vocab_size(vocab_size, v) -> None:
    """vocab_size, where given, against the student's vocab v (the group's, for a vocab slice): the
    teacher's rows past it are padding of the same tokenizer only if it is the student's whole vocab."""
    if vocab_size is not None and vocab_size != v:
        raise ValueError(f"vocab_size: expected {v} (the student's vocab: student_weight's rows), got {vocab_size!r}; "
                         "it declares the teacher's rows from there on padding of the student's tokenizer")


def renamed(error: Exception, names: dict) -> Exception:
    """`error` with the argument its message starts with ("name: expected ...") renamed by `names`."""
    field, sep, rest = str(error).partition(":")
    return type(error)(f"{names[field]}{sep}{rest}") if field in names else error



def any_dtensor(*xs) -> bool:
    dtensor = sys.modules.get("torch.distributed.tensor")  # not imported: none can be one
    return dtensor is not None and any(isinstance(x, dtensor.DTensor) for x in xs)



def run(call: Call, rows: Rows, vocab: VocabSlice | None = None):
    """Plan and run a call on its checked rows; the shared tail of the three forms. vocab: a rank's
    slice of the vocab (`flashkd.distributed`); its calls plan their chunks for the group's largest
    slice, `vocab.plan_size`."""
    spec, form, options = call.spec, call.teacher.form, call.options
    xs, ws, bs, y, teacher = rows.xs, rows.ws, rows.bs, rows.y, rows.teacher
    check_labels, grad_accum_dtype = options.check_labels, options.grad_accum_dtype
    if check_labels is None:
        check_labels = xs.device.type == "cpu"
    if check_labels and y is not None:
        check_label_range(y, ws.shape[0] if vocab is None else int(vocab.total), spec.ignore_index)
    wide = torch.promote_types(ws.dtype, torch.float32)
    if grad_accum_dtype is None:
        grad_accum_dtype = wide
    # Only these two: another would round dW to a format it does not have (fp16 for bf16 weights), or
    # ask cuBLAS for an output dtype it does not offer (fp64 from fp32 operands).
    if grad_accum_dtype not in (wide, ws.dtype):
        raise TypeError(f"grad_accum_dtype: expected {wide} or student_weight's dtype {ws.dtype}, got {grad_accum_dtype!r}")
    backend = pick_backend(options.backend, xs, spec.kind if form != "topk" else None)  # top-k: all on Triton
    want_dw = torch.is_grad_enabled() and ws.requires_grad
    accum_bytes = grad_accum_dtype.itemsize if want_dw else 0
    v = ws.shape[0] if vocab is None else vocab.plan_size
    chunk, teacher_chunk = chunk_rows(options.chunk_size, xs, ws, backend, form, accum_bytes, v,
                                      teacher[0].shape[-1] if form == "heads" else 0)
    rw = check_row_weight(call.student.row_weight, xs, call.student.student_input)
    stats = options.return_stats
    learning = learns(call, teacher, vocab)
    if form == "heads" and not learning:  # (a learning teacher with teacher_precision is refused by `learns`)
        teacher = _teacher_head(teacher, options.teacher_precision)
    index, teachers = check_teacher_index(call, rows) if form == "topk" else (None, 0)
    gemm = "cute" if backend == "triton" and (options.backend == "cute" or (
        options.backend == "auto" and form == "heads" and spec.kind in AUTO_CUTE_LOSSES and _cute_here(xs))) else "cublas"
    plan = Plan(spec, chunk, backend, grad_accum_dtype, form, teacher_chunk, stats, vocab, index, teachers, gemm,
                learning)
    loss_, soft, hard, *sums = apply(xs, ws, bs, y, rw, plan, *teacher)
    out = (loss_, soft, hard) if options.return_soft_hard_loss else (loss_,)
    if stats:
        topk = (sums[4], sums[5], sums[6] if index is not None else None) if form == "topk" else (None,)
        out += (DistillStats(*sums[:4], *topk),)
    return out if len(out) > 1 else loss_



def learns(call: Call, teacher: tuple, vocab=None) -> bool:
    """Whether the call's teacher learns: a loss of LEARNING_LOSSES, in grad mode, on teacher tensors of
    which one requires grad; their gradients then come from the same pass as the student's (two more
    GEMMs a block). For every other loss the teacher is a constant, whatever it requires. Where such a
    teacher cannot learn (dense logits, an FP8 head, a vocab slice) the call is refused, not silently
    given a constant teacher."""
    if call.spec.kind not in LEARNING_LOSSES or not torch.is_grad_enabled():
        return False
    if not any(isinstance(x, torch.Tensor) and x.requires_grad for x in teacher):
        return False
    loss = f"loss={call.spec.loss!r}"
    if call.teacher.form == "logits":
        raise ValueError(f"teacher_logits: {loss} gives the teacher a gradient, which the dense-logits form does not "
                         "(its N x V gradient is what the fused losses never hold); got teacher_logits that require "
                         "grad. Pass the teacher's hidden states and head to flashkd.fused_linear_distill, or "
                         "teacher_logits.detach() for a constant teacher")
    if call.options.teacher_precision is not None:
        raise ValueError(f"teacher_precision: expected None with {loss} and a teacher that requires grad (an FP8 "
                         f"head has no gradient), got {call.options.teacher_precision!r}")
    if vocab is not None:
        raise ValueError(f"process_group: {loss} with a teacher that requires grad runs on one process only (its "
                         "gradients over a vocab slice are not summed over the group); detach the teacher's "
                         "tensors, or call without process_group")
    return True


def apply(xs, ws, bs, y, rw, plan, *teacher):
    # One graph break: the chunk loop runs eagerly inside compiled code. Disabled here, while tracing, not by
    # a decorator: torch.compiler.disable imports torch._dynamo (~0.9 s), which `import flashkd` need not pay.
    if torch.compiler.is_compiling():
        return torch.compiler.disable(_apply)(xs, ws, bs, y, rw, plan, *teacher)
    return _apply(xs, ws, bs, y, rw, plan, *teacher)


def _apply(xs, ws, bs, y, rw, plan, *teacher):
    with autocast_off(xs.device):
        if plan.learns or (torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (xs, ws, bs))):
            return _FusedDistill.apply(xs, ws, bs, y, rw, plan, *teacher)
        # Evaluation: no autograd node, and no gradient work at all. The teacher is a constant: without
        # no_grad a teacher that requires grad would get a graph through every chunk's logits (and a grad).
        with torch.no_grad():
            return _chunk_loop(xs, ws, bs, y, rw, teacher, plan, False, False, False)[0]


def autocast_off(device: torch.device):
    """torch.autocast switched off on `device`: the GEMMs run in the inputs' dtype, which the checks
    made one, and write into buffers of it (autocast would make their logits bf16 from fp32 inputs,
    and fail on the fp32 dX written in place). To compute in autocast's dtype, pass tensors of it."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


_NO_DOUBLE_BACKWARD = ("flashkd: a fused distillation loss computes its gradients in its forward pass, so they carry "
                       "no graph: backward with create_graph=True (double backward, a gradient penalty, "
                       "gradgradcheck) is not supported; take second-order terms from the unfused logits")


def _first_order_only(backward):
    """A backward that refuses create_graph=True. torch's once_differentiable marks the gradients as not
    differentiable only when grad_output requires grad: with a plain seed they came back as constants,
    and a term built on them (a gradient penalty) silently added nothing to the gradients. Giving them
    a graph that raises when reached would need the inputs saved for backward (N·Hs·E more bytes)."""

    @functools.wraps(backward)
    def wrapper(ctx, *grad_outputs):
        if torch.is_grad_enabled():  # autograd runs a backward with grad mode on only for create_graph=True
            raise RuntimeError(_NO_DOUBLE_BACKWARD)
        return backward(ctx, *grad_outputs)

    return wrapper


class _FusedDistill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xs, ws, bs, y, rw, plan: Plan, *teacher):
        want_dx, want_dw, want_db = ctx.needs_input_grad[:3]
        # A learning teacher's (xt, wt, bt) get gradients as the student's do; any other teacher is a constant
        # (None below, whatever it requires). A head passed as both (self-distillation) is two inputs here:
        # autograd sums their gradients, the teacher's None adding nothing.
        want_teacher = ctx.needs_input_grad[6:] if plan.learns else (False,) * len(teacher)
        (loss, *logged), *grads = _chunk_loop(xs, ws, bs, y, rw, teacher, plan, want_dx, want_dw, want_db,
                                              want_teacher)
        ctx.save_for_backward(*grads)
        ctx.num_teacher = len(teacher)
        ctx.backend = plan.backend
        ctx.mark_non_differentiable(*logged)
        return loss, *logged

    @staticmethod
    @_first_order_only
    def backward(ctx, grad_loss, *_grad_logged):
        # grad_loss is a 0-d device tensor: scaling by it needs no host sync, whatever its value. The
        # saved grads are ours alone and freed after this call unless the graph is kept for another
        # backward: only then must they stay unscaled, and the scaled grads be new tensors. grad_loss
        # (fp32) enters the product as it is, multiplied in fp32 and rounded once: cast to bf16 first, a
        # loss divided by a token count (1/3 → 0.333984) would scale every bf16 gradient up to 0.4 % off.
        keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", lambda: True)()
        if keep:
            grads = tuple(None if g is None else g * grad_loss for g in ctx.saved_tensors)
        elif ctx.backend == "triton":
            from .backends import triton_rows

            grads = tuple(None if g is None else triton_rows.scale_(g, grad_loss) for g in ctx.saved_tensors)
        else:
            grads = tuple(None if g is None else g.mul_(grad_loss) for g in ctx.saved_tensors)
        return (*grads[:3], None, None, None, *grads[3:], *(None,) * (ctx.num_teacher - len(grads[3:])))


def _chunk_loop(xs, ws, bs, y, rw, teacher, plan: Plan, want_dx, want_dw, want_db, want_teacher=()):
    """((loss, soft, hard, *sums of DistillStats when plan.stats), dxs, dws, dbs), and dxt, dwt, dbt after
    them where want_teacher (a learning teacher's three) asks for any."""
    spec = plan.spec
    n, v = xs.shape[0], ws.shape[0]
    rows = _rows(plan)
    want_dxt, want_dwt, want_dbt = tuple(want_teacher) + (False,) * (3 - len(want_teacher))
    teacher_grad = any(want_teacher)
    # dL/dt from the rows, where there is a soft term (else the teacher's gradient is 0)
    learn = teacher_grad and spec.want_soft
    grad = want_dx or want_dw or want_db or learn
    device = xs.device
    # Loss math and accumulators in fp32, or fp64 for fp64 inputs (which float64 gradcheck relies on).
    f32 = dict(device=device, dtype=torch.promote_types(xs.dtype, torch.float32))
    if y is None or spec.reduction == "sum":
        scale = torch.full((), 1.0 if spec.reduction == "sum" else 1.0 / max(n, 1), **f32)
    else:
        scale = 1.0 / (y != spec.ignore_index).sum().clamp_min(1).to(f32["dtype"])
    if rw is not None:
        rw = rw.to(f32["dtype"])  # N numbers, read in the loss math's precision
    soft_sum = torch.zeros((), **f32)
    hard_sum = torch.zeros((), **f32)
    entropy_sum = torch.zeros((), **f32)
    mass_sum = torch.zeros((), **f32)
    teacher_entropy_sum = torch.zeros((), **f32)
    per_teacher = torch.zeros(plan.num_teachers, 3, **f32)
    teacher_ids = None if plan.teacher_index is None else torch.arange(plan.num_teachers, device=device)
    dxs = torch.empty_like(xs, memory_format=torch.contiguous_format) if want_dx else None
    # With one chunk there is nothing to accumulate: the GEMM accumulates in fp32 and rounds once either
    # way. dWs is made for the first chunk's GEMM (beta = 0 fills it), after that chunk's teacher logits
    # are freed: one chunk then peaks at max(S + T, S + dWs), not S + T + dWs.
    accum = plan.grad_accum_dtype if n > plan.chunk else ws.dtype
    dws = torch.zeros(ws.shape, device=device, dtype=ws.dtype) if want_dw and n == 0 else None
    dbs = torch.zeros(v, **f32) if want_db else None
    if teacher_grad:  # the learning teacher's [dxt, dwt, dbt], as the student's (`learns`); 0 without dL/dt
        xt, wt, bt = teacher
        new, filled = (torch.empty, True) if learn and n else (torch.zeros, False)  # filled by the blocks' GEMMs
        accum_t = plan.grad_accum_dtype if n > plan.teacher_chunk and filled else wt.dtype
        learner = (new(xt.shape, device=device, dtype=xt.dtype) if want_dxt else None,
                   new(wt.shape, device=device, dtype=accum_t) if want_dwt else None,
                   torch.zeros(v, **f32) if want_dbt else None)
    cute = _cute_fits(plan, xs, ws, bs, teacher, y is not None, grad)
    if cute:
        from .backends import cute_gemm, triton_rows

        k_s, k_ce, k_t = triton_rows.tile_constants(spec, y is not None)
        s_planes = 2 if k_ce is None else 3
    for start in range(0, n, plan.chunk):
        c = slice(start, min(start + plan.chunk, n))
        # Ignored rows (padding) may hold NaN or inf: zeroed, they cannot reach dW = dSᵀX as 0 · NaN, nor
        # dS through a NaN logit. One select over R·Hs elements and R·Hs·E bytes a chunk (1/V of its
        # GEMM), on the device: no host sync.
        x = xs[c] if y is None else torch.where((y[c] != spec.ignore_index)[:, None], xs[c], 0.0)
        if cute:  # (5, R, vocab tiles): each tile's m_s, l_s, l_c, m_t, l_t (`triton_rows.rows(..., tiles=)`)
            tiles = torch.empty(5, c.stop - c.start, cute_gemm.n_tiles(v), device=device)
            s = cute_gemm.logits(x, ws, tiles[:s_planes], k_s, k_ce)
        else:
            tiles = None
            s = linear(x, ws, bs)
        # fp32 logits of narrow inputs: the Triton rows write dL/ds once, rounded for the gradient GEMMs,
        # into half of s's own bytes (`triton_rows.grad_view`; a top-k teacher's kernel into a buffer of the
        # inputs' dtype); the torch rows write it over s, rounded below
        narrow = grad and s.dtype != ws.dtype
        ds, in_s = None, narrow and plan.backend == "triton" and plan.form != "topk"
        if in_s:
            from .backends import triton_rows

            ds = triton_rows.grad_view(s, ws.dtype, spec, grad)
        elif narrow and plan.backend == "triton":
            ds = torch.empty(s.shape, device=device, dtype=ws.dtype)
        for sub in range(c.start, c.stop, plan.teacher_chunk):
            b = slice(sub, min(sub + plan.teacher_chunk, c.stop))
            in_c = slice(b.start - c.start, b.stop - c.start)
            if tiles is None:
                t = _teacher_block(plan.form, teacher, b) if spec.want_soft else None
            else:
                t = cute_gemm.logits(teacher[0][b], teacher[1], tiles[3:, in_c], k_t)
            s_b = s[in_c]  # rows of s: contiguous
            row_scale = scale if rw is None else scale * rw[b]
            out = {} if ds is None else {"ds": ds[in_c]}
            if tiles is not None:
                out["tiles"] = tiles[:, in_c]
            if learn:
                out["teacher_grad"] = True  # dL/dt written over t (`torch_rows.rows`)
            soft, hard, *extra = rows(s_b, t, None if y is None else y[b], spec, row_scale, grad, plan.stats, **out)
            if learn:
                _teacher_gemms(learner, t, xt, wt, b, None if y is None else y[b] != spec.ignore_index)
            if rw is not None:
                soft, hard = soft * rw[b], hard * rw[b]
            soft_sum += soft.sum()
            hard_sum += hard.sum()
            if plan.stats:
                entropy_sum += extra[0].sum()
                if len(extra) > 1:
                    mass_sum += extra[1].sum()
                    teacher_entropy_sum += extra[2].sum()
                if teacher_ids is not None:
                    counted = torch.ones_like(soft) if y is None else (y[b] != spec.ignore_index).to(soft.dtype)
                    # (R, T) one-hot: an index outside [0, T) is in no teacher's sums (and no device assert);
                    # a select, not a product, so that one row's NaN stays in its own teacher's sums
                    of = plan.teacher_index[b, None] == teacher_ids
                    per_teacher += torch.where(of[:, :, None], torch.stack([counted, soft, extra[2]], 1)[:, None], 0.0).sum(0)
            del t, s_b, out  # a view left alive would keep this chunk's logits (or dL/ds) past `del s`
        if narrow:
            if ds is None:
                s = s.to(ws.dtype)
            elif in_s and want_dw and n <= plan.chunk and ws.shape[1] > c.stop - c.start:
                # one chunk whose dW (V·Hs) outweighs its dL/ds (R·V): dL/ds moved out of s's bytes, so that
                # s is freed before dWs is made (`peak_bytes`)
                s = ds.contiguous()
            else:
                s = ds
        del ds, tiles
        if want_dx:
            torch.mm(s, ws, out=dxs[c])
            if plan.vocab is not None:
                plan.vocab.chunk_dx(dxs[c])
        if want_dw:
            if start == 0:
                dws = torch.empty(ws.shape, device=device, dtype=accum)
            if cute and cute_gemm.accumulate_eligible(dws, s.t(), x.t()):
                # added by the TMA unit's reduce-add stores: no warpgroup waits on a read of the fp32 dWs
                cute_gemm.accumulate(dws, s.t(), x.t(), add=start != 0)
            else:
                accumulate_mm(dws, s.t(), x, beta=0.0 if start == 0 else 1.0)
        if want_db:
            dbs += s.sum(0, dtype=dbs.dtype)
        del s, x  # before the next chunk's GEMM allocates, and before dWs is cast below
    soft_total = soft_sum * scale * (spec.temperature**2 if spec.temperature_squared else 1.0)
    hard_total = hard_sum * scale
    loss = spec.total(soft_sum, hard_sum) * scale
    if plan.vocab is not None:
        dxs, dws, dbs = plan.vocab.finish(dxs, dws, dbs)
    if dws is not None:
        dws = dws.to(ws.dtype)
    if dbs is not None:
        dbs = dbs.to(bs.dtype)
    logged = (loss, soft_total, hard_total)
    if plan.stats:
        count = torch.full((), n, device=device) if y is None else (y != spec.ignore_index).sum()
        logged += (soft_sum, hard_sum, count, entropy_sum, mass_sum, teacher_entropy_sum, per_teacher)
    if not teacher_grad:
        return logged, dxs, dws, dbs
    dxt, dwt, dbt = learner
    return logged, dxs, dws, dbs, dxt, None if dwt is None else dwt.to(wt.dtype), None if dbt is None else dbt.to(bt.dtype)


def _teacher_gemms(grads, t, xt, wt, b: slice, counted) -> None:
    """A learning teacher's block b, as the student's chunk: t holds dL/dt (`torch_rows.rows`), and
    dXt[b] = dT Wt, dWt += dTᵀ Xt[b] (its accumulator written, not read, at the first block), dbt += Σ_rows
    dT, into grads = (dxt, dwt, dbt) (None: not wanted). counted: the block's rows whose label is not ignored."""
    dxt, dwt, dbt = grads
    dt = t.to(wt.dtype)  # rounded once to the inputs' dtype for the GEMMs, as dL/ds is
    if dxt is not None:
        torch.mm(dt, wt, out=dxt[b])
    if dwt is not None:
        # ignored rows' dT is 0, and their hidden states zeroed, as the student's: no 0 · NaN in dWt
        x = xt[b] if counted is None else torch.where(counted[:, None], xt[b], 0.0)
        accumulate_mm(dwt, dt.t(), x, beta=0.0 if b.start == 0 else 1.0)
    if dbt is not None:
        dbt += t.sum(0, dtype=dbt.dtype)


def _rows(plan: Plan):
    """The backend's row function for the plan's teacher form (see `flashkd.backends`)."""
    if plan.vocab is not None:
        return plan.vocab.rows(plan.form, plan.backend)
    if plan.backend == "triton":
        from .backends import triton_rows, triton_topk

        return triton_topk.topk_rows if plan.form == "topk" else triton_rows.rows
    return torch_rows.topk_rows if plan.form == "topk" else torch_rows.rows


def _cute_fits(plan: Plan, xs, ws, bs, teacher, labels: bool, grad: bool) -> bool:
    """Whether this call's logits GEMMs run on CuTe DSL with pass 1's statistics in their epilogue
    (`Plan.gemm` "cute"): teacher heads without biases or an FP8 head, the whole vocab on this rank, a loss
    whose pass 1 takes nothing else (`triton_rows.tiles_fit`), operands the kernel takes
    (`cute_gemm.eligible`). Elsewhere backend "cute" runs as "triton": the same results either way."""
    if plan.gemm != "cute" or plan.form != "heads" or plan.vocab is not None or bs is not None:
        return False
    xt, wt, bt = teacher
    if bt is not None or isinstance(wt, fp8.Head) or xs.shape[0] == 0:
        return False
    from .backends import cute_gemm, triton_rows

    return (triton_rows.tiles_fit(plan.spec, grad, plan.stats, labels) and cute_gemm.eligible(xs, ws)
            and cute_gemm.eligible(xt, wt) and cute_gemm.n_tiles(ws.shape[0]) <= triton_rows.MAX_TILES)


def _teacher_head(teacher, precision):
    """(xt, wt, bt) with wt the FP8 head (quantised now) of teacher_precision "fp8...", else as it came."""
    xt, wt, bt = teacher
    scaling = fp8.scaling_of(precision, xt.device)
    if scaling is None:
        return teacher
    fp8.check_dtype(xt.dtype)
    return xt, fp8.head(wt, scaling), bt


def _teacher_block(form, teacher, c):
    if form == "heads":
        xt, wt, bt = teacher
        if isinstance(wt, fp8.Head):
            return fp8.linear(xt[c], wt, bt)
        return linear(xt[c], wt, bt)
    if form == "logits":
        return teacher[0][c]
    ids, lp = teacher
    return ids[c], lp[c]


def linear(x, w, b):
    """x @ w^T (+ b) at fp32 accuracy: fp32 for bf16 / fp16 operands (the GEMM's fp32 accumulator, not
    its rounding to the inputs' dtype), else in their dtype. A trained head's logits reach 20-40, where
    bf16's ulp is 1/8: a logit stored in bf16 moves a top token's probability by up to ~6 %."""
    if x.dtype not in NARROW:
        return x @ w.t() if b is None else torch.addmm(b, x, w.t())
    if x.is_cuda:  # cuBLAS writes its fp32 accumulator: 1.05-1.1x the narrow output's time (BENCHMARKS.md)
        z = torch.mm(x, w.t(), out_dtype=torch.float32)
    else:  # the CPU GEMM has no fp32 output for narrow operands: exact products, fp32 sums
        z = x.float() @ w.float().t()
    return z if b is None else z.add_(b)


def logit_size(dtype: torch.dtype) -> int:
    """Bytes of a logit (`linear`): fp32 for narrow inputs, else the inputs' element size."""
    return max(dtype.itemsize, 4)


def accumulate_mm(acc, a, b, beta):
    """acc = beta · acc + a @ b, accumulated in acc's dtype (fp32 for bf16 operands on CUDA).
    beta = 0 on the first chunk: acc is then never read, so it needs no zero-fill."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b, beta=beta)
    elif acc.is_cuda:
        torch.addmm(acc, a, b, beta=beta, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype), beta=beta)


def check_backend(backend) -> None:
    if backend not in ("auto", "torch", "triton", "cute"):
        raise ValueError(f"backend: expected 'auto', 'torch', 'triton' or 'cute', got {backend!r}")


def check_chunk_size(chunk_size) -> None:
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size: expected a positive int or None, got {chunk_size!r}")


def pick_backend(backend, x, loss=None):
    check_backend(backend)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if backend == "auto":
        return "triton" if x.is_cuda and _has_triton() and loss not in TORCH_ROW_LOSSES else "torch"
    if backend == "cute":  # the Triton rows, with CuTe DSL logits GEMMs where they fit (`Plan.gemm`)
        from .backends import cute_gemm

        if not cute_gemm.available():
            raise ValueError("backend: 'cute' was asked for, but nvidia-cutlass-dsl is not installed "
                             "(pip install 'flashkd[cute]')")
        if not _has_triton():
            raise ValueError(f"backend: 'cute' was asked for, but the triton package is not installed ({TRITON_HINT})")
        if not x.is_cuda or torch.cuda.get_device_capability(x.device) != (9, 0):
            where = x.device if not x.is_cuda else f"{x.device} (sm_{''.join(map(str, torch.cuda.get_device_capability(x.device)))})"
            raise ValueError(f"backend: 'cute' needs CUDA tensors on an sm_90 (Hopper) GPU, got tensors on {where}")
        return "torch" if x.dtype == torch.float64 or loss in TORCH_ROW_LOSSES else "triton"
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
    # fp64 math on every backend; so do the losses without a dense Triton kernel (TORCH_ROW_LOSSES, given as
    # `loss` where the rows are dense).
    return "torch" if x.dtype == torch.float64 or loss in TORCH_ROW_LOSSES else backend


# The losses whose dense rows have no Triton kernel (`triton_rows.KERNEL_LOSSES` are the others): every
# backend runs them on the torch rows. AKL's head needs an order of the row's p (`losses.akl_head`); the
# entropy-gated blend and DKD have no kernel yet (docs/divergences.md); a learning teacher's (LEARNING_LOSSES)
# dL/dt is autograd's on the torch rows, beside dL/ds.
TORCH_ROW_LOSSES = ("akl", "entropy_adaptive", "dkd", *LEARNING_LOSSES)


# The losses "auto" runs with the CuTe DSL logits GEMMs where they fit (`_cute_fits`: of these, forward KL
# only with grad): each measured faster than the Triton backend's cuBLAS GEMMs in the same process (JSD at
# every N of the sweep, TVD and forward KL at the seed; BENCHMARKS.md, "The CuTe DSL logits GEMM"). Skew KL
# and skew reverse KL take JSD's path whole: the same GEMMs and epilogue statistics, the same row kernel
# reading the row twice (`triton_rows.rows(..., tiles=...)`), their passes JSD's bytes (not timed on their own).
AUTO_CUTE_LOSSES = ("jsd", "tvd", "forward_kl", "skew_kl", "skew_reverse_kl")


def _cute_here(x) -> bool:
    """Whether "auto" may take the CuTe DSL GEMMs for x: an sm_90 GPU with nvidia-cutlass-dsl installed. The
    first such call imports it (seconds, once a process)."""
    return x.is_cuda and _cute_on(torch.cuda.get_device_capability(x.device))


@functools.cache
def _cute_on(capability) -> bool:  # once a process: the package lookup walks sys.path
    import importlib.util

    if capability != (9, 0) or importlib.util.find_spec("cutlass") is None:  # without importing it
        return False
    from .backends import cute_gemm

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


def chunk_rows(chunk_size, xs, ws, backend, form, accum_bytes, v=None, teacher_hidden=0) -> tuple[int, int]:
    """(rows per chunk, teacher rows at a time): chunk_size for both, or the plan in the module's doc.
    accum_bytes: element size of the dW accumulator; 0 when dW is not wanted. v: the vocab rows to
    plan for (the weight's, or the largest slice of a vocab-parallel group). teacher_hidden: Ht of a
    teacher head, for the cost model (0: not weighed, the budget's plan)."""
    n, hs = xs.shape[0], ws.shape[1]
    v = ws.shape[0] if v is None else v
    if chunk_size is not None:  # checked by parse
        rows = min(chunk_size, max(n, 1))
        return rows, rows
    row = v * logit_size(xs.dtype)  # one row of logits
    blocks = 2 if form == "heads" else 1
    budget = LOGITS_BUDGET[backend]
    if backend == "torch":
        rows = even_chunks(n, budget // (row * blocks + v * 4 * 6))
        return rows, rows
    rows = even_chunks(n, budget // (row * blocks))
    if rows < n and accum_bytes:
        # One chunk needs no dW accumulator (its GEMM rounds once, into dW's dtype): taken when that
        # makes the peak no higher.
        teacher = -(-n // 2) if form == "heads" else n
        peak = functools.partial(peak_bytes, n, v, hs, xs.element_size(), form=form, accum_bytes=accum_bytes)
        if peak(n, teacher) <= peak(rows, rows):
            return n, teacher
    if rows < n and accum_bytes and form == "heads" and teacher_hidden:
        share = accum_share(rows, v, hs, teacher_hidden, accum_bytes)
        # fewer, larger chunks: the rows that bring the share to ACCUM_SHARE, and in whole row tiles either
        # way (on an H200, Gemma-3 4B <- 12B: 9 chunks of 911 rows ran no faster than 16 of 512, 8 of 1024
        # took 13% less; Qwen3 chunks of 820 rows 1.42x the floor, of 1024 1.20x), within ACCUM_GROWTH × the budget
        want = rows * share / ACCUM_SHARE if share > ACCUM_SHARE else rows
        cap = ACCUM_GROWTH * (budget // (row * blocks)) // _ROW_TILE * _ROW_TILE
        rows = max(rows, min(-(-int(want) // _ROW_TILE) * _ROW_TILE, cap, n))
    return rows, rows


def accum_share(rows, v, hs, ht, accum_bytes) -> float:
    """A chunk's dW accumulator traffic (2·V·Hs·A bytes: read and written) over its four GEMMs' FLOPs
    (2·R·V·(3·Hs + Ht)), in time at ACCUM_BALANCE FLOPs a byte: the share of the chunk's GEMM time it adds."""
    return 2 * v * hs * accum_bytes * ACCUM_BALANCE / (2 * rows * v * (3 * hs + ht))


def peak_bytes(n, v, hs, e, rows, teacher_rows, *, form, accum_bytes, learning=None) -> int:
    """Peak extra bytes of a plan, as the module's doc gives them (e: bytes of an input element, a
    logit L = max(e, 4) (`logit_size`), accum_bytes: of a dW accumulator element, 0 when dW is not
    wanted; the bias grad's V fp32 left out). Narrow inputs (L ≠ e) hold the chunk's dL/ds in their
    dtype inside its fp32 logits' bytes, or beside them for a top-k teacher. learning: (Ht, A) of a
    learning teacher (`learns`), A the bytes of its dWt accumulator's element (0: dWt not wanted); its
    gradients are held beside everything else, so they add to the peak."""
    if learning:
        ht, accum_t = learning
        held = n * ht * e + v * ht * (accum_t if teacher_rows < n or not accum_t else e)
        rounded = teacher_rows * v * e if max(e, 4) != e else 0
        return held + rounded + peak_bytes(n, v, hs, e, rows, teacher_rows, form=form, accum_bytes=accum_bytes)
    logit = max(e, 4)
    apart = logit != e and form == "topk"  # dL/ds in a buffer of its own (else in s's bytes, or over s)
    logits = rows * v * logit + (teacher_rows * v * logit if form == "heads" else 0) + (rows * v * e if apart else 0)
    dw = v * hs * e if accum_bytes else 0
    if rows >= n:
        ds, s = rows * v * e, rows * v * logit
        return n * hs * e + max(logits, ds + dw if apart else min(s + dw, ds + max(s, dw)))
    acc = v * hs * accum_bytes
    return n * hs * e + max(logits + acc, acc + dw if accum_bytes != e else 0)


# Chunks of a multiple of this many rows fill the GEMMs' row tiles (128 or 256 rows on an H200):
# at N = 8192 with teacher heads, 4 × 2048 rows instead of 3 × 2092 + 1916 (BENCHMARKS.md).
_ROW_TILE = 256


def even_chunks(n: int, fit: int) -> int:
    """Rows per chunk for n rows when at most `fit` fit: as few chunks as fit allows, of equal size,
    rounded up to a multiple of _ROW_TILE where that still fits."""
    if n <= fit:
        return max(n, 1)
    rows = -(-n // -(-n // max(fit, 1)))  # ceil(n / count), count = ceil(n / fit)
    aligned = -(-rows // _ROW_TILE) * _ROW_TILE
    return aligned if aligned <= fit else rows


# The tensor arguments that may be None; every other one named to check_tensors is required.
OPTIONAL_TENSORS = frozenset({"student_bias", "teacher_bias", "labels", "row_weight", "teacher_index"})


def check_tensors(named: dict, dtype=None, device=None, like="student_input"):
    """Type, layout, dtype (when given) and device of tensor arguments, against the tensor `like`; None only
    for those in OPTIONAL_TENSORS."""
    for name, x in named.items():
        if x is None:
            if name in OPTIONAL_TENSORS:
                continue
            raise TypeError(f"{name}: expected a torch.Tensor, got None")
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.layout != torch.strided:  # the kernels and the GEMMs read dense memory
            raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {x.layout}; pass {name}.to_dense()")
        dtensor = sys.modules.get("torch.distributed.tensor")  # not imported: x cannot be one
        if dtensor is not None and isinstance(x, dtensor.DTensor):
            # FSDP2's parameters outside the module's forward: the GEMMs would fail deep inside
            raise TypeError(f"{name}: expected a local torch.Tensor, got a DTensor ({x.placements} over "
                            f"{x.device_mesh}); call where FSDP has gathered it (inside the module's forward), "
                            f"or pass {name}.full_tensor()")
        if dtype is not None and x.dtype != dtype:
            raise TypeError(f"{name}: expected dtype {dtype} (the dtype of {like}), got {x.dtype}")
        if device is not None and x.device != device:
            raise ValueError(f"{name}: expected a tensor on {device} (the device of {like}), got {x.device}")


def check_student(xs, ws, bs, y):
    """The student side and labels, common to every input form; returns them flattened to rows."""
    check_tensors({"student_input": xs})
    if xs.dtype not in FLOATS:
        raise TypeError(f"student_input: expected a floating dtype (float16, bfloat16, float32, float64), got {xs.dtype}")
    check_tensors({"student_weight": ws, "student_bias": bs}, xs.dtype, xs.device)
    check_tensors({"labels": y}, device=xs.device)
    # The dtypes the Triton kernel reads: narrower ones would wrap ignore_index (-100 is 156 in uint8).
    if y is not None and y.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels: expected an integer dtype (torch.int64 or torch.int32), got {y.dtype}")
    if ws.dim() != 2 or 0 in ws.shape:  # an empty vocab or hidden size has no distribution
        raise ValueError(f"student_weight: expected a 2-D (vocab, hidden) tensor, both >= 1, got shape {tuple(ws.shape)}")
    if xs.dim() < 1:
        raise ValueError("student_input: expected a tensor of shape (..., hidden), got a 0-d tensor")
    v, hs = ws.shape
    if xs.shape[-1] != hs:
        raise ValueError(
            f"student_input: expected hidden size {hs} (student_weight is {tuple(ws.shape)}), got {xs.shape[-1]}"
            + _transposed("student_weight", ws, xs, "student_input", "pass the student's last hidden states")
        )
    if y is not None and y.shape != xs.shape[:-1]:
        raise ValueError(f"labels: expected shape {tuple(xs.shape[:-1])} (student_input's leading dims), got {tuple(y.shape)}")
    if bs is not None and bs.shape != (v,):
        raise ValueError(f"student_bias: expected shape ({v},), got {tuple(bs.shape)}")
    return xs.reshape(-1, hs), ws, bs, None if y is None else y.reshape(-1)


def check_row_weight(rw, xs, student_input):
    """row_weight flattened to (N,), or None; its values are checked on CPU only (a host sync)."""
    if rw is None:
        return None
    check_tensors({"row_weight": rw}, device=xs.device)
    if rw.dtype not in FLOATS:
        raise TypeError(f"row_weight: expected a floating dtype (float16, bfloat16, float32, float64), got {rw.dtype}")
    if rw.requires_grad:
        raise TypeError("row_weight: expected a constant tensor (requires_grad=False): no gradient flows to "
                        "it; got one that requires grad (pass row_weight.detach())")
    if rw.shape != student_input.shape[:-1]:
        raise ValueError(f"row_weight: expected shape {tuple(student_input.shape[:-1])} (student_input's leading "
                         f"dims, as labels), got {tuple(rw.shape)}")
    rw = rw.reshape(-1)
    if rw.device.type == "cpu":
        bad = ~torch.isfinite(rw)
        if bad.any():
            raise ValueError(f"row_weight: expected finite values, got {rw[bad][0].item()} in row {int(bad.nonzero()[0, 0])}")
    return rw


def _check_leading(name, x, student_input, trailing):
    if x.dim() < 1:
        raise ValueError(f"{name}: expected a tensor of shape (..., {trailing}), got a 0-d tensor")
    if x.shape[:-1] != student_input.shape[:-1]:
        raise ValueError(
            f"{name}: expected leading dims {tuple(student_input.shape[:-1])} (those of student_input), "
            f"got {tuple(x.shape[:-1])}"
        )


def check_teacher_vocab(name, vt, v, vocab_size, what="rows", keyword="vocab_size={v}"):
    """A dense teacher's vocab vt against the student's v: equal, or larger and declared a padded head of
    the student's tokenizer by vocab_size (checked against v by `check_vocab_size`). A larger one is not
    taken as padding unannounced: a teacher with another tokenizer would train on mismatched ids."""
    if vt < v:
        raise ValueError(
            f"{name}: expected {v} {what} (the student's vocab), got {vt}; a teacher vocab smaller than the "
            "student's is not a padded head of the same tokenizer"
        )
    if vt > v and vocab_size is None:
        raise ValueError(
            f"{name}: expected {v} {what} (the student's vocab), got {vt}: ambiguous. If the teacher's head is "
            f"the student's tokenizer padded to {vt} {what}, pass {keyword.format(v=v)} (its {what} from {v} on are "
            "dropped); a teacher with another tokenizer needs its head's rows gathered into the student's "
            "vocab order first: flashkd.token_map(student_tokenizer, teacher_tokenizer).teacher_head(...)"
        )


def _transposed(name, w, x, input_name, logits_hint) -> str:
    """The likelier culprit when x's last dim is w's first: logits passed for hidden states where w
    reads as (vocab, hidden) (a vocab outnumbers a hidden size), else a head passed as (hidden, vocab)."""
    if x.shape[-1] != w.shape[0]:
        return ""
    if w.shape[0] > w.shape[1]:
        return f"; {input_name} looks like logits (its last dim is {name}'s vocab): {logits_hint}"
    return (f"; {name} looks transposed: a head is (vocab, hidden), as nn.Linear(hidden, vocab).weight is, "
            f"so pass {name}.T, of shape {tuple(w.shape[::-1])}")


def check_teacher_heads(xs, student_input, ws, xt, wt, bt, vocab_size=None, keyword="vocab_size={v}"):
    check_tensors({"teacher_input": xt, "teacher_weight": wt, "teacher_bias": bt}, xs.dtype, xs.device)
    if wt.dim() != 2 or 0 in wt.shape:  # an empty vocab or hidden size has no distribution
        raise ValueError(f"teacher_weight: expected a 2-D (vocab, hidden) tensor, both >= 1, got shape {tuple(wt.shape)}")
    _check_leading("teacher_input", xt, student_input, "hidden")
    v = ws.shape[0]
    vt, ht = wt.shape
    if xt.shape[-1] != ht:
        raise ValueError(
            f"teacher_input: expected hidden size {ht} (teacher_weight is {tuple(wt.shape)}), got {xt.shape[-1]}"
            + _transposed("teacher_weight", wt, xt, "teacher_input", "pass teacher logits to "
                          "flashkd.fused_linear_distill_logits(student_input, student_weight, teacher_logits, labels)")
        )
    check_teacher_vocab("teacher_weight", vt, v, vocab_size, keyword=keyword)
    if bt is not None and bt.shape != (vt,):
        raise ValueError(f"teacher_bias: expected shape ({vt},), got {tuple(bt.shape)}")
    # A padded teacher head: its extra ids (>= V) are not tokens of the student's vocab; drop them.
    return xt.reshape(-1, ht), wt[:v], None if bt is None else bt[:v]


def check_teacher_logits(xs, student_input, ws, tl, vocab_size=None, keyword="vocab_size={v}"):
    # fp32 logits of a bf16 / fp16 student are read as passed, as exactly as the student's own
    wide = xs.dtype in NARROW and isinstance(tl, torch.Tensor) and tl.dtype == torch.float32
    check_tensors({"teacher_logits": tl}, None if wide else xs.dtype, xs.device)
    _check_leading("teacher_logits", tl, student_input, "vocab")
    v = ws.shape[0]
    check_teacher_vocab("teacher_logits", tl.shape[-1], v, vocab_size, "columns", keyword)
    try:
        flat = tl.view(-1, tl.shape[-1])
    except RuntimeError:
        raise ValueError(
            f"teacher_logits: expected leading dims that flatten without a copy (e.g. a contiguous tensor), "
            f"got strides {tuple(tl.stride())} for shape {tuple(tl.shape)}"
        ) from None
    return flat[:, :v]  # a padded teacher head's ids >= V are dropped, as for teacher_weight


def check_teacher_topk(xs, student_input, ws, ids, lp):
    check_tensors({"teacher_ids": ids, "teacher_logprobs": lp}, device=xs.device)
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"teacher_ids: expected an integer dtype (torch.int64 or torch.int32), got {ids.dtype}")
    if lp.dtype not in FLOATS:
        raise TypeError(f"teacher_logprobs: expected a floating dtype (float16, bfloat16, float32, float64), got {lp.dtype}")
    _check_leading("teacher_ids", ids, student_input, "k")
    if ids.shape[-1] < 1:
        raise ValueError(f"teacher_ids: expected at least one slot per row (K >= 1), got shape {tuple(ids.shape)}")
    if lp.shape != ids.shape:
        raise ValueError(f"teacher_logprobs: expected shape {tuple(ids.shape)} (that of teacher_ids), got {tuple(lp.shape)}")
    k = ids.shape[-1]
    return ids.reshape(-1, k), lp.reshape(-1, k)


def check_topk_values(ids, lp, v, spec, y):
    """Value checks of a top-k teacher on the rows that count (host syncs: run by default on CPU only);
    rows whose label is ignore_index contribute nothing, whatever they hold. v None: all but the ids'
    range (a vocab-parallel call checks it against the group's vocab, at its exchange)."""
    counted = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device) if y is None else y != spec.ignore_index
    if v is not None:
        bad = ((ids < -1) | (ids >= v)) & counted[:, None]
        if bad.any():
            raise ValueError(f"teacher_ids: expected ids in [0, {v}) or -1 (unused slot), got {ids[bad][0].item()}")
    used = (ids >= 0) & counted[:, None]
    bad = used & ~(lp <= 0)
    if bad.any():
        raise ValueError(
            f"teacher_logprobs: expected log-probabilities <= 0 (not NaN) at used slots, got {lp[bad][0].item()}"
        )
    if spec.tail == "bucket" and spec.tail_clamp is None:  # a clamped tail defines a mass past 1
        # Stored log-probs round (flashkd.data): by up to u·|log p|, u = 2^-11 in float16 and 2^-8 in
        # bfloat16, whose values may arrive widened to float32. Over K slots that lifts Σ p by at most
        # K^u − 1 (+ u for K < 3, + the fp32 rounding of the log-probs themselves): more is not a
        # distribution, which the bucket would silently renormalise (p_rest = 0).
        u = 2.0**-11 if lp.dtype == torch.float16 else 2.0**-8
        tol = ids.shape[-1] ** u - 1.0 + u + 1e-5
        mass = torch.where(used, lp.double().exp(), 0.0).sum(-1)
        if (mass > 1.0 + tol).any():
            row = int((mass > 1.0 + tol).nonzero()[0, 0])
            raise ValueError(
                f"teacher_logprobs: expected probabilities summing to at most 1 over a row's used slots "
                f"(tail='bucket'; tolerance {tol:.2g} for the log-probs' rounding), got {mass[row].item():.6g} in row {row}"
            )
    ordered = torch.where(used, ids, -1 - torch.arange(ids.shape[-1], device=ids.device)).sort(-1).values
    dup = (ordered[:, 1:] == ordered[:, :-1]).any(-1)
    if dup.any():
        row = int(dup.nonzero()[0, 0])
        dups = ordered[row, 1:][ordered[row, 1:] == ordered[row, :-1]]
        raise ValueError(f"teacher_ids: expected distinct ids within a row, got id {dups[0].item()} twice in row {row}")


def check_teacher_index(call: Call, rows: Rows):
    """(teacher_index flattened to (N,), num_teachers) of a top-k call, or (None, 0) without one; its
    values checked on the rows that count with check_teacher (default: on CPU, a host sync elsewhere)."""
    index, count = call.teacher.teacher_index, call.teacher.num_teachers
    if index is None:
        if count is not None:
            raise ValueError(f"num_teachers: expected None without teacher_index (it sizes the per-teacher sums), got {count!r}")
        return None, 0
    xs, y, spec = rows.xs, rows.y, call.spec
    check_tensors({"teacher_index": index}, device=xs.device)
    if index.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"teacher_index: expected an integer dtype (torch.int64 or torch.int32), got {index.dtype}")
    lead = call.student.student_input.shape[:-1]
    if index.shape != lead:
        raise ValueError(f"teacher_index: expected shape {tuple(lead)} (student_input's leading dims, as labels), "
                         f"got {tuple(index.shape)}")
    if isinstance(count, bool) or not isinstance(count, int):
        raise TypeError(f"num_teachers: expected an int with teacher_index, got {count!r}")
    if count < 1:
        raise ValueError(f"num_teachers: expected an int >= 1, got {count!r}")
    if not call.options.return_stats:
        raise ValueError("teacher_index: expected return_stats=True with it (it only splits the statistics by "
                         "teacher; the loss does not depend on it), got return_stats=False")
    index = index.reshape(-1)
    check = call.options.check_teacher
    if check if check is not None else xs.device.type == "cpu":
        bad = (index < -1) | (index >= count)
        if y is not None:
            bad &= y != spec.ignore_index
        if bad.any():
            raise ValueError(f"teacher_index: expected values in [0, {count}) or -1 (no teacher), got "
                             f"{index[bad][0].item()} in row {int(bad.nonzero()[0, 0])}")
    return index, count


def check_label_range(y, v, ignore_index):
    bad = ((y < 0) | (y >= v)) & (y != ignore_index)
    if bad.any():
        first = y[bad][0].item()
        raise ValueError(f"labels: expected values in [0, {v}) or ignore_index={ignore_index}, got {first}")
