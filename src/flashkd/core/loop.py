"""The chunk loop and its autograd Function: the student's LM head + a distillation loss, chunked over rows,
grads computed in forward.

Why a module of its own: this is the part that runs (GEMMs, the row function, the gradient GEMMs,
the slice's hooks); what comes before it (`call`, `checks`, `plan`, `backend`) only decides. The
memory it takes is `flashkd.core.plan`'s docstring.

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
            soft, hard = backend.rows(S[b], T, ...) dL/dS[b] written (rounded to the inputs' dtype)
            a learning teacher (`learns`): dL/dT written over T too, then dXt[b] = dT @ Wt;  dWt += dT^T @ Xt[b];
                                              dbt += Σ_rows dT   (two more GEMMs; losses.LEARNING_LOSSES)
        dXs[c] = dS @ Ws;  dWs += dS^T @ Xs[c] (fp32);  dbs += Σ_rows dS (fp32)
    loss = scale · (w_hard Σ hard + w_soft Σ soft);   backward multiplies the saved grads by grad_output

Logits at fp32 accuracy: S and T of bf16 / fp16 inputs are the GEMMs' fp32 accumulators (`linear`),
never rounded to the inputs' dtype; the loss math reads them in fp32, and dL/dS is rounded once, to
the inputs' dtype, for the dX and dW GEMMs (bf16: 2^-9 relative, as any bf16 gradient GEMM's input).
Dense teacher logits are read as the caller passes them (bf16 ones carry their own rounding).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from .. import fp8
from . import backend as backends, learning, mixture
from ..losses import DistillStats
from .checks import NARROW
from .gemms import accumulate_mm, gemm_rows, linear  # noqa: F401 (linear, accumulate_mm: the loop's, for its users)
from .plan import Plan

def run(call, rows, plan: Plan):
    """A checked and planned call run: the teacher's head made (FP8 where asked), the chunk loop (under its
    autograd Function where a gradient is wanted), and what the call returns."""
    options, form, teacher = call.options, plan.form, rows.teacher
    if form == "heads" and not plan.learns:  # (a learning teacher with teacher_precision is refused by `learns`)
        teacher = _teacher_head(teacher, options.teacher_precision)
    loss_, soft, hard, *sums = apply(rows.xs, rows.ws, rows.bs, rows.y, rows.rw, plan, *teacher)
    out = (loss_, soft, hard) if options.return_soft_hard_loss else (loss_,)
    if plan.stats:
        topk = (sums[4], sums[5]) if form == "topk" else (None, None)
        per_teacher = sums[6] if plan.teacher_index is not None else None  # top-k's teacher_index, or routed
        out += (DistillStats(*sums[:4], *topk, per_teacher),)
    return out if len(out) > 1 else loss_


def apply(xs, ws, bs, y, rw, plan, *teacher):
    # One graph break: the chunk loop runs eagerly inside compiled code. Disabled here, while tracing, not by
    # a decorator: torch.compiler.disable imports torch._dynamo (~0.9 s), which `import flashkd` need not pay.
    if torch.compiler.is_compiling():
        return torch.compiler.disable(_apply)(xs, ws, bs, y, rw, plan, *teacher)
    return _apply(xs, ws, bs, y, rw, plan, *teacher)


def _apply(xs, ws, bs, y, rw, plan, *teacher):
    with autocast_off(xs.device):
        if plan.learns or (torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (xs, ws, bs))):
            return _FusedDistill.apply(xs, ws, bs, y, rw, plan, *teacher)
        # Evaluation: no autograd node, and no gradient work at all. The teacher is a constant: without
        # no_grad a teacher that requires grad would get a graph through every chunk's logits (and a grad).
        with torch.no_grad():
            return _chunk_loop(xs, ws, bs, y, rw, teacher, plan, False, False, False)[0]


def autocast_off(device: torch.device):
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
    def forward(ctx, xs, ws, bs, y, rw, plan: Plan, *teacher):
        want_dx, want_dw, want_db = ctx.needs_input_grad[:3]
        # A learning teacher's (xt, wt, bt) get gradients as the student's do; any other teacher is a constant
        # (None below, whatever it requires). A head passed as both (self-distillation) is two inputs here:
        # autograd sums their gradients, the teacher's None adding nothing.
        want_teacher = ctx.needs_input_grad[6:] if plan.learns else ()
        (loss, *logged), *grads = _chunk_loop(xs, ws, bs, y, rw, teacher, plan, want_dx, want_dw, want_db,
                                              want_teacher)
        ctx.save_for_backward(*grads)
        ctx.num_teacher = len(teacher)
        ctx.backend = plan.backend
        ctx.mark_non_differentiable(*logged)
        return loss, *logged

    @staticmethod
    @_first_order_only
    def backward(ctx, grad_loss, *_grad_logged):
        # grad_loss is a 0-d device tensor: scaling by it needs no host sync, whatever its value. The
        # saved grads are ours alone and freed after this call unless the graph is kept for another
        # backward: only then must they stay unscaled, and the scaled grads be new tensors. grad_loss
        # (fp32) enters the product as it is, multiplied in fp32 and rounded once: cast to bf16 first, a
        # loss divided by a token count (1/3 → 0.333984) would scale every bf16 gradient up to 0.4 % off.
        keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", lambda: True)()
        # (torch's `g * t` of a bf16 g and a 0-d fp32 CUDA tensor t rounds t to bf16 first: narrow grads go
        # through fp32 here, explicitly.)
        if keep:
            grads = tuple(None if g is None else g * grad_loss if g.dtype not in NARROW else
                          (g.float() * grad_loss).to(g.dtype) for g in ctx.saved_tensors)
        elif ctx.backend == "triton":
            from ..backends import triton_rows

            grads = tuple(None if g is None else triton_rows.scale_(g, grad_loss) for g in ctx.saved_tensors)
        else:
            grads = tuple(None if g is None else g.mul_(grad_loss) if g.dtype not in NARROW else
                          g.copy_(g.float() * grad_loss) for g in ctx.saved_tensors)
        return (*grads[:3], None, None, None, *grads[3:], *(None,) * (ctx.num_teacher - len(grads[3:])))


def _chunk_loop(xs, ws, bs, y, rw, teacher, plan: Plan, want_dx, want_dw, want_db, want_teacher=()):
    """((loss, soft, hard, *sums of DistillStats when plan.stats), dxs, dws, dbs), and dxt, dwt, dbt after
    them where want_teacher (a learning teacher's three) asks for any."""
    spec = plan.spec
    n, v = xs.shape[0], ws.shape[0]
    rows = backends.row_function(plan)
    want_dxt, want_dwt, want_dbt = tuple(want_teacher) + (False,) * (3 - len(want_teacher))
    teacher_grad = any(want_teacher)
    # dL/dt from the rows, where there is a soft term (else the teacher's gradient is 0)
    learn = teacher_grad and spec.want_soft
    grad = want_dx or want_dw or want_db or learn
    device = xs.device
    # Loss math and accumulators in fp32, or fp64 for fp64 inputs (which float64 gradcheck relies on).
    f32 = dict(device=device, dtype=torch.promote_types(xs.dtype, torch.float32))
    if y is None or spec.reduction == "sum":
        scale = torch.full((), 1.0 if spec.reduction == "sum" else 1.0 / max(n, 1), **f32)
    else:
        scale = 1.0 / (y != spec.ignore_index).sum().clamp_min(1).to(f32["dtype"])
    if rw is not None:
        rw = rw.to(f32["dtype"])  # N numbers, read in the loss math's precision
    # soft, hard, entropy, mass, teacher entropy (0-d) and per teacher (T, 3) sums, added to in place (`_add_sums`)
    sums = tuple(torch.zeros(shape, **f32) for shape in ((),) * 5 + ((plan.num_teachers, 3),))
    teacher_ids = None if plan.teacher_index is None else torch.arange(plan.num_teachers, device=device)
    dxs = torch.empty_like(xs, memory_format=torch.contiguous_format) if want_dx else None
    # With one chunk there is nothing to accumulate: the GEMM accumulates in fp32 and rounds once either
    # way. dWs is made for the first chunk's GEMM (beta = 0 fills it), after that chunk's teacher logits
    # are freed: one chunk then peaks at max(S + T, S + dWs), not S + T + dWs.
    accum = plan.grad_accum_dtype if n > plan.chunk else ws.dtype
    dws = torch.zeros(ws.shape, device=device, dtype=ws.dtype) if want_dw and n == 0 else None
    dbs = torch.zeros(v, **f32) if want_db else None
    if teacher_grad:  # the learning teacher's [dxt, dwt, dbt], as the student's (`learns`); 0 without dL/dt
        xt, wt, bt = teacher
        learner = learning.buffers(plan, teacher, v, learn, want_dxt, want_dwt, want_dbt, f32)
    cute = backends.cute_fits(plan, xs, ws, bs, teacher, y is not None, grad)
    t_bias = None if cute else _kernel_bias(plan, teacher)
    block_teacher = teacher if t_bias is None else (teacher[0], teacher[1], None)  # the bias added at the kernel's loads
    if cute:
        from ..backends import cute_gemm, triton_rows

        k_s, k_ce, k_t = triton_rows.tile_constants(spec, y is not None)
        s_planes = 2 if k_ce is None else 3
    for start in range(0, n, plan.chunk):
        c = slice(start, min(start + plan.chunk, n))
        # Ignored rows (padding) may hold NaN or inf: zeroed, they cannot reach dW = dSᵀX as 0 · NaN, nor
        # dS through a NaN logit. One select over R·Hs elements and R·Hs·E bytes a chunk (1/V of its
        # GEMM), on the device: no host sync.
        x = xs[c] if y is None else torch.where((y[c] != spec.ignore_index)[:, None], xs[c], 0.0)
        if cute:  # (5, R, vocab tiles): each tile's m_s, l_s, l_c, m_t, l_t (`triton_rows.rows(..., tiles=)`)
            tiles = torch.empty(5, c.stop - c.start, cute_gemm.n_tiles(v), device=device)
            s = cute_gemm.logits(x, ws, tiles[:s_planes], k_s, k_ce)
        else:
            tiles = None
            s = linear(x, ws, bs)
        # fp32 logits of narrow inputs: the Triton rows write dL/ds once, rounded for the gradient GEMMs,
        # into half of s's own bytes (`triton_rows.grad_view`; a top-k teacher's kernel into a buffer of the
        # inputs' dtype); the torch rows write it over s, rounded below
        narrow = grad and s.dtype != ws.dtype
        ds, in_s = None, narrow and plan.backend == "triton" and plan.form != "topk"
        if in_s:
            from ..backends import triton_rows

            ds = triton_rows.grad_view(s, ws.dtype, spec, grad)
        elif narrow and plan.backend == "triton":
            ds = torch.empty(s.shape, device=device, dtype=ws.dtype)
        for b in _teacher_blocks(plan, teacher, c):
            in_c = slice(b.start - c.start, b.stop - c.start)
            if tiles is None:
                t = _teacher_block(plan, block_teacher, b, spec.temperature) if spec.want_soft else None
            else:
                t = cute_gemm.logits(teacher[0][b], teacher[1], tiles[3:, in_c], k_t)
            row_scale = scale if rw is None else scale * rw[b]
            out = {} if ds is None else {"ds": ds[in_c]}
            if tiles is not None:
                out["tiles"] = tiles[:, in_c]
            dt = learning.grad_out(plan, t, xt.dtype, grad, want_dbt, learner, b) if learn else t  # dL/dt's place
            if learn:
                out["teacher_grad"] = True if dt is t else dt
            if t_bias is not None:
                out["t_bias"] = t_bias
            soft, hard, *extra = rows(s[in_c], t, None if y is None else y[b], spec, row_scale, grad, plan.stats, **out)
            if learn:
                learning.gemms(learner, dt, xt, wt, b, None if y is None else y[b] != spec.ignore_index)
            _add_sums(sums, plan, spec, y, rw, b, soft, hard, extra, teacher_ids)
            del t, dt, out  # a view left alive would keep this chunk's logits (or dL/ds) past `del s`
        if narrow:
            if ds is None:
                s = s.to(ws.dtype)
            elif in_s and want_dw and n <= plan.chunk and ws.shape[1] > c.stop - c.start:
                # one chunk whose dW (V·Hs) outweighs its dL/ds (R·V): dL/ds moved out of s's bytes, so that
                # s is freed before dWs is made (`peak_bytes`)
                s = ds.contiguous()
            else:
                s = ds
        del ds, tiles
        if want_dx:
            torch.mm(gemm_rows(s), ws, out=dxs[c])
            if plan.vocab is not None:
                plan.vocab.exchange("dx", dxs[c])
        if want_dw:
            if start == 0:
                dws = torch.empty(ws.shape, device=device, dtype=accum)
            if cute and cute_gemm.accumulate_eligible(dws, s.t(), x.t()):
                # added by the TMA unit's reduce-add stores: no warpgroup waits on a read of the fp32 dWs
                cute_gemm.accumulate(dws, s.t(), x.t(), add=start != 0)
            else:
                accumulate_mm(dws, s.t(), x, beta=0.0 if start == 0 else 1.0)
        if want_db:
            dbs += s.sum(0, dtype=dbs.dtype)
        del s, x  # before the next chunk's GEMM allocates, and before dWs is cast below
    soft_sum, hard_sum, entropy_sum, mass_sum, teacher_entropy_sum, per_teacher = sums
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
        logged += (soft_sum, hard_sum, count, entropy_sum, mass_sum, teacher_entropy_sum, per_teacher)
    if not teacher_grad:
        return logged, dxs, dws, dbs
    dxt, dwt, dbt = learning.finish(learner, xt, None if y is None else y != spec.ignore_index)
    return logged, dxs, dws, dbs, dxt, None if dwt is None else dwt.to(wt.dtype), None if dbt is None else dbt.to(bt.dtype)


def _add_sums(sums, plan, spec, y, rw, b: slice, soft, hard, extra, teacher_ids) -> None:
    """Rows b's (soft, hard, *extra) of the row function added to the call's sums (`_chunk_loop`), in place."""
    soft_sum, hard_sum, entropy_sum, mass_sum, teacher_entropy_sum, per_teacher = sums
    if rw is not None:
        soft, hard = soft * rw[b], hard * rw[b]
    soft_sum += soft.sum()
    hard_sum += hard.sum()
    if plan.stats:
        entropy_sum += extra[0].sum()
        if len(extra) > 1:
            mass_sum += extra[1].sum()
            teacher_entropy_sum += extra[2].sum()
        if teacher_ids is not None:
            counted = torch.ones_like(soft) if y is None else (y[b] != spec.ignore_index).to(soft.dtype)
            # (R, T) one-hot: an index outside [0, T) is in no teacher's sums (and no device assert);
            # a select, not a product, so that one row's NaN stays in its own teacher's sums
            of = plan.teacher_index[b, None] == teacher_ids
            entropy_t = extra[2] if len(extra) > 2 else torch.zeros_like(soft)  # dense rows: none
            per_teacher += torch.where(of[:, :, None], torch.stack([counted, soft, entropy_t], 1)[:, None], 0.0).sum(0)


def _teacher_head(teacher, precision):
    """(xt, wt, bt) with wt the FP8 head (quantised now) of teacher_precision "fp8...", else as it came."""
    xt, wt, bt = teacher
    scaling = fp8.scaling_of(precision, xt.device)
    if scaling is None:
        return teacher
    fp8.check_dtype(xt.dtype)
    return xt, fp8.head(wt, scaling), bt


def _teacher_blocks(plan, teacher, c):
    """The teacher blocks of chunk c: plan.teacher_chunk rows each, cut at the groups' starts too where rows are
    routed (`mixture.routed_blocks`: each block one teacher's)."""
    if plan.form == "routed":
        return mixture.routed_blocks(teacher, c, plan.teacher_chunk)
    return [slice(sub, min(sub + plan.teacher_chunk, c.stop)) for sub in range(c.start, c.stop, plan.teacher_chunk)]


def _kernel_bias(plan, teacher):
    """The teacher head's bias where the Triton rows add it to its logits at load (`triton_rows.rows(...,
    t_bias=)`): one read of V numbers from L2 a tile instead of a pass of R·V·4 bytes read and written over the
    block's fp32 logits. A heads-form teacher with a bias and a bf16 / fp16 / fp32 head, whole rows, a loss that
    reads t only in the three passes; else None (the GEMM adds it, `linear`)."""
    if plan.backend != "triton" or plan.form != "heads" or plan.vocab is not None or not plan.spec.want_soft:
        return None
    from ..backends import triton_rows

    _, wt, bt = teacher
    if bt is None or isinstance(wt, fp8.Head) or triton_rows.kernel_kind(plan.spec) in triton_rows.BIAS_LOSSES_APART:
        return None
    return bt


def _teacher_block(plan, teacher, c, tau):
    form = plan.form
    if form == "mixture":
        mix = None
        if plan.backend != "torch":  # "triton" (and "cute", whose rows are Triton's): the mixing kernel
            from ..backends import triton_mixture

            mix = triton_mixture.mix_
        return mixture.block(teacher, c, tau, linear, mix)
    if form == "routed":
        return mixture.routed_block(teacher, c, linear)
    if form == "heads":
        xt, wt, bt = teacher
        if isinstance(wt, fp8.Head):
            return fp8.linear(xt[c], wt, bt)
        return linear(xt[c], wt, bt)
    if form == "logits":
        return teacher[0][c]
    ids, lp = teacher
    return ids[c], lp[c]
