"""The Triton row kernel (`flashkd.backends.triton_rows`) against the torch row backend.

The torch backend differentiates `flashkd.losses.row_losses` with autograd, so agreement here checks the
kernel's analytic gradients as well as its losses. Without a GPU the kernel runs under Triton's
interpreter (BLOCK_V = 256 there), on widths that are not multiples of the block: V = 257 and 1000 span
several tiles with a ragged last one. Inputs are fresh random logits (randn · 3) on every run, from the
`seed` fixture, which prints its seed on failure. Both backends read the same inputs in the same dtype
and compute in fp32: the kernel must agree with the torch backend, and with the torch backend's fp64
evaluation of the same inputs, to 1e-5 (dL/ds: to one rounding to the input dtype), or be no worse
than the torch backend's own fp32 error where fp32 cannot reach 1e-5 (see `_assert_matches`).
"""

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from flashkd.backends import torch_rows, triton_rows  # noqa: E402
from flashkd.losses import LossSpec  # noqa: E402
from helpers.rows import sharded  # noqa: E402
from helpers.ties import assert_close_except_at_ties, tvd_slack  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # set by conftest when there is no GPU
DEVICE = "cpu" if INTERPRET else "cuda"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET is off and there is no CUDA device", allow_module_level=True)


IGNORE = -100
F32_RTOL = 1e-5  # both backends compute in fp32, in different orders
F32_EPS = torch.finfo(torch.float32).eps
# Every loss, with its parameter (`_spec`): β for jsd (0 and 1 are the KL endpoints) and cosine, α for the
# skew losses (0: the KL each is there; 1: zero), unused by the others.
LOSSES = [
    ("forward_kl", 0.3),
    ("reverse_kl", 0.3),
    ("tvd", 0.3),
    ("jsd", 0.0),
    ("jsd", 0.3),
    ("jsd", 0.97),  # log2(1 − β) = −5: the constant log parts the kernel adds once a row are large
    ("jsd", 1.0),
    ("cosine", 0.0),
    ("cosine", 0.3),
    ("cosine", 1.0),
    ("skew_kl", 0.1),
    ("skew_kl", 0.97),  # log2 α ≈ 0, log2(1 − α) = −5
    ("skew_kl", 1.0),
    ("skew_reverse_kl", 0.0),
    ("skew_reverse_kl", 0.1),
    ("skew_reverse_kl", 1.0),
]
# (R, V, labels): V = 1, a sub-tile width, a full tile + 1, several tiles with a ragged tail.
CASES = [(1, 1, None), (3, 7, "some_ignored"), (5, 257, "out_of_range"), (3, 1000, "some_ignored")]


def _spec(loss, param, **options):
    """The LossSpec of a LOSSES entry: param is the skew losses' α, the others' β."""
    return LossSpec(loss=loss, **{"alpha" if loss.startswith("skew") else "beta": param}, **options)


def _logits(R, V, dtype, seed, scale=3.0):
    g = torch.Generator().manual_seed(2 * seed)
    s = torch.randn(R, V, generator=g) * scale
    t = torch.randn(R, V, generator=g) * scale
    return s.to(DEVICE, dtype), t.to(DEVICE, dtype)


def _labels(kind, R, V, seed):
    """None; "some_ignored": every other row ignored; "all_ignored"; "out_of_range": row 0 gets V and,
    when R > 2, row 2 gets −1 (neither is ignore_index: their CE is NaN)."""
    if kind is None:
        return None
    y = torch.randint(0, V, (R,), generator=torch.Generator().manual_seed(2 * seed + 1))
    if kind == "some_ignored":
        y[1::2] = IGNORE
    elif kind == "all_ignored":
        y[:] = IGNORE
    elif kind == "out_of_range":
        y[0] = V
        if R > 2:
            y[2] = -1
    return y.to(DEVICE)


def _kernel(s, t, labels, spec, scale, grad):
    """(soft, hard, s after) of the Triton kernel, on a copy of s."""
    x = s.clone()
    soft, hard = triton_rows.rows(x, t, labels, spec, scale, grad)
    return soft, hard, x


def _torch(s, t, labels, spec, scale, grad):
    """(soft, hard, s after) of the torch backend: on the same inputs, on their fp32 values (its result
    before the rounding to the input dtype) and on their fp64 values (the truth)."""
    out = []
    for dtype in (s.dtype, torch.float32, torch.float64):
        x = s.to(dtype, copy=True)
        soft, hard = torch_rows.rows(x, None if t is None else t.to(dtype), labels, spec, scale, grad)
        out.append((soft, hard, x))
    return out


