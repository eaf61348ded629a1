"""Skew KL, skew reverse KL and adaptive KL (AKL) against the float64 oracle, every form and option.

The oracle (tests/oracle.py) writes the three from the papers: KL(p ‖ α p + (1 − α) q), KL(q ‖ (1 − α) p
+ α q), and AKL as Wu et al.'s code computes it (the teacher's probabilities sorted descending, the head
where their cumulative sum is at most μ and the first always, the student's side of the weights
detached). The bar at trained magnitudes is tests/test_exact.py's: the loss within 1e-5 relative of the
truth, dX and dW within 1.3x the fp32-logit pipeline's error.
"""

import math

import pytest
import torch

import flashkd
from conftest import BACKENDS, HAS_TRITON
from flashkd.losses import PARAMETERS, WHOLE_VOCAB, LossSpec, akl_head, divergence, parameter
from helpers.distributed import LAYOUTS, rank_device, sharded_inputs, spawn
from helpers.divergences import (check_dense_exact, check_every_option_in_float64, check_masked_ids, check_topk_exact,
                                 compare_forms_sharded, device, small)
from helpers.exact import N, OPTIONS, make_case
from helpers.ties import near

NEW = ["skew_kl", "skew_reverse_kl", "akl"]
PARAMS = {"skew_kl": dict(alpha=0.1), "skew_reverse_kl": dict(alpha=0.1), "akl": dict(head_mass=0.5)}
IN_KERNEL = ("skew_kl", "skew_reverse_kl", "akl")  # the dense Triton row kernel's


def assert_ran(calls, backend, loss):
    """On the Triton backend the dense rows of the skew losses and AKL run in the kernel; on torch, none do."""
    runs = backend == "triton" and loss in IN_KERNEL
    assert (loss in calls) == runs and set(calls) <= {loss}, (backend, loss, calls)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss", NEW)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_heads_exact_at_trained_magnitudes(backend, loss, option, seed, kernel_calls):
    check_dense_exact(backend, seed, dict(OPTIONS[option], loss=loss, **PARAMS[loss]))
    assert_ran(kernel_calls, backend, loss)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss,params", [("skew_kl", dict(alpha=0.3)), ("skew_reverse_kl", dict(alpha=0.7)),
                                         ("skew_kl", dict(alpha=1.0, student_softcap=30.0, teacher_logit_scale=1.25)),
                                         ("skew_reverse_kl", dict(alpha=0.02, row_weight=True)),
                                         ("akl", dict(head_mass=0.8)), ("akl", dict(head_mass=0.2))])
def test_dense_logits_exact_at_trained_magnitudes(backend, loss, params, seed, kernel_calls):
    opts = dict(loss=loss, temperature=0.9, **params)
    if opts.pop("row_weight", False):
        opts["row_weight"] = torch.rand(N, generator=torch.Generator().manual_seed(seed))  # make_case's rows
    check_dense_exact(backend, seed, opts, logits=True)
    assert_ran(kernel_calls, backend, loss)


