"""The top-k form's tail clamp (TRL's bucket), the teacher's entropy and the per-teacher statistics,
against the float64 oracle, on both backends: the Triton backend on DEVICE (the GPU, or the CPU under
Triton's interpreter), the torch backend and the float64 oracle on the CPU."""

import math

import pytest
import torch

import flashkd
from conftest import BACKEND_PARAMS, _device
from helpers.cases import K, check_against_oracle, make_student, make_topk, read, rel_err, tolerance
from helpers.ties import drop_tied_rows, logits64
from oracle import student_stats, topk_loss


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest.py)


def _peaked_topk(lead, dtype, *, past_one=False):
    """make_topk's targets, a third of the rows sharpened so that the ids hold nearly all the teacher's
    mass (the clamp bites); with past_one, one row's probabilities lifted to sum past 1 (as rounded
    log-probs can), which only a clamped tail accepts."""
    ids, logprobs = make_topk(lead, temperature=0.3)
    ids, logprobs = ids.reshape(-1, K), logprobs.reshape(-1, K).clone()
    if past_one:
        used = ids[0] >= 0
        logprobs[0] = torch.where(used, logprobs[0] - torch.logsumexp(logprobs[0][used], 0) + 1e-3, logprobs[0])
    return ids.reshape(*lead, K), logprobs.reshape(*lead, K).to(dtype)


