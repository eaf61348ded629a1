"""How a call is spread over ranks: the public functions' sharding keywords, beside the core's call."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Sharding:
    """The sharding keywords of one call (`flashkd.distributed`'s docstring says what each does).
    fsdp_gather is checked where the call is made (`flashkd.distill`); the others at the group's
    exchange (`parallel.shard`), on every rank alike."""

    process_group: object = None  # a torch.distributed.ProcessGroup: vocab-parallel heads
    vocab_start: int | None = None  # the global id of this rank's first vocab row
    check_shards: bool | None = None
    check_replicas: bool = False
    fsdp_gather: str = "auto"  # a DTensor head's route: "auto", "rows" or "heads"
