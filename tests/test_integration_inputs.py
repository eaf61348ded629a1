"""Bad inputs to the verl and axolotl integrations (`flashkd.integrations.verl.topk_outputs`,
`check_options`, `patch`'s options; `flashkd.integrations.axolotl.FusedLinearKLTopKLogprobLoss`): each is
refused with a ValueError / TypeError that names the argument as the caller passed it, or computed right
(checked against a float64 autograd of the formula). Neither integration's peer library is needed: the
patch's options are checked before verl is imported. Tiny shapes, the torch backend but where noted."""

import importlib.metadata
import math
import os

import pytest
import torch
import torch.nn.functional as F

import flashkd.integrations.axolotl as fk_ax
import flashkd.integrations.verl as fk_verl
from conftest import BACKENDS

META = torch.device("meta")


# --- verl -------------------------------------------------------------------------------------------


def _verl_problem(n=5, h=8, v=23, k=4, dtype=torch.float64):
    x = torch.randn(n, h, dtype=torch.float64)
    w = torch.randn(v, h, dtype=torch.float64)
    ids = torch.stack([torch.randperm(v)[:k] for _ in range(n)])
    lp = torch.log_softmax(torch.randn(n, v, dtype=torch.float64), -1).gather(1, ids)
    return x.to(dtype), w.to(dtype), ids, lp


def _verl_oracle(x, w, ids, lp, b=None, clamp=None):
    """verl's forward KL in float64: Σ p (log p − log q) over the ids, its clamps included."""
    z = x.double() @ w.double().t() + (0.0 if b is None else b.double())
    log_q = torch.log_softmax(z, -1).gather(-1, ids)
    lp = lp.double()
    if clamp is not None:
        log_q, lp = log_q.clamp_min(clamp), lp.clamp_min(clamp)
    return (lp.exp() * (lp - log_q)).sum(-1)


def test_verl_ranks_and_empty_sizes_name_the_argument():
    x, w, ids, lp = _verl_problem()
    with pytest.raises(ValueError, match=r"^hidden_states: expected a tensor of shape \(\.\.\., H\)"):
        fk_verl.topk_outputs(x[0, 0], w, ids[0, 0], lp[0, 0])  # was an IndexError
    with pytest.raises(ValueError, match=r"^teacher_ids, teacher_logprobs: expected shape \(K\)"):
        fk_verl.topk_outputs(x[0], w, ids[0, 0], lp[0, 0])  # was an IndexError
    with pytest.raises(ValueError, match=r"^teacher_ids: expected 1 <= K <= V = 23, got K = 0"):
        fk_verl.topk_outputs(x, w, ids[:, :0], lp[:, :0])  # was a RuntimeError of reshape
    with pytest.raises(ValueError, match=r"^hidden_states: .*H >= 1, got shape \(5, 0\)"):
        fk_verl.topk_outputs(x[:, :0], w[:, :0], ids, lp)
    with pytest.raises(ValueError, match=r"^lm_head_weight: expected shape \(V, 8\) with V >= 1, got \(0, 8\)"):
        fk_verl.topk_outputs(x, w[:0], ids, lp)
    with pytest.raises(ValueError, match=r"^lm_head_bias: .*got shape \(24,\)"):
        fk_verl.topk_outputs(x, w, ids, lp, lm_head_bias=torch.zeros(24, dtype=x.dtype))


def test_verl_dtypes_name_the_argument():
    x, w, ids, lp = _verl_problem()
    with pytest.raises(TypeError, match=r"^hidden_states: expected a floating dtype .* got torch.int64"):
        fk_verl.topk_outputs(x.long(), w, ids, lp)  # was worded as lm_head_weight's
    with pytest.raises(TypeError, match=r"^teacher_logprobs: expected a floating dtype .* got torch.int64"):
        fk_verl.topk_outputs(x, w, ids, lp.long())  # was cast to float64 unseen
    with pytest.raises(TypeError, match=r"^teacher_logprobs: .* got torch.bool"):
        fk_verl.topk_outputs(x, w, ids, lp < -2)
    with pytest.raises(TypeError, match=r"^lm_head_bias: expected dtype torch.float64 .* got torch.float32"):
        fk_verl.topk_outputs(x, w, ids, lp, lm_head_bias=torch.zeros(w.shape[0]))  # was a RuntimeError of mm
    with pytest.raises(TypeError, match=r"^lm_head_bias: expected a torch.Tensor, got list"):
        fk_verl.topk_outputs(x, w, ids, lp, lm_head_bias=[0.0] * w.shape[0])
    # a dW accumulator narrower than the head's dtype rounded dW unseen (3.5e-4 relative for fp16)
    x32, w32 = x.float(), w.float().requires_grad_()
    with pytest.raises(TypeError, match=r"^grad_accum_dtype: expected torch.float32 or lm_head_weight's dtype"):
        fk_verl.topk_outputs(x32, w32, ids, lp, grad_accum_dtype=torch.float16)
    with pytest.raises(TypeError, match=r"^grad_accum_dtype: expected torch.float64 or lm_head_weight's dtype"):
        fk_verl.topk_outputs(x, w, ids, lp, grad_accum_dtype=torch.float32)