@pytest.mark.parametrize("loss,tail,clamp", [
    ("skew_kl", "bucket", None), ("skew_kl", "renormalize", None), ("skew_kl", "bucket", 1e-7),
    ("skew_reverse_kl", "bucket", None), ("skew_reverse_kl", "renormalize", None), ("skew_reverse_kl", "bucket", 1e-7),
    # not AKL with the plain bucket here: its reverse KL weighs q_rest · log(q_rest / p_rest) with p_rest = 1 − Σ p
    # over the ids, which fp32 log-probs of a peaked row round to 0 (an infinite loss, as reverse_kl's)
    ("akl", "renormalize", None), ("akl", "bucket", 1e-7)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_exact_at_trained_magnitudes(backend, loss, tail, clamp, seed):
    check_topk_exact(backend, seed, loss, tail, clamp, PARAMS[loss], drop_ties=True)


@pytest.mark.parametrize("form", ["heads", "topk"])
@pytest.mark.parametrize("skew,plain", [("skew_kl", "forward_kl"), ("skew_reverse_kl", "reverse_kl")])
def test_alpha_0_is_the_plain_kl_and_alpha_1_is_zero(form, skew, plain, seed):
    xs, ws, xt, wt, labels = small(seed)
    if form == "heads":
        fn, teacher = flashkd.fused_linear_distill, (xt, wt)
    else:
        fn, teacher = flashkd.fused_linear_distill_topk, flashkd.teacher_topk(xt, wt, 6, temperature=1.3)
    kw = dict(temperature=1.3, weight_hard_loss=0.0, weight_soft_loss=1.0)

    def run(**opts):
        x = xs.clone().requires_grad_()
        out = fn(x, ws, *teacher, labels, **kw, **opts)
        return out, torch.autograd.grad(out, x)[0]

    (a, da), (b, db) = run(loss=skew, alpha=0.0), run(loss=plain)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=0)
    torch.testing.assert_close(da, db, rtol=1e-10, atol=1e-14)
    zero, dzero = run(loss=skew, alpha=1.0)
    assert zero.item() == 0.0 and dzero.abs().max().item() <= 1e-15


@pytest.mark.parametrize("loss", ["skew_kl", "skew_reverse_kl"])
@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.5, 1.0])
def test_skew_gradients_are_the_tables(loss, alpha, seed):
    """The formula table's dL/da (what a kernel would write) against autograd of the oracle."""
    g = torch.Generator().manual_seed(seed)
    tau = 1.4
    a = (torch.randn(6, 40, generator=g, dtype=torch.float64) * 4).requires_grad_()
    b = torch.randn(6, 40, generator=g, dtype=torch.float64) * 4
    q, p = torch.softmax(a / tau, -1), torch.softmax(b / tau, -1)
    from oracle import _divergence

    (want,) = torch.autograd.grad(_divergence(q, p, loss, 0.5, alpha).sum(), a)
    q, p = q.detach(), p.detach()
    if loss == "skew_kl":
        m = alpha * p + (1 - alpha) * q
        r = q / m
        got = -(1 - alpha) * (p * r - q * (p * r).sum(-1, keepdim=True)) / tau
    else:
        m = (1 - alpha) * p + alpha * q
        gq = torch.log(q / m) + 1 - alpha * q / m
        got = q * (gq - (q * gq).sum(-1, keepdim=True)) / tau
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)


