"""The dense rows of Jeffreys, the triangular discrimination, Amari's α-, Rényi's (both directions), the
αβ-divergence, the entropy-gated KL blend and DKD in the Triton row kernel (`flashkd.backends.triton_rows`), against the float64 oracle
(tests/oracle.py, the papers' formulas) and the torch backend.

fp32 inputs on irregular shapes (V = 37, H = 11, N = 19, chunk_size 5); without a GPU the kernel runs
under Triton's interpreter, on a GPU compiled (the inputs made on the CPU and sent there, `_on`; results compared
on the CPU). The bar is the Triton backend's: 2e-5 relative of the float64 truth of the same
inputs, for the loss and for dX, dW, db (norm-wise). Where the row functions' forms are exact and the papers'
would cancel (p ≈ q) the rows are checked one by one, on the same fp32 logits the oracle reads in float64.
"""

import math

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

import flashkd  # noqa: E402
from flashkd import core  # noqa: E402
from flashkd.backends import torch_rows, triton_rows  # noqa: E402
from flashkd.losses import WHOLE_VOCAB, LossSpec, akl_head, divergence  # noqa: E402
from oracle import _divergence, distill_loss  # noqa: E402
from helpers.mp import mp_rows  # noqa: E402
from helpers.rows import sharded  # noqa: E402

INTERPRET = triton_rows.INTERPRET
DEVICE = "cpu" if INTERPRET else "cuda"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET is off and there is no CUDA device", allow_module_level=True)

RTOL = 2e-5
N, H, V = 19, 11, 37
MOVED = ["jeffreys", "triangular", "alpha_divergence", "renyi", "renyi_reverse", "ab_divergence", "entropy_adaptive", "dkd"]
GATE = dict(gate_min=0.1, gate_max=0.8, gate_center=0.4, gate_width=0.2)
# each at interior parameters, and at their ends (and Rényi where its forms change: r = 1, r > 1)
CASES = [("jeffreys", {}), ("triangular", {}), ("alpha_divergence", dict(alpha=0.3)), ("renyi", dict(alpha=0.7)),
         ("renyi_reverse", dict(alpha=1.4)), ("ab_divergence", dict(alpha=0.6, beta=1.3)), ("entropy_adaptive", GATE),
         ("dkd", dict(alpha=1.0, beta=8.0)), ("alpha_divergence", dict(alpha=1e-3)), ("alpha_divergence", dict(alpha=0.999)),
         ("renyi", dict(alpha=2.0)), ("renyi", dict(alpha=0.02)), ("renyi", dict(alpha=1.0)),
         ("renyi_reverse", dict(alpha=1.0)), ("renyi_reverse", dict(alpha=0.2)), ("renyi_reverse", dict(alpha=2.0)),
         ("renyi_reverse", dict(alpha=0.999)),
         ("ab_divergence", dict(alpha=0.05, beta=2.0)), ("ab_divergence", dict(alpha=2.0, beta=0.05)),
         ("ab_divergence", dict(alpha=0.05, beta=0.05)), ("ab_divergence", dict(alpha=2.0, beta=2.0)),
         # the gate's ends: w = 1 (forward KL), w = 0 (reverse KL), a step at the center (w saturating to 0 or 1)
         ("entropy_adaptive", dict(gate_min=1.0, gate_max=1.0)), ("entropy_adaptive", dict(gate_min=0.0, gate_max=0.0)),
         ("entropy_adaptive", dict(gate_min=0.0, gate_max=1.0, gate_center=0.9, gate_width=1e-3)),
         # DKD with one of its two terms, and weights unlike the paper's
         ("dkd", dict(alpha=0.0, beta=1.0)), ("dkd", dict(alpha=2.5, beta=0.0)), ("dkd", dict(alpha=0.3, beta=0.7)),
         # powers whose two sides take one form of ψ (`_power_term` evaluates it once there)
         ("alpha_divergence", dict(alpha=0.5)), ("renyi", dict(alpha=0.5)), ("ab_divergence", dict(alpha=0.3, beta=0.3))]
FIRST = CASES[:8]  # one case of each loss
ORACLE_DEFAULTS = dict(alpha=0.1, beta=0.5)


def _on(*tensors):
    """The tensors on the kernel's device (the CPU under the interpreter)."""
    moved = tuple(None if x is None else x.to(DEVICE) for x in tensors)
    return moved if len(moved) > 1 else moved[0]


def _ids(case):
    loss, params = case
    return loss + "".join(f"-{k}{v:g}" for k, v in params.items())


def _case(seed, std=2.0):
    g = torch.Generator().manual_seed(seed)
    f = dict(generator=g, dtype=torch.float64)
    xs, xt = torch.randn(N, H, **f), torch.randn(N, H, **f)
    ws, wt = torch.randn(V, H, **f) * (std / math.sqrt(H)), torch.randn(V, H, **f) * (std / math.sqrt(H))
    bs = torch.randn(V, **f) * 0.5
    labels = torch.randint(V, (N,), generator=g)
    labels[1::4] = -100
    # values fp32 holds: the fp32 calls and the float64 oracle read the same inputs
    return (*(x.float().double() for x in (xs, ws, xt, wt, bs)), labels)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _against_oracle(loss, params, seed, options=None, form="heads", kernel_calls=None):
    """backend="triton" on fp32 inputs against the float64 oracle of the same inputs (loss, dX, dW, db at
    RTOL) and the torch backend's fp32 result; returns the Triton call's loss."""
    xs, ws, xt, wt, bs, labels = _case(seed)
    opts = dict(loss=loss, weight_hard_loss=0.3, weight_soft_loss=0.7, **params, **(options or {}))
    teacher = (xt.float(), wt.float()) if form == "heads" else ((xt @ wt.T).float(),)
    fn = flashkd.fused_linear_distill if form == "heads" else flashkd.fused_linear_distill_logits
    outs = {}
    for backend in ("triton", "torch"):
        leaves = [_on(x.float()).requires_grad_() for x in (xs, ws, bs)]
        out = fn(leaves[0], leaves[1], *_on(*teacher) if form == "heads" else (_on(*teacher),), _on(labels),
                 student_bias=leaves[2], backend=backend, chunk_size=5, **opts)
        outs[backend] = tuple(x.cpu() for x in (out, *torch.autograd.grad(out, leaves)))
        if backend == "triton" and kernel_calls is not None:
            assert kernel_calls and set(kernel_calls) == {loss}, kernel_calls  # the kernel ran, every chunk
    ref = [xs.clone().requires_grad_(), ws.clone().requires_grad_(), bs.clone().requires_grad_()]
    oracle_teacher = dict(xt=xt, wt=wt) if form == "heads" else dict(xt=None, wt=None, teacher_logits=teacher[0].double())
    want = distill_loss(ref[0], ref[1], labels=labels, student_bias=ref[2], **oracle_teacher,
                        **{**ORACLE_DEFAULTS, **opts})[0]
    truth = (want, *torch.autograd.grad(want, ref))
    for name, got, base, true in zip(("loss", "dX", "dW", "db"), outs["triton"], outs["torch"], truth):
        assert torch.isfinite(got).all(), name
        err = rel(got, true)
        assert err <= RTOL, f"{name}: error {err:.2e} against the float64 oracle (torch backend: {rel(base, true):.2e})"
    return outs["triton"][0]


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_heads_against_the_oracle(case, seed, kernel_calls):
    _against_oracle(*case, seed, dict(temperature=0.9), kernel_calls=kernel_calls)


