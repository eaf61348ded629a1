"""Several teacher heads in one loss, built on `flashkd.fused_linear_distill` (one call per group of rows,
per teacher, or one call over the teachers' heads concatenated), so that no [tokens × vocab] logits exist
in full here either. M teachers, each its hidden states X_m (..., Ht_m) (student_input's leading dims) and
head W_m (Vt_m, Ht_m), logits z_m = σ_m (X_m W_m^T + b_m) (σ_m its `teacher_logit_scale`), and `combine`:

    routed     each row has one teacher (`teacher_index`, −1 for none): the rows are grouped per teacher
               and run as one call (`flashkd.core.mixture`: each block's teacher logits from its rows' teachers'
               heads, each teacher's GEMM over its own rows, the student's GEMMs once over all of them, one dW
               accumulation: no extra FLOPs); with an FP8 teacher head (teacher_precision), one call a group,
               their sums added. "mean" divides once by the number of rows that count (label not
               ignore_index, teacher_index ≥ 0).
               A row of teacher_index −1 contributes nothing (neither soft term nor CE) and is not counted.
               Grouping needs the groups' sizes on the host: one host sync per call.
    geometric  p = softmax(Σ_m w_m z_m / τ), the normalised weighted geometric mean of the teachers'
               distributions at τ = 1 (Σ w_m log p_m renormalised). Its logits are one GEMM: the weighted
               hidden states and the heads concatenated along the hidden dim, Xt = cat(w_m σ_m X_m),
               Wt = cat(W_m), a bias b_m as one more column (of value w_m σ_m in Xt, b_m in Wt); one call.
               The concatenation copies the heads (V × Σ Ht_m) and the hidden states (N × Σ Ht_m) once.
               A per-teacher softcap is not a linear map of the logits and cannot be concatenated: refused
               (a logit scale is folded into w_m).
    arithmetic p = Σ_m w_m softmax(z_m / τ), the teachers' distributions at τ mixed per row (the weights ≥ 0
               summing to 1 on each row: checked, never renormalised). Its log needs each teacher's row
               statistics, so the core's chunk loop makes it block by block from the M heads in turn
               (`flashkd.core.mixture`): one call, M teacher GEMMs over all rows (as geometric's one GEMM over
               the concatenated heads), no head copied; the loss and its gradients as for one teacher whose
               log-probs are log p. Softcaps per teacher are taken (the mixture is of the distributions).
    sum        Σ_m w_m D(p_m ‖ q), the weighted sum of the divergences to each teacher, the hard CE taken
               once: M calls, so the student's GEMMs run M times. Scalar weights are folded into each call's
               weight_soft_loss (the first call carries the CE); per-row weights go through row_weight, which
               would weigh the CE as well, so the CE then has a call of its own (an (M+1)-th pass of the
               student, its own head, detached, standing in as the teacher with weight_soft_loss 0).

teacher_weights: M floats, or a float tensor (..., M) of student_input's leading dims (per row), ≥ 0; for
arithmetic each row's summing to 1 (within M · the weights' dtype's epsilon; a tensor's checked on the host: one
host sync).

Statistics (`return_stats`): for routed and sum a `DistillStats` whose totals are those of the one-call
form, and `per_teacher` (M, 3): per teacher the rows that count (as floats), its soft sum (row-weighted, and
times w_m for sum: the column sums to soft_sum) and its teacher entropy sum, which is 0: the dense form
does not compute the teacher's entropy (its `teacher_entropy_sum` is None). For geometric and arithmetic the
one call's stats, `per_teacher` None (the rows' teacher is the mixture, no one teacher's).
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple, Sequence

import torch

from . import core, fp8
from .core import call as calls
from .core import checks, mixture
from .core import keywords
from .distill import KEYWORDS, fused_linear_distill
from .losses import LEARNING_LOSSES, REDUCTIONS, DistillStats

COMBINES = ("routed", "geometric", "arithmetic", "sum")
# What the calls here set themselves: per teacher (its head's transform), and per group of rows or returned
# here (the weights, the reduction, what is returned; the arithmetic mixture's one call takes them as given).
# fused_linear_distill's other loss and option keywords (the keyword table's) are passed through as given.
_PER_TEACHER = frozenset(("teacher_logit_scale", "teacher_softcap"))
_PER_CALL = frozenset(("weight_hard_loss", "weight_soft_loss", "reduction", "return_soft_hard_loss", "return_stats"))
_PASSED = frozenset(keywords.sort(KEYWORDS["fused_linear_distill"], keywords.PARSED)) - _PER_TEACHER - _PER_CALL


class _Teachers(NamedTuple):
    inputs: list  # (N, Ht_m) each, flattened rows
    heads: list  # (Vt_m, Ht_m)
    biases: list  # (Vt_m,) or None
    scales: list  # float per teacher
    softcaps: list  # float or None per teacher


def fused_linear_distill_teachers(
    student_input: torch.Tensor,  # (..., Hs)
    student_weight: torch.Tensor,  # (V, Hs)
    teacher_inputs: Sequence[torch.Tensor],  # M of (..., Ht_m)
    teacher_heads: Sequence[torch.Tensor],  # M of (Vt_m, Ht_m)
    labels: torch.Tensor | None = None,
    *,
    combine: str,
    teacher_index: torch.Tensor | None = None,  # routed: (...) int in [-1, M)
    teacher_weights=None,  # geometric, arithmetic, sum: M floats or (..., M)
    teacher_biases: Sequence[torch.Tensor | None] | None = None,
    loss: str = "jsd",
    beta: float | None = None,
    alpha: float | None = None,
    head_mass: float | None = None,
    gate_min: float | None = None,
    gate_max: float | None = None,
    gate_center: float | None = None,
    gate_width: float | None = None,
    temperature: float = 1.0,
    weight_hard_loss: float = 0.5,
    weight_soft_loss: float = 0.5,
    ignore_index: int = -100,
    student_bias: torch.Tensor | None = None,
    reduction: str = "mean",
    chunk_size: int | None = None,
    backend: str = "auto",
    return_soft_hard_loss: bool = False,
    temperature_squared: bool = False,
    grad_accum_dtype: torch.dtype | None = None,
    check_labels: bool | None = None,
    student_logit_scale: float = 1.0,
    student_softcap: float | None = None,
    teacher_logit_scale=1.0,  # a float, or M floats
    teacher_softcap=None,  # None, a float, or M of them (not with geometric)
    row_weight: torch.Tensor | None = None,
    return_stats: bool = False,
    teacher_precision: str | None = None,
    vocab_size: int | None = None,
):
    """The distillation loss of a student toward M teachers, combined as `combine` says ("routed",
    "geometric", "arithmetic", "sum": the module docstring, `flashkd.teachers`, and docs/forms.md), without the logits in
    full. teacher_inputs, teacher_heads (and teacher_biases, entries None for none): M each, M >= 1.
    routed takes `teacher_index` (labels' shape, int64 or int32, each row's teacher in [0, M) or −1 for
    none; one host sync: the groups' sizes), geometric, arithmetic and sum `teacher_weights` (M floats or a
    float tensor (..., M), >= 0, checked on CPU; arithmetic's summing to 1 a row, checked on any device; a tensor
    (M,) is read on the host; a constant: a tensor that requires grad is refused). teacher_logit_scale and
    teacher_softcap: one for all or M, per teacher; geometric refuses softcaps. The other keywords are
    `fused_linear_distill`'s, passed through; the returns too: loss, (soft, hard) with
    return_soft_hard_loss, a `DistillStats` with return_stats (per_teacher (M, 3) for routed and sum:
    rows, soft sum, 0 for the teacher entropy the dense form does not compute). The teachers are
    constants: loss="mutual" and "co_jeffreys" are refused. No process_group: a sharded head takes
    `fused_linear_distill`'s own calls.
    """
    given = dict(locals())  # the arguments as passed: those of _PASSED go through to each call
    if combine not in COMBINES:
        raise ValueError(f"combine: expected one of {COMBINES}, got {combine!r}")
    for name in ("return_soft_hard_loss", "return_stats"):  # read here by routed and sum, not only by the calls
        if not isinstance(given[name], bool):
            raise TypeError(f"{name}: expected a bool, got {given[name]!r}")
    if loss in LEARNING_LOSSES:
        raise ValueError(f"loss: {loss!r} trains the teacher; with several teachers the teachers are constants")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
    if not isinstance(student_input, torch.Tensor):
        raise TypeError(f"student_input: expected a tensor (..., Hs), got {type(student_input).__name__}")
    if student_input.dim() < 1:
        raise ValueError("student_input: expected a tensor of shape (..., Hs), got a 0-d tensor")
    lead = tuple(student_input.shape[:-1])
    # the student's tensors first, for every combine: geometric checks each teacher against student_input's dtype
    # before its one call, where an integer student_input would be blamed on teacher_inputs[0]
    checks.check_student(student_input, student_weight, student_bias, labels)
    # checked here as given: the calls below see it multiplied by per-row weights, or as the rows of a group
    checks.check_row_weight(row_weight, student_input, student_input)
    teachers = _teachers(teacher_inputs, teacher_heads, teacher_biases, teacher_logit_scale, teacher_softcap, lead)
    m = len(teachers.inputs)
    if combine == "routed":
        if teacher_weights is not None:
            raise ValueError("teacher_weights: expected None with combine='routed' (teacher_index routes the rows)")
    elif teacher_index is not None:
        raise ValueError(f"teacher_index: expected None with combine={combine!r} (teacher_weights weigh the teachers)")
    options = {name: value for name, value in given.items() if name in _PASSED}
    weights = (weight_hard_loss, weight_soft_loss)
    if combine == "routed":
        # labels' shape checked above, as given: the calls below see only the rows that have a teacher, flattened
        index = _check_index(teacher_index, labels, lead, m, student_input.device)
        # every row's labels, as one call checks them (on the CPU, or as check_labels says): −1 rows' too
        if labels is not None and (check_labels if isinstance(check_labels, bool) else labels.device.type == "cpu") \
                and isinstance(ignore_index, int):
            checks.check_label_range(labels.reshape(-1), student_weight.shape[0], ignore_index)
        counts, order = _groups(index, m)
        parsed = {**options, **{name: given[name] for name in _PER_CALL}}
        if teacher_precision is None and counts[0] < index.numel():
            return core.run(_routed_call(student_input, student_weight, student_bias, teachers, labels, row_weight,
                                         index, counts, order, parsed))
        if teacher_precision is not None and fp8.scaling_of(teacher_precision, student_input.device) is not None:
            # as one call checks it (a device with FP8 tensor cores, a student dtype it takes): the calls a group
            # below run only for teachers with rows, so with none it would otherwise pass unchecked, as a 0
            fp8.check_dtype(student_input.dtype)
        # no one call runs (no row has a teacher, or one call a group, a teacher without rows having none):
        # every teacher's tensors checked as the one call checks them, on no rows (nothing copied)
        none = [index.numel()] + [0] * (m + 1)
        checks.check(_routed_call(student_input, student_weight, student_bias, teachers, labels, row_weight, index,
                                  none, order, {**parsed, "teacher_precision": None}))
        out = _routed(student_input, student_weight, student_bias, teachers, labels, row_weight, counts, order,
                      weights, reduction, options)
    else:
        w, eps = _check_weights(teacher_weights, lead, m, student_input.device)
        if combine == "arithmetic":
            return _arithmetic(student_input, student_weight, student_bias, teachers, labels, row_weight, w, eps,
                               {**options, **{name: given[name] for name in _PER_CALL}})
        if combine == "geometric":
            if any(c is not None for c in teachers.softcaps):
                raise ValueError("teacher_softcap: expected None with combine='geometric' (a softcap per teacher is "
                                 "not linear in the logits; a logit scale is folded into teacher_weights)")
            return _geometric(student_input, student_weight, student_bias, teachers, labels, row_weight, w, weights,
                              reduction, return_soft_hard_loss, return_stats, options)
        out = _summed(student_input, student_weight, student_bias, teachers, labels, row_weight, w, weights,
                      reduction, options)
    loss_value, soft, hard, stats = out
    result = (loss_value, soft, hard) if return_soft_hard_loss else (loss_value,)
    if return_stats:
        result = (*result, stats)
    return result[0] if len(result) == 1 else result


def _per_teacher(value, name, m, check):
    """A keyword given once for every teacher or as M values: the list of M."""
    if isinstance(value, (list, tuple)):
        if len(value) != m:
            raise ValueError(f"{name}: expected one value or {m} (one per teacher), got {len(value)}")
        values = list(value)
    else:
        values = [value] * m
    for v in values:
        check(v)
    return values


def _teachers(inputs, heads, biases, scales, softcaps, lead) -> _Teachers:
    for name, seq in (("teacher_inputs", inputs), ("teacher_heads", heads)):
        if isinstance(seq, torch.Tensor) or not isinstance(seq, (list, tuple)):
            raise TypeError(f"{name}: expected a list or tuple of tensors, one per teacher, got {type(seq).__name__}")
    m = len(inputs)
    if m < 1:
        raise ValueError("teacher_inputs: expected at least one teacher, got 0")
    if len(heads) != m:
        raise ValueError(f"teacher_heads: expected {m} heads (one per teacher_inputs), got {len(heads)}")
    if biases is None:
        biases = [None] * m
    elif isinstance(biases, torch.Tensor) or not isinstance(biases, (list, tuple)) or len(biases) != m:
        got = f"{len(biases)} entries" if isinstance(biases, (list, tuple)) else type(biases).__name__
        raise ValueError(f"teacher_biases: expected None or a list of {m} (a tensor or None each), got {got}")
    flat = []
    for i, (x, w, b) in enumerate(zip(inputs, heads, biases)):
        # a tensor each, dense: a sparse one would fail in the reshape below, not by its name
        checks.check_tensors({f"teacher_inputs[{i}]": x, f"teacher_heads[{i}]": w})
        if b is not None:
            checks.check_tensors({f"teacher_biases[{i}]": b})
        if tuple(x.shape[:-1]) != lead or x.dim() != len(lead) + 1:
            raise ValueError(f"teacher_inputs[{i}]: expected shape {(*lead, 'Ht')} (student_input's leading dims), "
                             f"got {tuple(x.shape)}")
        if w.dim() != 2 or 0 in w.shape:  # an empty vocab or hidden size has no distribution
            raise ValueError(f"teacher_heads[{i}]: expected a 2-D (vocab, hidden) tensor, both >= 1, got shape "
                             f"{tuple(w.shape)}")
        if w.shape[1] != x.shape[-1]:
            raise ValueError(f"teacher_heads[{i}]: expected shape (Vt, {x.shape[-1]}), got {tuple(w.shape)}")
        if b is not None and tuple(b.shape) != (w.shape[0],):
            raise ValueError(f"teacher_biases[{i}]: expected None or a tensor of shape ({w.shape[0]},), got "
                             f"{tuple(b.shape)}")
        flat.append(x.reshape(-1, x.shape[-1]))

    def scale(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v == 0:
            raise ValueError(f"teacher_logit_scale: expected finite non-zero floats, got {v!r}")

    def cap(v):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0):
            raise ValueError(f"teacher_softcap: expected None or finite floats > 0, got {v!r}")

    return _Teachers(flat, list(heads), list(biases), _per_teacher(scales, "teacher_logit_scale", m, scale),
                     _per_teacher(softcaps, "teacher_softcap", m, cap))


def _check_index(index, labels, lead, m, device):
    if index is None:
        raise ValueError("teacher_index: expected a tensor with combine='routed' (each row's teacher), got None")
    if not isinstance(index, torch.Tensor) or index.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"teacher_index: expected an int64 or int32 tensor, got {getattr(index, 'dtype', type(index))}")
    # the rows are grouped by it on its device (bincount, argsort), then it indexes the student's rows
    if index.layout != torch.strided:
        raise TypeError(f"teacher_index: expected a dense (strided) tensor, got layout {index.layout}")
    if index.device != device:
        raise ValueError(f"teacher_index: expected a tensor on {device} (the device of student_input), got {index.device}")
    shape = lead if labels is None else tuple(labels.shape)
    if tuple(index.shape) != shape:
        raise ValueError(f"teacher_index: expected labels' shape {shape}, got {tuple(index.shape)}")
    flat = index.reshape(-1)
    if flat.device.type == "cpu" and flat.numel() and (int(flat.min()) < -1 or int(flat.max()) >= m):
        raise ValueError(f"teacher_index: expected values in [-1, {m}), got [{int(flat.min())}, {int(flat.max())}]")
    return flat


def _check_weights(weights, lead, m, device):
    """A list of M floats, or a float tensor (N, M) of per-row weights; and the epsilon of their dtype (the
    tolerance of arithmetic's sum, per weight: a tensor's dtype, fp64 for Python floats)."""
    eps = 2.0**-52
    if weights is None:
        raise ValueError(f"teacher_weights: expected {m} floats or a tensor (..., {m}), got None")
    if isinstance(weights, torch.Tensor):
        if not weights.is_floating_point():
            raise TypeError(f"teacher_weights: expected a float tensor, got {weights.dtype}")
        if weights.requires_grad:  # detached below: a gradient to it would be silently dropped
            raise TypeError("teacher_weights: expected a constant tensor (requires_grad=False): no gradient flows to "
                            "it; got one that requires grad (pass teacher_weights.detach())")
        checks.check_tensors({"teacher_weights": weights})  # dense: a sparse one has no values to compare
        eps = torch.finfo(weights.dtype).eps
        if tuple(weights.shape) == (m,):  # one weight per teacher, read on the host
            if weights.device.type == "meta":
                raise ValueError("teacher_weights: expected a tensor (M,) with values (read on the host), got one on "
                                 "the meta device")
            weights = weights.tolist()
        else:
            if tuple(weights.shape) != (*lead, m):
                raise ValueError(f"teacher_weights: expected shape {(*lead, m)} or ({m},), got {tuple(weights.shape)}")
            if weights.device != device:
                raise ValueError(f"teacher_weights: expected device {device}, got {weights.device}")
            if weights.device.type == "cpu" and not bool(((weights >= 0) & weights.isfinite()).all()):
                raise ValueError("teacher_weights: expected finite values >= 0")
            return weights.detach().reshape(-1, m), eps
    if not isinstance(weights, (list, tuple)) or len(weights) != m:
        raise ValueError(f"teacher_weights: expected {m} floats (one per teacher) or a tensor (..., {m}), "
                         f"got {weights!r}")
    for w in weights:
        if isinstance(w, bool) or not isinstance(w, (int, float)):
            raise TypeError(f"teacher_weights: expected Python floats (or a tensor), got {w!r}")
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"teacher_weights: expected finite floats >= 0, got {w!r}")
    return [float(w) for w in weights], eps


def _call(xs, ws, bs, xt, wt, bt, labels, row_weight, scale, cap, w_hard, w_soft, reduction, options, teacher=None):
    """One fused_linear_distill call, with its soft and hard terms and its stats; teacher: its index, that an
    error about its tensors names them as passed here."""
    try:
        return fused_linear_distill(xs, ws, xt, wt, labels, student_bias=bs, teacher_bias=bt, row_weight=row_weight,
                                    teacher_logit_scale=scale, teacher_softcap=cap, weight_hard_loss=w_hard,
                                    weight_soft_loss=w_soft, reduction=reduction, return_soft_hard_loss=True,
                                    return_stats=True, **options)
    except (TypeError, ValueError) as e:
        if teacher is None:
            raise
        raise checks.renamed(e, mixture.teacher_names(teacher)) from None


def _groups(index, m):
    """(counts (M + 2 host ints: rows of teacher −1, of each teacher, out of range), the rows grouped by teacher,
    −1 first): one host sync."""
    keys = torch.where((index < -1) | (index >= m), m + 1, index.long() + 1)
    counts = torch.bincount(keys, minlength=m + 2).tolist()  # the one host sync
    if counts[m + 1]:
        raise ValueError(f"teacher_index: expected values in [-1, {m}), got {counts[m + 1]} outside")
    return counts, torch.argsort(keys, stable=True)


def _routed_call(xs, ws, bs, teachers, labels, row_weight, index, counts, order, parsed):
    """The one call of the routed form (`flashkd.core.mixture`): the rows with a teacher, grouped by it (`_groups`:
    counts, order); parsed: the call's loss and option keywords."""
    m = len(teachers.inputs)
    starts = list(itertools.accumulate(counts[:m + 1]))  # where each teacher's rows start in order, and end
    sel = order[starts[0]:]
    inputs = tuple(teachers.inputs[t].index_select(0, order[starts[t]:starts[t + 1]]) for t in range(m))
    y, rw = (None if t is None else t.reshape(-1).index_select(0, sel) for t in (labels, row_weight))
    student = calls.Student(xs.reshape(-1, xs.shape[-1]).index_select(0, sel), ws, y, bs, rw)
    routed = calls.Routed(inputs, tuple(teachers.heads), tuple(teachers.biases), tuple(counts[1:m + 1]),
                          index.index_select(0, sel), tuple(teachers.scales), tuple(teachers.softcaps))
    return calls.parse(student, routed, parsed)


