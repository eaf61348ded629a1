"""Vocab-parallel calls: `process_group=` and `vocab_start=` on the public functions.

Each rank passes the same rows (hidden states, labels, top-k targets) and the rows
[vocab_start, vocab_start + V_r) of each head. The core validates the local tensors, then runs its
chunk loop with a `ShardedVocab`: the GEMMs give each rank its slice of every chunk's logits, the
row backend (the Triton rows' phases, or the torch row definition) merges the row statistics over
the group, dX is all-reduced, dW and db stay the slice's.
"""

from __future__ import annotations

import dataclasses
import struct
import zlib

import torch
import torch.distributed as dist

from .. import chunks, fp8, teacher
from ..losses import shown
from .sharding import Sharding
from .vocab import ShardedVocab, all_gather

# The exchanged layout row of a rank whose vocab_start is not an int (it raises with the others).
_NOT_AN_INT = -(1 << 62)


def run(call, sharding: Sharding, *, reduce_dx=True, dw_scale=1.0, record=None):
    """A loss call (`flashkd.chunks.Call`) with process_group, or a `flashkd.teacher.TopKCall`;
    reduce_dx, dw_scale, record: the ShardedVocab's (the FSDP route's)."""
    if isinstance(call, teacher.TopKCall):
        return teacher_topk(call, sharding)
    group = _check_group(sharding.process_group)
    failed, local_size, count, agree, ranges = None, 0, 0, None, None
    read = _reads(sharding.check_shards, call.options.chunk_size)
    student = call.student
    try:  # a check that fails on this rank alone fails on every rank, after the exchange in `shard`
        rows = chunks.check(call, sliced=True)
        xs, ws, teacher_rows = rows.xs, rows.ws, rows.teacher
        local_size, count = ws.shape[0], xs.shape[0]
        replicated = {"student_input": xs}  # a dense teacher's logits are the rank's own vocab columns
        if isinstance(call.teacher, chunks.Heads):
            replicated["teacher_input"] = teacher_rows[0]
        elif isinstance(call.teacher, chunks.TopK):
            replicated.update(teacher_ids=teacher_rows[0], teacher_logprobs=teacher_rows[1])
        agree = _agreed(call, sharding, rows)
        if read:
            ranges = _ranges(call, rows)
    except Exception as e:  # noqa: BLE001 (raised again in `shard`, on this rank as it came)
        failed = e
    vocab = shard(group, sharding.vocab_start, local_size, _wire_device(group, student.student_input),
                  sharding.check_shards, call.options.chunk_size, failed=failed, rows=("student_input", count),
                  agree=agree, ranges=ranges, reduce_dx=reduce_dx, dw_scale=dw_scale, record=record)
    if call.options.vocab_size is not None:  # agreed by every rank: raised on all alike (one host read, where asked)
        chunks.check_vocab_size(call.options.vocab_size, int(vocab.total))
    if sharding.check_replicas:
        check_replicas(group, {**replicated, "labels": rows.y})
    if read:  # the labels and ids were checked against the group's vocab in `shard`, on every rank alike
        unchecked = dataclasses.replace(call.options, check_labels=False)
        return chunks.run(dataclasses.replace(call, options=unchecked), rows, vocab)
    # check_shards=False: this rank's checks alone (a call wrong on some ranks can leave the others waiting)
    chunks.check_teacher_values(call, rows, vocab.total)
    return chunks.run(call, rows, vocab)


def fail(error: Exception, process_group, vocab_start, rows):
    """Raise error on every rank of process_group: this rank's call failed where it was made, before
    its checks here (`flashkd.distributed.fail`)."""
    group = _check_group(process_group)
    shard(group, vocab_start, 0, _wire_device(group, rows), None, None, failed=error)
    raise AssertionError("shard returned with a failed check")  # it raises `error` on this rank


