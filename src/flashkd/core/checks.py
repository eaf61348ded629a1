"""The checks of a call's tensors: types, dtypes, devices, shapes, and the values that are checked on
request (labels, a top-k teacher's ids and log-probs, teacher_index, row_weight).

Why a module of its own: a check raises with the public argument's name, as an unsharded call words
it, and the distributed layer raises the same errors on every rank; one module keeps the words and
their order. `check(call)` flattens the tensors to `Rows`, what the plan and the loop read; the checks
that need the vocab's size V (a slice's: only known after its ranks agree) are `check_values`.
"""

from __future__ import annotations

import dataclasses
import re
import sys

import torch


FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
NARROW = (torch.float16, torch.bfloat16)  # inputs whose logits are formed in fp32 (`linear`)


def check_chunk_size(chunk_size) -> None:
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size: expected a positive int or None, got {chunk_size!r}")


@dataclasses.dataclass(frozen=True)
class Rows:
    """A call's tensors checked and flattened to rows: what the chunk loop reads."""

    xs: torch.Tensor  # (N, Hs)
    ws: torch.Tensor  # (V, Hs)
    bs: torch.Tensor | None  # (V,)
    y: torch.Tensor | None  # (N,)
    teacher: tuple  # heads (Xt (N, Ht), Wt[:V], bt[:V]); logits (T[:, :V],); topk (ids, logprobs) (N, K)
    rw: torch.Tensor | None = None  # (N,) row_weight
    index: torch.Tensor | None = None  # (N,) teacher_index of a top-k teacher, with its num_teachers
    teachers: int = 0


def check(call, sliced: bool = False) -> Rows:
    """The call's tensors checked (types, dtypes, devices, shapes; row_weight's and teacher_index's values
    where they are checked) and flattened to rows; sliced: the heads are a rank's vocab slice (vocab_size,
    where a hint names it, is then the whole vocab's). The checks against the vocab's size: `check_values`."""
    student, t = call.student, call.teacher
    if t.form == "teacher_topk":
        return Rows(*check_teacher_head(t.teacher_input, t.teacher_weight, t.teacher_bias), None, ())
    xs, ws, bs, y = check_student(student.student_input, student.student_weight, student.student_bias, student.labels)
    vocab_size = call.options.vocab_size
    hint = {"keyword": "vocab_size=<the whole vocab's size, not this rank's slice's>"} if sliced else {}
    if t.form == "heads":
        teacher = check_teacher_heads(xs, student.student_input, ws, t.teacher_input, t.teacher_weight, t.teacher_bias,
                                      vocab_size, **hint)
    elif t.form == "logits":
        teacher = (check_teacher_logits(xs, student.student_input, ws, t.teacher_logits, vocab_size, **hint),)
    elif t.form in ("mixture", "routed"):
        teacher = t.checked(xs, student.student_input, ws, vocab_size)
    else:
        teacher = check_teacher_topk(xs, student.student_input, ws, t.teacher_ids, t.teacher_logprobs)
    rows = Rows(xs, ws, bs, y, teacher, check_row_weight(student.row_weight, xs, student.student_input))
    if t.form == "topk":
        rows = dataclasses.replace(rows, **dict(zip(("index", "teachers"), check_teacher_index(call, rows))))
    elif t.form == "routed":
        rows = dataclasses.replace(rows, index=t.index, teachers=len(t.counts))
    return rows


def check_values(call, rows: Rows, v, ranged: bool = False) -> None:
    """The checks against the vocab's size v (the whole vocab's: an int, or a slice's 0-d device tensor,
    read only where a check asks): vocab_size, then a top-k teacher's ids and the labels, where
    check_teacher and check_labels ask (default: on CPU tensors); ranged: a slice's exchange checked
    those two already."""
    if call.options.vocab_size is not None:
        check_vocab_size(call.options.vocab_size, int(v))
    if ranged:
        return
    check_teacher_values(call, rows, v)
    y, check = rows.y, call.options.check_labels
    if y is not None and (check if check is not None else rows.xs.device.type == "cpu"):
        check_label_range(y, int(v), call.spec.ignore_index)


def ranged(call, rows: Rows) -> dict:
    """{argument: (its (N, ...) values, the rows that count (N,) bool or None, check(V))} of the values a
    slice's exchange checks against the group's vocab V, where check_teacher and check_labels ask
    (default: on CPU tensors); check(V) raises the error an unsharded call raises. A top-k teacher's
    checks that need no V run here, before the exchange."""
    out, spec, y, options = {}, call.spec, rows.y, call.options
    counted = None if y is None else y != spec.ignore_index
    cpu = rows.xs.device.type == "cpu"
    if call.teacher.form == "topk" and (options.check_teacher if options.check_teacher is not None else cpu):
        ids, lp = rows.teacher
        check_topk_values(ids, lp, None, spec, y)
        out["teacher_ids"] = (ids, counted, lambda v: check_topk_values(ids, lp, v, spec, y))
    if y is not None and (options.check_labels if options.check_labels is not None else cpu):
        out["labels"] = (y, counted, lambda v: check_label_range(y, v, spec.ignore_index))
    return out


