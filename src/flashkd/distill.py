"""The student's LM head + a distillation loss, chunked over rows, grads computed in forward.

Three input forms of the teacher share one chunk loop:

    fused_linear_distill         teacher hidden states and LM head: T[c] = Xt[c] @ Wt[:V]^T (+ bt[:V])
    fused_linear_distill_logits  precomputed dense teacher logits:  T[c] = teacher_logits[c, :V]
    fused_linear_distill_topk    sparse teacher: (ids, logprobs)[c], K per row (losses.topk_row_losses)

    validate + flatten (..., H) -> (N, H)
    plan: rows per chunk R, and teacher rows at a time Rt <= R, from a memory budget
    for each chunk c of rows:
        S = Xs[c] @ Ws^T (+ bs)                     (R, V) in the input dtype
        for each block b of Rt rows of c:
            T = the teacher's block for b           only when the soft term is wanted
            soft, hard = backend.rows(S[b], T, ...) S[b] is overwritten with dL/dS when grads are wanted
        dXs[c] = dS @ Ws;  dWs += dS^T @ Xs[c] (fp32);  dbs += Σ_rows dS (fp32)
    loss = scale · (w_hard Σ hard + w_soft Σ soft);   backward multiplies the saved grads by grad_output

Extra memory, bytes, beyond the inputs (E = element size of the inputs):
    logits:  R·V·E + Rt·V·E with teacher heads (Rt = R unless the plan splits a chunk's teacher
             logits); R·V·E for dense teacher logits, which are read in place, and for a top-k
             teacher; + backend temporaries (torch: ≈ 6·R·V·4, + R·V·4 with labels; triton: none
             beyond O(R·K)); + R·Hs·E with labels (the chunk's rows of Xs, ignored rows zeroed)
    grads:   N·Hs·E (dXs) + V·Hs·A (dWs accumulator: A = 4 for fp32, A = E when all rows fit one
             chunk or grad_accum_dtype is the weight's dtype), made for the first chunk's dW GEMM,
             once its teacher logits are freed; rounded to V·Hs·E after the loop (no copy when A = E)
    peak:    one chunk   N·Hs·E + max(logits, R·V·E + V·Hs·E)
             chunks      N·Hs·E + max(logits + V·Hs·A,  V·Hs·(A + E))    (second term only when A ≠ E)
             (`_peak_bytes`; without dW wanted, V·Hs terms are 0)
The default plan (triton) keeps the logits within 1 GiB, in equal chunks with R = Rt; or, when that
takes more than one chunk and the weight's gradient is wanted, all N rows in one chunk (with teacher
heads, their logits in two blocks of ceil(N/2) rows) if its peak is no higher: its dW is then one
GEMM, with no accumulation.
Backward scales the saved grads by grad_output in place (no host sync, no copy); only when the graph
is retained (retain_graph=True, gradcheck) does it return new tensors, another
N·Hs·E + V·Hs·E. Nothing of size N × V is ever allocated. The gradients are first order: a backward
with create_graph=True raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys

import torch

from . import fp8
from .losses import DistillStats, LossSpec
from .backends import torch_rows

# Default memory for one chunk's logits. Bigger chunks make the GEMMs more efficient; past a few
# thousand rows they stop getting faster. The torch backend also keeps fp32 autograd temporaries.
_LOGITS_BUDGET = {"triton": 1 << 30, "torch": 512 << 20}
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclasses.dataclass(frozen=True)
class _Plan:
    spec: LossSpec
    chunk: int
    backend: str
    grad_accum_dtype: torch.dtype
    form: str  # the teacher's input form: "heads" (Xt, Wt, bt), "logits" (T,) or "topk" (ids, logprobs)
    teacher_chunk: int  # rows of teacher logits computed at a time within a chunk (heads only)
    stats: bool = False  # also sum the DistillStats
    vocab: object = None  # a rank's slice of the vocab (flashkd.distributed.ShardedVocab); None: all of it


def fused_linear_distill(
    student_input: torch.Tensor,  # (..., Hs)
    student_weight: torch.Tensor,  # (V, Hs)
    teacher_input: torch.Tensor,  # (..., Ht), same leading dims
    teacher_weight: torch.Tensor,  # (Vt, Ht), Vt >= V
    labels: torch.Tensor | None = None,  # (...) integer, ignore_index marks rows to skip
    *,
    loss: str = "jsd",
    beta: float = 0.5,
    temperature: float = 1.0,
    weight_hard_loss: float = 0.5,
    weight_soft_loss: float = 0.5,
    ignore_index: int = -100,
    student_bias: torch.Tensor | None = None,  # (V,)
    teacher_bias: torch.Tensor | None = None,  # (Vt,)
    reduction: str = "mean",
    chunk_size: int | None = None,
    backend: str = "auto",
    return_soft_hard_loss: bool = False,
    temperature_squared: bool = False,
    grad_accum_dtype: torch.dtype | None = None,
    check_labels: bool | None = None,
    student_logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    student_softcap: float | None = None,
    teacher_softcap: float | None = None,
    row_weight: torch.Tensor | None = None,  # (...) like labels, constant
    return_stats: bool = False,
    process_group=None,
    vocab_start: int | None = None,
    check_shards: bool | None = None,
    check_replicas: bool = False,
    fsdp_gather: str = "auto",
    teacher_precision: str | None = None,
):
    """Distillation loss between a student and a teacher LM head, without materialising the logits.

    Shapes: student_input (..., Hs) and teacher_input (..., Ht) with the same leading dims (B, T or
    N; flattened to N rows, gradients come back in the input's shape), student_weight (V, Hs),
    teacher_weight (Vt, Ht) with Vt >= V, labels (...) int64 or int32 or None, biases (V,) and (Vt,). All
    float tensors share one dtype (fp16, bf16, fp32, fp64).
    loss=: "jsd" (β-weighted JSD, β = 0 forward KL, β = 1 reverse KL), "forward_kl" (KL(p‖q)),
    "reverse_kl" (KL(q‖p)), "tvd" (½ Σ|q − p|) or "cosine" (β (1 − cos) of the logits); q and p are
    the student's and teacher's softmax at temperature τ.

    Returns the scalar loss  w_hard · CE + w_soft · soft  (see `flashkd.losses` for every formula),
    fp32 (fp64 for fp64 inputs, computed in fp64 on every backend), or `(loss, soft, hard)` with
    `return_soft_hard_loss` — `soft` and `hard` are the two terms before their weights, detached, for
    logging. With `return_stats` a `flashkd.DistillStats` comes last: `(loss, stats)`, or
    `(loss, soft, hard, stats)` with both. Gradients flow to `student_input`, `student_weight` and
    `student_bias`; the teacher is a constant (no graph through it, whatever it requires). Rows whose
    label is `ignore_index` contribute nothing, NaN or inf in them included. The gradients are first
    order only: a backward with create_graph=True (double backward) raises RuntimeError. torch.autocast
    changes nothing: the GEMMs run in the inputs' dtype (cast them first for autocast's, as
    `flashkd.integrations` do).

    - student_logit_scale, student_softcap (teacher_...: the teacher's): each head's own transform of
      its logits, z = c · tanh(σ · logits / c) (z = σ · logits with softcap None), before everything
      else: the soft term takes z / τ, the CE the student's z, cosine the z's. σ: a finite non-zero
      float (a config's `logit_scale`, 1 / `logits_scaling`, `lm_head_multiplier`); c: a finite
      float > 0 (`final_logit_softcapping`) or None. Gradients go through both exactly.
    - row_weight: a constant float tensor (any float dtype, read in fp32; fp64 for fp64 inputs) of the
      labels' shape (student_input's leading dims), on the same device: each row's soft and hard
      terms, and their gradients, are multiplied by it. "mean" still divides by the number of rows
      whose label is not ignore_index, so weights of 1 change nothing. Any finite value is allowed
      (negative too); on CPU a non-finite weight is an error, on GPU it is not checked (a host sync)
      and gives a non-finite loss. To drop a row, set its label to ignore_index.

    - labels: int64 or int32. labels=None: every row counts; `weight_hard_loss` must then be 0.
    - teacher vocab Vt > V (same tokenizer, padded head): teacher ids >= V are dropped, so the teacher
      distribution is the softmax over the student's V ids. Vt < V is an error.
    - temperature_squared: multiply the soft term by τ² (Hinton).
    - grad_accum_dtype: dtype of the dWs accumulator; None means fp32 (fp64 for fp64 weights).
      Passing the weight's own dtype saves V·Hs·(4 − E) bytes, and rounds dWs once per chunk: its
      error grows with the number of chunks (bf16, 8 chunks: 1.8–4.6× that of fp32, BENCHMARKS.md).
    - check_labels: raise on labels outside [0, V) other than ignore_index. Default: on CPU tensors
      (no cost); off on GPU, where such a row gives a NaN loss instead (the check would be a host sync).
    - process_group, vocab_start, check_shards, check_replicas: vocab-parallel heads, each rank holding
      the rows [vocab_start, vocab_start + V_r) of each head; fsdp_gather: what to gather for a head
      that is an FSDP2 DTensor ("auto", "rows", "heads"). See `flashkd.distributed`.
    - teacher_precision: None (the teacher's logits from a GEMM in its dtype), or "fp8" (the same as
      "fp8-rowwise") or "fp8-1x128": from an e4m3 GEMM with one scale per row (per 128 hidden units)
      of teacher_input and teacher_weight, on GPUs with FP8 tensor cores (sm_89+; 1x128 on sm_90
      only). The quantised head is cached until teacher_weight changes or is freed
      (`flashkd.fp8.clear_cache()`). Faster, and less exact: the teacher's probabilities move by
      what e4m3's 3-bit mantissa does to its logits (README, BENCHMARKS.md). See `flashkd.fp8`.
    """
    if process_group is not None or _any_dtensor(student_weight, teacher_weight, student_bias, teacher_bias):
        return _distributed("fused_linear_distill", locals())
    spec = _spec(locals())
    xs, ws, bs, y = _check_student(student_input, student_weight, student_bias, labels)
    xt, wt, bt = _check_teacher_heads(xs, student_input, ws, teacher_input, teacher_weight, teacher_bias)
    return _run(spec, "heads", (xt, wt, bt), xs, ws, bs, y, locals())


def fused_linear_distill_logits(
    student_input: torch.Tensor,  # (..., Hs)
    student_weight: torch.Tensor,  # (V, Hs)
    teacher_logits: torch.Tensor,  # (..., Vt), same leading dims, Vt >= V
    labels: torch.Tensor | None = None,
    *,
    loss: str = "jsd",
    beta: float = 0.5,
    temperature: float = 1.0,
    weight_hard_loss: float = 0.5,
    weight_soft_loss: float = 0.5,
    ignore_index: int = -100,
    student_bias: torch.Tensor | None = None,
    reduction: str = "mean",
    chunk_size: int | None = None,
    backend: str = "auto",
    return_soft_hard_loss: bool = False,
    temperature_squared: bool = False,
    grad_accum_dtype: torch.dtype | None = None,
    check_labels: bool | None = None,
    student_logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    student_softcap: float | None = None,
    teacher_softcap: float | None = None,
    row_weight: torch.Tensor | None = None,
    return_stats: bool = False,
    process_group=None,
    vocab_start: int | None = None,
    check_shards: bool | None = None,
    check_replicas: bool = False,
    fsdp_gather: str = "auto",
):
    """`fused_linear_distill` with the teacher given as precomputed dense logits (no teacher GEMM).

    Same losses, options and results as `fused_linear_distill` with teacher logits
    Xt @ Wt^T (+ bt); `teacher_logits` has the student's dtype and is read in place, one chunk of rows
    at a time (any strides with unit stride over the vocab; other layouts are copied per chunk). Its
    columns >= V (a padded head) are dropped. The teacher gets no gradient. `teacher_logit_scale` and
    `teacher_softcap` transform `teacher_logits` as given: an HF model's `.logits` already include
    its own scale and softcap, so leave them at their defaults for those. With `process_group`,
    `teacher_logits` are the columns of this rank's vocab slice.
    """
    if process_group is not None or _any_dtensor(student_weight, student_bias):
        return _distributed("fused_linear_distill_logits", locals())
    spec = _spec(locals())
    xs, ws, bs, y = _check_student(student_input, student_weight, student_bias, labels)
    tl = _check_teacher_logits(xs, student_input, ws, teacher_logits)
    return _run(spec, "logits", (tl,), xs, ws, bs, y, locals())


def fused_linear_distill_topk(
    student_input: torch.Tensor,  # (..., Hs)
    student_weight: torch.Tensor,  # (V, Hs)
    teacher_ids: torch.Tensor,  # (..., K) integer vocab ids, -1 marks an unused slot
    teacher_logprobs: torch.Tensor,  # (..., K) teacher log-probs at those ids
    labels: torch.Tensor | None = None,
    *,
    loss: str = "forward_kl",
    tail: str = "bucket",
    beta: float = 0.5,
    temperature: float = 1.0,
    weight_hard_loss: float = 0.0,
    weight_soft_loss: float = 1.0,
    ignore_index: int = -100,
    student_bias: torch.Tensor | None = None,
    reduction: str = "mean",
    chunk_size: int | None = None,
    backend: str = "auto",
    return_soft_hard_loss: bool = False,
    temperature_squared: bool = False,
    grad_accum_dtype: torch.dtype | None = None,
    check_labels: bool | None = None,
    check_teacher: bool | None = None,
    student_logit_scale: float = 1.0,
    student_softcap: float | None = None,
    row_weight: torch.Tensor | None = None,
    return_stats: bool = False,
    process_group=None,
    vocab_start: int | None = None,
    check_shards: bool | None = None,
    check_replicas: bool = False,
    fsdp_gather: str = "auto",
):
    """Distillation from a sparse teacher: its top-k log-probs (from disk, or an inference server).

    The student distribution is q = softmax(student logits / τ) over the whole vocab; the teacher's
    p is known at K ids per row. tail="bucket": both become distributions over K + 1 categories, the
    K ids and one bucket for the rest of the vocab (p_rest = max(1 − Σ p, 0), q_rest = 1 − Σ q);
    tail="renormalize": both are renormalised over the K ids. The loss ("forward_kl", "reverse_kl",
    "jsd", "tvd") is the dense one over those categories; CE mixing, ignore_index, reduction and the
    gradients are those of `fused_linear_distill`. Exact formulas: `flashkd.losses.topk_row_losses`.

    Temperature: `temperature` divides the student's logits only; `teacher_logprobs` are taken as the
    teacher's distribution at that temperature, as `flashkd.teacher_topk(..., temperature=τ)` makes
    them. Log-probs stored at τ0 can be used at τ with tail="renormalize" by passing
    logprobs · τ0 / τ (exact: renormalising over the K ids is all that differs); with tail="bucket"
    the rest mass at τ is not known from them — store them at the τ you distill at.

    - teacher_logprobs: any float dtype, read in fp32 (fp64 for an fp64 student); unused slots are
      ignored (−inf is fine there). They are the teacher's final distribution: only the student has a
      logit scale and softcap here (`student_logit_scale`, `student_softcap`, as in
      `fused_linear_distill`); `teacher_topk` takes the teacher's.
    - row_weight, return_stats: as in `fused_linear_distill`; the stats' `topk_mass_sum` is the
      student's probability mass on the teacher's ids, summed over the rows that count.
    - reverse_kl with tail="bucket" is infinite on a row whose teacher puts no mass outside the K ids
      (p_rest = 0) while the student does: use "jsd" or "renormalize" for such targets.
    - check_teacher: raise on ids outside [-1, V), duplicate ids in a row, log-probs > 0 or NaN at
      used slots, and with tail="bucket" probabilities summing past 1 over the used slots (beyond
      K^u + u, the rounding of log-probs stored in fp16, u = 2^-11, or bf16, u = 2^-8 for any other
      dtype), in rows whose label is not ignore_index. Default: on CPU tensors; off on GPU (a host
      sync), where an out-of-range id or a NaN log-prob gives a NaN loss on its row, duplicates give
      wrong values and a mass past 1 is renormalised (the bucket gets p_rest = 0).
    - With `process_group`, `teacher_ids` are ids of the whole vocab, the same on every rank.
    """
    if process_group is not None or _any_dtensor(student_weight, student_bias):
        return _distributed("fused_linear_distill_topk", locals())
    spec = _spec(locals())
    xs, ws, bs, y = _check_student(student_input, student_weight, student_bias, labels)
    ids, lp = _check_teacher_topk(xs, student_input, ws, teacher_ids, teacher_logprobs)
    if check_teacher is None:
        check_teacher = xs.device.type == "cpu"
    if check_teacher:
        _check_topk_values(ids, lp, ws.shape[0], spec, y)
    return _run(spec, "topk", (ids, lp), xs, ws, bs, y, locals())


def _public_names(spec_of):
    """`_spec` as the public functions call it: the flags checked (LossSpec holds none of them), and
    LossSpec's errors, which name its fields (weight_hard), renamed to the keyword the caller passed."""

    @functools.wraps(spec_of)
    def checked(args: dict) -> LossSpec:
        for flag in ("return_soft_hard_loss", "return_stats", "temperature_squared", "check_labels", "check_teacher"):
            value, optional = args.get(flag, False), flag.startswith("check_")  # check_teacher: top-k only
            if not isinstance(value, bool) and not (optional and value is None):
                raise TypeError(f"{flag}: expected a bool{' or None' if optional else ''}, got {value!r}")
        try:
            return spec_of(args)
        except (TypeError, ValueError) as e:
            raise _renamed(e, {"weight_hard": "weight_hard_loss", "weight_soft": "weight_soft_loss"}) from None

    return checked


def _renamed(error: Exception, names: dict) -> Exception:
    """`error` with the argument its message starts with ("name: expected ...") renamed by `names`."""
    field, sep, rest = str(error).partition(":")
    return type(error)(f"{names[field]}{sep}{rest}") if field in names else error


@_public_names
def _spec(args: dict) -> LossSpec:
    """The LossSpec of a public call, from its arguments."""
    has_labels = args["labels"] is not None
    w_hard, w_soft = args["weight_hard_loss"], args["weight_soft_loss"]
    logged = args["return_soft_hard_loss"] or args["return_stats"]
    spec = LossSpec(
        loss=args["loss"],
        beta=args["beta"],
        temperature=args["temperature"],
        weight_hard=w_hard,
        weight_soft=w_soft,
        temperature_squared=args["temperature_squared"],
        ignore_index=args["ignore_index"],
        reduction=args["reduction"],
        want_hard=has_labels and (w_hard != 0.0 or logged),
        # With both weights 0 the soft term is still computed, so the loss and grads are true zeros.
        want_soft=w_soft != 0.0 or logged or not has_labels or w_hard == 0.0,
        tail=args.get("tail"),  # only the top-k form has one
        student_logit_scale=args["student_logit_scale"],
        student_softcap=args["student_softcap"],
        teacher_logit_scale=args.get("teacher_logit_scale", 1.0),  # a top-k teacher has none
        teacher_softcap=args.get("teacher_softcap"),
    )
    if not has_labels and w_hard != 0.0:
        raise ValueError(f"weight_hard_loss: expected 0 when labels is None (no hard labels to train on), got {w_hard!r}")
    return spec


def _distributed(name, args):
    """Vocab-parallel and FSDP2 calls: `flashkd.distributed`, imported by the first such call."""
    from . import distributed

    return distributed.dispatch(name, args)


def _any_dtensor(*xs) -> bool:
    dtensor = sys.modules.get("torch.distributed.tensor")  # not imported: none can be one
    return dtensor is not None and any(isinstance(x, dtensor.DTensor) for x in xs)


def _run(spec, form, teacher, xs, ws, bs, y, args, vocab=None):
    """Plan and run a validated call; the shared tail of the three public functions. vocab: a rank's
    slice of the vocab (`flashkd.distributed`); its calls use the torch row definition on every
    backend and plan their chunks for the group's largest slice, `vocab.plan_size`."""
    check_labels, grad_accum_dtype = args["check_labels"], args["grad_accum_dtype"]
    if vocab is None and args["vocab_start"] is not None:
        raise ValueError(f"vocab_start: expected None without process_group, got {args['vocab_start']!r}")
    if args["fsdp_gather"] not in ("auto", "rows", "heads"):
        raise ValueError(f"fsdp_gather: expected 'auto', 'rows' or 'heads', got {args['fsdp_gather']!r}")
    if check_labels is None:
        check_labels = xs.device.type == "cpu"
    if check_labels and y is not None:
        _check_label_range(y, ws.shape[0] if vocab is None else int(vocab.total), spec.ignore_index)
    wide = torch.promote_types(ws.dtype, torch.float32)
    if grad_accum_dtype is None:
        grad_accum_dtype = wide
    # Only these two: another would round dW to a format it does not have (fp16 for bf16 weights), or
    # ask cuBLAS for an output dtype it does not offer (fp64 from fp32 operands).
    if grad_accum_dtype not in (wide, ws.dtype):
        raise TypeError(f"grad_accum_dtype: expected {wide} or student_weight's dtype {ws.dtype}, got {grad_accum_dtype!r}")
    backend = _pick_backend(args["backend"], xs)
    if vocab is not None:
        backend = "torch"
    want_dw = torch.is_grad_enabled() and ws.requires_grad
    accum_bytes = grad_accum_dtype.itemsize if want_dw else 0
    v = ws.shape[0] if vocab is None else vocab.plan_size
    chunk, teacher_chunk = _chunk_rows(args["chunk_size"], xs, ws, backend, form, accum_bytes, v)
    rw = _check_row_weight(args["row_weight"], xs, args["student_input"])
    stats = args["return_stats"]
    if not isinstance(stats, bool):
        raise TypeError(f"return_stats: expected a bool, got {stats!r}")
    if form == "heads":
        teacher = _teacher_head(teacher, args.get("teacher_precision"))
    plan = _Plan(spec, chunk, backend, grad_accum_dtype, form, teacher_chunk, stats, vocab)
    loss_, soft, hard, *sums = _apply(xs, ws, bs, y, rw, plan, *teacher)
    out = (loss_, soft, hard) if args["return_soft_hard_loss"] else (loss_,)
    if stats:
        out += (DistillStats(*sums[:4], sums[4] if form == "topk" else None),)
    return out if len(out) > 1 else loss_


@torch.compiler.disable  # one graph break: the chunk loop runs eagerly inside compiled code
def _apply(xs, ws, bs, y, rw, plan, *teacher):
    with _autocast_off(xs.device):
        if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (xs, ws, bs)):
            return _FusedDistill.apply(xs, ws, bs, y, rw, plan, *teacher)
        # Evaluation: no autograd node, and no gradient work at all. The teacher is a constant: without
        # no_grad a teacher that requires grad would get a graph through every chunk's logits (and a grad).
        with torch.no_grad():
            return _chunk_loop(xs, ws, bs, y, rw, teacher, plan, False, False, False)[0]