@pytest.mark.parametrize("case", FIRST, ids=_ids)
@pytest.mark.parametrize("option", ["transforms", "sum_tau2"])
def test_dense_logits_with_options(case, option, seed, kernel_calls):
    """The dense-logits form, with both heads' transforms (a softcap and scales: the kernel's folded path) or
    τ² with "sum" and row weights."""
    options = (dict(student_logit_scale=0.8, teacher_logit_scale=1.2, student_softcap=6.0, teacher_softcap=5.0,
                    temperature=1.7) if option == "transforms" else
               dict(temperature=0.6, temperature_squared=True, reduction="sum"))
    _against_oracle(*case, seed, options, form="logits", kernel_calls=kernel_calls)


def _rows_oracle(s, t, labels, loss, params, temperature, scale):
    """(soft per row, dL/ds), 0 on ignored rows, of the papers' formulas on the same logits: at 40 digits
    (tests/test_divergence_family.py's `mp_rows`), where the oracle's float64 forms would cancel (a loss of
    1e-12 at rows whose student and teacher share a peak of 30); Rényi of order 1 (a KL there) by the
    oracle in float64."""
    if not (loss.startswith("renyi") and params["alpha"] == 1.0):
        finite = torch.isfinite(s) | torch.isfinite(t)
        if finite.all():
            value, dz = mp_rows(s.double() / temperature, t.double() / temperature, loss, params, labels.clamp_min(0))
            valid = (labels != -100)
            return torch.where(valid, value, 0.0), torch.where(valid[:, None], dz * (scale / temperature), 0.0)
    a = s.double().requires_grad_()
    lq, lp = torch.log_softmax(a / temperature, -1), torch.log_softmax(t.double() / temperature, -1)
    p = {**ORACLE_DEFAULTS, **params}
    gate = tuple(params.get(k, d) for k, d in (("gate_min", 0.0), ("gate_max", 1.0), ("gate_center", 0.5), ("gate_width", 0.1)))
    soft = _divergence(lq.exp(), lp.exp(), loss, p["beta"], p["alpha"], logs=(lq, lp), gate=gate, labels=labels)
    soft = torch.where(labels != -100, soft, 0.0)
    (ds,) = torch.autograd.grad(soft.sum() * scale, a)
    return soft.detach(), ds


def _kernel_rows(s, t, labels, loss, params, temperature, scale):
    spec = LossSpec(loss=loss, temperature=temperature, weight_hard=0.0, weight_soft=1.0, **params)
    x = _on(s.clone())
    soft, _ = triton_rows.rows(x, _on(t), _on(labels), spec, torch.tensor(scale, device=DEVICE), True)
    return soft.cpu(), x.cpu()


def _grad_slack(s, t, temperature, scale, loss=None, params=None, labels=None):
    """Per element, a few fp32 roundings of what dL/ds carries from the softmaxes' normalisers: scale / τ ·
    q (|log q| + |log p| + 1) (tests/test_triton_rows.py's `_log_terms`). log l_s and log l_t, summed and
    taken in fp32, shift every log q − log p of a row alike by ~1e-7; the losses cancel that shift to first
    order, their gradients (q − p, q − e / S, ...) do not, and no fp32 evaluation does better. The
    αβ-divergence's (h − q Σ h)/α, h = q^c − p^α q^β, moves by q^c + q Σ q^c for such a shift, not q; DKD's
    by (β + α) q / Q, Q = 1 − q_y the mass off the label (q̂ = q / Q carries the shift at weight β)."""
    lq = torch.log_softmax(s.double() / temperature, -1)
    lp = torch.log_softmax(t.double() / temperature, -1)
    size = lq.exp()
    if loss == "dkd":  # β (q̂ − p̂) − α (q_y − p_y) q / Q: q's normaliser shift carried at weight (β + α) / Q
        lq_y = lq.gather(1, labels.clamp_min(0)[:, None])
        size = size * (params["beta"] + params["alpha"]) / -torch.expm1(lq_y)
    if loss == "ab_divergence":
        qc = (lq * (params["alpha"] + params["beta"])).exp()
        size = qc + size * qc.sum(-1, keepdim=True)
    w = torch.where(lq > -torch.inf, size * (lq.abs() + lp.abs().nan_to_num(posinf=0.0) + 1.0), 0.0)
    return 8 * torch.finfo(torch.float32).eps * scale / temperature * w


def _normalisation_slack(s, t, loss, params, temperature, labels=None):
    """Per row, how far the loss moves where q and p are each scaled by 1 + O(fp32 eps), as a softmax's
    normaliser summed in fp32 is: 0 to first order for the losses that are 0 at q = p on any scale, but the
    αβ-divergence of c = α + β ≠ 1, whose terms are homogeneous of degree c: there the first-order change
    ε Σ q^β (q^α − p^α)/α (and p's likewise) is not small beside a loss of (q − p)².
    To second order every loss moves by about ε²/2: log q − log p shifted by ε on a whole row adds
    Σ p (δ + ε)²/2 − Σ p δ²/2 ≈ ε²/2 near p = q. That is ~1e-14 where ε is a few fp32 roundings of the
    row's log2 normalisers (`second`), nothing beside a loss of ~1e-7, but a row whose loss is ~4e-10 (its
    mass on ids where δ ~ 3e-5) moves by it relatively 4e-5 on a GPU (its lg2.approx) and 4e-6 in numpy."""
    second = _second_order_slack(s, t, temperature)
    if loss == "dkd" and params["alpha"] != 0.0:
        # TCKD's log(q_y / p_y) carries the difference of the two rows' fp32 logsumexps, whose rounding no sum
        # over the vocab cancels (the binary's other log-ratio follows from it: P − Q = q_y − p_y); the loss
        # moves by α |∂TCKD/∂log q_y| = α |q_y − p_y| / (1 − q_y) times that rounding
        a, b = s.double() / temperature, t.double() / temperature
        y = labels.clamp_min(0)[:, None]
        lq, lp = torch.log_softmax(a, -1).gather(1, y)[:, 0], torch.log_softmax(b, -1).gather(1, y)[:, 0]
        rounding = 8 * torch.finfo(torch.float32).eps * (a.logsumexp(-1).abs() + b.logsumexp(-1).abs() + 1.0)
        return params["alpha"] * (lq.exp() - lp.exp()).abs() / -torch.expm1(lq) * rounding + second
    if loss != "ab_divergence" or params["alpha"] + params["beta"] == 1.0:
        return second
    q = torch.softmax(s.double() / temperature, -1)
    p = torch.softmax(t.double() / temperature, -1)
    al, be = params["alpha"], params["beta"]
    first = ((q**be * (q**al - p**al)).abs().sum(-1) / al + (p**al * (p**be - q**be)).abs().sum(-1) / be)
    return 16 * torch.finfo(torch.float32).eps * first + second


