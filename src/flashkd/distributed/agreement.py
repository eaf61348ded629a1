"""A vocab slice's agreement: what its ranks exchange once a call, before any collective of the loop.

Why a module of its own: every rank must issue the same collectives in the same order, so a call
wrong on some ranks only must raise on all of them instead of leaving the others waiting. `agree`
(the `ShardedVocab.agree` the core's entry calls) puts each rank's check status, vocab_start, V_r,
row count, the least and largest of the values it checks against the group's vocab, and its options
(encoded) into one all-gather of a small int64 row, read on the host (`layout`); the errors are
worded as an unsharded call words them, the others naming the rank.
"""

from __future__ import annotations

import struct
import zlib

import torch
import torch.distributed as dist

from ..core import call as calls
from ..core import keywords
from ..losses import shown
from .sharding import Sharding


# torch 2.13 renamed the tensor collectives, and the old names warn (FutureWarning) there; 2.11 has only the
# old names. Looked up at each call, so a wrapper set on torch.distributed (the bench's byte count) sees it.
def all_gather(out, x, group):
    """out: every rank's x, in rank order, along dim 0 (one all-gather)."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x, group=group)


def reduce_scatter(out, x, group):
    """out: this rank's 1/world of x along dim 0, summed over the ranks (one reduce-scatter)."""
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, x, group=group)


def agree(group, sharding: Sharding, call, rows, backend, ranged: dict, failed) -> tuple:
    """(vocab_start, V_r, V, the group's largest V_r, whether the values of `ranged` were checked against
    V here) of this rank, once every rank's call agrees: `failed`, this rank's failed check (rows and
    backend then None), raised on every rank; the options, the row count and the layout agreed; `ranged`
    ({argument: (values, rows that count, check(V))}, `flashkd.core.checks.ranged`) checked against the
    group's vocab; with check_replicas, the replicated rows compared."""
    form = call.teacher.form
    check_shards = sharding.check_shards
    chunk_size = call.options.chunk_size
    if form == "teacher_topk":  # its layout is always read: its chunks and its ids are the group's
        check_shards, chunk_size = True if check_shards is None else check_shards, None
    read = _reads(check_shards, chunk_size)
    local_size = count = 0
    agreed = ranges = None
    if failed is None:
        try:
            agreed = _agreed(call, sharding, rows, backend)
            if read:
                ranges = {k: (*_extremes(x, counted), check) for k, (x, counted, check) in ranged.items()}
            local_size, count = rows.ws.shape[0], rows.xs.shape[0]
        except Exception as e:  # noqa: BLE001 (raised on every rank by layout)
            failed = e
    name, first = next(iter(calls.tensors(call, calls.ROWS).items()))  # the hidden states
    start, local_size, total, plan_size = layout(
        group, sharding.vocab_start, local_size, wire_device(group, first), check_shards, chunk_size, failed=failed,
        rows=(name, count), agree=agreed, ranges=ranges)
    if sharding.check_replicas:
        replicated = {"student_input": rows.xs}  # a dense teacher's logits are the rank's own vocab columns
        if form == "heads":
            replicated["teacher_input"] = rows.teacher[0]
        elif form == "topk":
            replicated.update(teacher_ids=rows.teacher[0], teacher_logprobs=rows.teacher[1])
        check_replicas(group, {**replicated, "labels": rows.y})
    return start, local_size, total, plan_size, read


# The exchanged layout row of a rank whose vocab_start is not an int (it raises with the others).
_NOT_AN_INT = -(1 << 62)


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



