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
    """Liger gives the teacher's extra ids a student logit of 0; flashkd drops those ids, where the call
    declares them padding (vocab_size=V); undeclared, a larger teacher vocab is refused."""
    xs, ws, xt, wt, y = inputs(vt=45)
    wt[37:] *= 4  # the padded ids get real teacher mass, so the two policies must differ visibly
    theirs = chunked.LigerFusedLinearJSDLoss(compiled=False)(xs, ws, xt, wt, y)
    with pytest.raises(ValueError) as e:
        flashkd.FusedLinearJSDLoss()(xs, ws, xt, wt, y)
    assert str(e.value).startswith("teacher_weight: expected 37 rows (the student's vocab), got 45: ambiguous. "
                                   "If the teacher's head is the student's tokenizer padded to 45 rows, pass "
                                   "vocab_size=37"), str(e.value)
    ours = flashkd.FusedLinearDistillLoss("jsd", vocab_size=37)(xs, ws, xt, wt, y)
    truth, _, hard = distill_loss(xs.detach(), ws.detach(), xt, wt, y)
    zero_padded = torch.cat([ws.detach(), torch.zeros(8, ws.shape[1])])  # what Liger's soft term sees
    _, padded_soft, _ = distill_loss(xs.detach(), zero_padded, xt, wt, y)
    liger_formula = 0.5 * hard + 0.5 * padded_soft
    assert abs(ours.item() - truth.item()) <= 1e-5 * abs(truth.item())
    assert abs(theirs.item() - liger_formula.item()) <= 1e-5 * abs(truth.item())
    assert abs(truth.item() - liger_formula.item()) > 1e-3 * abs(truth.item())


LIGER_ATTRIBUTES = ("beta", "temperature", "weight_hard_loss", "weight_soft_loss", "ignore_index", "chunk_size",
                    "compiled", "return_soft_hard_loss")


@pytest.mark.parametrize("liger_cls,ours_cls,loss", PAIRS)
def test_liger_attributes(liger_cls, ours_cls, loss):
    """Code that reads Liger's module attributes reads the same from the drop-ins."""
    options = dict(weight_hard_loss=0.3, weight_soft_loss=0.7, beta=0.2, ignore_index=-1, temperature=2.0,
                   compiled=False, chunk_size=8, return_soft_hard_loss=True)
    theirs, ours = liger_cls(**options), ours_cls(**options)
    assert {a: getattr(ours, a) for a in LIGER_ATTRIBUTES} == {a: getattr(theirs, a) for a in LIGER_ATTRIBUTES}
    defaults = ours_cls()
    for name in LIGER_ATTRIBUTES:
        if name != "chunk_size":  # flashkd plans it (None); Liger's default is 1024
            assert getattr(defaults, name) == getattr(liger_cls(), name), name


@pytest.mark.parametrize("liger_cls,ours_cls,loss", PAIRS)
def test_setting_an_attribute_changes_the_next_forward(seed, liger_cls, ours_cls, loss):
    """As with Liger's modules: no copy that silently diverges from what forward uses."""
    xs, ws, xt, wt, y = inputs()
    y = torch.where(y == -100, 5, y)  # ignore_index becomes 5 below
    ours, theirs = ours_cls(chunk_size=8), liger_cls(compiled=False, chunk_size=8)
    for module in (ours, theirs):
        module.beta, module.temperature, module.weight_hard_loss, module.weight_soft_loss = 0.8, 3.0, 0.1, 0.9
        module.ignore_index = 5
        module.return_soft_hard_loss = True
    assert ours.options["beta"] == 0.8 and ours.options["ignore_index"] == 5
    got, want = ours(xs, ws, xt, wt, y), theirs(xs, ws, xt, wt, y)
    assert isinstance(got, tuple) and len(got) == 3
    for a, b in zip(got, want):
        assert torch.allclose(a, b.float(), rtol=1e-5, atol=1e-6), (a, b)
    fresh = ours_cls(beta=0.8, temperature=3.0, weight_hard_loss=0.1, weight_soft_loss=0.9, ignore_index=5,
                     chunk_size=8)(xs, ws, xt, wt, y)
    assert torch.equal(got[0], fresh)
    ours.options["beta"] = 0.4  # and the other way round
    assert ours.beta == 0.4
