"""A teacher that learns: loss="mutual" and loss="co_jeffreys" give the teacher's hidden states, head and bias
their gradients from the same pass as the student's; every other loss keeps the teacher a constant.

The oracle below is the naive formula over the full logits in float64 with torch autograd, written from
the definitions (orda-kernel's "mutual" and "cojeffreys"), sharing no code with flashkd.losses:
    value (both)   J = KL(p‖q) + KL(q‖p),  KL(a‖b) = Σ a (log a − log b)
    mutual         KL(p̄‖q) + KL(q̄‖p), a bar detached: each side learns toward the other's distribution
    co_jeffreys    J, both sides differentiated
with q = softmax(student logits / τ), p = softmax(teacher logits / τ).

The Triton backend runs on DEVICE (the GPU, or the CPU under Triton's interpreter), the torch backend and the
oracle on the CPU, unless a test compares the two backends bit for bit (then both on DEVICE).
"""

import pytest
import torch
import torch.nn.functional as F

import flashkd
from conftest import BACKEND_PARAMS, DEVICE, _device, needs_triton
from flashkd.losses import LEARNING_LOSSES, LOSSES

N, V, HS, HT, CHUNK = 19, 37, 11, 6, 5
IGNORED = (2, 11, 12)  # rows whose label is ignore_index; they hold NaN in the inputs


def _to(x, device):
    """x (a tensor, or None) on device."""
    return None if x is None else x.to(device)


def _cpu(grads):
    """grads_of's gradients on the CPU."""
    return {k: None if g is None else g.cpu() for k, g in grads.items()}


def _kl(a, log_a, log_b):
    return (torch.xlogy(a, a) - a * log_b).sum(-1) if log_a is None else (a * (log_a - log_b)).sum(-1)


def oracle(xs, ws, xt, wt, labels=None, *, loss, bs=None, bt=None, temperature=1.0, weight_hard_loss=0.5,
           weight_soft_loss=0.5, ignore_index=-100, reduction="mean", temperature_squared=False, row_weight=None,
           vocab_size=None):
    """The loss of the full logits in float64, differentiable w.r.t. every tensor as the loss defines."""
    up = lambda x: None if x is None else x.double()  # noqa: E731
    xs, ws, bs, xt, wt, bt = map(up, (xs, ws, bs, xt, wt, bt))
    v = ws.shape[0]
    xs, xt = xs.reshape(-1, xs.shape[-1]), xt.reshape(-1, xt.shape[-1])
    keep = torch.ones(xs.shape[0], dtype=torch.bool) if labels is None else labels.reshape(-1) != ignore_index
    rows = keep.nonzero()[:, 0]  # ignored rows never enter the math (their NaN included)
    s = xs[rows] @ ws.T + (0 if bs is None else bs)
    t = xt[rows] @ wt[:v].T + (0 if bt is None else bt[:v])
    if loss not in LEARNING_LOSSES:
        t = t.detach()  # every other loss: the teacher is a constant
    log_q, log_p = F.log_softmax(s / temperature, -1), F.log_softmax(t / temperature, -1)
    q, p = log_q.exp(), log_p.exp()
    if loss == "mutual":
        soft = _kl(p.detach(), log_p.detach(), log_q) + _kl(q.detach(), log_q.detach(), log_p)
    elif loss in ("co_jeffreys", "jeffreys"):
        soft = _kl(p, log_p, log_q) + _kl(q, log_q, log_p)
    elif loss == "jsd":  # β = 0.5
        log_m = torch.log(0.5 * (p + q))
        soft = 0.5 * _kl(p, log_p, log_m) + 0.5 * _kl(q, log_q, log_m)
    else:
        raise ValueError(loss)
    if temperature_squared:
        soft = soft * temperature**2
    hard = s.new_zeros(len(rows)) if labels is None else F.cross_entropy(s, labels.reshape(-1)[rows], reduction="none")
    if row_weight is not None:
        w = row_weight.reshape(-1)[rows].double()
        soft, hard = soft * w, hard * w
    total = weight_hard_loss * hard.sum() + weight_soft_loss * soft.sum()
    return total / max(len(rows), 1) if reduction == "mean" else total


