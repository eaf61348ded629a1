"""Inputs that used to give silently wrong results, each pinned on both backends (torch; triton under
the interpreter): label dtypes, non-finite values in ignored rows, the frozen-student (evaluation)
path, teacher_topk's temperature and non-finite hidden states, top-k mass past 1, the names in error
messages, and fp64 math."""

import math

import pytest
import torch

import flashkd
from conftest import BACKENDS
from flashkd.losses import PARAMETERS, LossSpec
from helpers.cases import read
from oracle import distill_loss, topk_loss

N, V, HS, HT, K = 7, 11, 4, 5, 3


def student(dtype=torch.float32, bias=True):
    xs = torch.randn(N, HS, dtype=dtype, requires_grad=True)
    ws = torch.randn(V, HS, dtype=dtype, requires_grad=True)
    bs = torch.randn(V, dtype=dtype, requires_grad=True) if bias else None
    y = torch.randint(0, V, (N,))
    y[[1, 4]] = -100
    return xs, ws, bs, y


def teacher(form, dtype=torch.float32):
    """The teacher's arguments of one input form (a dict of keyword arguments)."""
    if form == "heads":
        return dict(teacher_input=torch.randn(N, HT, dtype=dtype), teacher_weight=torch.randn(V, HT, dtype=dtype))
    if form == "logits":
        return dict(teacher_logits=3 * torch.randn(N, V, dtype=dtype))
    ids = torch.stack([torch.randperm(V)[:K] for _ in range(N)])
    ids[0, -1] = -1
    lp = torch.log_softmax(torch.randn(N, V, dtype=torch.float64), -1).gather(1, ids.clamp_min(0))
    return dict(teacher_ids=ids, teacher_logprobs=lp.to(dtype))


def call(form, xs, ws, bs, y, t, **options):
    """The public function of `form` on positional student args and the teacher dict `t`."""
    if form == "heads":
        return flashkd.fused_linear_distill(xs, ws, t["teacher_input"], t["teacher_weight"], y, student_bias=bs, **options)
    if form == "logits":
        return flashkd.fused_linear_distill_logits(xs, ws, t["teacher_logits"], y, student_bias=bs, **options)
    options.setdefault("weight_hard_loss", 0.5)
    return flashkd.fused_linear_distill_topk(xs, ws, t["teacher_ids"], t["teacher_logprobs"], y, student_bias=bs,
                                             **options)


FORMS = ["heads", "logits", "topk"]


