"""`flashkd.fused_linear_distill_teachers`: several teacher heads, routed per row, mixed geometrically, or
summed, against float64 oracles over the full logits (tests/oracle.py's `distill_loss` with the mixed or
routed teacher logits, or summed per teacher), value and student gradients, both backends: the Triton backend
on DEVICE (the GPU, or the CPU under Triton's interpreter), the torch backend and the oracles on the CPU."""

import pytest
import torch

import flashkd
from conftest import BACKEND_PARAMS, _device, _on, needs_triton
from oracle import distill_loss

N, V, HS = 19, 37, 11
HTS = (6, 9, 6)


def _tolerance(backend):
    return (torch.float64, 1e-9) if backend == "torch" else (torch.float32, 3e-5)


def make(g, m, dtype, *, bias=False, ignore=True):
    """Student (xs, ws, bs), M teachers (inputs, heads, biases), labels with some rows ignored."""
    def rand(*shape, s=1.0):
        return (s * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)

    xs = rand(N, HS).requires_grad_()
    ws = rand(V, HS, s=0.5).requires_grad_()
    bs = rand(V, s=0.3).requires_grad_() if bias else None
    xts = [rand(N, HTS[t]) for t in range(m)]
    wts = [rand(V, HTS[t], s=0.7) for t in range(m)]
    bts = [rand(V, s=0.3) if bias and t != 1 else None for t in range(m)]  # teacher 1: no bias
    labels = torch.randint(0, V, (N,), generator=g)
    if ignore:
        labels[torch.rand(N, generator=g) < 0.3] = -100
        labels[0] = -100
    return xs, ws, bs, xts, wts, bts, labels


def logits(x, w, b, scale=1.0):
    z = x.double() @ w.double().T
    return scale * (z if b is None else z + b.double())


def leaves(xs, ws, bs):
    return [t for t in (xs, ws, bs) if t is not None]


def check(out, ref, student, oracle_student, tol):
    """(loss, soft, hard) and the student's gradients against the oracle's (w.r.t. its float64 copies)."""
    for name, got, want in zip(("loss", "soft", "hard"), out, ref):
        assert abs(got.item() - want.item()) <= tol * max(abs(want.item()), 1.0), (name, got.item(), want.item())
    grads = [g.cpu() for g in torch.autograd.grad(out[0], student)]
    want = torch.autograd.grad(ref[0], oracle_student)
    for name, g, w in zip(("dX", "dW", "db"), grads, want):
        assert g.shape == w.shape and torch.isfinite(g).all(), name
        err = ((g.double() - w).norm() / w.norm().clamp_min(1e-30)).item()
        assert err <= tol, (name, err)


def _double(student):
    return [t.detach().double().requires_grad_() for t in student]


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_routed(seed, backend, reduction):
    """Each row distils from its own teacher; −1 rows drop out, teacher 1 gets no rows (an empty group)."""
    g = torch.Generator().manual_seed(seed)
    dtype, tol = _tolerance(backend)
    xs, ws, bs, xts, wts, bts, labels = make(g, 3, dtype, bias=True)
    index = torch.randint(0, 2, (N,), generator=g) * 2  # teachers 0 and 2 only
    index[3] = index[7] = -1
    index[1] = 0
    scales = [1.0, 1.0, 0.8]
    student = _on(_device(backend), xs, ws, bs)
    call_xts, call_wts, call_labels, call_index, call_bts = _on(_device(backend), xts, wts, labels, index, bts)
    out = flashkd.fused_linear_distill_teachers(
        student[0], student[1], call_xts, call_wts, call_labels, combine="routed", teacher_index=call_index,
        teacher_biases=call_bts, student_bias=student[2], teacher_logit_scale=scales, reduction=reduction,
        backend=backend, chunk_size=5, return_soft_hard_loss=True, return_stats=True)
    rows = torch.arange(N)
    z = torch.stack([logits(xts[t], wts[t], bts[t], scales[t]) for t in range(3)])  # (M, N, V)
    mixed = z[index.clamp_min(0), rows]
    counted = torch.where(index >= 0, labels, -100)
    xd, wd, bd = _double([xs, ws, bs])
    ref = distill_loss(xd, wd, None, None, counted, teacher_logits=mixed, student_bias=bd, reduction=reduction)
    check(out[:3], ref, list(student), [xd, wd, bd], tol)
    stats = out[3]
    assert stats.per_teacher.shape == (3, 3) and stats.teacher_entropy_sum is None
    for t in range(3):
        mine = torch.where(index == t, labels, -100)
        _, soft, _ = distill_loss(xd, wd, None, None, mine, teacher_logits=mixed, student_bias=bd, reduction="sum")
        assert stats.per_teacher[t, 0].item() == int((mine != -100).sum())
        assert abs(stats.per_teacher[t, 1].item() - soft.item()) <= tol * max(abs(soft.item()), 1.0)
        assert stats.per_teacher[t, 2].item() == 0
    assert stats.rows.item() == int((counted != -100).sum())
    assert stats.per_teacher[1].abs().sum() == 0