def make(seed, dtype=torch.float64, vt=V, bias=False, ht=HT):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    xs, ws, xt, wt = r(N, HS), r(V, HS) / 2, r(N, ht), r(vt, ht) / 2
    labels = torch.randint(0, V, (N,), generator=g)
    labels[list(IGNORED)] = -100
    xs[IGNORED[0]], xt[IGNORED[1]] = torch.nan, torch.inf  # padding: whatever it holds, it adds nothing
    bs, bt = (r(V), r(vt)) if bias else (None, None)
    return dict(xs=xs, ws=ws, bs=bs, xt=xt, wt=wt, bt=bt), labels


LEAVES = ("xs", "ws", "bs", "xt", "wt", "bt")


def leaves(tensors, device="cpu"):
    return {k: None if x is None else x.to(device).clone().requires_grad_() for k, x in tensors.items()}


def run_flashkd(t, labels, **opts):
    return flashkd.fused_linear_distill(t["xs"], t["ws"], t["xt"], t["wt"], labels, student_bias=t["bs"],
                                        teacher_bias=t["bt"], chunk_size=CHUNK, **opts)


def run_oracle(t, labels, **opts):
    opts.pop("backend", None)
    return oracle(t["xs"], t["ws"], t["xt"], t["wt"], labels, bs=t["bs"], bt=t["bt"], **opts)


def grads_of(out, t):
    names = [k for k in LEAVES if t[k] is not None and t[k].requires_grad]
    return dict(zip(names, torch.autograd.grad(out, [t[k] for k in names], allow_unused=True)))


OPTIONS = {
    "plain": {},
    "tau": dict(temperature=1.7, temperature_squared=True),
    "row_weight": dict(row_weight="draw"),
    "sum": dict(reduction="sum", weight_hard_loss=0.3, weight_soft_loss=1.2),
    "soft_only": dict(weight_hard_loss=0.0, weight_soft_loss=1.0, labels=None),
    "bias": dict(bias=True, temperature=0.8),
    "padded": dict(vt=V + 4, vocab_size=V, bias=True),
    "no_soft": dict(weight_soft_loss=0.0),  # the teacher's gradient is 0 there
}


def case(seed, option, dtype=torch.float64):
    opts = dict(OPTIONS[option])
    tensors, labels = make(seed, dtype, vt=opts.pop("vt", V), bias=opts.pop("bias", False))
    if "labels" in opts:
        labels = opts.pop("labels")
        for k in ("xs", "xt"):  # every row counts: no NaN padding
            tensors[k] = torch.nan_to_num(tensors[k], nan=0.5, posinf=0.5)
    if opts.get("row_weight") == "draw":
        opts["row_weight"] = torch.rand(N, generator=torch.Generator().manual_seed(seed + 1), dtype=dtype) * 2 - 0.5
    return tensors, labels, opts


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("loss", LEARNING_LOSSES)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_value_and_all_six_gradients(loss, option, backend, seed):
    tensors, labels, opts = case(seed, option)
    dev = _device(backend)
    mine, ref = leaves(tensors, dev), leaves(tensors)
    out = run_flashkd(mine, _to(labels, dev), loss=loss, backend=backend,
                      **{k: v.to(dev) if torch.is_tensor(v) else v for k, v in opts.items()})
    want = run_oracle(ref, labels, loss=loss, **opts)
    torch.testing.assert_close(out.cpu(), want)
    got, truth = _cpu(grads_of(out, mine)), grads_of(want, ref)
    assert set(got) == set(truth) and {"xt", "wt"} <= set(got)
    for name in got:
        assert got[name] is not None, name
        torch.testing.assert_close(got[name], truth[name], msg=lambda m: f"d{name}: {m}")
    if option == "no_soft":
        assert all(not got[k].any() for k in ("xt", "wt", "bt") if k in got)
    else:
        assert got["xt"].abs().sum() > 0 and got["wt"].abs().sum() > 0
    if labels is not None:
        assert not got["xt"][list(IGNORED)].any()  # ignored rows: zero, their NaN kept out


