"""The softcap's arithmetic in the Triton kernels (`triton_common.softcap_tanh`, `head`): accuracy against
float64 over dense grids and the edge cases (±0, tiny, saturated, huge, ±inf, NaN), with the
reciprocal on either pipe; then the row kernel with each pipe's masks against the torch rows."""

import math

import numpy as np
import pytest
import torch

from conftest import HAS_TRITON
from helpers.ties import assert_close_except_at_ties, probs, tvd_slack

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")

if HAS_TRITON:
    import triton
    import triton.language as tl

    from flashkd.backends import torch_rows, triton_common, triton_rows

    @triton.jit
    def _head_kernel(x_ptr, z_ptr, d_ptr, n, mul, HEAD: tl.constexpr, RCP_FMA: tl.constexpr,
                     BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n)
        z, d = triton_common.head(x, mul, HEAD, RCP_FMA)
        tl.store(z_ptr + offs, z, mask=offs < n)
        tl.store(d_ptr + offs, d + tl.zeros_like(x), mask=offs < n)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 4096
INF, NAN = math.inf, math.nan
PIPES = [False, True]  # RCP_FMA


def _head(x, sigma, cap, rcp_fma):
    head, fold, mul = triton_common.head_mode(sigma, cap)
    x = x.to(DEVICE, torch.float32)
    z, d = torch.empty_like(x), torch.empty_like(x)
    _head_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, z, d, x.numel(), mul, HEAD=head, RCP_FMA=rcp_fma,
                                                  BLOCK=BLOCK)
    return z.cpu().double() * fold, d.cpu()  # z in logit units (exactly: float64), as the kernels take it


def _rel(y, ref):
    return ((y.double() - ref) / ref).abs().max().item()


# ------------------------------------------------------------------------------------------- helpers


def _fused(a, b, c):
    """fp32 a·b + c rounded once: the GPU's FFMA (a·b is exact in float64)."""
    return (a.astype(np.float64) * b + c).astype(np.float32)


def _division(t, fused, steps=1, correct=True):
    """`_tanh`'s tanh |y| = (1 − t)/(1 + t) on the FMA pipe in numpy fp32, each multiply-add rounded once
    (fused: the GPU's FFMA) or twice (the interpreter's); with fewer steps for the checks' own test."""
    f32 = np.float32
    fma = _fused if fused else (lambda a, b, c: (a * b).astype(f32) + c)
    u, w = f32(1.0) + t, f32(1.0) - t
    r = fma(fma(t, f32(triton_common.RCP_P2), f32(triton_common.RCP_P1)), t, f32(triton_common.RCP_P0))
    for _ in range(steps):
        r = fma(r, fma(-u, r, f32(1.0)), r)
    q = fma(-t, r, r)
    return fma(r, fma(-u, q, w), q) if correct else q


@pytest.mark.parametrize("fused", [True, False])
def test_division_on_the_fma_pipe(fused):
    """tanh |y| = (1 − t)/(1 + t) over a dense grid of t in [0, 1] against float64, on the FMA pipe as the
    GPU evaluates it (fused) and as the interpreter does, and with the reciprocal, r − t·r: no worse
    than the tanh before, (1 − t)·rcp(1 + t) (both with a correctly rounded reciprocal: the hardware's
    is within an ulp of that), in absolute and relative error, near 0 (t near 1), between and near 1;
    exactly 1 at t = 0 and where 1 + t rounds to 1 and 1 − t too, exactly 0 at t = 1."""
    f32 = np.float32
    t = np.concatenate([np.linspace(0.0, 1.0, 1000001, dtype=f32), f32([2.0**-24, 2.0**-25, 1e-30])])
    ref = (1.0 - t.astype(np.float64)) / (1.0 + t.astype(np.float64))
    r = (1.0 / (f32(1.0) + t).astype(np.float64)).astype(f32)
    before = (f32(1.0) - t) * r
    slack = 1.0 if fused else 1.1  # the interpreter rounds each product first: a few 1/10 bit worse
    # unfused, r − t·r cancels near t = 1: an absolute 2^-26 there, against 2^-33 (the interpreter only)
    for q, compare in ((_division(t, fused), True), (_fused(-t, r, r) if fused else (-t * r) + r, fused)):
        err, err_before = np.abs(q - ref), np.abs(before - ref)
        rel, rel_before = err / np.maximum(ref, 1e-30), err_before / np.maximum(ref, 1e-30)
        for part in (ref < 1e-3, (ref >= 1e-3) & (ref < 0.9), ref >= 0.9) if compare else ():
            assert err[part].max() <= slack * err_before[part].max()
            assert rel[part].max() <= slack * rel_before[part].max()
        assert np.abs(q - ref).max() < 2.0**-22.9
        assert q[0] == 1.0 and q[-1] == 1.0 and q[-2] == 1.0 and q[1000000] == 0.0
    with pytest.raises(AssertionError):  # one Newton step and no correction: ~2^-13, which the bounds reject
        assert np.abs(_division(t, fused, steps=1, correct=False) - ref).max() < 2.0**-22.9


