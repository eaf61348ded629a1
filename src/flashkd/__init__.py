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

    fused_linear_distill_teachers(student_input, student_weight, teacher_inputs, teacher_heads, labels,
                                  combine="routed" | "geometric" | "sum")
                                several teacher heads in one loss (flashkd.teachers)
    teacher_topk(teacher_input, teacher_weight, k)
                                makes those top-k targets from a teacher, one chunk of logits at a time
    FusedLinearDistillLoss(loss=..., **options)
                                fused_linear_distill as an nn.Module; FusedLinearJSDLoss and
                                FusedLinearCosineSimilarityLoss are drop-ins for Liger-Kernel's modules
    token_map(student_tokenizer, teacher_tokenizer) -> TokenMap
                                a teacher with another tokenizer: TokenMap.teacher_head gathers its head
                                into the student's vocab order (the shared tokens, renormalised)
    fused_linear_uld(student_input, student_weight, teacher_input, teacher_weight, uld_alignment(...))
                                TRL's GOLD / ULD loss across tokenizers, a chunk of aligned rows at a time
    flashkd.fp8                 the FP8 teacher head behind teacher_precision="fp8"
    flashkd.data                top-k targets on disk (write_topk_targets), read lazily (TopKTargets)
                                and placed into padded batches (TopKCollator); needs safetensors

`loss=` is one of LOSSES ("jsd", "forward_kl", "reverse_kl", "tvd", "cosine", "skew_kl", "skew_reverse_kl",
"akl", "jeffreys", "alpha_divergence", "renyi", "renyi_reverse", "ab_divergence", "triangular",
"entropy_adaptive", "dkd", and, with a teacher that learns, "mutual" and "co_jeffreys"; their keywords and
formulas: docs/divergences.md); the total is weight_hard_loss · CE + weight_soft_loss · soft. The formulas, the one pure-torch definition of every
loss and of its top-k variant, are in flashkd.losses (LossSpec); the public functions in flashkd.distill;
the call's parse, checks, plan, backend choice and chunk loop (one entry, flashkd.core.run) in
flashkd.core; the row kernels in
flashkd.backends.
`flashkd bench` and `flashkd records` (flashkd.bench, flashkd.records) time the losses and keep their
results as KernelIndex records.
"""

import importlib

__version__ = "0.1.0"

# The public names, each from its module, imported at first use (PEP 562): `import flashkd` alone imports no
# torch, so that the `flashkd` command (flashkd.cli, inside this package) answers --help and a mistyped
# option before torch's second of imports.
_PUBLIC = {
    "distill": ("fused_linear_distill", "fused_linear_distill_logits", "fused_linear_distill_topk", "teacher_topk"),
    "losses": ("LOSSES", "DistillStats", "LossSpec"),
    "data": ("TopKCollator", "TopKTargets", "write_topk_targets"),
    "modules": ("FusedLinearCosineSimilarityLoss", "FusedLinearDistillLoss", "FusedLinearJSD", "FusedLinearJSDLoss"),
    "cross_vocab": ("TokenMap", "token_map", "UldAlignment", "uld_alignment", "fused_linear_uld"),
    "teachers": ("fused_linear_distill_teachers",),
}
_MODULE_OF = {name: module for module, names in _PUBLIC.items() for name in names}


def __getattr__(name: str):
    if name in _MODULE_OF:
        value = getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
        globals()[name] = value  # once: later reads are a plain module attribute
        return value
    if not name.startswith("__"):  # a submodule (flashkd.losses, ...), as the eager imports used to leave it
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_MODULE_OF})

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
    "token_map",
    "TokenMap",
    "uld_alignment",
    "UldAlignment",
    "fused_linear_uld",
    "fused_linear_distill_teachers",
]
