"""flashkd.FusedLinearJSD gives liger_kernel.transformers.LigerFusedLinearJSD's values and gradients,
built positionally as NVIDIA ModelOpt builds it: (jsd_beta, ignore_index, temperature)."""

import pytest
import torch

import flashkd

liger = pytest.importorskip("liger_kernel.transformers")


@pytest.mark.parametrize("args", [(0.5, -100, 1.0), (0.0, -100, 2.0), (1.0, -1, 0.5), (0.3, -100, 1.0)])
@pytest.mark.parametrize("with_labels", [True, False])
def test_same_values_and_grads_as_liger(seed, args, with_labels):
    n, v, hs, ht = 21, 37, 8, 12
    xs, ws = torch.randn(n, hs, requires_grad=True), (0.5 * torch.randn(v, hs)).requires_grad_()
    xt, wt = torch.randn(n, ht), 0.5 * torch.randn(v, ht)
    y = torch.randint(0, v, (n,))
    y[torch.rand(n) < 0.3] = args[1]
    labels = y if with_labels else None
    out = []
    for cls in (liger.LigerFusedLinearJSD, flashkd.FusedLinearJSD):
        loss = cls(*args)(xs, ws, xt, wt, labels)
        out.append((loss, torch.autograd.grad(loss, (xs, ws))))
    (l0, g0), (l1, g1) = out
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
