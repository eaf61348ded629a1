"""Vocab-parallel calls: `process_group=` and `vocab_start=` on the public functions.

Each rank passes the same rows (hidden states, labels, top-k targets) and the rows
[vocab_start, vocab_start + V_r) of each head. The core validates the local tensors, then runs its
chunk loop with a `ShardedVocab`: the GEMMs give each rank its slice of every chunk's logits, the
torch row definition merges the row statistics over the group, dX is all-reduced, dW and db stay
the slice's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import chunks, teacher
from .vocab import ShardedVocab

# The exchanged layout row of a rank whose vocab_start is not an int (it raises with the others).
_NOT_AN_INT = -(1 << 62)


def run(call, **vocab_options):
    """A loss call with process_group (`flashkd.chunks.Call`); vocab_options go to the ShardedVocab
    (the FSDP route's)."""
    group = _check_group(call.process_group)
    rows = chunks.check(call)
    xs, ws, teacher = rows.xs, rows.ws, rows.teacher
    replicated = {"student_input": xs}  # a dense teacher's logits are the rank's own vocab columns
    if isinstance(call.teacher, chunks.Heads):
        replicated["teacher_input"] = teacher[0]
    elif isinstance(call.teacher, chunks.TopK):
        replicated.update(teacher_ids=teacher[0], teacher_logprobs=teacher[1])
    vocab = shard(group, call.vocab_start, ws.shape[0], xs.device, call.check_shards, call.chunk_size,
                  **vocab_options)
    if call.check_replicas:
        check_replicas(group, {**replicated, "labels": rows.y})
    chunks.check_teacher_values(call, rows, vocab.total)
    return chunks.run(call, rows, vocab)


def teacher_topk(call):
    """A `flashkd.teacher.TopKCall` with process_group: the group's layout exchanged once the local
    tensors are checked, every rank the same global top-k."""

    def sharded(local_size, device):
        check_shards = True if call.check_shards is None else call.check_shards
        return shard(_check_group(call.process_group), call.vocab_start, local_size, device, check_shards, None)

    return teacher.run(call, sharded)


def _check_group(group):
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"process_group: expected a torch.distributed.ProcessGroup, got {type(group).__name__}")
    return group


def shard(group, start, local_size, device, check_shards, chunk_size, **options) -> ShardedVocab:
    """The ShardedVocab of this rank, after one all-gather of every rank's (vocab_start, V_r).

    The layout is read on the host (and checked: the slices must tile [0, V) without gaps or
    overlaps) when check_shards is True, by default on CPU, and whenever chunk_size is None (the
    chunks are planned for the largest slice, which every rank must agree on). Otherwise the vocab's
    size V stays a device tensor and no host sync happens. Every rank raises the same error."""
    if check_shards is not None and not isinstance(check_shards, bool):
        raise TypeError(f"check_shards: expected a bool or None, got {check_shards!r}")
    good = not isinstance(start, bool) and isinstance(start, int)
    mine = torch.tensor([start if good else _NOT_AN_INT, local_size], dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    layout = torch.empty(world * 2, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(layout, mine, group=group)
    layout = layout.view(world, 2)
    if not good:
        raise TypeError(f"vocab_start: expected an int (the global id of this rank's first vocab row), got {start!r}")
    read = check_shards or (check_shards is None and device.type == "cpu") or chunk_size is None
    if not read:
        return ShardedVocab(group, start, local_size, (layout[:, 0] + layout[:, 1]).max(), **options)
    total = _check_layout(layout.tolist(), dist.get_rank(group))
    return ShardedVocab(group, start, local_size, total, plan_size=int(layout[:, 1].max()), **options)


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
    dist.all_gather_into_tensor(every, mine, group=group)
    every = every.view(world, len(names), -1).cpu()
    for i, k in enumerate(names):
        differ = [r for r in range(world) if not torch.equal(every[r, i], every[0, i])]
        if differ:
            raise ValueError(
                f"{k}: expected the same tensor on every rank of process_group (the rows of a vocab-parallel "
                f"call are replicated), got one on rank(s) {differ} that differs from rank 0's"
            )
