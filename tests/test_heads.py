"""Each head's own logit transform (scale, softcap), per-row weights and the logged statistics, on every
loss and input form, both backends, against the float64 oracle. The Triton backend on DEVICE (the GPU, or the
CPU under Triton's interpreter), the torch backend and the oracle on the CPU."""

import dataclasses
import itertools
import math

import pytest
import torch

import flashkd
from conftest import BACKEND_PARAMS, _device, _on
from helpers.cases import V, check_against_oracle, make_inputs, make_topk, read, rel_err
from helpers.ties import drop_tied_rows, logits64
from oracle import distill_loss, student_stats, topk_loss

# (student σ, student c, teacher σ, teacher c): scales alone, caps alone, both, negative scales, and a
# cap that the logits (|x| up to ~10 here) pass by far
TRANSFORMS = [
    (1.7, None, 0.6, None),
    (1.0, 3.0, 1.0, 2.0),
    (1.3, 2.5, -0.7, 4.0),
    (-0.8, None, -1.2, 1.5),
    (-1.4, 0.3, 2.0, 0.25),
]
LOSSES = ["jsd", "forward_kl", "reverse_kl", "tvd", "cosine"]

TOPK_LOSSES = LOSSES[:4]


def _tolerance(backend):
    # the torch backend in float64: exact up to rounding; the kernel computes in fp32 whatever the input
    return (torch.float64, 1e-9) if backend == "torch" else (torch.float32, 3e-5)


def _weights(lead, dtype):
    """Row weights of every sign and size, one row's weight 0; in another float dtype than the inputs."""
    w = torch.rand(lead, dtype=torch.float64) * 2.0
    w.view(-1)[1] = 0.0
    w.view(-1)[-1] = -0.5
    return w.to(torch.float32 if dtype == torch.float64 else torch.float64)




def _run_dense(backend, form, loss, transform, weighted, lead, *, ignore="some", temperature=0.8, scale_x=1.0,
               stats=False, **extra):
    dtype, tol = _tolerance(backend)
    xs, ws, xt, wt, labels, bs, _ = make_inputs(lead, dtype, ignore=ignore, bias=True)
    with torch.no_grad():
        xs.mul_(scale_x)
    s_scale, s_cap, t_scale, t_cap = transform
    options = dict(loss=loss, beta=0.35, temperature=temperature, weight_hard_loss=0.3, weight_soft_loss=0.9,
                   student_logit_scale=s_scale, student_softcap=s_cap, teacher_logit_scale=t_scale,
                   teacher_softcap=t_cap, **extra)
    labels = drop_tied_rows(labels, logits64(xs, ws, bs), logits64(xt, wt), **options)
    rw = _weights(lead, dtype) if weighted else None
    dev = _device(backend)
    xs_, ws_, bs_, xt_, wt_, labels_, rw_ = _on(dev, xs, ws, bs, xt, wt, labels, rw)
    common = dict(student_bias=bs_, backend=backend, chunk_size=5, return_soft_hard_loss=True, row_weight=rw_,
                  return_stats=stats, **read(options))
    if form == "heads":
        out = flashkd.fused_linear_distill(xs_, ws_, xt_, wt_, labels_, **common)
        teacher = dict(xt=xt, wt=wt)
    else:
        logits_t = (xt @ wt.T).detach()
        out = flashkd.fused_linear_distill_logits(xs_, ws_, logits_t.to(dev), labels_, **common)
        teacher = dict(xt=None, wt=None, teacher_logits=logits_t)
    leaves = [xs, ws, bs]
    grads = [g.cpu() for g in torch.autograd.grad(out[0], [xs_, ws_, bs_])]
    ref_leaves = [x.detach().double().requires_grad_() for x in leaves]
    ref = distill_loss(ref_leaves[0], ref_leaves[1], teacher.pop("xt"), teacher.pop("wt"), labels,
                       student_bias=ref_leaves[2], row_weight=rw, **teacher, **options)
    ref_grads = torch.autograd.grad(ref[0], ref_leaves)
    check_against_oracle(out, ref, grads, ref_grads, leaves, tol, labels)
    return out, ref, (xs, ws, bs, labels, rw, options, tol)


