"""The teacher's other input forms against the float64 oracle: top-k (sparse), dense logits, teacher_topk. The
Triton backend on DEVICE (the GPU, or the CPU under Triton's interpreter), the torch backend and the oracle on
the CPU."""

import itertools
import math

import pytest
import torch

import flashkd
from conftest import BACKEND_PARAMS, _device, _on
from helpers.cases import HS, HT, K, V, check_against_oracle, make_student, make_topk, read, rel_err, tolerance
from helpers.ties import drop_tied_rows, logits64
from oracle import distill_loss, topk_loss


def check_topk(backend, dtype, lead, *, tol, bias=False, ignore="some", chunk_size=None, k=K, unused=True,
               **options):
    ignore_index = options.get("ignore_index", -100)
    xs, ws, bs, labels = make_student(lead, dtype, bias=bias, ignore=ignore, ignore_index=ignore_index)
    ids, logprobs = make_topk(lead, k, temperature=options.get("temperature", 1.0), unused=unused)
    logprobs = logprobs.to(dtype)
    labels = drop_tied_rows(labels, logits64(xs, ws, bs), ids=ids, logprobs=logprobs, **options)
    xs_, ws_, bs_, ids_, logprobs_, labels_ = _on(_device(backend), xs, ws, bs, ids, logprobs, labels)
    loss, soft, hard = flashkd.fused_linear_distill_topk(
        xs_, ws_, ids_, logprobs_, labels_, student_bias=bs_, chunk_size=chunk_size, backend=backend,
        return_soft_hard_loss=True, **read(options, "forward_kl"),
    )
    leaves = [xs, ws] + ([bs] if bias else [])
    grads = [g.cpu() for g in torch.autograd.grad(loss, [xs_, ws_] + ([bs_] if bias else []))]
    ref_leaves = [x.detach().double().requires_grad_() for x in leaves]
    ref = topk_loss(ref_leaves[0], ref_leaves[1], ids, logprobs, labels, student_bias=ref_leaves[2] if bias else None,
                    **options)
    ref_grads = torch.autograd.grad(ref[0], ref_leaves, allow_unused=True)
    assert loss.dim() == 0 and torch.isfinite(loss)
    check_against_oracle((loss, soft, hard), ref, grads, ref_grads, leaves, tol,
                         None if ignore == "none" else labels, ignore_index)