def _second_order_slack(s, t, temperature):
    """ε² per row (`_normalisation_slack`), ε = 4 fp32 roundings of what a row's log q − log p shift is made of:
    log2 l_s, log2 l_t (each row's sum of 2^((z − m)·log2 e / τ)) and (m_s − m_t)·log2 e / τ, in natural units."""
    k = 1.0 / (math.log(2.0) * temperature)
    a, b = s.double(), t.double()
    m_s, m_t = a.amax(-1, keepdim=True), b.amax(-1, keepdim=True)
    log2_l = lambda z, m: torch.log2(torch.exp2((z - m) * k).sum(-1))
    size = log2_l(a, m_s) + log2_l(b, m_t) + ((m_s - m_t)[:, 0] * k).abs() + 1.0
    return (4 * torch.finfo(torch.float32).eps * math.log(2.0) * size) ** 2


def _phi0(x):
    """e^x − 1 − x in float64, by its series where the difference cancels."""
    small = x.abs() < 0.1
    xs = torch.where(small, x, 0.0)
    series = sum(xs**n / math.factorial(n) for n in range(2, 14))
    return torch.where(small, series, torch.expm1(x) - x)


@triton.jit
def _terms_kernel(lp_ptr, lq_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    lp, lq, u = tl.load(lp_ptr + offs, mask=mask), tl.load(lq_ptr + offs, mask=mask), tl.load(u_ptr + offs, mask=mask)
    fkl, rkl, gap, p = triton_rows._kl_pair(lp, lq, u)
    tl.store(out_ptr + offs, fkl, mask=mask)
    tl.store(out_ptr + n + offs, rkl, mask=mask)
    tl.store(out_ptr + 2 * n + offs, gap, mask=mask)
    tl.store(out_ptr + 3 * n + offs, p, mask=mask)
    tl.store(out_ptr + 4 * n + offs, triton_rows._power_term(lp, lq, u, 0.5, 0.5, 6 + 8 * 6), mask=mask)


def test_row_terms_elementwise_against_float64(seed):
    """The row kernel's per-element terms, each against its float64 value on the same fp32 log2 p, log2 q and
    u = log2 q − log2 p: KL(p‖q)'s and KL(q‖p)'s, |q − p| and p (`_kl_pair`: the entropy blend, AKL, DKD) and the power
    family's at γ = ½ (ψ's closed form): within 32 fp32 roundings of each term at every gap — from 0 through
    the series' edge (|u| ln 2 = 1, the forms' switch: ~8 roundings there under the interpreter, and the GPU's
    exp2 is good to 2) to far apart and one side absent (inf and the other side's mass, exactly)."""
    g = torch.Generator().manual_seed(seed)
    edge = 1 / math.log(2)
    gaps = torch.cat([torch.tensor([0.0, 1e-30, 1e-7, 1e-4, 0.03, 0.3, edge * (1 - 1e-6), edge, edge * (1 + 1e-6),
                                    0.9 * edge, 1.1 * edge, 3.0, 40.0, 300.0]),
                      torch.rand(2000, generator=g) * 4, torch.rand(2000, generator=g).pow(4) * 60,
                      10 ** (torch.rand(500, generator=g) * 8 - 9)]).double()
    u = torch.cat([gaps, -gaps]).float()
    big = (torch.rand(u.shape, generator=g) * -40).float()  # the larger side's log2, the other |u| below it
    lq = torch.where(u >= 0, big, (big.double() + u.double()).float())
    lp = torch.where(u >= 0, (big.double() - u.double()).float(), big)
    u = (lq.double() - lp.double()).float()  # the kernel's u is the logs' difference, here exact in fp32
    lp = torch.cat([lp, torch.tensor([-3.0, -torch.inf, -torch.inf])])
    lq = torch.cat([lq, torch.tensor([-torch.inf, -5.0, -torch.inf])])
    u = torch.cat([u, torch.tensor([-torch.inf, torch.inf, torch.nan])])
    n = u.numel()
    out = _on(torch.empty(5 * n))
    _terms_kernel[(triton.cdiv(n, 1024),)](*_on(lp, lq, u), out, n, BLOCK=1024)
    fkl, rkl, gap, p_got, half = out.cpu().view(5, n).double()
    # p and q as the kernel's inputs define them: the larger side 2^max(log2 p, log2 q), the other 2^−|u| times it
    delta = u.double() * math.log(2)
    big = torch.exp2(torch.maximum(lp, lq).double())
    p, q = big * torch.exp((-delta).clamp_max(0.0)), big * torch.exp(delta.clamp_max(0.0))
    want_f, want_r = p * _phi0(delta), q * _phi0(-delta)  # p log(p/q) − p + q = p φ0(δ), and its mirror
    want_h = 2 * big * torch.expm1(-delta.abs() / 2) ** 2  # 2 (√p − √q)²
    body = slice(0, n - 3)
    want_gap = -big * torch.expm1(-delta.abs())
    for got, want in ((fkl, want_f), (rkl, want_r), (gap, want_gap), (p_got, p), (half, want_h)):
        err = (got[body] - want[body]).abs()
        # below fp32's least normal (2^−126) the GPU's exp2 flushes to 0 (ex2.approx.ftz): p at u ≥ 126, say
        bad = err > 32 * 2.0**-24 * want[body] + 2.0**-126
        assert not bad.any(), (u[body][bad][:4].tolist(), got[body][bad][:4].tolist(), want[body][bad][:4].tolist())
    assert fkl[-3:].tolist() == [math.inf, 2.0**-5, 0.0] and rkl[-3:].tolist() == [2.0**-3, math.inf, 0.0]
    assert gap[-3:].tolist() == [2.0**-3, 2.0**-5, 0.0] and p_got[-3:-1].tolist() == [2.0**-3, 0.0]
    assert half[-3:].tolist() == [2 * 2.0**-3, 2 * 2.0**-5, 0.0]


@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("gap", [1e-2, 1e-3])
def test_rows_near_p_equals_q(case, gap, seed):
    """A student within `gap` of the teacher (logits std 4; the loss ~gap²): each row's loss within RTOL of
    the float64 formula on the same fp32 logits (the kernel's forms do not cancel: log q − log p from the
    logits' difference, q − p and the α-family's ψ without a difference of near numbers), and dL/ds within
    RTOL of its largest element plus its normalisers' slack (`_grad_slack`). The αβ-divergence of c ≠ 1
    also moves by its normalisation slack."""
    loss, params = case
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(6, V, generator=g) * 4
    s = t + gap * torch.randn(6, V, generator=g)
    labels = torch.tensor([0, 1, -100, 3, 4, 5])
    soft, ds = _kernel_rows(s, t, labels, loss, params, 0.9, 0.5)
    want, want_ds = _rows_oracle(s, t, labels, loss, params, 0.9, 0.5)
    assert (soft[2] == 0).all() and (ds[2] == 0).all()
    slack = _normalisation_slack(s, t, loss, params, 0.9, labels)
    err = (soft.double() - want).abs()
    assert (err <= RTOL * want.abs() + slack).all(), (err / want.abs()).tolist()
    assert ((ds.double() - want_ds).abs() <= RTOL * want_ds.abs().max() + _grad_slack(s, t, 0.9, 0.5, loss, params, labels)).all()


@pytest.mark.parametrize("temperature", [1.0, 0.25])
def test_dkd_where_the_label_leaves_the_rest_below_fp32(temperature, seed):
    """DKD's non-target part where the student's label logit is so far above the rest that Q = 1 − q_y is below
    fp32's range (2^−170 here): q̂ = q / Q is formed from its logs, not as 0 · (1/0), so dL/ds off the label keeps
    β (q̂ − p̂) (it came out without it, or NaN at τ ¼); and the teacher's P likewise in the second row."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(3, V, generator=g) * 4
    t = torch.randn(3, V, generator=g) * 4
    s[0, 0], t[0, 2] = 120.0, 120.0  # the student on its label, the teacher elsewhere
    s[1, 3], t[1, 1] = 30.0, 120.0  # the teacher on the label
    labels = torch.tensor([0, 1, 5])
    params = dict(alpha=1.0, beta=8.0)
    soft, ds = _kernel_rows(s, t, labels, "dkd", params, temperature, 0.5)
    # the reference: the torch rows in float64 (the 40-digit oracle's 1 − q_y is 0 here), whose DKD takes Q from
    # the off-label logits' own logsumexp
    x = s.double().requires_grad_()
    total = flashkd.fused_linear_distill_logits(x, torch.eye(V, dtype=torch.float64), t.double(), labels, loss="dkd",
                                                temperature=temperature, weight_hard_loss=0.0, weight_soft_loss=1.0,
                                                reduction="sum", backend="torch", **params)
    (want_ds,) = torch.autograd.grad(total * 0.5, x)
    assert torch.isfinite(soft).all() and torch.isfinite(ds).all()
    torch.testing.assert_close(soft.double().sum(), total.detach(), rtol=RTOL, atol=0.0)
    # within 1e-4 of the largest element (3e-6 measured: the rows' logs near −170 carry ulps of 2e-5 there; the
    # lost non-target part was O(1) of it)
    err = ((ds.double() - want_ds).abs().max() / want_ds.abs().max()).item()
    assert err <= 1e-4, err


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_rows_at_trained_magnitudes(case, seed):
    """Logits of std 4 with peaks of 30, the teacher's and the student's on different ids in some rows, on
    the same id in others: each row's loss and dL/ds within RTOL of the formula (the slacks of the rows near
    p = q above where they apply: the row sharing a peak has a loss of ~1e-13)."""
    loss, params = case
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(6, V, generator=g) * 4
    s = torch.randn(6, V, generator=g) * 4
    t[0, 3], s[0, 7] = 30.0, 30.0
    t[1, 5], s[1, 5] = 30.0, 28.0
    t[2, 11] = 30.0
    s[3, 20] = 30.0
    labels = torch.tensor([0, 1, 2, 3, -100, 5])
    soft, ds = _kernel_rows(s, t, labels, loss, params, 1.0, 1.0)
    want, want_ds = _rows_oracle(s, t, labels, loss, params, 1.0, 1.0)
    assert torch.isfinite(soft).all() and torch.isfinite(ds).all()
    err = (soft.double() - want).abs()
    assert (err <= RTOL * want.abs() + _normalisation_slack(s, t, loss, params, 1.0, labels)).all(), (err / want).tolist()
    assert ((ds.double() - want_ds).abs() <= RTOL * want_ds.abs().max() + _grad_slack(s, t, 1.0, 1.0, loss, params, labels)).all()


@pytest.mark.parametrize("loss,params", [("renyi", dict(alpha=2.0)), ("renyi_reverse", dict(alpha=2.0)),
                                         ("renyi", dict(alpha=1.5)), ("renyi_reverse", dict(alpha=0.5))])
@pytest.mark.parametrize("sliced", [False, True])
def test_renyi_sums_past_fp32_on_sharp_rows(loss, params, sliced, seed):
    """Sharp rows (logits std 4 at τ 0.25, the sides' peaks of 30 on different ids): Rényi's S = Σ p^r q^(1−r)
    at r > 1 reaches e^100 and more (p² / q with q ~e^-130), past fp32, though the loss log S / (r − 1) is ~100
    nats. The kernel sums S per lane under its running max (and the slices merge (sum, max) pairs): the loss and
    dL/ds within RTOL of the formula at 40 digits, whole rows and over vocab slices."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(5, V, generator=g) * 4
    s = torch.randn(5, V, generator=g) * 4
    t[0, 3], s[0, 7] = 30.0, 30.0
    t[1, 5], s[1, 6] = 30.0, -30.0
    s[2, 20] = 30.0
    t[3] = s[3] + 1e-2 * torch.randn(V, generator=g)  # one row near p = q beside them
    labels = torch.tensor([0, 1, 2, 3, 4])
    tau = 0.25
    want, want_ds = _rows_oracle(s, t, labels, loss, params, tau, 1.0)
    if params["alpha"] == 2.0:  # the case: S past fp32's largest number on the sharp rows
        assert want[:3].max().item() * (params["alpha"] - 1) > 89
    spec = LossSpec(loss=loss, temperature=tau, weight_hard=0.0, weight_soft=1.0, **params)
    one = torch.tensor(1.0, device=DEVICE)
    if sliced:
        soft, _, ds = (x.cpu() for x in sharded(*_on(s, t, labels), spec, one, True, [(0, 9), (9, 23), (23, V)]))
    else:
        soft, ds = _kernel_rows(s, t, labels, loss, params, tau, 1.0)
    assert torch.isfinite(soft).all() and torch.isfinite(ds).all()
    err = (soft.double() - want).abs()
    assert (err <= RTOL * want.abs()).all(), (err / want).tolist()
    assert ((ds.double() - want_ds).abs() <= RTOL * want_ds.abs().max() + _grad_slack(s, t, tau, 1.0)).all()


@pytest.mark.parametrize("loss,params", [("alpha_divergence", dict(alpha=0.3)), ("ab_divergence", dict(alpha=0.3, beta=1.9)),
                                         ("triangular", {}), ("renyi", dict(alpha=0.6)), ("renyi_reverse", dict(alpha=0.4)),
                                         ("jeffreys", {}), ("renyi", dict(alpha=1.5)), ("renyi_reverse", dict(alpha=1.0))])
def test_masked_ids(loss, params, seed, kernel_calls):
    """−inf teacher logits and −inf student logits at other ids, where the formula is finite there (Amari's, αβ,
    triangular, Rényi of order < 1); Jeffreys and Rényi of order ≥ 1 with both sides ruling out the same ids.
    Finite, against the oracle of the same fp32 inputs in float64."""
    xs, ws, xt, wt, _, labels = _case(seed)
    tl = (xt @ wt.T).float()
    bias = torch.zeros(V)
    if loss == "jeffreys" or (loss.startswith("renyi") and params["alpha"] >= 1):
        tl[:, 3] = bias[3] = tl[:, 20] = bias[20] = -torch.inf
    else:
        tl[:, 3] = -torch.inf
        tl[::2, 10:14] = -torch.inf
        bias[20] = -torch.inf
    opts = dict(loss=loss, weight_hard_loss=0.0, weight_soft_loss=1.0, temperature=0.8, **params)
    x = _on(xs.float()).requires_grad_()
    out = flashkd.fused_linear_distill_logits(x, *_on(ws.float(), tl), None, student_bias=_on(bias), backend="triton",
                                              chunk_size=5, **opts)
    assert kernel_calls and set(kernel_calls) == {loss}
    (dx,) = torch.autograd.grad(out, x)
    out, dx = out.cpu(), dx.cpu()
    xr = xs.float().double().requires_grad_()
    want = distill_loss(None, None, None, None, None, teacher_logits=tl.double(),
                        student_logits=xr @ ws.float().double().T + bias.double(), **{**ORACLE_DEFAULTS, **opts})[0]
    assert torch.isfinite(out) and torch.isfinite(dx).all()
    assert abs(out.item() - want.item()) <= RTOL * abs(want.item())
    assert rel(dx, torch.autograd.grad(want, xr)[0]) <= RTOL


@pytest.mark.parametrize("loss", MOVED)
def test_infinite_where_the_formula_is(loss):
    """Jeffreys, and Rényi of order ≥ 1 (D(p‖q) where q = 0 < p; the reverse where p = 0 < q), are +inf on a row
    where one side rules out an id the other does not; the other rows keep their values."""
    s = torch.randn(3, V) * 2
    t = torch.randn(3, V) * 2
    second = s if loss in ("jeffreys", "renyi") else t
    second[0, 4] = -torch.inf
    params = dict(alpha=1.5) if loss.startswith("renyi") else dict(alpha=0.3) if loss == "alpha_divergence" else \
        dict(alpha=0.6, beta=1.3) if loss == "ab_divergence" else GATE if loss == "entropy_adaptive" else \
        dict(alpha=1.0, beta=8.0) if loss == "dkd" else {}
    spec = LossSpec(loss=loss, **params)
    labels = torch.zeros(3, dtype=torch.long) if loss == "dkd" else None  # DKD's target class
    soft, _ = triton_rows.rows(*_on(s.clone(), t, labels), spec, torch.tensor(1.0, device=DEVICE), False)
    soft = soft.cpu()
    want = _rows_oracle(s, t, torch.zeros(3, dtype=torch.long), loss, params, 1.0, 1.0)[0] \
        if loss not in ("jeffreys", "renyi", "renyi_reverse") else None
    if want is None:
        assert soft[0] == torch.inf and torch.isfinite(soft[1:]).all()
    else:  # the finite losses: finite there too, their limit
        torch.testing.assert_close(soft.double(), want, rtol=RTOL, atol=0)


@pytest.mark.parametrize("case", FIRST, ids=_ids)
def test_return_stats(case, seed):
    xs, ws, xt, wt, bs, labels = _case(seed)
    opts = dict(loss=case[0], temperature=1.3, return_stats=True, chunk_size=5, **case[1])
    got = flashkd.fused_linear_distill(*_on(xs.float(), ws.float(), xt.float(), wt.float(), labels), backend="triton",
                                       **opts)
    got = (got[0].cpu(), type(got[1])(*(x.cpu() if isinstance(x, torch.Tensor) else x for x in got[1])))
    want = flashkd.fused_linear_distill(xs, ws, xt, wt, labels, backend="torch", **opts)  # fp64: the truth
    torch.testing.assert_close(got[0].double(), want[0], rtol=RTOL, atol=0)
    for name in ("soft_sum", "hard_sum", "entropy_sum"):
        torch.testing.assert_close(getattr(got[1], name).double(), getattr(want[1], name), rtol=RTOL, atol=0, msg=name)
    assert got[1].rows.item() == want[1].rows.item() == int((labels != -100).sum())


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("case", FIRST + [("renyi", dict(alpha=2.0)), ("renyi_reverse", dict(alpha=1.0)), ("mutual", {}),
                                  ("co_jeffreys", {})], ids=_ids)
def test_rows_sharded_over_vocab_slices(case, grad, seed):
    """The vocab-parallel phases (each slice's pass 1, the statistics gathered, pass 2, its sums added over the
    ranks, pass 3; Jeffreys' online KL(q‖p) among the gathered statistics): the unsharded kernel's rows."""
    spec, s, t, labels, scale = _rows_case(case, seed)
    got = (x.cpu() for x in sharded(*_on(s, t, labels), spec, scale, grad, [(16, V), (0, 15), (15, 16)]))
    _assert_whole_rows(*got, case, spec, s, t, labels, scale, grad)


def _rows_case(case, seed):
    """(spec, s, t, labels, scale) of a row-function case: τ 0.7, both weights, logits of std 4, row 1 near
    p = q, an ignored row."""
    spec = LossSpec(loss=case[0], temperature=0.7, weight_hard=0.4, weight_soft=0.6, **case[1])
    g = torch.Generator().manual_seed(seed)
    s, t = torch.randn(5, V, generator=g) * 4, torch.randn(5, V, generator=g) * 4
    t[1] = s[1] + 1e-2 * torch.randn(V, generator=g)  # a row near p = q
    return spec, s, t, torch.tensor([16, 3, -100, 36, 15]), torch.tensor(0.37, device=DEVICE)


def _assert_whole_rows(soft, hard, ds, case, spec, s, t, labels, scale, grad):
    """(soft, hard, ds) on the CPU, made another way, against the unsharded kernel's rows of the same case: their
    sums merge in another order, so the αβ-divergence's row near p = q moves by its normalisation slack."""
    loss, params = case
    x = _on(s.clone())
    want_soft, want_hard = (y.cpu() for y in triton_rows.rows(x, *_on(t, labels), spec, scale, grad))
    x = x.cpu()
    slack = _normalisation_slack(s, t, loss, params, 0.7, labels)
    assert ((soft.double() - want_soft.double()).abs() <= RTOL * want_soft.double().abs() + slack).all()
    torch.testing.assert_close(hard, want_hard, rtol=RTOL, atol=0)
    if grad:
        slack = _grad_slack(s, t, 0.7, 0.37 * spec.weight_soft, loss, params, labels)
        assert ((ds - x).double().abs() <= RTOL * x.abs().max() + slack).all()


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("case", [c for c in CASES if c[0] != "dkd"], ids=_ids)
def test_rows_from_the_statistics_per_vocab_tile(case, grad, seed):
    """rows(..., tiles=...) (the CuTe logits GEMMs' per-tile statistics standing in for pass 1: the row read
    twice) against the whole-row kernel, every case and parameter end; uneven tiles (7 columns, V 37), a row
    near p = q, labels with an ignored row."""
    from flashkd.backends import cute_gemm

    spec, s, t, labels, scale = _rows_case(case, seed)
    assert triton_rows.tiles_fit(spec, grad, False, True)
    k_s, k_ce, k_t = triton_rows.tile_constants(spec, True)
    m_s, (l_s, l_c) = cute_gemm.tile_stats(s.double(), [k_s, k_ce], 7)
    m_t, (l_t,) = cute_gemm.tile_stats(t.double(), [k_t], 7)
    tiles = _on(torch.stack([m_s, l_s, l_c, m_t, l_t]).float().contiguous())
    x = _on(s.clone())
    soft, hard = (y.cpu() for y in triton_rows.rows(x, *_on(t, labels), spec, scale, grad, tiles=tiles))
    _assert_whole_rows(soft, hard, x.cpu(), case, spec, s, t, labels, scale, grad)


def test_routing():
    """The moved losses' dense rows run in the kernel on "triton" (and "auto" on a GPU), also under a process
    group (the sharded phases above); AKL's whole rows too (its slices: the torch rows); fp64 on the torch rows; the CuTe path's
    per-tile statistics stand in for pass 1 of all but DKD, AKL and a learning teacher (backend "cute", and
    "auto" where the CuTe DSL is there)."""
    x32, x64 = torch.zeros(2, 3, device=DEVICE), torch.zeros(2, 3, dtype=torch.float64, device=DEVICE)
    for loss in MOVED:
        assert loss in triton_rows.KERNEL_LOSSES
        assert core.backend.pick_backend("triton", x32) == "triton"
        assert core.backend.pick_backend("triton", x64) == "torch"
        assert (loss in core.backend.AUTO_CUTE_LOSSES) == (loss != "dkd")
        assert triton_rows.tiles_fit(LossSpec(loss=loss), True, False, True) == (loss != "dkd")
    assert "akl" in triton_rows.KERNEL_LOSSES
    for loss in ("akl", "mutual", "co_jeffreys"):  # AKL's teacher statistics come with its head; dL/dt on whole rows
        assert not triton_rows.tiles_fit(LossSpec(loss=loss), True, False, True)


@pytest.mark.parametrize("loss", MOVED)
def test_ignored_rows_and_columns_at_minus_inf_in_both(loss, seed):
    """Ignored rows get 0 and a zero gradient whatever they hold; columns at −inf in s and t both are absent."""
    params = dict(alpha=0.6, beta=1.3) if loss == "ab_divergence" else GATE if loss == "entropy_adaptive" else \
        dict(alpha=1.0, beta=8.0) if loss == "dkd" else dict(alpha=0.4) if loss not in ("jeffreys", "triangular") else {}
    g = torch.Generator().manual_seed(seed)
    s, t = torch.randn(4, V + 5, generator=g) * 3, torch.randn(4, V + 5, generator=g) * 3
    s[:, :5] = t[:, :5] = -torch.inf
    labels = torch.tensor([7, -100, 9, -100])
    s[1, 8], t[3, 9] = torch.nan, torch.inf
    soft, ds = _kernel_rows(s, t, labels, loss, params, 0.8, 1.0)
    assert (soft[1::2] == 0).all() and (ds[1::2] == 0).all() and (ds[:, :5] == 0).all()
    kept = s[::2, 5:].contiguous(), t[::2, 5:].contiguous(), labels[::2] - 5  # the labels' columns there
    want, want_ds = _rows_oracle(*kept, loss, params, 0.8, 1.0)
    torch.testing.assert_close(soft[::2].double(), want, rtol=RTOL, atol=0)
    assert ((ds[::2, 5:].double() - want_ds).abs() <= RTOL * want_ds.abs().max() + _grad_slack(*kept[:2], 0.8, 1.0, loss, params, kept[2])).all()


@pytest.mark.parametrize("loss", ["akl", "jeffreys", "reverse_kl", "entropy_adaptive", "skew_reverse_kl"])
def test_topk_ignored_rows_whose_teacher_fills_the_ids(loss, seed):
    """A top-k teacher whose K ids hold all its mass (p_rest = 0 under the bucket: reverse KL, Jeffreys', AKL's
    +inf there), or a NaN, on rows whose label is ignored (a rest of 0.1 on the others): the loss and every
    gradient finite, and equal to the torch backend's. The kernels' category math once took such a row's log-probs as 0 in every slot (a mass of K),
    and its +inf reached the gradient as 0 · inf = NaN through the masked row (an H100 run: NaN rows of dXs
    and dWs, AKL at τ 1.5)."""
    g = torch.Generator().manual_seed(seed)
    n, hs, v, k = 13, 7, 41, 5
    xs = torch.randn(n, hs, generator=g).to(DEVICE).requires_grad_()
    ws = torch.randn(v, hs, generator=g).to(DEVICE).requires_grad_()
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n)]).to(DEVICE)
    lp = torch.log_softmax(torch.randn(n, k, generator=g), -1)  # sums to 1 over the ids: no rest
    y = torch.randint(0, v, (n,), generator=g)
    y[::3] = -100
    lp = torch.where((y != -100)[:, None], lp + math.log(0.9), lp).to(DEVICE)  # the rows that count: a rest of 0.1
    lp[3, 1] = torch.nan  # an ignored row's NaN stays there too
    y = y.to(DEVICE)
    out = {}
    for backend in ("torch", "triton"):
        loss_value = flashkd.fused_linear_distill_topk(xs, ws, ids, lp, y, loss=loss, tail="bucket", temperature=1.5,
                                                       backend=backend, check_teacher=False)
        out[backend] = (loss_value, *torch.autograd.grad(loss_value, (xs, ws)))
    for got, want in zip(out["triton"], out["torch"]):
        assert torch.isfinite(want).all() and torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss,params,twin", [("entropy_adaptive", dict(gate_min=1.0, gate_max=1.0), "forward_kl"),
                                              ("entropy_adaptive", dict(gate_min=0.0, gate_max=0.0), "reverse_kl")])
