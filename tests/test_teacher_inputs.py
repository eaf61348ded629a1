"""Adversarial inputs of the several-teacher loss (`fused_linear_distill_teachers`), the token map (`token_map`,
`TokenMap.teacher_head`) and GOLD's ULD loss (`uld_alignment`, `fused_linear_uld`): each either gives the
single-teacher call's result, or raises a one-line ValueError / TypeError naming the argument as passed (never an
error of torch's from deep inside, a NaN, or a result of a tensor moved, dropped or read as something else).
The "meta" device stands in for a second device."""

import dataclasses

import pytest
import torch

import flashkd
from flashkd import TokenMap, fused_linear_distill_teachers, fused_linear_uld, uld_alignment

F64 = torch.float64
N, HS, V = 6, 5, 11
HTS = (4, 6)
COMBINES = ["routed", "geometric", "arithmetic", "sum"]
ROUTED = torch.tensor([0, 1, 0, 1, -1, 1])


def _raises(error, words, fn):
    with pytest.raises(error, match=words) as info:
        fn()
    assert "\n" not in str(info.value)


def _teachers(seed):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(N, HS, dtype=F64, generator=g, requires_grad=True)
    ws = torch.randn(V, HS, dtype=F64, generator=g, requires_grad=True)
    xts = [torch.randn(N, h, dtype=F64, generator=g) for h in HTS]
    wts = [torch.randn(V, h, dtype=F64, generator=g) for h in HTS]
    labels = torch.randint(0, V, (N,), generator=g)
    labels[2] = -100
    return xs, ws, xts, wts, labels


def _how(combine):
    return dict(teacher_index=ROUTED) if combine == "routed" else dict(teacher_weights=[0.5, 0.5])


# ---------------------------------------------------------------------------------------------------
# fused_linear_distill_teachers: what reduces to one teacher does


@pytest.mark.parametrize("combine", COMBINES)
def test_one_teacher_or_all_rows_to_one_is_that_teachers_call(combine, seed):
    """M = 1, and M = 2 with every row (routed) or all the weight on teacher 1: fused_linear_distill's value
    and gradients."""
    xs, ws, xts, wts, labels = _teachers(seed)
    one = flashkd.fused_linear_distill(xs, ws, xts[1], wts[1], labels, backend="torch")
    want = torch.autograd.grad(one, [xs, ws])
    alone = dict(teacher_index=torch.zeros(N, dtype=torch.long)) if combine == "routed" else \
        dict(teacher_weights=[1.0])
    both = dict(teacher_index=torch.ones(N, dtype=torch.int32)) if combine == "routed" else \
        dict(teacher_weights=[0.0, 1.0])
    for inputs, heads, how in ((xts[1:], wts[1:], alone), (xts, wts, both)):
        got = fused_linear_distill_teachers(xs, ws, inputs, heads, labels, combine=combine, backend="torch", **how)
        torch.testing.assert_close(got, one, rtol=1e-12, atol=1e-14)
        for a, b in zip(torch.autograd.grad(got, [xs, ws]), want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)


# ---------------------------------------------------------------------------------------------------
# fused_linear_distill_teachers: the refusals


@pytest.mark.parametrize("combine", COMBINES)
def test_an_integer_student_input_is_blamed_on_student_input(combine, seed):
    """geometric checked each teacher against student_input's dtype first: the error named teacher_inputs[0]."""
    xs, ws, xts, wts, labels = _teachers(seed)
    _raises(TypeError, "student_input: expected a floating dtype", lambda: fused_linear_distill_teachers(
        xs.detach().long(), ws, xts, wts, labels, combine=combine, **_how(combine)))


