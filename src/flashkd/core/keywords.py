"""The public functions' keywords: one table, which every reader of a keyword reads.

Why a module of its own: a keyword is written in its public signature(s), its docstring and here, nowhere
else (tests/test_layers.py counts). The public functions pass their arguments on as they got them
(`flashkd.distill`); the parse (`flashkd.core.call.parse`) sorts them by this table into the call's
groups, the options' check (`flashkd.distill.check_options`, read by the modules and integrations) fills
in the defaults from it, and the ranks of a vocab slice agree on the keywords it marks agreed
(`flashkd.distributed.agreement`).

    TABLE[keyword] = Keyword(default, goes, functions, check, agreed)
        default    the public default (a dict {function: default} where the functions' defaults differ)
        goes       where its value goes: PARAMETER (a loss's own parameter, `losses.PARAMETERS`: LossSpec's
                   field of its name), SPEC (LossSpec's field, `field` where the name differs), OPTION
                   (Options' field), TENSOR (a field of the call's Student or teacher form), SHARDING
                   (Sharding's field, beside the call)
        functions  the public functions that take it
        check      its check that needs no other value, run by the parse in the table's order (`late`:
                   after the loss spec's and the labels' checks; a SHARDING keyword's: before the parse,
                   `flashkd.distill._route`); None: LossSpec's, or the call's
        agreed     whether the ranks of a vocab slice compare it (`agreed(call, sharding)`; a tensor's
                   presence and shape are compared as facts of the checked rows, `distributed.agreement`)
    KEYWORDS[function] = {keyword: default}: a public function's keyword options (its signature's)
    Sharding: the sharding keywords of one call, as passed (`flashkd.distributed` runs them)
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from .. import fp8
from ..losses import PARAMETERS, TAILS, check_finite_float
from .backend import check_backend
from .checks import FLOATS, check_chunk_size

PARAMETER, SPEC, OPTION, TENSOR, SHARDING = "parameter", "spec", "option", "tensor", "sharding"
PARSED = (PARAMETER, SPEC, OPTION)  # what the parse sorts into the call's LossSpec and Options

DENSE, LOGITS, TOPK, TEACHER_TOPK = ("fused_linear_distill", "fused_linear_distill_logits",
                                     "fused_linear_distill_topk", "teacher_topk")
LOSS_FUNCTIONS = (DENSE, LOGITS, TOPK)
_TEACHER_HEADS = (DENSE, LOGITS)  # a teacher whose logits the call transforms (a top-k teacher has none)
_HEADS = (DENSE, TEACHER_TOPK)  # a teacher head the call multiplies


def _flag(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {value!r}")


def _optional_flag(name, value):
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool or None, got {value!r}")


def _accum_dtype(name, value):
    # the dtype alone (a module's options have no weight); `run` checks it against student_weight's
    if value is not None and value not in FLOATS:
        raise TypeError(f"{name}: expected None or a floating dtype (float16, bfloat16, float32, float64), "
                        f"got {value!r}")


def _tail(name, value):
    # LossSpec takes None for a dense teacher: given to the top-k form it ran as "renormalize" and let through
    # the losses a top-k teacher refuses (cosine, dkd, mutual, co_jeffreys)
    if value not in TAILS:
        raise ValueError(f"{name}: expected 'bucket' or 'renormalize', got {value!r}")


def _vocab_size(name, value):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise TypeError(f"{name}: expected None or an int >= 1 (the student's vocab size), got {value!r}")


@dataclasses.dataclass(frozen=True)
class Keyword:
    """One row of TABLE (the module docstring)."""

    default: object
    goes: str
    functions: tuple
    check: Callable | None = None
    late: bool = False
    agreed: bool = True
    field: str | None = None  # LossSpec's name for a SPEC keyword, where it is not the keyword's

    def default_of(self, function: str):
        return self.default[function] if isinstance(self.default, dict) else self.default


# The order is the parse's order of checks (then LossSpec's own), and the ranks' order of agreement.
TABLE = {
    "return_soft_hard_loss": Keyword(False, OPTION, LOSS_FUNCTIONS, _flag),
    "return_stats": Keyword(False, OPTION, LOSS_FUNCTIONS, _flag),
    "temperature_squared": Keyword(False, SPEC, LOSS_FUNCTIONS, _flag),
    "check_labels": Keyword(None, OPTION, LOSS_FUNCTIONS, _optional_flag),
    "check_teacher": Keyword(None, OPTION, (TOPK,), _optional_flag),
    "weight_hard_loss": Keyword({DENSE: 0.5, LOGITS: 0.5, TOPK: 0.0}, SPEC, LOSS_FUNCTIONS, check_finite_float,
                                field="weight_hard"),
    "weight_soft_loss": Keyword({DENSE: 0.5, LOGITS: 0.5, TOPK: 1.0}, SPEC, LOSS_FUNCTIONS, check_finite_float,
                                field="weight_soft"),
    "chunk_size": Keyword(None, OPTION, (*LOSS_FUNCTIONS, TEACHER_TOPK), lambda _, v: check_chunk_size(v)),
    # agreed as the backend each rank picks (`agreement`'s derived facts), not as passed
    "backend": Keyword("auto", OPTION, (*LOSS_FUNCTIONS, TEACHER_TOPK), lambda _, v: check_backend(v), agreed=False),
    "grad_accum_dtype": Keyword(None, OPTION, LOSS_FUNCTIONS, _accum_dtype),
    "loss": Keyword({DENSE: "jsd", LOGITS: "jsd", TOPK: "forward_kl"}, SPEC, LOSS_FUNCTIONS),
    **{name: Keyword(None, PARAMETER, LOSS_FUNCTIONS) for name in PARAMETERS},
    "temperature": Keyword(1.0, SPEC, (*LOSS_FUNCTIONS, TEACHER_TOPK)),
    "ignore_index": Keyword(-100, SPEC, LOSS_FUNCTIONS),
    "reduction": Keyword("mean", SPEC, LOSS_FUNCTIONS),
    "tail": Keyword("bucket", SPEC, (TOPK,), _tail),
    "tail_clamp": Keyword(None, SPEC, (TOPK,)),
    "student_logit_scale": Keyword(1.0, SPEC, LOSS_FUNCTIONS),
    "student_softcap": Keyword(None, SPEC, LOSS_FUNCTIONS),
    "teacher_logit_scale": Keyword(1.0, SPEC, (*_TEACHER_HEADS, TEACHER_TOPK)),
    "teacher_softcap": Keyword(None, SPEC, (*_TEACHER_HEADS, TEACHER_TOPK)),
    "teacher_precision": Keyword(None, OPTION, _HEADS, lambda _, v: fp8.check_precision(v), late=True),
    # teacher_topk checks its own (against the vocab: `flashkd.core.topk`)
    "vocab_size": Keyword(None, OPTION, (*_TEACHER_HEADS, TEACHER_TOPK), _vocab_size, late=True),
    "student_bias": Keyword(None, TENSOR, LOSS_FUNCTIONS, agreed=False),
    "teacher_bias": Keyword(None, TENSOR, _HEADS, agreed=False),
    "row_weight": Keyword(None, TENSOR, LOSS_FUNCTIONS, agreed=False),
    "teacher_index": Keyword(None, TENSOR, (TOPK,), agreed=False),
    "num_teachers": Keyword(None, TENSOR, (TOPK,)),  # it sizes the per-teacher sums: agreed
    "process_group": Keyword(None, SHARDING, (*LOSS_FUNCTIONS, TEACHER_TOPK), agreed=False),
    "vocab_start": Keyword(None, SHARDING, (*LOSS_FUNCTIONS, TEACHER_TOPK), agreed=False),  # the layout's
    # the sharding flags' checks run on every call (`flashkd.distill._route`), with a process group or not
    "check_shards": Keyword(None, SHARDING, (*LOSS_FUNCTIONS, TEACHER_TOPK), _optional_flag),
    # teacher_topk has none: its rows are checked by the exchange alone
    "check_replicas": Keyword(False, SHARDING, LOSS_FUNCTIONS, _flag),
    "fsdp_gather": Keyword("auto", SHARDING, (*LOSS_FUNCTIONS, TEACHER_TOPK)),
}

KEYWORDS = {function: {name: kw.default_of(function) for name, kw in TABLE.items() if function in kw.functions}
            for function in (*LOSS_FUNCTIONS, TEACHER_TOPK)}


# the public function of each teacher form (`flashkd.core.call`): what a call's ranks agree they make
FUNCTION_OF_FORM = {"heads": DENSE, "logits": LOGITS, "topk": TOPK, "teacher_topk": TEACHER_TOPK}


def agreed(call, sharding) -> dict:
    """{keyword: value} of the call's function's keywords that its ranks compare (TABLE's `agreed`), in
    the table's order, as the call holds them (LossSpec's, Options', its groups', the sharding's)."""
    function = FUNCTION_OF_FORM[call.teacher.form]
    holders = {SPEC: call.spec, PARAMETER: call.spec, OPTION: call.options, SHARDING: sharding}
    out = {}
    for name, kw in TABLE.items():
        if function in kw.functions and kw.agreed:
            holder = holders.get(kw.goes) or next(g for g in call.parts if hasattr(g, name))
            out[name] = getattr(holder, kw.field or name)
    return out


def sort(keywords: dict, goes: tuple) -> dict:
    """{keyword: value} of those of `keywords` that go where `goes` says (TABLE's `goes`)."""
    return {name: value for name, value in keywords.items() if name in TABLE and TABLE[name].goes in goes}


def spec_fields(keywords: dict) -> dict:
    """LossSpec's fields of the SPEC and PARAMETER keywords in `keywords`, under LossSpec's names."""
    return {TABLE[name].field or name: value for name, value in sort(keywords, (SPEC, PARAMETER)).items()}


def run_checks(keywords: dict, late: bool) -> None:
    """Each keyword's own check (TABLE's `check`), in the table's order: those before the loss spec's
    (late False) or after the labels' (late True)."""
    for name, kw in TABLE.items():
        if name in keywords and kw.check is not None and kw.late == late:
            kw.check(name, keywords[name])


def group(cls, given: dict):
    """A dataclass of the call (Student, a teacher form, Sharding) made of the arguments in `given` that
    are its fields (by their public names)."""
    return cls(**{f.name: given[f.name] for f in dataclasses.fields(cls) if f.name in given})


@dataclasses.dataclass(frozen=True)
class Sharding:
    """The sharding keywords of one call (`flashkd.distributed`'s docstring says what each does). Their
    types are checked where the call is parsed (`flashkd.distill`, `distributed.sharding.check_keywords`);
    the values that only the group knows (the layout, the same options on every rank) at its exchange
    (`distributed.agreement`)."""

    process_group: object = None  # a torch.distributed.ProcessGroup: vocab-parallel heads
    vocab_start: int | None = None  # the global id of this rank's first vocab row
    check_shards: bool | None = None
    check_replicas: bool = False
    fsdp_gather: str = "auto"  # a DTensor head's route: "auto", "rows" or "heads"