def _run(backend, dtype, lead, ids, logprobs, *, bias=False, ignore="some", teacher_index=None, num_teachers=None,
         scale=1.0, **options):
    """The call on `backend`'s device (`_device`), its inputs made on the CPU and copied there; the oracle's on
    the CPU. Returns the call's outputs (on its device), its gradients (on the CPU), the oracle's, the
    leaves differentiated, and the CPU inputs."""
    xs, ws, bs, labels = make_student(lead, dtype, bias=bias, ignore=ignore)
    with torch.no_grad():  # student logits that put most of q on the teacher's ids in some rows
        ws.mul_(scale)
    labels = drop_tied_rows(labels, logits64(xs, ws, bs), ids=ids, logprobs=logprobs, **options)
    dev = _device(backend)
    on = lambda t: t.to(dev) if torch.is_tensor(t) else t  # noqa: E731
    leaves = [t if dev == "cpu" else t.detach().to(dev).requires_grad_() for t in [xs, ws] + ([bs] if bias else [])]
    out = flashkd.fused_linear_distill_topk(
        leaves[0], leaves[1], on(ids), on(logprobs), on(labels), student_bias=leaves[2] if bias else None,
        backend=backend, return_soft_hard_loss=True, return_stats=True, teacher_index=on(teacher_index),
        num_teachers=num_teachers, **{k: on(v) for k, v in read(options, "forward_kl").items()})
    grads = [g.cpu() for g in torch.autograd.grad(out[0], leaves)]
    ref_leaves = [x.detach().double().requires_grad_() for x in [xs, ws] + ([bs] if bias else [])]
    ref, entropy = topk_loss(ref_leaves[0], ref_leaves[1], ids, logprobs, labels,
                             student_bias=ref_leaves[2] if bias else None, teacher_entropy=True, **options)
    ref_grads = torch.autograd.grad(ref[0], ref_leaves, allow_unused=True)
    return out, grads, ref, ref_grads, leaves, labels, entropy, xs, ws, bs


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("loss, beta, clamp", [  # clamp 0.3: a rest of at least 0.26, active on most rows
    ("forward_kl", 0.5, 1e-7), ("reverse_kl", 0.5, 1e-7), ("reverse_kl", 0.5, 0.3), ("jsd", 0.35, 1e-7),
    ("jsd", 0.35, 0.3), ("tvd", 0.5, 0.3),
])
def test_tail_clamp_matches_oracle(backend, loss, beta, clamp, seed):
    """The torch rows in float64 to 1e-9; the kernel in fp32 to 2e-5, or where fp32 itself is further off
    the oracle on these inputs (a reverse KL against a rest clamped to 1e-7 weighs log-ratios of ~16: the
    torch rows in fp32 are up to 1.5e-4 off in dX on some draws, e.g. seed 7), to twice their error."""
    dtype, tol = tolerance(backend)
    lead = (13,)
    options = dict(loss=loss, beta=beta, tail="bucket", tail_clamp=clamp, temperature=0.8, reduction="sum",
                   weight_hard_loss=0.3 if loss == "tvd" else 0.0, weight_soft_loss=0.9)

    def run(backend):
        torch.manual_seed(seed)  # the same inputs on every call
        ids, logprobs = _peaked_topk(lead, dtype, past_one=True)
        return _run(backend, dtype, lead, ids, logprobs, bias=True, scale=3.0, **options)

    out, grads, ref, ref_grads, leaves, labels, entropy, *_ = run(backend)
    loss_, soft, hard, stats = out
    assert abs(stats.teacher_entropy_sum.item() - entropy.sum().item()) <= tol * max(entropy.sum().item(), 1.0)
    if backend == "torch":
        check_against_oracle((loss_, soft, hard), ref, grads, ref_grads, leaves, tol, labels, -100)
        return
    plain = run("torch")  # the torch rows on the same fp32 inputs
    errors = lambda o, g: [abs(o[i].item() - ref[i].item()) / max(abs(ref[i].item()), 1.0) for i in range(3)] + [  # noqa: E731
        rel_err(a, b) for a, b in zip(g, ref_grads)]
    for name, err, err_plain in zip(("loss", "soft", "hard", "dXs", "dWs", "dbs"), errors(out, grads),
                                    errors(plain[0], plain[1])):
        assert err <= max(tol, 2 * err_plain), (name, err, err_plain)
    ignored = labels == -100
    assert grads[0][ignored].abs().max() == 0


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_tail_clamp_in_fp32_at_large_logits(backend, beta, seed):
    """Both sides clamped in fp32: the four ids' head rows are zero and their bias 25 (logits exact at 25 on
    every row, q ~ 1/4 each, the rest ~1e-9), the teacher's mass on them 1 − 1e-9 or 1. The hidden states'
    gradient is then the part off the ids alone, q_j times a sum over the categories that cancels at β
    between 0 and 1. Loss and gradients within 1e-5 relative of float64 truth on each of 3 draws (dX at
    β = 0.3 at most 5.3e-6 over 150 draws; categories taken as z − logsumexp of the logits, whose ~1e-6
    rounding at 26 every q carries, gave 7e-6 to 2e-5 over 60)."""
    n, v, h, k = 16, 50, 16, 4
    for draw in range(3):
        g = torch.Generator().manual_seed(seed + draw)
        x = torch.randn(n, h, generator=g)
        w = 0.1 * torch.randn(v, h, generator=g)
        w[:k] = 0.0
        b = torch.zeros(v)
        b[:k] = 25.0
        ids = torch.arange(k).repeat(n, 1)
        logprobs = torch.log_softmax(torch.randn(n, k, generator=g), -1)
        logprobs[: n // 2] += math.log1p(-1e-9)
        options = dict(loss="jsd", beta=beta, tail="bucket", tail_clamp=1e-7, reduction="sum")
        dev = _device(backend)
        leaves = [t.to(dev).requires_grad_() for t in (x, w, b)]
        loss = flashkd.fused_linear_distill_topk(leaves[0], leaves[1], ids.to(dev), logprobs.to(dev), None,
                                                 student_bias=leaves[2], backend=backend, **options)
        grads = [g.cpu() for g in torch.autograd.grad(loss, leaves)]
        ref_leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
        ref = topk_loss(ref_leaves[0], ref_leaves[1], ids, logprobs, student_bias=ref_leaves[2], **options)[0]
        ref_grads = torch.autograd.grad(ref, ref_leaves)
        assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item()), (draw, loss.item(), ref.item())
        for name, a, r in zip(("dX", "dW", "db"), grads, ref_grads):
            assert rel_err(a, r) <= 1e-5, (draw, name, rel_err(a, r))


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_tail_clamp_in_fp32_where_one_category_holds_the_mass(backend, beta, seed):
    """dL/dz per row in fp32 against float64 truth, the logits exact (an identity head): rows of an open
    student against a clamped teacher (the rest holds ~98 % of q; a reverse KL's g_rest ≈ 16 against a
    dz_rest ~1e-2), and rows of a student whose first id's logit is 30 (q ≈ 1 − 1e-11 there, dL/dz ~1e-11)
    against an open teacher. log_softmax's backward, g − q Σ g, cancels on both: 2e-4 and ~1 relative. The
    peaked rows within 1e-3 (float64 truth is itself ~1e-5 off there: the same cancellation at 1e-16), the
    open rows within 1e-5 at β 0 and 1 (at 0.3 the JSD's own gradient cancels to ~1e-4 on them, in TRL's
    formula too), the whole gradient within 1e-5."""
    n, v, k = 16, 40, 4
    g = torch.Generator().manual_seed(seed)
    z = 2.0 * torch.randn(n, v, generator=g)
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n)])
    peaked = torch.arange(n) % 2 == 1
    z[peaked, ids[peaked, 0]] = 30.0
    rest = torch.where(peaked, 0.3, torch.where(torch.arange(n) % 4 == 0, 1e-9, 3e-7)).double()[:, None]
    others = torch.where(peaked[:, None], 0.1, 1e-10) * (0.5 + torch.rand(n, k - 1, generator=g, dtype=torch.float64))
    logprobs = torch.cat([1 - rest - others.sum(-1, keepdim=True), others], -1).log().float()
    options = dict(loss="jsd", beta=beta, tail="bucket", tail_clamp=1e-7, reduction="sum")
    dev = _device(backend)
    x, eye = z.clone().to(dev).requires_grad_(), torch.eye(v)
    (dz,) = torch.autograd.grad(flashkd.fused_linear_distill_topk(x, eye.to(dev), ids.to(dev), logprobs.to(dev), None,
                                                                  backend=backend, **options), [x])
    dz = dz.cpu()
    xd = z.double().requires_grad_()
    (want,) = torch.autograd.grad(topk_loss(xd, eye.double(), ids, logprobs, **options)[0], [xd])
    row = (dz.double() - want).norm(dim=1) / want.norm(dim=1)
    assert row[peaked].max() <= 1e-3, row[peaked]
    if beta != 0.3:
        assert row[~peaked].max() <= 1e-5, row[~peaked]
    assert rel_err(dz, want) <= 1e-5, rel_err(dz, want)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("tail, clamp", [("bucket", None), ("renormalize", None), ("bucket", 1e-7)])
