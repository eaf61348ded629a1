"""A call of a public function, as one frozen value: its types and its one parse.

Why a module of its own: every later step (the checks, the plan, the loop, the distributed layer's
exchange) reads a `Call` and never the public keywords; the parse is the one place where they meet it,
and where an error that needs no tensor is raised, before any work.

    Call(spec, student, teacher, options)   the loss spec, the student's tensors (None for
                                            teacher_topk), the teacher in one of its forms, the options
    forms of the teacher: Heads (hidden states and LM head), Logits (dense logits), TopK (sparse top-k
                          targets), TeacherTopK (teacher_topk's: a head whose top-k log-probs are wanted)
    parse(Student, Heads | Logits | TopK, keywords) -> Call;  parse_teacher_topk(TeacherTopK, keywords): the
                          keywords ({keyword: value}) sorted by the one table, `flashkd.core.keywords`
    tensors(call, part), trailing(call, name), with_tensors(call, named)   a call's tensors by part (HEAD,
                          TEACHER_HEAD, ROWS), under their public names (the distributed layer's errors name them)
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from .. import fp8
from ..losses import LABEL_LOSSES, LossSpec, check_ignore_index, loss_parameters
from . import keywords as kw
from .backend import check_backend
from .checks import check_chunk_size, check_num_teachers

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
class Mixture:
    """Several teachers as hidden states and LM heads, their distributions at the temperature mixed per row,
    p = Σ_m w_m softmax(z_m / τ) (`flashkd.teachers`, combine="arithmetic"; `flashkd.core.mixture`). Made
    and checked by `flashkd.teachers` (weights ≥ 0 summing to 1 a row); not sharded."""

    form: ClassVar[str] = "mixture"
    teacher_inputs: tuple  # M of (..., Ht_m)
    teacher_heads: tuple  # M of (Vt_m, Ht_m)
    teacher_biases: tuple  # M of (Vt_m,) or None
    teacher_weights: object  # M floats, or a float tensor (N, M)
    scales: tuple  # M floats: each head's logit scale
    softcaps: tuple  # M floats or None: each head's softcap

    def checked(self, xs, student_input, ws, vocab_size) -> tuple:
        """Its tensors checked as the heads form's and flattened to rows (`flashkd.core.mixture.check`)."""
        from . import mixture

        return mixture.check(xs, student_input, ws, self, vocab_size)


@dataclasses.dataclass(frozen=True)
class Routed:
    """Several teachers as hidden states and LM heads, each row distilled from its own (`flashkd.teachers`,
    combine="routed"; `flashkd.core.mixture`): the rows come grouped by teacher, counts[m] of teacher m in
    turn, and teacher m's hidden states are its own rows only. Made and checked by `flashkd.teachers`."""

    form: ClassVar[str] = "routed"
    teacher_inputs: tuple  # M of (counts[m], Ht_m): each teacher's own rows, in the call's order
    teacher_heads: tuple  # M of (Vt_m, Ht_m)
    teacher_biases: tuple  # M of (Vt_m,) or None
    counts: tuple  # M ints: the rows of each teacher, in turn
    index: torch.Tensor  # (N,) each row's teacher (sorted): DistillStats.per_teacher's split
    scales: tuple  # M floats: each head's logit scale
    softcaps: tuple  # M floats or None: each head's softcap

    def checked(self, xs, student_input, ws, vocab_size) -> tuple:
        """Its tensors checked as the heads form's (`flashkd.core.mixture.check_routed`)."""
        from . import mixture

        return mixture.check_routed(xs, ws, self, vocab_size)


@dataclasses.dataclass(frozen=True)
class TeacherTopK(Heads):
    """teacher_topk's teacher: hidden states and an LM head (Heads' fields) whose top-k log-probs (and ids)
    are wanted, k a row."""

    form: ClassVar[str] = "teacher_topk"
    k: int = 1


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
    """One call of a public function, made by `parse` (or `parse_teacher_topk`; so its options are valid):
    the loss spec, the student's tensors (None for teacher_topk, whose spec holds only the teacher's
    temperature and logit transform), the teacher in one of its forms, and the options. How it is sharded
    over ranks is not the core's: `flashkd.distributed` takes that beside the call."""

    spec: LossSpec
    student: Student | None
    teacher: Heads | Logits | TopK | TeacherTopK | Mixture | Routed
    options: Options = Options()

    @property
    def parts(self) -> tuple:
        """The groups that hold the call's tensors."""
        return (self.teacher,) if self.student is None else (self.student, self.teacher)

    @property
    def sharded_by(self) -> str:
        """The head whose rows are a rank's vocab slice (FSDP)."""
        return "teacher_weight" if self.student is None else "student_weight"