def _assert_matches(got, refs, dtype, term=0.0, log_terms=None, jumps=None):
    """The kernel's (soft, hard, dL/ds) against the torch backend's.

    Each must lie within rtol·|truth| + atol of the fp64 truth, and within that plus the torch
    backend's own error of its result on the same inputs, where atol = max(1e-5 of the largest value,
    2 × the torch backend's fp32 error): 1e-5, or no worse than torch where fp32 cannot do better (JSD
    and TVD gradients through a cancellation). rtol is 1e-5, and for dL/ds in bf16 / fp16 the dtype's
    eps: one rounding at the store. term: the size of the terms that dL/ds sums where they cancel far
    below it (cosine at V = 1, exactly); dL/ds is then good to a few fp32 roundings of term.
    log_terms: per element, the size of what a softmax divergence's dL/ds subtracts, q·(|log q| + |log p| + 1)
    times its factors (see `_log_terms`): log(q/M) − K and its kin are differences of logs of size |log q|,
    so any fp32 evaluation of element j is good to a few fp32 roundings of log_terms[j], and two correct
    ones differ by that much where the difference cancels (seen: 3–5× the torch backend's error there).
    jumps: per element, how far dL/ds may move where the gradient itself jumps at a tie that fp32 cannot
    resolve (`_tvd_jumps`), else None; the comparison is `helpers.ties.assert_close_except_at_ties`.
    """
    assert got[0].dtype == got[1].dtype == torch.float32
    assert got[2].dtype == refs[0][2].dtype == dtype
    assert torch.isfinite(got[2]).all()
    rtols = (F32_RTOL, F32_RTOL, max(F32_RTOL, torch.finfo(dtype).eps))
    for name, x, ref, ref32, truth, rtol in zip(("soft", "hard", "dL/ds"), got, *refs, rtols):
        truth = truth.double()
        largest = truth.nan_to_num().abs().max().item()
        floor = F32_RTOL * largest if name == "dL/ds" else F32_RTOL * max(largest, 1.0)
        if name == "dL/ds":
            floor = max(floor, 8 * F32_EPS * term)
        err_torch = (ref32.double() - truth).nan_to_num().abs().max().item()
        atol = max(floor, 2.0 * err_torch)
        if name == "dL/ds" and log_terms is not None:
            atol = atol + 8 * F32_EPS * log_terms  # per element
        for want, slack in ((truth, 0.0), (ref.double(), err_torch)):
            assert_close_except_at_ties(x, want, jumps if name == "dL/ds" else None, rtol=rtol, atol=atol + slack,
                                        equal_nan=True, msg=name)


def _cosine_term(s, spec, scale):
    """Largest term of the cosine gradient, scale · soft_scale · β / ‖s‖ (see `_assert_matches`)."""
    if not spec.want_soft or spec.kind != "cosine":
        return 0.0
    norm = s.float().norm(dim=-1).clamp_min(1e-12).min().item()
    return scale.item() * spec.soft_scale * spec.beta / norm


def _log_terms(s, t, spec, scale):
    """Per element, scale · soft_scale / τ · q (|log q| + |log p| + 1) for a softmax divergence, else None."""
    if not spec.want_soft or spec.kind == "cosine":
        return None
    log_q = torch.log_softmax(s.double() / spec.temperature, -1)
    log_p = torch.log_softmax(t.double() / spec.temperature, -1)
    factor = scale.double().abs() * abs(spec.soft_scale) / spec.temperature
    return factor * log_q.exp() * (log_q.abs() + log_p.abs() + 1.0)


def _tvd_jumps(s, t, spec, scale):
    """TVD's dL/ds = ½ q ∘ (g − Σ q g) / τ with g = sign(q − p) jumps where q = p. Where q and p agree to
    a few fp32 roundings (seen: 2.5e-7 relative, a row of bf16 logits), the kernel's g and the float64
    truth's may differ, and either is right: per element, how far that may move it (`tvd_slack`, times
    scale · soft_scale / τ). None for other losses."""
    if not spec.want_soft or spec.kind != "tvd":
        return None
    q = torch.softmax(s.double() / spec.temperature, -1)
    p = torch.softmax(t.double() / spec.temperature, -1)
    return tvd_slack(q, p, scale.double().abs() * abs(spec.soft_scale) / spec.temperature)


