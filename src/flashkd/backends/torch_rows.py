"""The torch row backend: differentiates the torch definitions in `flashkd.losses` with autograd.

Runs on any device; its temporaries are a few fp32 copies of the block, O(R × V).
"""

from __future__ import annotations

import torch

from ..losses import LossSpec, row_losses, topk_row_losses


def rows(s, t, labels, spec: LossSpec, scale: torch.Tensor, grad: bool):
    """Dense teacher logits t (R, V)."""
    return _differentiate(row_losses, s, t, labels, spec, scale, grad)


def topk_rows(s, t, labels, spec: LossSpec, scale: torch.Tensor, grad: bool):
    """Sparse teacher t = (ids, logprobs), (R, K) each."""
    return _differentiate(topk_row_losses, s, t, labels, spec, scale, grad)


def _differentiate(row_fn, s, t, labels, spec, scale, grad):
    if not grad:
        return row_fn(s, t, labels, spec)
    with torch.enable_grad():
        a = s.detach().to(torch.promote_types(s.dtype, torch.float32)).requires_grad_()
        soft, hard = row_fn(a, t, labels, spec)
        total = spec.total(soft.sum(), hard.sum())
        (ds,) = torch.autograd.grad(total, a)
    s.copy_(ds.mul_(scale))
    return soft.detach(), hard.detach()