def _routed(xs, ws, bs, teachers, labels, row_weight, counts, order, weights, reduction, options):
    """Routed as one fused_linear_distill call a group (an FP8 teacher head), or zeros where no row has a teacher."""
    m = len(teachers.inputs)
    hs = xs.shape[-1]
    flat_x = xs.reshape(-1, hs)
    flat_labels = None if labels is None else labels.reshape(-1)
    flat_rw = None if row_weight is None else row_weight.reshape(-1)
    dtype = torch.float64 if xs.dtype == torch.float64 else torch.float32
    total = (flat_x[:0].sum() + ws.reshape(-1)[:0].sum()).to(dtype)  # 0, in the graph of both
    soft = hard = hard_sum = entropy = total.new_zeros(())
    rows = torch.zeros((), dtype=torch.int64, device=xs.device)
    per = torch.zeros(m, 3, dtype=dtype, device=xs.device)
    start = counts[0]  # the rows of teacher_index −1 come first, and are left out
    for t in range(m):
        n = counts[t + 1]
        if n == 0:
            start += n
            continue
        sel = order[start:start + n]
        start += n
        loss, s, h, st = _call(
            flat_x.index_select(0, sel), ws, bs, teachers.inputs[t].index_select(0, sel), teachers.heads[t],
            teachers.biases[t], None if flat_labels is None else flat_labels.index_select(0, sel),
            None if flat_rw is None else flat_rw.index_select(0, sel), teachers.scales[t], teachers.softcaps[t],
            weights[0], weights[1], "sum", options, t)
        total, soft, hard = total + loss, soft + s, hard + h
        rows, entropy, hard_sum = rows + st.rows, entropy + st.entropy_sum, hard_sum + st.hard_sum
        per[t, 0], per[t, 1] = st.rows.to(dtype), st.soft_sum
    if reduction == "mean":
        denom = rows.clamp_min(1).to(dtype)
        total, soft, hard = total / denom, soft / denom, hard / denom
    stats = DistillStats(per[:, 1].sum(), hard_sum=hard_sum, rows=rows,
                         entropy_sum=entropy, topk_mass_sum=None, teacher_entropy_sum=None, per_teacher=per)
    return total, soft, hard, stats