def test_teacher_entropy_and_per_teacher_stats(backend, tail, clamp, seed):
    """Each teacher's (rows, soft sum, teacher entropy sum) over the rows that count, the −1 rows in no
    teacher's; the totals are the oracle's; row_weight weighs the soft sums, not the counts."""
    dtype, tol = tolerance(backend)
    lead = (3, 5)
    ids, logprobs = _peaked_topk(lead, dtype)
    index = torch.randint(-1, 3, lead)
    weight = torch.rand(lead, dtype=dtype) + 0.5
    options = dict(loss="jsd", beta=0.3, tail=tail, tail_clamp=clamp)
    out, _, ref, _, _, labels, entropy, xs, ws, _ = _run(backend, dtype, lead, ids, logprobs, teacher_index=index,
                                                         num_teachers=3, row_weight=weight, **options)
    stats = out[-1]
    ref_w = topk_loss(xs.detach().double(), ws.detach().double(), ids, logprobs, labels, reduction="sum",
                      row_weight=weight, **options)
    valid = labels != -100
    assert stats.rows.item() == int(valid.sum())
    # per row: the oracle's weighted soft term, one row a call
    per_row = torch.stack([topk_loss(xs.detach().double()[i, j:j + 1], ws.detach().double(), ids[i, j:j + 1],
                                     logprobs[i, j:j + 1], labels[i, j:j + 1], reduction="sum",
                                     row_weight=weight[i, j:j + 1], **options)[1]
                           for i in range(lead[0]) for j in range(lead[1])]).reshape(lead)
    assert abs(stats.soft_sum.item() - ref_w[1].item()) <= tol * max(abs(ref_w[1].item()), 1.0)
    assert abs(stats.teacher_entropy_sum.item() - entropy.sum().item()) <= tol * max(entropy.sum().item(), 1.0)
    entropy = entropy.reshape(lead)
    assert stats.per_teacher.shape == (3, 3) and stats.per_teacher.dtype == stats.soft_sum.dtype
    for t in range(3):
        mine = (index == t) & valid
        want = torch.stack([mine.sum().double(), per_row[mine].sum(), entropy[mine].sum()])
        got = stats.per_teacher[t].double().cpu()
        assert got[0].item() == want[0].item(), (t, got, want)
        assert ((got - want).abs() <= tol * want.abs().clamp_min(1.0)).all(), (t, got, want)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_rows_without_signal_and_ignored_rows(backend, seed):
    """A row with no used slot: loss 0, gradient 0 (TRL's `has_teacher_signal` rows), under the clamped
    bucket and renormalisation alike; an ignored row's NaN log-probs reach nothing."""
    dtype, tol = tolerance(backend)
    xs, ws, _, labels = make_student((9,), dtype, ignore="none")
    ids, logprobs = make_topk((9,), unused=False)
    ids[:3] = -1
    labels[3] = -100
    logprobs = logprobs.to(dtype).clone()
    logprobs[3] = math.nan
    dev = _device(backend)  # the call's inputs there; the oracle's (student_stats) on the CPU
    xd = xs if dev == "cpu" else xs.detach().to(dev).requires_grad_()
    wd, idsd, lpd, yd = (t.to(dev) for t in (ws, ids, logprobs, labels))
    for tail, clamp in (("bucket", 1e-7), ("renormalize", None)):
        run = lambda x, i, lp, y: flashkd.fused_linear_distill_topk(  # noqa: E731
            x, wd, i, lp, y, loss="jsd", beta=0.3, tail=tail, tail_clamp=clamp, reduction="sum", backend=backend,
            return_stats=True)
        loss, stats = run(xd, idsd, lpd, yd)
        (g,) = torch.autograd.grad(loss, [xd])
        g = g.cpu()
        assert torch.isfinite(g).all() and g[:4].abs().max() == 0
        rest, rest_stats = run(xd[4:], idsd[4:], lpd[4:], yd[4:])
        assert abs(loss.item() - rest.item()) <= tol * max(rest.item(), 1.0)
        assert stats.teacher_entropy_sum.item() == pytest.approx(rest_stats.teacher_entropy_sum.item(), rel=tol)
        # the rows without signal count (TRL counts them too), with the student's entropy over the vocab
        ent, rows, _ = student_stats(xs.detach().double(), ws.detach().double(), labels)
        assert stats.rows.item() == rows == 8
        assert abs(stats.entropy_sum.item() - ent.item()) <= tol * ent.item()