def test_verl_devices_name_the_argument():
    x, w, ids, lp = _verl_problem()
    bias = torch.zeros(w.shape[0], dtype=x.dtype)
    # a head on meta gave values from nothing; the others failed inside torch without a name
    for name, args, kw in (("lm_head_weight", (x, w.to(META), ids, lp), {}),
                           ("teacher_ids", (x, w, ids.to(META), lp), {}),
                           ("teacher_logprobs", (x, w, ids, lp.to(META)), {}),
                           ("lm_head_bias", (x, w, ids, lp), {"lm_head_bias": bias.to(META)})):
        with pytest.raises(ValueError, match=rf"^{name}: expected a tensor on cpu \(the device of hidden_states\), "
                                             rf"got meta"):
            fk_verl.topk_outputs(*args, **kw)


def test_verl_teacher_values_checked_on_cpu():
    x, w, ids, lp = _verl_problem()
    dup = ids.clone()
    dup[:, 1] = dup[:, 0]  # a repeated id counted twice in q's normaliser: a loss verl does not compute
    with pytest.raises(ValueError, match=r"^teacher_ids: expected distinct ids within a row"):
        fk_verl.topk_outputs(x, w, dup, lp)
    for bad in (lp.abs() + 0.1, torch.full_like(lp, math.nan), lp + math.inf):
        with pytest.raises(ValueError, match=r"^teacher_logprobs: expected log-probabilities <= 0"):
            fk_verl.topk_outputs(x, w, ids, bad)
    big = torch.full_like(lp, math.log(0.4))  # 1.6 in all: the tail bucket would hold no mass, unseen
    with pytest.raises(ValueError, match=r"^teacher_logprobs: expected probabilities summing to at most 1"):
        fk_verl.topk_outputs(x, w, ids, big, loss="jsd")
    with_inf = lp.clone()
    with_inf[2, 3] = -math.inf  # verl's p·(log p − log q) is NaN there without a clamp
    with pytest.raises(ValueError, match=r"^teacher_logprobs: expected finite .* got -inf in row 2; set "
                                         r"log_prob_min_clamp"):
        fk_verl.topk_outputs(x, w, ids, with_inf)
    out = fk_verl.topk_outputs(x, w, ids, with_inf, log_prob_min_clamp=-10.0)  # clamped: as verl computes it
    torch.testing.assert_close(out["distillation_losses"], _verl_oracle(x, w, ids, with_inf, clamp=-10.0),
                               rtol=1e-12, atol=1e-12)
    # the reverse KL at a teacher probability of 0 is +inf, as it should be (no clamp there)
    assert fk_verl.topk_outputs(x, w, ids, with_inf, loss="reverse_kl")["distillation_losses"][2] == math.inf


def test_verl_options_refused_where_given():
    x, w, ids, lp = _verl_problem()
    with pytest.raises(ValueError, match=r"^predicted_clamp: expected lo <= hi, got \(1\.0, 0\.0\)"):
        fk_verl.check_options(predicted_clamp=(1.0, 0.0))
    with pytest.raises(ValueError, match=r"^predicted_clamp: expected lo <= hi"):
        fk_verl.topk_outputs(x, w, ids, lp, predicted_clamp=(1.0, 0.0))
    fk_verl.check_options(predicted_clamp=(0.0, 0.0))  # a point is a range


