"""A rank's slice of the vocab: the reductions of `flashkd.losses` merged over a process group.

`ShardedVocab` is the `flashkd.losses.Vocab` of a block of logits that holds the global ids
[start, start + V_r) of the vocab. The row definitions (`row_losses`, `topk_row_losses`) call its
`merge` once or twice per block; each merge is one all-reduce MAX (of the logsumexps' row maxima,
not differentiated) and one differentiable all-reduce SUM of everything summed over the vocab,
stacked into one (R, n) fp32 tensor. The SUM's backward is again an all-reduce SUM (autograd seeds
each rank's copy of the replicated loss with 1/world, so that the sum over the ranks of their
copies' gradients is the gradient of the loss). Between the Triton rows' phases the core's row
function calls `exchange` instead (`gather_rows`, `sum_rows`): the kernels run no collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..losses import Vocab, logit_transform
from . import agreement
from .agreement import all_gather, reduce_scatter  # noqa: F401 (the FSDP route's, with this module's)
from .sharding import Sharding


class _AllReduceSum(torch.autograd.Function):
    """y = Σ_ranks x on every rank; the gradient of x is Σ_ranks of the gradients of y."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ShardedVocab(Vocab):
    """The vocab slice [start, start + V_r) of one rank of `group`: the `flashkd.losses.VocabSlice` that
    the chunk loop, the row backends and teacher_topk's loop are written against.

    total:   the vocab's size V (an int, or a 0-d device tensor when it was not read on the host), once agreed
    reduce_dx: all-reduce each chunk's dX over the group (vocab-parallel); False leaves dX partial,
             for the FSDP route, where the gather of the rows reduce-scatters it in backward
    dw_scale: factor on dW and db at the end (1, or 1/world on the FSDP route, which averages them
             over the data-parallel ranks as FSDP does)
    """

    def __init__(self, group, sharding: Sharding, *, reduce_dx=True, dw_scale=1.0, record=None):
        self.group = group
        self.sharding = sharding
        # the layout, once the ranks agree (`agree`): this slice's first id and size, the vocab's, the largest slice's
        self.start, self.local_size, self.total, self.plan_size = sharding.vocab_start, 0, 0, 0
        self.copies = dist.get_world_size(group)
        self.reduce_dx = reduce_dx
        self.dw_scale = dw_scale
        self.recorded = record  # a list: gets (soft, hard) of each block, in row order (FSDP route)
        self._pending = []

    def agree(self, call, rows, backend, ranged, failed) -> bool:
        """`flashkd.losses.VocabSlice.agree`: the group's one exchange before the loop (`agreement.agree`),
        which raises on every rank where any rank's call fails; then this slice knows its layout."""
        self.start, self.local_size, self.total, self.plan_size, checked = agreement.agree(
            self.group, self.sharding, call, rows, backend, ranged, failed)
        return checked

    # --- flashkd.losses.Vocab ---
    def size(self, x):
        return self.total

    def local(self, ids, x):
        here = (ids >= self.start) & (ids < self.start + x.shape[-1])
        return torch.where(here, ids - self.start, 0).long(), here

    def amax(self, x):
        """`Vocab.amax` over the group: one all-reduce MAX of (R,)."""
        m = x.detach().amax(-1) if x.shape[-1] else x.new_full(x.shape[:1], -torch.inf)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=self.group)
        return m

    def before(self, count):
        """`Vocab.before` over the group: each rank's (start, count) in one all-gather of (2, R) int64
        (16·R bytes a rank), the counts of the slices that start before this one summed."""
        mine = torch.stack([torch.full_like(count, self.start), count]).contiguous()
        every = torch.empty(self.copies * mine.numel(), dtype=mine.dtype, device=mine.device)
        all_gather(every, mine.view(-1), self.group)
        every = every.view(self.copies, 2, -1)
        return torch.where(every[:, 0] < self.start, every[:, 1], 0).sum(0)

    def merge(self, log_softmax=(), lse=(), sums=()):
        """`Vocab.merge` over the group: one all-reduce MAX of every logsumexp's row maxima (not
        differentiated: the logsumexp's gradient does not depend on its shift), then one
        differentiable all-reduce SUM of their exp-sums and of `sums`, stacked into one (R, n) tensor."""
        blocks = list(log_softmax) + list(lse)
        m = None
        if blocks:
            m = torch.stack([x.detach().amax(-1) for x in blocks], -1)
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=self.group)
            m = torch.where(torch.isfinite(m), m, 0.0)  # a row −inf throughout: exp(−inf − 0) = 0
        parts = [torch.exp(x - m[:, i, None]).sum(-1) for i, x in enumerate(blocks)] + list(sums)
        parts = self._sum(parts)
        out = []
        for i, l in enumerate(parts[: len(blocks)]):
            log_l = torch.log(l.clamp_min(torch.finfo(l.dtype).tiny))
            out.append(torch.where(l > 0, m[:, i] + log_l, -torch.inf))  # −inf, gradient 0, on an empty row
        n = len(log_softmax)
        return [x - out[i][:, None] for i, x in enumerate(log_softmax)], out[n:], parts[len(blocks) :]

    def _sum(self, parts):
        """Each of parts summed over the group, in one differentiable all-reduce."""
        if not parts:
            return []
        flat = [p.reshape(p.shape[0], -1) for p in parts]
        merged = _AllReduceSum.apply(torch.cat(flat, -1), self.group)
        out, at = [], 0
        for p, f in zip(parts, flat):
            out.append(merged[:, at : at + f.shape[1]].reshape(p.shape))
            at += f.shape[1]
        return out

    # --- the chunk loop's one hook between its steps (flashkd.core.loop, flashkd.core.backend.row_function;
    # the Triton rows' statistics between their phases: flashkd.backends.triton_rows.sliced_rows) ---
    def exchange(self, kind, x):
        """`flashkd.losses.VocabSlice.exchange`: "gather", every rank's (R, n) x as (world, R, n), in rank
        order (`gather_rows`); "sum", x summed over the group (`sum_rows`); "rows", a block's row function's
        result, as it came, its (soft, hard) kept where asked (the FSDP route); "dx", a chunk's dX summed
        over the group, asynchronously (`finish` waits)."""
        if kind == "gather":
            return self.gather_rows(x)
        if kind == "sum":
            self.sum_rows(x)
        elif kind == "rows":
            if self.recorded is not None:
                self.recorded.append(x[:2])
        elif kind == "dx":
            if self.reduce_dx:
                self._pending.append(dist.all_reduce(x, group=self.group, async_op=True))
        else:
            raise ValueError(f"kind: expected 'gather', 'sum', 'rows' or 'dx', got {kind!r}")
        return x

    def gather_rows(self, part):
        """(world, R, n): every rank's (R, n) part, in rank order (one all-gather)."""
        every = torch.empty(self.copies * part.numel(), dtype=part.dtype, device=part.device)
        all_gather(every, part.contiguous().view(-1), self.group)
        return every.view(self.copies, *part.shape)

    def sum_rows(self, x):
        """x summed over the group, in place (one all-reduce)."""
        dist.all_reduce(x, group=self.group)

    def finish(self, dxs, dws, dbs):
        for work in self._pending:
            work.wait()
        self._pending.clear()
        if self.dw_scale != 1.0:
            dws = None if dws is None else dws.mul_(self.dw_scale)
            dbs = None if dbs is None else dbs.mul_(self.dw_scale)
        return dxs, dws, dbs

    # --- teacher_topk's per-chunk top-k (flashkd.core.topk) ---
    def topk(self, logits, k, temperature, scale=1.0, softcap=None, backend="torch"):
        """(ids, log-probs) of the global top-k of rows whose slice here is `logits` (R, V_r'): each rank's
        local top-k candidates (global ids, their z/τ) and its (max, sum-exp) of z/τ, in one all-gather
        of (R, 2k + 2) fp64 (fp64 holds the ids and fp32 values exactly), merged on every rank. On
        backend "triton" the local candidates and logsumexp come from the top-k kernel
        (`flashkd.backends.triton_topk.row_topk`: two reads of the slice), passed as (lse, 1)."""
        work = torch.promote_types(logits.dtype, torch.float32)
        r, width = logits.shape
        kk = min(k, width)
        pack = torch.full((r, 2 * k + 2), -torch.inf, dtype=torch.float64, device=logits.device)
        pack[:, k + kk : 2 * k] = -1.0  # no candidate (a slice narrower than k): never picked
        kernel = False
        if backend == "triton" and width:
            from ..backends import triton_topk

            kernel = kk <= triton_topk.TOPK_MAX_K
        if kernel:
            idx, logprobs, _, lse = triton_topk.row_topk(logits, kk, temperature, scale, softcap, with_lse=True)
            empty = lse == -torch.inf  # a row −inf throughout this slice (masked ids): no mass here
            pack[:, :kk] = torch.where(empty[:, None], -torch.inf, logprobs.double() + lse.double()[:, None])
            pack[:, k : k + kk] = (idx + self.start).double()
            pack[:, 2 * k] = lse.double()
            pack[:, 2 * k + 1] = torch.where(empty, 0.0, 1.0).double()
        else:
            if scale != 1.0 or softcap is not None:  # the head's transform in fp32, as the loss math reads it
                logits = logit_transform(logits.to(work), scale, softcap)
            z = logits.to(work) / temperature
            top, idx = torch.topk(logits, kk, dim=-1)
            pack[:, :kk] = top.to(work).double() / temperature
            pack[:, k : k + kk] = (idx + self.start).double()
            if width:
                m = z.amax(-1)
                pack[:, 2 * k] = m.double()
                # a row −inf throughout this slice (masked ids): no mass here, where exp(−inf − (−inf)) was NaN
                pack[:, 2 * k + 1] = torch.exp(z - torch.where(m == -torch.inf, 0.0, m)[:, None]).sum(-1).double()
            else:
                pack[:, 2 * k + 1] = 0.0  # an empty slice: no mass
        world = self.copies
        every = torch.empty(world * pack.numel(), dtype=pack.dtype, device=pack.device)
        all_gather(every, pack.reshape(-1), self.group)
        every = every.view(world, r, 2 * k + 2)
        values = every[:, :, :k].permute(1, 0, 2).reshape(r, world * k)
        ids = every[:, :, k : 2 * k].permute(1, 0, 2).reshape(r, world * k)
        m, l = every[:, :, 2 * k], every[:, :, 2 * k + 1]  # (world, R)
        m_all = m.amax(0)
        lse = m_all + torch.log((l * torch.exp(torch.where(l > 0, m - m_all, 0.0))).sum(0))
        # the k best candidates, those of a slice before its padding: a stable sort with every slot that
        # holds no candidate moved last, so that ties at −inf (masked ids) pick real ids
        last = torch.sort((ids < 0).to(torch.int8), dim=-1, stable=True).indices
        values, ids = values.gather(-1, last), ids.gather(-1, last)
        best, at = torch.sort(values, dim=-1, descending=True, stable=True)
        best, at = best[:, :k], at[:, :k]
        return ids.gather(-1, at).long(), (best - lse[:, None]).to(work)