# every loss with every transform, cycling the form, row weights and the shape
DENSE_GRID = [
    (loss, i, form, weighted, lead)
    for (loss, i), (form, weighted, lead) in zip(
        itertools.product(LOSSES, range(len(TRANSFORMS))),
        itertools.cycle(itertools.product(["heads", "logits"], [True, False], [(23,), (3, 7)])),
    )
]


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("loss,i,form,weighted,lead", DENSE_GRID)
def test_dense_transforms_match_oracle(backend, loss, i, form, weighted, lead, seed):
    _run_dense(backend, form, loss, TRANSFORMS[i], weighted, lead)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("temperature", [1.0, 2.3])
def test_dense_row_weight_alone(backend, loss, temperature, seed):
    """Row weights without transforms, τ = 1 (the kernel's CE shares q's statistics) and not."""
    _run_dense(backend, "heads", loss, (1.0, None, 1.0, None), True, (17,), temperature=temperature,
               reduction=["mean", "sum"][loss == "tvd"])


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("loss", LOSSES)
def test_saturated_softcap(backend, loss, seed):
    """Logits far past the caps (|x| ~ 1000 against c = 2 and 5): the tanh saturates, its derivative
    underflows to 0 for most entries; loss and gradients stay finite and exact."""
    _, ref, _ = _run_dense(backend, "heads", loss, (1.0, 2.0, 3.0, 5.0), True, (19,), scale_x=100.0)
    assert math.isfinite(ref[0].item())


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("loss", ["forward_kl", "jsd", "tvd"])
@pytest.mark.parametrize("t_scale,t_cap", [(1.0, 4.0), (-2.0, None), (-0.5, 3.0)])
def test_masked_teacher_ids_stay_masked_under_every_transform(backend, loss, t_scale, t_cap, seed):
    """Dense teacher logits with −inf at masked ids: under a softcap (−c otherwise: an id with mass) or
    a negative scale (+inf otherwise) they stay −inf, on both backends, as the oracle defines it."""
    dtype, tol = _tolerance(backend)
    xs, ws, xt, wt, labels, bs, _ = make_inputs((21,), dtype, ignore="some", bias=True)
    logits_t = (xt @ wt.T).detach()
    logits_t[:, ::3] = -math.inf
    options = dict(loss=loss, beta=0.4, temperature=0.9, teacher_logit_scale=t_scale, teacher_softcap=t_cap,
                   student_softcap=6.0)
    labels = drop_tied_rows(labels, logits64(xs, ws, bs), logits_t, **options)
    xs_, ws_, bs_, logits_t_, labels_ = _on(_device(backend), xs, ws, bs, logits_t, labels)
    out = flashkd.fused_linear_distill_logits(xs_, ws_, logits_t_, labels_, student_bias=bs_, backend=backend,
                                              chunk_size=4, return_soft_hard_loss=True, **read(options))
    grads = [g.cpu() for g in torch.autograd.grad(out[0], [xs_, ws_, bs_])]
    leaves = [x.detach().double().requires_grad_() for x in (xs, ws, bs)]
    ref = distill_loss(leaves[0], leaves[1], None, None, labels, student_bias=leaves[2], teacher_logits=logits_t,
                       **options)
    assert math.isfinite(ref[0].item())
    check_against_oracle(out, ref, grads, torch.autograd.grad(ref[0], leaves), [xs, ws, bs], tol, labels)