def test_routed_without_any_row(seed):
    """Every row's teacher −1: the loss is 0, its gradients zeros, and no call is made."""
    g = torch.Generator().manual_seed(seed)
    xs, ws, _, xts, wts, _, labels = make(g, 2, torch.float64)
    index = torch.full((N,), -1)
    loss = flashkd.fused_linear_distill_teachers(xs, ws, xts, wts, labels, combine="routed", teacher_index=index,
                                                 backend="torch")
    dx, dw = torch.autograd.grad(loss, [xs, ws])
    assert loss.item() == 0 and loss.dtype == torch.float64 and dx.abs().max() == 0 and dw.abs().max() == 0


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("per_row", [False, True], ids=["scalar", "per_row"])
@pytest.mark.parametrize("m", [2, 3])
def test_geometric(seed, backend, per_row, m):
    """p = softmax(Σ w_m z_m): the oracle's teacher logits are the weighted sum of each teacher's."""
    g = torch.Generator().manual_seed(seed)
    dtype, tol = _tolerance(backend)
    xs, ws, bs, xts, wts, bts, labels = make(g, m, dtype, bias=True)
    if per_row:
        w = torch.rand(N, m, generator=g, dtype=torch.float64).to(dtype) * 1.5
        w[2, 0] = 0.0
        wd = w.double()
    else:
        w = [0.7, 1.3, 0.4][:m]
        wd = torch.tensor(w, dtype=torch.float64).expand(N, m)
    scales = [1.0, 0.5, 2.0][:m]
    student = _on(_device(backend), xs, ws, bs)
    call_xts, call_wts, call_labels, call_w, call_bts = _on(_device(backend), xts, wts, labels, w, bts)
    out = flashkd.fused_linear_distill_teachers(
        student[0], student[1], call_xts, call_wts, call_labels, combine="geometric", teacher_weights=call_w,
        teacher_biases=call_bts, student_bias=student[2], teacher_logit_scale=scales, backend=backend, chunk_size=7,
        return_soft_hard_loss=True, return_stats=True, loss="reverse_kl")
    mixed = sum(wd[:, t:t + 1] * logits(xts[t], wts[t], bts[t], scales[t]) for t in range(m))
    xd, wsd, bd = _double([xs, ws, bs])
    ref = distill_loss(xd, wsd, None, None, labels, teacher_logits=mixed, student_bias=bd, loss="reverse_kl")
    check(out[:3], ref, list(student), [xd, wsd, bd], tol)
    assert out[3].per_teacher is None


def test_geometric_padded_heads_and_reduction_sum(seed):
    """Heads of different row counts, each cut to vocab_size; reduction "sum"; a scalar temperature."""
    g = torch.Generator().manual_seed(seed)
    xs, ws, _, xts, wts, _, labels = make(g, 2, torch.float64)
    wts = [torch.cat([wts[0], torch.randn(4, HTS[0], generator=g, dtype=torch.float64)]), wts[1]]
    out = flashkd.fused_linear_distill_teachers(
        xs, ws, xts, wts, labels, combine="geometric", teacher_weights=torch.tensor([0.6, 0.9], dtype=torch.float64),
        vocab_size=V, reduction="sum",
        temperature=1.7, backend="torch", return_soft_hard_loss=True)
    mixed = 0.6 * logits(xts[0], wts[0][:V], None) + 0.9 * logits(xts[1], wts[1], None)
    xd, wd = _double([xs, ws])
    ref = distill_loss(xd, wd, None, None, labels, teacher_logits=mixed, reduction="sum", temperature=1.7)
    check(out, ref, [xs, ws], [xd, wd], 1e-9)


