"""flashkd.integrations.verl: verl's own `compute_forward_kl_topk` (its FSDP engine's top-k loss and
diagnostics, from the student's logits) against `topk_outputs` (from hidden states and the LM head),
values and diagnostics; the gradients against a float64 autograd of verl's formula; the reverse-KL and
JSD options against flashkd's top-k definition on the dense logits; bf16 at a trained head's
magnitudes; `patch()`'s version refusal. On CPU, with verl installed without its dependencies
(tests/requirements-frameworks.txt); the Triton backend and kernels on DEVICE (the GPU, or the CPU under
Triton's interpreter), their references on the CPU unless a test compares them bit for bit."""

import importlib
import importlib.util
import math
import sys
import types
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed", allow_module_level=True)

import flashkd.integrations.verl as fk_verl  # noqa: E402
from flashkd.losses import LossSpec, topk_row_losses  # noqa: E402
from conftest import BACKENDS, BACKEND_PARAMS, DEVICE, TRITON_RUNS, _device, needs_triton  # noqa: E402
from helpers.cases import read  # noqa: E402
from helpers.integrations import check_refuses_version  # noqa: E402
from helpers.ties import near, tied_rows  # noqa: E402


def _load_reference():
    """verl's fsdp/losses.py as installed: benchmarks/_verl_losses.py (loaded by path) says how."""
    spec = importlib.util.spec_from_file_location("_verl_losses", Path(__file__).parent.parent / "benchmarks"
                                                  / "_verl_losses.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.load_verl_losses()


verl_losses = _load_reference()


def _config(clamp=None, chunked=False):
    loss = types.SimpleNamespace(log_prob_min_clamp=clamp, use_chunked_topk=chunked, chunked_topk_chunk_size=5, topk=None)
    return types.SimpleNamespace(distillation_loss=loss)


def _verl(logits, ids, lp, lengths, clamp=None, chunked=False):
    """verl's reference on (1, N, V) logits; teacher tensors nested by sequence, as its engine gives them."""
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    nested = [torch.nested.nested_tensor_from_jagged(t, offsets) for t in (lp, ids)]
    out = verl_losses.compute_forward_kl_topk(logits[None], nested[0], nested[1], _config(clamp, chunked), "thd")
    return {k: v[0] for k, v in out.items()}


def _problem(n=37, h=24, v=211, k=8, dtype=torch.float64, std=4.0, peak=30.0):
    """Trained-head magnitudes: student logits of std ~`std` with a peak near `peak` on some rows; a
    teacher's top-k ids and log-probs from its own (correlated) logits, so that the top-k sets overlap."""
    x = torch.randn(n, h, dtype=torch.float64)
    w = torch.randn(v, h, dtype=torch.float64) * std / math.sqrt(h)
    hot = torch.randint(0, v, (n // 3,))
    w[hot] += x[: n // 3] * (peak / h)  # rows 0 .. n/3: a logit near `peak` at one id
    t_logits = (x @ w.t()) * 0.8 + torch.randn(n, v, dtype=torch.float64) * 2.0
    lp_all = torch.log_softmax(t_logits, -1)
    lp, ids = lp_all.topk(k, -1)
    return x.to(dtype), w.to(dtype), ids, lp.to(dtype)


def _oracle(x, w, ids, lp, tau, clamp):
    """verl's formula in float64, differentiable: Σ p (log p − log q) over the ids, clamps included."""
    z = (x @ w.t()) / tau
    log_q = torch.log_softmax(z, -1).gather(-1, ids)
    if clamp is not None:
        log_q, lp = log_q.clamp_min(clamp), lp.clamp_min(clamp)
    return (lp.exp() * (lp - log_q)).sum(-1)


def _clamp_ties(x, w, ids, lp, tau, clamp, rtol):
    """(rows,) bool: the rows whose gradient jumps within rtol of a clamp: a student log-prob at
    log_prob_min_clamp, or the row's loss at verl's clamp at 0 (not exactly 0: that is a row whose ids
    the clamp cuts on both sides, 0 with no gradient on either). They get weight 0 downstream."""
    x, w, lp = x.detach().double(), w.detach().double(), lp.detach().double()
    loss = _oracle(x, w, ids, lp, tau, clamp)
    tie = (near(loss, 0.0, rtol=0.0, atol=rtol) & (loss != 0))[:, None]
    if clamp is not None:
        tie = tie | near(torch.log_softmax((x @ w.t()) / tau, -1).gather(-1, ids), clamp, rtol)
    return tied_rows(tie)


CASES = [  # temperature, log_prob_min_clamp, verl's use_chunked_topk
    (1.0, None, False),
    (1.0, -8.0, False),
    (0.7, None, True),
    (1.6, -6.0, True),
    (1.0, -0.5, False),  # most student log-probs clamped
]


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("tau, clamp, chunked", CASES)
def test_outputs_match_verl(tau, clamp, chunked, backend, seed):
    x, w, ids, lp = _problem()
    lengths = [5, 1, 20, 11]
    ref = _verl((x @ w.t()) / tau, ids, lp, lengths, clamp, chunked)
    dev = _device(backend)
    xs, ws = x.to(dev, copy=True).requires_grad_(), w.to(dev, copy=True).requires_grad_()
    ours = fk_verl.topk_outputs(xs, ws, ids.to(dev), lp.to(dev), temperature=tau, log_prob_min_clamp=clamp,
                                chunk_size=7, backend=backend)
    ours = {name: t.cpu() for name, t in ours.items()}  # the losses' graph goes on through the copy
    assert set(ours) == set(ref)
    assert torch.equal(ours["overlap_count"], ref["overlap_count"])
    assert 0 < ref["overlap_count"].sum() < ids.numel()  # the overlap is neither empty nor total
    # verl's chunked path takes its log-softmax in fp32 (`_chunked_topk_log_probs`): equal to its rounding
    tol = dict(rtol=2e-6, atol=2e-6) if chunked else dict(rtol=1e-10, atol=1e-12)
    for name in ("student_mass", "teacher_mass", "overlap_token_advantage"):
        torch.testing.assert_close(ours[name], ref[name], **tol, msg=name)
    # verl's kl_divergence casts its inputs to fp32: equal to its rounding; to the float64 formula at 1e-10
    truth = _oracle(x, w, ids, lp, tau, clamp)
    torch.testing.assert_close(ref["distillation_losses"].double(), truth, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(ours["distillation_losses"], truth, rtol=1e-10, atol=1e-12)
    if clamp is not None:
        log_q = torch.log_softmax((x @ w.t()) / tau, -1).gather(-1, ids)
        assert (log_q < clamp).any() and (log_q > clamp).any()  # the clamp cuts some ids, not all

    # gradients: of verl's downstream use, its clamp at 0 then a weighted sum (any aggregation is one)
    g = torch.rand(x.shape[0], dtype=torch.float64) + 0.5
    g[_clamp_ties(x, w, ids, lp, tau, clamp, 1e-12)] = 0.0  # float64 on both sides
    (ours["distillation_losses"].clamp_min(0.0) * g).sum().backward()
    xo, wo = x.clone().requires_grad_(), w.clone().requires_grad_()
    (_oracle(xo, wo, ids, lp, tau, clamp).clamp_min(0.0) * g).sum().backward()
    torch.testing.assert_close(xs.grad.cpu(), xo.grad, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(ws.grad.cpu(), wo.grad, rtol=1e-9, atol=1e-11)


def test_negative_losses_get_no_gradient(seed):
    """verl clamps the per-token losses at 0: a row below it is cut there, in values and gradients."""
    x, w, ids, lp = _problem(n=16)
    lp = lp - 1.5  # teacher mass ~e^-1.5 on its ids: Σ p (log p − log q) < 0 on some rows
    xs = x.clone().requires_grad_()
    loss = fk_verl.topk_outputs(xs, w, ids, lp)["distillation_losses"]
    assert (loss < 0).any() and (loss > 0).any()
    keep = (~_clamp_ties(x, w, ids, lp, 1.0, None, 1e-12)).double()  # float64 on both sides
    (loss.clamp_min(0.0) * keep).sum().backward()
    xo = x.clone().requires_grad_()
    (_oracle(xo, w, ids, lp, 1.0, None).clamp_min(0.0) * keep).sum().backward()
    torch.testing.assert_close(xs.grad, xo.grad, rtol=1e-9, atol=1e-11)
    assert (xs.grad[loss < 0] == 0).all()


def _topk_oracle(x, w, ids, lp, tau, loss, beta):
    """flashkd's top-k form written out in float64 on dense logits: categories = the ids + a bucket."""
    log_q_all = torch.log_softmax((x @ w.t()) / tau, -1)
    log_q_k = log_q_all.gather(-1, ids)
    on_ids = torch.zeros_like(log_q_all, dtype=torch.bool).scatter(-1, ids, True)
    log_q_rest = torch.logsumexp(log_q_all.masked_fill(on_ids, -torch.inf), -1, keepdim=True)
    p_k = lp.exp()
    p_rest = (1.0 - p_k.sum(-1, keepdim=True)).clamp_min(0.0)
    q = torch.cat([log_q_k, log_q_rest], -1).exp()
    p = torch.cat([p_k, p_rest], -1)
    p = p / p.sum(-1, keepdim=True)

    def kl(a, b):
        return (a * torch.where(a > 0, a.log() - b.log(), 0.0)).sum(-1)

    if loss == "reverse_kl":
        return kl(q, p)
    m = beta * p + (1 - beta) * q
    return beta * kl(p, m) + (1 - beta) * kl(q, m)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("loss, beta, tau", [("reverse_kl", None, 1.0), ("jsd", 0.5, 1.0), ("jsd", 0.2, 0.8)])
def test_reverse_kl_and_jsd_options(loss, beta, tau, backend, seed):
    x, w, ids, lp = _problem(n=23)
    # The teacher's rest 1 − Σ p between 1e-3 and 0.3: a rest near float64's cancellation (a peaked
    # teacher's, ~1e-14) is known to ~1e-2 of itself, and a reverse KL weighs it by q_rest / p_rest
    rest = 10 ** (torch.rand(x.shape[0], 1, dtype=torch.float64) * 2.5 - 3)
    lp = lp - lp.logsumexp(-1, keepdim=True) + torch.log1p(-rest)
    dev = _device(backend)
    xs, ws = x.to(dev, copy=True).requires_grad_(), w.to(dev, copy=True).requires_grad_()
    out = fk_verl.topk_outputs(xs, ws, ids.to(dev), lp.to(dev), temperature=tau, backend=backend,
                               **read(dict(loss=loss, beta=beta), "forward_kl"))  # beta where the loss reads it
    out = {name: t.cpu() for name, t in out.items()}  # the losses' graph goes on through the copy
    truth_x, truth_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    truth = _topk_oracle(truth_x, truth_w, ids, lp, tau, loss, beta)
    torch.testing.assert_close(out["distillation_losses"], truth.detach(), rtol=1e-10, atol=1e-12)
    g = torch.rand(x.shape[0], dtype=torch.float64)
    (out["distillation_losses"] * g).sum().backward()
    (truth * g).sum().backward()
    torch.testing.assert_close(xs.grad.cpu(), truth_x.grad, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(ws.grad.cpu(), truth_w.grad, rtol=1e-9, atol=1e-11)
    # the diagnostics are verl's whatever the loss
    ref = _verl(x @ w.t() / tau, ids, lp, [x.shape[0]])
    assert torch.equal(out["overlap_count"], ref["overlap_count"])
    torch.testing.assert_close(out["student_mass"], ref["student_mass"], rtol=1e-10, atol=1e-12)


def test_bf16_at_trained_magnitudes(seed):
    """bf16 hidden states and head: the per-token losses within 1.3x the error of verl's formula on fp32
    logits of the same bf16 inputs (the fp32-logit pipeline), both against float64 on those inputs."""
    x, w, ids, lp = _problem(n=64, h=64, v=1031, k=16)
    xb, wb = x.bfloat16(), w.bfloat16()
    truth = _oracle(xb.double(), wb.double(), ids, lp, 1.0, None)
    fp32 = _verl(xb.float() @ wb.float().t(), ids, lp.float(), [64])["distillation_losses"].double()
    ours = fk_verl.topk_outputs(xb, wb, ids, lp.float())["distillation_losses"].double()
    err_ours, err_fp32 = (ours - truth).abs().max(), (fp32 - truth).abs().max()
    assert err_ours <= 1.3 * err_fp32, (err_ours, err_fp32)
    bf16_logits = _verl((xb @ wb.t()), ids, lp.bfloat16(), [64])["distillation_losses"].double()
    assert err_ours < (bf16_logits - truth).abs().max()  # verl's own bf16 path is further off
    # The gradients (bf16, as the parameters'): against float64 on the bf16 inputs, within 1.8x the
    # floor, the exact gradients rounded to bf16 (measured 1.4-1.65x: the gradient GEMMs' bf16 operands)
    xs, ws = xb.clone().requires_grad_(), wb.clone().requires_grad_()
    xd, wd = xb.double().requires_grad_(), wb.double().requires_grad_()
    g = torch.rand(64, dtype=torch.float64)
    (fk_verl.topk_outputs(xs, ws, ids, lp.float())["distillation_losses"] * g.float()).sum().backward()
    (_oracle(xd, wd, ids, lp, 1.0, None) * g).sum().backward()
    for ours_g, exact in ((xs.grad, xd.grad), (ws.grad, wd.grad)):
        err = (ours_g.double() - exact).norm() / exact.norm()
        floor = (exact.bfloat16().double() - exact).norm() / exact.norm()
        assert err <= 1.8 * floor, (err, floor)


def test_bad_inputs_name_the_argument():
    x, w, ids, lp = _problem(n=4)
    with pytest.raises(ValueError, match="loss"):
        fk_verl.topk_outputs(x, w, ids, lp, loss="tvd")
    with pytest.raises(ValueError, match="log_prob_min_clamp"):
        fk_verl.topk_outputs(x, w, ids, lp, loss="jsd", log_prob_min_clamp=-5.0)
    with pytest.raises(ValueError, match="log_prob_min_clamp"):
        fk_verl.topk_outputs(x, w, ids, lp, log_prob_min_clamp=float("nan"))
    with pytest.raises(ValueError, match="teacher_ids"):
        fk_verl.topk_outputs(x, w, ids[:3], lp)
    with pytest.raises(ValueError, match="teacher_ids"):
        fk_verl.topk_outputs(x, w, ids + w.shape[0], lp)
    with pytest.raises(TypeError, match="teacher_ids"):
        fk_verl.topk_outputs(x, w, ids.double(), lp)
    with pytest.raises(ValueError, match="lm_head_weight"):
        fk_verl.topk_outputs(x, w[:, :-1], ids, lp)
    with pytest.raises(ValueError, match="chunk_size"):
        fk_verl.topk_outputs(x, w, ids, lp, chunk_size=0)


def test_patch_refuses_untested_versions(monkeypatch):
    check_refuses_version(fk_verl, monkeypatch, "verl", "0.8.0", r"verl 0\.8\.0 is installed.*0\.9\.1")


def test_patch_swaps_the_engine_methods():
    try:
        engine = importlib.import_module(fk_verl._ENGINE).FSDPEngineWithLMHead
    except ImportError as error:  # the engine needs ray, tensordict, ...: the GPU machine's install
        pytest.skip(f"verl's FSDP engine does not import here: {error}")
    before = (engine.prepare_model_inputs, engine.prepare_model_outputs)
    fk_verl.patch()
    try:
        assert fk_verl.is_patched() and engine.prepare_model_outputs is not before[1]
    finally:
        fk_verl.unpatch()
    assert (engine.prepare_model_inputs, engine.prepare_model_outputs) == before


def test_patched_engine_outputs_equal_verls_logits_path(seed):
    """verl's own `FSDPEngineWithLMHead.prepare_model_outputs`, unpatched on the logits path (its real
    distillation loss as the logits processor), against the patched one on the fused-kernel path (the
    model's hidden states, no logits): the same nested per-token outputs, and the same gradients."""
    import functools

    try:
        engine_mod = importlib.import_module(fk_verl._ENGINE)
        from verl.trainer.distillation import distillation_ppo_loss
        from verl.utils import tensordict_utils as tu
    except ImportError as error:
        pytest.skip(f"verl's FSDP engine does not import here: {error}")
    engine_cls = engine_mod.FSDPEngineWithLMHead
    x, w, ids, lp = _problem(n=29)
    lengths = [9, 13, 7]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    tau, clamp = 0.9, -8.0

    def nested(t):
        return torch.nested.nested_tensor_from_jagged(t, offsets)

    def micro_batch(fused):
        return tu.get_tensordict(
            {"input_ids": nested(torch.randint(0, w.shape[0], (x.shape[0],))), "teacher_ids": nested(ids),
             "teacher_logprobs": nested(lp)},
            {"use_fused_kernels": fused, "distillation_use_topk": True, "distillation_only": True,
             "use_remove_padding": True, "temperature": tau},
        )

    head = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.float64)
    fake = types.SimpleNamespace(use_ulysses_sp=False, module=types.SimpleNamespace(get_output_embeddings=lambda: head))
    fake._gather_and_unpad_packed = functools.partial(engine_cls._gather_and_unpad_packed, fake)
    loss_cfg = types.SimpleNamespace(log_prob_min_clamp=clamp, use_chunked_topk=False, loss_mode="forward_kl_topk")
    loss_fn = functools.partial(distillation_ppo_loss, config=types.SimpleNamespace(strategy="fsdp"),
                                distillation_config=types.SimpleNamespace(distillation_loss=loss_cfg))
    args = {"input_ids_rmpad_rolled": torch.zeros(x.shape[0], dtype=torch.long),
            "temperature_rmpad": torch.full((x.shape[0],), tau, dtype=torch.float64), "pad_size": 0,
            "temperature_is_one": False}

    ties = _clamp_ties(x, w, ids, lp, tau, clamp, 1e-5)  # verl's loss: rounded through fp32
    results = []
    for fused in (False, True):
        with torch.no_grad():
            head.weight.copy_(w)
        head.weight.grad = None
        xs = x.clone().requires_grad_()
        if fused:
            fk_verl.patch()
            out = types.SimpleNamespace(hidden_states=(torch.zeros(1), xs[None]), log_probs=None, entropy=None)
        else:
            out = types.SimpleNamespace(logits=head(xs)[None])
        try:
            model_output = engine_cls.prepare_model_outputs(fake, out, args, micro_batch(fused), loss_fn)
        finally:
            fk_verl.unpatch()
        weight = torch.linspace(0.5, 2, x.shape[0]).masked_fill(ties, 0.0)
        (model_output["distillation_losses"].values().clamp_min(0) * weight).sum().backward()
        results.append(({k: v.values() for k, v in model_output.items()}, xs.grad, head.weight.grad))
    (ref, gx_ref, gw_ref), (ours, gx, gw) = results
    assert set(ours) == set(ref) == set(fk_verl.FIELDS)
    for name in fk_verl.FIELDS:  # verl's kl_divergence rounds its loss through fp32
        torch.testing.assert_close(ours[name].detach(), ref[name].detach().to(ours[name].dtype), rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, gw_ref, rtol=1e-5, atol=1e-6)


def test_bench_verl_smoke(tmp_path):
    """benchmarks/bench_verl.py --smoke: every variant runs, and the per-token losses agree (fp32)."""
    import json

    spec = importlib.util.spec_from_file_location("bench_verl", Path(__file__).parent.parent / "benchmarks" / "bench_verl.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["k"], r["tokens"], r["variant"]) for r in rows] == [
        (k, n, v) for k in (8, 80) for n in (37, 64) for v in bench.VARIANTS]
    for r in rows:
        assert len(r["times_s"]) == 2 and r["p20_s"] <= r["median_s"] <= r["p80_s"]
        if r["variant"] != "flashkd top-k form":
            assert r["max_abs_diff_vs_first"] < 1e-4
    assert "| flashkd |" in (tmp_path / "summary.md").read_text()


def test_verl_external_modules_installs_the_patch():
    """VERL_USE_EXTERNAL_MODULES=flashkd.integrations.verl: verl imports it in each process that imports
    verl (its workers too), and that import installs the patch."""
    import os
    import subprocess

    try:
        importlib.import_module(fk_verl._ENGINE)
    except ImportError as error:
        pytest.skip(f"verl's FSDP engine does not import here: {error}")
    code = ("import verl, flashkd.integrations.verl as fk\n"
            "from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead as E\n"
            "assert fk.is_patched() and E.prepare_model_outputs.__module__ == 'flashkd.integrations.verl'\n")
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "flashkd.integrations.verl",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)


# --- the gradient taken in the forward for a predicted weight per token, and its fallback -----------


def _verl_function(path, name):
    """One function of an installed verl file, its source run as written (verl's modules import ray,
    tensordict, ... at the top): `agg_loss` from trainer/ppo/core_algos.py with `masked_sum` from
    utils/torch_functional.py."""
    import ast

    root = Path(importlib.util.find_spec("verl").submodule_search_locations[0])
    tree = ast.parse((root / path).read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    node.decorator_list = []
    scope = {"torch": torch, "Optional": __import__("typing").Optional}
    exec(compile(ast.Module([node], []), str(root / path), "exec"), scope)
    return scope[name]


_agg_loss = _verl_function("trainer/ppo/core_algos.py", "agg_loss")
_agg_loss.__globals__["verl_F"] = types.SimpleNamespace(
    masked_sum=_verl_function("utils/torch_functional.py", "masked_sum"))

PROMPTS, RESPONSES = [3, 2, 4, 2], [5, 6, 4, 7]


def _downstream(losses, mask, mode, max_clamp, coef):
    """verl's use of the per-token losses (N,) after the engine: `no_padding_2_padding` (each response's
    losses from the rows one before its tokens), the clamp at 0, `loss_max_clamp`, `agg_loss`, the
    coefficient."""
    ends = torch.tensor(PROMPTS).add(torch.tensor(RESPONSES)).cumsum(0)
    width = max(RESPONSES)
    padded = torch.stack([torch.nn.functional.pad(losses[e - r - 1:e - 1], (0, width - r))
                          for r, e in zip(RESPONSES, ends.tolist())])
    padded = padded.clamp_min(0.0)
    if max_clamp is not None:
        padded = padded.clamp(min=-max_clamp, max=max_clamp)
    return _agg_loss(padded, mask, mode, global_batch_size=None, batch_num_tokens=None) * coef


def _agg_problem(clamp, tau=0.9):
    """A packed batch of PROMPTS + RESPONSES rows with some negative losses, a response mask with holes,
    and loss_max_clamp at the median positive loss; rows at a clamp's tie are masked out."""
    n = sum(PROMPTS) + sum(RESPONSES)
    x, w, ids, lp = _problem(n=n)
    lp[::3] -= 1.5  # teacher mass ~e^-1.5: Σ p (log p − log q) < 0 on some rows
    mask = torch.zeros(len(RESPONSES), max(RESPONSES), dtype=torch.bool)
    for b, r in enumerate(RESPONSES):
        mask[b, :r] = torch.rand(r) > 0.2
    truth = _oracle(x, w, ids, lp, tau, clamp)
    max_clamp = truth[truth > 0].median().item() * 1.0001
    ties = _clamp_ties(x, w, ids, lp, tau, clamp, 1e-12) | fk_verl_near(truth, max_clamp)
    ends = torch.tensor(PROMPTS).add(torch.tensor(RESPONSES)).cumsum(0)
    for b, (r, e) in enumerate(zip(RESPONSES, ends.tolist())):
        mask[b, :r] &= ~ties[e - r - 1:e - 1]
    return x, w, ids, lp, mask, max_clamp


def fk_verl_near(a, b):
    return near(a, b, rtol=1e-12)


@pytest.mark.parametrize("mode", fk_verl.AGG_MODES)
@pytest.mark.parametrize("clamp", [None, -6.0])
@pytest.mark.parametrize("bias", [False, True])
def test_predicted_gradient_is_exact_and_its_fallback_too(mode, clamp, bias, seed, monkeypatch):
    """For each loss_agg_mode, log_prob_min_clamp, loss_max_clamp and a coefficient: the gradient verl's
    aggregation sends back is a multiple of the prediction (`response_weights`, the clamps): dW from the
    forward, no second sweep; a gradient that is none (random per token) takes the fallback, one sweep.
    Both against the float64 autograd of verl's formula and verl's own aggregation."""
    tau, coef = 0.9, 0.37
    x, w, ids, lp, mask, max_clamp = _agg_problem(clamp, tau)
    b = torch.randn(w.shape[0], dtype=torch.float64) if bias else None
    base = fk_verl.response_weights(torch.tensor(PROMPTS), torch.tensor(RESPONSES), mask, mode, x.shape[0],
                                    torch.float64)
    assert (base == 0).any() and (base != 0).any()
    sweeps = []
    real = fk_verl._sweep
    monkeypatch.setattr(fk_verl, "_sweep", lambda *a, **k: sweeps.append(k.get("weight") is not None) or real(*a, **k))

    def oracle(xo, wo, bo):
        z = (xo @ wo.t() + (0 if bo is None else bo)) / tau
        log_q = torch.log_softmax(z, -1).gather(-1, ids)
        lq, lpc = (log_q, lp) if clamp is None else (log_q.clamp_min(clamp), lp.clamp_min(clamp))
        return (lpc.exp() * (lpc - lq)).sum(-1)

    for matched in (True, False):
        sweeps.clear()
        leaves = [t.clone().requires_grad_() for t in (x, w) + ((b,) if bias else ())]
        out = fk_verl.topk_outputs(leaves[0], leaves[1], ids, lp, temperature=tau, log_prob_min_clamp=clamp,
                                   lm_head_bias=leaves[2] if bias else None, chunk_size=7,
                                   predicted_grad=base, predicted_clamp=(0.0, max_clamp))
        truth_leaves = [t.clone().requires_grad_() for t in (x, w) + ((b,) if bias else ())]
        truth = oracle(*truth_leaves, *([None] if not bias else []))
        torch.testing.assert_close(out["distillation_losses"], truth.detach(), rtol=1e-10, atol=1e-12)
        cut = (truth < 0) | (truth > max_clamp)
        assert cut.any() and (~cut & (base != 0)).any()
        if matched:
            _downstream(out["distillation_losses"], mask, mode, max_clamp, coef).backward()
            _downstream(truth, mask, mode, max_clamp, coef).backward()
        else:
            g = torch.rand(x.shape[0], dtype=torch.float64)
            ours = out["distillation_losses"]
            (_downstream(ours, mask, mode, max_clamp, coef) + (ours * g).sum()).backward()
            (_downstream(truth, mask, mode, max_clamp, coef) + (truth * g).sum()).backward()
        assert sweeps == [False] + ([] if matched else [True]), (matched, sweeps)
        for ours, exact in zip(leaves, truth_leaves):
            torch.testing.assert_close(ours.grad, exact.grad, rtol=1e-9, atol=1e-11)


def test_without_a_prediction_the_backward_sweeps_once(seed, monkeypatch):
    """No predicted_grad: dX from the forward, dW from one sweep in the backward, no check; only dX wanted:
    no sweep at all (dX is exact for any gradient)."""
    x, w, ids, lp = _problem(n=19)
    sweeps = []
    real = fk_verl._sweep
    monkeypatch.setattr(fk_verl, "_sweep", lambda *a, **k: sweeps.append(k.get("weight") is not None) or real(*a, **k))
    g = torch.rand(19, dtype=torch.float64)
    for want_w in (True, False):
        sweeps.clear()
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_(want_w)
        (fk_verl.topk_outputs(xs, ws, ids, lp, predicted_grad=None)["distillation_losses"] * g).sum().backward()
        xo, wo = x.clone().requires_grad_(), w.clone().requires_grad_(want_w)
        (_oracle(xo, wo, ids, lp, 1.0, None) * g).sum().backward()
        torch.testing.assert_close(xs.grad, xo.grad, rtol=1e-9, atol=1e-11)
        if want_w:
            torch.testing.assert_close(ws.grad, wo.grad, rtol=1e-9, atol=1e-11)
        assert sweeps == [False, True] if want_w else [False]


def test_response_weights_follow_no_padding_2_padding():
    """Each response's weights sit on the rows one before its tokens; 1 / (tokens + 1e-8) per sequence for
    seq-mean-token-mean; 0 on prompts and the last row of each sequence; None for another mode."""
    mask = torch.tensor([[1, 1, 0, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 0, 0, 0],
                         [1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    n = sum(PROMPTS) + sum(RESPONSES)
    rows = fk_verl.response_weights(torch.tensor(PROMPTS), torch.tensor(RESPONSES), mask, "token-mean", n)
    losses = torch.arange(n, dtype=torch.float32).requires_grad_()
    _downstream(losses + 1, mask, "token-sum", None, 1.0).backward()
    assert torch.equal(rows, losses.grad)
    means = fk_verl.response_weights(torch.tensor(PROMPTS), torch.tensor(RESPONSES), mask, "seq-mean-token-mean", n)
    assert torch.equal(means != 0, rows != 0)
    assert fk_verl.response_weights(torch.tensor(PROMPTS), torch.tensor(RESPONSES), mask, "seq-sum", n) is None


# --- the diagnostics from the pass: the student's top-K by rank, and the Triton path -------------------


def test_top_k_membership_by_rank_orders_ties_by_id():
    """`_own_by_rank`: an id is in the top K when fewer than K logits outrank it, ties to the larger id:
    the set of the first K of a sort by (logit, id) descending, tied rows included; and the Triton top-k
    kernel's set on the same rows."""
    g = torch.Generator().manual_seed(5)
    s = torch.randint(0, 6, (40, 97), generator=g).float()  # many exact ties
    k = 9
    ids = torch.stack([torch.randperm(97, generator=g)[:k] for _ in range(40)])
    order = torch.stack([torch.tensor(sorted(range(97), key=lambda j: (-s[r, j].item(), -j))[:k]) for r in range(40)])
    want = (ids[:, :, None] == order[:, None, :]).any(-1)
    assert torch.equal(fk_verl._own_by_rank(s, ids, s.gather(1, ids)), want)
    if TRITON_RUNS:
        from flashkd.backends import triton_topk

        top, _, redo, _ = triton_topk.kernel_topk(s.to(DEVICE).contiguous(), k, 1.0)
        top, redo = top.cpu(), redo.cpu()
        got = (ids[:, :, None] == top[:, None, :]).any(-1)
        assert torch.equal(got[~redo.bool()], want[~redo.bool()])


@needs_triton
@pytest.mark.parametrize("k", [1, 9, 40])
def test_membership_counted_in_the_expand_read(k, seed):
    """The expand kernel's membership (its OWN: elements at or over the stats kernel's θ kept as the row
    streams by, each id's rank counted among them): the set of `_own_by_rank` on rows of many exact ties,
    −0.0 beside +0.0, an id repeated in a row, −inf logits, and a row with fewer than K finite logits
    (flagged for the redo); the gradient it writes is the one written without it."""
    g = torch.Generator().manual_seed(seed)
    v = 97
    s = torch.randint(-3, 4, (12, v), generator=g).float()
    s[3] = torch.where(torch.rand(v, generator=g) < 0.5, -0.0, 0.0)  # signed zeros, equal to torch
    s[4, ::2] = -torch.inf
    s[5, 2:] = -torch.inf  # two finite logits
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(12)])
    s[0, ids[0, 0]] = 9.0  # an id on top
    if k > 1:
        ids[6, 1] = ids[6, 0]  # a repeated id
    want = fk_verl._own_by_rank(s, ids, s.gather(1, ids))
    ids_d = ids.to(DEVICE)
    runs = []
    for later in (False, True):
        x = s.to(DEVICE, copy=True)
        rel_k, rel_rest, shift, log2_rest, own, _ = fk_verl._stats(x, ids_d, 1.0, "triton", True, later)
        id_grad = torch.randn(12, k, generator=g, dtype=torch.float64).to(DEVICE) if not runs else runs[0][1]
        rest_grad = torch.randn(12, generator=g, dtype=torch.float64).to(DEVICE) if not runs else runs[0][2]
        ds = torch.empty_like(x)
        got = fk_verl._expand(x, ds, ids_d, id_grad, rest_grad, shift, log2_rest, rel_rest, 1.0, "triton",
                              own if later else None)
        runs.append((got, id_grad, rest_grad))
    ds, members, redo = (t.cpu() for t in runs[1][0])
    assert torch.equal(ds, runs[0][0].cpu())
    assert redo[5] == (k > 1) and redo.sum() <= 2  # the short row, where θ finds fewer than K lanes; the −inf row may be
    assert torch.equal(members[~redo], want[~redo])
    assert want[0, 0] and (~want[~redo]).any()  # neither all in nor all out


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("own", [False, True])
def test_narrow_gradient_written_over_the_logits_it_reads(dtype, own, seed):
    """dL/ds of narrow inputs lies over the first half of each fp32 row of S (the sweep's one buffer a
    chunk): the expand kernel's tiles, stored over columns it has read, give the bits a separate buffer
    gets, with and without the membership, at V not a multiple of the kernel's tile."""
    g = torch.Generator().manual_seed(seed)
    r, v, k = 9, 3 * 1024 + 517, 7
    s = (torch.randn(r, v, generator=g) * 4.0).to(DEVICE)
    s[2, :40] = 30.0  # a trained head's peak
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(r)]).to(DEVICE)
    id_grad = torch.randn(r, k, generator=g, dtype=torch.float64).to(DEVICE)
    rest_grad = torch.randn(r, generator=g, dtype=torch.float64).to(DEVICE)
    runs = []
    for aliased in (False, True):
        x = s.clone()
        rel_k, rel_rest, shift, log2_rest, mine, _ = fk_verl._stats(x, ids, 1.0, "triton", own, own)
        ds = x.view(dtype)[:, :v] if aliased else torch.empty(r, v, dtype=dtype, device=DEVICE)
        got = fk_verl._expand(x, ds, ids, id_grad, rest_grad, shift, log2_rest, rel_rest, 1.0, "triton",
                              mine if own else None)
        got = got if own else (got,)
        assert got[0].stride() == ((2 * v, 1) if aliased else (v, 1))
        runs.append(tuple(t.cpu() for t in got))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert runs[0][0].float().abs().max() > 0


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scaled_dw_is_torchs_product_rounded(dtype, seed):
    """The backward's dW: the forward's fp32 dW times the 0-d scale, rounded to the head's dtype in one
    pass (`triton_common.scaled`): the bits of torch's `(a * c).to(dtype)`, ties to even, NaN and ±inf
    kept, at an odd length."""
    from flashkd.backends import triton_common

    g = torch.Generator().manual_seed(seed)
    a = torch.randn(5, 2053, generator=g) * 10.0 ** torch.randint(-6, 4, (5, 1), generator=g).float()
    a[0, :64] = (torch.arange(64, dtype=torch.int32) * 0x8000 + 0x3F808000).view(torch.float32)  # bf16 ties
    a[1, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    for c in (torch.tensor(1.0, dtype=torch.float64), torch.rand((), generator=g, dtype=torch.float64) / 3):
        want = (a * c.float()).to(dtype)
        got = triton_common.scaled(a.to(DEVICE), c.to(DEVICE), dtype).cpu()
        assert torch.equal(got.isnan(), want.isnan())  # a NaN's bits are the platform's
        assert torch.equal(got[~want.isnan()].view(torch.int16), want[~want.isnan()].view(torch.int16))


@needs_triton
@pytest.mark.parametrize("k", [8, 80])
def test_triton_path_equals_torch_path(k, seed):
    """fp32 inputs (the Triton rows; fp64 ones take the torch rows on every backend): the five outputs
    and both gradients, predicted and fallback, against the torch path. K 80 passes the interpreter's
    top-k kernel's limit (64): membership by rank there. Both paths on DEVICE: the overlap counts and
    the row weights are compared bit for bit, from the same logits."""
    x, w, ids, lp = _problem(n=29, h=24, v=211, k=k, dtype=torch.float32)
    base = torch.rand(29) * (torch.rand(29) > 0.2)
    g_other = torch.rand(29)
    x, w, ids, lp, base, g_other = (t.to(DEVICE) for t in (x, w, ids, lp, base, g_other))
    results = {}
    for backend in BACKENDS:
        for matched in (True, False):
            xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
            out = fk_verl.topk_outputs(xs, ws, ids, lp, temperature=0.8, log_prob_min_clamp=-7.0, chunk_size=11,
                                       backend=backend, predicted_grad=base, predicted_clamp=(0.0, None))
            loss = out["distillation_losses"]
            g = base * (loss >= 0) * 2.5 if matched else g_other
            (loss * g).sum().backward()
            results[backend, matched] = (out, xs.grad, ws.grad, g)
    for matched in (True, False):
        (a, ax, aw, ag), (b, bx, bw, bg) = results["torch", matched], results["triton", matched]
        assert torch.equal(a["overlap_count"], b["overlap_count"])
        for name in ("distillation_losses", "student_mass", "teacher_mass", "overlap_token_advantage"):
            torch.testing.assert_close(a[name], b[name], rtol=2e-6, atol=2e-6, msg=name)
        assert torch.equal(ag, bg)  # the same row weights on both (no clamp tie)
        torch.testing.assert_close(ax, bx, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(aw, bw, rtol=1e-4, atol=1e-6)


def test_k_128_matches_verl(seed):
    """K = 128 (a quarter of the vocab here): the five outputs equal verl's."""
    x, w, ids, lp = _problem(n=21, h=16, v=509, k=128)
    ref = _verl(x @ w.t(), ids, lp, [21])
    ours = fk_verl.topk_outputs(x, w, ids, lp, chunk_size=8)
    assert torch.equal(ours["overlap_count"], ref["overlap_count"])
    assert 0 < ref["overlap_count"].sum() < ids.numel()
    for name in ("student_mass", "teacher_mass", "overlap_token_advantage"):
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-10, atol=1e-12, msg=name)
    # verl's kl_divergence rounds through fp32: the loss against the float64 formula
    torch.testing.assert_close(ours["distillation_losses"], _oracle(x, w, ids, lp, 1.0, None), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours["distillation_losses"], ref["distillation_losses"].double(), rtol=2e-6, atol=2e-6)


@needs_triton
@pytest.mark.parametrize("clamp", [None, -3.0])
def test_clamped_kl_kernel_is_the_row_math(clamp, seed):
    """verl's forward KL in one Triton kernel (`triton_topk.clamped_kl`) against the torch row math it replaces
    (`_categories`: float64 autograd), value, diagnostics and gradient, at float64 rounding: trained magnitudes,
    a teacher log-prob of −inf (NaN terms without a clamp, as torch gives them), a student log-prob exactly at
    the clamp (its gradient kept, as clamp_min keeps it), ids that cover the row (no rest), repeated ids. The row
    math on DEVICE, from the kernel's statistics, as the sweep runs it (the predicted weights compared bit for bit)."""
    pytest.importorskip("triton")
    from flashkd.backends import triton_topk

    g = torch.Generator().manual_seed(seed)
    r, k, v, tau = 9, 5, 40, 0.7
    s = torch.randn(r, v, generator=g) * 4
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(r)])
    ids[3, 1] = ids[3, 0]  # repeated
    lp = torch.log_softmax(torch.randn(r, k, generator=g) * 2, -1)
    lp[1, 2] = -torch.inf
    s_small = torch.randn(2, k, generator=g)  # rows whose ids are the whole vocab
    spec = LossSpec(loss="forward_kl", temperature=tau)
    for rows, ids_, lp_ in ((s, ids, lp), (s_small, torch.arange(k).repeat(2, 1), lp[:2])):
        if clamp is not None and rows is s:  # one student log-prob exactly at the clamp
            z = rows[4] / tau
            rows[4, ids_[4, 0]] = (clamp + torch.logsumexp(torch.cat([z[:ids_[4, 0]], z[ids_[4, 0] + 1:]]), 0)
                                   - math.log1p(-math.exp(clamp))) * tau
        s_t, ids_, lp_ = rows.to(DEVICE, copy=True), ids_.to(DEVICE), lp_.to(DEVICE)
        rel_k, rel_rest, shift, log2_rest, _, _ = fk_verl._stats(s_t.clone(), ids_, tau, "triton", False)
        want = fk_verl._categories(rel_k, rel_rest, lp_, spec, clamp, True)
        s_k, m, log2_rest2, _, _ = fk_verl._stats(s_t.clone(), ids_, tau, "triton", False, raw=True)
        const = triton_topk.clamped_kl_constants(tau, clamp, DEVICE)
        got = triton_topk.clamped_kl(s_k, m, log2_rest2, lp_, const, clamp, True, torch.float64)
        assert torch.equal(got[0], shift)
        for a, b in zip(got[1:5], want[:4]):
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13, equal_nan=True)
        # the gradients times u / τ, in fp32: u = 1; given weights; weights predicted where the loss is in bounds
        n = rows.shape[0]
        weight = (torch.rand(n, generator=g, dtype=torch.float64) - 0.3).to(DEVICE)
        for kind, u in (("none", torch.ones(n, dtype=torch.float64, device=DEVICE)), ("weight", weight),
                        ("base", None)):
            pred_u = (torch.empty(n, dtype=torch.float32, device=DEVICE),
                      torch.empty(n, dtype=torch.float32, device=DEVICE))
            got = triton_topk.clamped_kl(
                s_k, m, log2_rest2, lp_, const, clamp, True, torch.float32, weight=weight if kind == "weight" else None,
                base=weight.float() if kind == "base" else None, bounds=(0.0, 0.5), pred_u=pred_u)
            if kind == "base":
                loss32 = want[0].float()
                pred = torch.where((loss32 >= 0.0) & (loss32 <= 0.5), weight.float(), 0.0)
                assert torch.equal(pred_u[0], pred) and torch.equal(got[7], pred != 0)
                u = torch.where(pred != 0, pred, 1.0)
                assert torch.equal(pred_u[1], u)
                u = u.double()
            torch.testing.assert_close(got[5], (want[4] * (u / tau)[:, None]).float(), rtol=1.2e-7, atol=1e-37)  # 1 ulp
            torch.testing.assert_close(got[6], (want[5] * (u / tau)).float(), rtol=1.2e-7, atol=1e-37)
        if clamp is None and rows is s:
            assert got[1][1].isnan() and not got[1][0].isnan()


@needs_triton
def test_clamped_kl_gradient_where_one_id_holds_the_row():
    """The fused row math's gradient at an id holding nearly all of q (a trained head's peak of 30 over the
    rest): d rel_k = g (1 − q) with 1 − q = σ(rel_rest − a) for K = 1, taken from the rest's q, not from q
    (whose log rounds to ulp(30)): relative error at float64 rounding, where 1 − q ≈ 1e-11 and 1e-16."""
    pytest.importorskip("triton")
    from flashkd.backends import triton_topk

    v = 50
    for peak in (30.0, 40.0):
        s = torch.zeros(3, v)
        s[:, 7] = peak
        s[1, 3] = -torch.inf
        ids = torch.full((3, 1), 7)
        lp = torch.tensor([[-0.1], [-2.0], [0.0]])
        s_k, m, log2_rest, _, _ = fk_verl._stats(s.to(DEVICE, copy=True), ids.to(DEVICE), 1.0, "triton", False,
                                                 raw=True)
        const = triton_topk.clamped_kl_constants(1.0, None, DEVICE)
        got = triton_topk.clamped_kl(s_k, m, log2_rest, lp.to(DEVICE), const, None, True, torch.float64)[5]
        got = got.double()[:, 0].cpu()
        rest = math.log(v - 1.0) + 0.0 - peak  # logsumexp of the rest (zeros) minus the peak
        rest = torch.tensor([rest, math.log(v - 2.0) - peak, rest], dtype=torch.float64)
        want = -lp[:, 0].double().exp() * torch.sigmoid(rest)
        torch.testing.assert_close(got, want.float().double(), rtol=2e-7, atol=0)


def test_default_chunk_cuts_a_long_micro_batch_into_sixteen():
    """The Triton sweep's default rows a chunk: the core's logits budget (1 GiB), or N / 16 where that is more
    (each chunk reads and writes dW's fp32 accumulator once, whatever its rows), at most four budgets; the
    torch path keeps the budget; a given chunk_size is taken as it is."""
    v = 151936
    budget = fk_verl.core_plan.LOGITS_BUDGET["triton"] // (v * 4)
    rows = lambda n, backend="triton", size=None: fk_verl._chunk_rows(n, v, size, backend, 4)  # noqa: E731
    assert rows(1000) == 1000 and rows(budget) == budget  # one chunk
    assert rows(16 * budget) == budget  # the budget's rows: 16 chunks
    assert rows(32768) == 2048 > budget  # N / 16
    assert rows(32768 + 1) == 2049  # rounded up: never a 17th chunk
    assert rows(10**6) == fk_verl.SWEEP_GROWTH * budget  # at most four budgets
    torch_rows = fk_verl.core_plan.LOGITS_BUDGET["torch"] // (v * 16)
    assert rows(32768, "torch") == torch_rows
    assert rows(32768, size=100) == 100