def _check(s, t, labels, spec, scale, grad):
    """Runs both backends on the same inputs, asserts they match, returns the kernel's outputs."""
    got = _kernel(s, t, labels, spec, scale, grad)
    _assert_matches(got, _torch(s, t, labels, spec, scale, grad), s.dtype, _cosine_term(s, spec, scale),
                    _log_terms(s, t, spec, scale), _tvd_jumps(s, t, spec, scale))
    return got


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.5])
@pytest.mark.parametrize("loss,beta", LOSSES)
def test_matches_torch_backend(seed, loss, beta, temperature, dtype, grad):
    spec = _spec(loss, beta, temperature=temperature, temperature_squared=True)
    scale = torch.tensor(1.0 / 3.0, device=DEVICE)
    for i, (R, V, label_kind) in enumerate(CASES):
        s, t = _logits(R, V, dtype, seed + i)
        labels = _labels(label_kind, R, V, seed + i)
        soft, hard, ds = _check(s, t, labels, spec, scale, grad)
        assert not soft.isnan().any()
        if labels is None:
            assert (hard == 0).all()  # no labels, no CE
        else:
            ignored = labels == IGNORE
            assert (soft[ignored] == 0).all() and (hard[ignored] == 0).all()
            assert torch.equal(hard.isnan(), ~ignored & ((labels < 0) | (labels >= V)))  # NaN CE there only
            if grad:
                assert (ds[ignored] == 0).all()
        if not grad:
            assert torch.equal(ds, s)


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("label_kind", ["some_ignored", "out_of_range"])
def test_hard_only(seed, label_kind, dtype, grad):
    # no teacher at all; the CE stays untempered whatever τ
    spec = LossSpec(temperature=2.5, want_soft=False, weight_hard=0.7)
    scale = torch.tensor(0.25, device=DEVICE)
    for i, (R, V, _) in enumerate(CASES):
        s, _ = _logits(R, V, dtype, seed + i)
        soft, _, _ = _check(s, None, _labels(label_kind, R, V, seed + i), spec, scale, grad)
        assert (soft == 0).all()


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("loss,beta", [("forward_kl", 0.3), ("jsd", 0.3), ("tvd", 0.3), ("cosine", 0.5),
                                       ("skew_kl", 0.3), ("skew_reverse_kl", 0.3)])
def test_soft_only(seed, loss, beta, grad):
    spec = _spec(loss, beta, temperature=0.7, want_hard=False)
    s, t = _logits(5, 257, torch.float32, seed)
    _, hard, _ = _check(s, t, _labels("some_ignored", 5, 257, seed), spec, torch.tensor(1.0, device=DEVICE), grad)
    assert (hard == 0).all()


@pytest.mark.parametrize(
    "weights",
    [
        dict(weight_hard=0.0, weight_soft=1.0),  # CE for logging only: no CE gradient
        dict(weight_hard=1.0, weight_soft=0.0),  # divergence for logging only: no third pass
        dict(weight_hard=1, weight_soft=2, temperature_squared=True),  # ints, τ² factor
    ],
)
@pytest.mark.parametrize("loss", ["reverse_kl", "jsd", "forward_kl", "cosine"])
def test_weights(seed, loss, weights):
    spec = LossSpec(loss=loss, beta=0.4, temperature=2.5, **weights)
    s, t = _logits(3, 300, torch.float32, seed)
    _check(s, t, _labels("some_ignored", 3, 300, seed), spec, torch.tensor(1.0, device=DEVICE), True)


def test_neither_term(seed):
    spec = LossSpec(want_hard=False, want_soft=False)
    s, _ = _logits(3, 7, torch.float32, seed)
    one = torch.tensor(1.0, device=DEVICE)
    soft, hard = triton_rows.rows(s, None, _labels("some_ignored", 3, 7, seed), spec, one, True)
    assert (soft == 0).all() and (hard == 0).all() and (s == 0).all()


@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl", "jsd", "tvd", "cosine"])
def test_all_rows_ignored(seed, loss):
    spec = LossSpec(loss=loss, beta=0.3)
    s, t = _logits(3, 257, torch.float32, seed)
    s[0, 5] = float("nan")  # whatever ignored rows hold never reaches the outputs
    t[1, 9] = float("inf")
    labels = _labels("all_ignored", 3, 257, seed)
    soft, hard = triton_rows.rows(s, t, labels, spec, torch.tensor(1.0, device=DEVICE), True)
    assert (soft == 0).all() and (hard == 0).all() and (s == 0).all()


def test_grad_false_leaves_s_untouched(seed):
    spec = LossSpec(loss="jsd", beta=0.3)
    s, t = _logits(3, 1000, torch.bfloat16, seed)
    before = s.clone()
    triton_rows.rows(s, t, _labels("some_ignored", 3, 1000, seed), spec, torch.tensor(1.0, device=DEVICE), False)
    assert torch.equal(s, before)


@pytest.mark.parametrize("loss", ["reverse_kl", "forward_kl", "cosine"])
def test_scale_is_honoured(seed, loss):
    spec = LossSpec(loss=loss, beta=0.5, temperature=0.7)
    s, t = _logits(3, 257, torch.float32, seed)
    labels = _labels("some_ignored", 3, 257, seed)
    ds = {}
    for scale in (1.0, 1.0 / 3.0):
        ds[scale] = _check(s, t, labels, spec, torch.tensor(scale, device=DEVICE), True)[2]
    torch.testing.assert_close(ds[1.0 / 3.0], ds[1.0] / 3.0, rtol=1e-6, atol=1e-6 * ds[1.0].abs().max().item())


