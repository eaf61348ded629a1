"""FSDP2 heads: a head weight that is a DTensor sharded on dim 0 (the vocab) over a 1-D mesh.

Outside its module's forward an FSDP2 parameter is a DTensor holding, on each rank, the rows
[v_r, v_r + V_r) of the head, while each rank has its own batch of rows (data parallel). Two routes
give each rank its own loss, its rows' dX, and the head's gradient averaged over the ranks (as
FSDP2 averages its gradients), as the DTensor parameter's gradient with its placement:

  "rows"   all-gather the rows (hidden states, labels, top-k targets) instead of the head, run the
           vocab-parallel call (`flashkd.distributed.parallel`) over the union of the rows with each
           rank's vocab slice, reduce-scatter the union's dX in backward. The head is never gathered.
  "heads"  all-gather the heads (`DTensor.full_tensor`), run the plain call on the local rows; the
           student head's gradient is reduce-scattered (averaged) back to the shards in backward.

Bytes each rank receives per call (w ranks, N = Σ_r N_r rows of the union, E bytes per element,
f = (w − 1) / w; a ring all-gather or reduce-scatter of S bytes in all moves f · S per rank, an
all-reduce 2 f · S):

  rows:   f · N · (Hs·E + T + 8)          gather: hidden states, teacher rows, labels (+ 4 with row_weight)
        + f · N · Hs · E                  reduce-scatter of dX (backward)
        + 2 f · N · 4 · c                 row statistics, c ≈ 13 fp32 per row for a dense divergence
                                          (forward and backward merges), K + 6 for a top-k teacher
          T = Ht·E (teacher heads) or K·(e_id + e_lp) (top-k targets)
  heads:  f · V · Hs · E                  gather of the student head
        + f · V · Hs · E                  reduce-scatter of its gradient (backward)
        + f · Vt · Ht · E                 gather of the teacher head, when it is a DTensor too
  Leaving out the small terms, rows are cheaper when N·(2 Hs + Ht) < V·(2 Hs + Ht), i.e. N < V, with a
  sharded teacher head, and when N·(2 Hs + Ht) < 2·V·Hs with a teacher head every rank holds whole.

fsdp_gather="auto" (the default) takes the route whose formula is smaller, "rows" or "heads" forces
one. The dense-logits form has only the "heads" route: the rows route would move each rank's
teacher logit columns of every row, N · V · E. teacher_topk: rows f · N · Ht · E + (w − 1) · N ·
(2k + 2) · 8 (its merged candidates), heads f · Vt · Ht · E.

Memory per rank (rows route): the union's rows N · (Hs + Ht) · E and its dX N · Hs · E (instead of
N_r), the vocab-parallel call's chunk memory with V_r for V, its dW V_r · Hs; no head is gathered.
(heads route: the full heads V · (Hs + Ht) · E and the plain call's memory with the full V.)

Semantics: every rank's grad_output (loss scaling) must be the same, as FSDP's averaging assumes;
the rows route exchanges the ranks' row counts once per call (a host sync on GPU), and with the
union of the rows its result is each rank's own loss: `reduction="mean"` over its own rows. A bias
must be sharded like its weight (a DTensor) or, for the teacher, be a plain tensor (sliced).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .. import core
from ..core import call as calls
from ..core.checks import any_dtensor
from .sharding import Sharding
from .agreement import all_gather, reduce_scatter

# A call's heads (`flashkd.core.call.HEAD`, `TEACHER_HEAD`: gathered on the heads route, sliced on the rows
# route) and its rows (`ROWS`: each rank's own, gathered on the rows route) are the fields its class
# marks so, by their public names.


def _heads(call) -> dict:
    return {**calls.tensors(call, calls.HEAD), **calls.tensors(call, calls.TEACHER_HEAD)}


def _dtensor_type():
    from torch.distributed.tensor import DTensor

    return DTensor


def has_dtensor_head(call) -> bool:
    return any_dtensor(*_heads(call).values())


def _check_placement(name, x):
    """The mesh, and the rows [start, start + V_r) this rank holds, of a DTensor sharded on dim 0."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = x.device_mesh
    if mesh.ndim != 1 or tuple(x.placements) != (Shard(0),):
        raise TypeError(
            f"{name}: expected a local torch.Tensor or a DTensor sharded on dim 0 over a 1-D mesh (an FSDP2 "
            f"parameter), got a DTensor ({x.placements} over {mesh}); call where FSDP has gathered it "
            f"(inside the module's forward), or pass {name}.full_tensor()"
        )
    shape, offset = compute_local_shape_and_global_offset(x.shape, mesh, x.placements)
    return mesh, offset[0], shape[0]