@pytest.mark.parametrize("loss", LEARNING_LOSSES)
def test_mutual_and_co_jeffreys_differ_in_gradients_only(loss, seed):
    """Both report Jeffreys' value; mutual's student gradient is forward KL's, its teacher's the
    KL toward the student's (detached); co_jeffreys' student gradient is jeffreys'."""
    tensors, labels, _ = case(seed, "plain")
    runs = {}
    for name in ("jeffreys", "forward_kl", loss):
        t = leaves(tensors)
        out = run_flashkd(t, labels, loss=name)
        runs[name] = out.detach(), grads_of(out, t)
    torch.testing.assert_close(runs[loss][0], runs["jeffreys"][0])
    like = "forward_kl" if loss == "mutual" else "jeffreys"
    for k in ("xs", "ws"):
        torch.testing.assert_close(runs[loss][1][k], runs[like][1][k])
    other = "jeffreys" if loss == "mutual" else "forward_kl"
    assert not torch.allclose(runs[loss][1]["xs"], runs[other][1]["xs"])


@pytest.mark.parametrize("loss", LEARNING_LOSSES)
@pytest.mark.parametrize("option", list(OPTIONS))
@needs_triton
def test_float32_in_the_row_kernel(loss, option, seed, monkeypatch):
    """fp32 inputs on the triton backend: the row kernel writes the learning teacher's dL/dt beside dL/ds
    (each block's call asks it for the teacher's gradient); the value and all six gradients within fp32
    rounding of the float64 oracle (2e-6 of each gradient's largest element), ignored rows' zero."""
    from flashkd.backends import triton_rows

    calls = []
    kernel = triton_rows.rows

    def spy(*args, **kwargs):
        calls.append(kwargs.get("teacher_grad", False))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(triton_rows, "rows", spy)
    tensors, labels, opts = case(seed, option, torch.float32)
    mine = leaves(tensors, DEVICE)
    out = run_flashkd(mine, _to(labels, DEVICE), loss=loss, backend="triton",
                      **{k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in opts.items()})
    learns = OPTIONS[option].get("weight_soft_loss", 0.5) != 0.0
    assert calls and set(calls) == {learns}
    ref = leaves({k: None if x is None else x.double() for k, x in tensors.items()})
    want = run_oracle(ref, labels, loss=loss, **{k: v.double() if torch.is_tensor(v) else v for k, v in opts.items()})
    torch.testing.assert_close(out.double().cpu(), want, rtol=2e-6, atol=1e-7)
    got, truth = _cpu(grads_of(out, mine)), grads_of(want, ref)
    assert {"xt", "wt"} <= set(got)
    for name in got:
        scale = truth[name].abs().max().item()
        torch.testing.assert_close(got[name].double(), truth[name], rtol=0, atol=2e-6 * scale + 1e-12,
                                   msg=lambda m: f"d{name}: {m}")
    if labels is not None:
        assert not got["xt"][list(IGNORED)].any()  # ignored rows: zero, their NaN kept out