@pytest.mark.parametrize("loss,beta,options", [
    ("forward_kl", 0.3, {}), ("reverse_kl", 0.3, {}), ("jsd", 0.3, {}), ("tvd", 0.3, {}),
    ("jsd", 0.3, dict(temperature=1.0, weight_soft=0.0)),  # the CE's gradient from JSD's pass-2 q
    ("skew_kl", 0.2, {}), ("skew_reverse_kl", 0.2, {}), ("skew_kl", 1.0, {}),
])
def test_columns_at_minus_inf_in_both_are_absent(seed, loss, beta, options):
    """0·log 0 = 0: columns where s and t are both −inf (the whole first tile) change nothing."""
    spec = _spec(loss, beta, **{"temperature": 0.7, **options})
    R, V, cut = 3, 600, 300
    s, t = _logits(R, V, torch.float32, seed)
    s[:, :cut] = float("-inf")
    t[:, :cut] = float("-inf")
    labels = torch.randint(cut, V, (R,), generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    scale = torch.tensor(0.5, device=DEVICE)
    soft, hard, ds = _kernel(s, t, labels, spec, scale, True)
    assert (ds[:, :cut] == 0).all()
    kept = (s[:, cut:].contiguous(), t[:, cut:].contiguous(), labels - cut)
    _assert_matches((soft, hard, ds[:, cut:]), _torch(*kept, spec, scale, True), torch.float32)


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl"])
def test_kl_is_infinite_where_its_second_distribution_has_no_mass(seed, loss, grad):
    """KL(p‖q) is infinite where p > 0 = q, KL(q‖p) where q > 0 = p: one column at −inf, in the first
    tile, a middle one, the ragged last one, or the whole row but one column, of the second argument's
    logits. Pass 1 takes both KLs online when it can (reverse KL, forward KL without grad); the other
    rows keep their finite values."""
    spec = LossSpec(loss=loss, temperature=0.7)
    R, V = 5, 700
    s, t = _logits(R, V, torch.float32, seed)
    second = t if loss == "reverse_kl" else s  # KL(q‖p): p's logits; KL(p‖q): q's
    second[0, 3] = second[1, 300] = second[2, V - 1] = float("-inf")
    second[3, 1:] = float("-inf")
    soft, _, _ = _kernel(s, t, None, spec, torch.tensor(1.0, device=DEVICE), grad)
    assert torch.equal(soft[:4], torch.full((4,), float("inf"), device=DEVICE))
    truth = _torch(s[4:].contiguous(), t[4:].contiguous(), None, spec, torch.tensor(1.0, device=DEVICE), grad)[2][0]
    torch.testing.assert_close(soft[4:].double(), truth, rtol=F32_RTOL, atol=0.0)


@pytest.mark.parametrize("loss,beta", [("forward_kl", 0.3), ("reverse_kl", 0.3), ("jsd", 0.3), ("tvd", 0.3),
                                       ("skew_kl", 0.1), ("skew_reverse_kl", 0.1)])
def test_underflowing_probabilities(seed, loss, beta):
    """Logits spread over hundreds of nats: most probabilities are exactly 0 in fp32, their logs finite."""
    spec = _spec(loss, beta, temperature=0.7)
    s, t = _logits(3, 1000, torch.float32, seed, scale=40.0)
    args = (s, t, _labels("some_ignored", 3, 1000, seed), spec, torch.tensor(1.0, device=DEVICE), True)
    got, refs = _kernel(*args), _torch(*args)
    # reverse KL's gradient q (log(q/p) − KL) / τ subtracts terms of size KL / τ, hundreds of nats here,
    # each carrying the fp32 rounding of log(q/p)
    term = refs[2][0].max().item() / spec.temperature if loss == "reverse_kl" else 0.0
    _assert_matches(got, refs, torch.float32, term)


def test_wide_rows(seed):
    spec = LossSpec(loss="jsd", beta=0.3, temperature=0.7)
    s, t = _logits(2, 4099, torch.bfloat16, seed)
    _check(s, t, _labels("out_of_range", 2, 4099, seed), spec, torch.tensor(0.5, device=DEVICE), True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64], ids=["fp16", "fp64"])
def test_other_dtypes(seed, dtype):
    # fp64 inputs are computed in fp32 by the kernel and in fp64 by the torch backend
    spec = LossSpec(loss="jsd", beta=0.3, temperature=2.5)
    s, t = _logits(3, 257, dtype, seed)
    _check(s, t, _labels("some_ignored", 3, 257, seed), spec, torch.tensor(0.5, device=DEVICE), True)


def test_int32_labels_and_fp64_scale(seed):
    spec = LossSpec(loss="tvd", temperature=0.7)
    s, t = _logits(5, 257, torch.float32, seed)
    labels = _labels("out_of_range", 5, 257, seed)
    got = _kernel(s, t, labels.to(torch.int32), spec, torch.tensor(0.5, device=DEVICE, dtype=torch.float64), True)
    _assert_matches(got, _torch(s, t, labels, spec, torch.tensor(0.5, device=DEVICE), True), torch.float32)


