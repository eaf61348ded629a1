"""The chunk loop's GEMMs: logits at fp32 accuracy, the fp32 gradient accumulators, and the CPU GEMM's operands.

    linear       x @ wᵀ (+ b), fp32 logits of bf16 / fp16 operands
    accumulate_mm  acc = β · acc + a @ b in acc's dtype (dW's fp32 accumulator)
    gemm_rows    a GEMM's first operand as the GEMM may read it (a row-strided bf16 one on the CPU, contiguous)
"""

from __future__ import annotations

import torch

from .checks import NARROW


def gemm_rows(a):
    """a, the first operand of a GEMM, as the GEMM may read it: on the CPU a bf16 matrix whose rows lie apart
    (dL/ds in half its logits' bytes, `grad_view`) made contiguous. torch's CPU bf16 GEMM reads such rows past
    their columns (torch 2.13): a NaN among the spent logits' bytes there came out in dX. CUDA's read what they
    are given."""
    if a.is_cuda or a.dtype != torch.bfloat16 or a.dim() != 2 or a.stride(1) != 1 or a.stride(0) <= a.shape[1]:
        return a
    return a.contiguous()


def linear(x, w, b):
    """x @ w^T (+ b) at fp32 accuracy: fp32 for bf16 / fp16 operands (the GEMM's fp32 accumulator, not
    its rounding to the inputs' dtype), else in their dtype. A trained head's logits reach 20-40, where
    bf16's ulp is 1/8: a logit stored in bf16 moves a top token's probability by up to ~6 %."""
    if x.dtype not in NARROW:
        return x @ w.t() if b is None else torch.addmm(b, x, w.t())
    if x.is_cuda:  # cuBLAS writes its fp32 accumulator: 1.05-1.1x the narrow output's time (BENCHMARKS.md)
        if b is not None:  # the bias added by the GEMM (the same bits as add_ after it, ~0.3 ms less a 4096-row chunk)
            return torch.addmm(b.float(), x, w.t(), out_dtype=torch.float32)
        z = torch.mm(x, w.t(), out_dtype=torch.float32)
    else:  # the CPU GEMM has no fp32 output for narrow operands: exact products, fp32 sums
        z = x.float() @ w.float().t()
    return z if b is None else z.add_(b)


def accumulate_mm(acc, a, b, beta):
    """acc = beta · acc + a @ b, accumulated in acc's dtype (fp32 for bf16 operands on CUDA).
    beta = 0 on the first chunk: acc is then never read, so it needs no zero-fill."""
    a = gemm_rows(a)
    if a.dtype == acc.dtype:
        acc.addmm_(a, b, beta=beta)
    elif acc.is_cuda:
        torch.addmm(acc, a, b, beta=beta, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype), beta=beta)
