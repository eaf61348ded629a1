"""verl's on-policy top-k distillation with flashkd's loss: `patch()` computes verl's per-token top-k
loss and diagnostics from the student's last hidden states and LM head, with no (tokens × V) logits.

verl 0.9.1 (`verl/trainer/distillation/`, loss mode "forward_kl_topk") takes the student's logits
(1, total_nnz, V) from its FSDP engine (`prepare_model_outputs`, scaled by the temperature) and hands
them to `fsdp/losses.py`'s `compute_forward_kl_topk`, which returns per token, with z = logits / τ and
log q = log_softmax(z) over the whole vocab, c = `log_prob_min_clamp` (None: no clamp):

    distillation_losses      Σ_k p_k (log p_k − log q_k)   with log q_k ← max(log q_k, c), log p_k ← max(log p_k, c)
    student_mass             Σ_k q_k  (unclamped)           teacher_mass   Σ_k p_k  (unclamped)
    overlap_count            |teacher ids ∩ student's own top-K ids|
    overlap_token_advantage  mean over the shared ids of −p_k (log p_k − log q_k) (clamped; 0 with none)

over the teacher's K ids. verl then clamps the losses at 0 (`compute_forward_kl_topk` in
`losses.py`: the top-k terms do not sum to a divergence) and aggregates them (`agg_loss`, its
`loss_agg_mode`), or takes them as a reward (`use_policy_gradient`, detached).

`topk_outputs` below computes the same five tensors from hidden states X (N, H) and the head W (V, H)
in one sweep over chunks of R rows, never N·V logits. Per chunk:

    S = X[c] Wᵀ (+ b)              GEMM 1, fp32 (the GEMM's accumulator for bf16 / fp16 inputs)
    row statistics                 the top-k stats kernel (one read): S at the ids, the logsumexp of
                                   S/τ off them; the ids' columns set to −inf; and θ, the K-th largest
                                   of its lanes' maxima (at most the row's K-th largest logit)
    (R, K + 1) row math            float64: log q at the ids, the loss (verl's formula with its
                                   clamps, or the top-k form), student_mass, teacher_mass, token_kl,
                                   and the loss's gradient in the ids' logits and in the rest's
                                   logsumexp: verl's forward KL in one Triton kernel
                                   (`triton_topk.clamped_kl`, the gradient as torch's autograd of the
                                   formula gives it); the other losses and the torch path in torch,
                                   the gradient by autograd of the same code
    dL/dS (R, V)                   the top-k expand kernel (one read, one write in the inputs' dtype),
                                   each row times its weight u; in the same read the candidates for
                                   each teacher id's membership of the student's top-K, for the
                                   overlap: the elements at or over θ kept in the row's scratch
                                   (`triton_topk.expand_kernel`'s OWN), each id's rank then counted
                                   among them (`triton_topk.rank_kernel`: K · ~K comparisons a row). Without a gradient (no expand
                                   step) the Triton top-k kernel gives it (`triton_topk.kernel_topk`,
                                   two reads of S); on the torch path each id's rank, over vocab blocks
    dX[c] = dS W                   GEMM 2 (fp32 out for narrow inputs)
    dW += dSᵀ X'[c]                GEMM 3 (fp32 accumulator), X' = X with the rows of predicted weight 0
                                   zeroed (a select)

overlap_count and overlap_token_advantage follow from the membership and token_kl at the end.
Ties: an id is in the student's top-K when fewer than K logits (fp32, the GEMM's) outrank it, a tie
going to the larger id, on both paths (the Triton kernels order (logit, id) pairs, −0.0 as +0.0 in the
expand kernel's count; `_own_by_rank` counts so). verl's torch.topk leaves the order among equal logits
unspecified: the sets differ only where the K-th and (K+1)-th largest logits of a row are exactly equal. Rows the Triton kernels flag
(more than 512 elements at or over θ in the row, or fewer than K finite logits off the ids: about
never) are settled with torch.topk on their logits made again, after the sweep: one host read in the
forward.

The gradient. Verl's use of the per-token losses is linear per token with weights fixed before the
loss is known (the response mask, `loss_agg_mode`'s normalisers, dp size, the coefficient) except for
its clamps, which cut a token's gradient where its loss leaves [0, loss_max_clamp]. The patch knows
all but one scalar: `predicted_grad` w (N,) (`response_weights`) and `predicted_clamp` (0,
loss_max_clamp); the sweep cuts w where the loss it has just computed leaves those bounds. dL/dS of a
row carries u = w where w ≠ 0, else 1, so:

- dX row i = (g_i / u_i) · dX_u row i: exact for any grad_output g (rows are independent);
- dW: the forward's dW is Σ_i w_i dSᵢᵀ Xᵢ; the backward checks g = c·w (`_proportional`: one scalar c,
  |g − c·w| <= 8 eps · |g| row by row in float64, so a row of w = 0 needs g = 0 exactly) and returns
  c·dW. That check reads one boolean on the host (a sync, once per micro-batch, in the backward). Where
  it fails (g is no multiple of w: a use of the losses the patch does not know), or without a
  prediction, the backward sweeps again for dW alone: GEMM 1, the row statistics and math, dL/dS with
  u = g, GEMM 3. dX needs nothing more.

GEMMs of N·V·H: 3 when the prediction holds (verl's own path runs 3: the logits, dX, dW), 3 + 2 when
it does not, 2 + 2 without a prediction (2 in the forward: logits and dX), 1 without a gradient (no
tensor requires one, or grad mode off: values alone). Exact in every case: float64 inputs give the
float64 formula's gradients; narrow ones round dL/dS to their dtype once, as flashkd's GEMMs do.

Memory, bytes (E: the inputs' element size, L = 4 for bf16 / fp16 inputs else E, A: the dW
accumulator's, 4 for narrow inputs unless grad_accum_dtype says otherwise):
    a chunk      R·V·L (S) + R·V·E (dL/dS, its own buffer for narrow inputs) + R·(8·256 + O(K)) (the
                 top-k kernel's scratch, the row math); R·V·4 more on the torch path's temporaries
    kept         N·H·max(E, 4 if narrow) (dX_u) + V·H·A (dW, with a prediction) + N·K·(4 + 1)
                 (token_kl, membership): alive from the forward to the backward
    peak         kept + a chunk;  R from `flashkd.core.plan.LOGITS_BUDGET` (R·V·L <= 1 GiB), on Triton
                 R = max(that, N/16) up to 4 GiB of logits (`SWEEP_CHUNKS`: each chunk reads and writes
                 the dW accumulator once, 2·V·H·4 bytes, so a long micro-batch is cut into 16 chunks)
At N 32768, V 151936, H 2048, bf16: 0.27 GB + 1.24 GB kept and about 1.6 GB a chunk, where verl's
own path holds its (N, V) logits, their log-softmax and its gradient (29.9 GB measured at that size,
benchmarks/bench_verl.py).

- options verl does not have: loss="reverse_kl" or "jsd" (β) over the same K ids plus a tail
  bucket for the rest of the vocab (flashkd's top-k form, `flashkd.losses.topk_row_losses`, whose
  values are then the per-token losses), as verl's users ask for; the same sweep, its row math that
  of `flashkd.losses.category_logprobs` and `divergence`.

`patch()` installs it in verl's FSDP engine (`FSDPEngineWithLMHead`) for runs with
`actor.use_fused_kernels=True` (the path where the model returns no logits): it asks the model for its
hidden states, takes the last (the LM head's input) and the LM head's weight (gathered once when it
is an FSDP2 DTensor), and puts the five tensors into the model output where verl's fused path puts
its own. It passes the prediction: `response_weights` of the micro-batch's prompts, responses,
response mask and the actor's `loss_agg_mode`, with predicted_clamp (0, `loss_max_clamp`); none where
they are not known (another mode, Ulysses sequence parallelism, padded inputs), and no gradient at all
with `use_policy_gradient` (verl detaches the losses there). It refuses a verl version other than
`TESTED_VERL_VERSIONS`. verl builds the engine in its
Ray workers: `VERL_USE_EXTERNAL_MODULES=flashkd.integrations.verl` in their environment makes each
import this module with verl, and the import installs the patch (with its default options).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import math
import os
import sys

import torch

from ..core import backend as core_backend, checks as core_checks, loop as core_loop, plan as core_plan
from ..distill import check_options as distill_check_options
from ..losses import LossSpec, category_logprobs, divergence, loss_parameters
from . import announce, full_head, is_replaced, original, replace, restore

try:
    import triton
except ImportError:  # the torch rows only
    triton = None

TESTED_VERL_VERSIONS = ("0.9.1",)
LOSSES = ("forward_kl", "reverse_kl", "jsd")
FIELDS = ("distillation_losses", "student_mass", "teacher_mass", "overlap_count", "overlap_token_advantage")
# What `topk_outputs` takes from flashkd.fused_linear_distill_topk's keywords (the rest do not apply here)
KEYWORDS = ("backend", "grad_accum_dtype")
# The backward's proportionality check: |g − c·w| <= _CHECK_EPS · eps · |g| on every row (eps of g's dtype)
_CHECK_EPS = 8
_LN2 = math.log(2.0)
_LOG2E = math.log2(math.e)

# the methods of verl's FSDPEngineWithLMHead that patch() replaces (verl's own kept on the class meanwhile)
_METHODS = ("prepare_model_inputs", "prepare_model_outputs")


SWEEP_CHUNKS = 16  # the most chunks a micro-batch is cut into by default (Triton), while ...
SWEEP_GROWTH = 4  # ... a chunk's logits stay within this many times the core's budget


def _chunk_rows(n: int, v: int, chunk_size: int | None, backend: str, logit_bytes: int) -> int:
    if chunk_size is not None:
        return chunk_size
    # the chunk loop's budget for one chunk's logits (`flashkd.core.plan.LOGITS_BUDGET`); the torch rows
    # hold a few more (R, V) temporaries
    per_row = v * (logit_bytes if backend == "triton" else 4 * logit_bytes)
    rows = core_plan.LOGITS_BUDGET[backend] // max(per_row, 1)
    if backend == "triton":
        # Each chunk reads and writes dW's fp32 accumulator once (2·V·H·4 bytes, ~0.65 ms at V 151936, H 2048
        # on an H100) whatever its rows: a long micro-batch takes at most SWEEP_CHUNKS chunks, up to
        # SWEEP_GROWTH times the budget's rows (its logits N·V·L / 16 then, still a sixteenth of verl's own)
        rows = min(max(rows, -(-n // SWEEP_CHUNKS)), SWEEP_GROWTH * rows)
    return max(1, min(max(n, 1), rows))


def _own_by_rank(s: torch.Tensor, ids: torch.Tensor, s_k: torch.Tensor) -> torch.Tensor:
    """(R, K) bool: whether each teacher id is among the K largest logits of its row of s (R, V), by its
    rank: rank = #{j: s_j > s_id} + #{j > id: s_j = s_id} (ties to the larger id, as the Triton top-k
    kernel orders them), in the student's top-K when rank < K. Over vocab blocks of B columns:
    R·K·B <= 2^22 booleans at a time, never (R, K, V)."""
    r, v = s.shape
    k = ids.shape[1]
    rank = torch.zeros(r, k, dtype=torch.int64, device=s.device)
    block = max(1, (1 << 22) // max(1, r * k))
    sk = s_k[:, :, None]
    for start in range(0, v, block):
        part = s[:, None, start:start + block]
        cols = torch.arange(start, min(start + block, v), device=s.device)
        rank += (part > sk).sum(-1)
        rank += ((part == sk) & (cols > ids[:, :, None])).sum(-1)
    return rank < k


def _stats(s: torch.Tensor, ids: torch.Tensor, tau: float, backend: str, own: bool, later: bool = False,
           raw: bool = False):
    """One chunk's row statistics from its logits s (R, V) (fp32, or the inputs' fp32 / fp64), read
    once before anything is written over them: (rel_k, rel_rest, shift, log2_rest, own, redo).
    rel_k (R, K) and rel_rest (R,) are z = s/τ at the ids and the logsumexp of z off the ids, both
    minus shift/τ (shift: the largest logit off the ids), float64; log2_rest = rel_rest / ln 2 in
    the kernels' fp32 (the expand step's). own (R, K) bool: each id in the student's top-K (None
    unless asked); redo (R,) bool: rows whose top-K the kernel could not settle (None on the torch
    path). With `later` (Triton, the expand step to follow) own is (θ, s at the ids) instead, for the
    expand kernel to keep the candidates in its read (`triton_topk.expand_kernel`'s OWN) and
    `triton_topk.rank_kernel` to count the ranks among them. With `raw` (Triton)
    the kernel's own (s_k, m, log2_rest, own, redo) instead, for `triton_topk.clamped_kl`. s is left with
    −inf at the ids, as the expand step reads it."""
    r, v = s.shape
    k = ids.shape[1]
    if backend == "triton":
        from ..backends import triton_common, triton_topk

        members = redo = theta = None
        if later:
            theta = torch.empty(r, device=s.device, dtype=torch.float32)
        elif own and k <= triton_topk.TOPK_MAX_K:  # the student's top-K, two reads of s; ties to the larger id
            top, _, redo, _ = triton_topk.kernel_topk(s, k, 1.0)
            members, redo = (ids[:, :, None] == top[:, None, :]).any(-1), redo.bool()
        elif own:
            members = _own_by_rank(s, ids, s.gather(1, ids))
        s_k = torch.empty(r, k, device=s.device, dtype=torch.float32)
        m = torch.empty(r, device=s.device, dtype=torch.float32)
        log2_rest = torch.empty(r, device=s.device, dtype=torch.float32)
        head, fold, mul = triton_common.head_mode(1.0, None)
        with triton_common.launching():
            triton_topk.stats_kernel[(r,)](
                s, ids, s_k, m, log2_rest, log2_rest, m, v, k, _LOG2E * fold / tau, _LOG2E * fold, mul,
                STREAM=True, ONE=False, HEAD=head, STATS=False, BLOCK_V=triton_topk.BLOCK_V,
                BLOCK_K=triton.next_power_of_2(k), num_warps=triton_topk.NUM_WARPS, theta_ptr=theta, OWN=later,
            )
        if later:
            members = (theta, s_k)
        if raw:
            return s_k, m, log2_rest, members, redo
        rel_rest = _LN2 * log2_rest.double()
    else:
        s_k = s.gather(1, ids)
        members = _own_by_rank(s, ids, s_k) if own else None
        redo = None
        s.scatter_(1, ids, -torch.inf)
        m = s.amax(1)
        finite = m > -torch.inf
        rel_rest = torch.logsumexp((s - torch.where(finite, m, 0.0)[:, None]) / tau, 1).double()
        log2_rest = rel_rest / _LN2
    # no logit off the ids (the ids cover the vocab): the shift is the largest at the ids
    empty = rel_rest == -torch.inf
    shift = torch.where(empty, s_k.amax(1), m)
    rel_k = (s_k.double() - shift.double()[:, None]) / tau
    return rel_k, rel_rest, shift, log2_rest, members, redo


def _categories(rel_k, rel_rest, lp, spec: LossSpec, clamp, grad: bool):
    """The per-row math on (R, K + 1) numbers, float64: verl's formulas (the module docstring) for
    the loss (or flashkd's top-k form for "reverse_kl" / "jsd") and the diagnostics, and with `grad`
    the loss's gradient in rel_k and rel_rest (autograd of the same code, so the clamps act as
    torch's `clamp_min` does in verl). Returns (loss, student_mass, teacher_mass, token_kl (R, K),
    d loss/d rel_k or None, d loss/d rel_rest or None)."""
    with torch.enable_grad():
        a = rel_k.detach().requires_grad_(grad)
        r = rel_rest.detach()[:, None].requires_grad_(grad)
        log_q = a - torch.logaddexp(r, torch.logsumexp(a, -1, keepdim=True))
        t = lp.to(torch.float64)
        lq, lpc = (log_q, t) if clamp is None else (log_q.clamp_min(clamp), t.clamp_min(clamp))
        token_kl = lpc.exp() * (lpc - lq)
        if spec.loss == "forward_kl":
            loss = token_kl.sum(-1)
        else:
            used = torch.ones_like(a, dtype=torch.bool)
            log_qc, log_pc = category_logprobs(a, r, t, used, r == -torch.inf, "bucket")
            loss = divergence(log_qc, log_pc, spec)
        da = dr = None
        if grad:
            da, dr = torch.autograd.grad(loss.sum(), (a, r))
    return (loss.detach(), log_q.detach().exp().sum(-1), t.exp().sum(-1), token_kl.detach(), da,
            None if dr is None else dr[:, 0])


def _expand(s, ds, ids, id_grad, rest_grad, shift, log2_rest, rel_rest, tau, backend, own=None):
    """dL/ds (R, V) into ds (rounded to its dtype; ds may be s, or lie over the first half of each of s's
    fp32 rows as the narrow dtype: the kernel stores a tile once it is read): rest_grad · softmax of z over the
    row's off-ids columns (s holds −inf at the ids) and id_grad at the ids; both already / τ and
    times the row's weight. With own = (θ, s at the ids) (`_stats`' later), the Triton kernel also
    counts each id's rank in the same read: returns (ds, members (R, K) bool, redo (R,) bool)."""
    r, v = s.shape
    k = ids.shape[1]
    if backend == "triton":
        from ..backends import triton_common, triton_topk

        head, fold, mul = triton_common.head_mode(1.0, None)
        f32 = torch.float32
        members = redo = scratch = None
        if own is not None:
            members = torch.empty(r, k, dtype=torch.int8, device=s.device)
            redo = torch.empty(r, dtype=torch.int8, device=s.device)
            scratch = torch.empty(r, triton_topk.OWN_CAP, dtype=torch.int64, device=s.device)
            count = torch.zeros(r, dtype=torch.int32, device=s.device)
        with triton_common.launching():
            triton_topk.expand_kernel[(r,)](
                s, ds, ids, id_grad.to(f32).contiguous(), rest_grad.to(f32).contiguous(), shift, log2_rest, shift,
                shift, ids, v, k, ds.stride(0), _LOG2E * fold / tau, _LOG2E * fold, mul, REST=True, CE=False,
                HEAD=head, RTNE_BITS=triton_common.rtne_bits(ds), BLOCK_V=triton_topk.BLOCK_V,
                ALIASED=ds.dtype != s.dtype and ds.untyped_storage().data_ptr() == s.untyped_storage().data_ptr(),
                BLOCK_K=triton.next_power_of_2(k), num_warps=triton_topk.NUM_WARPS,
                **({} if own is None else dict(theta_ptr=own[0], scratch_ptr=scratch, count_ptr=count, OWN=True,
                                               CAP=triton_topk.OWN_CAP)),
            )
            if own is not None:  # each id's rank among what the expand kernel kept
                triton_topk.rank_kernel[(r,)](
                    ids, own[1], own[0], members, redo, scratch, count, v, k, CAP=triton_topk.OWN_CAP,
                    CH=min(32, triton.next_power_of_2(k)), BLOCK_K=triton.next_power_of_2(k),
                    num_warps=triton_topk.NUM_WARPS)
        return ds if own is None else (ds, members.bool(), redo.bool())
    off = s > -torch.inf
    g = (s - shift[:, None]) / tau - rel_rest.to(s.dtype)[:, None]
    g = torch.where(off, rest_grad.to(s.dtype)[:, None] * torch.exp(torch.where(off, g, 0.0)), 0.0)
    g.scatter_(1, ids, id_grad.to(s.dtype))
    ds.copy_(g)
    return ds


