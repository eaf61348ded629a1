"""The bench's orda provider (orda-kernel 0.1.0, on its torch path on CPU) computes the loss flashkd does, for
every divergence the two share, with their parameters mapped (`providers.orda_options`): value and gradients at a
trained head's magnitudes, each parameter off its default (a mapping the wrong way round, β for 1 − β or α for
β, shows), at a temperature other than 1 (orda's KL carries τ², which the mapping undoes)."""

import dataclasses
import warnings

import pytest
import torch

import flashkd
from flashkd.bench import providers, workloads

orda_kernel = pytest.importorskip("orda_kernel")

PARAMS = {"jsd": dict(beta=0.3), "skew_kl": dict(alpha=0.2), "skew_reverse_kl": dict(alpha=0.3),
          "alpha_divergence": dict(alpha=0.3), "renyi": dict(alpha=0.7), "renyi_reverse": dict(alpha=1.6),
          "ab_divergence": dict(alpha=0.6, beta=1.3), "dkd": dict(alpha=0.7, beta=2.0),
          "entropy_adaptive": dict(gate_min=0.2, gate_max=0.9, gate_center=0.4, gate_width=0.2)}


def _grads(loss, x):
    loss.backward()
    out = loss.detach(), x.xs.grad.clone(), x.ws.grad.clone()
    x.xs.grad = x.ws.grad = None
    return out


@pytest.mark.parametrize("temperature_squared", [False, True])
@pytest.mark.parametrize("form", ["heads", "logits"])
@pytest.mark.parametrize("loss", sorted(providers.ORDA_LOSSES))
def test_orda_options_give_flashkd_loss(loss, form, temperature_squared):
    params = PARAMS.get(loss, {})
    w = workloads.Workload(loss=loss, n=29, h=40, v=173, dtype="float32", form=form, inputs="trained",
                           temperature=1.7, weight_hard=0.3, weight_soft=0.8)
    x = workloads.make_inputs(w, torch.device("cpu"))
    options = dict(loss=loss, temperature=w.temperature, weight_hard_loss=w.weight_hard,
                   weight_soft_loss=w.weight_soft, temperature_squared=temperature_squared, **params)
    if form == "heads":
        mine = _grads(flashkd.fused_linear_distill(x.xs, x.ws, x.xt, x.wt, x.y, **options), x)
        teacher = orda_kernel.SeparateTeacher(x.xt, x.wt)
    else:
        mine = _grads(flashkd.fused_linear_distill_logits(x.xs, x.ws, x.tl, x.y, **options), x)
        teacher = orda_kernel.PrecomputedTeacher(logits=x.tl)
    spec = dataclasses.replace(w.spec(), temperature_squared=temperature_squared,
                               **flashkd.losses.loss_parameters(loss, params))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its note that the CPU runs its torch reference
        theirs = _grads(orda_kernel.distillation_loss(x.xs, x.ws, x.y, teacher, **providers.orda_options(spec)).loss, x)
    assert mine[0].abs() > 1e-2
    torch.testing.assert_close(theirs[0], mine[0], rtol=2e-5, atol=1e-6)
    for a, b in zip(mine[1:], theirs[1:]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4 * a.abs().max().item())


def test_orda_provider_runs_the_workload_and_skips_what_it_has_not():
    w = workloads.Workload(loss="jeffreys", n=13, h=24, v=97, dtype="float32", inputs="trained")
    x = workloads.make_inputs(w, torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = _grads(providers.PROVIDERS["orda"].make(w, x)(), x)
    mine = _grads(providers.PROVIDERS["flashkd"].make(w, x)(), x)
    torch.testing.assert_close(theirs[0], mine[0], rtol=2e-5, atol=1e-6)
    for what, said in (({"loss": "tvd"}, "orda has no tvd"), ({"form": "topk", "k": 4}, "topk form"),
                       ({"softcap": 30.0}, "softcap")):
        with pytest.raises(providers.Skip, match=said):
            providers.PROVIDERS["orda"].make(dataclasses.replace(w, **what), x)