def test_rejects_bad_inputs():
    spec = LossSpec()
    s, t = _logits(3, 7, torch.float32, seed=0)
    y = _labels("some_ignored", 3, 7, seed=0)
    one = torch.tensor(1.0, device=DEVICE)
    with pytest.raises(ValueError, match="s: expected a 2-D"):
        triton_rows.rows(s[0], t[0], y, spec, one, True)
    with pytest.raises(ValueError, match="s: expected a contiguous"):
        triton_rows.rows(s.t(), t.t(), None, spec, one, True)
    with pytest.raises(TypeError, match="s: expected bfloat16"):
        triton_rows.rows(s.int(), t.int(), y, spec, one, True)
    with pytest.raises(ValueError, match="t: expected the teacher"):
        triton_rows.rows(s, None, y, spec, one, True)
    with pytest.raises(ValueError, match="t: expected shape"):
        triton_rows.rows(s, t[:, :5].contiguous(), y, spec, one, True)
    with pytest.raises(TypeError, match="t: expected bfloat16, float16, float32 or float64"):
        triton_rows.rows(s, t.to(torch.int32), y, spec, one, True)
    with pytest.raises(ValueError, match="ds: expected an"):
        triton_rows.rows(s, t, y, spec, one, True, ds=s[:, :5])
    with pytest.raises(ValueError, match="labels: expected shape"):
        triton_rows.rows(s, t, y[:2], spec, one, True)
    with pytest.raises(TypeError, match="labels: expected int32 or int64"):
        triton_rows.rows(s, t, y.float(), spec, one, True)
    with pytest.raises(TypeError, match="scale: expected a 0-d"):
        triton_rows.rows(s, t, y, spec, 1.0, True)
    with pytest.raises(TypeError, match="scale: expected a 0-d"):
        triton_rows.rows(s, t, y, spec, one.reshape(1), True)
    with pytest.raises(ValueError, match="V < 2"):
        triton_rows.rows(s[:, :0], t[:, :0], y, spec, one, True)


def test_no_rows():
    s, t = _logits(0, 7, torch.float32, seed=0)
    soft, hard = triton_rows.rows(s, t, None, LossSpec(), torch.tensor(1.0, device=DEVICE), True)
    assert soft.shape == hard.shape == (0,)


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's numpy warnings: CPU only")
def test_interpreted_kernels_do_not_warn_about_masked_lanes():
    """Under TRITON_INTERPRET=1 numpy evaluated the masked lanes too and its RuntimeWarnings (overflow in
    multiply, log2 of 0, inf − inf) reached users of backend="triton" on CPU. They are dropped around
    flashkd's own launches only: the filters outside are what they were."""
    import warnings

    import flashkd

    torch.manual_seed(0)
    xs, ws = torch.randn(9, 16, requires_grad=True), torch.randn(301, 16, requires_grad=True)
    xt, wt, y = torch.randn(9, 24), torch.randn(301, 24), torch.randint(0, 301, (9,))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # pytest's own filters (pyproject) ignore them: a user's do not
        before = list(warnings.filters)
        flashkd.fused_linear_distill(xs, ws, xt, wt, y, backend="triton", student_softcap=30.0).backward()
        ids, lp = flashkd.teacher_topk(xt, wt, 8, backend="triton")
        flashkd.fused_linear_distill_topk(xs, ws, ids, lp, y, backend="triton").backward()
        assert warnings.filters == before
        import numpy

        with numpy.errstate(over="warn"):
            numpy.float32(3e38) * numpy.float32(10)  # anyone else's still warns
    runtime = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    assert runtime == ["overflow encountered in scalar multiply"], runtime[:4]


# ------------------------------------------------ pass 1's statistics given per vocab tile (PHASE 4)


def _tile_planes(s, t, spec, labels, width):
    """The (5, R, n) planes the CuTe logits GEMMs write (`flashkd.backends.cute_gemm`): each vocab tile of
    `width` columns' max and sums of 2^((z − max)·k), made here in float64 from the same logits
    (`cute_gemm.tile_stats`). The CE's plane is NaN where the kernel must not read it."""
    from flashkd.backends import cute_gemm

    k_s, k_ce, k_t = triton_rows.tile_constants(spec, labels is not None)
    m_s, (l_s, *l_c) = cute_gemm.tile_stats(s.double(), [k_s] + ([] if k_ce is None else [k_ce]), width)
    m_t, (l_t,) = cute_gemm.tile_stats(t.double(), [k_t], width)
    l_c = l_c[0] if l_c else torch.full_like(l_s, torch.nan)
    return torch.stack([m_s, l_s, l_c, m_t, l_t]).float()


@pytest.mark.parametrize("width", [7, 256])
@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("loss,beta", [("jsd", 0.3), ("jsd", 0.97), ("tvd", 0.3), ("forward_kl", 0.3),
                                       ("skew_kl", 0.1), ("skew_reverse_kl", 0.1)])