@pytest.mark.parametrize("combine", COMBINES)
@pytest.mark.parametrize("change, error, words", [
    # a head of no hidden size: torch's reshape failed ("cannot reshape tensor of 0 elements")
    (lambda xts, wts: dict(teacher_inputs=[xts[0][:, :0], xts[1]], teacher_heads=[wts[0][:, :0], wts[1]]),
     ValueError, r"teacher_heads\[0\]: expected a 2-D \(vocab, hidden\) tensor, both >= 1, got shape \(11, 0\)"),
    (lambda xts, wts: dict(teacher_heads=[wts[0][:0], wts[1]]), ValueError, r"teacher_heads\[0\]: .*both >= 1"),
    # sparse hidden states: torch's reshape failed; a sparse head's hint named teacher_weight
    (lambda xts, wts: dict(teacher_inputs=[xts[0].to_sparse(), xts[1]]), TypeError,
     r"teacher_inputs\[0\]: expected a dense .*pass teacher_inputs\[0\]\.to_dense\(\)"),
    (lambda xts, wts: dict(teacher_heads=[wts[0], wts[1].to_sparse()]), TypeError,
     r"teacher_heads\[1\]: expected a dense .*pass teacher_heads\[1\]\.to_dense\(\)"),
    # one argument named, and what came
    (lambda xts, wts: dict(teacher_inputs=[xts[0], xts[1].tolist()]), TypeError,
     r"^teacher_inputs\[1\]: expected a torch.Tensor, got list"),
    (lambda xts, wts: dict(teacher_biases=torch.zeros(2, V, dtype=F64)), ValueError,
     "teacher_biases: expected None or a list of 2 .*got Tensor"),
    (lambda xts, wts: dict(teacher_biases=[None] * 3), ValueError, "teacher_biases: .*got 3 entries"),
    (lambda xts, wts: dict(teacher_biases=[0.5, None]), TypeError, r"teacher_biases\[0\]: expected a torch.Tensor"),
    (lambda xts, wts: dict(teacher_biases=[None, torch.zeros(V + 1, dtype=F64)]), ValueError,
     r"teacher_biases\[1\]: .*shape \(11,\), got \(12,\)"),
])
def test_teacher_tensors_are_refused_by_name(combine, change, error, words, seed):
    xs, ws, xts, wts, labels = _teachers(seed)
    kwargs = dict(teacher_inputs=xts, teacher_heads=wts, **_how(combine))
    kwargs.update(change(xts, wts))
    _raises(error, words, lambda: fused_linear_distill_teachers(xs, ws, labels=labels, combine=combine, **kwargs))


def test_teacher_index_on_another_device_is_refused(seed):
    """It was grouped by bincount on its own device: torch's NotImplementedError (meta), or a device clash."""
    xs, ws, xts, wts, labels = _teachers(seed)
    _raises(ValueError, "teacher_index: expected a tensor on cpu .*got meta", lambda: fused_linear_distill_teachers(
        xs, ws, xts, wts, labels, combine="routed", teacher_index=ROUTED.to("meta")))
    _raises(TypeError, "teacher_index: expected a dense", lambda: fused_linear_distill_teachers(
        xs, ws, xts, wts, labels, combine="routed", teacher_index=ROUTED.to_sparse()))


@pytest.mark.parametrize("combine", ["geometric", "arithmetic", "sum"])
@pytest.mark.parametrize("weights, error, words", [
    (torch.tensor([0.5, 0.5], device="meta"), ValueError, "teacher_weights: .*meta"),  # was: "no data!"
    (torch.tensor([0.5, 0.5]).to_sparse(), TypeError, "teacher_weights: expected a dense"),
    (torch.full((N, 2), 0.5).to_sparse(), TypeError, "teacher_weights: expected a dense"),
    ([torch.tensor(0.5), torch.tensor(0.5)], TypeError, r"teacher_weights: expected Python floats .*tensor\(0.5"),
])
def test_teacher_weights_that_cannot_be_read_are_refused(combine, weights, error, words, seed):
    xs, ws, xts, wts, labels = _teachers(seed)
    _raises(error, words, lambda: fused_linear_distill_teachers(xs, ws, xts, wts, labels, combine=combine,
                                                                teacher_weights=weights))


