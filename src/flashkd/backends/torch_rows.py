"""The torch row backend: differentiates the torch definitions in `flashkd.losses` with autograd.

Runs on any device; its temporaries are a few fp32 copies of the block, O(R × V).
"""

from __future__ import annotations

import torch

from ..losses import LossSpec, row_losses, topk_row_losses


def rows(s, t, labels, spec: LossSpec, scale: torch.Tensor, grad: bool, stats: bool = False, *, vocab=None):
    """Dense teacher logits t (R, V). vocab: the block's `flashkd.losses.Vocab` (None: the whole vocab)."""
    return _differentiate(row_losses, s, t, labels, spec, scale, grad, stats, vocab)


def topk_rows(s, t, labels, spec: LossSpec, scale: torch.Tensor, grad: bool, stats: bool = False, *, vocab=None):
    """Sparse teacher t = (ids, logprobs), (R, K) each."""
    return _differentiate(topk_row_losses, s, t, labels, spec, scale, grad, stats, vocab)


def _differentiate(row_fn, s, t, labels, spec, scale, grad, stats, vocab):
    if not grad:
        return row_fn(s, t, labels, spec, vocab, stats=stats)
    with torch.enable_grad():
        a = s.detach().to(torch.promote_types(s.dtype, torch.float32)).requires_grad_()
        out = row_fn(a, t, labels, spec, vocab, stats=stats)
        total = spec.total(out[0].sum(), out[1].sum())
        if vocab is not None and vocab.copies != 1:
            total = total / vocab.copies  # each rank's copy of a replicated loss (`losses.Vocab.copies`)
        (ds,) = torch.autograd.grad(total, a)
    s.copy_(ds.mul_(scale[:, None] if scale.dim() else scale))  # per-row factors: (R,) scale
    return tuple(x.detach() for x in out)