@pytest.mark.parametrize("loss", LEARNING_LOSSES)
@needs_triton
def test_float32_kernel_with_head_transforms(loss, seed):
    """Both heads' logit scales and softcaps (the teacher's own scale, a cap on each side): the kernel's dL/dt
    through the teacher's transform (σ_t in its factor, 1 − tanh² where it is written) equals the torch
    backend's float64 autograd of the definition to fp32 rounding, on all six tensors."""
    tensors, labels, _ = case(seed, "bias", torch.float32)
    opts = dict(temperature=0.9, student_logit_scale=1.2, teacher_logit_scale=0.7, student_softcap=8.0,
                teacher_softcap=6.0)
    mine = leaves(tensors, DEVICE)
    out = run_flashkd(mine, _to(labels, DEVICE), loss=loss, backend="triton", **opts)
    ref = leaves({k: None if x is None else x.double() for k, x in tensors.items()})
    want = run_flashkd(ref, labels, loss=loss, backend="torch", **opts)
    torch.testing.assert_close(out.double().cpu(), want, rtol=2e-6, atol=1e-7)
    got, truth = _cpu(grads_of(out, mine)), grads_of(want, ref)
    for name in got:
        scale = truth[name].abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(got[name].double(), truth[name], rtol=0, atol=2e-6 * scale,
                                   msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("loss", ["mutual", "co_jeffreys", "jsd"])
def test_shared_head(loss, seed):
    """Self-distillation from a deeper layer: one head (and bias) for both sides. A learning teacher's
    head gradient is the sum of both sides'; a constant teacher's (jsd) is the student's alone."""
    tensors, labels, _ = case(seed, "bias")
    head, bias = tensors["ws"], tensors["bs"]
    # the deeper layer's states (a generator of their own: the global one, seeded alike, would repeat xs)
    xt = torch.randn(N, HS, generator=torch.Generator().manual_seed(seed + 2), dtype=torch.float64)
    xt[IGNORED[1]] = torch.nan

    def grads(fn):
        w, b = head.clone().requires_grad_(), bias.clone().requires_grad_()
        xs_, xt_ = tensors["xs"].clone().requires_grad_(), xt.clone().requires_grad_()
        out = fn(dict(xs=xs_, ws=w, bs=b, xt=xt_, wt=w, bt=b), labels, loss=loss)
        return out, dict(zip(("xs", "xt", "w", "b"), torch.autograd.grad(out, (xs_, xt_, w, b), allow_unused=True)))

    out, got = grads(run_flashkd)
    want, truth = grads(run_oracle)
    torch.testing.assert_close(out, want)
    for name in ("xs", "w", "b"):
        torch.testing.assert_close(got[name], truth[name], msg=lambda m: f"d{name}: {m}")
    if loss == "jsd":
        assert got["xt"] is None
    else:
        torch.testing.assert_close(got["xt"], truth["xt"])
    # the student's half alone: the head's gradient with the teacher's copy detached
    w = head.clone().requires_grad_()
    alone = oracle(tensors["xs"], w, xt, head, labels, loss=loss, bs=bias, bt=bias)
    (dw_student,) = torch.autograd.grad(alone, w)
    if loss == "jsd":
        torch.testing.assert_close(got["w"], dw_student)
    else:
        assert (got["w"] - dw_student).abs().max() > 1e-3 * dw_student.abs().max()


def small_case(seed, n=6, v=9, hs=4, ht=3):
    """A case small enough for float64 gradcheck: biases, an ignored row, chunks of 2 rows."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    tensors = dict(xs=r(n, hs), ws=r(v, hs), bs=r(v), xt=r(n, ht), wt=r(v, ht), bt=r(v))
    labels = torch.randint(0, v, (n,), generator=g)
    labels[1] = -100
    return tensors, labels


def small_loss(tensors, labels, loss, **opts):
    names = list(LEAVES)

    def fn(*xs):
        t = dict(zip(names, xs))
        return flashkd.fused_linear_distill(t["xs"], t["ws"], t["xt"], t["wt"], labels, student_bias=t["bs"],
                                            teacher_bias=t["bt"], chunk_size=2, loss=loss, **opts)

    return fn, [tensors[k].clone().requires_grad_() for k in names]


@pytest.mark.parametrize("opts", [{}, dict(temperature=1.7, temperature_squared=True, reduction="sum")])
@pytest.mark.parametrize("ht", [3, 8], ids=["accumulated", "held"])
def test_gradcheck_co_jeffreys(opts, ht, seed):
    """co_jeffreys differentiates its value on both sides: float64 gradcheck of all six leaves, with dWt
    accumulated a block at a time and (a teacher 8 wide: N·E ≤ Ht·A) made once from every row's dL/dT."""
    from flashkd.core import learning

    assert learning.defers(6, ht, 8, 8, True) == (ht == 8)
    fn, inputs = small_loss(*small_case(seed, ht=ht), "co_jeffreys", **opts)
    assert torch.autograd.gradcheck(fn, inputs)


def test_mutual_is_not_the_gradient_of_its_value(seed):
    """mutual's gradient is each side's KL toward the other, not J's: gradcheck of its value fails."""
    fn, inputs = small_loss(*small_case(seed), "mutual")
    assert not torch.autograd.gradcheck(fn, inputs, raise_exception=False)


@pytest.mark.parametrize("loss", [name for name in LOSSES if name not in LEARNING_LOSSES])
def test_every_other_teacher_is_a_constant(loss, seed):
    """A teacher that requires grad gets none from any other loss, as before."""
    tensors, labels, _ = case(seed, "bias")
    t = leaves(tensors)
    out = run_flashkd(t, labels, loss=loss)
    out.backward()
    assert t["xs"].grad is not None and t["ws"].grad is not None
    assert t["xt"].grad is None and t["wt"].grad is None and t["bt"].grad is None


@pytest.mark.parametrize("loss", LEARNING_LOSSES)
def test_teacher_alone_learns(loss, seed):
    """A constant student and a learning teacher: the teacher's gradients, the student none."""
    tensors, labels, _ = case(seed, "plain")
    t = {k: None if x is None else x.clone() for k, x in tensors.items()}
    t["xt"].requires_grad_()
    t["wt"].requires_grad_()
    out = run_flashkd(t, labels, loss=loss)
    ref = dict(t, xt=tensors["xt"].clone().requires_grad_(), wt=tensors["wt"].clone().requires_grad_())
    want = run_oracle(ref, labels, loss=loss)
    got = torch.autograd.grad(out, (t["xt"], t["wt"]))
    for g, truth in zip(got, torch.autograd.grad(want, (ref["xt"], ref["wt"]))):
        torch.testing.assert_close(g, truth)
    with torch.no_grad():  # no grad mode: the value alone
        assert run_flashkd(t, labels, loss=loss).grad_fn is None


def test_top_k_form_refuses_them():
    ids = torch.randint(0, V, (N, 4))
    lp = torch.log_softmax(torch.randn(N, 4), -1)
    for loss in LEARNING_LOSSES:
        with pytest.raises(ValueError, match=f"loss: .*got '{loss}' .*its teacher learns.*fused_linear_distill"):
            flashkd.fused_linear_distill_topk(torch.randn(N, HS), torch.randn(V, HS), ids, lp, loss=loss)


@pytest.mark.parametrize("loss", LEARNING_LOSSES)
def test_dense_logits_form(loss, seed):
    """Dense teacher logits: a constant teacher learns nothing (the student's gradient is the loss's), and
    logits that require grad are refused: their gradient would be N x V."""
    tensors, labels, _ = case(seed, "plain")
    xs = tensors["xs"].clone().requires_grad_()
    zt = tensors["xt"] @ tensors["wt"].T
    out = flashkd.fused_linear_distill_logits(xs, tensors["ws"], zt, labels, loss=loss, chunk_size=CHUNK)
    ref = xs.detach().clone().requires_grad_()
    want = oracle(ref, tensors["ws"], tensors["xt"], tensors["wt"], labels, loss=loss)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(torch.autograd.grad(out, xs)[0], torch.autograd.grad(want, ref)[0])
    with pytest.raises(ValueError, match="teacher_logits: .*require grad.*fused_linear_distill"):
        flashkd.fused_linear_distill_logits(xs, tensors["ws"], zt.requires_grad_(), labels, loss=loss)
    with torch.no_grad():  # no gradient asked for: nothing to refuse
        flashkd.fused_linear_distill_logits(xs, tensors["ws"], zt, labels, loss=loss)
    flashkd.fused_linear_distill_logits(xs, tensors["ws"], zt, labels, loss="jsd")  # constant teacher, as before


def test_fp8_learning_teacher_is_refused(seed):
    tensors, labels, _ = case(seed, "plain", torch.float32)
    t = leaves(tensors)
    with pytest.raises(ValueError, match="teacher_precision: expected None with loss='mutual'"):
        run_flashkd(t, labels, loss="mutual", teacher_precision="fp8")


@pytest.mark.parametrize("loss", LEARNING_LOSSES)
@pytest.mark.parametrize("student_view", [True, False], ids=["ds-view", "ds-buffer"])
@pytest.mark.parametrize("shape", [(7, 300), (5, 1031)])
@needs_triton
def test_teacher_grad_into_a_view_of_t(loss, student_view, shape, seed):
    """dL/dt of fp32 teacher logits written rounded to bf16 into half t's own bytes (`grad_view(t, ...)`, what the
    chunk loop asks for with bf16 inputs) is, bit for bit, the kernel's fp32 dL/dt rounded after (what it wrote
    before); dL/ds, soft and hard too, with dL/ds in s's own bytes or a buffer; ignored rows and a trained head's
    magnitudes (std 4, one peak of 30 a row) among the rows; a soft weight of 0 gives zeros."""
    from flashkd.backends import triton_rows
    from flashkd.losses import LossSpec

    r, v = shape
    g = torch.Generator().manual_seed(seed)
    s0 = torch.randn(r, v, generator=g) * 4
    t0 = torch.randn(r, v, generator=g) * 4
    t0[torch.arange(r), torch.randint(0, v, (r,), generator=g)] = 30.0
    labels = torch.randint(0, v, (r,), generator=g)
    labels[1] = -100
    scale = torch.tensor(1.0 / r)
    for w_soft in (0.5, 0.0):
        spec = LossSpec(loss=loss, weight_hard=0.5, weight_soft=w_soft, want_hard=True, want_soft=True,
                        temperature=1.3)
        results = []
        for into_view in (False, True):
            s, t = s0.clone().to(DEVICE), t0.clone().to(DEVICE)
            ds = triton_rows.grad_view(s, torch.bfloat16, spec, True) if student_view else \
                torch.empty(r, v, dtype=torch.bfloat16, device=DEVICE)
            gt = triton_rows.grad_view(t, torch.bfloat16, spec, True) if into_view else True
            soft, hard = triton_rows.rows(s, t, labels.to(DEVICE), spec, scale.to(DEVICE), True, ds=ds,
                                          teacher_grad=gt)
            dt = gt.clone() if into_view else t.to(torch.bfloat16)
            results.append((soft.cpu(), hard.cpu(), ds.clone().cpu(), dt.cpu()))
        for name, before, now in zip(("soft", "hard", "dL/ds", "dL/dt"), *results):
            assert torch.equal(before.view(torch.int16) if before.dtype == torch.bfloat16 else before,
                               now.view(torch.int16) if now.dtype == torch.bfloat16 else now), (name, w_soft)
        dt = results[1][3]
        assert not dt[1].any()  # the ignored row
        if w_soft == 0.0:
            assert not dt.any()
        else:
            assert dt.float().abs().max() > 0


@needs_triton
def test_teacher_grad_refuses_other_views(seed):
    """teacher_grad as a tensor: a buffer of its own or t's `grad_view`; a view of s, another view of t, a wrong
    shape and a non-tensor are named errors."""
    from flashkd.backends import triton_rows
    from flashkd.losses import LossSpec

    spec = LossSpec(loss="mutual", weight_hard=0.5, weight_soft=0.5, want_hard=True, want_soft=True)
    s, t = torch.randn(3, 40, device=DEVICE), torch.randn(3, 40, device=DEVICE)
    y, scale = torch.zeros(3, dtype=torch.long, device=DEVICE), torch.tensor(1.0, device=DEVICE)
    half = 40 if triton_rows.grad_view(t, torch.bfloat16, spec, True).data_ptr() == t.data_ptr() else 0
    bad = {"view of s": lambda s, t: s.view(torch.bfloat16)[:, :40],
           "other view of t": lambda s, t: t.view(torch.bfloat16)[:, half:half + 40],
           "shape": lambda s, t: torch.empty(3, 39, device=DEVICE), "a string": lambda s, t: "yes"}
    for name, make in bad.items():
        s1, t1 = s.clone(), t.clone()
        with pytest.raises((ValueError, TypeError), match="teacher_grad"):
            triton_rows.rows(s1, t1, y, spec, scale, True, teacher_grad=make(s1, t1))
    buffer = torch.empty(3, 40, dtype=torch.bfloat16, device=DEVICE)
    triton_rows.rows(s.clone(), t.clone(), y, spec, scale, True, teacher_grad=buffer)
    assert buffer.float().abs().max() > 0


@pytest.mark.parametrize("loss", LEARNING_LOSSES)
@needs_triton
def test_bf16_teacher_grad_in_its_logits_bytes(loss, seed, monkeypatch):
    """bf16 inputs on the triton backend: each block's dL/dt is asked for in a bf16 view of its fp32 logits (no
    cast after) where the teacher's bias does not learn (its gradient sums dL/dt in fp32); the gradients as near
    the float64 oracle as the torch backend's (which rounds after)."""
    from flashkd.backends import triton_rows

    calls = []
    kernel = triton_rows.rows

    def spy(s, t, *args, **kwargs):
        gt = kwargs.get("teacher_grad")
        calls.append(isinstance(gt, torch.Tensor) and gt.dtype == torch.bfloat16 and gt.data_ptr() == t.data_ptr())
        return kernel(s, t, *args, **kwargs)

    monkeypatch.setattr(triton_rows, "rows", spy)
    tensors, labels, opts = case(seed, "bias", torch.bfloat16)
    bt = tensors.pop("bt")  # a constant bias: its gradient is not asked for
    ref = leaves({k: None if x is None else x.double() for k, x in tensors.items()})
    ref["bt"] = bt.double()
    truth = grads_of(run_oracle(ref, labels, loss=loss, **opts), ref)
    errors = {}
    for backend in ("triton", "torch"):
        mine = leaves(tensors, DEVICE if backend == "triton" else "cpu")
        mine["bt"] = bt.to(mine["xs"].device)
        out = run_flashkd(mine, _to(labels, mine["xs"].device), loss=loss, backend=backend, **opts)
        got = _cpu(grads_of(out, mine))
        errors[backend] = {k: ((got[k].double() - truth[k]).abs().max() / truth[k].abs().max()).item() for k in got}
    assert calls and all(calls)
    assert set(errors["triton"]) == {"xs", "ws", "bs", "xt", "wt"}
    for name, err in errors["triton"].items():
        assert err <= 1.5 * errors["torch"][name] + 2e-3, (name, errors)


@pytest.mark.parametrize("backend,dtype", [("torch", torch.float64), ("triton", torch.float32),
                                           ("triton", torch.bfloat16)], ids=["torch-fp64", "triton-fp32", "triton-bf16"])
@pytest.mark.parametrize("loss", LEARNING_LOSSES)
def test_dwt_in_one_gemm_where_every_rows_dl_dt_is_held(loss, backend, dtype, seed, monkeypatch):
    """Where holding every row's dL/dT (N·V·E bytes) takes no more than dWt's accumulator (V·Ht·A: N·E ≤ Ht·A, a
    teacher 24 wide here), dWt is one GEMM over all rows after the loop (`core.learning.defers`): all six
    gradients as near the float64 oracle as the accumulated path's, ignored rows' NaN / inf hidden states kept
    out, the held path taken (and not taken where forced off)."""
    if backend == "triton" and not flashkd.core.backend._has_triton():
        pytest.skip("triton is not installed")
    from flashkd.core import learning

    tensors, labels = make(seed, dtype, bias=True, ht=24)
    ref = leaves({k: None if x is None else x.double() for k, x in tensors.items()})
    truth = grads_of(run_oracle(ref, labels, loss=loss), ref)
    dev = DEVICE if backend == "triton" else "cpu"
    errors, held = {}, []
    finish = learning.finish
    monkeypatch.setattr(learning, "finish", lambda grads, *a: (held.append(grads[3] is not None), finish(grads, *a))[1])
    for path in ("held", "accumulated"):
        if path == "accumulated":
            monkeypatch.setattr(learning, "defers", lambda *a: False)
        mine = leaves(tensors, dev)
        mine["bt"].requires_grad_(False)  # db_t would take dL/dt in fp32 over the logits: the bf16 view is tried
        out = run_flashkd(mine, _to(labels, dev), loss=loss, backend=backend)
        got = _cpu(grads_of(out, mine))
        assert set(got) == {"xs", "ws", "bs", "xt", "wt"}
        assert not got["xt"][list(IGNORED)].any()
        errors[path] = {k: ((got[k].double() - truth[k]).abs().max() / truth[k].abs().max()).item() for k in got}
    assert held == [True, False]
    bar = 2e-6 if dtype != torch.bfloat16 else 0.0
    for name, err in errors["held"].items():
        assert err <= 1.5 * errors["accumulated"][name] + max(bar, 1e-12), (name, errors)
    if dtype != torch.bfloat16:
        assert max(errors["held"].values()) <= 2e-6
