"""The chunk plan: rows per chunk and teacher rows at a time, from a memory budget and a cost model.

Why a module of its own: the plan is the one place where the loop's memory is bounded, so its
formulas (below) and the code that keeps within them (`chunk_rows`, `peak_bytes`, `accum_share`) are
read together; tests and benchmarks check the formulas against measured peaks.

Extra memory, bytes, beyond the inputs (E = element size of the inputs, L = 4 for bf16 / fp16 inputs,
else E: the logits' element size):
    logits:  R·V·L + Rt·V·L with teacher heads (Rt = R unless the plan splits a chunk's teacher
             logits); R·V·L for dense teacher logits, which are read in place, and for a top-k
             teacher; + R·V·E for dL/dS in the inputs' dtype when L ≠ E and the teacher is top-k (else
             dL/dS takes half of S's own bytes, `triton_rows.grad_view`); + backend temporaries (torch:
             ≈ 6·R·V·4, + R·V·4 with labels; triton: none beyond O(R·K); cute: + 20·R·⌈V/128⌉ for the vocab
             tiles' statistics, 1/26 of R·V·L); + R·Hs·E with labels (the chunk's rows of Xs, ignored rows
             zeroed)
    grads:   N·Hs·E (dXs) + V·Hs·A (dWs accumulator: A = 4 for fp32, A = E when all rows fit one
             chunk or grad_accum_dtype is the weight's dtype), made for the first chunk's dW GEMM,
             once its teacher logits are freed; rounded to V·Hs·E after the loop (no copy when A = E)
    peak:    one chunk   N·Hs·E + max(logits, D)   (D: dL/dS and dW. dL/dS in its own buffer: R·V·E + V·Hs·E;
                         inside S's bytes: min(R·V·L + V·Hs·E, R·V·E + max(R·V·L, V·Hs·E)), as it
                         is moved out of them, freeing S before dW is made, where V·Hs·E > R·V·E)
             chunks      N·Hs·E + max(logits + V·Hs·A,  V·Hs·(A + E))    (second term only when A ≠ E)
             (`peak_bytes`; without dW wanted, V·Hs terms are 0)
    a learning teacher (losses.LEARNING_LOSSES, teacher tensors requiring grad; dL/dT written over its logits), on top:
             N·Ht·E (dXt) + V·Ht·A (dWt accumulator; A = E when all rows fit one block; or, where N·E ≤ Ht·A,
             N·V·E: every row's dL/dT, dWt one GEMM after the loop, `learning.defers`) + V·4 (dbt), held for
             the loop, + Rt·V·E for a block's dL/dT rounded to the inputs' dtype when L ≠ E (an upper bound:
             made once the rows' temporaries are freed); the torch rows' autograd temporaries no more than the
             loss's own with a constant teacher (co_jeffreys: jeffreys' peak; mutual: less), the Triton rows none.
             `peak_bytes(..., learning=(Ht, A))`
    a mixture of M teacher heads (`flashkd.core.mixture`): its blocks hold 3·Rt·V·L (the running log-mixture, one
             teacher's logits, logsumexp's temporary) with Rt a third of the heads form's, planned as one head of
             hidden size ΣHt_m
The default plan (triton) keeps R·V·L + Rt·V·L within 1 GiB, in equal chunks with R = Rt; or, when that
takes more than one chunk and the weight's gradient is wanted, all N rows in one chunk (with teacher
heads, their logits in two blocks of ceil(N/2) rows) if its peak is no higher: its dW is then one
GEMM, with no accumulation. With teacher heads and a dW accumulator, a cost model then weighs each
chunk's accumulator traffic (2·V·Hs·A bytes, read and written) against its GEMMs (2·R·V·(3·Hs + Ht)
FLOPs) at the GPU's FLOPs per byte (`ACCUM_BALANCE`): where the traffic is over `ACCUM_SHARE` of the
GEMMs' time, chunks grow, in whole row tiles, up to `ACCUM_GROWTH` × the budget, until it is not
(`accum_share`). A narrow student under a wide vocab pays it most: Gemma-3's 2560 ← 3840 at V = 262144,
16 chunks of 512 rows → 8 of 1024.
Backward scales the saved grads by grad_output in place (no host sync, no copy); only when the graph
is retained (retain_graph=True, gradcheck) does it return new tensors, another
N·Hs·E + V·Hs·E. Nothing of size N × V is ever allocated. The gradients are first order: a backward
with create_graph=True raises.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..losses import LEARNING_LOSSES, LossSpec, VocabSlice
from . import backend as backends, mixture
from .learning import defers


# Default memory for one chunk's logits. Bigger chunks make the GEMMs more efficient; past a few
# thousand rows they stop getting faster. The torch backend also keeps fp32 autograd temporaries.
LOGITS_BUDGET = {"triton": 1 << 30, "torch": 512 << 20}
# The cost model of the chunk plan (`accum_share`): an H200's bf16 GEMM rate over its copy bandwidth
# (≈ 700 TFLOP/s over ≈ 4.3 TB/s, as measured there), the share of a chunk's GEMM time its dW
# accumulator's traffic may take before chunks grow, and how far (× LOGITS_BUDGET) they may grow for it.
ACCUM_BALANCE, ACCUM_SHARE, ACCUM_GROWTH = 160.0, 0.15, 2


@dataclasses.dataclass(frozen=True)
class Plan:
    spec: LossSpec
    chunk: int
    backend: str
    grad_accum_dtype: torch.dtype
    form: str  # the teacher's input form: "heads" (Xt, Wt, bt), "logits" (T,) or "topk" (ids, logprobs)
    teacher_chunk: int  # rows of teacher logits computed at a time within a chunk (heads only)
    stats: bool = False  # also sum the DistillStats
    vocab: VocabSlice | None = None  # a rank's slice of the vocab (flashkd.distributed.ShardedVocab); None: all of it
    # top-k with teacher_index: DistillStats.per_teacher's (N,) index (−1: no teacher) and its number of teachers
    teacher_index: torch.Tensor | None = dataclasses.field(default=None, compare=False)
    num_teachers: int = 0
    # "cute": the logits GEMMs of teacher heads on CuTe DSL, with pass 1's statistics in their epilogue,
    # and the fp32 dW's chunk GEMMs (`flashkd.backends.cute_gemm`), where `backend.cute_fits`; else (and "cublas")
    # torch.mm
    gemm: str = "cublas"
    # the teacher learns (`learns`): its heads' tensors are the autograd function's differentiable inputs
    learns: bool = False


def learns(call, teacher: tuple, vocab=None) -> bool:
    """Whether the call's teacher learns: a loss of LEARNING_LOSSES, in grad mode, on teacher tensors of
    which one requires grad; their gradients then come from the same pass as the student's (two more
    GEMMs a block). For every other loss the teacher is a constant, whatever it requires. Where such a
    teacher cannot learn (dense logits, an FP8 head, a vocab slice) the call is refused, not silently
    given a constant teacher."""
    if call.spec.kind not in LEARNING_LOSSES or not torch.is_grad_enabled():
        return False
    if not any(isinstance(x, torch.Tensor) and x.requires_grad for x in teacher):
        return False
    loss = f"loss={call.spec.loss!r}"
    if call.teacher.form == "logits":
        raise ValueError(f"teacher_logits: {loss} gives the teacher a gradient, which the dense-logits form does not "
                         "(its N x V gradient is what the fused losses never hold); got teacher_logits that require "
                         "grad. Pass the teacher's hidden states and head to flashkd.fused_linear_distill, or "
                         "teacher_logits.detach() for a constant teacher")
    if call.options.teacher_precision is not None:
        raise ValueError(f"teacher_precision: expected None with {loss} and a teacher that requires grad (an FP8 "
                         f"head has no gradient), got {call.options.teacher_precision!r}")
    if vocab is not None:
        raise ValueError(f"process_group: {loss} with a teacher that requires grad runs on one process only (its "
                         "gradients over a vocab slice are not summed over the group); detach the teacher's "
                         "tensors, or call without process_group")
    return True


def make(call, rows, backend: str, learning: bool, vocab: VocabSlice | None = None) -> Plan:
    """The plan of a checked call: its dW accumulator's dtype (grad_accum_dtype checked against the
    weight's), its chunks (`chunk_rows`; a slice plans for the group's largest slice, `vocab.plan_size`,
    so that every rank runs the same chunks) and its logits GEMMs (`backend.gemm_of`)."""
    spec, form, options = call.spec, call.teacher.form, call.options
    xs, ws = rows.xs, rows.ws
    wide = torch.promote_types(ws.dtype, torch.float32)
    grad_accum_dtype = wide if options.grad_accum_dtype is None else options.grad_accum_dtype
    # Only these two: another would round dW to a format it does not have (fp16 for bf16 weights), or
    # ask cuBLAS for an output dtype it does not offer (fp64 from fp32 operands).
    if grad_accum_dtype not in (wide, ws.dtype):
        raise TypeError(f"grad_accum_dtype: expected {wide} or student_weight's dtype {ws.dtype}, got {grad_accum_dtype!r}")
    want_dw = torch.is_grad_enabled() and ws.requires_grad
    accum_bytes = grad_accum_dtype.itemsize if want_dw else 0
    v = ws.shape[0] if vocab is None else vocab.plan_size
    if form == "mixture":  # planned as teacher heads of ΣHt, in blocks a third as large (`flashkd.core.mixture`)
        chunk, teacher_chunk = chunk_rows(options.chunk_size, xs, ws, backend, "heads", accum_bytes, v,
                                          sum(x.shape[-1] for x in rows.teacher[0]))
        teacher_chunk = -(-teacher_chunk // mixture.TEMPORARIES)
    elif form == "routed":  # planned as the widest teacher's head (its blocks one teacher's, `mixture.routed_blocks`)
        chunk, teacher_chunk = chunk_rows(options.chunk_size, xs, ws, backend, "heads", accum_bytes, v,
                                          max(x.shape[-1] for x in rows.teacher[0]))
    else:
        ht = rows.teacher[0].shape[-1] if form == "heads" else 0
        # a learning teacher whose dWt is made once after the loop (`learning.defers`) adds no accumulator traffic
        accumulates = learning and not defers(xs.shape[0], ht, xs.element_size(), grad_accum_dtype.itemsize, True)
        chunk, teacher_chunk = chunk_rows(options.chunk_size, xs, ws, backend, form, accum_bytes, v, ht, accumulates)
    return Plan(spec, chunk, backend, grad_accum_dtype, form, teacher_chunk, options.return_stats, vocab, rows.index,
                rows.teachers, backends.gemm_of(call, backend, xs), learning)


def logit_size(dtype: torch.dtype) -> int:
    """Bytes of a logit (`linear`): fp32 for narrow inputs, else the inputs' element size."""
    return max(dtype.itemsize, 4)