def _topk_case(backend, loss, tail, transform, weighted, lead, *, temperature=0.7, stats=False, scale_x=1.0,
               ignore="some", dtype=None, **extra):
    """One top-k call and the oracle's: (out, grads, ref, ref_grads, leaves, context)."""
    dtype = dtype or _tolerance(backend)[0]
    xs, ws, _, _, labels, bs, _ = make_inputs(lead, dtype, ignore=ignore, bias=True)
    with torch.no_grad():
        xs.mul_(scale_x)
    ids, logprobs = make_topk(lead, temperature=temperature)
    rw = _weights(lead, dtype) if weighted else None
    options = dict(loss=loss, tail=tail, beta=0.35, temperature=temperature, weight_hard_loss=0.4,
                   weight_soft_loss=0.7, student_logit_scale=transform[0], student_softcap=transform[1], **extra)
    labels = drop_tied_rows(labels, logits64(xs, ws, bs), ids=ids, logprobs=logprobs.to(dtype), **options)
    xs_, ws_, bs_, ids_, logprobs_, labels_, rw_ = _on(_device(backend), xs, ws, bs, ids, logprobs.to(dtype), labels,
                                                       rw)
    out = flashkd.fused_linear_distill_topk(xs_, ws_, ids_, logprobs_, labels_, student_bias=bs_, chunk_size=5,
                                            backend=backend, return_soft_hard_loss=True, row_weight=rw_,
                                            return_stats=stats, **read(options, "forward_kl"))
    leaves = [xs, ws, bs]
    grads = [g.cpu() for g in torch.autograd.grad(out[0], [xs_, ws_, bs_])]
    ref_leaves = [x.detach().double().requires_grad_() for x in leaves]
    ref = topk_loss(ref_leaves[0], ref_leaves[1], ids, logprobs.to(dtype), labels, student_bias=ref_leaves[2],
                    row_weight=rw, **options)
    ref_grads = torch.autograd.grad(ref[0], ref_leaves)
    return out, grads, ref, ref_grads, leaves, (xs, ws, bs, labels, ids, rw, options)


def _run_topk(backend, loss, tail, transform, weighted, lead, *, tol=None, **kw):
    out, grads, ref, ref_grads, leaves, context = _topk_case(backend, loss, tail, transform, weighted, lead, **kw)
    tol = tol or _tolerance(backend)[1]
    check_against_oracle(out, ref, grads, ref_grads, leaves, tol, context[3])
    return out, (*context, tol)


TOPK_GRID = [
    (loss, tail, i, weighted)
    for (loss, tail), (i, weighted) in zip(
        itertools.product(TOPK_LOSSES, ["bucket", "renormalize"]),
        itertools.cycle(itertools.product(range(len(TRANSFORMS)), [True, False])),
    )
]


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("loss,tail,i,weighted", TOPK_GRID)
def test_topk_transforms_match_oracle(backend, loss, tail, i, weighted, seed):
    _run_topk(backend, loss, tail, TRANSFORMS[i], weighted, [(23,), (3, 7)][i % 2])


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("tail", ["bucket", "renormalize"])
def test_topk_saturated_softcap_and_row_weight(backend, tail, seed):
    case = ("jsd", tail, (1.5, 2.0), True, (19,))
    kw = dict(scale_x=100.0, temperature=1.0)
    tol = None
    if backend == "triton":
        # Logits 100x past the cap: in fp32, σ·s loses digits before the tanh and the few unsaturated
        # elements carry the gradient, so fp32 itself is off the float64 oracle by up to ~2e-4 on some
        # draws (plain torch as much as the kernel). The kernel is held to twice plain torch's fp32 error
        # on the same inputs, and never looser than the fixed fp32 bound.
        torch.manual_seed(seed)
        out, grads, ref, ref_grads, _, _ = _topk_case("torch", *case, dtype=torch.float32, **kw)
        base = max([rel_err(g, r) for g, r in zip(grads, ref_grads)] +
                   [abs(a.item() - b.item()) / max(abs(b.item()), 1.0) for a, b in zip(out, ref)])
        tol = max(_tolerance("triton")[1], 2 * base)
        torch.manual_seed(seed)
    _run_topk(backend, *case, tol=tol, **kw)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("form", ["heads", "logits", "topk"])
