"""The losses' keywords at and past the ends of what they take, as an adversarial caller passes them: each
either gives the loss of its definition or an error naming the keyword as passed, what was expected and
what came. The regressions here were accepted silently: a top-k teacher's tail=None (LossSpec's dense
teacher) ran as tail="renormalize" and let through the losses a top-k teacher refuses; a sharding flag that
is not a bool was taken for its truth value, or not read at all; and `check_options` sorted out a name the
function does not take, unread."""

import pytest
import torch

import flashkd
import oracle
from flashkd.distill import KEYWORDS, check_options

N, H, V, K = 5, 8, 30, 4


def _inputs(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(N, H, generator=g, dtype=dtype, requires_grad=True)
    ws = torch.randn(V, H, generator=g, dtype=dtype)
    xt = 2.0 * torch.randn(N, H, generator=g, dtype=dtype)
    wt = torch.randn(V, H, generator=g, dtype=dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[1] = -100
    return xs, ws, xt, wt, labels


def _topk(seed=0):
    xs, ws, xt, wt, labels = _inputs(seed)
    ids, lp = flashkd.teacher_topk(xt, wt, K)
    return xs, ws, ids, lp, labels


def _one_line(info) -> str:
    text = str(info.value)
    assert "\n" not in text, text
    return text


# -- a top-k teacher's tail ------------------------------------------------------------------------------

@pytest.mark.parametrize("loss", ["forward_kl", "jsd", "cosine", "mutual", "co_jeffreys"])
@pytest.mark.parametrize("tail", [None, "Bucket", " renormalize", True, 0])
def test_a_tail_other_than_bucket_or_renormalize_is_refused(loss, tail):
    """tail=None is LossSpec's dense teacher: the top-k form ran it as "renormalize", and it let through the
    losses a top-k teacher cannot give (cosine of log-probs, a learning teacher of none)."""
    xs, ws, ids, lp, labels = _topk()
    with pytest.raises(ValueError) as info:
        flashkd.fused_linear_distill_topk(xs, ws, ids, lp, labels, loss=loss, tail=tail, backend="torch")
    assert _one_line(info) == f"tail: expected 'bucket' or 'renormalize', got {tail!r}"
    with pytest.raises(ValueError, match=r"^tail: expected 'bucket' or 'renormalize'"):
        check_options({"tail": tail}, "fused_linear_distill_topk")


@pytest.mark.parametrize("tail", ["bucket", "renormalize"])
def test_the_two_tails_still_run(tail):
    xs, ws, ids, lp, labels = _topk()
    got = flashkd.fused_linear_distill_topk(xs, ws, ids, lp, labels, tail=tail, backend="torch")
    assert torch.isfinite(got)
    check_options({"tail": tail}, "fused_linear_distill_topk")


# -- the sharding flags ------------------------------------------------------------------------------------

def _call(function, **kw):
    xs, ws, xt, wt, labels = _inputs()
    if function == "fused_linear_distill":
        return flashkd.fused_linear_distill(xs, ws, xt, wt, labels, backend="torch", **kw)
    if function == "fused_linear_distill_logits":
        return flashkd.fused_linear_distill_logits(xs, ws, xt @ wt.T, labels, backend="torch", **kw)
    if function == "fused_linear_distill_topk":
        ids, lp = flashkd.teacher_topk(xt, wt, K)
        return flashkd.fused_linear_distill_topk(xs, ws, ids, lp, labels, backend="torch", **kw)
    return flashkd.teacher_topk(xt, wt, K, backend="torch", **kw)


FUNCTIONS = ["fused_linear_distill", "fused_linear_distill_logits", "fused_linear_distill_topk", "teacher_topk"]


FLAGS = [("check_shards", "no", "a bool or None"), ("check_shards", 0, "a bool or None"),
         ("check_replicas", "no", "a bool"), ("check_replicas", 1, "a bool"), ("check_replicas", None, "a bool")]


@pytest.mark.parametrize("function,name,value,expected", [
    (function, *flag) for function in FUNCTIONS for flag in FLAGS if flag[0] in KEYWORDS[function]])
def test_a_sharding_flag_that_is_not_a_bool_is_refused_without_a_process_group(function, name, value, expected):
    """A str passed for True where the flag is read (a DTensor head's exchange reads check_shards without a
    process group), and for nothing on an unsharded call: the docs' rule, the check_* flags are bools."""
    with pytest.raises(TypeError) as info:
        _call(function, **{name: value})
    assert _one_line(info) == f"{name}: expected {expected}, got {value!r}"


@pytest.mark.parametrize("function", FUNCTIONS)
def test_bool_sharding_flags_still_run_unsharded(function):
    kw = {name: value for name, value in (("check_shards", False), ("check_replicas", True))
          if name in KEYWORDS[function]}
    got, want = _call(function, **kw), _call(function)
    got, want = (got, want) if function == "teacher_topk" else ((got,), (want,))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# -- check_options: only the function's own keywords -------------------------------------------------------

@pytest.mark.parametrize("function,name,value", [
    ("fused_linear_distill", "betta", 0.2),  # misspelt
    ("fused_linear_distill", "Beta", 0.2),
    ("fused_linear_distill", "tail", "bucket"),  # the top-k form's
    ("fused_linear_distill", "labels", None),  # per-call data, not an option
    ("fused_linear_distill_logits", "teacher_precision", "fp8"),  # the heads form's
    ("fused_linear_distill_topk", "teacher_logit_scale", 2.0),  # a dense teacher's
    pytest.param("fused_linear_distill_topk", "foo", 10**5000, id="huge-int"),  # its repr past 4300 digits raises
])
def test_check_options_refuses_a_name_the_function_does_not_take(function, name, value):
    """It sorted the options by the keyword table, and a name outside the function's keywords went nowhere,
    unread (a module's or trainer's option checked as fine, then refused or ignored by the call)."""
    with pytest.raises(TypeError) as info:
        check_options({name: value}, function)
    assert _one_line(info).startswith(f"{name}: expected a keyword option of flashkd.{function}, got {name}=")


def test_check_options_still_takes_every_keyword_of_the_function():
    for function in ("fused_linear_distill", "fused_linear_distill_logits", "fused_linear_distill_topk"):
        check_options(dict(KEYWORDS[function]), function)


# -- the parameters at their range's ends: the definition's value ---------------------------------------------

@pytest.mark.parametrize("loss,params", [
    ("jsd", dict(beta=0.0)), ("jsd", dict(beta=1)), ("skew_kl", dict(alpha=0.0)), ("skew_kl", dict(alpha=1.0)),
    ("skew_reverse_kl", dict(alpha=1.0)), ("akl", dict(head_mass=0.0)), ("alpha_divergence", dict(alpha=1e-6)),
    ("renyi", dict(alpha=2)), ("renyi_reverse", dict(alpha=1.0)), ("ab_divergence", dict(alpha=0.05, beta=2.0)),
    ("dkd", dict(alpha=0, beta=0)), ("dkd", dict(alpha=0.0)), ("entropy_adaptive", dict(gate_min=1.0, gate_max=1.0)),
    ("entropy_adaptive", dict(gate_width=1e-12)), ("cosine", dict(beta=0.0))])
@pytest.mark.parametrize("temperature", [1, 0.25])
def test_a_parameter_at_its_ranges_end_gives_the_definitions_value(loss, params, temperature):
    """Ints where floats go are taken (1 is 1.0); the ends are the formulas', in float64."""
    xs, ws, xt, wt, labels = _inputs()
    got = flashkd.fused_linear_distill(xs, ws, xt, wt, labels, loss=loss, temperature=temperature, backend="torch",
                                       **params)
    want = oracle.distill_loss(xs, ws, xt, wt, labels, loss=loss, temperature=temperature,
                               **{k: float(v) for k, v in params.items()})[0]
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("value", [torch.tensor(0.5), torch.tensor(0.5, dtype=torch.float64), "0.5", True])
def test_a_parameter_that_is_no_python_float_is_refused(value):
    """A 0-d tensor would need a host sync to read (and a bool is no weight): refused, not converted."""
    xs, ws, xt, wt, labels = _inputs()
    with pytest.raises(TypeError) as info:
        flashkd.fused_linear_distill(xs, ws, xt, wt, labels, loss="jsd", beta=value)
    assert _one_line(info).startswith("beta: expected a finite Python float, got ")