def test_verl_patch_checks_its_options_before_importing_verl(monkeypatch):
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.9.1" if name == "verl" else real(name))
    # what the patch sets itself for each micro-batch: refused, not overridden (or passed twice) at the
    # first training step
    for name, value in (("temperature", 2.0), ("log_prob_min_clamp", -5.0), ("predicted_grad", torch.ones(3)),
                        ("predicted_clamp", (0.0, 1.0)), ("lm_head_bias", torch.zeros(3))):
        with pytest.raises(TypeError, match=rf"^{name}: expected from .*, not as an option of patch\(\)"):
            fk_verl.patch(**{name: value})
    with pytest.raises(ValueError, match=r"^loss: expected one of"):
        fk_verl.patch(loss="tvd")
    with pytest.raises(ValueError, match=r"^chunk_size"):
        fk_verl.patch(chunk_size=0)
    with pytest.raises(TypeError, match=r"^foo: expected a keyword option of topk_outputs"):
        fk_verl.patch(foo=1)
    assert not fk_verl.is_patched()


@pytest.mark.parametrize("grads", [(True, False, False), (False, True, False), (False, False, True),
                                   (False, False, False), (True, True, True)])
def test_verl_gradients_of_each_input_alone(grads):
    """Each of hidden states, head and bias alone requiring grad, none, all: the same values, and the
    gradient of those that require it, as a float64 autograd of verl's formula (torch backend)."""
    x, w, ids, lp = _verl_problem(dtype=torch.float32)
    b = torch.randn(w.shape[0])
    leaves = [t.clone().requires_grad_(r) for t, r in zip((x, w, b), grads)]
    ref = [t.double().clone().requires_grad_(r) for t, r in zip((x, w, b), grads)]
    out = fk_verl.topk_outputs(*leaves[:2], ids, lp, lm_head_bias=leaves[2], backend="torch")["distillation_losses"]
    exact = _verl_oracle(*ref[:2], ids, lp, b=ref[2])
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-6)
    assert out.requires_grad == any(grads)
    if any(grads):
        g = torch.randn(out.shape)
        (out * g).sum().backward()
        (exact * g.double()).sum().backward()
    for ours, theirs, wanted in zip(leaves, ref, grads):
        assert (ours.grad is not None) == wanted
        if wanted:
            torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=1e-4, atol=1e-5)


def test_verl_strided_inputs_and_no_rows():
    x, w, ids, lp = _verl_problem()
    # expanded (stride 0), transposed-back and column-sliced inputs: the same as their contiguous copies
    xe, ide, lpe = x[:1].expand(5, -1), ids[:1].expand(5, -1), lp[:1].expand(5, -1)
    lps = torch.cat([lp, lp], 1)[:, ::2]
    for args in ((xe, w, ide, lpe), (x.t().contiguous().t(), w, ids.t().contiguous().t(), lps)):
        out = fk_verl.topk_outputs(*args, backend="torch")["distillation_losses"]
        torch.testing.assert_close(out, _verl_oracle(*(t.contiguous() for t in args)), rtol=1e-12, atol=1e-12)
    for backend in BACKENDS:  # N = 0 rows: empty outputs and a zero dW (Triton's on CUDA where there is a GPU)
        dev = "cuda" if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
        if dev == "cuda" and not torch.cuda.is_available():
            continue
        xg, wg = x[:0].float().to(dev).requires_grad_(), w.float().to(dev).requires_grad_()
        out = fk_verl.topk_outputs(xg, wg, ids[:0].to(dev), lp[:0].to(dev), backend=backend)
        assert all(v.shape == (0,) for v in out.values())
        out["distillation_losses"].sum().backward()
        assert xg.grad.shape == (0, 8) and not wg.grad.any()


# --- axolotl ----------------------------------------------------------------------------------------


def _ax_problem(b=2, t=3, h=8, v=23, k=4):
    x = torch.randn(b, t, h, dtype=torch.float64)
    w = torch.randn(v, h, dtype=torch.float64)
    ids = torch.stack([torch.randperm(v)[:k] for _ in range(b * t)]).reshape(b, t, k)
    lp = torch.log_softmax(torch.randn(b, t, k, dtype=torch.float64), -1)
    mask = torch.ones(b, t, k, dtype=torch.long)
    labels = torch.randint(0, v, (b, t))
    return w, x, ids, lp, mask, labels


