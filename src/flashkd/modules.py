"""nn.Module holders of config over `fused_linear_distill`, including drop-ins for Liger-Kernel's losses."""

from __future__ import annotations

import torch

from .distill import fused_linear_distill


class FusedLinearDistillLoss(torch.nn.Module):
    """`fused_linear_distill` with its keyword options fixed at construction."""

    def __init__(self, loss: str = "jsd", **options):
        super().__init__()
        self.options = dict(loss=loss, **options)

    def forward(
        self,
        student_input,  # (..., Hs)
        student_weight,  # (V, Hs)
        teacher_input,  # (..., Ht)
        teacher_weight,  # (Vt, Ht)
        labels=None,  # (...)
        student_bias=None,  # (V,)
        teacher_bias=None,  # (Vt,)
        row_weight=None,  # (...) like labels: per-call data, not an option
    ):
        return fused_linear_distill(
            student_input,
            student_weight,
            teacher_input,
            teacher_weight,
            labels,
            student_bias=student_bias,
            teacher_bias=teacher_bias,
            row_weight=row_weight,
            **self.options,
        )

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())


class _LigerDropIn(FusedLinearDistillLoss):
    """Liger-Kernel's constructor keywords; `compiled` is accepted and ignored (nothing here needs it)."""

    _loss = ""

    def __init__(
        self,
        weight_hard_loss: float = 0.5,
        weight_soft_loss: float = 0.5,
        beta: float = 0.5,
        ignore_index: int = -100,
        temperature: float = 1.0,
        compiled: bool = True,
        chunk_size: int | None = None,
        return_soft_hard_loss: bool = False,
    ):
        super().__init__(
            self._loss,
            weight_hard_loss=weight_hard_loss,
            weight_soft_loss=weight_soft_loss,
            beta=beta,
            ignore_index=ignore_index,
            temperature=temperature,
            chunk_size=chunk_size,
            return_soft_hard_loss=return_soft_hard_loss,
        )

    def forward(
        self,
        student_input,
        student_weight,
        teacher_input,
        teacher_weight,
        true_labels,
        student_bias=None,
        teacher_bias=None,
    ):
        return super().forward(
            student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias, teacher_bias
        )


class FusedLinearJSDLoss(_LigerDropIn):
    """Drop-in for `liger_kernel.chunked_loss.LigerFusedLinearJSDLoss`."""

    _loss = "jsd"


class FusedLinearCosineSimilarityLoss(_LigerDropIn):
    """Drop-in for `liger_kernel.chunked_loss.LigerFusedLinearCosineSimilarityLoss`: soft term β (1 − cos)."""

    _loss = "cosine"