def test_new_options_bad_input():
    xs, ws, _, labels = make_student((4,), torch.float32, ignore="none")
    ids, logprobs = make_topk((4,), unused=False)
    index = torch.tensor([0, 1, 0, -1])
    run = flashkd.fused_linear_distill_topk
    cases = [
        (dict(tail_clamp=1e-7, tail="renormalize"), ValueError, "tail_clamp: expected None with tail='renormalize'"),
        (dict(tail_clamp=0.0), ValueError, r"tail_clamp: expected a finite float > 0"),
        (dict(tail_clamp=math.inf), ValueError, r"tail_clamp: expected a finite float > 0"),
        (dict(tail_clamp="1e-7"), TypeError, "tail_clamp: expected a Python float or None"),
        (dict(tail_clamp=True), TypeError, "tail_clamp: expected a Python float or None"),
        (dict(teacher_index=index), TypeError, "num_teachers: expected an int with teacher_index, got None"),
        (dict(teacher_index=index, num_teachers=0), ValueError, "num_teachers: expected an int >= 1, got 0"),
        (dict(num_teachers=2), ValueError, "num_teachers: expected None without teacher_index"),
        (dict(teacher_index=index, num_teachers=2, return_stats=False), ValueError,
         "teacher_index: expected return_stats=True"),
        (dict(teacher_index=index.float(), num_teachers=2), TypeError, "teacher_index: expected an integer dtype"),
        (dict(teacher_index=index[:3], num_teachers=2), ValueError, r"teacher_index: expected shape \(4,\)"),
        (dict(teacher_index=index.tolist(), num_teachers=2), TypeError, "teacher_index: expected a torch.Tensor"),
        (dict(teacher_index=index, num_teachers=1), ValueError,
         r"teacher_index: expected values in \[0, 1\) or -1 \(no teacher\), got 1 in row 1"),
        (dict(teacher_index=index - 1, num_teachers=2), ValueError, "got -2 in row 3"),
    ]
    for change, error, message in cases:
        args = dict(loss="jsd", tail="bucket", return_stats=True)
        args.update(change)
        with pytest.raises(error, match=message):
            run(xs, ws, ids, logprobs, labels, **args)
    # an ignored row's index is not checked; unchecked (as on GPU) an out-of-range index is in no teacher's sums
    y = labels.clone()
    y[1] = -100
    assert run(xs, ws, ids, logprobs, y, return_stats=True, teacher_index=index, num_teachers=1)[1].per_teacher[0, 0] == 2
    stats = run(xs, ws, ids, logprobs, return_stats=True, teacher_index=index + 5, num_teachers=2,
                check_teacher=False)[1]
    assert stats.per_teacher.abs().max() == 0
    # a teacher's mass past 1 is refused under the exact bucket, defined (the rest clamped) under tail_clamp
    used = ids >= 0
    lifted = logprobs - torch.logsumexp(logprobs.masked_fill(~used, -math.inf), -1, keepdim=True) + math.log(1.05)
    with pytest.raises(ValueError, match="summing to at most 1"):
        run(xs, ws, ids, lifted, tail="bucket")
    assert torch.isfinite(run(xs, ws, ids, lifted, tail="bucket", tail_clamp=1e-7))
