"""The drop-ins give liger-kernel's values on the same inputs, where Liger is right (fp32, same vocab)."""

import pytest
import torch

import flashkd
from oracle import distill_loss

chunked = pytest.importorskip("liger_kernel.chunked_loss")

PAIRS = [
    (chunked.LigerFusedLinearJSDLoss, flashkd.FusedLinearJSDLoss, "jsd"),
    (chunked.LigerFusedLinearCosineSimilarityLoss, flashkd.FusedLinearCosineSimilarityLoss, "cosine"),
]


def inputs(n=21, v=37, vt=37, hs=8, ht=12):
    xs = torch.randn(n, hs, requires_grad=True)
    ws = (0.5 * torch.randn(v, hs)).requires_grad_()
    xt, wt = torch.randn(n, ht), 0.5 * torch.randn(vt, ht)
    y = torch.randint(0, v, (n,))
    y[torch.rand(n) < 0.3] = -100
    return xs, ws, xt, wt, y


@pytest.mark.parametrize("liger_cls,ours_cls,loss", PAIRS)
@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(beta=0.0, temperature=2.0),
        dict(beta=1.0, temperature=0.5),
        dict(beta=0.3, weight_hard_loss=0.0, weight_soft_loss=1.0),
        dict(beta=0.7, weight_hard_loss=0.2, weight_soft_loss=0.8, return_soft_hard_loss=True),
    ],
)
def test_same_values_and_grads(seed, liger_cls, ours_cls, loss, options):
    xs, ws, xt, wt, y = inputs()
    bs, bt = (0.1 * torch.randn(37)).requires_grad_(), 0.1 * torch.randn(37)
    theirs = liger_cls(compiled=False, chunk_size=8, **options)(xs, ws, xt, wt, y, bs, bt)
    ours = ours_cls(compiled=False, chunk_size=8, **options)(xs, ws, xt, wt, y, bs, bt)
    theirs, ours = (theirs, ours) if isinstance(ours, tuple) else ((theirs,), (ours,))
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b.float(), rtol=1e-5, atol=1e-6), (a, b)
    g_theirs = torch.autograd.grad(theirs[0], (xs, ws, bs))
    g_ours = torch.autograd.grad(ours[0], (xs, ws, bs))
    for a, b in zip(g_ours, g_theirs):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_padded_teacher_vocab_differs_from_liger_by_design(seed):
    """Liger gives the teacher's extra ids a student logit of 0; flashkd drops those ids."""
    xs, ws, xt, wt, y = inputs(vt=45)
    wt[37:] *= 4  # the padded ids get real teacher mass, so the two policies must differ visibly
    theirs = chunked.LigerFusedLinearJSDLoss(compiled=False)(xs, ws, xt, wt, y)
    ours = flashkd.FusedLinearJSDLoss()(xs, ws, xt, wt, y)
    truth, _, hard = distill_loss(xs.detach(), ws.detach(), xt, wt, y)
    zero_padded = torch.cat([ws.detach(), torch.zeros(8, ws.shape[1])])  # what Liger's soft term sees
    _, padded_soft, _ = distill_loss(xs.detach(), zero_padded, xt, wt, y)
    liger_formula = 0.5 * hard + 0.5 * padded_soft
    assert abs(ours.item() - truth.item()) <= 1e-5 * abs(truth.item())
    assert abs(theirs.item() - liger_formula.item()) <= 1e-5 * abs(truth.item())
    assert abs(truth.item() - liger_formula.item()) > 1e-3 * abs(truth.item())
