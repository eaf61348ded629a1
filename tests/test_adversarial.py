"""The public API as an ML engineer would misuse it, on small irregular shapes and both backends: autograd
contexts (create_graph, autocast), odd layouts and the argument checks. Every result is checked against
the float64 oracle (tests/oracle.py); every refusal must name the argument, what was expected and what came."""

import math

import pytest
import torch

import flashkd
from conftest import BACKENDS
from helpers.ties import drop_tied_rows, logits64
from oracle import distill_loss, topk_loss

N, HS, V, HT, K = 37, 19, 203, 23, 7
FORMS = ["heads", "logits", "topk"]


def student(dtype=torch.float32, lead=(N,), bias=False):
    xs = torch.randn(*lead, HS, dtype=dtype, requires_grad=True)
    ws = (0.3 * torch.randn(V, HS, dtype=dtype)).requires_grad_()
    bs = torch.randn(V, dtype=dtype, requires_grad=True) if bias else None
    y = torch.randint(0, V, lead)
    y.view(-1)[::5] = -100
    return xs, ws, bs, y


def teacher(form, dtype=torch.float32, lead=(N,)):
    """The teacher's keyword arguments of one input form."""
    if form == "heads":
        return dict(teacher_input=torch.randn(*lead, HT, dtype=dtype), teacher_weight=0.3 * torch.randn(V, HT, dtype=dtype))
    if form == "logits":
        return dict(teacher_logits=2 * torch.randn(*lead, V, dtype=dtype))
    logits = torch.log_softmax(2 * torch.randn(*lead, V, dtype=torch.float64), -1)
    lp, ids = logits.topk(K)
    return dict(teacher_ids=ids, teacher_logprobs=lp.to(dtype))


def call(form, xs, ws, y, t, **options):
    if form == "heads":
        return flashkd.fused_linear_distill(xs, ws, t["teacher_input"], t["teacher_weight"], y,
                                            teacher_bias=t.get("teacher_bias"), **options)
    if form == "logits":
        return flashkd.fused_linear_distill_logits(xs, ws, t["teacher_logits"], y, **options)
    options.setdefault("weight_hard_loss", 0.5)
    return flashkd.fused_linear_distill_topk(xs, ws, t["teacher_ids"], t["teacher_logprobs"], y, **options)


def oracle(form, xs, ws, y, t, **options):
    """The float64 loss of the naive formula, differentiable w.r.t. xs and ws."""
    xs, ws = xs.double(), ws.double()
    if form == "heads":
        return distill_loss(xs, ws, t["teacher_input"], t["teacher_weight"], y, teacher_bias=t.get("teacher_bias"),
                            **options)[0]
    if form == "logits":
        return distill_loss(xs, ws, None, None, y, teacher_logits=t["teacher_logits"], **options)[0]
    options.setdefault("weight_hard_loss", 0.5)
    return topk_loss(xs, ws, t["teacher_ids"], t["teacher_logprobs"], y, **options)[0]