def _summed(xs, ws, bs, teachers, labels, row_weight, w, weights, reduction, options):
    m = len(teachers.inputs)
    w_hard, w_soft = weights
    per_row = isinstance(w, torch.Tensor)
    lead = xs.shape[:-1]
    total = soft = hard = None
    per = []
    stats0 = None
    for t in range(m):
        if per_row:
            rw = w[:, t].reshape(lead)
            rw = rw if row_weight is None else rw * row_weight
            call_w_soft, carries_ce = w_soft, False
        else:
            rw, call_w_soft, carries_ce = row_weight, w_soft * w[t], t == 0
        xt = teachers.inputs[t].reshape(*lead, teachers.inputs[t].shape[-1])  # -1 is ambiguous with no rows
        loss, s, h, st = _call(xs, ws, bs, xt, teachers.heads[t], teachers.biases[t], labels, rw,
                               teachers.scales[t], teachers.softcaps[t], w_hard if carries_ce else 0.0,
                               call_w_soft, reduction, options, t)
        factor = 1.0 if per_row else w[t]
        total = loss if total is None else total + loss
        soft = s * factor if soft is None else soft + s * factor
        if carries_ce:
            hard, stats0 = h, st
        if stats0 is None:
            stats0 = st
        per.append(torch.stack([st.rows.to(st.soft_sum.dtype), st.soft_sum * factor, torch.zeros_like(st.soft_sum)]))
    per = torch.stack(per)
    hard_sum = stats0.hard_sum if hard is not None else torch.zeros_like(stats0.soft_sum)
    if hard is None and per_row and labels is not None and w_hard != 0.0:
        # row_weight would weigh the CE too: a pass of its own, the student's head standing in as the teacher
        options = {**options, "teacher_precision": None, "vocab_size": None}
        loss, _, hard, st = _call(xs, ws, bs, xs.detach(), ws.detach(), None if bs is None else bs.detach(), labels,
                                  row_weight, 1.0, None, w_hard, 0.0, reduction, options)
        total, hard_sum = total + loss, st.hard_sum
    if hard is None:
        hard = torch.zeros_like(soft)
    stats = DistillStats(per[:, 1].sum(), hard_sum=hard_sum, rows=stats0.rows, entropy_sum=stats0.entropy_sum,
                         topk_mass_sum=None, teacher_entropy_sum=None, per_teacher=per)
    return total, soft, hard, stats