def _mixture(zs, wd, tau):
    """τ · log Σ_m w_m softmax(z_m / τ): teacher logits whose softmax at τ is the mixture."""
    return tau * torch.stack([torch.log_softmax(z / tau, -1) + wd[:, t:t + 1].log() for t, z in enumerate(zs)]).logsumexp(0)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("per_row", [False, True], ids=["scalar", "per_row"])
@pytest.mark.parametrize("m", [2, 3])
def test_arithmetic(seed, backend, per_row, m):
    """p = Σ w_m p_m at τ: the oracle's teacher logits are τ · log of the mixed probabilities, each teacher with its
    own logit scale and softcap; a zero weight on a row drops that teacher there; the chunks and blocks of the
    loop (7 rows a chunk, 3 a block) do not show."""
    g = torch.Generator().manual_seed(seed)
    dtype, tol = _tolerance(backend)
    xs, ws, bs, xts, wts, bts, labels = make(g, m, dtype, bias=True)
    xts = [3.0 * x for x in xts]  # logits of std ~4: distributions far apart, so that a wrong mixture shows
    if per_row:
        w = torch.rand(N, m, generator=g, dtype=torch.float64) + 0.05
        w[2, 0] = 0.0
        w = (w / w.sum(-1, keepdim=True)).to(dtype)
        wd = w.double()
    else:
        w = [0.25, 0.75] if m == 2 else [0.2, 0.5, 0.3]
        wd = torch.tensor(w, dtype=torch.float64).expand(N, m)
    scales, caps, tau = [1.0, 0.5, 2.0][:m], [None, 20.0, None][:m], 1.7
    student = _on(_device(backend), xs, ws, bs)
    call_xts, call_wts, call_labels, call_w, call_bts = _on(_device(backend), xts, wts, labels, w, bts)
    out = flashkd.fused_linear_distill_teachers(
        student[0], student[1], call_xts, call_wts, call_labels, combine="arithmetic", teacher_weights=call_w,
        teacher_biases=call_bts, student_bias=student[2], teacher_logit_scale=scales, teacher_softcap=caps,
        temperature=tau, backend=backend, chunk_size=7, return_soft_hard_loss=True, return_stats=True, loss="jsd",
        beta=0.3)
    zs = [logits(xts[t], wts[t], bts[t], scales[t]) for t in range(m)]
    zs = [z if c is None else c * torch.tanh(z / c) for z, c in zip(zs, caps)]
    xd, wsd, bd = _double([xs, ws, bs])
    ref = distill_loss(xd, wsd, None, None, labels, teacher_logits=_mixture(zs, wd, tau), student_bias=bd,
                       temperature=tau, loss="jsd", beta=0.3)
    check(out[:3], ref, list(student), [xd, wsd, bd], tol)
    assert out[3].per_teacher is None
    # the mixture is no teacher's alone, nor the geometric mean's
    alone = distill_loss(xd, wsd, None, None, labels, teacher_logits=zs[0], student_bias=bd, temperature=tau,
                         loss="jsd", beta=0.3)
    assert abs(alone[0].item() - ref[0].item()) > 100 * tol * abs(ref[0].item())