def run(call, sharding: Sharding):
    """A call (`flashkd.core.call.Call`, a loss's or teacher_topk's) with a DTensor head."""
    if sharding.process_group is not None:
        raise ValueError(
            "process_group: expected None with a DTensor head (its device mesh is the group), got a process group"
        )
    if sharding.vocab_start is not None:
        raise ValueError(f"vocab_start: expected None with a DTensor head (its placement says it), got "
                         f"{sharding.vocab_start!r}")
    gather = sharding.fsdp_gather  # one of "auto", "rows", "heads" (`flashkd.distill` checks it)
    DTensor = _dtensor_type()
    heads = {k: x for k, x in _heads(call).items() if isinstance(x, DTensor)}
    placed = {k: _check_placement(k, x) for k, x in heads.items()}
    mesh = next(iter(placed.values()))[0]
    for k, (m, _, _) in placed.items():
        if m != mesh:
            raise ValueError(f"{k}: expected a DTensor on the device mesh of the other heads ({mesh}), got one on {m}")
    group = mesh.get_group()
    world = dist.get_world_size(group)
    weight = call.sharded_by
    if weight not in heads:
        raise TypeError(
            f"{weight}: expected a DTensor sharded like {', '.join(heads)} (the rows route shards the vocab "
            f"by the weight), got a {type(_heads(call)[weight]).__name__}; pass {', '.join(heads)}.full_tensor()"
        )
    if _is_logits(call):
        if gather == "rows":
            raise ValueError(
                "fsdp_gather: 'rows' is not available for dense teacher logits (it would move each rank's "
                "teacher logit columns of every row, N · V); use 'heads' or 'auto'"
            )
        gather = "heads"  # the only route of dense teacher logits: no row counts needed
    counts = None
    if gather != "heads":
        first = next(iter(calls.tensors(call, calls.ROWS).values()))  # the hidden states
        n_local = first.reshape(-1, first.shape[-1]).shape[0] if first.dim() >= 1 else 0
        counts = _exchange_counts(group, n_local, first.device)
    if gather == "auto":
        gather = choose(call, heads, sum(counts), world)
    if gather == "heads":
        return _heads_route(call, heads)
    return _rows_route(call, sharding, heads, placed, group, counts)


def _is_logits(call) -> bool:
    return call.teacher.form == "logits"


def route_bytes(call, heads, n, world) -> dict:
    """The bytes each rank receives per call on each route (the module's formulas); heads: the call's
    heads that are DTensors, by name."""
    f = (world - 1) / world
    weight = _heads(call)[call.sharded_by]
    v, h = weight.shape
    e = weight.dtype.itemsize
    if call.teacher.form == "teacher_topk":
        k = call.teacher.k
        return {"rows": f * n * h * e + (world - 1) * n * (2 * k + 2) * 8, "heads": f * v * h * e}
    heads_bytes = 2 * f * v * h * e
    sharded_teacher = heads.get("teacher_weight")
    if sharded_teacher is not None:
        vt, ht = sharded_teacher.shape
        heads_bytes += f * vt * ht * sharded_teacher.dtype.itemsize
    if _is_logits(call):
        return {"rows": float("inf"), "heads": heads_bytes}
    if call.teacher.form == "heads":
        teacher_bytes, stats = call.teacher.teacher_input.shape[-1] * e, 13
    else:
        ids, lp = call.teacher.teacher_ids, call.teacher.teacher_logprobs
        teacher_bytes, stats = ids.shape[-1] * (ids.dtype.itemsize + lp.dtype.itemsize), ids.shape[-1] + 6
    rows_bytes = f * n * (h * e + teacher_bytes + 8) + f * n * h * e + 2 * f * n * 4 * stats
    return {"rows": rows_bytes, "heads": heads_bytes}


def choose(call, heads, n, world) -> str:
    cost = route_bytes(call, heads, n, world)
    return "rows" if cost["rows"] < cost["heads"] else "heads"


def _exchange_counts(group, n_local, device) -> list:
    world = dist.get_world_size(group)
    counts = torch.empty(world, dtype=torch.int64, device=device)
    all_gather(counts, torch.tensor([n_local], dtype=torch.int64, device=device), group)
    return counts.tolist()  # a host sync on GPU: the union's shape


def _heads_route(call, heads):
    from torch.distributed.tensor import Partial

    gathered = {}
    for k, x in heads.items():
        # the student's gradient: a sum over the ranks' batches, averaged into each shard (FSDP's mean)
        gathered[k] = x.full_tensor(grad_placements=[Partial("avg")]) if x.requires_grad else x.full_tensor()
    return core.run(calls.with_tensors(call, gathered))