def _ranges(call, rows) -> dict:
    """{argument: (least, largest, check)} of the values this rank checks against the group's vocab V
    (`_RANGED`; check(V) raises this rank's own error where they do not fit it), where check_teacher and
    check_labels ask (default: on CPU tensors; host syncs); the top-k teacher's checks that need no V
    run here, before the exchange."""
    out, spec, y, options = {}, call.spec, rows.y, call.options
    counted = None if y is None else y != spec.ignore_index
    cpu = rows.xs.device.type == "cpu"
    if isinstance(call.teacher, chunks.TopK) and (options.check_teacher if options.check_teacher is not None else cpu):
        ids, lp = rows.teacher
        chunks.check_topk_values(ids, lp, None, spec, y)
        out["teacher_ids"] = (*_extremes(ids, counted), lambda v: chunks.check_topk_values(ids, lp, v, spec, y))
    if y is not None and (options.check_labels if options.check_labels is not None else cpu):
        out["labels"] = (*_extremes(y, counted), lambda v: chunks.check_label_range(y, v, spec.ignore_index))
    return out


def _extremes(x, counted) -> tuple[int, int]:
    """(least, largest) of integer x's entries in the rows that count (counted: (N,) bool, None: all), or
    `_NONE` where none does; one host sync."""
    if x.numel() == 0:
        return _NONE
    if counted is not None:
        keep = counted.view(-1, *(1,) * (x.dim() - 1))
        info = torch.iinfo(x.dtype)
        lo, hi = torch.where(keep, x, info.max).amin(), torch.where(keep, x, info.min).amax()
    else:
        lo, hi = x.amin(), x.amax()
    lo, hi = torch.stack([lo, hi]).tolist()
    return (lo, hi) if lo <= hi else _NONE


def teacher_topk(call, sharding: Sharding):
    """A `flashkd.teacher.TopKCall` with process_group: the group's layout exchanged once the local
    tensors are checked (a failed check, `failed`, raised on every rank), every rank the same global
    top-k."""
    x = call.teacher.teacher_input

    def sharded(local_size, device, failed=None, rows=0):
        check_shards = True if sharding.check_shards is None else sharding.check_shards
        agree = None if failed is not None else _agreed(call, sharding, None, {
            "teacher_input's dtype": x.dtype, "teacher_input's hidden size": x.shape[-1]})
        group = _check_group(sharding.process_group)
        return shard(group, sharding.vocab_start, local_size, device or _wire_device(group, x),
                     check_shards, None, failed=failed, rows=("teacher_input", rows), agree=agree)

    return teacher.run(call, sharded)


_SPEC_NAMES = {"weight_hard": "weight_hard_loss", "weight_soft": "weight_soft_loss"}  # LossSpec's fields, as passed
_FUNCTIONS = {"heads": "fused_linear_distill", "logits": "fused_linear_distill_logits", "topk": "fused_linear_distill_topk"}