def _geometric(xs, ws, bs, teachers, labels, row_weight, w, weights, reduction, return_soft_hard_loss, return_stats,
               options):
    m = len(teachers.inputs)
    lead = xs.shape[:-1]
    vocab_size = options["vocab_size"]
    if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1):
        raise TypeError(f"vocab_size: expected None or an int >= 1 (the student's vocab size), got {vocab_size!r}")
    for t in range(m):  # concatenated below, where torch.cat would promote a mixed dtype silently
        checks.check_tensors({f"teacher_inputs[{t}]": teachers.inputs[t], f"teacher_heads[{t}]": teachers.heads[t]},
                             xs.dtype, xs.device)
        if teachers.biases[t] is not None:
            checks.check_tensors({f"teacher_biases[{t}]": teachers.biases[t]}, xs.dtype, xs.device)
    # each head against the student's vocab, as one call checks its teacher_weight: the one call below sees only
    # their concatenation, whose errors would name a teacher_weight the caller did not pass
    cut = ws.shape[0]
    checks.check_vocab_size(vocab_size, cut)
    for t in range(m):
        checks.check_teacher_vocab(f"teacher_heads[{t}]", teachers.heads[t].shape[0], cut, vocab_size)
    per_row = isinstance(w, torch.Tensor)
    dtype = teachers.inputs[0].dtype
    xcols, wcols = [], []
    for t in range(m):
        x, head, bias, scale = teachers.inputs[t], teachers.heads[t][:cut], teachers.biases[t], teachers.scales[t]
        coef = (w[:, t:t + 1].to(dtype) * scale) if per_row else w[t] * scale  # (N, 1) or a float
        xcols.append(x * coef)
        wcols.append(head)
        if bias is not None:
            xcols.append(coef.expand(x.shape[0], 1) if per_row else x.new_full((x.shape[0], 1), coef))
            wcols.append(bias[:cut, None].to(head.dtype))
    xt = torch.cat(xcols, dim=1)
    xt = xt.reshape(*lead, xt.shape[-1])  # -1 is ambiguous with no rows
    wt = torch.cat(wcols, dim=1)
    w_hard, w_soft = weights
    return fused_linear_distill(xs, ws, xt, wt, labels, student_bias=bs, row_weight=row_weight,
                                weight_hard_loss=w_hard, weight_soft_loss=w_soft, reduction=reduction,
                                return_soft_hard_loss=return_soft_hard_loss, return_stats=return_stats, **options)