class _GatherRows(torch.autograd.Function):
    """The union of every rank's rows (rank order); backward: each rank's rows of the union's
    gradient summed over the ranks (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group, counts):
        ctx.group, ctx.counts = group, counts
        return _gather(x, group, counts)

    @staticmethod
    def backward(ctx, grad):
        counts, world, rank = ctx.counts, len(ctx.counts), dist.get_rank(ctx.group)
        most = max(counts)
        padded = grad.new_zeros((world * most, *grad.shape[1:]))
        at = 0
        for r, c in enumerate(counts):
            padded[r * most : r * most + c] = grad[at : at + c]
            at += c
        out = grad.new_empty((most, *grad.shape[1:]))
        reduce_scatter(out, padded.contiguous(), ctx.group)
        return out[: counts[rank]], None, None


def _gather(x, group, counts):
    """(Σ counts, ...) rows: every rank's x in rank order (padded to the largest count on the wire)."""
    world, most = len(counts), max(counts)
    if x.shape[0] != most:
        x = torch.cat([x, x.new_zeros((most - x.shape[0], *x.shape[1:]))])
    out = x.new_empty((world * most, *x.shape[1:]))
    all_gather(out, x.contiguous(), group)
    if all(c == most for c in counts):
        return out
    return torch.cat([out[r * most : r * most + c] for r, c in enumerate(counts)])


def _rows_route(call, sharding, heads, placed, group, counts):
    from . import parallel

    world, rank = len(counts), dist.get_rank(group)
    weight = call.sharded_by
    _, start, size = placed[weight]
    full_v = _heads(call)[weight].shape[0]
    local = {}
    for k, x in _heads(call).items():
        if x is None:
            continue
        if k in heads:
            if heads[k].shape[0] != full_v:
                raise ValueError(
                    f"{k}: expected {full_v} rows (a DTensor sharded like {weight}), got {heads[k].shape[0]}"
                )
            local[k] = heads[k].to_local()  # its gradient comes back as a DTensor with the same placement
        elif k in calls.tensors(call, calls.HEAD):  # the student's bias: it gets a gradient of the slice
            raise TypeError(f"{k}: expected a DTensor sharded like {weight}, got a {type(x).__name__}")
        else:
            local[k] = x[start : start + size]  # a plain teacher head: this rank's rows of it
    if call.options.return_stats:
        raise ValueError("return_stats: not available on the FSDP rows route yet; pass fsdp_gather='heads'")
    own_rows = calls.tensors(call, calls.ROWS)
    lead = next(iter(own_rows.values())).shape[:-1]  # this rank's rows, as it passed them
    for k, x in own_rows.items():
        if x is None:
            continue
        # (N_r, ...) rows: the trailing dim stays for the hidden states and top-k targets
        flat = x.reshape(counts[rank], *(x.shape[-1:] if calls.trailing(call, k) else ()))
        local[k] = _GatherRows.apply(flat, group, counts) if flat.requires_grad else _gather(flat, group, counts)
    offset = sum(counts[:rank])
    own = slice(offset, offset + counts[rank])
    call = calls.with_tensors(call, local)
    sharding = dataclasses.replace(sharding, process_group=group, vocab_start=start, fsdp_gather="auto")
    if call.teacher.form == "teacher_topk":
        ids, logprobs = parallel.run(call, sharding)
        return ids[own].reshape(*lead, -1), logprobs[own].reshape(*lead, -1)
    return _rows_loss(call, sharding, own, counts)


def _rows_loss(call, sharding, own, counts):
    """The vocab-parallel call over the union of the rows, each row weighted so that the union's loss
    J is the sum over the ranks of their own losses: dX of a rank's rows is then its own loss's, and
    dW / world the average of theirs. The rank's own loss is J's graph with its own value."""
    from . import parallel

    world = len(counts)
    spec = call.spec
    student = call.student
    y, device = student.labels, student.student_input.device
    work = torch.promote_types(student.student_input.dtype, torch.float32)
    n = student.student_input.shape[0]
    rank_of = torch.repeat_interleave(torch.arange(world, device=device), torch.tensor(counts, device=device))
    if spec.reduction == "mean":
        valid = torch.ones(n, dtype=work, device=device) if y is None else (y != spec.ignore_index).to(work)
        per_rank = torch.zeros(world, dtype=work, device=device).index_add_(0, rank_of, valid)
        row_scale = 1.0 / per_rank.clamp_min(1.0)[rank_of]
    else:
        row_scale = torch.ones(n, dtype=work, device=device)
    if student.row_weight is not None:
        row_scale = row_scale * student.row_weight.to(work)
    recorded = []
    call = dataclasses.replace(call, student=dataclasses.replace(student, row_weight=row_scale),
                               spec=dataclasses.replace(spec, reduction="sum"))
    out = parallel.run(call, sharding, reduce_dx=False, dw_scale=1.0 / world, record=recorded)
    union = out[0] if isinstance(out, tuple) else out
    soft = torch.cat([r[0] for r in recorded])[own] * row_scale[own]
    hard = torch.cat([r[1] for r in recorded])[own] * row_scale[own]
    tau2 = spec.temperature ** 2 if spec.temperature_squared else 1.0
    soft_sum, hard_sum = soft.sum() * tau2, hard.sum()
    mine = spec.weight_hard * hard_sum + spec.weight_soft * soft_sum
    loss = union + (mine - union).detach() if union.requires_grad else mine.to(union.dtype)
    if call.options.return_soft_hard_loss:
        return loss, soft_sum.to(union.dtype), hard_sum.to(union.dtype)
    return loss