def _agreed(call, sharding: Sharding, rows, backend) -> dict:
    """{what: value} every rank of the call must agree on (encoded for `layout`'s one all-gather): the
    function, its keywords that the keyword table marks agreed (`flashkd.core.keywords.agreed`: what
    changes the loss, which collectives run, or what a check after the exchange reads), under their public
    names, and the facts derived from the checked rows that can differ from rank to rank (the backend
    among them)."""
    form = call.teacher.form
    out = {"function": keywords.FUNCTION_OF_FORM[form], **keywords.agreed(call, sharding)}
    if form == "teacher_topk":
        out.update({"k": call.teacher.k, "teacher_input's dtype": rows.xs.dtype,
                    "teacher_input's hidden size": rows.xs.shape[-1]})
        return out
    xs, ws, bs = rows.xs, rows.ws, rows.bs
    grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (xs, ws, bs))
    # the hidden sizes: dX's all-reduce is R·Hs a chunk (ranks that differ abort in it); the rows are replicated
    # the row backend's collectives differ: all ranks alike (dense rows of some losses: the torch rows)
    out.update({"backend": backend, "student_input's dtype": xs.dtype, "student_input's hidden size": xs.shape[1],
                "teacher_input's hidden size": rows.teacher[0].shape[1] if form == "heads" else None,
                "labels given": rows.y is not None,
                "row_weight given": call.student.row_weight is not None,
                "gradients (grad mode, requires_grad; of student_input)": (grad, grad and xs.requires_grad),
                "teacher_ids' k": rows.teacher[0].shape[-1] if form == "topk" else None})
    return out


def wire_device(group, x):
    """The device of the exchange: x's, or (x not a tensor, on a rank that will raise) the backend's."""
    if isinstance(x, torch.Tensor):
        return x.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reads(check_shards, chunk_size) -> bool:
    """Whether `layout` reads the exchanged rows on the host: unless check_shards is False, and then
    also when chunk_size is None (the chunks are planned for the largest slice, which every rank must
    agree on)."""
    return check_shards is not False or chunk_size is None


def layout(group, start, local_size, device, check_shards, chunk_size, *, failed=None, rows=("rows", 0), agree=None,
           ranges=None) -> tuple:
    """(vocab_start, V_r, V, the group's largest V_r) of this rank, after one all-gather of a small int64 row per rank: whether its
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
        return start, local_size, (layout[:, 0] + layout[:, 1]).max(), local_size
    _check_agreement(table, agree, rows, dist.get_rank(group))
    total = _check_layout([row[1:3] for row in table], dist.get_rank(group))
    _check_ranges(table, ranges or {}, total, agree, dist.get_rank(group))
    return start, local_size, total, max(row[2] for row in table)


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
    all-gather of a few fp64 fingerprints per tensor (of its finite values: sum, sum of squares, a
    position-weighted sum; its size; position-weighted sums of where it is NaN, +inf and -inf)."""
    names = [k for k, x in named.items() if x is not None]
    if not names:
        return
    prints = []
    for k in names:
        x = named[k].detach().reshape(-1).double()
        pos = torch.arange(x.numel(), device=x.device, dtype=torch.float64).remainder_(1009).add_(1)
        # the non-finite values apart: one NaN made every sum NaN, hiding any other difference in the tensor
        finite = torch.where(torch.isfinite(x), x, 0.0)
        odd = [(torch.isnan(x) * pos).sum(), ((x == torch.inf) * pos).sum(), ((x == -torch.inf) * pos).sum()]
        size = torch.tensor(float(x.numel()), device=x.device, dtype=torch.float64)
        prints.append(torch.stack([finite.sum(), (finite * finite).sum(), (finite * pos).sum(), size, *odd]))
    mine = torch.stack(prints).reshape(-1)
    world = dist.get_world_size(group)
    every = torch.empty(world * mine.numel(), dtype=mine.dtype, device=mine.device)
    all_gather(every, mine, group)
    every = every.view(world, len(names), -1).cpu()
    # NaN == NaN is False (huge finite values can still sum to one): where both are NaN they agree, so that the
    # same tensor on every rank is never reported as differing, rank 0 from itself
    same = (every == every[:1]) | (every.isnan() & every[:1].isnan())
    for i, k in enumerate(names):
        differ = [r for r in range(world) if not bool(same[r, i].all())]
        if differ:
            raise ValueError(
                f"{k}: expected the same tensor on every rank of process_group (the rows of a vocab-parallel "
                f"call are replicated), got one on rank(s) {differ} that differs from rank 0's"
            )