def test_unit_weights_and_default_transforms_change_nothing(backend, form, seed):
    """Weights of 1 everywhere, σ = 1 and no caps give the plain call's results exactly."""
    dev = _device(backend)
    xs, ws, xt, wt, labels, _, _ = make_inputs((13,), torch.float32)
    xs, ws, xt, wt, labels = _on(dev, xs, ws, xt, wt, labels)
    if form == "topk":
        ids, logprobs = _on(dev, *make_topk((13,)))
        call = lambda **o: flashkd.fused_linear_distill_topk(xs, ws, ids, logprobs, labels, backend=backend,
                                                             weight_hard_loss=0.5, **o)
        transform = dict(student_logit_scale=1.0, student_softcap=None)
    else:
        teacher = (xt, wt) if form == "heads" else ((xt @ wt.T),)
        run = flashkd.fused_linear_distill if form == "heads" else flashkd.fused_linear_distill_logits
        call = lambda **o: run(xs, ws, *teacher, labels, backend=backend, **o)
        transform = dict(student_logit_scale=1.0, teacher_logit_scale=1.0, student_softcap=None, teacher_softcap=None)
    plain = call()
    weighted = call(row_weight=torch.ones(13, dtype=torch.float16, device=dev), **transform)
    assert torch.equal(plain, weighted)
    (g1,) = torch.autograd.grad(plain, [xs])
    (g2,) = torch.autograd.grad(weighted, [xs])
    assert torch.equal(g1, g2)


# ------------------------------------------------------------------------------------------------ stats


def _check_stats(out, xs, ws, bs, labels, rw, options, tol, ids=None):
    loss, soft, hard, stats = out
    assert isinstance(stats, flashkd.DistillStats)
    assert all(not x.requires_grad for x in stats if x is not None)
    temperature = options["temperature"]
    entropy, rows, mass = student_stats(xs, ws, labels, ids, temperature=temperature, student_bias=bs,
                                        student_logit_scale=options["student_logit_scale"],
                                        student_softcap=options["student_softcap"])
    assert stats.rows.item() == rows and stats.rows.dtype == torch.int64
    assert abs(stats.entropy_sum.item() - entropy.item()) <= tol * max(entropy.item(), 1.0)
    if ids is None:
        assert stats.topk_mass_sum is None
    else:
        assert abs(stats.topk_mass_sum.item() - mass.item()) <= tol * max(mass.item(), 1.0)
    # the sums are the loss before its reduction and weights: soft and hard times max(rows, 1)
    count = max(rows, 1) if options.get("reduction", "mean") == "mean" else 1
    tau2 = temperature**2 if options.get("temperature_squared") else 1.0
    for got, want in ((stats.soft_sum * tau2, soft * count), (stats.hard_sum, hard * count)):
        assert abs(got.item() - want.item()) <= tol * max(abs(want.item()), 1.0)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("loss", LOSSES)
def test_stats_dense(backend, loss, seed):
    i = LOSSES.index(loss)
    form = ["heads", "logits"][i % 2]
    out, _, (xs, ws, bs, labels, rw, options, tol) = _run_dense(
        backend, form, loss, TRANSFORMS[i], i % 2 == 0, (3, 7), stats=True, temperature=[1.0, 0.8][i % 2],
        ignore=["some", "all", "none"][i % 3], temperature_squared=i == 3,
    )
    _check_stats(out, xs.detach(), ws.detach(), bs.detach(), labels, rw, options, tol)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("tail", ["bucket", "renormalize"])