def test_statistics_per_vocab_tile(seed, loss, beta, temperature, dtype, grad, width):
    """rows(..., tiles=...) reads the row twice, with pass 1's statistics merged from the vocab tiles'
    (as the CuTe logits GEMMs make them): the same results as the torch backend, every case above."""
    spec = _spec(loss, beta, temperature=temperature, weight_hard=0.5, weight_soft=0.5,
                    ignore_index=IGNORE)
    if not triton_rows.tiles_fit(spec, grad, False, True):
        assert loss == "forward_kl" and not grad  # its loss is taken online in pass 1 then
        return
    for case_i, (R, V, kind) in enumerate(CASES):
        s, t = _logits(R, V, dtype, seed + case_i)
        labels = _labels(kind, R, V, seed + case_i)
        scale = torch.tensor(0.37, device=DEVICE)
        tiles = _tile_planes(s, t, spec, labels, width)
        x = s.clone()
        got = (*triton_rows.rows(x, t, labels, spec, scale, grad, tiles=tiles), x)
        _assert_matches(got, _torch(s, t, labels, spec, scale, grad), dtype, 0.0, _log_terms(s, t, spec, scale),
                        _tvd_jumps(s, t, spec, scale))


def test_statistics_per_vocab_tile_only_where_pass_1_takes_nothing_else():
    s, t = _logits(2, 9, torch.float32, 0)
    scale = torch.tensor(1.0, device=DEVICE)
    ok = LossSpec(loss="jsd", beta=0.5)
    tiles = _tile_planes(s, t, ok, None, 4)
    for spec, grad, stats in ((LossSpec(loss="reverse_kl"), True, False), (LossSpec(loss="cosine"), True, False),
                              (LossSpec(loss="forward_kl"), False, False), (ok, True, True),
                              (LossSpec(loss="jsd", student_softcap=30.0), True, False),
                              (LossSpec(loss="jsd", teacher_logit_scale=-1.0), True, False)):
        assert not triton_rows.tiles_fit(spec, grad, stats, False)
        with pytest.raises(ValueError, match="tiles"):
            triton_rows.rows(s.clone(), t, None, spec, scale, grad, stats, tiles=tiles)
    for bad in (tiles[:4], tiles[:, :1], tiles.double(), tiles.transpose(1, 2), tiles[:, :, :0]):
        with pytest.raises(ValueError, match="tiles"):
            triton_rows.rows(s.clone(), t, None, ok, scale, True, tiles=bad)


@pytest.mark.skipif(INTERPRET, reason="races between a program's warps: a GPU's, not the interpreter's")
@pytest.mark.parametrize("loss,beta", LOSSES)
def test_gradient_into_the_logits_own_bytes_over_a_long_row(loss, beta):
    """At the seed's vocab (126 tiles a row) a store of dL/ds into s's bytes lands on a column about half as
    many tiles into the walk: a warp running ahead of another that has not yet loaded that column would
    hand it a logit made of two bf16 gradients. Each element against the kernel writing into a buffer of
    its own, run after run: within one bf16 ulp or 1e-6 of the row's largest (the two compiled kernels may
    sum the row's constants in another order)."""
    R, V = 512, 128256
    s, t = _logits(R, V, torch.float32, 11, scale=4.0)
    labels = _labels("some_ignored", R, V, 11)
    scale = torch.tensor(1.0 / R, device=DEVICE)
    for spec in (_spec(loss, beta), _spec(loss, beta, want_soft=False)):
        apart = torch.empty(R, V, device=DEVICE, dtype=torch.bfloat16)
        want = triton_rows.rows(s.clone(), t, labels, spec, scale, True, ds=apart)
        for run in range(4):
            x = s.clone()
            view = triton_rows.grad_view(x, torch.bfloat16, spec, True)
            got = triton_rows.rows(x, t, labels, spec, scale, True, ds=view)
            a, b = view.double(), apart.double()
            bad = (a - b).abs() > b.abs() / 128 + 1e-6 * b.abs().amax(1, keepdim=True)
            assert not bad.any(), (spec, run, bad.sum().item(), bad.nonzero()[:5].tolist())
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("labels_kind", [None, "some_ignored"])
@pytest.mark.parametrize("loss,beta", LOSSES)
def test_gradient_into_the_logits_own_bytes(seed, loss, beta, labels_kind):
    """dL/ds in bf16 written into half of fp32 s's own bytes (`grad_view`: the half each row's writing pass
    has read before it stores there) equals dL/ds written into a buffer of its own, as do the losses:
    whether the pass walks the row forwards (jsd, tvd) or backwards (the others, the CE alone); with the
    per-tile statistics too. Bit for bit under the interpreter; on a GPU the two kernels (IN_PLACE adds a
    barrier) may sum in another order: within fp32 rounding, where a store over a column not yet read would
    be off by the logit's size. A view of s that is not its `grad_view` is refused."""
    scale = torch.tensor(0.37, device=DEVICE)

    def same(got, want):
        if INTERPRET:
            return all(torch.equal(a, b) for a, b in zip(got, want))
        return all(torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-6 * b.double().abs().max().item())
                   for a, b in zip(got, want))
    for i, (R, V, _) in enumerate(CASES):
        s, t = _logits(R, V, torch.float32, seed + i, scale=4.0)
        labels = _labels(labels_kind, R, V, seed + i)
        for spec in (_spec(loss, beta, temperature=0.7), _spec(loss, beta, weight_soft=0.0),
                     _spec(loss, beta, want_soft=False)):
            apart = torch.empty(R, V, device=DEVICE, dtype=torch.bfloat16)
            want = triton_rows.rows(s.clone(), t, labels, spec, scale, True, ds=apart)
            x = s.clone()
            got = triton_rows.rows(x, t, labels, spec, scale, True, ds=triton_rows.grad_view(x, torch.bfloat16, spec, True))
            assert same((*got, triton_rows.grad_view(x, torch.bfloat16, spec, True)), (*want, apart)), (spec, R, V)
            if triton_rows.tiles_fit(spec, True, False, labels is not None):
                x = s.clone()
                tiles = _tile_planes(s, t, spec, labels, 7)
                got = triton_rows.rows(x, t, labels, spec, scale, True, tiles=tiles,
                                       ds=triton_rows.grad_view(x, torch.bfloat16, spec, True))
                apart2 = torch.empty_like(apart)
                want = triton_rows.rows(s.clone(), t, labels, spec, scale, True, tiles=tiles, ds=apart2)
                assert same((*got, triton_rows.grad_view(x, torch.bfloat16, spec, True)), (*want, apart2)), (spec, R, V)
    s, t = _logits(3, 9, torch.float32, seed)
    spec = _spec(loss, beta)
    view = triton_rows.grad_view(s, torch.bfloat16, spec, True)
    wide = s.view(torch.bfloat16)
    other = wide[:, 9:] if view.data_ptr() == s.data_ptr() else wide[:, :9]
    for wrong in (other, wide[:, 1:10]):
        with pytest.raises(ValueError, match="ds: expected a buffer of its own or `grad_view"):
            triton_rows.rows(s, t, None, spec, scale, True, ds=wrong)
    with pytest.raises(TypeError, match="dtype: expected a dtype half as wide"):
        triton_rows.grad_view(s, torch.float32, spec, True)