def chunk_rows(chunk_size, xs, ws, backend, form, accum_bytes, v=None, teacher_hidden=0,
               learning=False) -> tuple[int, int]:
    """(rows per chunk, teacher rows at a time): chunk_size for both, or the plan in the module's doc.
    accum_bytes: element size of the dW accumulator; 0 when dW is not wanted. v: the vocab rows to
    plan for (the weight's, or the largest slice of a vocab-parallel group). teacher_hidden: Ht of a
    teacher head, for the cost model (0: not weighed, the budget's plan). learning: the teacher learns
    (`learns`): its dWt accumulator and two GEMMs weighed too."""
    n, hs = xs.shape[0], ws.shape[1]
    v = ws.shape[0] if v is None else v
    if chunk_size is not None:  # checked by parse
        rows = min(chunk_size, max(n, 1))
        return rows, rows
    row = v * logit_size(xs.dtype)  # one row of logits
    blocks = 2 if form == "heads" else 1
    budget = LOGITS_BUDGET[backend]
    if backend == "torch":
        rows = even_chunks(n, budget // (row * blocks + v * 4 * 6))
        return rows, rows
    rows = even_chunks(n, budget // (row * blocks))
    if rows < n and accum_bytes:
        # One chunk needs no dW accumulator (its GEMM rounds once, into dW's dtype): taken when that
        # makes the peak no higher.
        teacher = -(-n // 2) if form == "heads" else n
        peak = functools.partial(peak_bytes, n, v, hs, xs.element_size(), form=form, accum_bytes=accum_bytes)
        if peak(n, teacher) <= peak(rows, rows):
            return n, teacher
    if rows < n and accum_bytes and form == "heads" and teacher_hidden:
        share = accum_share(rows, v, hs, teacher_hidden, accum_bytes, learning)
        # fewer, larger chunks: the rows that bring the share to ACCUM_SHARE, and in whole row tiles either
        # way (on an H200, Gemma-3 4B <- 12B: 9 chunks of 911 rows ran no faster than 16 of 512, 8 of 1024
        # took 13% less; Qwen3 chunks of 820 rows 1.42x the floor, of 1024 1.20x), within ACCUM_GROWTH × the budget
        want = rows * share / ACCUM_SHARE if share > ACCUM_SHARE else rows
        cap = ACCUM_GROWTH * (budget // (row * blocks)) // _ROW_TILE * _ROW_TILE
        rows = max(rows, min(-(-int(want) // _ROW_TILE) * _ROW_TILE, cap, n))
    return rows, rows


def accum_share(rows, v, hs, ht, accum_bytes, learning=False) -> float:
    """A chunk's dW accumulator traffic (2·V·Hs·A bytes: read and written) over its four GEMMs' FLOPs
    (2·R·V·(3·Hs + Ht)), in time at ACCUM_BALANCE FLOPs a byte: the share of the chunk's GEMM time it adds.
    A learning teacher adds its dWt accumulator's 2·V·Ht·A bytes and its dXt, dWt GEMMs' 4·R·V·Ht FLOPs."""
    hidden = hs + ht if learning else hs
    return 2 * v * hidden * accum_bytes * ACCUM_BALANCE / (2 * rows * v * (3 * hs + (3 if learning else 1) * ht))


def peak_bytes(n, v, hs, e, rows, teacher_rows, *, form, accum_bytes, learning=None) -> int:
    """Peak extra bytes of a plan, as the module's doc gives them (e: bytes of an input element, a
    logit L = max(e, 4) (`logit_size`), accum_bytes: of a dW accumulator element, 0 when dW is not
    wanted; the bias grad's V fp32 left out). Narrow inputs (L ≠ e) hold the chunk's dL/ds in their
    dtype inside its fp32 logits' bytes, or beside them for a top-k teacher. learning: (Ht, A) of a
    learning teacher (`learns`), A the bytes of its dWt accumulator's element (0: dWt not wanted); its
    gradients are held beside everything else, so they add to the peak."""
    if learning:
        ht, accum_t = learning
        held = n * ht * e + v * ht * (accum_t if teacher_rows < n or not accum_t else e)
        rounded = teacher_rows * v * e if max(e, 4) != e else 0
        return held + rounded + peak_bytes(n, v, hs, e, rows, teacher_rows, form=form, accum_bytes=accum_bytes)
    logit = max(e, 4)
    apart = logit != e and form == "topk"  # dL/ds in a buffer of its own (else in s's bytes, or over s)
    logits = rows * v * logit + (teacher_rows * v * logit if form == "heads" else 0) + (rows * v * e if apart else 0)
    dw = v * hs * e if accum_bytes else 0
    if rows >= n:
        ds, s = rows * v * e, rows * v * logit
        return n * hs * e + max(logits, ds + dw if apart else min(s + dw, ds + max(s, dw)))
    acc = v * hs * accum_bytes
    return n * hs * e + max(logits + acc, acc + dw if accum_bytes != e else 0)


# Chunks of a multiple of this many rows fill the GEMMs' row tiles (128 or 256 rows on an H200):
# at N = 8192 with teacher heads, 4 × 2048 rows instead of 3 × 2092 + 1916 (BENCHMARKS.md).
_ROW_TILE = 256


def even_chunks(n: int, fit: int) -> int:
    """Rows per chunk for n rows when at most `fit` fit: as few chunks as fit allows, of equal size,
    rounded up to a multiple of _ROW_TILE where that still fits."""
    if n <= fit:
        return max(n, 1)
    rows = -(-n // -(-n // max(fit, 1)))  # ceil(n / count), count = ceil(n / fit)
    aligned = -(-rows // _ROW_TILE) * _ROW_TILE
    return aligned if aligned <= fit else rows