def test_arithmetic_of_one_weight_is_that_teacher(seed):
    """Weights (0, 1): the other teacher's call exactly, padded heads cut to vocab_size, reduction "sum"."""
    g = torch.Generator().manual_seed(seed)
    xs, ws, _, xts, wts, _, labels = make(g, 2, torch.float64)
    wts = [torch.cat([wts[0], torch.randn(4, HTS[0], generator=g, dtype=torch.float64)]), wts[1]]
    out = flashkd.fused_linear_distill_teachers(xs, ws, xts, wts, labels, combine="arithmetic", teacher_weights=[0.0, 1.0],
                                                vocab_size=V, reduction="sum", backend="torch")
    one = flashkd.fused_linear_distill(xs, ws, xts[1], wts[1], labels, reduction="sum", backend="torch")
    assert abs(out.item() - one.item()) <= 1e-12 * abs(one.item())
    for a, b in zip(torch.autograd.grad(out, [xs, ws]), torch.autograd.grad(one, [xs, ws])):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("per_row", [False, True], ids=["scalar", "per_row"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_sum(seed, backend, per_row, reduction):
    """Σ_m w_m D(p_m ‖ q) + the CE once, with a row_weight of the caller's too."""
    g = torch.Generator().manual_seed(seed)
    dtype, tol = _tolerance(backend)
    m = 3
    xs, ws, bs, xts, wts, bts, labels = make(g, m, dtype, bias=True)
    if per_row:
        w = torch.rand(N, m, generator=g, dtype=torch.float64).to(dtype)
        wd = w.double()
    else:
        w = [0.25, 1.0, 0.5]
        wd = torch.tensor(w, dtype=torch.float64).expand(N, m)
    row_weight = (0.5 + torch.rand(N, generator=g, dtype=torch.float64)).to(dtype)
    student = _on(_device(backend), xs, ws, bs)
    call_xts, call_wts, call_labels, call_w, call_bts, call_rw = _on(_device(backend), xts, wts, labels, w, bts,
                                                                     row_weight)
    out = flashkd.fused_linear_distill_teachers(
        student[0], student[1], call_xts, call_wts, call_labels, combine="sum", teacher_weights=call_w,
        teacher_biases=call_bts, student_bias=student[2], row_weight=call_rw, reduction=reduction, backend=backend,
        chunk_size=6, return_soft_hard_loss=True, return_stats=True, weight_hard_loss=0.3, weight_soft_loss=0.8)
    xd, wsd, bd = _double([xs, ws, bs])
    per = []
    total = soft = 0
    for t in range(m):
        z = logits(xts[t], wts[t], bts[t])
        loss, s, _ = distill_loss(xd, wsd, None, None, labels, teacher_logits=z, student_bias=bd, reduction=reduction,
                                  weight_hard_loss=0.0, weight_soft_loss=0.8, row_weight=wd[:, t] * row_weight.double())
        _, s_sum, _ = distill_loss(xd, wsd, None, None, labels, teacher_logits=z, student_bias=bd, reduction="sum",
                                   row_weight=wd[:, t] * row_weight.double())
        total, soft = total + loss, soft + s
        per.append(s_sum.item())
    ce, _, hard = distill_loss(xd, wsd, None, None, labels, teacher_logits=z, student_bias=bd, reduction=reduction,
                               weight_hard_loss=0.3, weight_soft_loss=0.0, row_weight=row_weight.double())
    check(out[:3], (total + ce, soft, hard), list(student), [xd, wsd, bd], tol)
    stats = out[3]
    counted = int((labels != -100).sum())
    assert stats.rows.item() == counted and stats.per_teacher.shape == (m, 3)
    for t in range(m):
        assert stats.per_teacher[t, 0].item() == counted and stats.per_teacher[t, 2].item() == 0
        assert abs(stats.per_teacher[t, 1].item() - per[t]) <= tol * max(abs(per[t]), 1.0)
    assert abs(stats.soft_sum.item() - sum(per)) <= tol * max(abs(sum(per)), 1.0)


def test_sum_of_two_without_labels(seed):
    """M = 2, labels None (no CE): the weighted sum of the two divergences, forward KL."""
    g = torch.Generator().manual_seed(seed)
    xs, ws, _, xts, wts, _, _ = make(g, 2, torch.float64)
    w = torch.rand(N, 2, generator=g, dtype=torch.float64)
    loss = flashkd.fused_linear_distill_teachers(xs, ws, xts, wts, combine="sum", teacher_weights=w,
                                                 weight_hard_loss=0.0, loss="forward_kl", backend="torch")
    xd, wd = _double([xs, ws])
    ref = sum(distill_loss(xd, wd, xts[t], wts[t], None, weight_hard_loss=0.0, row_weight=w[:, t], loss="forward_kl")[0]
              for t in range(2))
    check((loss,), (ref,), [xs, ws], [xd, wd], 1e-9)


def _base(g):
    xs, ws, _, xts, wts, _, labels = make(g, 2, torch.float64)
    return dict(student_input=xs, student_weight=ws, teacher_inputs=xts, teacher_heads=wts, labels=labels)


ERRORS = [
    (dict(combine="mixture"), ValueError, "combine"),
    (dict(combine="routed"), ValueError, "teacher_index"),
    (dict(combine="routed", teacher_index=torch.zeros(N)), TypeError, "teacher_index"),
    (dict(combine="routed", teacher_index=torch.zeros(N + 1, dtype=torch.long)), ValueError, "teacher_index"),
    (dict(combine="routed", teacher_index=torch.full((N,), 2)), ValueError, "teacher_index"),
    (dict(combine="routed", teacher_index=torch.full((N,), -2)), ValueError, "teacher_index"),
    (dict(combine="routed", teacher_index=torch.zeros(N, dtype=torch.long), teacher_weights=[1.0, 1.0]), ValueError,
     "teacher_weights"),
    (dict(combine="sum"), ValueError, "teacher_weights"),
    (dict(combine="sum", teacher_weights=[1.0]), ValueError, "teacher_weights"),
    (dict(combine="sum", teacher_weights=[1.0, -0.5]), ValueError, "teacher_weights"),
    (dict(combine="sum", teacher_weights=[1.0, float("nan")]), ValueError, "teacher_weights"),
    (dict(combine="sum", teacher_weights=torch.ones(N, 3, dtype=torch.float64)), ValueError, "teacher_weights"),
    (dict(combine="sum", teacher_weights=-torch.ones(N, 2, dtype=torch.float64)), ValueError, "teacher_weights"),
    (dict(combine="sum", teacher_weights=torch.ones(N, 2, dtype=torch.long)), TypeError, "teacher_weights"),
    (dict(combine="sum", teacher_weights=[1.0, 1.0], teacher_index=torch.zeros(N, dtype=torch.long)), ValueError,
     "teacher_index"),
    (dict(combine="geometric", teacher_weights=[1.0, 1.0], teacher_softcap=30.0), ValueError, "teacher_softcap"),
    (dict(combine="geometric", teacher_weights=[1.0, 1.0], teacher_softcap=[None, 30.0]), ValueError,
     "teacher_softcap"),
    (dict(combine="sum", teacher_weights=[1.0, 1.0], teacher_logit_scale=[1.0]), ValueError, "teacher_logit_scale"),
    (dict(combine="sum", teacher_weights=[1.0, 1.0], teacher_biases=[None]), ValueError, "teacher_biases"),
    (dict(combine="sum", teacher_weights=[1.0, 1.0], reduction="none"), ValueError, "reduction"),
    (dict(combine="sum", teacher_weights=[1.0, 1.0], loss="mutual"), ValueError, "loss"),
    # arithmetic: a mixture of distributions, its weights summing to 1 (never renormalised)
    (dict(combine="arithmetic", teacher_weights=[0.5, 0.6]), ValueError, "teacher_weights: expected .*summing to 1"),
    (dict(combine="arithmetic", teacher_weights=[1.0, 1.0]), ValueError, "teacher_weights: expected .*summing to 1"),
    (dict(combine="arithmetic", teacher_weights=torch.full((N, 2), 0.6, dtype=torch.float64)), ValueError,
     "teacher_weights: expected .*summing to 1"),
    (dict(combine="arithmetic", teacher_weights=torch.tensor([[1.5, -0.5]] * N, dtype=torch.float64)), ValueError,
     "teacher_weights"),
    (dict(combine="arithmetic", teacher_weights=[0.5, 0.5], teacher_precision="fp8"), ValueError,
     "teacher_precision"),
    (dict(combine="arithmetic", teacher_weights=[0.5, 0.5], loss="co_jeffreys"), ValueError, "loss"),
]


@pytest.mark.parametrize("change, error, name", ERRORS, ids=[f"{i}-{e[2]}" for i, e in enumerate(ERRORS)])
def test_errors(seed, change, error, name):
    g = torch.Generator().manual_seed(seed)
    kw = {**_base(g), **change}
    with pytest.raises(error, match=name):
        flashkd.fused_linear_distill_teachers(**kw, backend="torch")


def test_errors_of_the_teachers(seed):
    g = torch.Generator().manual_seed(seed)
    kw = _base(g)
    xts, wts = kw["teacher_inputs"], kw["teacher_heads"]
    cases = [
        (dict(teacher_inputs=xts[:1]), ValueError, "teacher_heads"),
        (dict(teacher_inputs=[], teacher_heads=[]), ValueError, "teacher_inputs"),
        (dict(teacher_inputs=xts[0]), TypeError, "teacher_inputs"),
        (dict(teacher_inputs=[xts[0], xts[1][:-1]]), ValueError, r"teacher_inputs\[1\]"),
        (dict(teacher_heads=[wts[0], wts[1].T]), ValueError, r"teacher_heads\[1\]"),
        (dict(teacher_heads=[wts[0], wts[1][:-2]]), ValueError, "teacher_heads"),  # geometric: unequal rows
    ]
    for change, error, name in cases:
        with pytest.raises(error, match=name):
            flashkd.fused_linear_distill_teachers(**{**kw, **change}, combine="geometric", teacher_weights=[1.0, 1.0],
                                                  backend="torch")


def test_sum_per_row_without_ce(seed):
    """Per-row weights, labels and weight_hard_loss=0: no CE pass; the hard term and hard_sum read 0."""
    g = torch.Generator().manual_seed(seed)
    xs, ws, _, xts, wts, _, labels = make(g, 2, torch.float64)
    w = torch.rand(N, 2, generator=g, dtype=torch.float64)
    loss, soft, hard, stats = flashkd.fused_linear_distill_teachers(
        xs, ws, xts, wts, labels, combine="sum", teacher_weights=w, weight_hard_loss=0.0, weight_soft_loss=1.0,
        backend="torch", return_soft_hard_loss=True, return_stats=True)
    xd, wd = _double([xs, ws])
    parts = [distill_loss(xd, wd, xts[t], wts[t], labels, weight_hard_loss=0.0, weight_soft_loss=1.0,
                          row_weight=w[:, t]) for t in range(2)]
    ref = (parts[0][0] + parts[1][0], parts[0][1] + parts[1][1], torch.zeros((), dtype=torch.float64))
    check((loss, soft, hard), ref, [xs, ws], [xd, wd], 1e-9)
    assert stats.hard_sum.item() == 0


@pytest.mark.parametrize("combine", ["sum", "routed", "geometric", "arithmetic"])
def test_return_flags_are_bools(combine, seed):
    """return_stats / return_soft_hard_loss of every combine: a "no" is refused, not taken as True."""
    g = torch.Generator().manual_seed(seed)
    xs, ws, bs, xts, wts, bts, labels = make(g, 2, torch.float64)
    extra = dict(teacher_index=torch.zeros(N, dtype=torch.long)) if combine == "routed" else \
        dict(teacher_weights=[0.5, 0.5])
    for flag in ("return_stats", "return_soft_hard_loss"):
        with pytest.raises(TypeError, match=f"{flag}: expected a bool, got 'no'"):
            flashkd.fused_linear_distill_teachers(xs, ws, xts, wts, labels, combine=combine, **extra, **{flag: "no"})


def test_routed_checks_the_labels_of_rows_without_a_teacher(seed):
    """A label out of range on a row routed to no teacher (−1) is refused as one call refuses it (on the CPU;
    check_labels=False skips it)."""
    g = torch.Generator().manual_seed(seed)
    xs, ws, bs, xts, wts, bts, labels = make(g, 2, torch.float64)
    index = torch.zeros(N, dtype=torch.long)
    index[4] = -1
    labels = labels.clone()
    labels[4] = 10**6
    with pytest.raises(ValueError, match=r"labels: expected values in \[0, "):
        flashkd.fused_linear_distill_teachers(xs, ws, xts, wts, labels, combine="routed", teacher_index=index)
    out = flashkd.fused_linear_distill_teachers(xs, ws, xts, wts, labels, combine="routed", teacher_index=index,
                                                check_labels=False)
    assert torch.isfinite(out)


@pytest.mark.parametrize("index", [-1, None], ids=["no-row-has-a-teacher", "no-rows"])
def test_routed_fp8_on_a_device_without_it_is_refused_with_no_routed_row(index, seed):
    # routed runs one call a group with an FP8 head, and a group only for a teacher with rows: with none, the
    # device was never checked and the call returned 0 on the CPU
    g = torch.Generator().manual_seed(seed)
    kw = _base(g)
    if index is None:
        kw = {**kw, "student_input": kw["student_input"][:0], "labels": kw["labels"][:0],
              "teacher_inputs": [x[:0] for x in kw["teacher_inputs"]]}
    teacher_index = torch.full(kw["labels"].shape, -1 if index is not None else 0, dtype=torch.long)
    with pytest.raises(ValueError, match="teacher_precision: 'fp8' needs a CUDA GPU"):
        flashkd.fused_linear_distill_teachers(**kw, combine="routed", teacher_index=teacher_index,
                                              teacher_precision="fp8", backend="torch")