# ------------------------------------------------------- a row sharded over vocab slices (PHASE 1, 2, 3)


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("loss,param", [("jsd", 0.3), ("skew_kl", 0.1), ("skew_kl", 1.0), ("skew_reverse_kl", 0.1),
                                        ("skew_reverse_kl", 0.6)])
def test_rows_sharded_over_vocab_slices(seed, loss, param, grad):
    """The phases of a row split over ranks' vocab slices (not in rank order; a one-column slice, one of a
    whole tile): each rank's pass 1, their statistics gathered, pass 2, its sums added over the ranks, pass 3.
    The losses every rank gets and the slices' dL/ds put together: the torch backend's on the whole rows."""
    spec = _spec(loss, param, temperature=0.7, weight_hard=0.4, weight_soft=0.6)
    R, V = 5, 700
    s, t = _logits(R, V, torch.float32, seed, scale=4.0)
    labels = _labels("some_ignored", R, V, seed)
    labels[0], labels[2] = 256, V - 1  # a slice's first column, the one-column slice's
    scale = torch.tensor(0.37, device=DEVICE)
    got = sharded(s, t, labels, spec, scale, grad, [(257, V), (0, 256), (256, 257)])
    if not grad:
        got = (got[0], got[1], s)
    _assert_matches(got, _torch(s, t, labels, spec, scale, grad), torch.float32, 0.0, _log_terms(s, t, spec, scale))


def test_every_dense_loss_runs_in_the_kernel():
    """Every loss's dense rows run in the kernel (`KERNEL_LOSSES`); a learning teacher's dL/dt is asked of it for
    mutual and co_jeffreys alone, and written only over an fp32 / fp64 t of its own."""
    from flashkd.losses import LOSSES

    assert sorted(triton_rows.KERNEL_LOSSES) == sorted(LOSSES)
    s, t = _logits(2, 9, torch.float32, 0)
    one = torch.tensor(1.0, device=DEVICE)
    with pytest.raises(ValueError, match="^teacher_grad: the teacher learns from 'mutual', 'co_jeffreys' only, got loss 'jsd'"):
        triton_rows.rows(s.clone(), t.clone(), None, LossSpec(loss="jsd"), one, True, teacher_grad=True)
    with pytest.raises(ValueError, match="^t: expected an fp32 / fp64 contiguous tensor of its own"):
        triton_rows.rows(s.clone(), t.t().contiguous().t(), None, LossSpec(loss="mutual"), one, True, teacher_grad=True)
    with pytest.raises(TypeError, match="^teacher_grad: expected a bool"):
        triton_rows.rows(s.clone(), t.clone(), None, LossSpec(loss="mutual"), one, True, teacher_grad=1)