def test_akl_gradient_is_the_tables(seed):
    g = torch.Generator().manual_seed(seed)
    tau = 0.8
    a = (torch.randn(6, 40, generator=g, dtype=torch.float64) * 4).requires_grad_()
    b = torch.randn(6, 40, generator=g, dtype=torch.float64) * 4
    q, p = torch.softmax(a / tau, -1), torch.softmax(b / tau, -1)
    from oracle import _divergence

    (want,) = torch.autograd.grad(_divergence(q, p, "akl", 0.5, 0.1, 0.5).sum(), a)
    q, p = q.detach(), p.detach()
    sorted_p, order = p.sort(-1, descending=True)
    tail = sorted_p.cumsum(-1) > 0.5
    tail[:, 0] = False
    gap = (sorted_p - q.gather(-1, order)).abs()
    g_h, g_t = gap.masked_fill(tail, 0).sum(-1, keepdim=True), gap.masked_fill(~tail, 0).sum(-1, keepdim=True)
    w_h, w_t = g_h / (g_h + g_t), g_t / (g_h + g_t)
    rkl = (q * (q.log() - p.log())).sum(-1, keepdim=True)
    got = (w_h * (q - p) + w_t * q * (q.log() - p.log() - rkl)) / tau
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mu", [0.0, 0.05, 0.5, 0.9, 1.0])
def test_akl_head_is_the_sorted_prefix(dtype, mu, seed):
    """`akl_head` (bisection, no sort) gives the authors' head: p sorted descending (ties by id, a stable
    sort), cumsum ≤ μ, and the first always; with masked ids (p = 0), peaked and flat rows, and logits on
    bf16's grid, whose ties are common (a tied pair at the top of a row among them)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(40, 300, generator=g, dtype=torch.float64) * torch.rand(40, 1, generator=g, dtype=torch.float64) * 8
    z[::3, ::7] = -torch.inf
    z[1, 5] = 40.0  # one token holds nearly all the mass
    z[2] = 0.0  # flat
    z[3, 10] = z[3, 20] = z[3].max() + 1.0  # a tie for the top
    z[20:] = z[20:].to(torch.bfloat16).double()
    p = torch.softmax(z, -1).to(dtype)
    head = akl_head(p, mu, WHOLE_VOCAB)
    sorted_p, order = p.double().sort(dim=-1, descending=True, stable=True)
    tail = sorted_p.cumsum(-1) > mu
    tail[:, 0] = False
    want = torch.zeros_like(head).scatter(-1, order, ~tail)
    # an id whose cumulative sum is within rounding of μ may fall either side: compare the others
    tie = near(sorted_p.cumsum(-1), mu, rtol=0.0, atol=64 * torch.finfo(dtype).eps)
    sure = ~torch.zeros_like(head).scatter(-1, order, tie)
    assert (head == want)[sure].all()
    assert sure[:, :50].float().mean() > 0.5
    assert head.any(-1).all()
    if mu == 1.0:  # the whole row, also where Σ p rounds past 1
        assert head.all()


def test_akl_ties_are_ordered_by_id():
    """A flat teacher over 17 ids at μ = 0.5: the first 8 (8/17 ≤ 0.5 < 9/17) are the head; a tie for the
    top at μ below it: the lower id alone."""
    p = torch.full((1, 17), 1 / 17, dtype=torch.float64)
    assert akl_head(p, 0.5, WHOLE_VOCAB).nonzero()[:, 1].tolist() == list(range(8))
    p = torch.tensor([[0.1, 0.35, 0.1, 0.35, 0.1]], dtype=torch.float64)
    assert akl_head(p, 0.3, WHOLE_VOCAB).nonzero()[:, 1].tolist() == [1]
    assert akl_head(p, 0.7, WHOLE_VOCAB).nonzero()[:, 1].tolist() == [1, 3]
    assert akl_head(p, 0.8, WHOLE_VOCAB).nonzero()[:, 1].tolist() == [0, 1, 3]


def test_akl_is_zero_with_zero_gradient_where_p_is_q():
    """g_head + g_tail = 0: both weights ½, the loss 0 and its gradient 0 (no 0/0)."""
    b = torch.randn(3, 17, dtype=torch.float64)
    x = b.clone().requires_grad_()
    same = divergence(torch.log_softmax(x, -1), torch.log_softmax(b, -1), LossSpec(loss="akl"))
    assert same.abs().max().item() == 0.0
    assert torch.autograd.grad(same.sum(), x)[0].abs().max().item() == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss", NEW)
def test_every_option_against_the_oracle_in_float64(backend, loss, seed):
    """With α / μ away from their defaults (`check_every_option_in_float64` says which options)."""
    check_every_option_in_float64(backend, seed, loss, dict(head_mass=0.65) if loss == "akl" else dict(alpha=0.35))


@pytest.mark.parametrize("loss", NEW)
def test_masked_ids(loss, seed):
    """−inf teacher logits (ids the teacher rules out) and −inf student logits at other ids: finite where
    the formula is (skew at α > 0), against the oracle. AKL's reverse KL is infinite where the teacher
    rules out an id the student does not (as reverse_kl is), and its forward KL where the student rules out
    one the teacher does not: there both rule out the same ids."""
    xs, ws, xt, wt, labels = small(seed, v=31)
    tl = xt @ wt.T
    tl[:, 3] = -torch.inf
    tl[::2, 10:14] = -torch.inf
    bias = torch.zeros(ws.shape[0], dtype=torch.float64)
    bias[20] = -torch.inf  # the student rules an id out, everywhere
    if loss == "akl":
        tl[::2, 10:14] = 0.0
        tl[:, 20] = -torch.inf
        bias[3] = -torch.inf
    opts = dict(loss=loss, weight_hard_loss=0.0, weight_soft_loss=1.0,
                **(dict(head_mass=0.5) if loss == "akl" else dict(alpha=0.2)))
    check_masked_ids(xs, ws, tl, None, bias, opts)


READER = {"alpha": "skew_kl", "head_mass": "akl"}  # a loss that reads the parameter


@pytest.mark.parametrize("name,value", [("alpha", -0.1), ("alpha", 1.5), ("head_mass", -1e-9), ("head_mass", 2.0)])
def test_out_of_range_parameters_are_named(name, value):
    xs, ws, xt, wt, labels = small(0)
    with pytest.raises(ValueError, match=rf"^{name}: expected a value in \[0, 1\], got {value!r}"):
        flashkd.fused_linear_distill(xs, ws, xt, wt, labels, loss=READER[name], **{name: value})
    with pytest.raises(ValueError, match=rf"^{name}: expected a value in \[0, 1\], got {value!r}"):
        flashkd.FusedLinearDistillLoss(READER[name], **{name: value})


@pytest.mark.parametrize("name", ["alpha", "head_mass"])
@pytest.mark.parametrize("value", [math.nan, math.inf, "0.1", True])
def test_non_numbers_are_named(name, value):
    xs, ws, xt, wt, labels = small(0)
    with pytest.raises(TypeError, match=rf"^{name}: expected a finite Python float"):
        flashkd.fused_linear_distill(xs, ws, xt, wt, labels, loss=READER[name], **{name: value})


@pytest.mark.parametrize("name", ["alpha", "head_mass"])
def test_none_is_the_loss_default(name):
    """None, the keyword's default, is the loss's own default value (`flashkd.losses.PARAMETERS`)."""
    xs, ws, xt, wt, labels = small(0)
    run = lambda **o: flashkd.fused_linear_distill(xs, ws, xt, wt, labels, loss=READER[name], **o)
    want = run(**{name: parameter(name, READER[name]).default})
    assert torch.equal(run(**{name: None}), want) and torch.equal(run(), want)


@pytest.mark.parametrize("name,loss", [(name, loss) for name in ("alpha", "head_mass")
                                       for loss in ("jsd", "forward_kl", "tvd", "skew_kl", "akl")
                                       if parameter(name, loss) is None])
def test_a_parameter_the_loss_does_not_read_is_refused(name, loss):
    """A value for a loss that does not read it would change nothing: refused, naming the losses that do."""
    xs, ws, xt, wt, labels = small(0)
    readers = ", ".join(f"loss={r!r}" for param in PARAMETERS[name] for r in param.losses)
    said = f"{name}: loss={loss!r} does not read it (it is read by {readers}); got {name}=0.3, leave it out"
    for make in (lambda: flashkd.fused_linear_distill(xs, ws, xt, wt, labels, loss=loss, **{name: 0.3}),
                 lambda: flashkd.FusedLinearDistillLoss(loss, **{name: 0.3})):
        with pytest.raises(ValueError) as e:
            make()
        assert str(e.value) == said


@pytest.mark.parametrize("loss", NEW)
def test_triton_backend_runs_the_new_losses_in_its_kernel(loss, kernel_calls):
    """"triton" and "auto" (on a GPU) run skew KL and skew reverse KL (at every α) and AKL (at μ inside
    (0, 1) and at 1) in the dense row kernel, whose results agree with the torch rows' in fp32. fp64 inputs
    go to the torch rows whatever the loss."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # on a CPU, the interpreter (tests/conftest.py)
    xs, ws, xt, wt = (t.float().to(device) for t in small(3)[:4])
    labels = small(3)[4].to(device)
    grid = [dict(alpha=a) for a in (0.0, 0.1, 1.0)] if loss != "akl" else [dict(head_mass=m) for m in (0.3, 1.0)]
    for params in grid:
        for backend in ("triton", "auto") if device == "cuda" else ("triton",):
            del kernel_calls[:]
            a = flashkd.fused_linear_distill(xs, ws, xt, wt, labels, loss=loss, backend=backend, **params)
            b = flashkd.fused_linear_distill(xs, ws, xt, wt, labels, loss=loss, backend="torch", **params)
            assert_ran(kernel_calls, "triton", loss)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    del kernel_calls[:]
    flashkd.fused_linear_distill(*(t.double() for t in (xs, ws, xt, wt)), labels, loss=loss, backend="triton")
    assert kernel_calls == []


