"""How a call is spread over ranks: the public functions' sharding keywords, beside the core's call."""

from __future__ import annotations

import dataclasses

from ..losses import shown


@dataclasses.dataclass(frozen=True)
class Sharding:
    """The sharding keywords of one call (`flashkd.distributed`'s docstring says what each does). Their
    types are checked where the call is parsed (`flashkd.distill`, `check_keywords`); the values that
    only the group knows (the layout, the same options on every rank) at its exchange (`agreement`)."""

    process_group: object = None  # a torch.distributed.ProcessGroup: vocab-parallel heads
    vocab_start: int | None = None  # the global id of this rank's first vocab row
    check_shards: bool | None = None
    check_replicas: bool = False
    fsdp_gather: str = "auto"  # a DTensor head's route: "auto", "rows" or "heads"


def check_keywords(process_group, vocab_start, check_shards) -> None:
    """The sharding keywords that need no tensor, checked with the call's parse, before any work (with a
    process group its error is raised on every rank of it there: `flashkd.distributed.fail`)."""
    if process_group is None:  # a DTensor head's: its mesh's exchange checks them, where it has one
        return
    if check_shards is not None and not isinstance(check_shards, bool):
        raise TypeError(f"check_shards: expected a bool or None, got {check_shards!r}")
    if isinstance(vocab_start, bool) or not isinstance(vocab_start, int):
        raise TypeError(f"vocab_start: expected an int (the global id of this rank's first vocab row), got {vocab_start!r}")
    if not -(2**63) <= vocab_start < 2**63:
        raise ValueError(f"vocab_start: expected an int64 value (the global id of this rank's first vocab row), "
                         f"got {shown(vocab_start)}")
