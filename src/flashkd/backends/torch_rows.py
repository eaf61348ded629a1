"""The torch row backend: differentiates the torch definitions in `flashkd.losses` with autograd.

Runs on any device; its temporaries are a few fp32 copies of the block, O(R × V).
"""

from __future__ import annotations

import torch

from ..losses import LossSpec, row_losses, topk_row_losses


def rows(s, t, labels, spec: LossSpec, scale: torch.Tensor, grad: bool, stats: bool = False):
    """Dense teacher logits t (R, V)."""
    return _differentiate(row_losses, s, t, labels, spec, scale, grad, stats)


def topk_rows(s, t, labels, spec: LossSpec, scale: torch.Tensor, grad: bool, stats: bool = False):
    """Sparse teacher t = (ids, logprobs), (R, K) each."""
    return _differentiate(topk_row_losses, s, t, labels, spec, scale, grad, stats)


def _differentiate(row_fn, s, t, labels, spec, scale, grad, stats):
    if not grad:
        return row_fn(s, t, labels, spec, stats=stats)
    with torch.enable_grad():
        a = s.detach().to(torch.promote_types(s.dtype, torch.float32)).requires_grad_()
        out = row_fn(a, t, labels, spec, stats=stats)
        total = spec.total(out[0].sum(), out[1].sum())
        (ds,) = torch.autograd.grad(total, a)
    s.copy_(ds.mul_(scale[:, None] if scale.dim() else scale))  # per-row factors: (R,) scale
    return tuple(x.detach() for x in out)