# ------------------------------------------------------------------------------------------------- labels


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.bool, torch.float32])
def test_labels_outside_int32_int64_are_refused(backend, form, dtype):
    """One rule on both backends: uint8 labels used to wrap ignore_index (−100 is 156 in uint8), so a
    label of 156 silently ignored its row on the torch backend; int8/int16 passed there and failed on
    triton."""
    xs, ws, bs, _ = student()
    labels = torch.full((N,), 156 if dtype == torch.uint8 else 1).to(dtype)
    with pytest.raises(TypeError, match=rf"labels: expected an integer dtype \(torch.int64 or torch.int32\), got {dtype}"):
        call(form, xs, ws, bs, labels, teacher(form), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int32_labels_equal_int64(backend):
    xs, ws, bs, y = student()
    t = teacher("heads")
    want = call("heads", xs, ws, bs, y, t, backend=backend)
    assert torch.equal(call("heads", xs, ws, bs, y.to(torch.int32), t, backend=backend), want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", FORMS)
def test_int32_labels_with_an_ignore_index_past_int32_are_refused(backend, form):
    """2**32 + 5 wrapped to 5 in int32 (torch's comparison and the kernels'): the rows labelled 5 were
    dropped, and the backends disagreed. int64 labels keep it, and every row counts (the oracle)."""
    xs, ws, bs, y = student()
    y[:] = 5
    y[[1, 4]] = 2
    t = teacher(form)
    for bad in (2**32 + 5, 2**31, -(2**31) - 1):
        with pytest.raises(ValueError, match=r"ignore_index: expected a value in \[-2\*\*31, 2\*\*31\) with torch.int32 labels"):
            call(form, xs, ws, bs, y.to(torch.int32), t, backend=backend, ignore_index=bad)
    opts = dict(weight_hard_loss=0.5, beta=0.3)
    got, stats = call(form, xs, ws, bs, y, t, backend=backend, ignore_index=2**32 + 5, return_stats=True,
                      **read(opts, "forward_kl" if form == "topk" else "jsd"))
    assert stats.rows.item() == N
    leaves = [z.detach().double() for z in (xs, ws, bs)]
    if form == "heads":
        want = distill_loss(*leaves[:2], t["teacher_input"].double(), t["teacher_weight"].double(), y,
                            student_bias=leaves[2], ignore_index=2**32 + 5, **opts)[0]
    elif form == "logits":
        want = distill_loss(*leaves[:2], None, None, y, student_bias=leaves[2], teacher_logits=t["teacher_logits"].double(),
                            ignore_index=2**32 + 5, **opts)[0]
    else:
        want = topk_loss(*leaves[:2], t["teacher_ids"], t["teacher_logprobs"].double(), y, student_bias=leaves[2],
                         ignore_index=2**32 + 5, **opts)[0]
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    # the edges of int32 stay usable with int32 labels, as with int64 ones
    for edge in (2**31 - 1, -(2**31)):
        y32 = y.to(torch.int32)
        y32[0] = edge
        assert torch.equal(call(form, xs, ws, bs, y32, t, backend=backend, ignore_index=edge),
                           call(form, xs, ws, bs, y32.long(), t, backend=backend, ignore_index=edge))


def test_the_reference_row_losses_refuse_int32_labels_with_an_ignore_index_past_int32():
    """`flashkd.losses.row_losses` and `topk_row_losses`, the pure-torch reference, still compared in int32:
    2**32 + 5 wrapped to 5 and the rows labelled 5 were dropped. Refused as the public functions refuse it."""
    from flashkd.losses import row_losses, topk_row_losses

    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(6, 11, generator=g), torch.randn(6, 11, generator=g)
    y = torch.tensor([5, 1, 5, 2, 3, 4], dtype=torch.int32)
    ids = t.topk(3).indices
    topk = (ids, t.log_softmax(-1).gather(1, ids))
    match = r"^ignore_index: expected a value in \[-2\*\*31, 2\*\*31\) with torch.int32 labels .*, got 4294967301$"
    for rows, teacher, tail in ((row_losses, t, None), (topk_row_losses, topk, "bucket")):
        spec = LossSpec(ignore_index=2**32 + 5, tail=tail)
        with pytest.raises(ValueError, match=match):
            rows(s, teacher, y, spec)
        assert (rows(s, teacher, y.long(), spec)[1] > 0).all()  # int64 labels keep it: every row counts
        edge = LossSpec(ignore_index=2**31 - 1, tail=tail)
        assert torch.equal(rows(s, teacher, y, edge)[1], rows(s, teacher, y.long(), edge)[1])


# ------------------------------------------------------------------------- non-finite values in ignored rows


# (where the non-finite value goes, the forms that have it)
POISON = [("student_input", f) for f in FORMS] + [("teacher_input", "heads"), ("teacher_logits", "logits"),
                                                  ("teacher_logprobs", "topk")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where,form", POISON)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nonfinite_values_in_ignored_rows_contribute_nothing(backend, where, form, value, seed):
    """A NaN or inf in a row whose label is ignore_index (padding): the loss and every gradient are
    those of the same call with that row finite, its dX row is 0, and nothing is NaN. dW = dSᵀX used
    to be NaN from 0 · NaN even where dS was 0, and the torch backend's autograd gave NaN through the
    row's logits."""
    xs, ws, bs, y = student()
    t = teacher(form)
    clean = [xs.detach().clone().requires_grad_(), ws.detach().clone().requires_grad_(),
             bs.detach().clone().requires_grad_()]
    want = call(form, *clean, y, t, backend=backend, chunk_size=3)
    want.backward()
    with torch.no_grad():
        if where == "student_input":
            xs[4, 1] = value
        elif where == "teacher_input":
            t[where] = t[where].clone()
            t[where][1, 2] = value
        else:
            t[where] = t[where].clone()
            t[where][4, 0] = value
    got = call(form, xs, ws, bs, y, t, backend=backend, chunk_size=3)
    got.backward()
    assert torch.isfinite(got) and torch.allclose(got, want, rtol=1e-6, atol=0), (got, want)
    for g, w in zip((xs.grad, ws.grad, bs.grad), (c.grad for c in clean)):
        assert torch.isfinite(g).all() and torch.allclose(g, w, rtol=1e-5, atol=1e-7)
    assert xs.grad[[1, 4]].abs().max() == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where,form", POISON)
def test_nan_in_a_counted_row_is_not_silent(backend, where, form):
    """Only ignored rows are masked: a NaN in a row that counts still gives a NaN loss."""
    xs, ws, bs, y = student()
    t = teacher(form)
    with torch.no_grad():
        if where == "student_input":
            xs[0, 1] = math.nan
        else:
            t[where] = t[where].clone()
            t[where][0, 0] = math.nan
    # a NaN log-prob is refused by the CPU check; unchecked (as on GPU) it is a NaN loss
    options = dict(check_teacher=False) if form == "topk" else {}
    assert torch.isnan(call(form, xs, ws, bs, y, t, backend=backend, **options))


def test_topk_checks_skip_ignored_rows():
    """check_teacher looks at the rows that count only: an ignored row may hold anything."""
    xs, ws, bs, y = student()
    t = teacher("topk")
    t["teacher_ids"][1] = torch.tensor([V + 5, 0, 0])  # out of range and duplicated, in an ignored row
    t["teacher_logprobs"][1] = torch.tensor([0.5, math.nan, 0.0])
    assert torch.isfinite(call("topk", xs, ws, bs, y, t))
    t["teacher_ids"][0, 0] = V + 5
    with pytest.raises(ValueError, match="teacher_ids: expected ids in"):
        call("topk", xs, ws, bs, y, t)


# ------------------------------------------------------------------------------------------ evaluation path


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_frozen_student_does_not_train_the_teacher(backend):
    """With nothing of the student requiring grad, the call is an evaluation: no graph at all, even
    through a teacher whose weight and bias require grad (the torch backend used to build one through
    every chunk's teacher logits, and backward() trained the teacher)."""
    xs, ws, bs, y = student()
    for x in (xs, ws, bs):
        x.requires_grad_(False)
    wt = torch.randn(V, HT, requires_grad=True)
    bt = torch.randn(V, requires_grad=True)
    xt = torch.randn(N, HT, requires_grad=True)
    loss = flashkd.fused_linear_distill(xs, ws, xt, wt, y, student_bias=bs, teacher_bias=bt, backend=backend,
                                        chunk_size=3)
    assert loss.grad_fn is None and not loss.requires_grad
    with pytest.raises(RuntimeError):
        loss.backward()
    assert wt.grad is None and bt.grad is None and xt.grad is None
    other = flashkd.fused_linear_distill(xs, ws, xt, wt, y, student_bias=bs, teacher_bias=bt,
                                         backend="torch" if backend == "triton" else BACKENDS[-1])
    torch.testing.assert_close(loss, other)
    want, _, _ = distill_loss(xs, ws, xt.detach(), wt.detach(), y, student_bias=bs, teacher_bias=bt.detach())
    assert abs(loss.item() - want.item()) <= 2e-5 * abs(want.item())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["heads", "logits"])
def test_training_gives_the_teacher_no_grad(backend, form):
    xs, ws, bs, y = student()
    t = {k: v.requires_grad_() for k, v in teacher(form).items()}
    call(form, xs, ws, bs, y, t, backend=backend).backward()
    assert xs.grad is not None and all(v.grad is None for v in t.values())


# -------------------------------------------------------------------------------------------- teacher_topk


@pytest.mark.parametrize("temperature", [math.inf, -math.inf, math.nan, 0.0, -1.0, True, "1"])
def test_teacher_topk_temperature_is_finite_and_positive(temperature):
    """LossSpec's rule; temperature=inf used to return uniform log-probs."""
    x, w = torch.randn(4, HT), torch.randn(V, HT)
    with pytest.raises((TypeError, ValueError), match="temperature: expected"):
        flashkd.teacher_topk(x, w, 3, temperature=temperature)


@pytest.mark.parametrize("backend,dtype,value", [
    ("torch", torch.float32, math.nan), ("torch", torch.float32, math.inf), ("torch", torch.float64, math.nan),
] + [("triton", torch.float32, v) for v in (math.nan, math.inf) if "triton" in BACKENDS])
def test_teacher_topk_nonfinite_hidden_states_raise(backend, dtype, value):
    """NaN targets used to come back silently (and be written by flashkd.data.write_topk_targets).
    The row named is the row of teacher_input, across chunks; the Triton path finds it in the host
    sync it already makes per chunk."""
    x, w = torch.randn(2, 3, HT, dtype=dtype), torch.randn(V, HT, dtype=dtype)
    x[1, 1, 3] = value  # row 4 of 6: the second chunk
    with pytest.raises(ValueError, match="teacher_input: expected hidden states with finite logits, .* in row 4 "):
        flashkd.teacher_topk(x, w, 3, chunk_size=4, backend=backend)
    if backend == "torch":  # the finite case on the kernel: test_forms
        x[1, 1, 3] = 0.0
        ids, lp = flashkd.teacher_topk(x, w, 3, chunk_size=4, backend=backend)
        assert torch.isfinite(lp).all() and lp.dtype == dtype


# ----------------------------------------------------------------------------------------- top-k mass > 1


def rounded(lp, dtype):
    return lp.to(dtype).float()


@pytest.mark.parametrize("store", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 2, 5, 64, 200])
def test_stored_topk_targets_pass_the_mass_check(store, k):
    """Genuine targets rounded to fp16 / bf16 (as flashkd.data stores them, read back as fp32) pass the
    check, in its worst case: a uniform teacher over k = V ids, every log-prob rounded the same way."""
    v = k
    xs, ws = torch.randn(3, HS), torch.randn(v, HS)
    y = torch.randint(0, v, (3,))
    for x in (torch.zeros(3, 2), torch.randn(3, 2)):
        ids, lp = flashkd.teacher_topk(x, torch.randn(v, 2), k)
        for given in (rounded(lp, store), lp.to(store)):
            loss = flashkd.fused_linear_distill_topk(xs, ws, ids, given, y)
            assert torch.isfinite(loss)


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_mass_past_one_is_refused_with_tail_bucket(backend):
    """Log-probs whose probabilities sum past 1 (+ the rounding tolerance) are not a distribution: the
    CPU check refuses them (they used to be renormalised). Unchecked (the GPU default) the bucket is
    empty (p_rest = 0) and p is renormalised over the ids, as documented."""
    xs, ws, bs, y = student()
    t = teacher("topk")
    ids = t["teacher_ids"]
    # Σ p = 1 over the used slots; logits in [0, 1) keep every p ≤ e / (e + K − 1) < 1 / 1.05, so the
    # rescaled rows below pass 1 in their sum, never in one log-prob above 0 (another error)
    lp = torch.log_softmax(torch.rand(N, K), -1)
    lp[0] = torch.tensor([0.3, 0.3, 0.4]).log()  # ids[0, -1] is unused: row 0 sums to 0.6, 0.63 over
    over = lp + math.log(1.05)
    with pytest.raises(ValueError, match=r"teacher_logprobs: expected probabilities summing to at most 1 .* in row 2"):
        flashkd.fused_linear_distill_topk(xs, ws, ids, over, y, backend=backend)
    assert torch.isfinite(flashkd.fused_linear_distill_topk(xs, ws, ids, lp, y, backend=backend))
    unchecked = flashkd.fused_linear_distill_topk(xs, ws, ids, over, y, backend=backend, check_teacher=False)
    masked = torch.where(ids >= 0, over, -math.inf)
    renormalised = torch.where(masked.exp().sum(-1, keepdim=True) > 1, masked.log_softmax(-1), over)
    want, _, _ = topk_loss(xs.detach(), ws.detach(), ids, renormalised, y)
    assert abs(unchecked.item() - want.item()) <= 2e-5 * abs(want.item())
    # with tail="renormalize" only ratios count: log-probs rescaled to another τ (Σ p > 1) are valid
    flashkd.fused_linear_distill_topk(xs, ws, ids, over * 0.5, y, tail="renormalize", backend=backend)


# ---------------------------------------------------------------------------------------- names in errors


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("keyword,value,error", [
    ("weight_hard_loss", math.nan, TypeError), ("weight_soft_loss", "0.5", TypeError),
    ("weight_hard_loss", True, TypeError), ("beta", math.nan, TypeError), ("temperature", math.inf, TypeError),
    ("temperature_squared", 2, TypeError), ("return_soft_hard_loss", "yes", TypeError),
    ("check_labels", 1, TypeError), ("grad_accum_dtype", torch.float16, TypeError),
    ("grad_accum_dtype", torch.float64, TypeError), ("chunk_size", True, ValueError),
    ("ignore_index", 1.5, TypeError),
])
def test_errors_name_the_keyword_the_caller_passed(form, keyword, value, error):
    """Not LossSpec's field (weight_hard): the keyword of the public function."""
    xs, ws, bs, y = student()
    # a loss parameter's value is checked where the loss reads it (the top-k default, forward_kl, reads no beta)
    loss = dict(loss="jsd") if form == "topk" and keyword in PARAMETERS else {}
    with pytest.raises(error) as info:
        call(form, xs, ws, bs, y, teacher(form), **loss, **{keyword: value})
    assert str(info.value).startswith(f"{keyword}: expected"), str(info.value)


@pytest.mark.parametrize("keyword,sign,exponent,error", [
    ("temperature", 1, 400, TypeError), ("beta", -1, 400, TypeError), ("weight_soft_loss", 1, 400, TypeError),
    ("student_softcap", 1, 400, ValueError), ("student_logit_scale", 1, 5000, ValueError),
    ("ignore_index", 1, 5000, ValueError),
])
def test_an_int_too_large_for_a_float_is_an_error_naming_the_keyword(keyword, sign, exponent, error):
    """math.isfinite raised OverflowError on it, an error no caller names the argument of (and a
    vocab-parallel call did not carry it to the other ranks, which waited); past 4300 digits even its
    repr raises."""
    xs, ws, bs, y = student()
    shown = rf"~{'-' if sign < 0 else ''}10\*\*{exponent} \(an int too large for a float\)"
    with pytest.raises(error, match=rf"^{keyword}: expected .*, got {shown}$"):
        call("heads", xs, ws, bs, y, teacher("heads"), **{keyword: sign * 10**exponent})
    t = teacher("heads")
    with pytest.raises(TypeError, match=r"^temperature: expected a finite Python float, got ~10\*\*400 "):
        flashkd.teacher_topk(t["teacher_input"], t["teacher_weight"], 2, temperature=10**400)
    with pytest.raises(ValueError, match=r"^teacher_softcap: expected a finite float > 0 \(or None for no cap\), got ~10"):
        flashkd.teacher_topk(t["teacher_input"], t["teacher_weight"], 2, teacher_softcap=10**400)


def test_modules_name_their_own_arguments():
    xs, ws, bs, y = student()
    t = teacher("heads")
    with pytest.raises(TypeError, match="^weight_soft_loss: expected a finite"):
        flashkd.FusedLinearDistillLoss(weight_soft_loss=math.nan)(xs, ws, t["teacher_input"], t["teacher_weight"], y)
    with pytest.raises(ValueError, match="^true_labels: expected shape"):  # Liger's name for the labels
        flashkd.FusedLinearJSDLoss()(xs, ws, t["teacher_input"], t["teacher_weight"], y[:-1])
    with pytest.raises(TypeError, match="^weight_hard_loss: expected a finite"):
        flashkd.FusedLinearCosineSimilarityLoss(weight_hard_loss=math.inf)(xs, ws, t["teacher_input"],
                                                                             t["teacher_weight"], y)
    with pytest.raises(TypeError, match="^weight_hard: expected"):  # LossSpec's own users see its fields
        LossSpec(weight_hard=math.nan)


# ---------------------------------------------------------------------------------------------------- fp64


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", FORMS)
def test_gradcheck_fp64_on_every_backend(backend, form, seed):
    """fp64 inputs get fp64 math on every backend (backend="triton" routes them to the torch rows; its
    kernels compute in fp32, which gradcheck cannot pass)."""
    xs, ws, bs = (torch.randn(*shape, dtype=torch.float64, requires_grad=True) for shape in ((5, 2), (6, 2), (6,)))
    y = torch.tensor([1, -100, 5, 0, 2])
    f64 = dict(dtype=torch.float64)
    t = dict(teacher_input=torch.randn(5, 3, **f64), teacher_weight=torch.randn(6, 3, **f64),
             teacher_logits=torch.randn(5, 6, **f64), teacher_ids=torch.tensor([[0, 3]] * 5),
             teacher_logprobs=torch.tensor([[-1.0, -2.0]] * 5, **f64))

    def f(xs, ws, bs):
        return call(form, xs, ws, bs, y, t, loss="jsd", temperature=1.3, chunk_size=3, backend=backend)

    assert torch.autograd.gradcheck(f, (xs, ws, bs))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("grad", [True, False])
def test_loss_dtype(backend, form, dtype, grad):
    """fp32 for fp16 / bf16 / fp32 inputs, fp64 for fp64, on every backend, form and path; the logged
    terms too."""
    xs, ws, bs, y = student(dtype)
    with torch.set_grad_enabled(grad):
        loss, soft, hard = call(form, xs, ws, bs, y, teacher(form, dtype), backend=backend, return_soft_hard_loss=True)
    want = torch.float64 if dtype == torch.float64 else torch.float32
    assert loss.dtype == soft.dtype == hard.dtype == want and loss.requires_grad == grad


# ---------------------------------------------------------------------------------- found by an adversarial sweep


def test_degenerate_arguments_are_named():
    """An empty vocab or hidden size used to fail deep inside (ZeroDivisionError, a reshape error), and an
    ignore_index past int64 with an OverflowError; each is now an error naming the argument."""
    xs, ws, bs, y = student()
    t = teacher("heads")
    cases = [
        (dict(student_input=torch.randn(N, 0), student_weight=torch.randn(V, 0)), "student_weight: expected a 2-D"),
        (dict(student_weight=torch.randn(0, HS), labels=None, weight_hard_loss=0.0), "student_weight: expected a 2-D"),
        (dict(teacher_input=torch.randn(N, 0), teacher_weight=torch.randn(V, 0)), "teacher_weight: expected a 2-D"),
        (dict(ignore_index=2**70), "ignore_index: expected an int64 value"),
    ]
    for change, message in cases:
        args = dict(student_input=xs, student_weight=ws, labels=y, **t)
        args.update(change)
        with pytest.raises(ValueError, match=message):
            flashkd.fused_linear_distill(**args)
    with pytest.raises(ValueError, match="teacher_weight: expected a 2-D"):
        flashkd.teacher_topk(torch.randn(3, 0), torch.randn(V, 0), 2)


# ------------------------------------------------------------------------------- the KLs at a small τ


@pytest.mark.parametrize("loss,grad", [("reverse_kl", True), ("reverse_kl", False), ("forward_kl", False)])
@pytest.mark.parametrize("tau", [0.01, 0.001])
@pytest.mark.parametrize("heads", [dict(student_logit_scale=1.3, teacher_logit_scale=0.7), dict(student_softcap=20.0),
                                   dict(teacher_softcap=20.0)])
def test_a_kl_at_a_small_temperature_is_not_fp32_noise(loss, grad, tau, heads, seed):
    """The KLs the Triton kernel takes in one pass (reverse KL; forward KL without grad) formed
    E_q[z_s − z_t] and max z_s − max z_t apart, each ~|z| (30 at a trained model's peaks), and
    subtracted them: where the two distributions agree the difference is ~0, and its rounding was
    multiplied by 1/τ in the loss and 1/τ² in the gradient (a negative KL, gradients of 0.2 where the
    truth is 1e-55). Held to 4× the torch backend's error on the same inputs, never looser than 1e-6
    nor tighter than fp32 allows: rounding z/τ alone (|z|/τ up to 3·10^4 here) moves the loss by up to
    u·Σ|∂L/∂z·z|, u = 2^-24, and each element g_i of its gradient by u·Σ_j|∂g_i/∂z_j·z_j|; an fp32
    evaluation rounds values of that size a few times (the floor takes 8). The defect this guards
    against was 10^4 times that."""
    g = torch.Generator().manual_seed(seed)
    v = 200
    s = 4 * torch.randn(16, v, generator=g, dtype=torch.float64)
    s[:, :3] += 30 * torch.rand(16, 1, generator=g, dtype=torch.float64)  # peaks up to 30
    sigma_s, sigma_t = heads.get("student_logit_scale", 1.0), heads.get("teacher_logit_scale", 1.0)
    t = s * sigma_s / sigma_t  # the same distributions but for the softcap: a KL near 0
    xs, ws, tl = s.float(), torch.eye(v), t.float()
    kw = dict(loss=loss, temperature=tau, weight_hard_loss=0.0, weight_soft_loss=1.0, **heads)

    def row_loss(x, xt):  # one row's share of the mean loss, in float64
        zs, zt = x * sigma_s, xt * sigma_t
        if "student_softcap" in heads:
            zs = 20.0 * torch.tanh(zs / 20.0)
        if "teacher_softcap" in heads:
            zt = 20.0 * torch.tanh(zt / 20.0)
        lq, lp = torch.log_softmax(zs / tau, -1), torch.log_softmax(zt / tau, -1)
        return ((lq.exp() * (lq - lp)) if loss == "reverse_kl" else (lp.exp() * (lp - lq))).sum(-1) / len(xs)

    x, xt = xs.double(), tl.double()
    want = torch.func.vmap(row_loss)(x, xt).sum()
    want_grad, want_grad_t = torch.func.vmap(torch.func.grad(row_loss, argnums=(0, 1)))(x, xt)
    u = 2.0**-24
    conditioning = u * ((want_grad * x).abs().sum() + (want_grad_t * xt).abs().sum()).item()
    # the same for each element of the gradient: u·Σ_j |∂g_i/∂z_j · z_j|, the Hessian's rows per row
    hess, hess_t = torch.func.vmap(torch.func.jacrev(torch.func.grad(row_loss), argnums=(0, 1)))(x, xt)
    grad_conditioning = u * ((hess.abs() * x.abs()[:, None]).sum(-1) + (hess_t.abs() * xt.abs()[:, None]).sum(-1)).max().item()

    def error(backend):
        x = xs.clone().requires_grad_(grad)
        got = flashkd.fused_linear_distill_logits(x, ws, tl, None, backend=backend, **kw)
        err = abs(got.item() - want.item())
        if grad:
            err = (err, (torch.autograd.grad(got, x)[0].double() - want_grad).abs().max().item())
        return err if grad else (err,)

    floor = (max(1e-6 * max(1.0, abs(want.item())), 8 * conditioning),
             max(1e-6 * max(1.0, want_grad.abs().max().item()), 8 * grad_conditioning))
    for backend in BACKENDS:
        for got, torch_err, least in zip(error(backend), error("torch"), floor):
            assert got <= max(4 * torch_err, least), (backend, got, torch_err)