@pytest.mark.parametrize("rows", [V + 3, V - 2])
def test_geometric_heads_off_the_student_vocab_are_named_as_passed(rows, seed):
    """Heads of one row count other than V went into the one call concatenated: its error named teacher_weight."""
    xs, ws, xts, wts, labels = _teachers(seed)
    g = torch.Generator().manual_seed(seed)
    heads = [torch.randn(rows, h, dtype=F64, generator=g) for h in HTS]
    _raises(ValueError, r"^teacher_heads\[0\]: expected 11 rows", lambda: fused_linear_distill_teachers(
        xs, ws, xts, heads, labels, combine="geometric", teacher_weights=[0.5, 0.5]))


def test_geometric_vocab_size_is_checked_against_the_student(seed):
    """vocab_size=V + 1 with heads of V rows was blamed on the heads ("at least 12 rows each")."""
    xs, ws, xts, wts, labels = _teachers(seed)
    _raises(ValueError, "^vocab_size: expected 11", lambda: fused_linear_distill_teachers(
        xs, ws, xts, wts, labels, combine="geometric", teacher_weights=[0.5, 0.5], vocab_size=V + 1))


def test_geometric_padded_head_cut_to_vocab_size(seed):
    """One head padded past V, vocab_size=V: p = softmax(Σ w_m z_m) over each head's first V rows (float64)."""
    xs, ws, xts, wts, labels = _teachers(seed)
    g = torch.Generator().manual_seed(seed)
    padded = torch.cat([wts[0], torch.randn(3, HTS[0], dtype=F64, generator=g)])
    got = fused_linear_distill_teachers(xs, ws, xts, [padded, wts[1]], labels, combine="geometric",
                                        teacher_weights=[0.3, 0.9], vocab_size=V, backend="torch", loss="forward_kl")
    zt = 0.3 * xts[0] @ wts[0].T + 0.9 * xts[1] @ wts[1].T
    p = torch.softmax(zt, -1)
    q = torch.log_softmax(xs @ ws.T, -1)
    keep = labels != -100
    soft = (torch.xlogy(p, p) - p * q).sum(-1)[keep]
    hard = torch.nn.functional.cross_entropy(xs @ ws.T, labels, reduction="none")[keep]
    want = (0.5 * soft + 0.5 * hard).mean()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------------------
# TokenMap.teacher_head


def test_a_map_matching_nothing_is_refused_not_a_nan_loss(seed):
    """No shared token: a bias of −inf everywhere, the teacher's distribution 0/0, a NaN loss."""
    g = torch.Generator().manual_seed(seed)
    tmap = flashkd.token_map({"a": 0, "b": 1, "c": 2}, {"x": 0, "y": 1, "z": 2, "w": 3})
    assert (tmap.index == -1).all()
    _raises(ValueError, "index: expected at least one student id matched .*none of 3",
            lambda: tmap.teacher_head(torch.randn(4, 2, dtype=F64, generator=g)))


def test_a_head_smaller_than_the_maps_teacher_vocab_is_refused(seed):
    """teacher_vocab_size 4, a head of 3 rows (another model's): accepted while the matched ids fit; a padded
    head (more rows) is still taken."""
    g = torch.Generator().manual_seed(seed)
    tmap = TokenMap(torch.tensor([2, -1, 0]), 4)
    _raises(ValueError, "teacher_weight: expected at least 4 rows .*teacher_vocab_size.*got 3",
            lambda: tmap.teacher_head(torch.randn(3, 2, dtype=F64, generator=g)))
    wt = torch.randn(6, 2, dtype=F64, generator=g)
    w, b = tmap.teacher_head(wt)
    assert torch.equal(w[0], wt[2]) and torch.equal(w[2], wt[0]) and not w[1].any() and b[1] == -torch.inf