def _sweep(x, w, b, ids, lp, spec: LossSpec, clamp, *, rows: int, backend: str, accum: torch.dtype,
           values: bool, want_dx: bool, want_dw: bool, want_db: bool, weight=None, base=None, bounds=(None, None)):
    """The chunk loop: for each chunk of `rows` rows, one GEMM of the head (S = X Wᵀ + b at fp32
    accuracy), the row statistics (`_stats`), the per-row math (`_categories`), dL/dS (`_expand`),
    then the gradient GEMMs: dX = dS W and dW += dSᵀ X. Row weights: `weight` (N,) given (the
    backward's recomputation), or predicted from `base` (N,) and `bounds` as each chunk's losses come
    out (pred = base where lo <= loss <= hi, else 0); dL/dS then carries u = pred where pred ≠ 0,
    else 1, so that dX (u-weighted, fp32 for narrow inputs) can be re-weighted to any g row by row,
    and dW (dB) sums the rows with pred ≠ 0 only (X masked by a select: no rounding).
    Returns a dict of what was asked: the five outputs and token_kl, own, redo (values); dx_u, u,
    pred (want_dx or base); dw, db."""
    n, v = x.shape[0], w.shape[0]
    k = ids.shape[1]
    dev = x.device
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    narrow = x.dtype in core_checks.NARROW
    grad = want_dx or want_dw or want_db
    out = {}
    if values:
        out["distillation_losses"] = torch.empty(n, dtype=wide, device=dev)
        out["student_mass"] = torch.empty(n, dtype=wide, device=dev)
        out["teacher_mass"] = torch.empty(n, dtype=wide, device=dev)
        out["token_kl"] = torch.empty(n, k, dtype=wide, device=dev)
        out["own"] = torch.empty(n, k, dtype=torch.bool, device=dev)
        out["redo"] = torch.zeros(n, dtype=torch.bool, device=dev) if backend == "triton" else None
    if want_dx:
        out["dx_u"] = torch.empty(n, x.shape[1], dtype=torch.float32 if narrow else x.dtype, device=dev)
    if base is not None:
        out["u"] = torch.empty(n, dtype=wide, device=dev)
        out["pred"] = torch.empty(n, dtype=wide, device=dev)
    dw = db = None
    if want_db:
        db = torch.zeros(v, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32, device=dev)
    lo, hi = bounds
    later = values and grad and backend == "triton" and k <= _fold_k()  # the membership in the expand's read
    fused = backend == "triton" and spec.loss == "forward_kl"  # verl's forward KL: its row math in one kernel
    if fused:
        from ..backends import triton_topk

        const = triton_topk.clamped_kl_constants(spec.temperature, clamp, dev)
    for start in range(0, n, rows):
        c = slice(start, min(start + rows, n))
        xc = x[c]
        s = core_loop.linear(xc, w, b)
        i = ids[c]
        if fused:  # verl's forward KL, its gradient and the rows' weights in one kernel, into the outputs
            s_k, m, log2_rest, own, redo = _stats(s, i, spec.temperature, backend, values, later, raw=True)
            predicted = grad and weight is None and base is not None
            shift, loss, _, _, _, id_grad, rest_grad, keep = triton_topk.clamped_kl(
                s_k, m, log2_rest, lp[c], const, clamp, grad, wide,
                out=tuple(out[f][c] for f in ("distillation_losses", "student_mass", "teacher_mass", "token_kl"))
                if values else None, weight=None if weight is None else weight[c],
                base=base[c] if predicted else None, bounds=bounds,
                pred_u=(out["pred"][c], out["u"][c]) if predicted else None)
            rel_rest = None
        else:
            rel_k, rel_rest, shift, log2_rest, own, redo = _stats(s, i, spec.temperature, backend, values, later)
            loss, q_mass, p_mass, token_kl, da, dr = _categories(rel_k, rel_rest, lp[c], spec, clamp, grad)
            if values:
                out["distillation_losses"][c] = loss
                out["student_mass"][c] = q_mass
                out["teacher_mass"][c] = p_mass
                out["token_kl"][c] = token_kl
        if values:
            if not later:
                out["own"][c] = own
            if redo is not None:
                out["redo"][c] = redo
        if not grad:
            del s
            continue
        if not fused:  # (the kernel gave id_grad, rest_grad and keep)
            keep = None
            if weight is not None:
                u = weight[c].to(torch.float64)
            elif base is not None:
                loss_out = loss.to(wide)  # the value verl's clamps compare, as returned
                inside = torch.ones_like(loss_out, dtype=torch.bool)
                if lo is not None:
                    inside &= loss_out >= torch.tensor(lo, dtype=wide)
                if hi is not None:
                    inside &= loss_out <= torch.tensor(hi, dtype=wide)
                pred = torch.where(inside, base[c].to(wide), 0.0)
                keep = pred != 0
                u = torch.where(keep, pred, 1.0)
                out["pred"][c], out["u"][c] = pred, u
                u = u.to(torch.float64)
            else:
                u = torch.ones(c.stop - c.start, dtype=torch.float64, device=dev)
            id_grad = da * (u / spec.temperature)[:, None]
            rest_grad = dr * (u / spec.temperature)
        if backend != "triton":
            ds = torch.empty(s.shape, dtype=x.dtype, device=dev)
        elif narrow:  # dL/dS in the first half of each fp32 row of S, as the expand kernel reads it: no second buffer
            ds = s.view(x.dtype)[:, :v]
        else:
            ds = s
        ds = _expand(s, ds, i, id_grad, rest_grad, shift, log2_rest, rel_rest, spec.temperature, backend,
                     own if later else None)
        if later:
            ds, out["own"][c], out["redo"][c] = ds
        del s
        if want_dx:
            core_loop.accumulate_mm(out["dx_u"][c], ds, w, beta=0.0)
        if (want_dw or want_db) and (weight is not None or base is not None):
            xm = xc if keep is None else torch.where(keep[:, None], xc, 0.0)
            if want_dw:
                if dw is None:
                    dw = torch.empty(w.shape, dtype=accum, device=dev)
                core_loop.accumulate_mm(dw, ds.t(), xm, beta=0.0 if start == 0 else 1.0)
            if want_db:
                m = torch.ones(c.stop - c.start, dtype=ds.dtype, device=dev) if keep is None else keep.to(ds.dtype)
                db += (m[None] @ ds if not narrow or not ds.is_cuda else
                       torch.mm(m[None], ds, out_dtype=torch.float32))[0].to(db.dtype)
        del ds
    if want_dw and dw is None and (weight is not None or base is not None):
        dw = torch.zeros(w.shape, dtype=accum, device=dev)  # no rows
    out["dw"], out["db"] = dw, db
    return out


