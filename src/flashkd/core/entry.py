"""The core's one entry: a parsed call run on the whole vocab or on a rank's slice of it.

Why a module of its own: it is the sequence every route runs, in one place, so that the distributed
layer supplies a `VocabSlice` and calls it once, instead of restating the steps:

    check   the tensors (`checks.check`), the backend (`backend.pick`), whether the teacher learns
            (`plan.learns`)
    agree   a slice's ranks exchange what they checked and chose (`VocabSlice.agree`: a failed check
            raised on every rank, the options and the layout agreed, the ids and labels checked against
            the group's vocab); nothing for the whole vocab
    check   what needs the vocab's size (`checks.check_values`)
    plan    `plan.make`
    loop    `loop.run`; teacher_topk's loop is `topk.run`
"""

from __future__ import annotations

from .. import fp8
from ..losses import VocabSlice
from . import backend as backends, checks, loop, plan as plans, topk


def run(call, vocab: VocabSlice | None = None):
    """A call (`flashkd.core.call.Call`, made by `parse` or `parse_teacher_topk`) run to its result. vocab:
    None, the whole vocab on this process; or this rank's `VocabSlice` (`flashkd.distributed`), whose
    `agree` the ranks all reach: a check that fails on one rank is raised on every rank there."""
    form = call.teacher.form
    rows = backend = learning = None
    failed, ranged = None, {}
    try:
        rows = checks.check(call, sliced=vocab is not None)
        backend = backends.pick(call, rows.xs)
        learning = plans.learns(call, rows.teacher, vocab)
        if form in ("heads", "teacher_topk") and not learning and fp8.scaling_of(call.options.teacher_precision,
                                                                             rows.xs.device) is not None:
            fp8.check_dtype(rows.xs.dtype)
        if vocab is not None:
            ranged = checks.ranged(call, rows)
    except Exception as e:  # noqa: BLE001 (raised again by the slice's agree, on every rank)
        if vocab is None:
            raise
        failed = e
    checked = False if vocab is None else vocab.agree(call, rows, backend, ranged, failed)
    if form == "teacher_topk":
        return topk.run(call, rows, backend, vocab)
    checks.check_values(call, rows, rows.ws.shape[0] if vocab is None else vocab.total, checked)
    return loop.run(call, rows, plans.make(call, rows, backend, learning, vocab))