def test_teacher_head_refuses_sparse_tensors_and_a_bias_elsewhere(seed):
    """A sparse head failed in torch's indexing; a bias on another device was copied over (meta: torch's error)."""
    g = torch.Generator().manual_seed(seed)
    tmap = TokenMap(torch.tensor([2, -1, 0]), 4)
    wt, bt = torch.randn(4, 2, dtype=F64, generator=g), torch.randn(4, dtype=F64, generator=g)
    _raises(TypeError, "teacher_weight: expected a dense", lambda: tmap.teacher_head(wt.to_sparse()))
    _raises(TypeError, "teacher_bias: expected a dense", lambda: tmap.teacher_head(wt, bt.to_sparse()))
    _raises(ValueError, "teacher_bias: expected a tensor on cpu .*got meta", lambda: tmap.teacher_head(wt, bt.to("meta")))


def test_a_token_map_of_no_values_is_refused():
    _raises(ValueError, "index: .*meta", lambda: TokenMap(torch.tensor([0, -1], device="meta")))


# ---------------------------------------------------------------------------------------------------
# GOLD's ULD loss

B, T, UHS, UHT, VS, VT = 2, 5, 4, 3, 7, 9


def _uld(seed):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(B, T, UHS, dtype=F64, generator=g, requires_grad=True)
    ws = torch.randn(VS, UHS, dtype=F64, generator=g, requires_grad=True)
    xt, wt = torch.randn(B, T, UHT, dtype=F64, generator=g), torch.randn(VT, UHT, dtype=F64, generator=g)
    s_lab, t_lab = torch.full((B, T), -100), torch.full((B, T), -100)
    s_lab[:, 1:4] = torch.randint(0, VS, (B, 3), generator=g)
    t_lab[:, 1:4] = torch.randint(0, VT, (B, 3), generator=g)
    s_ids, t_ids = torch.randint(0, VS, (B, T), generator=g), torch.randint(0, VT, (B, T), generator=g)
    return xs, ws, xt, wt, s_lab, t_lab, s_ids, t_ids


@pytest.mark.parametrize("name, error, words", [
    ("student_weight", ValueError, "student_weight: expected a tensor on cpu .*got meta"),
    ("teacher_input", ValueError, "teacher_input: expected a tensor on cpu .*got meta"),
    ("teacher_weight", ValueError, "teacher_weight: expected a tensor on cpu .*got meta"),  # was: a loss of 1.0
    ("student_bias", ValueError, "student_bias: expected a tensor on cpu .*got meta"),
    ("teacher_bias", ValueError, "teacher_bias: expected a tensor on cpu .*got meta"),
    ("labels", ValueError, "labels: expected a tensor on cpu .*got meta"),
    ("student_weight sparse", TypeError, "student_weight: expected a dense"),
    ("teacher_input sparse", TypeError, "teacher_input: expected a dense"),
])
def test_uld_tensors_elsewhere_are_refused_by_name(name, error, words, seed):
    xs, ws, xt, wt, s_lab, t_lab, s_ids, t_ids = _uld(seed)
    al = uld_alignment(s_lab, t_lab, s_ids, t_ids, extended=False)
    kwargs = dict(student_input=xs, student_weight=ws, teacher_input=xt, teacher_weight=wt, alignment=al)
    arg = name.split()[0]
    if arg == "labels":
        kwargs.update(labels=s_lab.to("meta"), ce_weight=1.0)
    elif arg.endswith("bias"):
        kwargs[arg] = torch.zeros(VS if arg.startswith("student") else VT, dtype=F64, device="meta")
    elif name.endswith("sparse"):
        kwargs[arg] = kwargs[arg].detach().reshape(-1, kwargs[arg].shape[-1]).to_sparse()
    else:
        kwargs[arg] = kwargs[arg].detach().to("meta")
    _raises(error, words, lambda: fused_linear_uld(**kwargs))


