"""flashkd: fused, memory-lean knowledge-distillation losses for language models.

Each loss takes the student's last hidden states and LM-head weight, the teacher in one of three
forms, and labels; it returns the loss, with the student's gradients computed in the same call, in
chunks of rows, so the [tokens × vocab] logits never exist in full:

    fused_linear_distill(student_input, student_weight, teacher_input, teacher_weight, labels)
                                the teacher's hidden states and LM head (its logits made chunk by chunk)
    fused_linear_distill_logits(student_input, student_weight, teacher_logits, labels)
                                the teacher's precomputed dense logits, read in place
    fused_linear_distill_topk(student_input, student_weight, teacher_ids, teacher_logprobs, labels)
                                a sparse teacher: its top-k ids and log-probs per token (stored, or
                                returned by an inference server)

    teacher_topk(teacher_input, teacher_weight, k)
                                makes those top-k targets from a teacher, one chunk of logits at a time
    FusedLinearDistillLoss(loss=..., **options)
                                fused_linear_distill as an nn.Module; FusedLinearJSDLoss and
                                FusedLinearCosineSimilarityLoss are drop-ins for Liger-Kernel's modules
    flashkd.fp8                 the FP8 teacher head behind teacher_precision="fp8"
    flashkd.data                top-k targets on disk (write_topk_targets), read lazily (TopKTargets)
                                and placed into padded batches (TopKCollator); needs safetensors

`loss=` is one of LOSSES ("jsd", "forward_kl", "reverse_kl", "tvd", "cosine", "skew_kl", "skew_reverse_kl",
"akl"); the total is
weight_hard_loss · CE + weight_soft_loss · soft. The formulas, the one pure-torch definition of every
loss and of its top-k variant, are in flashkd.losses (LossSpec); the public functions in flashkd.distill;
the chunk loop, its memory bounds and the three forms' shared tail in flashkd.chunks; the row kernels in
flashkd.backends.
`flashkd bench` and `flashkd records` (flashkd.bench, flashkd.records) time the losses and keep their
results as KernelIndex records.
"""

from .distill import fused_linear_distill, fused_linear_distill_logits, fused_linear_distill_topk, teacher_topk
from .losses import LOSSES, DistillStats, LossSpec
from .data import TopKCollator, TopKTargets, write_topk_targets
from .modules import FusedLinearCosineSimilarityLoss, FusedLinearDistillLoss, FusedLinearJSD, FusedLinearJSDLoss

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
    "FusedLinearJSD",
    "LossSpec",
    "DistillStats",
    "LOSSES",
]