def _autocast_off(device: torch.device):
    """torch.autocast switched off on `device`: the GEMMs run in the inputs' dtype, which the checks
    made one, and write into buffers of it (autocast would make their logits bf16 from fp32 inputs,
    and fail on the fp32 dX written in place). To compute in autocast's dtype, pass tensors of it."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


_NO_DOUBLE_BACKWARD = ("flashkd: a fused distillation loss computes its gradients in its forward pass, so they carry "
                       "no graph: backward with create_graph=True (double backward, a gradient penalty, "
                       "gradgradcheck) is not supported; take second-order terms from the unfused logits")


def _first_order_only(backward):
    """A backward that refuses create_graph=True. torch's once_differentiable marks the gradients as not
    differentiable only when grad_output requires grad: with a plain seed they came back as constants,
    and a term built on them (a gradient penalty) silently added nothing to the gradients. Giving them
    a graph that raises when reached would need the inputs saved for backward (N·Hs·E more bytes)."""

    @functools.wraps(backward)
    def wrapper(ctx, *grad_outputs):
        if torch.is_grad_enabled():  # autograd runs a backward with grad mode on only for create_graph=True
            raise RuntimeError(_NO_DOUBLE_BACKWARD)
        return backward(ctx, *grad_outputs)

    return wrapper


class _FusedDistill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xs, ws, bs, y, rw, plan: _Plan, *teacher):
        want_dx, want_dw, want_db = ctx.needs_input_grad[:3]
        (loss, *logged), dxs, dws, dbs = _chunk_loop(xs, ws, bs, y, rw, teacher, plan, want_dx, want_dw, want_db)
        ctx.save_for_backward(dxs, dws, dbs)
        ctx.num_teacher = len(teacher)
        ctx.backend = plan.backend
        ctx.mark_non_differentiable(*logged)
        return loss, *logged

    @staticmethod
    @_first_order_only
    def backward(ctx, grad_loss, *_grad_logged):
        # grad_loss is a 0-d device tensor: scaling by it needs no host sync, whatever its value. The
        # saved grads are ours alone and freed after this call unless the graph is kept for another
        # backward: only then must they stay unscaled, and the scaled grads be new tensors.
        keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", lambda: True)()
        if keep:
            grads = tuple(None if g is None else g * grad_loss.to(g.dtype) for g in ctx.saved_tensors)
        elif ctx.backend == "triton":
            from .backends import triton_rows

            grads = tuple(None if g is None else triton_rows.scale_(g, grad_loss) for g in ctx.saved_tensors)
        else:
            grads = tuple(None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in ctx.saved_tensors)
        return (*grads, None, None, None, *(None,) * ctx.num_teacher)


def _chunk_loop(xs, ws, bs, y, rw, teacher, plan: _Plan, want_dx, want_dw, want_db):
    """((loss, soft, hard, *sums of DistillStats when plan.stats), dxs, dws, dbs)."""
    spec = plan.spec
    n, v = xs.shape[0], ws.shape[0]
    rows = _rows(plan)
    grad = want_dx or want_dw or want_db
    device = xs.device
    # Loss math and accumulators in fp32, or fp64 for fp64 inputs (which float64 gradcheck relies on).
    f32 = dict(device=device, dtype=torch.promote_types(xs.dtype, torch.float32))
    if y is None or spec.reduction == "sum":
        scale = torch.full((), 1.0 if spec.reduction == "sum" else 1.0 / max(n, 1), **f32)
    else:
        scale = 1.0 / (y != spec.ignore_index).sum().clamp_min(1).to(f32["dtype"])
    if rw is not None:
        rw = rw.to(f32["dtype"])  # N numbers, read in the loss math's precision
    soft_sum = torch.zeros((), **f32)
    hard_sum = torch.zeros((), **f32)
    entropy_sum = torch.zeros((), **f32)
    mass_sum = torch.zeros((), **f32)
    dxs = torch.empty_like(xs, memory_format=torch.contiguous_format) if want_dx else None
    # With one chunk there is nothing to accumulate: the GEMM accumulates in fp32 and rounds once either
    # way. dWs is made for the first chunk's GEMM (beta = 0 fills it), after that chunk's teacher logits
    # are freed: one chunk then peaks at max(S + T, S + dWs), not S + T + dWs.
    accum = plan.grad_accum_dtype if n > plan.chunk else ws.dtype
    dws = torch.zeros(ws.shape, device=device, dtype=ws.dtype) if want_dw and n == 0 else None
    dbs = torch.zeros(v, **f32) if want_db else None
    for start in range(0, n, plan.chunk):
        c = slice(start, min(start + plan.chunk, n))
        # Ignored rows (padding) may hold NaN or inf: zeroed, they cannot reach dW = dSᵀX as 0 · NaN, nor
        # dS through a NaN logit. One select over R·Hs elements and R·Hs·E bytes a chunk (1/V of its
        # GEMM), on the device: no host sync.
        x = xs[c] if y is None else torch.where((y[c] != spec.ignore_index)[:, None], xs[c], 0.0)
        s = _linear(x, ws, bs)
        for sub in range(c.start, c.stop, plan.teacher_chunk):
            b = slice(sub, min(sub + plan.teacher_chunk, c.stop))
            t = _teacher_block(plan.form, teacher, b) if spec.want_soft else None
            s_b = s[b.start - c.start : b.stop - c.start]  # rows of s: contiguous
            row_scale = scale if rw is None else scale * rw[b]
            soft, hard, *extra = rows(s_b, t, None if y is None else y[b], spec, row_scale, grad, plan.stats)
            if rw is not None:
                soft, hard = soft * rw[b], hard * rw[b]
            soft_sum += soft.sum()
            hard_sum += hard.sum()
            if plan.stats:
                entropy_sum += extra[0].sum()
                if len(extra) > 1:
                    mass_sum += extra[1].sum()
            del t, s_b  # a view left alive would keep this chunk's logits past `del s`
        if want_dx:
            torch.mm(s, ws, out=dxs[c])
            if plan.vocab is not None:
                plan.vocab.chunk_dx(dxs[c])
        if want_dw:
            if start == 0:
                dws = torch.empty(ws.shape, device=device, dtype=accum)
            _accumulate_mm(dws, s.t(), x, beta=0.0 if start == 0 else 1.0)
        if want_db:
            dbs += s.sum(0, dtype=dbs.dtype)
        del s, x  # before the next chunk's GEMM allocates, and before dWs is cast below
    soft_total = soft_sum * scale * (spec.temperature**2 if spec.temperature_squared else 1.0)
    hard_total = hard_sum * scale
    loss = spec.total(soft_sum, hard_sum) * scale
    if plan.vocab is not None:
        dxs, dws, dbs = plan.vocab.finish(dxs, dws, dbs)
    if dws is not None:
        dws = dws.to(ws.dtype)
    if dbs is not None:
        dbs = dbs.to(bs.dtype)
    logged = (loss, soft_total, hard_total)
    if plan.stats:
        count = torch.full((), n, device=device) if y is None else (y != spec.ignore_index).sum()
        logged += (soft_sum, hard_sum, count, entropy_sum, mass_sum)
    return logged, dxs, dws, dbs


def _rows(plan: _Plan):
    """The backend's row function for the plan's teacher form (see `flashkd.backends`)."""
    if plan.vocab is not None:
        return plan.vocab.rows(plan.form)
    if plan.backend == "triton":
        from .backends import triton_rows, triton_topk

        return triton_topk.topk_rows if plan.form == "topk" else triton_rows.rows
    return torch_rows.topk_rows if plan.form == "topk" else torch_rows.rows


def _teacher_head(teacher, precision):
    """(xt, wt, bt) with wt the cached FP8 head of teacher_precision "fp8...", else as it came."""
    xt, wt, bt = teacher
    scaling = fp8.scaling_of(precision, xt.device)
    if scaling is None:
        return teacher
    fp8.check_dtype(xt.dtype)
    return xt, fp8.head(wt, scaling), bt


def _teacher_block(form, teacher, c):
    if form == "heads":
        xt, wt, bt = teacher
        if isinstance(wt, fp8.Head):
            return fp8.linear(xt[c], wt, bt)
        return _linear(xt[c], wt, bt)
    if form == "logits":
        return teacher[0][c]
    ids, lp = teacher
    return ids[c], lp[c]


def _linear(x, w, b):
    return x @ w.t() if b is None else torch.addmm(b, x, w.t())


def _accumulate_mm(acc, a, b, beta):
    """acc = beta · acc + a @ b, accumulated in acc's dtype (fp32 for bf16 operands on CUDA).
    beta = 0 on the first chunk: acc is then never read, so it needs no zero-fill."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b, beta=beta)
    elif acc.is_cuda:
        torch.addmm(acc, a, b, beta=beta, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype), beta=beta)