@pytest.mark.parametrize("field, value, error, words", [
    ("weight", lambda t: t.tolist(), TypeError, "alignment.weight: expected a tensor, got list"),
    ("student_rows", lambda t: t.tolist(), TypeError, "alignment.student_rows: expected a tensor, got list"),
    ("item", lambda t: t.tolist(), TypeError, "alignment.item: expected a tensor, got list"),
    ("student_rows", lambda t: t.to("meta"), ValueError, "alignment.student_rows: .*meta"),
    ("weight", lambda t: t.to("meta"), ValueError, "alignment.weight: .*meta"),
])
def test_a_hand_made_alignment_is_checked_by_field(field, value, error, words, seed):
    """Its fields were read as tensors before any check: AttributeError, or torch's meta errors."""
    xs, ws, xt, wt, s_lab, t_lab, s_ids, t_ids = _uld(seed)
    al = uld_alignment(s_lab, t_lab, s_ids, t_ids, extended=False)
    al = dataclasses.replace(al, **{field: value(getattr(al, field))})
    _raises(error, words, lambda: fused_linear_uld(xs, ws, xt, wt, al))


def test_uld_refuses_a_token_map_of_a_larger_teacher_vocab(seed):
    """A map built for another teacher (teacher_vocab_size > the head's rows) was taken where its ids fit."""
    xs, ws, xt, wt, s_lab, t_lab, s_ids, t_ids = _uld(seed)
    al = uld_alignment(s_lab, t_lab, s_ids, t_ids, extended=False)
    _raises(ValueError, "matched: expected a TokenMap of at most 9 teacher ids .*teacher_vocab_size=14",
            lambda: fused_linear_uld(xs, ws, xt, wt, al, matched=TokenMap(torch.arange(VS), VT + 5)))
    fused_linear_uld(xs, ws, xt, wt, al, matched=TokenMap(torch.arange(VS), VT))  # its own teacher's: taken


@pytest.mark.parametrize("change, error, words", [
    # uint8 labels: -100 is 156 there, so that a real label 156 read as ignored
    (lambda s, t: dict(student_labels=s.to(torch.uint8)), TypeError, "student_labels: expected an integer dtype"),
    (lambda s, t: dict(teacher_labels=t.to(torch.int16)), TypeError, "teacher_labels: expected an integer dtype"),
    # read for their truth value: "no" was True
    (lambda s, t: dict(extended="no"), TypeError, "extended: expected a bool, got 'no'"),
    (lambda s, t: dict(skip_student_eos=1), TypeError, "skip_student_eos: expected a bool"),
    (lambda s, t: dict(skip_teacher_eos=torch.tensor(True)), TypeError, "skip_teacher_eos: expected a bool"),
    # read on the host: torch's "Cannot copy out of meta tensor"
    (lambda s, t: dict(student_labels=s.to("meta")), ValueError, "student_labels: .*meta"),
    (lambda s, t: dict(extended=True, student_byte_offsets=torch.zeros(B, T, 2, dtype=torch.long, device="meta"),
                       teacher_byte_offsets=torch.zeros(B, T, 2, dtype=torch.long)), ValueError,
     "student_byte_offsets: .*meta"),
])
def test_uld_alignment_refuses_what_it_would_misread(change, error, words, seed):
    xs, ws, xt, wt, s_lab, t_lab, s_ids, t_ids = _uld(seed)
    kwargs = dict(student_labels=s_lab, teacher_labels=t_lab, student_input_ids=s_ids, teacher_input_ids=t_ids,
                  extended=False)
    kwargs.update(change(s_lab, t_lab))
    _raises(error, words, lambda: uld_alignment(**kwargs))


def test_uld_alignment_of_int32_labels_is_int64s(seed):
    """int32 labels are taken, and align as int64 ones do."""
    xs, ws, xt, wt, s_lab, t_lab, s_ids, t_ids = _uld(seed)
    a = uld_alignment(s_lab, t_lab, s_ids, t_ids, extended=False)
    b = uld_alignment(s_lab.int(), t_lab.int(), s_ids.int(), t_ids.int(), extended=False)
    for f in dataclasses.fields(a):
        assert torch.equal(getattr(a, f.name), getattr(b, f.name)), f.name