# Every loss × tail × τ × weights; bias, shape, reduction and ignore pattern cycle through the cases.
TOPK_GRID = [
    (loss, tail, tau, weights, i)
    for i, (loss, tail, tau, weights) in enumerate(
        itertools.product(
            ["forward_kl", "reverse_kl", "jsd", "tvd"],
            ["bucket", "renormalize"],
            [1.0, 0.6, 2.3],
            [(0.0, 1.0), (0.4, 0.7)],
        )
    )
]


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("loss,tail,tau,weights,i", TOPK_GRID)
def test_topk_matches_oracle(backend, loss, tail, tau, weights, i, seed):
    dtype, tol = tolerance(backend)
    check_topk(
        backend, dtype, [(23,), (3, 7)][i % 2], tol=tol, bias=i % 3 == 0, ignore=["some", "none", "all"][i % 3],
        chunk_size=[None, 5][i % 2], loss=loss, tail=tail, temperature=tau, weight_hard_loss=weights[0],
        weight_soft_loss=weights[1], beta=0.35, reduction=["mean", "sum"][(i // 2) % 2],
    )


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("tail", ["bucket", "renormalize"])
@pytest.mark.parametrize(
    "options",
    [
        dict(loss="jsd", beta=0.0),
        dict(loss="jsd", beta=1.0),
        dict(loss="forward_kl", temperature_squared=True, temperature=2.0),
        dict(loss="tvd", ignore_index=5, weight_hard_loss=1.0),
        dict(loss="jsd", weight_hard_loss=0.0, weight_soft_loss=0.0),
        dict(loss="forward_kl", weight_hard_loss=1.0, weight_soft_loss=0.0),
    ],
)
def test_topk_options(backend, tail, options, seed):
    dtype, tol = tolerance(backend)
    check_topk(backend, dtype, (19,), tol=tol, tail=tail, **options)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("loss", ["forward_kl", "jsd", "reverse_kl", "tvd"])
def test_topk_covering_the_vocab_is_the_dense_loss(backend, loss, seed):
    """K = V, every slot used: the bucket is empty and the loss is the dense one on the teacher's logits."""
    dtype, tol = tolerance(backend)
    check_topk(backend, dtype, (9,), tol=tol, k=V, unused=False, loss=loss, tail="bucket")
    xs, ws, _, labels = make_student((9,), dtype)
    logits_t = torch.randn(9, V, dtype=dtype)
    ids, logprobs = flashkd.teacher_topk(logits_t, torch.eye(V, dtype=dtype), V)
    xs, ws, labels, logits_t, ids, logprobs = _on(_device(backend), xs, ws, labels, logits_t, ids, logprobs)
    options = dict(loss=loss, weight_hard_loss=0.3, weight_soft_loss=0.7, backend=backend)
    sparse = flashkd.fused_linear_distill_topk(xs, ws, ids, logprobs, labels, **options)
    dense = flashkd.fused_linear_distill_logits(xs, ws, logits_t, labels, **options)
    assert abs(sparse.item() - dense.item()) <= tol * max(abs(dense.item()), 1.0)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_topk_without_labels_and_edge_rows(backend, seed):
    dtype, tol = tolerance(backend)
    xs_cpu, ws_cpu, _, _ = make_student((1,), dtype)  # N = 1
    ids_cpu, logprobs_cpu = make_topk((1,), unused=False)
    xs, ws, ids, logprobs = _on(_device(backend), xs_cpu, ws_cpu, ids_cpu, logprobs_cpu)
    loss = flashkd.fused_linear_distill_topk(xs, ws, ids, logprobs, backend=backend)
    ref = topk_loss(xs_cpu.detach(), ws_cpu.detach(), ids_cpu, logprobs_cpu)[0]
    assert abs(loss.item() - ref.item()) <= tol * max(ref.item(), 1.0)
    # grad_output 0 and negative: finite, scaled
    (g1,) = torch.autograd.grad(flashkd.fused_linear_distill_topk(xs, ws, ids, logprobs, backend=backend), [xs])
    (g0,) = torch.autograd.grad(0 * flashkd.fused_linear_distill_topk(xs, ws, ids, logprobs, backend=backend), [xs])
    (gn,) = torch.autograd.grad(-2.5 * flashkd.fused_linear_distill_topk(xs, ws, ids, logprobs, backend=backend), [xs])
    assert g0.abs().max() == 0 and torch.allclose(gn, -2.5 * g1)
    # N = 0
    empty = flashkd.fused_linear_distill_topk(xs[:0], ws, ids[:0], logprobs[:0], backend=backend)
    assert empty.item() == 0


def test_topk_reverse_kl_is_infinite_when_the_teacher_has_no_tail(seed):
    """p_rest = 0 (the teacher's K probabilities sum to 1) while q_rest > 0: KL(q‖p) is +inf, as defined."""
    xs, ws, _, _ = make_student((2,), torch.float64)
    ids = torch.tensor([[0, 1], [2, 3]])
    logprobs = torch.log(torch.tensor([[0.5, 0.5], [0.25, 0.75]], dtype=torch.float64))
    loss = flashkd.fused_linear_distill_topk(xs, ws, ids, logprobs, loss="reverse_kl")
    assert loss.item() == math.inf
    assert torch.isfinite(flashkd.fused_linear_distill_topk(xs, ws, ids, logprobs, loss="jsd"))


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_topk_dtypes(backend, ids_dtype, seed):
    """int32 ids and log-probs of another float dtype than the student's are read as they are."""
    xs, ws, _, labels = make_student((11,), torch.float32)
    ids, logprobs = make_topk((11,))
    xs, ws, labels, ids, logprobs = _on(_device(backend), xs, ws, labels, ids, logprobs)
    a = flashkd.fused_linear_distill_topk(xs, ws, ids.to(ids_dtype), logprobs.to(torch.bfloat16), labels,
                                          backend=backend)
    b = flashkd.fused_linear_distill_topk(xs, ws, ids, logprobs.to(torch.bfloat16).float(), labels, backend=backend)
    assert torch.allclose(a, b, rtol=1e-6)


def test_topk_bad_input():
    xs, ws, _, labels = make_student((4,), torch.float32, ignore="none")  # the checks skip ignored rows
    ids, logprobs = make_topk((4,), unused=False)
    run = flashkd.fused_linear_distill_topk
    cases = [
        (dict(teacher_ids=ids.masked_fill(ids == ids[0, 0], V)), ValueError, r"teacher_ids: expected ids in \[0, 37\) or -1"),
        (dict(teacher_ids=ids.masked_fill(ids == ids[0, 0], -2)), ValueError, "teacher_ids: expected ids .* got -2"),
        (dict(teacher_ids=torch.cat([ids[:, :1], ids[:, :-1]], 1)), ValueError, "teacher_ids: expected distinct ids"),
        (dict(teacher_logprobs=logprobs[:, :-1]), ValueError, r"teacher_logprobs: expected shape \(4, 7\)"),
        (dict(teacher_logprobs=logprobs.abs() + 0.1), ValueError, "teacher_logprobs: expected log-probabilities <= 0"),
        (dict(teacher_logprobs=logprobs.masked_fill(ids == ids[1, 2], math.nan)), ValueError, "not NaN"),
        (dict(teacher_ids=ids.float()), TypeError, "teacher_ids: expected an integer dtype"),
        (dict(teacher_logprobs=logprobs.long()), TypeError, "teacher_logprobs: expected a floating dtype"),
        (dict(teacher_ids=ids[:3], teacher_logprobs=logprobs[:3]), ValueError, r"teacher_ids: expected leading dims \(4,\)"),
        (dict(teacher_ids=ids[:, :0], teacher_logprobs=logprobs[:, :0]), ValueError, "K >= 1"),
        (dict(loss="cosine"), ValueError, "loss: expected one of 'jsd', 'forward_kl', 'reverse_kl', 'tvd'"),
        (dict(tail="drop"), ValueError, "tail: expected 'bucket' or 'renormalize', got 'drop'"),
        (dict(teacher_ids=ids.tolist()), TypeError, "teacher_ids: expected a torch.Tensor"),
    ]
    for change, error, message in cases:
        args = dict(teacher_ids=ids, teacher_logprobs=logprobs, loss="forward_kl", tail="bucket")
        args.update(change)
        with pytest.raises(error, match=message):
            run(xs, ws, args.pop("teacher_ids"), args.pop("teacher_logprobs"), labels, **args)
    # on request the value checks are skipped (as on GPU): an out-of-range id gives NaN, not a bad read
    bad = ids.masked_fill(ids == ids[0, 0], V + 5)
    out = run(xs, ws, bad, logprobs, check_teacher=False, reduction="sum", return_soft_hard_loss=True)
    assert math.isnan(out[1].item())


# ------------------------------------------------------------------------------------------ dense logits


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("loss", ["jsd", "forward_kl", "reverse_kl", "tvd", "cosine"])
@pytest.mark.parametrize("layout", ["contiguous", "padded", "row-strided", "3-d"])
def test_logits_matches_oracle(backend, loss, layout, seed):
    dtype, tol = tolerance(backend)
    lead = (3, 5) if layout == "3-d" else (17,)
    dev = _device(backend)
    xs, ws, bs, labels = make_student(lead, dtype, bias=layout == "padded")
    if layout == "padded":  # a padded teacher head: columns >= V are dropped
        logits_t = torch.randn(*lead, V + 4, dtype=dtype)
        call_t = logits_t.to(dev)
    elif layout == "row-strided":  # rows of a bigger buffer: read in place
        rows = torch.randn(*lead, V + 9, dtype=dtype)
        logits_t, call_t = rows[:, 3 : 3 + V], rows.to(dev)[:, 3 : 3 + V]  # the same layout on dev
    else:
        logits_t = torch.randn(*lead, V, dtype=dtype)
        call_t = logits_t.to(dev)
    options = dict(loss=loss, beta=0.35, temperature=0.8, weight_hard_loss=0.3, weight_soft_loss=0.9)
    labels = drop_tied_rows(labels, logits64(xs, ws, bs), logits_t, **options)
    xs_, ws_, bs_, labels_ = _on(dev, xs, ws, bs, labels)
    loss_, soft, hard = flashkd.fused_linear_distill_logits(
        xs_, ws_, call_t, labels_, student_bias=bs_, backend=backend, chunk_size=4, return_soft_hard_loss=True,
        vocab_size=V if layout == "padded" else None, **read(options),
    )
    leaves = [xs, ws] + ([bs] if bs is not None else [])
    grads = [g.cpu() for g in torch.autograd.grad(loss_, [xs_, ws_] + ([bs_] if bs is not None else []))]
    ref_leaves = [x.detach().double().requires_grad_() for x in leaves]
    ref = distill_loss(ref_leaves[0], ref_leaves[1], None, None, labels, teacher_logits=logits_t,
                       student_bias=ref_leaves[2] if bs is not None else None, **options)
    ref_grads = torch.autograd.grad(ref[0], ref_leaves)
    for name, got, want in zip(("loss", "soft", "hard"), (loss_, soft, hard), ref):
        assert abs(got.item() - want.item()) <= tol * max(abs(want.item()), 1.0), (name, got.item(), want.item())
    for name, g, rg in zip(("dXs", "dWs", "dbs"), grads, ref_grads):
        assert rel_err(g, rg) <= tol, (name, rel_err(g, rg))


def test_logits_bad_input():
    xs, ws, _, labels = make_student((4,), torch.float32)
    run = flashkd.fused_linear_distill_logits
    cases = [
        (torch.randn(4, V, dtype=torch.float64), TypeError, "teacher_logits: expected dtype torch.float32"),
        (torch.randn(5, V), ValueError, r"teacher_logits: expected leading dims \(4,\)"),
        (torch.randn(4, V - 1), ValueError, r"teacher_logits: expected 37 columns \(the student's vocab\), got 36"),
        (torch.randn(4, V + 4), ValueError,  # a padded head must be declared: vocab_size=V
         r"teacher_logits: expected 37 columns \(the student's vocab\), got 41: ambiguous\. .*pass vocab_size=37"),
        (torch.randn(V, 4).t(), None, None),  # column-major: read per chunk with a copy, fine
        (torch.randn(2, 4, V).transpose(0, 1)[:, 0], None, None),
        (torch.randn(4, 2, V).transpose(0, 1), ValueError, r"teacher_logits: expected leading dims \(4,\)"),
        (torch.randn(()), ValueError, "teacher_logits: expected a tensor of shape"),
    ]
    for logits_t, error, message in cases:
        if error is None:
            ref = run(xs, ws, logits_t.contiguous(), labels)
            assert torch.allclose(run(xs, ws, logits_t, labels), ref)
        else:
            with pytest.raises(error, match=message):
                run(xs, ws, logits_t, labels)
    with pytest.raises(ValueError, match=r"^vocab_size: expected 37 \(the student's vocab: student_weight's rows\), got 41"):
        run(xs, ws, torch.randn(4, V + 4), labels, vocab_size=V + 4)  # vocab_size is the student's vocab
    xs3 = torch.randn(2, 3, HS)
    t3 = torch.randn(3, 2, V).transpose(0, 1)  # leading dims that cannot flatten without a copy
    with pytest.raises(ValueError, match="teacher_logits: expected leading dims that flatten without a copy"):
        run(xs3, ws, t3, weight_hard_loss=0.0)


# ----------------------------------------------------------------------------------------- teacher_topk


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_teacher_topk(backend, temperature, seed):
    x = torch.randn(3, 9, HT)
    w = torch.randn(V + 3, HT)
    b = torch.randn(V + 3)
    ids, logprobs = (t.cpu() for t in flashkd.teacher_topk(*_on(_device(backend), x, w), 5, temperature=temperature,
                                                           teacher_bias=b.to(_device(backend)), vocab_size=V,
                                                           chunk_size=4, backend=backend))
    assert ids.shape == (3, 9, 5) and ids.dtype == torch.int64 and logprobs.dtype == torch.float32
    ref = torch.log_softmax((x.double() @ w[:V].double().T + b[:V].double()) / temperature, -1)
    top = ref.topk(5, -1)
    assert torch.equal(ids, top.indices)
    assert (logprobs.double() - top.values).abs().max() < 1e-5
    assert (logprobs[..., :-1] >= logprobs[..., 1:]).all()


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_teacher_topk_with_ties(backend, dtype, seed):
    """Low-precision logits tie often: any of the tied ids may be chosen, but every chosen logit is at
    least every other one, the ids are distinct, and the log-probs are the float64 log-softmax."""
    k, n = 9, 6
    x = torch.randn(n, V, dtype=torch.float64)
    x[0] = 0.0  # one value everywhere
    x[1, ::2] = x[1].max()  # the max many times over
    x[2, 5:] = -1e4  # masked after 5 ids (not −inf: the GEMM with the identity would make 0 · −inf)
    x = x.to(dtype)
    ids, logprobs = (t.cpu() for t in flashkd.teacher_topk(*_on(_device(backend), x, torch.eye(V, dtype=dtype)), k,
                                                           temperature=0.9, backend=backend))
    chosen = x.gather(1, ids).double()
    others = x.double().scatter(1, ids, -math.inf)
    assert (chosen.min(1).values >= others.max(1).values).all()
    assert all(len(set(row.tolist())) == k for row in ids)
    truth = torch.log_softmax(x.double() / 0.9, -1).gather(1, ids)
    assert ((logprobs.double() - truth).abs() <= 1e-5 * truth.abs().clamp_min(1.0)).all()


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("k", [12, 100])  # 100: more than the kernel's lanes, torch.topk's case
def test_teacher_topk_hard_rows(backend, k, seed):
    """Rows the Triton kernel cannot finish alone (its top values crowded into one lane of a tile, or a
    threshold tied by the whole row) come out exact too."""
    v = 1000
    x = torch.randn(4, v)
    x[0, 3::64] += 8.0  # the largest values all in lane 3 of every 64-column tile (and of 256 too)
    x[1] = 1.5  # every value tied
    x[2, :40] = 9.0  # 40 ties at the top, k of them to pick
    ids, logprobs = (t.cpu() for t in flashkd.teacher_topk(*_on(_device(backend), x, torch.eye(v)), k, backend=backend))
    chosen, others = x.gather(1, ids), x.scatter(1, ids, -math.inf)
    assert (chosen.min(1).values >= others.max(1).values).all()
    assert all(len(set(row.tolist())) == k for row in ids)
    truth = torch.log_softmax(x.double(), -1).gather(1, ids)
    assert (logprobs.double() - truth).abs().max() < 1e-5


def test_teacher_topk_bad_input():
    x, w = torch.randn(4, HT), torch.randn(V, HT)
    cases = [
        (dict(k=0), "k: expected an int in"),
        (dict(k=V + 1), r"k: expected an int in \[1, 37\]"),
        (dict(vocab_size=V + 1), "vocab_size: expected an int in"),
        (dict(temperature=0.0), "temperature: expected a value > 0"),
        (dict(teacher_bias=torch.randn(V - 1)), r"teacher_bias: expected shape \(37,\)"),
        (dict(teacher_input=torch.randn(4, HT + 1)), "teacher_input: expected shape"),
        (dict(teacher_weight=torch.randn(V, HT, dtype=torch.float64)), r"teacher_weight: expected dtype torch.float32 \(the dtype of teacher_input\)"),
        (dict(chunk_size=0), "chunk_size: expected a positive int"),
    ]
    for change, message in cases:
        args = dict(teacher_input=x, teacher_weight=w, k=3)
        args.update(change)
        with pytest.raises((ValueError, TypeError), match=message):
            flashkd.teacher_topk(args.pop("teacher_input"), args.pop("teacher_weight"), args.pop("k"), **args)


# ------------------------------------------------------------------------------------------------- backward


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_backward_twice_with_retained_graph(backend, seed):
    """Backward scales the saved grads in place unless the graph is kept: a second backward through a
    retained graph must still see them unscaled."""
    xs, ws, _, labels = make_student((13,), torch.float32)
    ids, logprobs = make_topk((13,))
    xs, ws, ids, logprobs, labels = _on(_device(backend), xs, ws, ids, logprobs, labels)
    loss = flashkd.fused_linear_distill_topk(xs, ws, ids, logprobs, labels, backend=backend)
    (once,) = torch.autograd.grad(loss, [xs], retain_graph=True)
    (scaled,) = torch.autograd.grad(3.0 * loss, [xs], retain_graph=True)
    (last,) = torch.autograd.grad(loss, [xs])
    assert torch.allclose(scaled, 3.0 * once) and torch.equal(last, once)
    with pytest.raises(RuntimeError):  # the graph is freed now, as for any autograd op
        torch.autograd.grad(loss, [xs])