def _pick_backend(backend, x):
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend: expected 'auto', 'torch' or 'triton', got {backend!r}")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if backend == "auto":
        return "triton" if x.is_cuda and _has_triton() else "torch"
    if backend == "triton":
        if not _has_triton():
            raise ValueError("backend: 'triton' was asked for, but the triton package is not installed")
        if not (x.is_cuda or interpret):
            raise ValueError(
                f"backend: 'triton' needs CUDA tensors (or TRITON_INTERPRET=1), got tensors on {x.device}"
            )
    # The Triton kernels compute in fp32: fp64 inputs (float64 gradcheck, references) get the torch rows'
    # fp64 math on every backend.
    return "torch" if x.dtype == torch.float64 else backend


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _chunk_rows(chunk_size, xs, ws, backend, form, accum_bytes, v=None) -> tuple[int, int]:
    """(rows per chunk, teacher rows at a time): chunk_size for both, or the plan in the module's doc.
    accum_bytes: element size of the dW accumulator; 0 when dW is not wanted. v: the vocab rows to
    plan for (the weight's, or the largest slice of a vocab-parallel group)."""
    n, hs = xs.shape[0], ws.shape[1]
    v = ws.shape[0] if v is None else v
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size: expected a positive int or None, got {chunk_size!r}")
        rows = min(chunk_size, max(n, 1))
        return rows, rows
    row = v * xs.element_size()  # one row of logits
    blocks = 2 if form == "heads" else 1
    budget = _LOGITS_BUDGET[backend]
    if backend == "torch":
        rows = _even_chunks(n, budget // (row * blocks + v * 4 * 6))
        return rows, rows
    rows = _even_chunks(n, budget // (row * blocks))
    if rows < n and accum_bytes:
        # One chunk needs no dW accumulator (its GEMM rounds once, into dW's dtype): taken when that
        # makes the peak no higher.
        teacher = -(-n // 2) if form == "heads" else n
        peak = functools.partial(_peak_bytes, n, v, hs, xs.element_size(), form=form, accum_bytes=accum_bytes)
        if peak(n, teacher) <= peak(rows, rows):
            return n, teacher
    return rows, rows


def _peak_bytes(n, v, hs, e, rows, teacher_rows, *, form, accum_bytes) -> int:
    """Peak extra bytes of a plan, as the module's doc gives them (e: bytes of an input element,
    accum_bytes: of a dW accumulator element, 0 when dW is not wanted; the bias grad's V fp32 left out)."""
    logits = rows * v * e + (teacher_rows * v * e if form == "heads" else 0)
    dw = v * hs * e if accum_bytes else 0
    if rows >= n:
        return n * hs * e + max(logits, rows * v * e + dw)
    acc = v * hs * accum_bytes
    return n * hs * e + max(logits + acc, acc + dw if accum_bytes != e else 0)


# Chunks of a multiple of this many rows fill the GEMMs' row tiles (128 or 256 rows on an H200):
# at N = 8192 with teacher heads, 4 × 2048 rows instead of 3 × 2092 + 1916 (BENCHMARKS.md).
_ROW_TILE = 256


def _even_chunks(n: int, fit: int) -> int:
    """Rows per chunk for n rows when at most `fit` fit: as few chunks as fit allows, of equal size,
    rounded up to a multiple of _ROW_TILE where that still fits."""
    if n <= fit:
        return max(n, 1)
    rows = -(-n // -(-n // max(fit, 1)))  # ceil(n / count), count = ceil(n / fit)
    aligned = -(-rows // _ROW_TILE) * _ROW_TILE
    return aligned if aligned <= fit else rows


def _check_tensors(named: dict, dtype=None, device=None, like="student_input"):
    """Type, dtype (when given) and device of optional tensor arguments, against the tensor `like`."""
    for name, x in named.items():
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        dtensor = sys.modules.get("torch.distributed.tensor")  # not imported: x cannot be one
        if dtensor is not None and isinstance(x, dtensor.DTensor):
            # FSDP2's parameters outside the module's forward: the GEMMs would fail deep inside
            raise TypeError(f"{name}: expected a local torch.Tensor, got a DTensor ({x.placements} over "
                            f"{x.device_mesh}); call where FSDP has gathered it (inside the module's forward), "
                            f"or pass {name}.full_tensor()")
        if dtype is not None and x.dtype != dtype:
            raise TypeError(f"{name}: expected dtype {dtype} (the dtype of {like}), got {x.dtype}")
        if device is not None and x.device != device:
            raise ValueError(f"{name}: expected a tensor on {device} (the device of {like}), got {x.device}")


def _check_student(xs, ws, bs, y):
    """The student side and labels, common to every input form; returns them flattened to rows."""
    _check_tensors({"student_input": xs})
    if xs.dtype not in _FLOATS:
        raise TypeError(f"student_input: expected a floating dtype (float16, bfloat16, float32, float64), got {xs.dtype}")
    _check_tensors({"student_weight": ws, "student_bias": bs}, xs.dtype, xs.device)
    _check_tensors({"labels": y}, device=xs.device)
    # The dtypes the Triton kernel reads: narrower ones would wrap ignore_index (-100 is 156 in uint8).
    if y is not None and y.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels: expected an integer dtype (torch.int64 or torch.int32), got {y.dtype}")
    if ws.dim() != 2 or 0 in ws.shape:  # an empty vocab or hidden size has no distribution
        raise ValueError(f"student_weight: expected a 2-D (vocab, hidden) tensor, both >= 1, got shape {tuple(ws.shape)}")
    if xs.dim() < 1:
        raise ValueError("student_input: expected a tensor of shape (..., hidden), got a 0-d tensor")
    v, hs = ws.shape
    if xs.shape[-1] != hs:
        raise ValueError(
            f"student_input: expected hidden size {hs} (student_weight is {tuple(ws.shape)}), got {xs.shape[-1]}"
        )
    if y is not None and y.shape != xs.shape[:-1]:
        raise ValueError(f"labels: expected shape {tuple(xs.shape[:-1])} (student_input's leading dims), got {tuple(y.shape)}")
    if bs is not None and bs.shape != (v,):
        raise ValueError(f"student_bias: expected shape ({v},), got {tuple(bs.shape)}")
    return xs.reshape(-1, hs), ws, bs, None if y is None else y.reshape(-1)


def _check_row_weight(rw, xs, student_input):
    """row_weight flattened to (N,), or None; its values are checked on CPU only (a host sync)."""
    if rw is None:
        return None
    _check_tensors({"row_weight": rw}, device=xs.device)
    if rw.dtype not in _FLOATS:
        raise TypeError(f"row_weight: expected a floating dtype (float16, bfloat16, float32, float64), got {rw.dtype}")
    if rw.requires_grad:
        raise TypeError("row_weight: expected a constant tensor (requires_grad=False): no gradient flows to "
                        "it; got one that requires grad (pass row_weight.detach())")
    if rw.shape != student_input.shape[:-1]:
        raise ValueError(f"row_weight: expected shape {tuple(student_input.shape[:-1])} (student_input's leading "
                         f"dims, as labels), got {tuple(rw.shape)}")
    rw = rw.reshape(-1)
    if rw.device.type == "cpu":
        bad = ~torch.isfinite(rw)
        if bad.any():
            raise ValueError(f"row_weight: expected finite values, got {rw[bad][0].item()} in row {int(bad.nonzero()[0, 0])}")
    return rw


def _check_leading(name, x, student_input, trailing):
    if x.dim() < 1:
        raise ValueError(f"{name}: expected a tensor of shape (..., {trailing}), got a 0-d tensor")
    if x.shape[:-1] != student_input.shape[:-1]:
        raise ValueError(
            f"{name}: expected leading dims {tuple(student_input.shape[:-1])} (those of student_input), "
            f"got {tuple(x.shape[:-1])}"
        )


def _check_vocab(name, vt, v):
    if vt < v:
        raise ValueError(
            f"{name}: expected a vocab of at least {v} (the student's), got {vt}; a teacher vocab "
            "smaller than the student's is not a padded head of the same tokenizer"
        )


def _check_teacher_heads(xs, student_input, ws, xt, wt, bt):
    _check_tensors({"teacher_input": xt, "teacher_weight": wt, "teacher_bias": bt}, xs.dtype, xs.device)
    if wt.dim() != 2 or 0 in wt.shape:  # an empty vocab or hidden size has no distribution
        raise ValueError(f"teacher_weight: expected a 2-D (vocab, hidden) tensor, both >= 1, got shape {tuple(wt.shape)}")
    _check_leading("teacher_input", xt, student_input, "hidden")
    v = ws.shape[0]
    vt, ht = wt.shape
    if xt.shape[-1] != ht:
        raise ValueError(
            f"teacher_input: expected hidden size {ht} (teacher_weight is {tuple(wt.shape)}), got {xt.shape[-1]}"
        )
    _check_vocab("teacher_weight", vt, v)
    if bt is not None and bt.shape != (vt,):
        raise ValueError(f"teacher_bias: expected shape ({vt},), got {tuple(bt.shape)}")
    # A padded teacher head: its extra ids (>= V) are not tokens of the student's vocab; drop them.
    return xt.reshape(-1, ht), wt[:v], None if bt is None else bt[:v]


def _check_teacher_logits(xs, student_input, ws, tl):
    _check_tensors({"teacher_logits": tl}, xs.dtype, xs.device)
    _check_leading("teacher_logits", tl, student_input, "vocab")
    v = ws.shape[0]
    _check_vocab("teacher_logits", tl.shape[-1], v)
    try:
        flat = tl.view(-1, tl.shape[-1])
    except RuntimeError:
        raise ValueError(
            f"teacher_logits: expected leading dims that flatten without a copy (e.g. a contiguous tensor), "
            f"got strides {tuple(tl.stride())} for shape {tuple(tl.shape)}"
        ) from None
    return flat[:, :v]  # a padded teacher head's ids >= V are dropped, as for teacher_weight


def _check_teacher_topk(xs, student_input, ws, ids, lp):
    _check_tensors({"teacher_ids": ids, "teacher_logprobs": lp}, device=xs.device)
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"teacher_ids: expected an integer dtype (torch.int64 or torch.int32), got {ids.dtype}")
    if lp.dtype not in _FLOATS:
        raise TypeError(f"teacher_logprobs: expected a floating dtype (float16, bfloat16, float32, float64), got {lp.dtype}")
    _check_leading("teacher_ids", ids, student_input, "k")
    if ids.shape[-1] < 1:
        raise ValueError(f"teacher_ids: expected at least one slot per row (K >= 1), got shape {tuple(ids.shape)}")
    if lp.shape != ids.shape:
        raise ValueError(f"teacher_logprobs: expected shape {tuple(ids.shape)} (that of teacher_ids), got {tuple(lp.shape)}")
    k = ids.shape[-1]
    return ids.reshape(-1, k), lp.reshape(-1, k)


def _check_topk_values(ids, lp, v, spec, y):
    """Value checks of a top-k teacher on the rows that count (host syncs: run by default on CPU only);
    rows whose label is ignore_index contribute nothing, whatever they hold."""
    counted = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device) if y is None else y != spec.ignore_index
    bad = ((ids < -1) | (ids >= v)) & counted[:, None]
    if bad.any():
        raise ValueError(f"teacher_ids: expected ids in [0, {v}) or -1 (unused slot), got {ids[bad][0].item()}")
    used = (ids >= 0) & counted[:, None]
    bad = used & ~(lp <= 0)
    if bad.any():
        raise ValueError(
            f"teacher_logprobs: expected log-probabilities <= 0 (not NaN) at used slots, got {lp[bad][0].item()}"
        )
    if spec.tail == "bucket":
        # Stored log-probs round (flashkd.data): by up to u·|log p|, u = 2^-11 in float16 and 2^-8 in
        # bfloat16, whose values may arrive widened to float32. Over K slots that lifts Σ p by at most
        # K^u − 1 (+ u for K < 3, + the fp32 rounding of the log-probs themselves): more is not a
        # distribution, which the bucket would silently renormalise (p_rest = 0).
        u = 2.0**-11 if lp.dtype == torch.float16 else 2.0**-8
        tol = ids.shape[-1] ** u - 1.0 + u + 1e-5
        mass = torch.where(used, lp.double().exp(), 0.0).sum(-1)
        if (mass > 1.0 + tol).any():
            row = int((mass > 1.0 + tol).nonzero()[0, 0])
            raise ValueError(
                f"teacher_logprobs: expected probabilities summing to at most 1 over a row's used slots "
                f"(tail='bucket'; tolerance {tol:.2g} for the log-probs' rounding), got {mass[row].item():.6g} in row {row}"
            )
    ordered = torch.where(used, ids, -1 - torch.arange(ids.shape[-1], device=ids.device)).sort(-1).values
    dup = (ordered[:, 1:] == ordered[:, :-1]).any(-1)
    if dup.any():
        row = int(dup.nonzero()[0, 0])
        dups = ordered[row, 1:][ordered[row, 1:] == ordered[row, :-1]]
        raise ValueError(f"teacher_ids: expected distinct ids within a row, got id {dups[0].item()} twice in row {row}")


def _check_label_range(y, v, ignore_index):
    bad = ((y < 0) | (y >= v)) & (y != ignore_index)
    if bad.any():
        first = y[bad][0].item()
        raise ValueError(f"labels: expected values in [0, {v}) or ignore_index={ignore_index}, got {first}")