def check_teacher_values(call, rows: Rows, v) -> None:
    """A top-k teacher's values, as `check_teacher` asks (default: on CPU tensors), against a vocab of
    v ids (an int, or a device tensor, read only when checking)."""
    if call.teacher.form != "topk":
        return
    check = call.options.check_teacher
    if check if check is not None else rows.xs.device.type == "cpu":
        check_topk_values(*rows.teacher, int(v), call.spec, rows.y)


def check_vocab_size(vocab_size, v) -> None:
    """vocab_size, where given, against the student's vocab v (the group's, for a vocab slice): the
    teacher's rows past it are padding of the same tokenizer only if it is the student's whole vocab."""
    if vocab_size is not None and vocab_size != v:
        raise ValueError(f"vocab_size: expected {v} (the student's vocab: student_weight's rows), got {vocab_size!r}; "
                         "it declares the teacher's rows from there on padding of the student's tokenizer")


def renamed(error: Exception, names: dict) -> Exception:
    """`error` with the arguments its message names ("name: expected ... when other is None") renamed by `names`."""
    words = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, sorted(names, key=len, reverse=True))) + r")(?!\w)")
    message = words.sub(lambda m: names[m.group(1)], str(error)) if names else str(error)
    return error if message == str(error) else type(error)(message)


def any_dtensor(*xs) -> bool:
    dtensor = sys.modules.get("torch.distributed.tensor")  # not imported: none can be one
    return dtensor is not None and any(isinstance(x, dtensor.DTensor) for x in xs)


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


def check_teacher_head(x, w, b):
    """teacher_topk's tensors: (hidden states flattened to rows, head, bias)."""
    check_tensors({"teacher_input": x})
    if x.dtype not in FLOATS:
        raise TypeError(f"teacher_input: expected a floating dtype (float16, bfloat16, float32, float64), got {x.dtype}")
    check_tensors({"teacher_weight": w, "teacher_bias": b}, x.dtype, x.device, like="teacher_input")
    if w.dim() != 2 or 0 in w.shape:  # an empty vocab or hidden size has no distribution
        raise ValueError(f"teacher_weight: expected a 2-D (vocab, hidden) tensor, both >= 1, got shape {tuple(w.shape)}")
    if x.dim() < 1 or x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"teacher_input: expected shape (..., {w.shape[1]}) (teacher_weight is {tuple(w.shape)}), got {tuple(x.shape)}"
        )
    if b is not None and b.shape != (w.shape[0],):
        raise ValueError(f"teacher_bias: expected shape ({w.shape[0]},), got {tuple(b.shape)}")
    return x.reshape(-1, x.shape[-1]), w, b


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


def check_num_teachers(indexed: bool, count, return_stats: bool) -> None:
    """num_teachers (count) of a top-k teacher, with or without teacher_index (indexed), and return_stats
    that teacher_index asks for: what the parse checks of them, before any work."""
    if not indexed:
        if count is not None:
            raise ValueError(f"num_teachers: expected None without teacher_index (it sizes the per-teacher sums), got {count!r}")
        return
    if isinstance(count, bool) or not isinstance(count, int):
        raise TypeError(f"num_teachers: expected an int with teacher_index, got {count!r}")
    if count < 1:
        raise ValueError(f"num_teachers: expected an int >= 1, got {count!r}")
    if not return_stats:
        raise ValueError("teacher_index: expected return_stats=True with it (it only splits the statistics by "
                         "teacher; the loss does not depend on it), got return_stats=False")


def check_teacher_index(call, rows: Rows):
    """(teacher_index flattened to (N,), num_teachers) of a top-k call, or (None, 0) without one; its
    values checked on the rows that count with check_teacher (default: on CPU, a host sync elsewhere)."""
    index, count = call.teacher.teacher_index, call.teacher.num_teachers  # count checked by the parse
    if index is None:
        return None, 0
    xs, y, spec = rows.xs, rows.y, call.spec
    check_tensors({"teacher_index": index}, device=xs.device)
    if index.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"teacher_index: expected an integer dtype (torch.int64 or torch.int32), got {index.dtype}")
    lead = call.student.student_input.shape[:-1]
    if index.shape != lead:
        raise ValueError(f"teacher_index: expected shape {tuple(lead)} (student_input's leading dims, as labels), "
                         f"got {tuple(index.shape)}")
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

