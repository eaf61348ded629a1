"""The CuTe DSL row pass (`flashkd.backends.cute_rows`), one read of each row on a thread-block cluster,
against the float64 truth of the same fp32 logits (the torch rows' autograd of the naive formulas) and
against the Triton rows on them: at a trained model's magnitudes (std 4, a peak of 30 in every 4th row),
every loss it takes, τ = 1 (the CE's softmax is q) and not, labels ignored and out of range, a scale a row,
widths of one CTA, two, and eight, dL/ds written into the logits' own bytes. GPU only (sm_90 and
nvidia-cutlass-dsl): CuTe DSL has no CPU interpreter."""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)
pytest.importorskip("cutlass.cute")

from flashkd.backends import cute_rows, torch_rows, triton_rows  # noqa: E402
from flashkd.losses import LossSpec  # noqa: E402

SHAPES = [(7, 517), (5, 16385), (3, 128256), (2, cute_rows.MAX_V)]  # 1, 2, 8, 8 CTAs a row


def _logits(r, v, gen):
    s = torch.randn(r, v, generator=gen, device="cuda") * 4.0
    t = torch.randn(r, v, generator=gen, device="cuda") * 4.0
    s[::4, 3], t[::4, 3] = 30.0, 28.0  # a confident token, agreed on
    t[1::4, v // 2] = 30.0
    return s, t


def _labels(r, v, gen, kind):
    if kind is None:
        return None
    y = torch.randint(0, v, (r,), generator=gen, device="cuda")
    y[1::3] = -100
    if kind == "out_of_range":
        y[0] = v
    return y


@pytest.mark.parametrize("labels_kind", [None, "ignored", "out_of_range"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("loss,beta", [("jsd", 0.5), ("jsd", 0.97), ("tvd", 0.5), ("forward_kl", 0.5)])
def test_against_the_float64_truth_and_the_triton_rows(seed, loss, beta, temperature, labels_kind):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for grad in (True, False):
        spec = LossSpec(loss=loss, beta=beta, temperature=temperature, weight_hard=0.3, weight_soft=0.7)
        assert cute_rows.fits(spec, grad, False, 128256)
        for r, v in SHAPES:
            s, t = _logits(r, v, gen)
            y = _labels(r, v, gen, labels_kind)
            scale = torch.rand(r, generator=gen, device="cuda") + 0.5
            x64 = s.double()
            soft64, hard64 = torch_rows.rows(x64, t.double(), y, spec, scale.double(), grad)
            xt = s.clone()
            ds_t = torch.empty(r, v, device="cuda", dtype=torch.bfloat16)
            soft_t, hard_t = triton_rows.rows(xt, t, y, spec, scale, grad, ds=ds_t)
            x = s.clone()
            ds = triton_rows.grad_view(x, torch.bfloat16, spec, True) if grad else None
            soft, hard = cute_rows.rows(x, t, y, spec, scale, grad, ds=ds)
            torch.cuda.synchronize()
            where = f"{loss} β={beta} τ={temperature} grad={grad} {r}x{v}"
            for name, got, ref, truth in (("soft", soft, soft_t, soft64), ("hard", hard, hard_t, hard64)):
                assert torch.equal(got.isnan(), truth.isnan()), (where, name)
                err = (got.double() - truth).nan_to_num().abs()
                err_t = (ref.double() - truth).nan_to_num().abs()
                assert (err <= 1e-5 * truth.nan_to_num().abs().clamp_min(1.0) + 2 * err_t).all(), (where, name, err.max())
            if not grad:
                assert torch.equal(x, s)  # nothing written
                continue
            assert torch.isfinite(ds.float()).all(), where
            if y is not None:
                assert (ds[y == -100] == 0).all(), where
            norm = x64.norm(dim=-1).clamp_min(1e-30)
            err = (ds.double() - x64).norm(dim=-1) / norm
            err_t = (ds_t.double() - x64).norm(dim=-1) / norm
            # bf16's rounding (2^-9 relative) dominates both: no worse than the Triton rows' by a small factor
            assert (err <= 1.5 * err_t + 2.0**-12).all(), (where, err.max().item(), err_t.max().item())


def test_refuses_what_it_does_not_take():
    s = torch.zeros(2, 10, device="cuda")
    scale = torch.ones((), device="cuda")
    for spec in (LossSpec(loss="reverse_kl"), LossSpec(loss="cosine"), LossSpec(loss="jsd", beta=0.0),
                 LossSpec(loss="jsd", student_softcap=30.0)):
        assert not cute_rows.fits(spec, True, False, 10)
        with pytest.raises(ValueError, match="spec: the CuTe rows take"):
            cute_rows.rows(s, s, None, spec, scale, False)
    assert not cute_rows.fits(LossSpec(), True, False, cute_rows.MAX_V + 1)
    assert not cute_rows.fits(LossSpec(), True, True, 10)
