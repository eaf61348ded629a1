"""Several teachers in one call, two teacher forms of the chunk loop (`flashkd.teachers`):

routed (combine="routed"): each row's own teacher, the rows grouped by teacher: the loop cuts its teacher blocks at
the groups' starts too (`routed_blocks`), so that a block's logits are one teacher's GEMM (`routed_block`): the
teachers' GEMMs over their own rows only, the student's over all rows once, one dW accumulation; a block holds
only its own (Rt, V) logits, as the heads form's does (the plan's blocks as large).

arithmetic (combine="arithmetic"): p = Σ_m w_m softmax(z_m / τ), the teachers' distributions mixed per row.

Why in the core: log p needs each teacher's row statistics (its logsumexp at τ), which one head's logits do not
carry, so it is made where the loop makes a teacher's block of logits, from the M heads in turn:

    for each teacher m:  z = σ_m-and-softcap_m(Xt_m[b] Wt_m^T + bt_m) / τ  (fp32, `loop.linear`)
                         z ← z − logsumexp(z) + log w_m                      (log of w_m · its softmax)
                         acc ← logaddexp(acc, z)                             (log Σ so far)
    the block's teacher logits: τ · acc   (the rows divide by τ again: log p, already normalised)

A block costs M teacher GEMMs (as M calls of the heads form would) and holds acc and one teacher's z, fp32 (Rt, V)
each, beside logsumexp's own temporary: the plan gives it blocks of a third of the heads form's rows (`plan.make`).
On the Triton backend the three lines under the GEMM are one kernel reading z twice and acc once
(`flashkd.backends.triton_mixture`), where torch's ops make ~7 passes over the block.
The teachers are constants. Zero weights give log w = −inf: that teacher adds nothing to its row."""

from __future__ import annotations

import itertools
import math

import torch

from ..losses import logit_transform
from .checks import check_teacher_heads, renamed

# fp32 (Rt, V) tensors a block holds: the running log-mixture, one teacher's logits, logsumexp's temporary
TEMPORARIES = 3


def _heads(xs, student_input, ws, t, vocab_size, own_rows=False) -> tuple:
    """Each teacher's (hidden states, head, bias) checked as the heads form's (errors naming teacher_inputs[m],
    teacher_heads[m], teacher_biases[m]), flattened and cut to the student's V: three tuples. own_rows: each
    teacher's hidden states are its own rows only (their leading dims are not student_input's)."""
    out = []
    for m, (x, w, b) in enumerate(zip(t.teacher_inputs, t.teacher_heads, t.teacher_biases)):
        names = teacher_names(m)
        try:
            out.append(check_teacher_heads(xs, x if own_rows else student_input, ws, x, w, b, vocab_size))
        except (TypeError, ValueError) as e:
            raise renamed(e, names) from None
    return tuple(map(tuple, zip(*out)))


def teacher_names(m: int) -> dict:
    """One call's teacher arguments as the several teachers' call names its m-th (for `checks.renamed`)."""
    return {"teacher_input": f"teacher_inputs[{m}]", "teacher_weight": f"teacher_heads[{m}]",
            "teacher_bias": f"teacher_biases[{m}]"}


def check(xs, student_input, ws, t, vocab_size) -> tuple:
    """The mixture's heads (`_heads`) and its weights, (N, M) or M floats."""
    inputs, heads, biases = _heads(xs, student_input, ws, t, vocab_size)
    weights = t.teacher_weights
    if isinstance(weights, torch.Tensor):
        weights = weights.reshape(xs.shape[0], len(heads))
    return inputs, heads, biases, weights, tuple(t.scales), tuple(t.softcaps)


def block(teacher: tuple, c: slice, tau: float, linear, mix=None) -> torch.Tensor:
    """The teacher logits of rows c: τ · log Σ_m w_m softmax(z_m / τ), (R, V) fp32 (fp64 for fp64 inputs).
    mix: None (torch), or a kernel that mixes one teacher's fp32 logits into the block in two reads of them
    (`flashkd.backends.triton_mixture.mix_`, the Triton backend's)."""
    inputs, heads, biases, weights, scales, softcaps = teacher
    acc = None
    for m in range(len(heads)):
        z = linear(inputs[m][c], heads[m], biases[m])  # a new tensor: changed in place below
        z = logit_transform(z, scales[m], softcaps[m])  # new too, where it changes z
        # log w_m: the rows' own (R,), or one float (−inf for a zero weight: the teacher adds nothing)
        log_w = weights[c, m].to(z.dtype).log() if isinstance(weights, torch.Tensor) else \
            math.log(weights[m]) if weights[m] > 0 else -math.inf
        if mix is not None:  # the last teacher's pass writes the mixture times τ
            acc = mix(acc, z.contiguous(), log_w, tau, m == len(heads) - 1)
            continue
        if tau != 1.0:
            z.div_(tau)
        if isinstance(log_w, torch.Tensor):
            log_w = log_w[:, None]
        z -= z.logsumexp(-1, keepdim=True) - log_w
        acc = z if acc is None else torch.logaddexp(acc, z, out=acc)
    return acc if mix is not None else acc.mul_(tau)


def check_routed(xs, ws, t, vocab_size) -> tuple:
    """The routed teachers' heads (`_heads`, each its own rows) and their row counts' starts (M + 1 ints)."""
    inputs, heads, biases = _heads(xs, None, ws, t, vocab_size, own_rows=True)
    return inputs, heads, biases, (0, *itertools.accumulate(t.counts)), tuple(t.scales), tuple(t.softcaps)


def routed_blocks(teacher: tuple, c: slice, rows: int):
    """The teacher blocks of chunk c: at most `rows` rows each, cut at the groups' starts as well (each block is
    one teacher's rows)."""
    starts = teacher[3]
    cuts = sorted({*range(c.start, c.stop, rows), *(x for x in starts if c.start < x < c.stop), c.stop})
    return [slice(a, b) for a, b in itertools.pairwise(cuts)]


def routed_block(teacher: tuple, c: slice, linear) -> torch.Tensor:
    """The teacher logits of rows c, all of one teacher's group (`routed_blocks`): its head's GEMM and transform."""
    inputs, heads, biases, starts, scales, softcaps = teacher
    m = max(i for i in range(len(heads)) if starts[i] <= c.start)
    if c.stop > starts[m + 1]:
        raise AssertionError(f"a routed block spans two teachers' rows: {c} across {starts[m + 1]}")
    return logit_transform(linear(inputs[m][c.start - starts[m]:c.stop - starts[m]], heads[m], biases[m]), scales[m],
                           softcaps[m])