def parse(student: Student | None, teacher: Heads | Logits | TopK | Mixture | None, keywords: dict) -> Call:
    """The Call of a public function's keywords ({keyword: value}, as passed; those of the table's
    PARSED kinds, `flashkd.core.keywords`): its LossSpec (the one place where the public weights' names
    meet LossSpec's fields, checked under the public names first) and its Options, checked, each keyword
    going where the table says. A keyword not given takes LossSpec's or Options' default (a dense teacher:
    no tail, no logit transform of its own to a top-k teacher). The tensors are checked by `check`, on the
    local or the distributed route. student and teacher None: a module's options alone (labels counted as
    given, as the usual forward has them); the Call that comes back holds no tensors."""
    unknown = [name for name in keywords if name not in kw.TABLE or kw.TABLE[name].goes not in kw.PARSED]
    if unknown:
        raise TypeError(f"{unknown[0]}: expected a keyword option of a loss function, got {unknown[0]}="
                        f"{keywords[unknown[0]]!r}")
    kw.run_checks(keywords, late=False)
    options = Options(**kw.sort(keywords, (kw.OPTION,)))
    fields = kw.spec_fields(keywords)
    labels = None if student is None else student.labels
    has_labels = student is None or labels is not None
    w_hard, w_soft = fields["weight_hard"], fields["weight_soft"]
    logged = options.return_soft_hard_loss or options.return_stats
    fields.update(loss_parameters(fields["loss"], kw.sort(keywords, (kw.PARAMETER,))))
    spec = LossSpec(
        **fields,
        want_hard=has_labels and (w_hard != 0.0 or logged),
        # With both weights 0 the soft term is still computed, so the loss and grads are true zeros.
        want_soft=w_soft != 0.0 or logged or not has_labels or w_hard == 0.0,
    )
    if not has_labels and spec.loss in LABEL_LOSSES:
        raise ValueError(f"labels: loss={spec.loss!r} reads each row's target class (labels), got labels=None")
    if not has_labels and w_hard != 0.0:
        raise ValueError(f"weight_hard_loss: expected 0 when labels is None (no targets for the hard loss), got {w_hard!r}")
    check_ignore_index(labels, spec.ignore_index)
    kw.run_checks(keywords, late=True)
    if teacher is not None and teacher.form == "topk":
        check_num_teachers(teacher.teacher_index is not None, teacher.num_teachers, options.return_stats)
    return Call(spec, student, teacher, options)


def parse_teacher_topk(teacher: TeacherTopK, keywords: dict) -> Call:
    """The Call of `flashkd.teacher_topk`'s keywords ({keyword: value}, its PARSED ones), checked where
    they need no tensor (k and vocab_size are checked against the vocab by `flashkd.core.topk`)."""
    # the losses' rule for the temperature: a finite float > 0 (inf would give uniform log-probs); then the
    # teacher's logit transform (LossSpec checks it last)
    spec = LossSpec(**kw.spec_fields(keywords))
    options = Options(**kw.sort(keywords, (kw.OPTION,)))
    check_backend(options.backend)
    check_chunk_size(options.chunk_size)
    fp8.check_precision(options.teacher_precision)
    # their types here, before any work; their ranges against the vocab in `flashkd.core.topk`
    vocab_size = options.vocab_size
    if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)):
        raise ValueError(f"vocab_size: expected an int in [1, V] (V: teacher_weight's vocab), got {vocab_size!r}")
    k = teacher.k
    if isinstance(k, bool) or not isinstance(k, int):
        raise ValueError(f"k: expected an int in [1, V] (V: the vocab size, teacher_weight's rows or vocab_size), "
                         f"got {k!r}")
    return Call(spec, None, teacher, options)


def tensors(call, part: str) -> dict:
    """The tensors of one part (HEAD, TEACHER_HEAD, ROWS) of a call, by their public names, None where
    not given."""
    return group_tensors(call.parts, part)


def group_tensors(groups, part: str) -> dict:
    """The tensors of one part of the groups (Student, a teacher form), by their public names."""
    return {f.name: getattr(group, f.name) for group in groups if group is not None
            for f in dataclasses.fields(group) if f.metadata.get("part") == part}


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
    for role in ("student", "teacher"):
        group = getattr(call, role)
        if group is None:
            continue
        mine = {f.name: named[f.name] for f in dataclasses.fields(group) if f.name in named}
        if mine:
            changes[role] = dataclasses.replace(group, **mine)
    return dataclasses.replace(call, **changes)