def _agreed(call, sharding: Sharding, rows, derived=None) -> dict:
    """{what: value} every rank of the call must agree on (encoded for `shard`'s one all-gather): the
    function, what the run reads before its first collective that can differ from rank to rank
    (checked here: raises where it fails), the loss spec's fields under their public names, the call's
    options (what changes the loss, which collectives run, or what a check after the exchange reads:
    grad_accum_dtype) and the derived facts."""
    options = call.options
    if isinstance(call, teacher.TopKCall):
        return {"function": "teacher_topk", "chunk_size": options.chunk_size, "check_shards": sharding.check_shards,
                "teacher_precision": options.teacher_precision, "fsdp_gather": sharding.fsdp_gather, "k": call.k,
                "temperature": call.temperature, "vocab_size": call.vocab_size,
                "teacher_logit_scale": call.teacher_logit_scale, "teacher_softcap": call.teacher_softcap,
                **(derived or {})}
    out = {"function": _FUNCTIONS[call.teacher.form]}
    xs, ws, bs = rows.xs, rows.ws, rows.bs
    chunks.check_row_weight(call.student.row_weight, xs, call.student.student_input)
    # the row backend's collectives differ: all ranks alike (dense rows of some losses: the torch rows)
    topk = isinstance(call.teacher, chunks.TopK)
    backend = chunks.pick_backend(options.backend, xs, None if topk else call.spec.kind)
    if isinstance(call.teacher, chunks.Heads) and fp8.scaling_of(options.teacher_precision, xs.device) is not None:
        fp8.check_dtype(xs.dtype)
    if topk:
        chunks.check_teacher_index(call, rows)
    grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (xs, ws, bs))
    # the hidden sizes: dX's all-reduce is R·Hs a chunk (ranks that differ abort in it); the rows are replicated
    derived = {"backend": backend, "student_input's dtype": xs.dtype, "student_input's hidden size": xs.shape[1],
               "teacher_input's hidden size": rows.teacher[0].shape[1] if isinstance(call.teacher, chunks.Heads) else None,
               "labels given": rows.y is not None,
               "row_weight given": call.student.row_weight is not None,
               "gradients (grad mode, requires_grad; of student_input)": (grad, grad and xs.requires_grad),
               "teacher_ids' k": rows.teacher[0].shape[-1] if topk else None,
               "num_teachers": call.teacher.num_teachers if topk else None}
    spec = call.spec
    out.update({_SPEC_NAMES.get(f.name, f.name): getattr(spec, f.name) for f in dataclasses.fields(spec)
                if f.name not in ("want_hard", "want_soft")})  # those two follow from the weights and labels
    out.update({"chunk_size": options.chunk_size, "return_soft_hard_loss": options.return_soft_hard_loss,
                "return_stats": options.return_stats, "check_labels": options.check_labels,
                "check_teacher": options.check_teacher, "check_replicas": sharding.check_replicas,
                "check_shards": sharding.check_shards, "teacher_precision": options.teacher_precision,
                "fsdp_gather": sharding.fsdp_gather, "grad_accum_dtype": options.grad_accum_dtype,
                "vocab_size": options.vocab_size})
    out.update(derived)
    return out


def _wire_device(group, x):
    """The device of the exchange: x's, or (x not a tensor, on a rank that will raise) the backend's."""
    if isinstance(x, torch.Tensor):
        return x.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_group(group):
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"process_group: expected a torch.distributed.ProcessGroup, got {type(group).__name__}")
    return group


def _reads(check_shards, chunk_size) -> bool:
    """Whether `shard` reads the exchanged rows on the host: unless check_shards is False, and then
    also when chunk_size is None (the chunks are planned for the largest slice, which every rank must
    agree on)."""
    return check_shards is not False or chunk_size is None