@pytest.mark.parametrize("loss,params", [("jsd", {}), ("forward_kl", {}), ("reverse_kl", {}), ("tvd", {}),
                                         ("cosine", {}), ("skew_kl", dict(alpha=0.3)), ("jeffreys", {}),
                                         ("renyi", dict(alpha=2.0)), ("entropy_adaptive", dict(gate_min=0.2)),
                                         ("mutual", {})])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_teacher_bias_added_at_load_is_t_plus_b(loss, params, softcap, seed):
    """t_bias (a teacher head's bias, −inf at ids it rules out, as a token map's gathered head has): the rows and
    dL/ds those of t + b made first (bit for bit under the interpreter; compiled, to a few fp32 roundings, as the
    compiler contracts differently around the extra add), with and without the teacher's softcap; AKL and DKD, which read t
    outside the three passes, refuse it (the core adds their bias in the GEMM)."""
    s, t = _logits(5, 300, torch.float32, seed)
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(300, generator=g)
    b[::7] = -torch.inf
    b = b.to(DEVICE)
    labels = torch.tensor([3, -100, 0, 299, 150])
    spec = LossSpec(loss=loss, temperature=0.8, weight_hard=0.3, weight_soft=0.7, teacher_softcap=softcap, **params)
    scale = torch.tensor(0.5, device=DEVICE)
    x, want_x = (s.clone().to(DEVICE) for _ in range(2))
    got = triton_rows.rows(x, t.to(DEVICE), labels.to(DEVICE), spec, scale, True, t_bias=b.to(DEVICE))
    want = triton_rows.rows(want_x, (t + b).to(DEVICE), labels.to(DEVICE), spec, scale, True)
    for a, c in zip((*got, x), (*want, want_x)):  # NaN where they are NaN (reverse KL where p = 0 < q: inf)
        if INTERPRET:  # the same fp32 operations, one by one
            torch.testing.assert_close(a, c, rtol=0, atol=0, equal_nan=True)
        else:  # compiled: the add at load moves the compiler's FMA contractions around it (a few roundings)
            torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6 * c.nan_to_num(0, 0, 0).abs().max().item(),
                                       equal_nan=True)
    for other in ("akl", "dkd"):
        with pytest.raises(ValueError, match=f"^t_bias: expected None for loss '{other}'"):
            triton_rows.rows(s.clone().to(DEVICE), t.to(DEVICE), labels.clamp_min(0).to(DEVICE), LossSpec(loss=other),
                             scale, True, t_bias=b.to(DEVICE))
    with pytest.raises(ValueError, match=r"^t_bias: expected None or a \(300,\) float tensor"):
        triton_rows.rows(s.clone().to(DEVICE), t.to(DEVICE), None, spec, scale, True, t_bias=b[:299].to(DEVICE))


def test_heads_with_a_teacher_bias_hand_it_to_the_kernel(seed, monkeypatch):
    """fused_linear_distill with teacher_bias on the Triton rows: the kernel gets the bias (no pass adding it over
    the logits; AKL's call adds it in the GEMM instead), and the loss and gradients are the float64 torch
    backend's to fp32 rounding (−inf bias entries, as a token map's: AKL's reverse KL is inf there, NaN alike)."""
    import flashkd

    seen = []
    kernel = triton_rows.rows

    def spy(*args, **kwargs):
        seen.append(kwargs.get("t_bias") is not None)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(triton_rows, "rows", spy)
    g = torch.Generator().manual_seed(seed)
    xs, xt = torch.randn(13, 24, generator=g), torch.randn(13, 16, generator=g)
    ws, wt = torch.randn(97, 24, generator=g) / 5, torch.randn(97, 16, generator=g) / 4
    bt = torch.randn(97, generator=g)
    bt[5::9] = -torch.inf
    labels = torch.randint(97, (13,), generator=g)
    for loss in ("jsd", "akl"):
        runs = []
        for backend in ("triton", "torch"):
            dev, dt = (DEVICE, torch.float32) if backend == "triton" else ("cpu", torch.float64)
            x, w = (t.to(dev, dt).requires_grad_() for t in (xs, ws))
            seen.clear()
            out = flashkd.fused_linear_distill(x, w, *(t.to(dev, dt) for t in (xt, wt)), labels.to(dev), loss=loss,
                                               teacher_bias=bt.to(dev, dt), backend=backend, chunk_size=5)
            if backend == "triton":
                assert seen and set(seen) == {loss == "jsd"}
            runs.append([y.detach().cpu().double() for y in (out, *torch.autograd.grad(out, (x, w)))])
        for a, c in zip(*runs):
            torch.testing.assert_close(a, c, rtol=2e-5, atol=2e-5 * c.nan_to_num().abs().max().item(), equal_nan=True,
                                       msg=lambda m: f"{loss}: {m}")