@pytest.mark.parametrize("loss", ["forward_kl", "tvd"])
def test_stats_topk(backend, tail, loss, seed):
    out, (xs, ws, bs, labels, ids, rw, options, tol) = _run_topk(
        backend, loss, tail, TRANSFORMS[2 if tail == "bucket" else 3], tail == "bucket", (3, 7), stats=True,
        temperature=1.0 if loss == "tvd" else 1.4, reduction="sum" if loss == "tvd" else "mean",
    )
    _check_stats(out, xs.detach(), ws.detach(), bs.detach(), labels, rw, options, tol, ids=ids)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_stats_without_labels_and_return_orders(backend, seed):
    """Without labels every row counts and hard_sum is 0; stats come last, after (soft, hard) if asked;
    under no_grad too; and with a zero soft weight the soft sum is still computed."""
    xs_cpu, ws_cpu, xt, wt, _, _, _ = make_inputs((6,), torch.float32)
    xs, ws, xt, wt = _on(_device(backend), xs_cpu, ws_cpu, xt, wt)
    run = lambda **o: flashkd.fused_linear_distill(xs, ws, xt, wt, weight_hard_loss=0.0, backend=backend, **o)
    loss, stats = run(return_stats=True)
    assert stats.rows.item() == 6 and stats.hard_sum.item() == 0.0
    assert torch.allclose(loss, 0.5 * stats.soft_sum / 6)
    loss2, soft, hard, stats2 = run(return_stats=True, return_soft_hard_loss=True)
    assert torch.equal(loss, loss2) and torch.equal(stats.entropy_sum, stats2.entropy_sum)
    with torch.no_grad():
        loss3, stats3 = run(return_stats=True, weight_soft_loss=0.0)
    assert loss3.item() == 0.0 and torch.allclose(stats3.soft_sum, stats.soft_sum)
    entropy, _, _ = student_stats(xs_cpu.detach(), ws_cpu.detach())
    assert abs(stats.entropy_sum.item() - entropy.item()) <= 3e-5 * entropy.item()


# ----------------------------------------------------------------------------------------- teacher_topk


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("scale,cap", [(1.8, None), (-1.0, None), (0.9, 1.5), (-2.0, 3.0)])
def test_teacher_topk_transforms(backend, scale, cap, seed):
    """The ids of the k largest transformed logits (a negative scale reverses the order) and their
    log-probs under the transform; with a saturating cap, ties are broken either way."""
    x = 3.0 * torch.randn(5, 7, 6)
    w = torch.randn(V, 6)
    x_, w_ = _on(_device(backend), x, w)
    ids, logprobs = (t.cpu() for t in flashkd.teacher_topk(x_, w_, 5, temperature=0.8, teacher_logit_scale=scale,
                                                           teacher_softcap=cap, chunk_size=8, backend=backend))
    # the fp32 GEMM's logits (on the call's device): the error judged is the loss math's
    z = (x_ @ w_.T).double().cpu() * scale
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    ref = torch.log_softmax(z / 0.8, -1)
    tol = 4 * torch.finfo(torch.float32).eps * max(1.0, (z / 0.8).abs().max().item())
    chosen = ref.gather(-1, ids)
    others = ref.scatter(-1, ids, -math.inf)
    assert (chosen.min(-1).values >= others.max(-1).values - tol).all()
    assert (logprobs.double() - chosen).abs().max() < tol
    assert (logprobs[..., :-1] >= logprobs[..., 1:]).all()


# ------------------------------------------------------------------------------------------- bad input


