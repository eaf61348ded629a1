"""The Triton row kernel's phases over vocab slices, run one rank after another in this process: what the
vocab-parallel collectives would exchange, without a process group (tests/test_triton_rows.py,
tests/test_triton_divergences.py)."""

import torch

from flashkd.backends import triton_rows


class _Stop(Exception):
    """A slice's call reached a collective whose inputs the other slices have not given yet."""


class _Slice:
    """One rank's `ShardedVocab`, as `rows` uses it, for the ranks run one after another in this process:
    a collective with no result yet keeps this rank's part and stops the call, which is then run again with
    the result made from every rank's part (`sharded`)."""

    def __init__(self, start, gathered=None, summed=None):
        self.start, self.gathered, self.summed, self.part = start, gathered, summed, None

    def gather_rows(self, part):
        if self.gathered is None:
            self.part = part.clone()
            raise _Stop
        return self.gathered

    def sum_rows(self, x):
        if self.summed is None:
            self.part = x.clone()
            raise _Stop
        x.copy_(self.summed)


def sharded(s, t, labels, spec, scale, grad, bounds):
    """(soft, hard, dL/ds) of rows(..., vocab=) on the column slices `bounds` of s and t, one rank each:
    the all-gather of pass 1's statistics, and the all-reduce of pass 2's sums where the loss needs it."""
    def run(i, gathered=None, summed=None):
        a, b = bounds[i]
        vocab, x = _Slice(a, gathered, summed), s[:, a:b].contiguous()
        try:
            return (*triton_rows.rows(x, t[:, a:b].contiguous(), labels, spec, scale, grad, vocab=vocab), x)
        except _Stop:
            return vocab.part

    gathered = torch.stack([run(i) for i in range(len(bounds))])
    outs = [run(i, gathered) for i in range(len(bounds))]
    if isinstance(outs[0], torch.Tensor):  # phase 3 follows the all-reduce of pass 2's sums
        summed = torch.stack(outs).sum(0)
        outs = [run(i, gathered, summed) for i in range(len(bounds))]
    for soft, hard, _ in outs[1:]:  # every rank has the whole rows' losses
        assert torch.equal(soft, outs[0][0]) and torch.equal(hard, outs[0][1])
    order = sorted(range(len(bounds)), key=lambda i: bounds[i][0])
    return outs[0][0], outs[0][1], torch.cat([outs[i][2] for i in order], 1)
