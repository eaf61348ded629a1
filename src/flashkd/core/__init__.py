"""The core of flashkd: a loss call's parse, checks, plan, backend choice and chunk loop, and teacher_topk's loop.

    keywords the public functions' keywords: the one table (default, where each goes, which functions take
             it, its check, whether a slice's ranks agree on it) that the parse, the options' check, the
             modules and the agreement read; Sharding, the sharding keywords as passed
    call     the call as one frozen value (Call: LossSpec, Student, the teacher's form, Options) and its
             one parse (`parse`, `parse_teacher_topk`)
    checks   the tensors' checks, raised with the public names, flattened to `Rows`
    plan     the chunk plan and the memory formulas it keeps within
    backend  the backend choice and the row function of a plan, for the whole vocab or a slice
    loop     the chunk loop and its autograd Function
    gemms    its GEMMs: fp32 logits of narrow operands, the fp32 gradient accumulators, the CPU GEMM's operands
    learning a teacher that learns: its gradient buffers, where dL/dt goes, its two GEMMs a block
    mixture  several teachers' forms: each row's own head (routed), their distributions mixed per row (arithmetic)
    topk     teacher_topk's loop
    entry    `run(call, vocab=None)`: the one entry, check -> agree (a slice's ranks) -> plan -> loop

The layer below `flashkd.distributed`: it imports nothing of it, and runs a rank's slice of the vocab
through the `flashkd.losses.VocabSlice` it is given.
"""

from . import backend, call, checks, gemms, keywords, learning, loop, mixture, plan, topk
from .entry import run

__all__ = ["backend", "call", "checks", "gemms", "keywords", "learning", "loop", "mixture", "plan", "run", "topk"]
