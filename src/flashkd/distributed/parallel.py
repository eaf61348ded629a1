"""Vocab-parallel calls: `process_group=` and `vocab_start=` on the public functions.

Each rank passes the same rows (hidden states, labels, top-k targets) and the rows
[vocab_start, vocab_start + V_r) of each head. A call here is one call of the core's entry
(`flashkd.core.run`) with this rank's `ShardedVocab` (its sharding keywords were parsed with the
call, `sharding.check_keywords`): the entry checks the local tensors, has the slice agree across
the ranks (`ShardedVocab.agree`: one exchange, `agreement`), plans and runs the loop. The GEMMs give
each rank its slice of every chunk's logits, the row backend (the Triton rows' phases, with the
slice's exchanges between them, or the torch row definition on the slice's reductions) merges the
row statistics over the group, dX is all-reduced, dW and db stay the slice's.
"""

from __future__ import annotations

import torch.distributed as dist

from .. import core
from .agreement import wire_device, layout
from .sharding import Sharding
from .vocab import ShardedVocab


def run(call, sharding: Sharding, *, reduce_dx=True, dw_scale=1.0, record=None):
    """A call (`flashkd.core.call.Call`, a loss's or teacher_topk's) with process_group, run by the core's
    entry on this rank's slice; reduce_dx, dw_scale, record: the ShardedVocab's (the FSDP route's)."""
    group = _check_group(sharding.process_group)
    return core.run(call, ShardedVocab(group, sharding, reduce_dx=reduce_dx, dw_scale=dw_scale, record=record))


def fail(error: Exception, process_group, vocab_start, rows):
    """Raise error on every rank of process_group: this rank's call failed where it was made, before
    its checks here (`flashkd.distributed.fail`)."""
    group = _check_group(process_group)
    layout(group, vocab_start, 0, wire_device(group, rows), None, None, failed=error)
    raise AssertionError("layout returned with a failed check")  # it raises `error` on this rank


def _check_group(group):
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"process_group: expected a torch.distributed.ProcessGroup, got {type(group).__name__}")
    return group