# ------------------------------------------------------------------------------------------ the tanh


def _grid(scale):
    """x over every regime of tanh(x / scale): 0 and the tiny, the linear part, the bend, saturation
    (|x| / scale > 9), huge logits; both signs and both zeros."""
    pos = torch.cat([torch.logspace(-40, 38, 20001, dtype=torch.float64), torch.linspace(0, 40 * scale, 200001,
                                                                                     dtype=torch.float64)[1:]])
    pos = pos[pos < 3.4e38].float()
    return torch.cat([pos, -pos, torch.tensor([0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38])])


def _check_tanh(x, z, d, sigma, cap):
    """z = c·tanh(σx/c) and d = 1 − tanh²(σx/c) from a kernel against float64: within an absolute
    2^-22 of tanh and a relative 2^-20 where |tanh| > 1/4 (an exp2 within 2^-21.5, the interpreter's
    or ex2.approx, moves tanh by half that: 2^-20.6 relative at 1/4), exactly ±c where tanh rounds to ±1 in
    fp32 (saturated), d within a relative 2^-21·(1 + 2|y|) wherever it is a normal float (saturation
    included: 1 − tanh² stays accurate past where tanh is ±1) and in [0, 1] (up to rounding) everywhere."""
    y = sigma * x.double() / cap
    th = torch.tanh(y)
    got = z.double() / cap
    assert not z.isnan().any() and not d.isnan().any()
    assert (got - th).abs().max().item() < 2.0**-22
    big = th.abs() > 0.25
    assert _rel(got[big], th[big]) < 2.0**-20
    sat = th.float().abs() == 1.0
    assert sat.sum() > 1000 and (z[sat] == cap * th[sat].sign().float()).all()
    dd = 1.0 / torch.cosh(y) ** 2
    normal = dd > 2.0**-120  # 1 − tanh² as a normal float: the relative bound holds there
    # t = 2^(k·|x|) carries the rounding of its fp32 argument, |2y|·log2(e)·2^-24, times ln 2: relative
    assert (((d.double() - dd) / dd).abs() / (1.0 + 2.0 * y.abs()))[normal].max().item() < 2.0**-21
    assert ((d >= 0.0) & (d <= 1.0 + 2.0**-21)).all()  # 4t·r² rounds to just over 1 near t = 1


@pytest.mark.parametrize("rcp_fma", PIPES)
@pytest.mark.parametrize("sigma,cap", [(1.0, 30.0), (1.7, 2.5), (-0.8, 1.5), (0.3, 50.0)])
def test_tanh(sigma, cap, rcp_fma):
    x = _grid(cap / abs(sigma))
    z, d = _head(x, sigma, cap, rcp_fma)
    _check_tanh(x, z, d, sigma, cap)
    n = (x.numel() - 6) // 2  # odd, bit for bit
    assert torch.equal(z[n:2 * n], -z[:n]) and torch.equal(d[n:2 * n], d[:n])
    zeros = _head(torch.tensor([0.0, -0.0]), sigma, cap, rcp_fma)[0]
    assert zeros.tolist() == [0.0, 0.0] and torch.signbit(zeros).tolist() == [sigma < 0, sigma > 0]


