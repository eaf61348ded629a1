"""Input validation of the multi-teacher loss, the token map and GOLD's ULD loss: bad input raises an error
naming the argument as passed; nothing is broadcast, truncated, cast or renormalised silently."""

import pytest
import torch

from flashkd import TokenMap, fused_linear_distill_teachers, fused_linear_uld, token_map, uld_alignment

N, H, V = 6, 8, 11


def _teachers(seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(N, H, generator=g, requires_grad=True)
    ws = torch.randn(V, H, generator=g, requires_grad=True)
    xts = [torch.randn(N, 8, generator=g), torch.randn(N, 5, generator=g)]
    wts = [torch.randn(V, 8, generator=g), torch.randn(V, 5, generator=g)]
    labels = torch.randint(0, V, (N,), generator=g)
    return xs, ws, xts, wts, labels


def _raises(error, words, fn):
    with pytest.raises(error, match=words) as info:
        fn()
    assert "\n" not in str(info.value)


ROUTED = torch.tensor([0, 1, -1, 0, 1, 1])
NO_TEACHER = torch.full((N,), -1)


@pytest.mark.parametrize("change, error, words", [
    # labels and teacher_index of one wrong shape: flattened to rows, then taken as N rows or indexed past them
    (dict(labels=torch.zeros(N, 1, dtype=torch.long), teacher_index=ROUTED[:, None]), ValueError,
     r"labels: .*\(6, 1\)"),
    (dict(labels=torch.zeros(2 * N, dtype=torch.long), teacher_index=torch.cat([ROUTED, ROUTED])), ValueError,
     r"labels: .*\(12,\)"),
    # row_weight of the wrong shape: flattened and indexed per group
    (dict(row_weight=torch.ones(2 * N)), ValueError, r"row_weight: .*\(12,\)"),
    (dict(row_weight=torch.ones(N, 1)), ValueError, r"row_weight: .*\(6, 1\)"),
    # no row has a teacher: no call runs, the tensors are checked all the same
    (dict(teacher_index=NO_TEACHER, labels=torch.zeros(N)), TypeError, "labels"),
    (dict(teacher_index=NO_TEACHER, student_weight=torch.randn(V, 3)), ValueError, "student_input"),
    (dict(teacher_index=NO_TEACHER, teacher_heads=[torch.randn(V, 8).long(), torch.randn(V, 5)]), TypeError,
     r"teacher_heads\[0\]"),
])
def test_routed_refuses_what_it_used_to_reshape_or_skip(change, error, words):
    xs, ws, xts, wts, labels = _teachers()
    kwargs = dict(student_input=xs, student_weight=ws, teacher_inputs=xts, teacher_heads=wts, labels=labels,
                  combine="routed", teacher_index=ROUTED)
    kwargs.update(change)
    _raises(error, words, lambda: fused_linear_distill_teachers(**kwargs))


def test_routed_without_any_teacher_is_still_zero():
    xs, ws, xts, wts, labels = _teachers()
    loss = fused_linear_distill_teachers(xs, ws, xts, wts, labels, combine="routed", teacher_index=NO_TEACHER)
    assert loss.item() == 0.0


@pytest.mark.parametrize("combine", ["geometric", "arithmetic", "sum"])
@pytest.mark.parametrize("change, error, words", [
    (dict(teacher_biases=[torch.zeros(V, dtype=torch.float64), None]), TypeError, r"teacher_biases\[0\]"),
    (dict(teacher_biases=[torch.zeros(V, dtype=torch.long), None]), TypeError, r"teacher_biases\[0\]"),
    (dict(vocab_size=8.0), TypeError, "vocab_size"),
    (dict(teacher_weights=torch.full((N, 2), 0.5, requires_grad=True)), TypeError, "teacher_weights"),
    (dict(teacher_weights=torch.tensor([0.5, 0.5], requires_grad=True)), TypeError, "teacher_weights"),
])
def test_weighted_combines_refuse_casts_and_dropped_gradients(combine, change, error, words):
    xs, ws, xts, wts, labels = _teachers()
    kwargs = {**dict(combine=combine, teacher_weights=[0.5, 0.5]), **change}
    _raises(error, words, lambda: fused_linear_distill_teachers(xs, ws, xts, wts, labels, **kwargs))


@pytest.mark.parametrize("combine", ["geometric", "arithmetic", "sum"])
def test_teachers_of_another_dtype_are_refused_not_promoted(combine):
    xs, ws, xts, wts, labels = _teachers()
    xts, wts = [xts[0], xts[1].bfloat16()], [wts[0], wts[1].bfloat16()]
    _raises(TypeError, r"teacher_inputs\[1\]", lambda: fused_linear_distill_teachers(
        xs, ws, xts, wts, labels, combine=combine, teacher_weights=[0.5, 0.5]))


def test_integer_teacher_input_is_refused_by_geometric():
    xs, ws, xts, wts, labels = _teachers()
    _raises(TypeError, r"teacher_inputs\[0\]", lambda: fused_linear_distill_teachers(
        xs, ws, [xts[0].long(), xts[1]], wts, labels, combine="geometric", teacher_weights=[0.5, 0.5]))


@pytest.mark.parametrize("row_weight, words", [
    (torch.ones(1), r"row_weight: .*\(1,\)"),
    (torch.ones(N, 1), r"row_weight: .*\(6, 1\)"),
    (torch.ones(N, dtype=torch.long), "row_weight: expected a floating dtype"),
    (torch.tensor([float("inf")] + [1.0] * (N - 1)), "row_weight: expected finite values, got inf"),
])
def test_sum_with_per_row_weights_checks_row_weight_as_given(row_weight, words):
    """Multiplied by the per-row teacher weights, a row_weight of one element used to broadcast."""
    xs, ws, xts, wts, labels = _teachers()
    w = torch.full((N, 2), 0.5)
    error = TypeError if row_weight.dtype == torch.long else ValueError
    _raises(error, words, lambda: fused_linear_distill_teachers(
        xs, ws, xts, wts, None, combine="sum", teacher_weights=w, row_weight=row_weight, weight_hard_loss=0.0))


def test_arithmetic_takes_float32_weights_summing_to_one_in_float32():
    """A (M,) tensor's sum is checked within M · its dtype's epsilon, as a per-row tensor's is."""
    xs, ws, xts, wts, labels = _teachers()
    w = torch.tensor([0.1, 0.9])
    assert abs(sum(w.tolist()) - 1.0) > 2 * 2.0**-52
    got = fused_linear_distill_teachers(xs, ws, xts, wts, labels, combine="arithmetic", teacher_weights=w)
    ref = fused_linear_distill_teachers(xs, ws, xts, wts, labels, combine="arithmetic",
                                        teacher_weights=w.expand(N, 2).contiguous())
    torch.testing.assert_close(got, ref)
    _raises(ValueError, "summing to 1", lambda: fused_linear_distill_teachers(
        xs, ws, xts, wts, labels, combine="arithmetic", teacher_weights=torch.tensor([0.1, 0.8])))


@pytest.mark.parametrize("combine", ["routed", "geometric", "arithmetic", "sum"])
def test_no_rows_give_a_zero_loss(combine):
    _, ws, _, wts, _ = _teachers()
    xs = torch.randn(0, H, requires_grad=True)
    xts = [torch.randn(0, 8), torch.randn(0, 5)]
    kwargs = dict(teacher_index=torch.zeros(0, dtype=torch.long)) if combine == "routed" else \
        dict(teacher_weights=[0.5, 0.5])
    loss = fused_linear_distill_teachers(xs, ws, xts, wts, torch.zeros(0, dtype=torch.long), combine=combine, **kwargs)
    assert loss.item() == 0.0


def test_zero_dim_student_input_is_a_value_error():
    _, ws, xts, wts, _ = _teachers()
    _raises(ValueError, "student_input: .*0-d", lambda: fused_linear_distill_teachers(
        torch.tensor(1.0), ws, xts, wts, combine="sum", teacher_weights=[0.5, 0.5]))


# --- the token map


def test_pairs_giving_one_teacher_id_twice_are_refused():
    s, t = {"a": 0, "b": 1, "c": 2}, {"b": 0, "a": 1, "d": 2}
    assert token_map(s, t, pairs={2: 1}).index.tolist() == [-1, 0, 1]  # taken from the matching: allowed
    _raises(ValueError, "pairs: .*teacher id 0", lambda: token_map(s, t, pairs={2: 0, 0: 0}))


@pytest.mark.parametrize("shape", [(0, 4), (3, 0)])
def test_teacher_head_refuses_an_empty_head(shape):
    tmap = TokenMap(torch.tensor([-1, -1]))
    _raises(ValueError, "teacher_weight: .*both >= 1", lambda: tmap.teacher_head(torch.zeros(shape)))


# --- GOLD's ULD loss

B, T, HS, HT, VS, VT = 2, 5, 8, 6, 11, 13


def _uld(seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(B, T, HS, generator=g, requires_grad=True)
    ws = torch.randn(VS, HS, generator=g, requires_grad=True)
    xt, wt = torch.randn(B, T, HT, generator=g), torch.randn(VT, HT, generator=g)
    s_lab, t_lab = torch.full((B, T), -100), torch.full((B, T), -100)
    s_lab[:, 1:4] = torch.randint(0, VS, (B, 3), generator=g)
    t_lab[:, 1:4] = torch.randint(0, VT, (B, 3), generator=g)
    s_ids, t_ids = torch.randint(0, VS, (B, T), generator=g), torch.randint(0, VT, (B, T), generator=g)
    al = uld_alignment(s_lab, t_lab, s_ids, t_ids, extended=False)
    return xs, ws, xt, wt, al, s_lab


def _replaced(al, **fields):
    return type(al)(**{**vars(al), **fields})


LABELS = torch.full((B, T), -100)


@pytest.mark.parametrize("change, error, words", [
    (lambda al: dict(student_bias=torch.zeros(VS, dtype=torch.float64)), TypeError, "student_bias"),
    (lambda al: dict(teacher_bias=torch.zeros(VT, dtype=torch.long)), TypeError, "teacher_bias"),
    (lambda al: dict(ce_weight="1", labels=LABELS), TypeError, "ce_weight"),
    (lambda al: dict(ce_weight=float("nan"), labels=LABELS), TypeError, "ce_weight"),
    (lambda al: dict(ce_weight=1.0, labels=LABELS.reshape(-1)), ValueError, r"labels: .*\(10,\)"),
    (lambda al: dict(ce_weight=1.0, labels=LABELS.T.contiguous()), ValueError, r"labels: .*\(5, 2\)"),
    (lambda al: dict(ce_weight=1.0, labels=torch.full((B, T), 156, dtype=torch.uint8)), TypeError, "labels"),
    (lambda al: dict(ce_weight=1.0, labels=LABELS.to(torch.int16)), TypeError, "labels"),
    (lambda al: dict(matched=(torch.tensor([0, 1, 2]), torch.tensor([3, 3, 5]))), ValueError, "matched teacher ids"),
    (lambda al: dict(matched=(torch.tensor([0]), torch.tensor([3])), matched_weight=float("nan"), unmatched_weight=0.5),
     TypeError, "matched_weight"),
    (lambda al: dict(matched=(torch.tensor([0]), torch.tensor([3])), matched_weight=0.5, unmatched_weight="0.5"),
     TypeError, "unmatched_weight"),
    (lambda al: dict(matched=(torch.tensor([0]), torch.tensor([3])), beta="0.5"), TypeError, "beta"),
    (lambda al: dict(beta=2.0), ValueError, "beta"),
    (lambda al: dict(student_input=torch.tensor(1.0)), ValueError, "student_input: .*0-d"),
    (lambda al: dict(student_weight=torch.zeros(0, HS)), ValueError, "student_weight"),
    (lambda al: dict(student_input=torch.zeros(B, T, 0), student_weight=torch.zeros(VS, 0)), ValueError,
     "student_weight"),
    (lambda al: dict(alignment=_replaced(al, weight=al.weight.long())), TypeError, "alignment.weight"),
    (lambda al: dict(alignment=_replaced(al, weight=torch.full_like(al.weight, float("nan")))), ValueError,
     "alignment.weight"),
    (lambda al: dict(alignment=_replaced(al, student_rows=al.student_rows.to(torch.uint8))), TypeError,
     "alignment.student_rows"),
    (lambda al: dict(alignment=_replaced(al, student_rows=al.student_rows[:, None])), ValueError,
     "alignment.student_rows"),
    (lambda al: dict(alignment=_replaced(al, item=al.item.float())), TypeError, "alignment.item"),
])
def test_uld_refuses_casts_broadcasts_and_wrapped_labels(change, error, words):
    xs, ws, xt, wt, al, _ = _uld()
    kwargs = dict(student_input=xs, student_weight=ws, teacher_input=xt, teacher_weight=wt, alignment=al)
    kwargs.update(change(al))
    _raises(error, words, lambda: fused_linear_uld(**kwargs))


def test_uld_keeps_valid_input():
    xs, ws, xt, wt, al, s_lab = _uld()
    labels = torch.cat([s_lab[:, 1:], torch.full_like(s_lab[:, :1], -100)], 1)
    loss = fused_linear_uld(xs, ws, xt, wt, al, matched=(torch.tensor([0, 1]), torch.tensor([3, 4])), labels=labels,
                            ce_weight=0.5, matched_weight=0.7, unmatched_weight=0.3, beta=0)
    assert torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(xs.grad).all()


@pytest.mark.parametrize("change, error, words", [
    (dict(weight=float("nan")), TypeError, "weight"),
    (dict(weight="1"), TypeError, "weight"),
    (dict(ignore_index="x"), TypeError, "ignore_index"),
    (dict(student_labels=torch.zeros(B, T, dtype=torch.bool)), ValueError, "student_labels"),
    (dict(teacher_input_ids=torch.zeros(B, T, dtype=torch.bool)), ValueError, "teacher_input_ids"),
    (dict(extended=True, student_byte_offsets=torch.zeros(B, T, 2), teacher_byte_offsets=torch.zeros(B, T, 2)),
     TypeError, "student_byte_offsets"),
])
def test_uld_alignment_refuses_bool_ids_float_offsets_and_bad_scalars(change, error, words):
    _, _, _, _, _, s_lab = _uld()
    kwargs = dict(student_labels=s_lab, teacher_labels=s_lab, student_input_ids=s_lab.clamp(min=0),
                  teacher_input_ids=s_lab.clamp(min=0), extended=False)
    kwargs.update(change)
    _raises(error, words, lambda: uld_alignment(**kwargs))