def _fold_k() -> int:
    """The largest K whose membership the expand kernel counts in its read (K lanes under θ)."""
    from ..backends import triton_topk

    return triton_topk.BLOCK_V


def _diagnostics(out, x, w, b, ids):
    """overlap_count and overlap_token_advantage from each id's membership of the student's top-K.
    Rows the Triton top-k kernel flagged (many ties at its threshold: rare) are settled here with
    torch.topk on their logits, made again: finding them is one host read."""
    own = out["own"]
    if out["redo"] is not None:
        rows = out["redo"].nonzero()[:, 0]  # the forward's one host sync
        if rows.numel():
            z = core_loop.linear(x[rows], w, b)
            top = torch.topk(z, ids.shape[1], dim=-1).indices
            own[rows] = (ids[rows][:, :, None] == top[:, None, :]).any(-1)
    count = own.sum(-1)
    adv = (-out["token_kl"] * own).sum(-1) / count.clamp_min(1)
    return count, torch.where(count > 0, adv, 0.0)


def _scaled(a: torch.Tensor, c: torch.Tensor, dtype: torch.dtype, backend: str) -> torch.Tensor:
    """(a · c) rounded to dtype, a (fp32 / fp64) and c 0-d: one pass, no second copy of a."""
    c = c.to(a.dtype)
    if backend == "triton" and a.dtype == torch.float32 and dtype != a.dtype and a.is_contiguous():
        from ..backends import triton_common

        return triton_common.scaled(a, c, dtype)
    return torch.mul(a, c, out=torch.empty(a.shape, dtype=dtype, device=a.device))