def test_a_gate_at_its_end_is_the_kl_it_keeps(loss, params, twin, seed, kernel_calls):
    """The entropy blend at w = 1 is forward KL, at w = 0 reverse KL, also where the KL it drops is infinite
    (the teacher rules out ids the student keeps for w = 1; the student those the teacher keeps for w = 0):
    value and gradients those of the kept KL's own kernel, finite, no 0 · inf."""
    xs, ws, xt, wt, bs, labels = _case(seed)
    tl = (xt @ wt.T).float()
    bias = bs.float().clone()
    if twin == "forward_kl":
        tl[:, 3] = -torch.inf
        tl[::2, 10:14] = -torch.inf
    else:
        bias[3] = bias[20] = -torch.inf
        labels = torch.where((labels == 3) | (labels == 20), 0, labels)  # the CE of a ruled-out label is inf
    outs = []
    for name, opts in ((loss, params), (twin, {})):
        x, w = _on(xs.float()).requires_grad_(), _on(ws.float()).requires_grad_()
        out = flashkd.fused_linear_distill_logits(x, w, *_on(tl, labels), student_bias=_on(bias), backend="triton",
                                                  chunk_size=5, loss=name, temperature=0.8, weight_hard_loss=0.2, **opts)
        outs.append(tuple(y.cpu() for y in (out, *torch.autograd.grad(out, (x, w)))))
    assert loss in kernel_calls and twin in kernel_calls
    for got, want in zip(*outs):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-7)


