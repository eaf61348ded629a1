"""The protocol of `flashkd bench` as its records state it: the timed modes, the quantiles, the
correctness gate's tolerances, and which modes apply to a workload.

flashkd.bench.measure runs by these and flashkd.records.emit writes them into the manifests; they
live here, below both, so that the records never import the bench harness that sits above them.
"""

from __future__ import annotations

import torch

MODES = ("full", "forward", "backward", "no-grad-forward")
QUANTILES = (0.5, 0.2, 0.8)  # Liger's columns y_value_50, y_value_20, y_value_80

# The gate on relative error against the fp32 reference: (loss, grads). It catches wrong results (a
# wrong term, β or scale moves the loss or a gradient by 1e-2 and more); it does not rank precision,
# which the reported errors do. The provider's inputs are the reference's inputs before upcasting,
# so its error is its own arithmetic only. fp32: sums over V and H in another order differ by ~1e-6,
# so 1e-4 leaves 100x. bf16/fp16: logits and dX/dW rounded to 8 (11) bits give ~2e-3 (torch),
# and Liger's bf16 loss math gives 4e-3 on the loss and 1.5e-2 on dX (measured on an H200), so
# 1e-2 / 5e-2 passes every correct implementation known and still fails a 10% error.
TOLERANCE = {
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (1e-2, 5e-2),
    torch.float16: (1e-2, 5e-2),
}

# An FP8 teacher's logits are off by what e4m3's 3-bit mantissa makes of them: on the bench's inputs its
# probabilities by ~1 % (L1 0.0096, JSD 1.3e-3, BENCHMARKS.md). 5e-2 passes that and still fails a
# wrong scale or layout, which is off by O(1).
FP8_TOLERANCE = (5e-2, 5e-2)


def tolerance(w) -> tuple[float, float]:
    """The gate's (loss, grads) tolerance of a bench Workload w: its dtype's, or FP8_TOLERANCE for
    flashkd's FP8 teacher (w.teacher_precision set)."""
    return FP8_TOLERANCE if w.teacher_precision is not None else TOLERANCE[w.torch_dtype]


def applicable(w, modes: list[str]) -> list[str]:
    """The modes that apply to a bench Workload w: all for a loss; for teacher_topk (no gradient,
    w.has_grad False) only no-grad-forward."""
    return list(modes) if w.has_grad else [m for m in modes if m == "no-grad-forward"]