def _ax_oracle(w, x, ids, lp, mask, labels, *, w_hard=0.5, w_soft=0.5, beta=1.0, normalize=True):
    """axolotl's loss (τ = 1) in float64, its CE on the labels shifted by one."""
    k = ids.shape[-1]
    logits = x.reshape(-1, x.shape[-1]) @ w.t()
    lq = logits.gather(-1, ids.reshape(-1, k)) - logits.logsumexp(-1, keepdim=True)
    if normalize:
        lq = lq - lq.logsumexp(-1, keepdim=True)
    used = mask.reshape(-1, k).bool()
    lq, lpt = lq[used], lp.reshape(-1, k)[used]
    q, p = lq.exp(), lpt.exp()
    soft = (p * (lpt - lq)).sum() if beta == 0.0 else (q * (lq - lpt)).sum()
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:].reshape(-1)
    return w_soft * soft + w_hard * F.cross_entropy(logits, shifted, reduction="sum", ignore_index=-100)


def _replaced(args, i, value):
    args = list(args)
    args[i] = value
    return args


def test_axolotl_tensor_types_shapes_and_devices_name_the_argument():
    args = _ax_problem()
    w, x, ids, lp, mask, labels = args
    loss = fk_ax.FusedLinearKLTopKLogprobLoss()
    cases = [  # (argument index, bad value, error type, message start): each used to fail unnamed or pass
        (1, x.tolist(), TypeError, r"student_hidden_states: expected a torch.Tensor, got list"),
        (2, ids.tolist(), TypeError, r"target_token_ids: expected a torch.Tensor, got list"),
        (1, x.long(), TypeError, r"student_hidden_states: expected a floating dtype"),
        (0, w.float(), TypeError, r"lm_head_weight: expected dtype torch.float64 \(the dtype of student_hidden_states\)"),
        (0, w.t(), ValueError, r"lm_head_weight: expected shape \(V, 8\)"),
        (2, ids[..., :0], ValueError, r"target_token_ids: expected shape \(2, 3, K\) with K >= 1"),
        (3, lp[..., :3], ValueError, r"target_logprobs: expected shape \(2, 3, 4\) \(that of target_token_ids\)"),
        (4, mask[..., :1], ValueError, r"target_mask: expected shape \(2, 3, 4\)"),  # not broadcast
        (2, ids.double(), TypeError, r"target_token_ids: expected an integer dtype, got torch.float64"),  # was truncated
        (2, ids > 5, TypeError, r"target_token_ids: expected an integer dtype, got torch.bool"),
        (3, lp.long(), TypeError, r"target_logprobs: expected a floating dtype"),  # was cast unseen
        (5, labels.double(), TypeError, r"true_labels: expected an integer dtype"),  # was named `labels`
        (2, ids.to(META), ValueError, r"target_token_ids: expected a tensor on cpu"),
        (3, lp.to(META), ValueError, r"target_logprobs: expected a tensor on cpu"),
        (4, mask.to(META), ValueError, r"target_mask: expected a tensor on cpu"),
        (5, labels.to(META), ValueError, r"true_labels: expected a tensor on cpu"),
        (0, w.to(META), ValueError, r"lm_head_weight: expected a tensor on cpu"),
    ]
    for i, bad, error, message in cases:
        with pytest.raises(error, match="^" + message):
            loss(*_replaced(args, i, bad))
    with pytest.raises(TypeError, match=r"^student_bias: expected dtype torch.float64"):
        loss(*args, torch.zeros(w.shape[0]))