def _proportional(g: torch.Tensor, pred: torch.Tensor):
    """(c, ok): c = g_j / pred_j at the row of largest |pred| (0 where pred is all 0), a 0-d float64
    device tensor, and ok, a 0-d bool device tensor: |g_i − c·pred_i| <= 8·eps·|g_i| on every row, in
    float64 (eps: g's dtype's). A row with pred 0 then needs g exactly 0, and a g of 0 needs pred 0
    (or c = 0); a NaN fails. Where it holds, c·(pred-weighted dW) differs from the g-weighted one by
    under 8 eps of each row's share: below what rounding the recomputation does itself."""
    g64, p64 = g.double(), pred.double()
    j = p64.abs().argmax()
    c = torch.where(p64[j] != 0, g64[j] / torch.where(p64[j] != 0, p64[j], 1.0), 0.0)
    tol = _CHECK_EPS * torch.finfo(g.dtype).eps
    return c, ((g64 - c * p64).abs() <= tol * g64.abs()).all()


class _TopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, ids, lp, spec, clamp, rows, backend, accum, base, bounds):
        want_dx, want_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        want_db = b is not None and ctx.needs_input_grad[2]
        out = _sweep(x, w, b, ids, lp, spec, clamp, rows=rows, backend=backend, accum=accum, values=True,
                     want_dx=want_dx, want_dw=want_dw and base is not None, want_db=want_db and base is not None,
                     base=base, bounds=bounds)
        count, adv = _diagnostics(out, x, w, b, ids)
        ctx.save_for_backward(x, w, b, ids, lp, out.get("dx_u"), out.get("u"), out.get("pred"), out["dw"], out["db"])
        ctx.spec, ctx.clamp, ctx.rows, ctx.backend, ctx.accum = spec, clamp, rows, backend, accum
        ctx.want = (want_dx, want_dw, want_db)
        diagnostics = (out["student_mass"], out["teacher_mass"], count, adv)
        ctx.mark_non_differentiable(*diagnostics)
        return (out["distillation_losses"],) + diagnostics

    @staticmethod
    def backward(ctx, g, *_):
        x, w, b, ids, lp, dx_u, u, pred, dw_pred, db_pred = ctx.saved_tensors
        want_dx, want_dw, want_db = ctx.want
        dx = dw = db = None
        if want_dx:  # exact for any g: each row of dx_u carries the weight u, re-weighted to g here
            factor = g.to(dx_u.dtype) if u is None else (g.to(torch.float64) / u).to(dx_u.dtype)
            dx = (dx_u * factor[:, None]).to(x.dtype)
        if want_dw or want_db:
            ok = False
            if pred is not None:
                c, ok = _proportional(g, pred)
                ok = bool(ok)  # the backward's one host read: which branch
            if ok:  # scaled and rounded to the head's dtype in one pass: no second fp32 copy of dW
                dw = None if dw_pred is None else _scaled(dw_pred, c, w.dtype, ctx.backend)
                db = None if db_pred is None else (db_pred * c.to(db_pred.dtype)).to(b.dtype)
            else:  # g is no multiple of the prediction (or there was none): dW from g, one more sweep
                out = _sweep(x, w, b, ids, lp, ctx.spec, ctx.clamp, rows=ctx.rows, backend=ctx.backend,
                             accum=ctx.accum, values=False, want_dx=False, want_dw=want_dw, want_db=want_db,
                             weight=g.detach())
                dw = None if out["dw"] is None else out["dw"].to(w.dtype)
                db = None if out["db"] is None else out["db"].to(b.dtype)
        return dx, dw, db, None, None, None, None, None, None, None, None, None