# --- AKL on whole rows: its head found by the kernel (`triton_rows.akl_head_keys`), then Jeffreys' passes ------


def _akl_head_of_keys(t, spec, search=False):
    """The head mask of `akl_head_keys`' (κ, κ_v, cut), made with the kernel's order keys in torch."""
    keys = triton_rows.akl_head_keys(_on(t).contiguous(), spec, search).cpu()
    x = torch.where(t == -torch.inf, t, -t) if spec.teacher_logit_scale < 0 else t
    i = (x + 0.0).view(torch.int32)
    key = (i ^ ((i >> 31) & 0x7FFFFFFF)).long()
    ids = torch.arange(t.shape[1])
    return (key >= keys[:, :1]) | ((key == keys[:, 1:2]) & (ids <= keys[:, 2:3]))


def _sorted_prefix(t, spec):
    """(want, sure) of the head in float64: the ids of p sorted descending (ties by id, a stable sort) whose
    cumulative sum is ≤ μ, the first always; sure: the ids whose cumulative sum is not within fp32 rounding of
    μ (those may fall either side)."""
    p = torch.softmax(spec.teacher(t.double()) / spec.temperature, -1)
    sorted_p, order = p.sort(dim=-1, descending=True, stable=True)
    tail = sorted_p.cumsum(-1) > spec.head_mass
    tail[:, 0] = False
    want = torch.zeros_like(tail).scatter(-1, order, ~tail)
    tie = (sorted_p.cumsum(-1) - spec.head_mass).abs() <= 64 * torch.finfo(torch.float32).eps
    return want, ~torch.zeros_like(tail).scatter(-1, order, tie)