def test_axolotl_teacher_values_checked_on_cpu():
    args = _ax_problem()
    w, x, ids, lp, mask, labels = args
    first = torch.arange(ids.shape[-1]) == 0
    loss = fk_ax.FusedLinearKLTopKLogprobLoss()
    # an id of -1 at a slot the mask keeps was taken as flashkd's unused slot: a different loss, unseen
    with pytest.raises(ValueError, match=r"^target_token_ids: expected ids >= 0 where target_mask is set, got -1"):
        loss(*_replaced(args, 2, torch.where(first, -1, ids)))
    # where the mask drops the slot, its id is not read: the loss of the kept rows (whole rows masked, as
    # axolotl's collators mask them: the module docstring says why)
    dropped = mask.clone()
    dropped[0, 0] = 0
    padded = ids.clone()
    padded[0, 0, 0] = -1
    out = loss(*_replaced(_replaced(args, 2, padded), 4, dropped))
    torch.testing.assert_close(out, _ax_oracle(w, x, ids, lp, dropped, labels), rtol=1e-10, atol=1e-10)
    # positive log-probs were renormalised away on the forward-KL path without normalize_topk
    forward = fk_ax.FusedLinearKLTopKLogprobLoss(beta=0.0, normalize_topk=False)
    with pytest.raises(ValueError, match=r"^target_logprobs: expected log-probabilities <= 0 \(not NaN\) where "
                                         r"target_mask is set, got \d\.\d+ in row 0"):
        forward(*_replaced(args, 3, lp + 5.0))
    with pytest.raises(ValueError, match=r"^target_logprobs: .* got nan"):
        forward(*_replaced(args, 3, lp * math.nan))
    dup = ids.clone()
    dup[..., 1] = dup[..., 0]
    with pytest.raises(ValueError, match=r"^target_token_ids: expected distinct ids"):  # flashkd's check, renamed
        loss(*_replaced(args, 2, dup))
    # check_teacher=False: not checked (the caller's choice, as flashkd's own calls take it)
    unchecked = fk_ax.FusedLinearKLTopKLogprobLoss(beta=0.0, normalize_topk=False, check_teacher=False)
    assert torch.isfinite(unchecked(*_replaced(args, 3, lp + 5.0)))


def test_axolotl_constructor_flags():
    for name, value in (("compute_ce_loss", "no"), ("normalize_topk", "no"), ("compiled", "no"),
                        ("normalize_topk", torch.tensor(True))):
        with pytest.raises(TypeError, match=rf"^{name}: expected a bool"):  # were read by their truth value
            fk_ax.FusedLinearKLTopKLogprobLoss(beta=0.0, **{name: value})
    for value in (0, -1, 2.5, True, None):
        with pytest.raises(ValueError, match=r"^chunk_size: expected an int >= 1"):
            fk_ax.FusedLinearKLTopKLogprobLoss(chunk_size=value)
    with pytest.raises(ValueError, match=r"^normalize_topk: expected True with beta=1\.0 .* got None"):
        fk_ax.FusedLinearKLTopKLogprobLoss(beta=1.0, normalize_topk=None)
    # None, axolotl's unset kd_normalize_topk, reads as False there and here
    args = _ax_problem()
    loss = fk_ax.FusedLinearKLTopKLogprobLoss(beta=0.0, normalize_topk=None)
    assert loss.normalize_topk is False
    torch.testing.assert_close(loss(*args), _ax_oracle(*args, beta=0.0, normalize=False), rtol=1e-10, atol=1e-10)


def test_axolotl_attributes_set_after_construction_are_checked():
    """forward reads the loss's attributes; set after construction they skipped the constructor's checks:
    `beta = 0.5` beside normalize_topk False (a loss axolotl does not compute), a weight past 1, a flag "yes"
    read by its truth value, a temperature below 0, an option set by forward itself. Refused, the value kept."""
    args = _ax_problem()
    loss = fk_ax.FusedLinearKLTopKLogprobLoss(beta=0.0, normalize_topk=False)
    for name, value, error, message in (
            ("beta", 0.5, ValueError, r"normalize_topk: expected True with beta=0\.5"),
            ("weight_soft_loss", 2.0, ValueError, r"weight_soft_loss: expected a value in \[0, 1\]"),
            ("normalize_topk", "yes", TypeError, r"normalize_topk: expected a bool"),
            ("temperature", -1.0, ValueError, r"temperature: expected a float > 0"),
            ("flashkd_options", {"loss": "tvd"}, TypeError, r"loss: expected a keyword of axolotl's loss")):
        with pytest.raises(error, match="^" + message):
            setattr(loss, name, value)
    assert (loss.beta, loss.weight_soft_loss, loss.normalize_topk, loss.temperature, loss.flashkd_options) == (
        0.0, 0.5, False, 1.0, {})
    loss.normalize_topk, loss.beta = True, 1.0  # a valid change is read by the next forward
    torch.testing.assert_close(loss(*args), _ax_oracle(*args, beta=1.0, normalize=True), rtol=1e-10, atol=1e-10)
