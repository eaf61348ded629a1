"""The arithmetic mixture's Triton kernel (`flashkd.backends.triton_mixture.mix_`) against torch's logaddexp of the
teachers' log-softmaxes, one teacher at a time as `flashkd.core.mixture.block` calls it: −inf logits (a teacher
that rules ids out, both teachers on some), a zero weight, per-row and scalar weights, τ ≠ 1, a ragged last tile.
The whole call with backend="triton" is tests/test_teachers.py's test_arithmetic."""

import math

import pytest
import torch

triton = pytest.importorskip("triton")

from flashkd.backends import triton_mixture  # noqa: E402

INTERPRET = triton_mixture.INTERPRET
DEVICE = "cpu" if INTERPRET else "cuda"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET is off and there is no CUDA device", allow_module_level=True)


def _want(zs, log_ws, tau):
    parts = [torch.log_softmax(z.double() / tau, -1) + lw.double().reshape(-1, 1) for z, lw in zip(zs, log_ws)]
    acc = parts[0]
    for p in parts[1:]:
        acc = torch.logaddexp(acc, p)
    return tau * acc


@pytest.mark.parametrize("per_row", [False, "zero", True], ids=["scalar", "scalar_zero", "per_row"])
@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_mix_against_torch(seed, per_row, tau):
    g = torch.Generator().manual_seed(seed)
    r, v, m = 5, 300, 3  # 300: two tiles of 256 under the interpreter, the second ragged
    zs = [torch.randn(r, v, generator=g) * 4 for _ in range(m)]
    zs[0][:, 7] = -torch.inf  # one teacher rules out an id: the others keep it
    for z in zs:
        z[:, 11] = -torch.inf  # every teacher rules out another: −inf in the mixture
    if per_row is True:
        w = torch.rand(r, m, generator=g) + 0.05
        w[1, 2] = 0.0  # this teacher adds nothing to row 1
        w = w / w.sum(-1, keepdim=True)
        log_ws = [w[:, k].log().to(DEVICE) for k in range(m)]
    else:  # one float a teacher, as the kernel takes M floats' logs; a zero weight's is −inf
        log_ws = [math.log(x) if x > 0 else -math.inf for x in ((0.0, 0.6, 0.4) if per_row else (0.2, 0.5, 0.3))]
    acc = None
    for k, (z, lw) in enumerate(zip(zs, log_ws)):
        acc = triton_mixture.mix_(acc, z.clone().to(DEVICE), lw, tau, k == m - 1)
    want = _want(zs, [torch.as_tensor(lw).cpu() for lw in log_ws], tau)
    got = acc.cpu().double()
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert ((got - want).abs()[finite] <= 2e-6 * (want.abs()[finite] + 1.0)).all()
    # the mixture is a distribution at τ: Σ softmax(acc / τ) = 1 without renormalising
    total = torch.softmax(got / tau, -1).sum(-1)
    torch.testing.assert_close(total, torch.ones_like(total), rtol=0, atol=1e-9)
    assert (torch.logsumexp(got / tau, -1).abs() <= 1e-5).all()


def test_mix_refuses_what_it_cannot_read():
    z = torch.zeros(2, 3, dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match="z: expected contiguous float32"):
        triton_mixture.mix_(None, z, 0.0, 1.0, True)
    with pytest.raises(ValueError, match="acc: expected a contiguous float32 tensor of shape"):
        triton_mixture.mix_(torch.zeros(2, 4, device=DEVICE), z.float(), 0.0, 1.0, True)