# ------------------------------------------------------------------------------------ double backward


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", FORMS)
def test_create_graph_is_refused_not_silently_first_order(backend, form):
    """create_graph=True (a gradient penalty, gradgradcheck) raises, naming why. The gradients used to come
    back as constants, so a penalty built on them silently added nothing to the gradients; the plain
    first-order gradients and retain_graph are unchanged (checked against the oracle)."""
    xs, ws, _, y = student(torch.float64)
    t = teacher(form, torch.float64)
    loss = call(form, xs, ws, y, t, backend=backend, chunk_size=10)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(loss, [xs, ws], create_graph=True)
    dx, dw = torch.autograd.grad(loss, [xs, ws], retain_graph=True)
    ref_dx, ref_dw = torch.autograd.grad(oracle(form, xs, ws, y, t), [xs, ws])
    torch.testing.assert_close(dx, ref_dx, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(dw, ref_dw, rtol=1e-9, atol=1e-12)
    with pytest.raises(RuntimeError, match="create_graph=True"):  # another branch wanting a graph
        torch.autograd.grad(loss + (xs**3).sum(), [xs], create_graph=True)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.gradgradcheck(lambda a: call(form, a, ws.detach(), y, t, backend=backend), (xs.detach().requires_grad_(),))


# ------------------------------------------------------------------------------------------- autocast


def _check_close(got, want, tol):
    assert got.shape == want.shape, (got.shape, want.shape)
    err = (got.double() - want).abs().max().item()
    assert err <= tol * max(want.abs().max().item(), 1.0), err


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_leaves_the_loss_in_its_inputs_dtype(backend, form, dtype):
    """Under torch.autocast (an fp32 model in a bf16 run) the loss used to fail inside its dX GEMM
    ("Expected out tensor to have dtype BFloat16"). It computes in its inputs' dtype, as without
    autocast: the same loss and gradients, bit for bit, and the oracle's."""
    xs, ws, bs, y = student(bias=True)
    t = teacher(form)
    args = dict(backend=backend, chunk_size=10, student_bias=bs)
    plain = call(form, xs, ws, y, t, **args)
    plain_grads = torch.autograd.grad(plain, [xs, ws, bs])
    with torch.autocast("cpu", dtype=dtype):
        loss = call(form, xs, ws, y, t, **args)
    grads = torch.autograd.grad(loss, [xs, ws, bs])
    assert loss.dtype == torch.float32 and torch.equal(loss, plain)
    for g, p in zip(grads, plain_grads):
        assert g.dtype == torch.float32 and torch.equal(g, p)
    leaves = [x.detach().double().requires_grad_() for x in (xs, ws, bs)]
    ref = oracle(form, leaves[0], leaves[1], y, t, student_bias=leaves[2])
    _check_close(loss, ref, 1e-5)
    for g, r in zip(grads, torch.autograd.grad(ref, leaves)):
        _check_close(g, r, 1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_autocast_leaves_teacher_topk_in_its_inputs_dtype(backend):
    """teacher_topk under autocast used to take its logits from a bf16 GEMM of fp32 inputs (ids and
    log-probs off by 2e-2 from the float64 truth, silently): it computes in its inputs' dtype."""
    xt, wt = torch.randn(N, HT), 0.3 * torch.randn(V, HT)
    plain = flashkd.teacher_topk(xt, wt, K, backend=backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ids, lp = flashkd.teacher_topk(xt, wt, K, backend=backend)
    assert torch.equal(ids, plain[0]) and torch.equal(lp, plain[1]) and lp.dtype == torch.float32
    ref_lp, ref_ids = torch.log_softmax(xt.double() @ wt.double().T, -1).topk(K)
    assert torch.equal(ids, ref_ids)
    _check_close(lp, ref_lp, 1e-5)


# ------------------------------------------------------------------------------------------- TopKCollator


def _one_target():
    logits = torch.log_softmax(torch.randn(3, V, dtype=torch.float64), -1)
    lp, ids = logits.topk(2)
    ids[2, 1] = -1
    return ids, lp.float()


@pytest.mark.parametrize("target,message", [
    (lambda ids, lp: (ids.float() + 0.7, lp), "targets['a']: expected ids of dtype torch.int32 or torch.int64, got torch.float32"),
    (lambda ids, lp: (ids > 2, lp), "targets['a']: expected ids of dtype torch.int32 or torch.int64, got torch.bool"),
    (lambda ids, lp: (ids.clamp_min(0).to(torch.int16), lp), "got torch.int16"),
    (lambda ids, lp: (ids, lp.long()), "targets['a']: expected logprobs of a floating dtype (float16, bfloat16, float32, float64), got torch.int64"),
    (lambda ids, lp: (ids.numpy(), lp.numpy()), "targets['a']: expected a pair (ids, logprobs) of torch.Tensors, got a tuple of (ndarray, ndarray)"),
    (lambda ids, lp: (ids,), "targets['a']: expected a pair (ids, logprobs) of torch.Tensors, got a tuple of (Tensor)"),
    (lambda ids, lp: ids, "targets['a']: expected a pair (ids, logprobs) of torch.Tensors, got Tensor"),
])
def test_collator_refuses_targets_it_would_cast(target, message):
    """A mapping's targets of another dtype used to be cast in silence: float ids truncated (an unused
    slot's -1 + 0.7 became id 0, a token with the teacher's mass), bool ids read as 0/1, int16 ids kept,
    integer log-probs taken as floats; non-tensors failed with an AttributeError."""
    ids, lp = _one_target()
    features = [{"key": "a", "input_ids": torch.tensor([7, 8, 9])}]
    with pytest.raises(TypeError) as info:
        flashkd.TopKCollator({"a": target(ids, lp)})(features)
    assert message in str(info.value), str(info.value)


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("lp_dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_collator_takes_the_dtypes_the_loss_takes(ids_dtype, lp_dtype):
    ids, lp = _one_target()
    features = [{"key": "a", "input_ids": torch.tensor([7, 8, 9])}]
    batch = flashkd.TopKCollator({"a": [ids.to(ids_dtype), lp.to(lp_dtype)]})(features)
    assert torch.equal(batch["teacher_ids"][0], ids)
    assert torch.equal(batch["teacher_logprobs"][0], lp.to(lp_dtype).float())


# ------------------------------------------------------------------------------------------------ modules


@pytest.mark.parametrize("options,message", [
    (dict(bogus=3), "bogus: expected a keyword option of flashkd.fused_linear_distill"),
    (dict(chunksize=8), "chunksize: expected a keyword option of flashkd.fused_linear_distill"),
    (dict(student_bias=torch.zeros(V)), "student_bias: expected as an argument of forward (per-call data), not as an option"),
    (dict(row_weight=torch.ones(N)), "row_weight: expected as an argument of forward (per-call data), not as an option"),
    (dict(labels=torch.zeros(N, dtype=torch.long)), "labels: expected as an argument of forward"),
])
def test_module_refuses_unknown_options_when_built(options, message):
    """A misspelt option (or per-call data given as one) used to pass construction and fail at the first
    forward, with Python's 'unexpected keyword argument' or 'multiple values for keyword argument'."""
    with pytest.raises(TypeError) as info:
        flashkd.FusedLinearDistillLoss(loss="jsd", **options)
    assert message in str(info.value), str(info.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_module_matches_the_oracle(backend):
    xs, ws, bs, y = student(lead=(3, 13), bias=True)
    t = teacher("heads", lead=(3, 13))
    rw = torch.rand(3, 13) + 0.5
    # TVD's gradient jumps where q = p: rows tied within fp32's reach count on neither side
    y = drop_tied_rows(y, logits64(xs, ws, bs), logits64(t["teacher_input"], t["teacher_weight"]), loss="tvd",
                       temperature=1.7)
    module = flashkd.FusedLinearDistillLoss(loss="tvd", chunk_size=5, backend=backend, temperature=1.7)
    loss = module(xs, ws, t["teacher_input"], t["teacher_weight"], y, student_bias=bs, row_weight=rw)
    grads = torch.autograd.grad(loss, [xs, ws, bs])
    leaves = [x.detach().double().requires_grad_() for x in (xs, ws, bs)]
    ref = oracle("heads", leaves[0], leaves[1], y, t, student_bias=leaves[2], loss="tvd", temperature=1.7, row_weight=rw)
    _check_close(loss, ref, 1e-5)
    for g, r in zip(grads, torch.autograd.grad(ref, leaves)):
        _check_close(g, r, 1e-4)


# ------------------------------------------------------------------------------- layouts, requires_grad


def _offset(x):
    """x as a view at a storage offset of 3 elements, and its base (a leaf requiring grad if x does)."""
    base = torch.zeros(x.numel() + 3, dtype=x.dtype)
    base[3:] = x.detach().reshape(-1)
    base.requires_grad_(x.requires_grad)
    return base[3:].view(x.shape), base


def _layout(layout, form, xs, ws, bs, y, t):
    """(xs, ws, bs, y, t, leaves): the same values in another memory layout; leaves require grad."""
    if layout == "stride-0":  # expanded: every row the same (stride 0 over the rows)
        row = xs[:1].detach().requires_grad_()
        xs, leaves = row.expand_as(xs), [row]
        y = y[:1].expand_as(y) if y[0] != -100 else torch.zeros(1, dtype=y.dtype).expand_as(y)
        t = {k: v[:1].expand_as(v) if k != "teacher_weight" else v for k, v in t.items()}
        bias = bs[:1].detach().requires_grad_()
        bs = bias.expand_as(bs)
        return xs, ws, bs, y, t, leaves + [ws, bias]
    if layout == "offset":  # views into larger storage
        (xs, xb), (ws, wb), (bs, bb) = _offset(xs), _offset(ws), _offset(bs)
        t = {k: _offset(v)[0] for k, v in t.items()}
        return xs, ws, bs, y, t, [xb, wb, bb]
    if layout == "transposed-3d":  # (B, T, ·) made from (T, B, ·): leading dims that do not flatten as a view
        b = 3
        lead = (b, N // b)
        n = lead[0] * lead[1]
        xt_ = xs[:n].detach().reshape(*lead, HS).transpose(0, 1).contiguous().requires_grad_()
        t = {k: (v[:n].reshape(*lead, -1).transpose(0, 1).contiguous().transpose(0, 1) if k != "teacher_weight" else v)
             for k, v in t.items()}
        if form == "logits":  # teacher_logits are read in place: their leading dims must flatten as a view
            t["teacher_logits"] = t["teacher_logits"].contiguous()
        wt_ = ws.detach().t().contiguous().requires_grad_()
        return xt_.transpose(0, 1), wt_.t(), bs, y[:n].reshape(lead).t().contiguous().t(), t, [xt_, wt_, bs]
    raise AssertionError(layout)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("layout", ["stride-0", "offset", "transposed-3d"])
def test_layouts_match_the_oracle(backend, form, layout):
    """Expanded (stride-0) inputs, weights, biases, labels and teachers; views at a storage offset; 3-D
    inputs whose leading dims do not flatten as a view: the oracle's loss and gradients, reaching the
    tensors the caller made (the expand's row, the offset view's base)."""
    xs, ws, bs, y = student(bias=True)
    t = teacher(form)
    xs, ws, bs, y, t, leaves = _layout(layout, form, xs, ws, bs, y, t)
    loss = call(form, xs, ws, y, t, backend=backend, chunk_size=4, student_bias=bs)
    grads = torch.autograd.grad(loss, leaves)
    ref_leaves = [x.detach().double().requires_grad_() for x in leaves]
    ref_xs, ref_ws, ref_bs, *_ = _layout_again(layout, ref_leaves, xs, ws, bs)
    ref = oracle(form, ref_xs, ref_ws, y, {k: v.double() if v.is_floating_point() else v for k, v in t.items()},
                 student_bias=ref_bs)
    _check_close(loss, ref, 1e-5)
    for g, r in zip(grads, torch.autograd.grad(ref, ref_leaves)):
        _check_close(g, r, 1e-4)


def _layout_again(layout, leaves, xs, ws, bs):
    """The student's (xs, ws, bs) rebuilt from float64 copies of the leaves, in the same way."""
    if layout == "stride-0":
        return leaves[0].expand(xs.shape), leaves[1], leaves[2].expand(bs.shape)
    if layout == "offset":
        return tuple(leaf[3:].view(x.shape) for leaf, x in zip(leaves, (xs, ws, bs)))
    return leaves[0].transpose(0, 1), leaves[1].t(), leaves[2]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("wanted", ["x", "w", "b", "xb", "wb", ""])
def test_only_what_requires_grad_gets_one(backend, form, wanted):
    """Every combination of the student's tensors requiring grad, with a teacher whose tensors require grad
    too (a live model's parameters): exactly the wanted grads, the oracle's, and none for the teacher."""
    xs, ws, bs, y = student(bias=True)
    for name, x in (("x", xs), ("w", ws), ("b", bs)):
        x.requires_grad_(name in wanted)
    t = {k: v.requires_grad_() if v.is_floating_point() else v for k, v in teacher(form).items()}
    loss = call(form, xs, ws, y, t, backend=backend, chunk_size=9, student_bias=bs)
    want = [x for x in (xs, ws, bs) if x.requires_grad]
    assert loss.requires_grad == bool(want)
    ref_leaves = [x.detach().double().requires_grad_() for x in (xs, ws, bs)]
    ref = oracle(form, ref_leaves[0], ref_leaves[1], y, {k: v.detach() for k, v in t.items()}, student_bias=ref_leaves[2])
    _check_close(loss.detach(), ref.detach(), 1e-5)
    if want:
        loss.backward()
        ref_grads = torch.autograd.grad(ref, ref_leaves)
        for x, r in zip((xs, ws, bs), ref_grads):
            if x.requires_grad:
                _check_close(x.grad, r, 1e-4)
            else:
                assert x.grad is None
    assert all(v.grad is None for v in t.values() if v.is_floating_point())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("stride", ["column", "stride-0"])
def test_labels_of_any_stride(backend, form, stride):
    """Labels that are a column of a (N, 2) tensor or an expand (stride 2, 0): the top-k Triton kernel
    read them as contiguous in its CE gradient (the loss right, dX 1.4e-2 off); every form now gives
    the oracle's gradients."""
    xs, ws, _, y = student()
    t = teacher(form)
    labels = torch.stack([torch.randint(0, V, (N,)), y], 1)[:, 1] if stride == "column" else y[1:2].expand(N)
    loss = call(form, xs, ws, labels, t, backend=backend, chunk_size=8, weight_hard_loss=0.7)
    grads = torch.autograd.grad(loss, [xs, ws])
    leaves = [x.detach().double().requires_grad_() for x in (xs, ws)]
    ref = oracle(form, *leaves, labels.contiguous(), t, weight_hard_loss=0.7)
    _check_close(loss, ref, 1e-5)
    for g, r in zip(grads, torch.autograd.grad(ref, leaves)):
        _check_close(g, r, 1e-4)


# ---------------------------------------------------------------------------------------------- refusals


def _bad(form):
    """(change, error, words) cases of `form` not in the other test files' tables."""
    cases = [
        (dict(student_weight=torch.randint(0, 3, (V, HS))), TypeError, ["student_weight", "torch.float32", "torch.int64"]),
        (dict(student_bias=torch.randn(1, V)), ValueError, ["student_bias", f"({V},)", f"(1, {V})"]),
        (dict(student_bias=torch.randn(V, dtype=torch.float64)), TypeError, ["student_bias", "torch.float32", "torch.float64"]),
        (dict(labels=torch.zeros(N, 1, dtype=torch.long)), ValueError, ["labels", f"({N},)", f"({N}, 1)"]),
        (dict(labels=torch.zeros(1, N, dtype=torch.long)), ValueError, ["labels", f"({N},)", f"(1, {N})"]),
        (dict(labels=torch.full((N,), V + 7)), ValueError, ["labels", f"[0, {V})", f"got {V + 7}"]),
        (dict(labels=torch.full((N,), -100), ignore_index=-1), ValueError, ["labels", "ignore_index=-1", "got -100"]),
        (dict(row_weight=torch.ones(N, dtype=torch.long)), TypeError, ["row_weight", "floating", "torch.int64"]),
        (dict(row_weight=torch.ones(N, 1)), ValueError, ["row_weight", f"({N},)", f"({N}, 1)"]),
        (dict(reduction="batchmean"), ValueError, ["reduction", "'batchmean'"]),
        (dict(chunk_size=-3), ValueError, ["chunk_size", "-3"]),
        (dict(chunk_size=2.0), ValueError, ["chunk_size", "2.0"]),
        (dict(temperature=-0.5), ValueError, ["temperature", "-0.5"]),
        (dict(weight_soft_loss=math.inf), TypeError, ["weight_soft_loss", "inf"]),
        (dict(student_softcap=-1.0), ValueError, ["student_softcap", "-1.0"]),
        (dict(student_logit_scale=0.0), ValueError, ["student_logit_scale", "0.0"]),
    ]
    if form == "heads":
        cases += [
            (dict(teacher_input=torch.randn(N, HT, dtype=torch.bfloat16)), TypeError,
             ["teacher_input", "torch.float32", "torch.bfloat16"]),
            (dict(teacher_weight=torch.randint(0, 3, (V, HT))), TypeError, ["teacher_weight", "torch.int64"]),
            (dict(teacher_weight=torch.randn(V + 5, HT), teacher_bias=torch.randn(V), vocab_size=V), ValueError,
             ["teacher_bias", f"({V + 5},)", f"({V},)"]),
            (dict(teacher_weight=torch.randn(V - 1, HT)), ValueError, ["teacher_weight", f"expected {V} rows", f"got {V - 1}"]),
            (dict(teacher_weight=torch.randn(V + 5, HT)), ValueError,
             ["teacher_weight", f"expected {V} rows", f"got {V + 5}: ambiguous", f"pass vocab_size={V}"]),
        ]
    if form == "logits":
        cases += [
            (dict(teacher_logits=torch.randn(N, V, dtype=torch.float16)), TypeError,
             ["teacher_logits", "torch.float32", "torch.float16"]),
            (dict(teacher_logits=torch.randn(N, V - 1)), ValueError, ["teacher_logits", f"expected {V} columns", f"got {V - 1}"]),
            (dict(teacher_logits=torch.randn(N, V + 5)), ValueError,
             ["teacher_logits", f"expected {V} columns", f"got {V + 5}: ambiguous", f"pass vocab_size={V}"]),
            (dict(teacher_logits=torch.randn(N + 1, V)), ValueError, ["teacher_logits", f"({N},)", f"({N + 1},)"]),
        ]
    if form == "topk":
        cases += [
            (dict(teacher_ids=torch.zeros(N, K, dtype=torch.int16)), TypeError, ["teacher_ids", "integer", "torch.int16"]),
            (dict(tail="renormalise"), ValueError, ["tail", "'renormalise'"]),
        ]
    return cases


@pytest.mark.parametrize("form", FORMS)
def test_bad_input_names_the_argument(form):
    for change, error, words in _bad(form):
        xs, ws, _, y = student()
        t = teacher(form)
        args = dict(xs=xs, ws=ws, y=y)
        for name, short in (("student_input", "xs"), ("student_weight", "ws"), ("labels", "y")):
            if name in change:
                args[short] = change.pop(name)
        t.update({k: change.pop(k) for k in list(change) if k in t or k.startswith("teacher_")})
        with pytest.raises(error) as info:
            call(form, args["xs"], args["ws"], args["y"], t, **change)
        for word in words:
            assert word in str(info.value), (form, word, str(info.value))


# ---------------------------------------------------------------------------------------------- contexts


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", FORMS)
def test_no_grad_and_inference_mode_give_the_loss_without_a_graph(backend, form):
    xs, ws, bs, y = student(bias=True)
    t = teacher(form)
    ref = oracle(form, xs.detach(), ws.detach(), y, t, student_bias=bs.detach().double())
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            loss = call(form, xs, ws, y, t, backend=backend, student_bias=bs)
        assert not loss.requires_grad and loss.grad_fn is None
        _check_close(loss, ref, 1e-5)
    with torch.inference_mode():  # inference tensors, used in a call outside inference mode
        frozen = {k: v.clone() for k, v in t.items()}
    loss = call(form, xs, ws, y, frozen, backend=backend, student_bias=bs)
    _check_close(loss.detach(), ref, 1e-5)
    loss.backward()
    assert xs.grad is not None and ws.grad is not None and bs.grad is not None


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_twice_is_torchs_error_and_retain_graph_accumulates(backend):
    xs, ws, _, y = student()
    t = teacher("heads")
    loss = call("heads", xs, ws, y, t, backend=backend)
    loss.backward(retain_graph=True)
    once = xs.grad.clone(), ws.grad.clone()
    loss.backward()
    assert torch.equal(xs.grad, 2 * once[0]) and torch.equal(ws.grad, 2 * once[1])
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


# ----------------------------------------------------------------------------------- HF Trainer options


def test_trainer_refuses_unknown_distill_options_when_built(tmp_path):
    """A misspelt distill_options key used to pass the Trainer's construction and fail at the first
    training step with Python's 'unexpected keyword argument'."""
    transformers = pytest.importorskip("transformers")
    import tiny_models
    from flashkd.integrations.transformers import DistillationTrainer

    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(TypeError, match=r"distill_options: expected keyword options of flashkd.fused_linear_distill "
                                        r"or fused_linear_distill_topk, got 'chunksize'"):
        DistillationTrainer(model=tiny_models.llama(16, 0), args=args, distill_options={"chunksize": 8})
    options = {"chunk_size": 8, "tail": "renormalize"}  # top-k targets (no teacher model): the top-k form's options
    assert DistillationTrainer(model=tiny_models.llama(16, 0), args=args, distill_options=options).distill_options == options
    options = {"teacher_precision": None, "backend": "torch"}  # a live teacher's
    assert DistillationTrainer(model=tiny_models.llama(16, 0), teacher_model=tiny_models.llama(24, 1), args=args,
                               distill_options=options).distill_options == options
    # a live teacher's option without one: the first step's top-k call would not take it
    with pytest.raises(TypeError, match=r"^distill_options: 'teacher_precision' is not a keyword option of "
                                        r"flashkd.fused_linear_distill_topk \(the loss of a top-k teacher\)$"):
        DistillationTrainer(model=tiny_models.llama(16, 0), args=args, distill_options=options)


def test_writer_names_the_example_with_non_finite_hidden_states(tmp_path):
    """A NaN in one example's hidden states was reported as 'teacher_input: ... row 1', an argument
    write_topk_targets does not have: it names the example, and the row in it."""
    pytest.importorskip("safetensors")
    w = torch.randn(V, HS)
    bad = torch.randn(4, HS)
    bad[1, 3] = math.nan
    with pytest.raises(ValueError, match=r"^examples: hidden_states of 'b': expected hidden states with finite "
                                         r"logits, got a NaN or infinite logit in row 1"):
        flashkd.write_topk_targets(tmp_path / "t", [("a", torch.randn(3, HS)), ("b", bad)], w, K)
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("module,labels,message", [
    (lambda: flashkd.FusedLinearJSD(2.0), None, "jsd_beta: expected a value in [0, 1], got 2.0"),
    (lambda: flashkd.FusedLinearJSD(0.5), slice(0, 3), f"shift_labels: expected shape ({N},)"),
    (lambda: flashkd.FusedLinearJSD(0.5, accum_dtype=torch.float16), None, "accum_dtype: expected torch.float32"),
    (lambda: flashkd.FusedLinearJSD(0.5, temperature=0.0), None, "temperature: expected a value > 0"),
])
def test_liger_jsd_drop_in_names_its_own_arguments(module, labels, message):
    """LigerFusedLinearJSD's drop-in reported flashkd's names (beta, labels, grad_accum_dtype) for the
    arguments its callers pass as jsd_beta, shift_labels and accum_dtype."""
    xs, ws, _, y = student()
    t = teacher("heads")
    with pytest.raises((TypeError, ValueError)) as info:
        module()(xs, ws, t["teacher_input"], t["teacher_weight"], y if labels is None else y[labels])
    assert str(info.value).startswith(message), str(info.value)


def test_collator_names_what_it_cannot_use():
    """An empty batch died in torch's default_collate (IndexError), a key that is a list in "unhashable
    type", a 0-d ids tensor in an IndexError, a feature without input_ids (no attention_mask) in a KeyError."""
    ids, lp = _one_target()
    features = [{"key": "a", "input_ids": torch.tensor([7, 8, 9])}]
    cases = [
        (flashkd.TopKCollator({"a": (ids, lp)}), [], ValueError,
         "features: expected a non-empty list of examples (a DataLoader's batch), got an empty list"),
        (flashkd.TopKCollator({"a": (ids, lp)}), [{"key": ["a"], "input_ids": torch.tensor([7, 8, 9])}], TypeError,
         "features[0]['key']: expected the example's key in targets (a str for TopKTargets), got list"),
        (flashkd.TopKCollator({"a": (ids[0, 0], lp[0, 0])}), features, ValueError,
         "targets['a']: expected ids and logprobs of shape (length, K), got () and ()"),
        (flashkd.TopKCollator({"a": (ids, lp)}, lambda f: {"input_ids": torch.zeros(1, 3, dtype=torch.long)}),
         [{"key": "a", "text": "x y z"}], ValueError,
         "features[0]: the batch has no attention_mask, so the example's length is that of its input_ids feature, "
         "and it has none (fields ['key', 'text'])"),
    ]
    # an attention_mask the targets cannot be placed by: another shape, or values .bool() would read as 1
    def masked(mask):
        return flashkd.TopKCollator({"a": (ids, lp)}, lambda f: {"input_ids": torch.zeros(1, 3, dtype=torch.long),
                                                                 "attention_mask": mask})
    cases += [
        (masked(torch.ones(1, 4, dtype=torch.long)), features, ValueError,
         "collate_fn: expected attention_mask of shape (1, 3) (that of input_ids), got (1, 4)"),
        (masked([[1, 1, 1]]), features, ValueError,
         "collate_fn: expected attention_mask of shape (1, 3) (that of input_ids), got list"),
        (masked(torch.tensor([[1, 2, 1]])), features, ValueError,
         "collate_fn: expected an attention_mask of 0s and 1s, got values [2] (dtype torch.int64)"),
        (masked(torch.tensor([[1.0, 0.5, float("nan")]])), features, ValueError,
         "collate_fn: expected an attention_mask of 0s and 1s, got values [0.5, nan] (dtype torch.float32)"),
    ]
    for collator, batch, error, message in cases:
        with pytest.raises(error) as info:
            collator(batch)
        assert str(info.value) == message, str(info.value)
    # bool, int and float masks of 0s and 1s place the targets alike
    for mask in (torch.tensor([[True, True, True]]), torch.tensor([[1, 1, 1]], dtype=torch.int32),
                 torch.tensor([[1.0, 1.0, 1.0]])):
        out = masked(mask)(features)
        assert torch.equal(out["teacher_ids"][0], ids.long()), mask.dtype
