"""fused_linear_distill: LM heads + distillation loss, chunked over rows, grads computed in forward.

    validate + flatten (..., H) -> (N, H)
    plan: rows per chunk from a memory budget
    for each chunk c of rows:
        S = Xs[c] @ Ws^T (+ bs)                     (R, V) in the input dtype
        T = Xt[c] @ Wt[:V]^T (+ bt[:V])             (R, V), only when the soft term is wanted
        soft, hard = backend.rows(S, T, ...)        S is overwritten with dL/dS when grads are wanted
        dXs[c] = dS @ Ws;  dWs += dS^T @ Xs[c] (fp32);  dbs += Σ_rows dS (fp32)
    loss = scale · (w_hard Σ hard + w_soft Σ soft);   backward multiplies the saved grads by grad_output

Extra memory, bytes, beyond the inputs (E = element size of the inputs, R = rows per chunk):
    logits:  R·V·E·2 (S and T) + backend temporaries (torch: ≈ 6·R·V·4; triton: none)
    grads:   N·Hs·E (dXs) + V·Hs·A (dWs accumulator: A = 4 for fp32, A = E when all rows fit one
             chunk), rounded to V·Hs·E after the loop; backward hands autograd new N·Hs·E + V·Hs·E
             (the grads times grad_output)
    peak:    max(logits + N·Hs·E + V·Hs·A,  N·Hs·E + V·Hs·(A + E),  2·N·Hs·E + 2·V·Hs·E)
Without a host sync backward cannot know that grad_output is 1, so it returns new tensors: 2·V·Hs·E is
the floor of this design (1 GiB for V = 128256, Hs = 2048, bf16).
Nothing of size N × V is ever allocated.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from .losses import LossSpec
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
):
    """Distillation loss between a student and a teacher LM head, without materialising the logits.

    Returns the scalar fp32 loss  w_hard · CE + w_soft · soft  (see `flashkd.losses` for every
    formula), or `(loss, soft, hard)` with `return_soft_hard_loss` — `soft` and `hard` are the two
    terms before their weights, detached, for logging. Gradients flow to `student_input`,
    `student_weight` and `student_bias`; the teacher is a constant.

    - labels=None: every row counts; `weight_hard_loss` must then be 0.
    - teacher vocab Vt > V (same tokenizer, padded head): teacher ids >= V are dropped, so the teacher
      distribution is the softmax over the student's V ids. Vt < V is an error.
    - temperature_squared: multiply the soft term by τ² (Hinton).
    - grad_accum_dtype: dtype of the dWs accumulator; None means fp32 (fp64 for fp64 weights).
      Passing the weight's own dtype saves V·Hs·(4 − E) bytes at some precision cost.
    - check_labels: raise on labels outside [0, V) other than ignore_index. Default: on CPU tensors
      (no cost); off on GPU, where such a row gives a NaN loss instead (the check would be a host sync).
    """
    spec = LossSpec(
        loss=loss,
        beta=beta,
        temperature=temperature,
        weight_hard=weight_hard_loss,
        weight_soft=weight_soft_loss,
        temperature_squared=temperature_squared,
        ignore_index=ignore_index,
        reduction=reduction,
        want_hard=labels is not None and (weight_hard_loss != 0.0 or return_soft_hard_loss),
        # With both weights 0 the soft term is still computed, so the loss and grads are true zeros.
        want_soft=weight_soft_loss != 0.0 or return_soft_hard_loss or labels is None or weight_hard_loss == 0.0,
    )
    if labels is None and weight_hard_loss != 0.0:
        raise ValueError(
            f"weight_hard_loss: expected 0 when labels is None (no hard labels to train on), got {weight_hard_loss!r}"
        )
    xs, ws, bs, xt, wt, bt, y = _check_inputs(
        student_input, student_weight, student_bias, teacher_input, teacher_weight, teacher_bias, labels
    )
    if check_labels is None:
        check_labels = xs.device.type == "cpu"
    if check_labels and y is not None:
        _check_label_range(y, ws.shape[0], ignore_index)
    if grad_accum_dtype is None:
        grad_accum_dtype = torch.promote_types(ws.dtype, torch.float32)
    if grad_accum_dtype not in _FLOATS:
        raise TypeError(f"grad_accum_dtype: expected a floating torch.dtype, got {grad_accum_dtype!r}")
    plan = _Plan(spec, _chunk_rows(chunk_size, xs, ws, backend := _pick_backend(backend, xs)), backend, grad_accum_dtype)
    loss_, soft, hard = _apply(xs, ws, bs, xt, wt, bt, y, plan)
    return (loss_, soft, hard) if return_soft_hard_loss else loss_


@torch.compiler.disable  # one graph break: the chunk loop runs eagerly inside compiled code
def _apply(xs, ws, bs, xt, wt, bt, y, plan):
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (xs, ws, bs)):
        return _FusedDistill.apply(xs, ws, bs, xt, wt, bt, y, plan)
    # Evaluation: no autograd node, and no gradient work at all.
    return _chunk_loop(xs, ws, bs, xt, wt, bt, y, plan, False, False, False)[:3]


class _FusedDistill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xs, ws, bs, xt, wt, bt, y, plan: _Plan):
        want_dx, want_dw, want_db = ctx.needs_input_grad[:3]
        loss, soft, hard, dxs, dws, dbs = _chunk_loop(xs, ws, bs, xt, wt, bt, y, plan, want_dx, want_dw, want_db)
        ctx.save_for_backward(dxs, dws, dbs)
        ctx.mark_non_differentiable(soft, hard)
        return loss, soft, hard

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _grad_soft, _grad_hard):
        # grad_loss is a 0-d device tensor: scaling by it needs no host sync, whatever its value.
        grads = tuple(None if g is None else g * grad_loss.to(g.dtype) for g in ctx.saved_tensors)
        return (*grads, None, None, None, None, None)


def _chunk_loop(xs, ws, bs, xt, wt, bt, y, plan: _Plan, want_dx, want_dw, want_db):
    spec = plan.spec
    n, v = xs.shape[0], ws.shape[0]
    rows = torch_rows.rows
    if plan.backend == "triton":
        from .backends import triton_rows

        rows = triton_rows.rows
    grad = want_dx or want_dw or want_db
    device = xs.device
    # Loss math and accumulators in fp32, or fp64 for fp64 inputs (which float64 gradcheck relies on).
    f32 = dict(device=device, dtype=torch.promote_types(xs.dtype, torch.float32))
    if y is None or spec.reduction == "sum":
        scale = torch.full((), 1.0 if spec.reduction == "sum" else 1.0 / max(n, 1), **f32)
    else:
        scale = 1.0 / (y != spec.ignore_index).sum().clamp_min(1).to(f32["dtype"])
    soft_sum = torch.zeros((), **f32)
    hard_sum = torch.zeros((), **f32)
    dxs = torch.empty_like(xs, memory_format=torch.contiguous_format) if want_dx else None
    # Filled by the first chunk's GEMM (beta = 0); zeros only when there are no rows at all. With one
    # chunk there is nothing to accumulate: the GEMM accumulates in fp32 and rounds once either way.
    accum = plan.grad_accum_dtype if n > plan.chunk else ws.dtype
    dws = (torch.empty if n else torch.zeros)(ws.shape, device=device, dtype=accum) if want_dw else None
    dbs = torch.zeros(v, **f32) if want_db else None
    for start in range(0, n, plan.chunk):
        c = slice(start, min(start + plan.chunk, n))
        s = _linear(xs[c], ws, bs)
        t = _linear(xt[c], wt, bt) if spec.want_soft else None
        soft, hard = rows(s, t, None if y is None else y[c], spec, scale, grad)
        soft_sum += soft.sum()
        hard_sum += hard.sum()
        del t
        if want_dx:
            torch.mm(s, ws, out=dxs[c])
        if want_dw:
            _accumulate_mm(dws, s.t(), xs[c], beta=0.0 if start == 0 else 1.0)
        if want_db:
            dbs += s.sum(0, dtype=dbs.dtype)
        del s  # before the next chunk's GEMM allocates, and before dWs is cast below
    soft_total = soft_sum * scale * (spec.temperature**2 if spec.temperature_squared else 1.0)
    hard_total = hard_sum * scale
    loss = spec.total(soft_sum, hard_sum) * scale
    if dws is not None:
        dws = dws.to(ws.dtype)
    if dbs is not None:
        dbs = dbs.to(bs.dtype)
    return loss, soft_total, hard_total, dxs, dws, dbs


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
    return backend


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _chunk_rows(chunk_size, xs, ws, backend) -> int:
    n, v = xs.shape[0], ws.shape[0]
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size: expected a positive int or None, got {chunk_size!r}")
        return min(chunk_size, max(n, 1))
    per_row = v * xs.element_size() * 2 + (v * 4 * 6 if backend == "torch" else 0)
    return max(1, min(n, _LOGITS_BUDGET[backend] // per_row))


def _check_inputs(xs, ws, bs, xt, wt, bt, y):
    named = {
        "student_input": xs,
        "student_weight": ws,
        "teacher_input": xt,
        "teacher_weight": wt,
        "student_bias": bs,
        "teacher_bias": bt,
        "labels": y,
    }
    for name, x in named.items():
        if x is not None and not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    dtype = xs.dtype
    if dtype not in _FLOATS:
        raise TypeError(f"student_input: expected a floating dtype (float16, bfloat16, float32, float64), got {dtype}")
    for name in ("student_weight", "teacher_input", "teacher_weight", "student_bias", "teacher_bias"):
        x = named[name]
        if x is not None and x.dtype != dtype:
            raise TypeError(f"{name}: expected dtype {dtype} (the dtype of student_input), got {x.dtype}")
    for name, x in named.items():
        if x is not None and x.device != xs.device:
            raise ValueError(f"{name}: expected a tensor on {xs.device} (the device of student_input), got {x.device}")
    if y is not None and (y.dtype.is_floating_point or y.dtype.is_complex or y.dtype == torch.bool):
        raise TypeError(f"labels: expected an integer dtype (torch.int64), got {y.dtype}")
    for name in ("student_weight", "teacher_weight"):
        if named[name].dim() != 2:
            raise ValueError(f"{name}: expected a 2-D (vocab, hidden) tensor, got shape {tuple(named[name].shape)}")
    for name, x in (("student_input", xs), ("teacher_input", xt)):
        if x.dim() < 1:
            raise ValueError(f"{name}: expected a tensor of shape (..., hidden), got a 0-d tensor")
    v, hs = ws.shape
    vt, ht = wt.shape
    if xs.shape[-1] != hs:
        raise ValueError(
            f"student_input: expected hidden size {hs} (student_weight is {tuple(ws.shape)}), got {xs.shape[-1]}"
        )
    if xt.shape[-1] != ht:
        raise ValueError(
            f"teacher_input: expected hidden size {ht} (teacher_weight is {tuple(wt.shape)}), got {xt.shape[-1]}"
        )
    if xs.shape[:-1] != xt.shape[:-1]:
        raise ValueError(
            f"teacher_input: expected leading dims {tuple(xs.shape[:-1])} (those of student_input), "
            f"got {tuple(xt.shape[:-1])}"
        )
    if y is not None and y.shape != xs.shape[:-1]:
        raise ValueError(f"labels: expected shape {tuple(xs.shape[:-1])} (student_input's leading dims), got {tuple(y.shape)}")
    if vt < v:
        raise ValueError(
            f"teacher_weight: expected a vocab of at least {v} rows (the student's), got {vt}; a teacher vocab "
            "smaller than the student's is not a padded head of the same tokenizer"
        )
    for name, b, size in (("student_bias", bs, v), ("teacher_bias", bt, vt)):
        if b is not None and b.shape != (size,):
            raise ValueError(f"{name}: expected shape ({size},), got {tuple(b.shape)}")
    # A padded teacher head: its extra ids (>= V) are not tokens of the student's vocab; drop them.
    wt = wt[:v]
    bt = None if bt is None else bt[:v]
    xs = xs.reshape(-1, hs)
    xt = xt.reshape(-1, ht)
    y = None if y is None else y.reshape(-1)
    return xs, ws, bs, xt, wt, bt, y


def _check_label_range(y, v, ignore_index):
    bad = ((y < 0) | (y >= v)) & (y != ignore_index)
    if bad.any():
        first = y[bad][0].item()
        raise ValueError(f"labels: expected values in [0, {v}) or ignore_index={ignore_index}, got {first}")
