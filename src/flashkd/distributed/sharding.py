"""How a call is spread over ranks: the public functions' sharding keywords, beside the core's call."""

from __future__ import annotations

from ..core.keywords import Sharding
from ..losses import shown

__all__ = ["Sharding", "check_keywords"]  # Sharding: the sharding keywords' values, made by the parse's table


def check_keywords(sharding: Sharding) -> None:
    """The sharding keywords that need no tensor, checked with the call's parse, before any work (with a
    process group its error is raised on every rank of it there: `flashkd.distributed.fail`)."""
    process_group, vocab_start, check_shards = sharding.process_group, sharding.vocab_start, sharding.check_shards
    if process_group is None:  # a DTensor head's: its mesh's exchange checks them, where it has one
        return
    if check_shards is not None and not isinstance(check_shards, bool):
        raise TypeError(f"check_shards: expected a bool or None, got {check_shards!r}")
    if isinstance(vocab_start, bool) or not isinstance(vocab_start, int):
        raise TypeError(f"vocab_start: expected an int (the global id of this rank's first vocab row), got {vocab_start!r}")
    if not -(2**63) <= vocab_start < 2**63:
        raise ValueError(f"vocab_start: expected an int64 value (the global id of this rank's first vocab row), "
                         f"got {shown(vocab_start)}")