def shard(group, start, local_size, device, check_shards, chunk_size, *, failed=None, rows=("rows", 0), agree=None,
          ranges=None, reduce_dx=True, dw_scale=1.0, record=None) -> ShardedVocab:
    """The ShardedVocab of this rank, after one all-gather of a small int64 row per rank: whether its
    local checks passed (`failed`: the exception they raised, or None), its (vocab_start, V_r), its
    row count (`rows`: (the argument holding them, count)), the least and largest of the values it
    checks against the group's vocab (`ranges`: {argument: (least, largest, check)}, `_RANGED`) and
    its `agree` options ({what: value}, encoded).

    The row is read on the host where `_reads`: a rank whose checks failed raises its error on every
    rank; rows or options that differ between ranks, slices that do not tile [0, V) without gaps or
    overlaps, or values outside [0, V) raise on every rank, naming what is wrong and where. One host
    sync a call. check_shards=False skips the read: then no host sync (with chunk_size set; V stays a
    device tensor), and a call that is wrong on some ranks only leaves the others waiting in a later
    collective."""
    if failed is None and check_shards is not None and not isinstance(check_shards, bool):
        failed = TypeError(f"check_shards: expected a bool or None, got {check_shards!r}")
    good = not isinstance(start, bool) and isinstance(start, int)
    # Nothing here may raise before the all-gather: this rank alone would, and the others would wait in it
    fits = good and -(2**63) <= start < 2**63
    if failed is None and good and not fits:
        failed = ValueError(f"vocab_start: expected an int64 value (the global id of this rank's first vocab row), "
                            f"got {shown(start)}")
    try:
        codes = [c for value in (agree or {}).values() for c in _encode(value)]
    except Exception as e:  # noqa: BLE001 (a value whose repr raises)
        failed, codes = failed or e, []
    if len(codes) > 2 * _SLOTS:
        raise AssertionError(f"{len(codes) // 2} options to agree on, room for {_SLOTS}")
    head = [int(failed is not None), start if fits else _NOT_AN_INT, local_size, rows[1]]
    head += [c for name in _RANGED for c in (ranges or {}).get(name, _NONE)[:2]]
    mine = torch.tensor(head + codes + [0] * (2 * _SLOTS - len(codes)), dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    every = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
    all_gather(every, mine, group)
    every = every.view(world, -1)
    layout = every[:, 1:3]
    read = _reads(check_shards, chunk_size)
    table = every.tolist() if read else None  # the call's one host sync
    if read:
        _raise_any_failure(group, table, failed)
    elif failed is not None:
        raise failed
    if not good:
        raise TypeError(f"vocab_start: expected an int (the global id of this rank's first vocab row), got {start!r}")
    if not read:
        return ShardedVocab(group, start, local_size, (layout[:, 0] + layout[:, 1]).max(), reduce_dx=reduce_dx,
                            dw_scale=dw_scale, record=record)
    _check_agreement(table, agree, rows, dist.get_rank(group))
    total = _check_layout([row[1:3] for row in table], dist.get_rank(group))
    _check_ranges(table, ranges or {}, total, agree, dist.get_rank(group))
    return ShardedVocab(group, start, local_size, total, plan_size=max(row[2] for row in table), reduce_dx=reduce_dx,
                        dw_scale=dw_scale, record=record)


_SLOTS = 64  # options `agree` may hold (two int64 each): the same width on every rank, whatever it calls
# The values a rank checks against the group's vocab V, which only the exchange gives (labels and a
# top-k teacher's ids are global ids), in the order an unsharded call checks them: the least and the
# largest of each in the row (`_NONE` where it checks none: checks off, no labels, no row that counts).
_RANGED = ("teacher_ids", "labels")
_NONE = (0, -1)
_HEAD = 4 + 2 * len(_RANGED)  # the row's columns before the options' codes
_FINE_HERE = "this rank's call was checked and fine, and raises with it so that no rank waits in a collective"
_ERRORS = {"TypeError": TypeError, "ValueError": ValueError}


def _encode(value) -> tuple[int, int]:
    """(kind, code) of an option value, equal on two ranks exactly when the values are (2 and 2.0 alike;
    strings, dtypes and tuples by a CRC-32 of their repr)."""
    if value is None:
        return 0, 0
    if isinstance(value, bool):
        return 1, int(value)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    if isinstance(value, int):  # past int64, by its bytes: its repr may be too long to make (4300 digits)
        if -(2**63) <= value < 2**63:
            return 2, value
        return 4, zlib.crc32(value.to_bytes(value.bit_length() // 8 + 1, "little", signed=True))
    if isinstance(value, float):
        return 3, struct.unpack("<q", struct.pack("<d", value))[0]
    return 4, zlib.crc32(repr(value).encode())


def _raise_any_failure(group, table, failed):
    """Every rank raises when a rank's local checks failed: that rank its own error, the others the
    first failing rank's, with its rank (a second collective, on this path only, carries the text)."""
    bad = [r for r, row in enumerate(table) if row[0]]
    if not bad:
        return
    said = [None] * len(table)
    dist.all_gather_object(said, None if failed is None else (type(failed).__name__, str(failed)), group=group)
    if failed is not None:
        raise failed
    kind, text = said[bad[0]]
    raise _ERRORS.get(kind, RuntimeError)(f"{text} (on rank {bad[0]} of process_group; {_FINE_HERE})")


def _check_ranges(table, ranges, total, agree, rank):
    """Every rank raises when a rank's labels or top-k ids fall outside the group's vocab [0, V): that
    rank its own check's error (as an unsharded call words it), the others one naming its rank."""
    for i, name in enumerate(_RANGED):
        least = -1 if name == "teacher_ids" else 0  # -1: an unused slot
        bad = [r for r, row in enumerate(table) if row[4 + 2 * i] < least or row[5 + 2 * i] >= total]
        if not bad:
            continue
        if rank in bad and name in ranges:
            ranges[name][2](total)  # raises this rank's own error
        lo, hi = table[bad[0]][4 + 2 * i : 6 + 2 * i]
        expected = (f"ids in [0, {total}) or -1 (unused slot)" if name == "teacher_ids"
                    else f"values in [0, {total}) or ignore_index={agree['ignore_index']}")
        raise ValueError(f"{name}: expected {expected}, got {lo if lo < least else hi} (on rank {bad[0]} of "
                         f"process_group; {_FINE_HERE})")


def _check_agreement(table, agree, rows, rank):
    """The same function, row count and options on every rank (their codes in table), else ValueError
    on every rank naming the first that differs."""
    items = list((agree or {}).items())
    checks = [(what, value, [_HEAD + 2 * i, _HEAD + 1 + 2 * i]) for i, (what, value) in enumerate(items)]
    checks.insert(min(1, len(checks)), (rows[0], rows[1], [3]))  # after the function: the rows are its
    for what, value, cols in checks:
        differ = [r for r, row in enumerate(table) if [row[c] for c in cols] != [table[0][c] for c in cols]]
        if not differ:
            continue
        if cols == [3]:
            raise ValueError(f"{what}: expected the same number of rows on every rank of process_group (the rows are "
                             f"replicated), got rank(s) {differ} with a number other than rank 0's; this rank's "
                             f"(rank {rank}): {value}")
        raise ValueError(f"{what}: expected the same value on every rank of process_group (every rank makes the same "
                         f"call), got one on rank(s) {differ} that differs from rank 0's; this rank's (rank {rank}): {shown(value)}")


def _check_layout(layout, rank) -> int:
    """The vocab size V of a group's [vocab_start, V_r] rows, which must tile [0, V)."""
    starts = [s for s, _ in layout]
    if _NOT_AN_INT in starts:
        bad = [r for r, s in enumerate(starts) if s == _NOT_AN_INT]
        raise TypeError(f"vocab_start: expected an int on every rank of process_group, got another type on rank(s) {bad}")
    shown = ", ".join(f"rank {r}: [{s}, {s + n})" for r, (s, n) in enumerate(layout))
    if any(s < 0 for s in starts):
        raise ValueError(f"vocab_start: expected a value >= 0 on every rank, got the vocab slices {shown}")
    if any(n < 1 for _, n in layout):
        raise ValueError(f"student_weight: expected at least one vocab row on every rank, got the vocab slices {shown}")
    end = 0
    for s, n in sorted(layout):
        if s != end:
            what = "a gap" if s > end else "an overlap"
            raise ValueError(
                f"vocab_start: expected the ranks' vocab slices to tile [0, V) without gaps or overlaps, got "
                f"{what} at id {min(s, end)} (this is rank {rank}; slices {shown})"
            )
        end = s + n
    return end


def check_replicas(group, named: dict):
    """Raise, on every rank, when a tensor that must be the same on every rank is not: one
    all-gather of a few fp64 fingerprints per tensor (sum, sum of squares, a position-weighted sum)."""
    names = [k for k, x in named.items() if x is not None]
    if not names:
        return
    prints = []
    for k in names:
        x = named[k].detach().reshape(-1).double()
        pos = torch.arange(x.numel(), device=x.device, dtype=torch.float64).remainder_(1009).add_(1)
        prints.append(torch.stack([x.sum(), (x * x).sum(), (x * pos).sum(), torch.tensor(float(x.numel()), device=x.device, dtype=torch.float64)]))
    mine = torch.stack(prints).reshape(-1)
    world = dist.get_world_size(group)
    every = torch.empty(world * mine.numel(), dtype=mine.dtype, device=mine.device)
    all_gather(every, mine, group)
    every = every.view(world, len(names), -1).cpu()
    for i, k in enumerate(names):
        differ = [r for r in range(world) if not torch.equal(every[r, i], every[0, i])]
        if differ:
            raise ValueError(
                f"{k}: expected the same tensor on every rank of process_group (the rows of a vocab-parallel "
                f"call are replicated), got one on rank(s) {differ} that differs from rank 0's"
            )