@pytest.mark.parametrize("skew,plain", [("skew_kl", "forward_kl"), ("skew_reverse_kl", "reverse_kl")])
def test_alpha_ends_in_the_kernel(skew, plain, seed, kernel_calls):
    """The Triton rows at α = 0 are the KL's (the same kernel: `triton_rows.kernel_kind`), at α = 1 zero: the
    loss and dX exactly 0 (no CE: weight_hard_loss 0), from fp32 inputs at trained magnitudes."""
    pytest.importorskip("triton")
    dev = device("triton")  # the GPU, or the CPU under the interpreter
    xs, ws, xt, wt, labels = ((t.float() if t.is_floating_point() else t).to(dev) for t in make_case(seed))
    kw = dict(temperature=1.3, weight_hard_loss=0.0, weight_soft_loss=1.0, backend="triton", chunk_size=16)

    def run(**opts):
        x = xs.clone().requires_grad_()
        out = flashkd.fused_linear_distill(x, ws, xt, wt, labels, **kw, **opts)
        return out, torch.autograd.grad(out, x)[0]

    (a, da), (b, db) = run(loss=skew, alpha=0.0), run(loss=plain)
    assert torch.equal(a, b) and torch.equal(da, db)
    zero, dzero = run(loss=skew, alpha=1.0)
    assert zero.item() == 0.0 and dzero.abs().max().item() == 0.0
    assert kernel_calls == [skew, skew, plain, plain, skew, skew], kernel_calls  # 2 chunks each


