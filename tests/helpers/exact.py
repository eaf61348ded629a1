"""The bf16 cases at a trained head's magnitudes (std ~4, peaks ~30) and the bar they are held to: the
fp32-logit pipeline's error against the float64 truth of the same inputs (tests/test_exact.py says why)."""

import math

import torch

N, HS, HT, V = 29, 40, 56, 517  # irregular: multiples of no block size
RATIO = 1.3  # flashkd's gradient error over the fp32-logit pipeline's, at most
LOSS_RTOL = 1e-5


def trained_head(n, h, v, gen, *, std=4.0, peak=30.0, every=4):
    """bf16 (x (n, h), w (v, h)) on gen's device whose logits x @ w^T have std `std`, and every `every`-th
    row one logit set to `peak` (a confident token), as a trained LM head gives them."""
    f64 = dict(generator=gen, dtype=torch.float64, device=gen.device)
    x = torch.randn(n, h, **f64)
    w = torch.randn(v, h, **f64) * (std / math.sqrt(h))
    rows = torch.arange(0, n, every, device=gen.device)
    wj = w[torch.randint(v, (rows.numel(),), generator=gen, device=gen.device)]
    x[rows] += ((peak - (x[rows] * wj).sum(-1)) / (wj * wj).sum(-1))[:, None] * wj
    return x.to(torch.bfloat16), w.to(torch.bfloat16)


def make_case(seed, *, ignore=True):
    gen = torch.Generator().manual_seed(seed)
    xs, ws = trained_head(N, HS, V, gen)
    xt, wt = trained_head(N, HT, V, gen)
    labels = torch.randint(V, (N,), generator=gen)
    if ignore:
        labels[1::7] = -100
    return xs, ws, xt, wt, labels


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def pipeline_grads(loss_of_logits, xs, ws):
    """The fp32-logit pipeline's (dX, dW): dL/dz in fp32 from fp32 logits, rounded to bf16, through
    GEMMs that accumulate exactly and round their results to bf16."""
    zs = (xs.double() @ ws.double().T).float().requires_grad_()
    (dz,) = torch.autograd.grad(loss_of_logits(zs), zs)
    dz = dz.to(xs.dtype).double()
    return (dz @ ws.double()).to(xs.dtype), (dz.T @ xs.double()).to(ws.dtype)


def truth_grads(loss_of_inputs, xs, ws):
    x, w = xs.double().requires_grad_(), ws.double().requires_grad_()
    loss = loss_of_inputs(x, w)
    return (loss, *torch.autograd.grad(loss, (x, w)))


def check(out, grads, truth, pipeline):
    loss, dx, dw = truth
    assert abs(out.item() - loss.item()) <= LOSS_RTOL * abs(loss.item()), (out.item(), loss.item())
    for name, got, want, base in (("dX", grads[0], dx, pipeline[0]), ("dW", grads[1], dw, pipeline[1])):
        err, err_base = rel(got, want), rel(base, want)
        assert err <= RATIO * err_base, f"{name}: error {err:.3e}, fp32-logit pipeline {err_base:.3e}"


OPTIONS = {
    "plain": {},
    "tau": {"temperature": 0.7},
    "softcap": {"student_softcap": 30.0, "teacher_softcap": 30.0},
    "scale": {"student_logit_scale": 0.8, "teacher_logit_scale": 1.25, "temperature": 1.5},
}