@pytest.mark.parametrize("search", [False, True])
@pytest.mark.parametrize("mu", [0.5, 0.05, 0.9, 1.0])
@pytest.mark.parametrize("scale", [1.0, -0.6])
def test_akl_head_keys_give_the_sorted_prefix(mu, scale, search, seed):
    """The kernel's head: the ids of p sorted descending (ties by id, a stable sort), cumsum ≤ μ, the first
    always (`losses.akl_head`, against the sort in float64): peaked, flat and masked rows, logits on an integer
    grid (ties everywhere, the prefix ending inside a tied group), a negative teacher scale (the order reversed,
    −inf columns absent still); by the kernel's bins and by its search alone."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(12, 300, generator=g) * 4
    t[1, 5] = 40.0  # one id holds nearly all the mass
    t[2] = 0.0  # flat: the first ids by id
    t[3, 10] = t[3, 20] = t[3].max() + 1.0  # a tie for the top
    t[4, ::7] = -torch.inf
    t[6:] = t[6:].round()  # ties
    spec = LossSpec(loss="akl", head_mass=mu, temperature=0.8, teacher_logit_scale=scale)
    head = _akl_head_of_keys(t, spec, search)
    want, sure = _sorted_prefix(t, spec)
    assert (head == want)[sure].all()
    assert head.any(-1).all()
    if mu == 1.0:
        assert head.all()
    else:  # the flat row: a tied group cut short, its first ids by id
        n = int(head[2].sum())
        assert 0 < n < 300 and head[2].equal(torch.arange(300) < n)


@pytest.mark.parametrize("mu", [0.5, 0.1])
def test_akl_head_bins_settle_the_rows_a_search_is_kept_for(mu, seed):
    """Which of the kernel's paths settles a row, and that both give the sorted prefix: rows of a few tenths
    (a head of thousands of ids), trained magnitudes, a peak and a tie for the top are settled by the bins (no
    search); a flat row of 5000 tied ids (one tied group longer than the kernel's scratch) by the search."""
    g = torch.Generator().manual_seed(seed)
    V = 5000
    t = torch.randn(8, V, generator=g) * 0.3
    t[2:4] *= 4 / 0.3  # trained magnitudes
    t[4, 7] = 30.0
    t[5, 11] = t[5, 4000] = t[5].max() + 2.0
    t[6] = 1.5  # flat
    t[7] = torch.randn(V, generator=g).round() * 0.25  # on a grid: ties of hundreds of ids
    spec = LossSpec(loss="akl", head_mass=mu, temperature=0.8)
    searched = triton_rows.akl_head_keys(_on(t), spec).cpu()[:, 3]
    assert searched[:6].tolist() == [0] * 6 and searched[6] == 1
    # a near-flat row (std 0.01) and a large μ: a bin's mass bounded from below by 1 less what lies under it
    flat = torch.randn(2, 1000, generator=g) * 0.01
    assert triton_rows.akl_head_keys(_on(flat), LossSpec(loss="akl", head_mass=0.9)).cpu()[:, 3].tolist() == [0, 0]
    want, sure = _sorted_prefix(t, spec)
    for search in (False, True):
        head = _akl_head_of_keys(t, spec, search)
        assert (head == want)[sure].all(), search
        assert 0 < int(head[6].sum()) < V and head[6].equal(torch.arange(V) < int(head[6].sum()))


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_akl_head_of_a_top_id_over_mu_is_the_searchs(softcap, seed):
    """Rows whose top id alone holds more than μ are settled after the kernel's first read: the same (κ, κ_v,
    cut) as its search's, the first id of the top key where several share it (in one lane of the scan or in
    two; a softcap saturating the top logits, so that they round to one p while their keys differ)."""
    g = torch.Generator().manual_seed(seed)
    V = 3000
    t = torch.randn(6, V, generator=g) * 4
    t[0, 2500] = 40.0
    t[1, 5] = t[1, 1029] = 40.0  # one lane of a 1024-wide scan
    t[2, 2000] = t[2, 700] = 40.0  # two lanes
    t[3, 17] = 500.0  # a softcap of 30 takes both to 30.0 in fp32: one p, two keys
    t[3, 18] = 400.0
    t[4] = t[4].round()
    t[4, 99] = t[4, 3] = t[4].max() + 20.0
    t[5, ::3] = -torch.inf
    t[5, 6] = 45.0
    spec = LossSpec(loss="akl", head_mass=0.3, temperature=0.9, teacher_softcap=softcap)
    fast = triton_rows.akl_head_keys(_on(t), spec).cpu()
    slow = triton_rows.akl_head_keys(_on(t), spec, search=True).cpu()
    p = torch.softmax(spec.teacher(t.double()) / spec.temperature, -1)
    settled = (p.max(-1).values > 0.3).tolist()
    assert settled[:3] == [True] * 3 and settled[5]
    for r in range(6):
        assert fast[r, :3].tolist() == slow[r, :3].tolist(), r
        assert fast[r, 3] == (0 if settled[r] else fast[r, 3])
    assert fast[1, 2] == 5 and fast[2, 2] == 700 and fast[3, 2] == 17 and fast[5, 2] == 6
    want, sure = _sorted_prefix(t, spec)
    assert (_akl_head_of_keys(t, spec) == want)[sure].all()


@pytest.mark.parametrize("mu", [0.5, 0.2])
@pytest.mark.parametrize("scale", [1.0, -0.6])
def test_akl_head_within_the_lanes_four_largest_keys(mu, scale, seed, monkeypatch):
    """Rows of trained magnitudes (std 3: a head of tens of ids, the top one under μ) are settled from the lanes'
    four largest keys before the bins' kernel reads any row: exactly the rows whose id after the head (in the
    order of p, ties by id) lies above every lane's fourth largest logit, counted here in float64 — nearly all
    of them; the sorted prefix in float64 all the same, and on an integer grid (ties in the head, settled by
    either kernel). Flat rows go to the bins."""
    left = []

    class Spy:  # the rows still unsettled when `_akl_head_kernel` is launched
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(t, out, *args, **kwargs):
                left.append(int((out[:, 3] < 0).sum()))
                return self.kernel[grid](t, out, *args, **kwargs)
            return launch

    monkeypatch.setattr(triton_rows, "_akl_head_kernel", Spy(triton_rows._akl_head_kernel))
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(16, 20000, generator=g) * (3 / abs(scale))  # z of std 3
    t[6, ::3] = -torch.inf
    spec = LossSpec(loss="akl", head_mass=mu, temperature=1.0, teacher_logit_scale=scale)
    z = spec.teacher(t.double())
    p = torch.softmax(z, -1)
    unpeaked = p.max(-1).values <= mu  # the top id alone does not settle them
    sorted_p, order = p.sort(dim=-1, descending=True, stable=True)
    after = (sorted_p.cumsum(-1) <= mu).sum(-1).clamp_min(1)  # the id after the head, in the order of p
    width = triton_rows.BLOCK_V  # the kernel's lanes: lane c holds columns c, c + width, ... (V ≥ width here)
    lanes = torch.full((16, -(-20000 // width) * width), -torch.inf, dtype=torch.float64)
    lanes[:, :20000] = z
    fourth = lanes.view(16, -1, width).topk(4, dim=1).values[:, 3].amax(-1)
    within = z.gather(1, order.gather(1, after[:, None]))[:, 0] > fourth
    assert unpeaked.sum() >= 8 and (unpeaked & within).sum() >= unpeaked.sum() // 2
    _akl_head_of_keys(t, spec)
    assert left == [int((unpeaked & ~within).sum())]
    ties = (torch.randn(3, 20000, generator=g) * (3 / abs(scale))).round()  # a prefix ending in a tied group
    for rows in (t, ties):
        want, sure = _sorted_prefix(rows, spec)
        head = _akl_head_of_keys(rows, spec)
        assert (head == want)[sure].all() and head.any(-1).all()
    flat = torch.randn(2, 20000, generator=g) * 0.5
    _akl_head_of_keys(flat, spec)
    assert left[-1] == 2


@pytest.mark.parametrize("mu", [0.5, 0.2, 1.0])
@pytest.mark.parametrize("case", ["trained", "ties", "near", "softcap", "negative", "masked"])
def test_akl_rows_against_float64(case, mu, seed):
    """AKL's rows on the kernel (value and dL/ds) against autograd of the torch definition in float64 on the
    same fp32 logits: trained magnitudes (std 4, peaks 30), tied teacher logits, a student near the teacher,
    a teacher softcap, a negative teacher scale, −inf columns on both sides."""
    g = torch.Generator().manual_seed(seed)
    s, t = torch.randn(6, V + 40, generator=g) * 4, torch.randn(6, V + 40, generator=g) * 4
    s[0, 3], t[0, 3], t[1, 7], s[2, 9] = 30.0, 30.0, 30.0, 30.0
    kw = {}
    if case == "ties":
        t = t.round()
    if case == "near":
        s = t + 1e-2 * torch.randn(t.shape, generator=g)
    if case == "softcap":
        kw = dict(teacher_softcap=6.0)
    if case == "negative":
        kw = dict(teacher_logit_scale=-0.8)
    if case == "masked":
        s[:, :5] = t[:, :5] = -torch.inf
    labels = torch.tensor([0, 1, -100, 3, 4, 5])
    spec = LossSpec(loss="akl", head_mass=mu, temperature=0.9, weight_hard=0.0, weight_soft=1.0, **kw)
    x = _on(s.clone())
    soft, _ = triton_rows.rows(x, _on(t), _on(labels), spec, torch.tensor(0.5, device=DEVICE), True)
    soft, ds = soft.cpu().double(), x.cpu().double()
    a = s.double().requires_grad_()
    lq = torch.log_softmax(a / 0.9, -1)
    lp = torch.log_softmax(spec.teacher(t.double()) / 0.9, -1)
    valid = labels != -100
    want = torch.where(valid, losses_divergence(lq, lp, spec), 0.0)
    (want_ds,) = torch.autograd.grad(want.sum() * 0.5, a)
    want_ds = torch.where(torch.isfinite(s), want_ds, 0.0)
    assert (soft[~valid] == 0).all() and (ds[~valid] == 0).all()
    # The weights w = g_h / (g_h + g_t) are ratios of sums of |p − q|, each |p − q| known in fp32 only to the
    # rounding of the row's normalisers (~eps of max(p, q)): where g_h + g_t is that small (a student and
    # teacher sharing a peak of 30), fp32 does not fix w, and the loss may sit anywhere between the two KLs
    # (|KL(p‖q) − KL(q‖p)|, both of the order of the gaps squared); elsewhere this slack is ~eps of it.
    lq, lp = lq.detach(), lp.detach()
    head = akl_head(lp.exp(), mu, WHOLE_VOCAB)
    gap = torch.where(torch.isfinite(lq) | torch.isfinite(lp), (lp.exp() - lq.exp()).abs(), 0.0)
    g_all = gap.sum(-1)
    loose = (16 * torch.finfo(torch.float32).eps / g_all.clamp_min(1e-300)).clamp_max(1.0)
    kl = (spec_kl(lq, lp, "forward_kl") - spec_kl(lq, lp, "reverse_kl")).abs()
    value_slack = torch.where(valid, loose * kl.nan_to_num(posinf=0.0), 0.0)
    assert ((soft - want).abs() <= RTOL * want.abs() + value_slack + 1e-15).all(), (soft - want).abs().max()
    q, pp = lq.exp(), lp.exp()
    d_f, d_r = q - pp, q * ((lq - lp).nan_to_num(posinf=0.0, neginf=0.0) - spec_kl(lq, lp, "reverse_kl")[:, None])
    grad_slack = 0.5 / 0.9 * loose[:, None] * (d_f - d_r).abs().nan_to_num(posinf=0.0)
    slack = _grad_slack(s, spec.teacher(t), 0.9, 0.5) * 2 + torch.where(valid[:, None], grad_slack, 0.0)
    assert ((ds - want_ds).abs() <= RTOL * want_ds.abs().max() + slack).all()
    assert head.any(-1).all() and (mu == 1.0 or not head[valid].all())


def losses_divergence(lq, lp, spec):
    return divergence(lq, lp, spec)


def spec_kl(lq, lp, loss):
    """KL(p‖q) (forward_kl) or KL(q‖p) per row, float64, by the torch definition."""
    return divergence(lq, lp, LossSpec(loss=loss))


def test_akl_on_a_vocab_slice_takes_the_torch_rows():
    """The kernel's AKL needs whole rows: a slice (start=) is refused by name, and the row function of a
    sliced plan is the torch rows'."""
    spec = LossSpec(loss="akl")
    s = _on(torch.zeros(2, 8))
    with pytest.raises(ValueError, match="loss='akl' runs here on whole rows"):
        next(triton_rows.sliced_rows(s, s.clone(), None, spec, torch.tensor(1.0, device=DEVICE), False, start=8))


def test_constant_teacher_mutual_is_jeffreys_value_and_forward_kls_pull(seed, kernel_calls):
    """mutual and co_jeffreys with a constant teacher in the kernel (fp32, on DEVICE): both report Jeffreys'
    value; co_jeffreys' student gradients are jeffreys' bit for bit (the same passes), mutual's forward KL's to
    fp32 rounding (forward KL's own passes sum in another order)."""
    xs, ws, xt, wt, _, labels = _case(seed)
    runs = {}
    for loss in ("jeffreys", "forward_kl", "mutual", "co_jeffreys"):
        x, w = (t.float().to(DEVICE).requires_grad_() for t in (xs, ws))
        out = flashkd.fused_linear_distill(x, w, *_on(xt.float(), wt.float(), labels), loss=loss, backend="triton",
                                           chunk_size=5, temperature=0.8)
        runs[loss] = [y.detach().cpu() for y in (out, *torch.autograd.grad(out, (x, w)))]
    assert set(kernel_calls) == {"jeffreys", "forward_kl", "mutual", "co_jeffreys"}
    assert torch.equal(runs["mutual"][0], runs["jeffreys"][0]) and torch.equal(runs["co_jeffreys"][0], runs["jeffreys"][0])
    for a, b in zip(runs["co_jeffreys"][1:], runs["jeffreys"][1:]):
        assert torch.equal(a, b)
    for a, b in zip(runs["mutual"][1:], runs["forward_kl"][1:]):
        assert rel(a, b) <= RTOL
    assert rel(runs["mutual"][1], runs["jeffreys"][1]) > 1e-3  # not Jeffreys' gradient