def test_bad_transforms_and_weights_are_named():
    xs, ws, xt, wt, labels, _, _ = make_inputs((4,), torch.float32)
    cases = [
        (dict(student_logit_scale=0.0), ValueError, ["student_logit_scale", "non-zero", "0.0"]),
        (dict(teacher_logit_scale=math.inf), ValueError, ["teacher_logit_scale", "finite", "inf"]),
        (dict(student_logit_scale=math.nan), ValueError, ["student_logit_scale", "nan"]),
        (dict(teacher_logit_scale=torch.tensor(2.0)), TypeError, ["teacher_logit_scale", "Python float"]),
        (dict(student_logit_scale=True), TypeError, ["student_logit_scale", "True"]),
        (dict(student_softcap=0.0), ValueError, ["student_softcap", "> 0", "0.0"]),
        (dict(teacher_softcap=-30.0), ValueError, ["teacher_softcap", "-30.0"]),
        (dict(teacher_softcap=math.inf), ValueError, ["teacher_softcap", "inf"]),
        (dict(student_softcap="30"), TypeError, ["student_softcap", "'30'"]),
        (dict(row_weight=torch.ones(5)), ValueError, ["row_weight", "(4,)", "(5,)"]),
        (dict(row_weight=torch.ones(4, 1)), ValueError, ["row_weight", "(4,)", "(4, 1)"]),
        (dict(row_weight=torch.ones(4, dtype=torch.long)), TypeError, ["row_weight", "floating", "int64"]),
        (dict(row_weight=torch.ones(4, requires_grad=True)), TypeError, ["row_weight", "requires_grad", "detach"]),
        (dict(row_weight=torch.tensor([1.0, math.nan, 1.0, 1.0])), ValueError, ["row_weight", "finite", "nan", "row 1"]),
        (dict(row_weight=torch.ones(4, device="meta")), ValueError, ["row_weight", "cpu", "meta"]),
        (dict(row_weight=[1.0] * 4), TypeError, ["row_weight", "torch.Tensor", "list"]),
        (dict(return_stats=1), TypeError, ["return_stats", "bool"]),
    ]
    for change, error, words in cases:
        with pytest.raises(error) as info:
            flashkd.fused_linear_distill(xs, ws, xt, wt, labels, **change)
        for word in words:
            assert word in str(info.value), (change, str(info.value))
    ids, logprobs = make_topk((4,))
    with pytest.raises(TypeError, match="teacher_softcap"):  # a top-k teacher's log-probs are final
        flashkd.fused_linear_distill_topk(xs, ws, ids, logprobs, labels, teacher_softcap=30.0)
    with pytest.raises(ValueError, match="student_softcap: expected a finite float > 0"):
        flashkd.fused_linear_distill_topk(xs, ws, ids, logprobs, labels, student_softcap=-1.0)
    with pytest.raises(ValueError, match="teacher_logit_scale: expected a finite non-zero float"):
        flashkd.teacher_topk(xt, wt, 3, teacher_logit_scale=0.0)
    with pytest.raises(ValueError, match="teacher_softcap"):
        flashkd.teacher_topk(xt, wt, 3, teacher_softcap=math.nan)


def test_modules_pass_the_options_through():
    xs, ws, xt, wt, labels, _, _ = make_inputs((5,), torch.float32)
    options = dict(student_logit_scale=0.5, teacher_softcap=3.0, student_softcap=2.0, return_stats=True)
    got = flashkd.FusedLinearDistillLoss("tvd", **options)(xs, ws, xt, wt, labels)
    want = flashkd.fused_linear_distill(xs, ws, xt, wt, labels, loss="tvd", **options)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1].entropy_sum, want[1].entropy_sum)


# ------------------------------------------------------------------------------------------ bench flag


def test_bench_softcap_on_every_form():
    """`flashkd bench --softcap C` reaches every form's providers and the reference: each passes the gate,
    and flashkd without the cap fails it (C small enough to matter at these logits)."""
    from flashkd.bench import cli, measure
    from flashkd.bench.providers import PROVIDERS, Provider

    args = cli.parse_bench(["--preset", "small", "--softcap", "0.05", "--h", "12", "--v", "37"])
    workloads = cli.plan(args).workloads
    assert {w.softcap for w in workloads} == {0.05} and {w.form for w in workloads} == {"heads", "topk", "logits"}
    fast = measure.Settings(torch.device("cpu"), rep_ms=1.0, warmup_ms=0.0, min_reps=1)
    uncapped = Provider(lambda w, x: PROVIDERS["flashkd"].make(dataclasses.replace(w, softcap=None), x), lambda: "0")
    cases = [workloads[0], next(w for w in workloads if w.form == "topk"),
             dataclasses.replace(workloads[0], n=11, form="teacher_topk", k=5).canonical()]
    for w in cases:
        PROVIDERS["uncapped"] = uncapped
        try:
            results = measure.run([dataclasses.replace(w, n=11)], ["flashkd", "torch", "uncapped"],
                                  ["no-grad-forward"], fast)
        finally:
            del PROVIDERS["uncapped"]
        status = {r.provider: r.check.status for r in results}
        assert status == {"flashkd": "passed", "torch": "passed", "uncapped": "FAILED"}, (w.form, status)
        assert w.config()["softcap"] == 0.05
    with pytest.raises(SystemExit, match="softcap"):
        cli.plan(cli.parse_bench(["--softcap", "-1"]))
