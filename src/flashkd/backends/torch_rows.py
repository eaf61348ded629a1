"""The torch row backend: differentiates `flashkd.losses.row_losses` on one block with autograd.

Runs on any device; its temporaries are a few fp32 copies of the block, O(R × V).
"""

from __future__ import annotations

import torch

from ..losses import LossSpec, row_losses


def rows(s, t, labels, spec: LossSpec, scale: torch.Tensor, grad: bool):
    if not grad:
        soft, hard = row_losses(s, t, labels, spec)
        return soft, hard
    with torch.enable_grad():
        a = s.detach().to(torch.promote_types(s.dtype, torch.float32)).requires_grad_()
        soft, hard = row_losses(a, t, labels, spec)
        total = spec.total(soft.sum(), hard.sum())
        (ds,) = torch.autograd.grad(total, a)
    s.copy_(ds.mul_(scale))
    return soft.detach(), hard.detach()
