"""The Triton row kernel's phases over vocab slices, run one rank after another in this process: what the
vocab-parallel collectives would exchange, without a process group (tests/test_triton_rows.py,
tests/test_triton_divergences.py)."""

import torch

from flashkd.backends import triton_rows


def sharded(s, t, labels, spec, scale, grad, bounds):
    """(soft, hard, dL/ds) of `sliced_rows` on the column slices `bounds` of s and t, one rank each: the
    all-gather of pass 1's statistics, and the all-reduce of pass 2's sums where the loss needs it, made
    here from every slice's part."""
    xs = [s[:, a:b].contiguous() for a, b in bounds]
    steps = [triton_rows.sliced_rows(x, t[:, a:b].contiguous(), labels, spec, scale, grad, start=a)
             for x, (a, b) in zip(xs, bounds)]
    asked = [next(step) for step in steps]  # every slice's pass 1 statistics: ("gather", parts)
    done = [None] * len(steps)
    while True:
        what = {kind for kind, _ in asked}
        assert len(what) == 1, what  # every rank asks for the same exchange
        kind = what.pop()
        parts = [part for _, part in asked]
        result = torch.stack(parts) if kind == "gather" else torch.stack(parts).sum(0)
        asked = []
        for i, step in enumerate(steps):
            try:
                asked.append(step.send(result.clone() if kind == "sum" else result))
            except StopIteration as stop:
                done[i] = stop.value
        if not asked:
            break
        assert len(asked) == len(steps)
    outs = [(*out, x) for out, x in zip(done, xs)]
    for soft, hard, _ in outs[1:]:  # every rank has the whole rows' losses
        assert torch.equal(soft, outs[0][0]) and torch.equal(hard, outs[0][1])
    order = sorted(range(len(bounds)), key=lambda i: bounds[i][0])
    return outs[0][0], outs[0][1], torch.cat([outs[i][2] for i in order], 1)
