"""flashkd: fused, memory-lean knowledge-distillation losses for language models."""

from .distill import fused_linear_distill, fused_linear_distill_logits, fused_linear_distill_topk
from .losses import LOSSES, DistillStats, LossSpec
from .teacher import teacher_topk
from .data import TopKCollator, TopKTargets, write_topk_targets
from .modules import FusedLinearCosineSimilarityLoss, FusedLinearDistillLoss, FusedLinearJSDLoss

__version__ = "0.1.0"

__all__ = [
    "fused_linear_distill",
    "fused_linear_distill_logits",
    "fused_linear_distill_topk",
    "teacher_topk",
    "write_topk_targets",
    "TopKTargets",
    "TopKCollator",
    "FusedLinearDistillLoss",
    "FusedLinearJSDLoss",
    "FusedLinearCosineSimilarityLoss",
    "LossSpec",
    "DistillStats",
    "LOSSES",
]