def topk_outputs(
    hidden_states: torch.Tensor,  # (..., H) the student's last hidden states (the LM head's input)
    lm_head_weight: torch.Tensor,  # (V, H)
    teacher_ids: torch.Tensor,  # (..., K) integer
    teacher_logprobs: torch.Tensor,  # (..., K)
    *,
    temperature: float = 1.0,
    log_prob_min_clamp: float | None = None,
    loss: str = "forward_kl",
    beta: float | None = None,
    lm_head_bias: torch.Tensor | None = None,
    chunk_size: int | None = None,
    predicted_grad: torch.Tensor | None = None,  # (...) like teacher_ids without K
    predicted_clamp: tuple[float | None, float | None] = (None, None),
    **keywords,
) -> dict[str, torch.Tensor]:
    """verl's `compute_forward_kl_topk` outputs from hidden states: a dict of FIELDS, each (...) like
    teacher_ids without K. `distillation_losses` carries the gradient to hidden_states, lm_head_weight
    and lm_head_bias; the diagnostics are detached (overlap_count int64, the rest fp32; fp64 for fp64
    inputs).

    loss="forward_kl" is verl's (the module docstring), with `log_prob_min_clamp` as verl applies it;
    "reverse_kl" and "jsd" (β in flashkd's convention: 0 forward, 1 reverse) are flashkd's top-k form
    over the teacher's ids and a tail bucket (`flashkd.losses.topk_row_losses`), without a clamp; β is
    read by "jsd" only (None: 0.5). The teacher's ids in a row are distinct (a top-k's are) and in
    [0, V), its log-probs <= 0 (at most 1 in all for "reverse_kl" / "jsd"'s tail bucket; finite for
    verl's forward KL without log_prob_min_clamp, whose p·(log p − log q) is NaN at p = 0): checked on
    CPU tensors only, as flashkd's top-k calls check them by default (elsewhere a host sync).

    predicted_grad, predicted_clamp: what the gradient that will reach `distillation_losses` is
    expected to be, up to one scalar: predicted_grad (a float tensor, constant) where
    lo <= loss <= hi for (lo, hi) = predicted_clamp (None: no bound), 0 elsewhere (a clamp of the
    losses there, as verl's clamp at 0 and `loss_max_clamp`). The forward then makes dW for it, and
    the backward scales it when the gradient is a multiple of it; otherwise (and without a
    prediction) the backward makes dW again from the gradient it got. Exact either way (the module
    docstring).
    `keywords`: `backend` ("auto", "torch", "triton") and `grad_accum_dtype` (the dW accumulator's,
    fp32 by default for bf16 / fp16 inputs), as `flashkd.fused_linear_distill_topk` takes them.
    """
    spec = check_options(loss=loss, beta=beta, temperature=temperature, log_prob_min_clamp=log_prob_min_clamp,
                         chunk_size=chunk_size, predicted_clamp=predicted_clamp, **keywords)
    # types, layouts, dtypes and devices first (no tensor is read): a head on another device or in another
    # dtype would otherwise fail deep in a GEMM, or (a meta head) give values from nothing
    core_checks.check_tensors({"hidden_states": hidden_states})
    if hidden_states.dtype not in core_checks.FLOATS:
        raise TypeError(f"hidden_states: expected a floating dtype (float16, bfloat16, float32, float64), got "
                        f"{hidden_states.dtype}")
    if hidden_states.dim() < 1 or hidden_states.shape[-1] == 0:
        raise ValueError(f"hidden_states: expected a tensor of shape (..., H) with H >= 1, got shape "
                         f"{tuple(hidden_states.shape)}")
    core_checks.check_tensors({"lm_head_weight": lm_head_weight, **({} if lm_head_bias is None else
                                                                     {"lm_head_bias": lm_head_bias})},
                              hidden_states.dtype, hidden_states.device, like="hidden_states")
    core_checks.check_tensors({"teacher_ids": teacher_ids, "teacher_logprobs": teacher_logprobs},
                              device=hidden_states.device, like="hidden_states")
    if teacher_ids.dtype.is_floating_point or teacher_ids.dtype.is_complex or teacher_ids.dtype == torch.bool:
        raise TypeError(f"teacher_ids: expected an integer dtype, got {teacher_ids.dtype}")
    if teacher_logprobs.dtype not in core_checks.FLOATS:  # an int or bool one would be cast to float64 unseen
        raise TypeError(f"teacher_logprobs: expected a floating dtype (float16, bfloat16, float32, float64), got "
                        f"{teacher_logprobs.dtype}")
    if (teacher_ids.dim() < 1 or teacher_ids.shape != teacher_logprobs.shape
            or teacher_ids.shape[:-1] != hidden_states.shape[:-1]):
        want = ", ".join([*map(str, hidden_states.shape[:-1]), "K"])
        raise ValueError(f"teacher_ids, teacher_logprobs: expected shape ({want}) (hidden_states' leading dims, then "
                         f"K), got {tuple(teacher_ids.shape)} and {tuple(teacher_logprobs.shape)}")
    if lm_head_weight.dim() != 2 or 0 in lm_head_weight.shape or lm_head_weight.shape[1] != hidden_states.shape[-1]:
        raise ValueError(f"lm_head_weight: expected shape (V, {hidden_states.shape[-1]}) with V >= 1, got "
                         f"{tuple(lm_head_weight.shape)}")
    if lm_head_bias is not None and lm_head_bias.shape != (lm_head_weight.shape[0],):
        raise ValueError(f"lm_head_bias: expected None or a tensor of shape ({lm_head_weight.shape[0]},), got shape "
                         f"{tuple(lm_head_bias.shape)}")
    lead = teacher_ids.shape[:-1]
    k = teacher_ids.shape[-1]
    if not 1 <= k <= lm_head_weight.shape[0]:
        raise ValueError(f"teacher_ids: expected 1 <= K <= V = {lm_head_weight.shape[0]}, got K = {k}")
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    ids = teacher_ids.reshape(-1, k).long().contiguous()
    lp = teacher_logprobs.reshape(-1, k)
    if x.device.type == "cpu" and ids.numel():  # the values, where reading them is no host sync
        if ids.min() < 0 or ids.max() >= lm_head_weight.shape[0]:
            raise ValueError(f"teacher_ids: expected ids in [0, {lm_head_weight.shape[0]}) (the LM head's rows), got "
                             f"values in [{int(ids.min())}, {int(ids.max())}]")
        # as flashkd's top-k calls check them on CPU: log-probs <= 0 (not NaN), at most 1 in all for the
        # tail bucket, ids distinct within a row (a repeated id counts twice in q's normaliser)
        core_checks.check_topk_values(ids, lp, None, spec, None)
        if spec.loss == "forward_kl" and log_prob_min_clamp is None and (lp == -torch.inf).any():
            row = int((lp == -torch.inf).any(-1).nonzero()[0, 0])
            raise ValueError(f"teacher_logprobs: expected finite log-probabilities with loss='forward_kl' and "
                             f"log_prob_min_clamp=None (verl's p·(log p − log q) is NaN at p = 0), got -inf in row "
                             f"{row}; set log_prob_min_clamp (verl's distillation_loss.log_prob_min_clamp)")
    if predicted_grad is not None:
        if not isinstance(predicted_grad, torch.Tensor) or not predicted_grad.dtype.is_floating_point \
                or predicted_grad.shape != lead or predicted_grad.device != x.device:
            got = (f"a {predicted_grad.dtype} tensor of shape {tuple(predicted_grad.shape)} on {predicted_grad.device}"
                   if isinstance(predicted_grad, torch.Tensor) else repr(predicted_grad))
            raise ValueError(f"predicted_grad: expected None or a float tensor of shape {tuple(lead)} on {x.device}, "
                             f"got {got}")
        predicted_grad = predicted_grad.detach().reshape(-1)
    backend = core_backend.pick_backend(keywords.get("backend", "auto"), x)
    narrow = x.dtype in core_checks.NARROW
    accum = keywords.get("grad_accum_dtype") or (torch.float32 if narrow else x.dtype)
    # as flashkd's calls take it: another dtype would round dW to a format it does not have (fp16 for
    # fp32 / fp64 / bf16 heads), or ask cuBLAS for an output dtype it does not offer
    if accum not in (torch.promote_types(x.dtype, torch.float32), x.dtype):
        raise TypeError(f"grad_accum_dtype: expected {torch.promote_types(x.dtype, torch.float32)} or lm_head_weight's "
                        f"dtype {x.dtype}, got {accum!r}")
    rows = _chunk_rows(x.shape[0], lm_head_weight.shape[0], chunk_size, backend, 4 if narrow else x.element_size())
    args = (x, lm_head_weight, lm_head_bias, ids, lp, spec, log_prob_min_clamp, rows, backend, accum)
    graded = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden_states, lm_head_weight, lm_head_bias))
    if graded:
        outs = _TopK.apply(*args, predicted_grad, tuple(predicted_clamp))
    else:  # no gradient wanted: the values alone, one GEMM
        out = _sweep(*args[:7], rows=rows, backend=backend, accum=accum, values=True, want_dx=False,
                     want_dw=False, want_db=False)
        outs = (out["distillation_losses"], out["student_mass"], out["teacher_mass"],
                *_diagnostics(out, x, lm_head_weight, lm_head_bias, ids))
    return {name: o.reshape(lead) for name, o in zip(FIELDS, outs)}


