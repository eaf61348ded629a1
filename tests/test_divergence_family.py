"""Jeffreys, Amari's α-divergence, Rényi (both directions), the αβ-divergence, the triangular
discrimination, the entropy-gated KL blend and DKD against the float64 oracle, every form and option.

The oracle (tests/oracle.py, `_power_divergence`) writes them as their papers do: Σ (q − p)(log q − log p),
(1 − Σ p^(1−α) q^α)/(α(1 − α)), log Σ p^α q^(1−α)/(α − 1), −Σ (p^α q^β − α/c p^c − β/c q^c)/(αβ), Σ (p − q)²/(p + q),
w KL(p‖q) + (1 − w) KL(q‖p) with w from the teacher's normalised entropy, and α TCKD + β NCKD. Where p ≈ q
those forms cancel in float64 itself: there the reference is mpmath at 40 digits. The bar at trained
magnitudes is tests/test_exact.py's: the loss within 1e-5 relative of the truth, dX and dW within 1.3x the
fp32-logit pipeline's error.
"""

import math

import pytest
import torch

import flashkd
from conftest import BACKENDS, HAS_TRITON
from helpers.distributed import LAYOUTS, rank_device, sharded_inputs, spawn
from helpers.divergences import (check_dense_exact, check_every_option_in_float64, check_masked_ids, check_topk_exact,
                                 compare_forms_sharded, small)
from helpers.exact import OPTIONS
from helpers.mp import mp_rows
from oracle import distill_loss

FAMILY = ["jeffreys", "alpha_divergence", "renyi", "renyi_reverse", "ab_divergence", "triangular", "entropy_adaptive",
          "dkd"]
# parameters away from the defaults (the oracle takes every one explicitly)
PARAMS = {"jeffreys": {}, "alpha_divergence": dict(alpha=0.3), "renyi": dict(alpha=0.7), "renyi_reverse": dict(alpha=1.4),
          "ab_divergence": dict(alpha=0.6, beta=1.3), "triangular": {},
          "entropy_adaptive": dict(gate_min=0.1, gate_max=0.8, gate_center=0.4, gate_width=0.2),
          "dkd": dict(alpha=1.0, beta=8.0)}
# each loss at its parameters' ends (and the orders where Rényi changes form: r = 1 its limit, r > 1)
ENDS = [("alpha_divergence", dict(alpha=1e-3)), ("alpha_divergence", dict(alpha=0.999)),
        ("renyi", dict(alpha=2.0)), ("renyi", dict(alpha=0.02)), ("renyi", dict(alpha=1.0)),
        ("renyi_reverse", dict(alpha=1.0)), ("renyi_reverse", dict(alpha=0.2)), ("renyi_reverse", dict(alpha=2.0)),
        ("ab_divergence", dict(alpha=0.05, beta=2.0)), ("ab_divergence", dict(alpha=2.0, beta=0.05)),
        ("ab_divergence", dict(alpha=0.05, beta=0.05)), ("ab_divergence", dict(alpha=2.0, beta=2.0)),
        ("entropy_adaptive", dict(gate_min=0.0, gate_max=1.0, gate_center=0.0, gate_width=1e-3)),
        ("entropy_adaptive", dict(gate_min=0.3, gate_max=0.3)),
        ("dkd", dict(alpha=0.0, beta=1.0)), ("dkd", dict(alpha=2.5, beta=0.0))]