def _arithmetic(xs, ws, bs, teachers, labels, row_weight, w, eps, parsed):
    """One call of the mixture form; parsed: the call's loss and option keywords; eps: the weights' dtype's."""
    m = len(teachers.inputs)
    if parsed["teacher_precision"] is not None:
        raise ValueError(f"teacher_precision: expected None with combine='arithmetic' (its teachers' logits are made "
                         f"in their own dtype), got {parsed['teacher_precision']!r}")
    if isinstance(w, torch.Tensor):
        total = w.double().sum(-1)
        tol = m * torch.finfo(w.dtype).eps
        off = (total - 1.0).abs() > tol
        if bool(off.any()):  # the one host sync
            row = int(off.nonzero()[0, 0])
            raise ValueError(f"teacher_weights: expected each row's weights summing to 1 with combine='arithmetic' (a "
                             f"mixture of distributions; they are not renormalised), got {total[row].item()!r} at row "
                             f"{row}")
        if not bool(((w >= 0) & w.isfinite()).all()):
            raise ValueError("teacher_weights: expected finite values >= 0")
    elif abs(math.fsum(w) - 1.0) > m * eps:
        raise ValueError(f"teacher_weights: expected weights summing to 1 with combine='arithmetic' (a mixture of "
                         f"distributions; they are not renormalised), got {list(w)} (sum {math.fsum(w)!r})")
    lead = xs.shape[:-1]
    mixture = calls.Mixture(tuple(x.reshape(*lead, x.shape[-1]) for x in teachers.inputs), tuple(teachers.heads),
                            tuple(teachers.biases), w, tuple(teachers.scales), tuple(teachers.softcaps))
    call = calls.parse(calls.Student(xs, ws, labels, bs, row_weight), mixture, parsed)
    return core.run(call)