def check_options(*, loss="forward_kl", beta=None, temperature=1.0, log_prob_min_clamp=None, chunk_size=None,
                  predicted_clamp=(None, None), **keywords) -> LossSpec:
    """`topk_outputs`'s options (no tensors), checked: its LossSpec. `patch` checks its options here, so
    that a wrong one fails where it is given, not in verl's first training step."""
    if loss not in LOSSES:
        raise ValueError(f"loss: expected one of {', '.join(map(repr, LOSSES))}, got {loss!r}")
    if log_prob_min_clamp is not None:
        if isinstance(log_prob_min_clamp, bool) or not isinstance(log_prob_min_clamp, (int, float)):
            raise TypeError(f"log_prob_min_clamp: expected a float or None, got {log_prob_min_clamp!r}")
        if not math.isfinite(log_prob_min_clamp):
            raise ValueError(f"log_prob_min_clamp: expected a finite float, got {log_prob_min_clamp!r}")
        if loss != "forward_kl":
            raise ValueError(f"log_prob_min_clamp: verl clamps its forward KL only; expected None with "
                             f"loss={loss!r}, got {log_prob_min_clamp!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size: expected None or an int >= 1, got {chunk_size!r}")
    if (not isinstance(predicted_clamp, (tuple, list)) or len(predicted_clamp) != 2
            or any(v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v))
                   for v in predicted_clamp)):
        raise ValueError(f"predicted_clamp: expected a pair (lo, hi) of floats or None, got {predicted_clamp!r}")
    lo, hi = predicted_clamp
    if lo is not None and hi is not None and lo > hi:  # no loss lies in it: every row predicted 0
        raise ValueError(f"predicted_clamp: expected lo <= hi, got {predicted_clamp!r}")
    wrong = sorted(set(keywords) - set(KEYWORDS))
    if wrong:
        raise TypeError(f"{wrong[0]}: expected a keyword option of topk_outputs (or one of {', '.join(KEYWORDS)}), "
                        f"got {wrong[0]}={keywords[wrong[0]]!r}")
    distill_check_options({"loss": loss, "beta": beta, "temperature": temperature, "chunk_size": chunk_size,
                           **keywords}, "fused_linear_distill_topk")
    return LossSpec(loss=loss, **loss_parameters(loss, dict(beta=beta)), temperature=float(temperature),
                    weight_hard=0.0, weight_soft=1.0, want_hard=False, tail=None if loss == "forward_kl" else "bucket")