@pytest.mark.parametrize("rcp_fma", PIPES)
def test_tanh_special_values(rcp_fma):
    """−inf stays −inf (an absent column), +inf saturates to ±c (as torch's c·tanh), NaN stays NaN; the
    derivative is finite at ±inf: 0, so a 0 gradient there stays 0."""
    x = torch.tensor([-INF, INF, NAN])
    for sigma in (1.0, -2.0):
        z, d = _head(x, sigma, 4.0, rcp_fma)
        assert z[0] == -INF and z[1] == 4.0 * math.copysign(1.0, sigma) and z[2].isnan()
        assert ((d[:2] >= 0.0) & (d[:2] <= 0.0)).all() and d[2].isnan()


def test_checks_fail_on_a_worse_tanh():
    """The tanh checks reject one whose division is off by 2^-13 (one Newton step, no correction), and
    one whose 1 − tanh² is taken from tanh (0 where saturated, where it is not 0)."""
    x = _grid(30.0)
    y = x.double() / 30.0
    t = torch.exp(-2.0 * y.abs()).float()
    th = torch.from_numpy(_division(t.numpy(), True, steps=1, correct=False))
    d = 4.0 * t / (1.0 + t) ** 2
    with pytest.raises(AssertionError):
        _check_tanh(x, 30.0 * th * torch.sign(x), d, 1.0, 30.0)
    th = torch.tanh(y).float()
    with pytest.raises(AssertionError):
        _check_tanh(x, 30.0 * th, 1.0 - th * th, 1.0, 30.0)
    _check_tanh(x, 30.0 * th, d, 1.0, 30.0)  # torch's tanh itself passes


# ------------------------------------------------------------------------------- in the row kernel


@pytest.mark.parametrize("rcp", [0, 0b111111, 0b010101, 0b101010])
@pytest.mark.parametrize("loss", ["jsd", "reverse_kl", "tvd"])
def test_rows_on_each_pipe(monkeypatch, seed, loss, rcp):
    """The row kernel with the softcap's reciprocal on either pipe, pass by pass and side by side (the
    masks): loss and dL/ds as the torch rows', saturated logits (|x| ≫ c) included."""
    from flashkd.losses import LossSpec

    monkeypatch.setattr(triton_rows, "SOFTCAP_RCP_FMA", {loss: rcp})
    R, V = 4, 300
    s = torch.randn(R, V) * 4.0
    s[0, :8] = torch.tensor([25.0, -60.0, 100.0, -90.0, 1e4, -1e4, 0.0, -0.0])  # |σx/c| 10 to 4000: saturated
    t = torch.randn(R, V) * 4.0
    t[1, :5] = torch.tensor([-300.0, 60.0, 1e4, -0.0, 25.0])
    labels = torch.randint(0, V, (R,))
    spec = LossSpec(loss=loss, beta=0.4, weight_hard=0.5, want_hard=True, temperature=1.3, student_softcap=3.0,
                    teacher_softcap=5.0, student_logit_scale=1.2, teacher_logit_scale=-0.9)
    scale = torch.tensor(1.0 / R)
    jumps = None  # TVD's sign(q − p) where q and p tie in fp32 (seed 626848574: 3.4 ulp apart)
    if loss == "tvd":  # (s is about to be overwritten by dL/ds)
        q = probs(s, spec.temperature, spec.student_logit_scale, spec.student_softcap)
        p = probs(t, spec.temperature, spec.teacher_logit_scale, spec.teacher_softcap)
        jumps = tvd_slack(q, p, abs(spec.soft_scale * spec.student_logit_scale) * scale.item() / spec.temperature)
    ref = s.double()
    soft_ref, hard_ref = torch_rows.rows(ref, t.double(), labels, spec, scale.double(), True)
    got = s.to(DEVICE)
    soft, hard = triton_rows.rows(got, t.to(DEVICE), labels.to(DEVICE), spec, scale.to(DEVICE), True)
    torch.testing.assert_close(soft.cpu().double(), soft_ref, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(hard.cpu().double(), hard_ref, rtol=2e-5, atol=2e-6)
    assert_close_except_at_ties(got.cpu(), ref, jumps, rtol=2e-4, atol=2e-7, msg="dL/ds")
    # saturated: dL/ds tiny but not 0 (1 − tanh² from 4t/(1 + t)²; float64 autograd's 1 − tanh² is 0 past
    # |y| ≈ 19, its accuracy is test_tanh's)
    assert (got[0, :4] != 0).all()