ORACLE_DEFAULTS = dict(alpha=0.1, beta=0.5, gate_min=0.0, gate_max=1.0, gate_center=0.5, gate_width=0.1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss", FAMILY)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_heads_exact_at_trained_magnitudes(backend, loss, option, seed, kernel_calls):
    check_dense_exact(backend, seed, dict(OPTIONS[option], loss=loss, **PARAMS[loss]))
    assert kernel_calls == ([] if backend == "torch" else [loss] * 2)  # the kernel on "triton"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss,params", ENDS)
def test_dense_logits_exact_at_the_parameters_ends(backend, loss, params, seed):
    check_dense_exact(backend, seed, dict(loss=loss, temperature=0.9, **params), logits=True)


# The top-k forms: the KLs of Jeffreys and the entropy blend are infinite with the plain bucket where fp32
# log-probs of a peaked row round p_rest = 1 − Σ p to 0 (as reverse_kl is), and Rényi's Σ p^r q^(1−r) is as
# uncertain as p_rest's rounding there: those take "renormalize" and TRL's clamped bucket. The clamped bucket is not quite a distribution: the losses whose rows take forms equal to
# the textbook ones on distributions only (Amari's, αβ, Rényi, the KL blend's) are not held to the textbook
# formula there.
TOPK_CASES = [(loss, tail, None) for loss in FAMILY if loss != "dkd" for tail in ("bucket", "renormalize")
              if not (tail == "bucket" and loss in ("jeffreys", "entropy_adaptive", "renyi", "renyi_reverse"))]
TOPK_CASES += [(loss, "bucket", 1e-7) for loss in ("jeffreys", "triangular")]


@pytest.mark.parametrize("loss,tail,clamp", TOPK_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_exact_at_trained_magnitudes(backend, loss, tail, clamp, seed):
    check_topk_exact(backend, seed, loss, tail, clamp, PARAMS[loss], drop_ties=False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss", FAMILY)
def test_every_option_against_the_oracle_in_float64(backend, loss, seed):
    """fp64 inputs: the loss and every gradient (x, W, bias) to ~1e-10 of the oracle, with the options
    that touch the rows: temperature and τ², both heads' transforms, biases, row weights, ignored rows,
    "sum", and the parameters away from their defaults."""
    check_every_option_in_float64(backend, seed, loss, PARAMS[loss])


@pytest.mark.parametrize("loss,params", [(loss, PARAMS[loss]) for loss in FAMILY if loss != "entropy_adaptive"] + [
    ("renyi", dict(alpha=1.7)), ("renyi_reverse", dict(alpha=0.3)), ("alpha_divergence", dict(alpha=0.95)),
    ("ab_divergence", dict(alpha=2.0, beta=0.05))])
@pytest.mark.parametrize("gap", [1e-2, 1e-5])
def test_p_near_q_is_exact(loss, params, gap, seed):
    """A student within `gap` of the teacher (logits std 4): the loss (~gap²) and dL/da against the 40-digit
    truth of the same float64 logits, to their conditioning: the log-softmax rounds log q − log p (~gap) by
    ~1e-15, which moves the loss by 2e-14/gap relative. The papers' formulas in float64 lose far more to
    cancellation (1 − Σ p^(1−α) q^α at a loss of 1e-10 keeps 6 digits); the row functions' forms do not."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(4, 23, generator=g, dtype=torch.float64) * 4
    a = (b + gap * torch.randn(4, 23, generator=g, dtype=torch.float64)).requires_grad_()
    labels = torch.randint(23, (4,), generator=g)
    out = flashkd.losses.row_losses(a, b, labels, flashkd.losses.LossSpec(loss=loss, **params))[0]
    (grad,) = torch.autograd.grad(out.sum(), a)
    value, dz = mp_rows(a.detach(), b, loss, params, labels)
    rounding = torch.zeros_like(value)
    if loss == "ab_divergence":
        # off α + β = 1 the value moves at first order with a shift of all log q (or log p) by one rounding of the
        # row's logsumexp (Σ q^(α+β) is no normaliser): dD/dδ_q = Σ (q^c − p^α q^β) / α, dD/dδ_p = Σ (p^c − p^α q^β) / β
        al, be = params["alpha"], params["beta"]
        lq, lp = torch.log_softmax(a.detach(), -1), torch.log_softmax(b, -1)
        mixed = torch.exp(al * lp + be * lq)
        shift_q = ((al + be) * lq).exp().sub(mixed).sum(-1).abs() / al
        shift_p = ((al + be) * lp).exp().sub(mixed).sum(-1).abs() / be
        ulp = lambda z: 2.0**-52 * (z.abs().amax(-1) + torch.logsumexp(z, -1).abs())  # noqa: E731
        rounding = 2 * (shift_q * ulp(a.detach()) + shift_p * ulp(b))
    err = (out.detach() - value).abs()
    assert (err <= 2e-14 / gap * value.abs() + rounding).all(), (err, value, rounding)
    torch.testing.assert_close(grad, dz, rtol=1e-9, atol=1e-9 * dz.abs().max().item())


@pytest.mark.parametrize("loss", FAMILY)
def test_gradients_are_the_tables_at_trained_magnitudes(loss, seed):
    """The formula table's dL/da (docs/divergences.md) against the 40-digit truth, at logits of std 4 with peaks
    of 30 (the teacher's and the student's on different ids), through the row functions' autograd."""
    if loss == "entropy_adaptive":
        pytest.skip("its gate is the teacher's: its dL/da is that of the two KLs, tested in float64 against the oracle")
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(4, 31, generator=g, dtype=torch.float64) * 4
    a = torch.randn(4, 31, generator=g, dtype=torch.float64) * 4
    b[0, 3], a[0, 7] = 30.0, 30.0
    a.requires_grad_()
    labels = torch.randint(31, (4,), generator=g)
    out = flashkd.losses.row_losses(a, b, labels, flashkd.losses.LossSpec(loss=loss, **PARAMS[loss]))[0]
    (grad,) = torch.autograd.grad(out.sum(), a)
    value, dz = mp_rows(a.detach(), b, loss, PARAMS[loss], labels)
    torch.testing.assert_close(out.detach(), value, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, dz, rtol=1e-9, atol=1e-12)


def test_entropy_gate_ends_are_the_kls_and_renyi_1_is_the_kl(seed):
    """gate_min = gate_max = 1 is forward KL and 0 reverse KL; Rényi of order 1 is KL(p‖q), its reverse KL(q‖p)."""
    xs, ws, xt, wt, labels = small(seed)
    kw = dict(temperature=1.3, weight_hard_loss=0.0, weight_soft_loss=1.0)

    def run(**opts):
        x = xs.clone().requires_grad_()
        out = flashkd.fused_linear_distill(x, ws, xt, wt, labels, **kw, **opts)
        return out, torch.autograd.grad(out, x)[0]

    for plain, same in (("forward_kl", dict(loss="entropy_adaptive", gate_min=1.0, gate_max=1.0)),
                        ("reverse_kl", dict(loss="entropy_adaptive", gate_min=0.0, gate_max=0.0)),
                        ("forward_kl", dict(loss="renyi", alpha=1.0)), ("reverse_kl", dict(loss="renyi_reverse", alpha=1.0))):
        (a, da), (b, db) = run(**same), run(loss=plain)
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)
        torch.testing.assert_close(da, db, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("loss,params", [("alpha_divergence", dict(alpha=0.3)), ("ab_divergence", dict(alpha=0.3, beta=1.9)),
                                         ("triangular", {}), ("renyi", dict(alpha=0.6)), ("renyi_reverse", dict(alpha=0.4)),
                                         ("jeffreys", {}), ("entropy_adaptive", PARAMS["entropy_adaptive"]),
                                         ("renyi", dict(alpha=1.5)), ("dkd", PARAMS["dkd"])])
@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_ids(loss, params, backend, seed):
    """−inf teacher logits (ids the teacher rules out) and −inf student logits at other ids: finite, with finite
    gradients, against the oracle, where the formula is finite there (Amari's, αβ, triangular, Rényi of order
    < 1). Jeffreys, the KL blend, Rényi of order ≥ 1 and DKD are infinite where one side rules out an id the
    other does not: there both rule out the same ids."""
    xs, ws, xt, wt, labels = small(seed, v=31)
    tl = xt @ wt.T
    bias = torch.zeros(ws.shape[0], dtype=torch.float64)
    same = loss in ("jeffreys", "entropy_adaptive", "dkd") or (loss.startswith("renyi") and params["alpha"] >= 1)
    if same:
        tl[:, 3] = -torch.inf
        bias[3] = -torch.inf
        tl[:, 20] = -torch.inf
        bias[20] = -torch.inf
        labels = torch.where((labels == 3) | (labels == 20), 0, labels)
    else:
        tl[:, 3] = -torch.inf
        tl[::2, 10:14] = -torch.inf
        bias[20] = -torch.inf  # the student rules an id out, everywhere
    labels = labels if loss == "dkd" else None  # (the oracle's CE, weighed by 0, is NaN at a −inf label)
    opts = dict(loss=loss, weight_hard_loss=0.0, weight_soft_loss=1.0, **params)
    check_masked_ids(xs, ws, tl, labels, bias, opts, oracle={**ORACLE_DEFAULTS, **opts}, backend=backend)


def test_a_side_at_zero_gives_the_limits_in_fp32():
    """fp32 rows where the student or the teacher holds an id at probability 0 exactly (−inf) or at e^-200 (0
    in fp32): the finite losses' limits, no NaN in the value or the gradient."""
    a = torch.tensor([[0.0, 1.0, -torch.inf, 2.0], [0.0, -200.0, 3.0, 1.0]]).requires_grad_()
    b = torch.tensor([[1.0, -torch.inf, 0.5, 2.0], [-200.0, 0.0, 3.0, -torch.inf]])
    for loss, params in (("alpha_divergence", dict(alpha=0.3)), ("ab_divergence", dict(alpha=1.5, beta=0.2)),
                         ("triangular", {}), ("renyi", dict(alpha=0.5)), ("renyi_reverse", dict(alpha=0.8))):
        spec = flashkd.losses.LossSpec(loss=loss, **params)
        out = flashkd.losses.row_losses(a, b, None, spec)[0]
        (grad,) = torch.autograd.grad(out.sum(), a)
        want = distill_loss(None, None, None, None, None, teacher_logits=b.double(), student_logits=a.detach().double(),
                            **{**ORACLE_DEFAULTS, "loss": loss, **params})[1] * 2
        assert torch.isfinite(out).all() and torch.isfinite(grad).all(), loss
        torch.testing.assert_close(out.sum().double(), want, rtol=1e-6, atol=0)


# --- misuse ---

@pytest.mark.parametrize("loss,name,value", [
    ("jeffreys", "alpha", 0.3), ("triangular", "beta", 0.5), ("renyi", "beta", 0.5), ("alpha_divergence", "beta", 0.2),
    ("dkd", "head_mass", 0.5), ("forward_kl", "gate_min", 0.1), ("jsd", "gate_width", 0.2),
    ("entropy_adaptive", "alpha", 0.5)])
def test_a_parameter_the_loss_does_not_read_is_refused(loss, name, value):
    xs, ws, xt, wt, labels = small(0)
    with pytest.raises(ValueError, match=rf"^{name}: loss={loss!r} does not read it \(it is read by "):
        flashkd.fused_linear_distill(xs, ws, xt, wt, labels, loss=loss, **{name: value})
    with pytest.raises(ValueError, match=rf"^{name}: loss={loss!r} does not read it"):
        flashkd.FusedLinearDistillLoss(loss, **{name: value})


@pytest.mark.parametrize("loss,name,value,interval", [
    ("alpha_divergence", "alpha", 0.0, r"\(0, 1\)"), ("alpha_divergence", "alpha", 1.0, r"\(0, 1\)"),
    ("renyi", "alpha", 0.0, r"\(0, 2\]"), ("renyi_reverse", "alpha", 2.5, r"\(0, 2\]"),
    ("ab_divergence", "alpha", 0.04, r"\[0.05, 2\]"), ("ab_divergence", "beta", 2.01, r"\[0.05, 2\]"),
    ("dkd", "beta", -1.0, r"\[0, inf\)"), ("dkd", "alpha", -1e-9, r"\[0, inf\)"),
    ("entropy_adaptive", "gate_width", 0.0, r"\(0, inf\)"), ("entropy_adaptive", "gate_min", -0.1, r"\[0, 1\]"),
    ("entropy_adaptive", "gate_max", 1.5, r"\[0, 1\]"), ("entropy_adaptive", "gate_center", 2.0, r"\[0, 1\]"),
    ("skew_kl", "alpha", 1.5, r"\[0, 1\]"), ("akl", "head_mass", -1e-9, r"\[0, 1\]")])
def test_out_of_range_parameters_are_named(loss, name, value, interval):
    xs, ws, xt, wt, labels = small(0)
    with pytest.raises(ValueError, match=rf"^{name}: expected a value in {interval}( for loss={loss!r})?, got {value!r}$"):
        flashkd.fused_linear_distill(xs, ws, xt, wt, labels, loss=loss, **{name: value})
    with pytest.raises(ValueError, match=rf"^{name}: expected a value in {interval}"):
        flashkd.FusedLinearDistillLoss(loss, **{name: value})


def test_gate_min_above_gate_max_is_refused():
    xs, ws, xt, wt, labels = small(0)
    with pytest.raises(ValueError, match=r"^gate_min: expected a value at most gate_max \(0.2\), got 0.5$"):
        flashkd.fused_linear_distill(xs, ws, xt, wt, labels, loss="entropy_adaptive", gate_min=0.5, gate_max=0.2)


@pytest.mark.parametrize("name", ["gate_min", "gate_width", "alpha", "beta"])
@pytest.mark.parametrize("value", [math.nan, math.inf, "0.1", True])
def test_non_numbers_are_named(name, value):
    xs, ws, xt, wt, labels = small(0)
    loss = "entropy_adaptive" if name.startswith("gate") else "ab_divergence"
    with pytest.raises(TypeError, match=rf"^{name}: expected a finite Python float"):
        flashkd.fused_linear_distill(xs, ws, xt, wt, labels, loss=loss, **{name: value})


def test_dkd_needs_labels_and_a_dense_teacher():
    xs, ws, xt, wt, labels = small(0)
    with pytest.raises(ValueError, match=r"^labels: loss='dkd' reads each row's target class \(labels\), got labels=None$"):
        flashkd.fused_linear_distill(xs, ws, xt, wt, None, loss="dkd", weight_hard_loss=0.0)
    with pytest.raises(ValueError, match=r"^labels: loss='dkd'"):
        flashkd.fused_linear_distill_logits(xs, ws, xt @ wt.T, None, loss="dkd", weight_hard_loss=0.0)
    ids, lp = flashkd.teacher_topk(xt, wt, 4)
    with pytest.raises(ValueError, match=r"^loss: expected one of .* for a top-k teacher, got 'dkd' \(it reads the "
                                         r"teacher's probability at the label"):
        flashkd.fused_linear_distill_topk(xs, ws, ids, lp, labels, loss="dkd")
    # the module's options are checked where it is made; labels come with each forward
    flashkd.FusedLinearDistillLoss("dkd", alpha=0.5, beta=2.0)


def _vocab_parallel_worker(rank, world, seed):
    """The family on a vocab split across ranks (uneven slices, not in rank order, a one-id slice at world 3),
    fp64, against the unsharded call: Rényi's logsumexp and sums, DKD's label mass and the entropy gate merge
    over the slices; Rényi at an order whose rows are far from p = q (the logsumexp form) and near it."""
    start, stop = LAYOUTS[world][rank]
    dev = rank_device()
    gen = torch.Generator().manual_seed(seed)  # the same inputs on every rank
    par = dict(process_group=torch.distributed.group.WORLD, vocab_start=start)
    cases = [dict(loss=loss, **PARAMS[loss]) for loss in FAMILY] + [
        dict(loss="renyi", alpha=2.0, temperature=0.5, chunk_size=4), dict(loss="renyi_reverse", alpha=1.0),
        dict(loss="dkd", alpha=0.5, beta=2.0, return_stats=True)]
    for options in cases:
        xs, ws, xt, wt, labels, bs, _ = sharded_inputs(gen, 11, torch.float64, dev, bias=True)
        xt = xt * 3.0  # peaked rows
        compare_forms_sharded(options, (xs, ws, xt, wt, labels, bs), start, stop, par, topk=options["loss"] != "dkd")


@pytest.mark.parametrize("world", [2, 3])
def test_vocab_parallel_equals_unsharded(world, seed):
    spawn(_vocab_parallel_worker, world, seed)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_triangular_where_both_sides_round_to_zero_is_finite(backend, dtype):
    """An id whose log-probs are finite on both sides but whose p and q both underflow to 0 (a sharp row at
    trained magnitudes: logit gaps past ~104 in fp32, ~745 in fp64) adds 0, not 0/0."""
    big = 120.0 if dtype == torch.float32 else 1200.0
    a = torch.tensor([[0.0, -big, 1.0]], dtype=dtype, requires_grad=True)
    b = torch.tensor([[0.5, -1.1 * big, 1.0]], dtype=dtype)
    loss = flashkd.fused_linear_distill_logits(a, torch.eye(3, dtype=dtype), b, torch.tensor([0]), loss="triangular",
                                               weight_hard_loss=0.0, weight_soft_loss=1.0, backend=backend)
    loss.backward()
    p, q = torch.softmax(b.double(), -1), torch.softmax(a.detach().double(), -1)
    want = torch.where(p + q > 0, (p - q).square() / (p + q), 0.0).sum()  # the id at 0 on both sides adds 0
    assert torch.isfinite(a.grad).all()
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dkd_with_both_weights_zero_and_no_ce_is_zero_with_a_zero_gradient(backend):
    x = torch.randn(4, 5, requires_grad=True)
    w = torch.randn(7, 5, requires_grad=True)
    loss = flashkd.fused_linear_distill(x, w, torch.randn(4, 5), torch.randn(7, 5), torch.tensor([1, 2, 3, 4]),
                                        loss="dkd", alpha=0.0, beta=0.0, weight_hard_loss=0.0, backend=backend)
    loss.backward()
    assert loss.item() == 0.0 and (x.grad == 0).all() and (w.grad == 0).all()
