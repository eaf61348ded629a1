"""The small cases the dense and top-k tests share: odd sizes that no block divides, student inputs, a
teacher's top-k targets, and the comparison of a call's results with the float64 oracle's."""

import math

import torch

import flashkd
from flashkd.losses import PARAMETERS, parameter

V, VT, HS, HT = 37, 41, 11, 6  # odd sizes: no block divides them; VT > V exercises the padded-head policy
K = 7  # teacher slots per row, fewer than V: the bucket is never empty unless a test makes it so


def read(options: dict, loss: str = "jsd") -> dict:
    """`options` without the loss parameters (beta, alpha, head_mass: `flashkd.losses.PARAMETERS`) that
    their loss does not read, which flashkd refuses; `loss` is the function's default, for options that
    name none: "jsd" for the dense functions and modules, "forward_kl" for `fused_linear_distill_topk`.
    The oracle takes every parameter for every loss: give it the options whole."""
    chosen = options.get("loss", loss)
    return {name: value for name, value in options.items()
            if name not in PARAMETERS or parameter(name, chosen) is not None}


def make_inputs(lead, dtype, *, ignore="some", bias=False, padded=False, ignore_index=-100):
    vt = VT if padded else V
    xs = torch.randn(*lead, HS, dtype=dtype, requires_grad=True)
    ws = (0.5 * torch.randn(V, HS, dtype=dtype)).requires_grad_()
    xt = torch.randn(*lead, HT, dtype=dtype)
    wt = 0.7 * torch.randn(vt, HT, dtype=dtype)
    labels = torch.randint(0, V, lead)
    if ignore == "some":
        labels[torch.rand(lead) < 0.3] = ignore_index
        labels.view(-1)[0] = ignore_index
    elif ignore == "all":
        labels.fill_(ignore_index)
    bs = (0.3 * torch.randn(V, dtype=dtype)).requires_grad_() if bias else None
    bt = 0.3 * torch.randn(vt, dtype=dtype) if bias else None
    return xs, ws, xt, wt, labels, bs, bt


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def make_student(lead, dtype, *, bias=False, ignore="some", ignore_index=-100):
    xs, ws, _, _, labels, bs, _ = make_inputs(lead, dtype, ignore=ignore, bias=bias, ignore_index=ignore_index)
    return xs, ws, bs, labels


def make_topk(lead, k=K, *, temperature=1.0, unused=True):
    """Targets as a teacher would give them: top-k of random logits at τ, slots shuffled, some slots
    unused (id −1 with −inf or junk log-prob), one row with no used slot at all."""
    logits = 2.0 * torch.randn(*lead, V, dtype=torch.float64)
    ids, logprobs = flashkd.teacher_topk(logits, torch.eye(V, dtype=torch.float64), k, temperature=temperature)
    perm = torch.argsort(torch.rand(*lead, k), -1)
    ids, logprobs = ids.gather(-1, perm), logprobs.gather(-1, perm)
    if unused:
        drop = torch.rand(*lead, k) < 0.25
        ids = ids.masked_fill(drop, -1)
        junk = torch.where(torch.rand(*lead, k) < 0.5, -math.inf, 0.7)  # anything goes in an unused slot
        logprobs = torch.where(drop, junk.to(logprobs.dtype), logprobs)
        ids.view(-1, k)[-1] = -1
    return ids, logprobs


def check_against_oracle(out, ref, grads, ref_grads, leaves, tol, labels=None, ignore_index=-100):
    """(loss, soft, hard) and the gradients of `leaves` against the oracle's, within tol; with labels,
    the rows whose label is ignore_index get exactly zero dX."""
    for name, got, want in zip(("loss", "soft", "hard"), out, ref):
        assert abs(got.item() - want.item()) <= tol * max(abs(want.item()), 1.0), (name, got.item(), want.item())
    for name, g, rg, x in zip(("dXs", "dWs", "dbs"), grads, ref_grads, leaves):
        assert g.shape == x.shape and g.dtype == x.dtype and torch.isfinite(g).all(), name
        if rg.abs().max() == 0:
            assert g.abs().max() == 0, name
        else:
            assert rel_err(g, rg) <= tol, (name, rel_err(g, rg))
    if labels is not None:
        ignored = (labels == ignore_index).reshape(-1)
        if ignored.any():
            assert grads[0].reshape(-1, HS)[ignored].abs().max() == 0


def tolerance(backend):
    """(dtype, tol) of a backend's oracle checks. torch in float64: exact up to rounding; the kernel is
    tested in fp32 (fp64 inputs would go to the torch rows)."""
    return (torch.float64, 1e-9) if backend == "torch" else (torch.float32, 2e-5)