def _vocab_parallel_worker(rank, world, seed):
    """The three on a vocab split across ranks (uneven slices, not in rank order, a one-id slice at world
    3), fp64, against the unsharded call: AKL's head is found from the slices' merged sums and counts."""
    start, stop = LAYOUTS[world][rank]
    dev = rank_device()
    gen = torch.Generator().manual_seed(seed)  # the same inputs on every rank
    par = dict(process_group=torch.distributed.group.WORLD, vocab_start=start)
    for options in (dict(loss="akl"), dict(loss="akl", head_mass=0.2, temperature=0.6, chunk_size=4),
                    dict(loss="akl", head_mass=0.9, return_stats=True), dict(loss="skew_kl", alpha=0.3),
                    dict(loss="skew_reverse_kl", alpha=0.2, return_soft_hard_loss=True)):
        xs, ws, xt, wt, labels, bs, _ = sharded_inputs(gen, 11, torch.float64, dev, bias=True)
        xt = xt * 3.0  # peaked rows: a head of one id or a few
        xt[2] = 0.0  # a flat teacher: every id tied
        compare_forms_sharded(options, (xs, ws, xt, wt, labels, bs), start, stop, par)


@pytest.mark.parametrize("world", [2, 3])
def test_vocab_parallel_equals_unsharded(world, seed):
    spawn(_vocab_parallel_worker, world, seed)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ends_where_the_teacher_rules_ids_out(backend, dtype):
    """Teacher ids at −inf (a masked or cross-vocab teacher; a top-k teacher whose ids hold all its mass):
    skew KL at α = 1 is 0 with a zero gradient, AKL at μ = 1 is the forward KL (its reverse KL, infinite
    there, has weight 0), not NaN."""
    a = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, 0.0]], dtype=dtype)
    b = torch.tensor([[1.0, 0.0] + [-math.inf] * 4], dtype=dtype)
    eye = torch.eye(6, dtype=dtype)
    ids, lps = torch.tensor([[0, 1]]), torch.log(torch.tensor([[0.75, 0.25]], dtype=dtype))
    kw = dict(weight_hard_loss=0.0, weight_soft_loss=1.0, backend=backend)
    calls = [lambda x, **o: flashkd.fused_linear_distill_logits(x, eye, b, torch.tensor([0]), **o, **kw),
             lambda x, **o: flashkd.fused_linear_distill_topk(x, eye, ids, lps, torch.tensor([0]), **o, **kw)]
    for call in calls:
        x = a.clone().requires_grad_()
        skew = call(x, loss="skew_kl", alpha=1.0)
        skew.backward()
        assert skew.item() == 0.0 and (x.grad == 0).all()
        got, want = a.clone().requires_grad_(), a.clone().requires_grad_()
        akl, fkl = call(got, loss="akl", head_mass=1.0), call(want, loss="forward_kl")
        akl.backward(), fkl.backward()
        assert math.isfinite(akl.item()) and akl.item() == pytest.approx(fkl.item(), rel=1e-6)
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-7)
