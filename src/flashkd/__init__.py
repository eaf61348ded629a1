"""flashkd: fused, memory-lean knowledge-distillation losses for language models."""

from .distill import fused_linear_distill
from .losses import LOSSES, LossSpec
from .modules import FusedLinearCosineSimilarityLoss, FusedLinearDistillLoss, FusedLinearJSDLoss

__version__ = "0.1.0"

__all__ = [
    "fused_linear_distill",
    "FusedLinearDistillLoss",
    "FusedLinearJSDLoss",
    "FusedLinearCosineSimilarityLoss",
    "LossSpec",
    "LOSSES",
]