# --- verl's FSDP engine -----------------------------------------------------------------------------

# verl's `agg_loss` modes whose per-token weights are known here (up to one scalar: its global-batch
# normalisers, dp_size, the distillation coefficient and the engine's loss scale)
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")


def response_weights(prompt_lens: torch.Tensor, response_lens: torch.Tensor, response_mask: torch.Tensor,
                     loss_agg_mode: str, n_rows: int, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """(n_rows,) the weight verl's `agg_loss(loss_agg_mode)` gives each packed row's loss, up to one
    scalar, before its clamps (`topk_outputs`' predicted_grad); None for a mode not in AGG_MODES.
    Rows are the sequences' tokens packed (prompt then response each); verl's `no_padding_2_padding`
    takes the response's losses from the rows one before its tokens (the logits at t predict t + 1):
    row start_b + t for t < response_lens[b], start_b = (end of sequence b) − response_lens[b] − 1,
    weighted by response_mask[b, t] (and by 1 / (its row sum + 1e-8) for "seq-mean-token-mean", as
    agg_loss divides); every other row (prompts, the last token, padding) by 0."""
    if loss_agg_mode not in AGG_MODES:
        return None
    dev = response_mask.device
    prompt_lens, response_lens = prompt_lens.to(dev), response_lens.to(dev)
    per = response_mask.to(dtype)
    if loss_agg_mode == "seq-mean-token-mean":
        per = per / (torch.sum(response_mask, dim=-1) + 1e-8).to(dtype)[:, None]  # agg_loss's divisor
    seq = torch.repeat_interleave(torch.arange(len(response_lens), device=dev), response_lens)
    first = torch.cumsum(response_lens, 0) - response_lens  # each sequence's first response slot, packed
    t = torch.arange(seq.numel(), device=dev) - first[seq]
    start = torch.cumsum(prompt_lens + response_lens, 0) - response_lens - 1
    base = torch.zeros(n_rows, dtype=dtype, device=dev)
    base[start[seq] + t] = per[seq, t]
    return base


_ENGINE = "verl.workers.engine.fsdp.transformer_impl"
# topk_outputs' arguments that patch() sets for each micro-batch: {name: where they come from}
_SET_BY_PATCH = {
    "temperature": "verl's own config (the micro-batch, distillation_loss)",
    "log_prob_min_clamp": "verl's own config (the micro-batch, distillation_loss)",
    "predicted_grad": "the micro-batch (its response mask and the actor's loss_agg_mode)",
    "predicted_clamp": "verl's config (0 and distillation_loss.loss_max_clamp)",
    "lm_head_bias": "the model's LM head",
}


def _check_version():
    try:
        version = importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError('flashkd.integrations.verl.patch(): verl is not installed (pip install "flashkd[verl]")')
    if version not in TESTED_VERL_VERSIONS:
        raise RuntimeError(f"flashkd.integrations.verl.patch(): verl {version} is installed; this patch is tested "
                           f"with verl {', '.join(TESTED_VERL_VERSIONS)} only (its engine's model outputs and "
                           f"distillation loss may differ): install one of those, or leave it unpatched")
    return version


def _last_hidden(output):
    hidden = getattr(output, "hidden_states", None)
    if not hidden:
        raise RuntimeError("flashkd.integrations.verl: the model returned no hidden_states with "
                           "output_hidden_states=True; its forward must pass them through")
    return hidden[-1]


def _lm_head(module):
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    if head is None:
        raise RuntimeError(f"flashkd.integrations.verl: {type(module).__name__} has no output embeddings (LM head)")
    return head



def _predicted(micro_batch, loss_fn, loss_cfg, hidden):
    """The per-row weights verl's distillation loss will give this rank's losses (`response_weights`),
    or None where they are not known here: another loss_agg_mode, Ulysses sequence parallelism (each
    rank holds a slice of the rows), padded (not nested) prompts, or a policy-gradient loss (detached)."""
    from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size

    config = (getattr(loss_fn, "keywords", None) or {}).get("config")
    mode = getattr(config, "loss_agg_mode", None)
    if mode not in AGG_MODES or get_ulysses_sequence_parallel_world_size() > 1 \
            or getattr(loss_cfg, "use_policy_gradient", False):
        return None
    try:
        prompts, responses, mask = micro_batch["prompts"], micro_batch["responses"], micro_batch["response_mask"]
    except KeyError:
        return None
    if not (prompts.is_nested and responses.is_nested):
        return None
    if mask.is_nested:
        mask = mask.to_padded_tensor(0)
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    base = response_weights(prompts.offsets().diff(), responses.offsets().diff(), mask.to(hidden.device), mode,
                            hidden.shape[0], dtype)
    return base

def patch(**options) -> None:
    """Install flashkd's top-k path in verl's FSDP engine (`FSDPEngineWithLMHead`): for a micro-batch
    with top-k distillation and `use_fused_kernels`, the model's last hidden states and LM head give
    verl's five per-token outputs (`topk_outputs`). `options` go to `topk_outputs` (loss="reverse_kl"
    or "jsd", beta, chunk_size, backend, ...); the temperature and `log_prob_min_clamp` come from verl's
    own config. Idempotent (a second call sets the options); `unpatch()` restores verl's methods, which
    are kept on the engine class while patched."""
    _check_version()
    # the options first, before verl's modules are imported: a wrong one fails here, not in verl's first
    # training step. What the patch passes itself is no option: given here it would be overridden (or,
    # lm_head_bias, be a second value of the same keyword at the first step)
    for name, source in _SET_BY_PATCH.items():
        if name in options:
            raise TypeError(f"{name}: expected from {source}, not as an option of patch(), got "
                            f"{name}={options[name]!r}")
    check_options(**options)
    options = dict(options)
    from verl.utils import tensordict_utils as tu
    from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size, slice_input_tensor
    import importlib

    engine = importlib.import_module(_ENGINE).FSDPEngineWithLMHead
    inputs_fn, outputs_fn = (original(engine, name) for name in _METHODS)

    def ours(micro_batch):
        return (tu.get_non_tensor_data(data=micro_batch, key="distillation_use_topk", default=False)
                and tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels", default=False))

    def prepare_model_inputs(self, micro_batch):
        model_inputs, output_args = inputs_fn(self, micro_batch)
        if ours(micro_batch):
            model_inputs["output_hidden_states"] = True
        return model_inputs, output_args

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        model_output = outputs_fn(self, output, output_args, micro_batch, logits_processor_func)
        if not ours(micro_batch) or logits_processor_func is None:
            return model_output
        # verl's worker passes partial(distillation_ppo_loss, config=..., distillation_config=...): the
        # loss's config (its log_prob_min_clamp) is read from there, as its logits path reads it
        cfg = (getattr(logits_processor_func, "keywords", None) or {}).get("distillation_config")
        loss_cfg = getattr(cfg, "distillation_loss", None)
        if loss_cfg is None:
            raise RuntimeError("flashkd.integrations.verl: expected the engine's loss function to be verl's "
                               "partial(distillation_ppo_loss, ..., distillation_config=...), got "
                               f"{logits_processor_func!r}: its distillation config is not known here")
        if getattr(loss_cfg, "loss_mode", "forward_kl_topk") != "forward_kl_topk":
            raise RuntimeError(f"flashkd.integrations.verl: expected distillation loss_mode 'forward_kl_topk' for "
                               f"a top-k run, got {loss_cfg.loss_mode!r}")
        hidden = _last_hidden(output).squeeze(0)  # (total_nnz / sp + pad, H)
        head = _lm_head(self.module)
        weight, bias = full_head(head.weight, getattr(head, "bias", None), hidden.dtype)
        ids = micro_batch["teacher_ids"].values().unsqueeze(0)
        lp = micro_batch["teacher_logprobs"].values().unsqueeze(0)
        if get_ulysses_sequence_parallel_world_size() > 1:  # as verl's compute_forward_kl_topk slices them
            ids, lp = slice_input_tensor(ids, dim=1), slice_input_tensor(lp, dim=1)
        ids, lp = ids.squeeze(0), lp.squeeze(0)
        if ids.shape[0] != hidden.shape[0]:
            raise RuntimeError(f"flashkd.integrations.verl: {ids.shape[0]} teacher rows for {hidden.shape[0]} "
                               f"hidden-state rows on this rank")
        temperature = micro_batch["temperature"]
        if isinstance(temperature, torch.Tensor):
            temperature = temperature.flatten()[0].item()  # verl's fused path takes one temperature
        predicted = _predicted(micro_batch, logits_processor_func, loss_cfg, hidden)
        these = dict(options)
        if predicted is not None:
            these.update(predicted_grad=predicted, predicted_clamp=(0.0, getattr(loss_cfg, "loss_max_clamp", None)))
        with contextlib.nullcontext() if not getattr(loss_cfg, "use_policy_gradient", False) else torch.no_grad():
            outs = topk_outputs(hidden, weight.to(hidden.dtype), ids, lp, temperature=float(temperature),
                                log_prob_min_clamp=getattr(loss_cfg, "log_prob_min_clamp", None),
                                lm_head_bias=None if bias is None else bias.to(hidden.dtype), **these)
        cu_seqlens = micro_batch["input_ids"].offsets()
        for name, v in outs.items():
            v = self._gather_and_unpad_packed(v, output_args["pad_size"])
            model_output[name] = torch.nested.nested_tensor_from_jagged(v, cu_seqlens)
        return model_output

    replace(engine, "prepare_model_inputs", prepare_model_inputs)
    replace(engine, "prepare_model_outputs", prepare_model_outputs)
    announce("verl's FSDP engine computes top-k distillation (use_fused_kernels) with flashkd "
             "(flashkd.integrations.verl.patch; unpatch() undoes it)")


def unpatch() -> None:
    """verl's own engine methods again, exactly as they were (nothing when not patched)."""
    module = sys.modules.get(_ENGINE)
    if module is not None:
        restore(module.FSDPEngineWithLMHead, *_METHODS)


def is_patched() -> bool:
    module = sys.modules.get(_ENGINE)
    return module is not None and is_replaced(module.FSDPEngineWithLMHead, _METHODS[0])


# verl imports the modules named in VERL_USE_EXTERNAL_MODULES in every process that imports verl (its
# Ray workers too, where the engine is built): naming this module there installs the patch in each.
if __name__ in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(","):
    patch()
