"""flashkd.integrations.trl on TRL's on-policy trainer: `_chunked_jsd_loss` (AsyncDistillationTrainer's
loss on a served teacher's top-k) against the patch's `chunked_jsd_loss` (values, every statistic,
gradients), and the trainer itself on CPU with a stand-in rollout worker, patched and unpatched."""

import functools
import math
import os

import pytest
import torch

trl = pytest.importorskip("trl")
pytest.importorskip("transformers")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import flashkd.integrations.trl as fk_trl  # noqa: E402
import tiny_models  # noqa: E402
from conftest import BACKENDS  # noqa: E402
from oracle import head, trl_jsd_loss  # noqa: E402
from helpers.exact import RATIO, pipeline_grads  # noqa: E402
from helpers.integrations import unpatched  # noqa: E402

from trl.experimental.async_distillation import async_distillation_trainer as trl_ad  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest.py)


_unpatched = unpatched(fk_trl)


def _trl_jsd():
    assert not fk_trl.is_patched()
    return trl_ad._chunked_jsd_loss


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def targets(n, v, k, beta, *, teachers=1, teacher_std=2.0, temperature=1.0, dtype=torch.float32):
    """A served teacher's candidates as AsyncDistillationTrainer hands them to its loss: per row the
    teacher's top-k at its temperature, rank-sorted, plus the sampled token when outside them (vLLM's
    prompt_logprobs), padded with -1 / -inf; some rows cut short, one row with no candidate at all.
    β ≠ 0 narrows them with TRL's own `_narrow_top1_actual_support` (top-1 + the sampled token, a
    duplicate masked out). Returns (target_ids, teacher logps, mask, teacher index or None)."""
    lp = torch.log_softmax(teacher_std * torch.randn(n, v, dtype=torch.float64) / temperature, -1)
    top = lp.topk(k, -1)
    actual = torch.randint(0, v, (n,))
    actual[::3] = top.indices[::3, 0]  # the sampled token is often the teacher's top-1 (a duplicate)
    ids = torch.full((n, k + 1), -1)
    logps = torch.full((n, k + 1), -math.inf, dtype=torch.float64)
    ids[:, :k], logps[:, :k] = top.indices, top.values
    outside = ~(top.indices == actual[:, None]).any(-1)
    ids[outside, k], logps[outside, k] = actual[outside], lp[outside, actual[outside]]
    cut = torch.rand(n) < 0.3  # the last candidates padded away (the sampled one stays: vLLM always has it)
    ids[cut, k // 2:k], logps[cut, k // 2:k] = -1, -math.inf
    ids[1], logps[1] = -1, -math.inf  # a position the teacher scored no candidate for
    logps = logps.to(dtype)
    mask = ids != -1
    if beta != 0.0:
        ids, logps, mask = trl_ad._narrow_top1_actual_support(ids, logps, actual, mask, beta)
    index = torch.randint(0, teachers, (n,)) if teachers > 1 else None
    return ids, logps, mask, index


def student(n, v, h, *, bias, logit_std=2.0, peaked=False):
    """(hidden (n, h), head weight (v, h), bias or None), leaves with gradients. peaked: a trained
    model's magnitudes, logits of std ~4 and every 4th row's logit at a random token moved to 30.
    Moving a row's peak moves its other logits too, so a draw's std scatters around 5; draws outside
    3 < std < 6 are drawn again, so every run tests the regime it names."""
    for _ in range(100):
        x = torch.randn(n, h)
        w = torch.randn(v, h) * (4.0 if peaked else logit_std) / math.sqrt(h)
        b = 0.5 * torch.randn(v) if bias else None
        if not peaked:
            break
        rows = torch.arange(0, n, 4)
        wt = w[torch.randint(0, v, (len(rows),))]
        x[rows] += ((30.0 - (x[rows] * wt).sum(-1)) / (wt * wt).sum(-1))[:, None] * wt
        z = x @ w.T + (0.0 if b is None else b)
        if 3.0 < z.std() < 6.0 and z.max() > 25.0:
            break
    else:
        raise AssertionError("no draw at a trained model's magnitudes in 100 tries")
    return [t if t is None else t.requires_grad_() for t in (x, w, b)]


def _truth(inputs, ids, logps, mask, beta, tail, index):
    """TRL's formula in float64 on the leaves' values (three teachers): (results, their gradients)."""
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    truth = trl_jsd_loss(*leaves, ids, logps, mask, beta=beta, temperature=1.0, add_tail_bucket=tail,
                         teacher_index=index, num_teachers=3)
    return truth, torch.autograd.grad(truth[0], leaves)


def _both(inputs, args, backend):
    """TRL's results and the patch's on the same leaves: [(five results, gradients)] × 2."""
    x, w, b = inputs
    out = []
    for fn in (_trl_jsd(), fk_trl.chunked_jsd_loss):
        res = fn(x, w, b, *args)
        leaves = [t for t in (x, w, b) if t is not None]
        out.append((res, torch.autograd.grad(res[0], leaves)))
    return out


CASES = [  # beta, add_tail_bucket, teachers, (logit_scale, softcap, temperature, bias)
    (beta, tail, teachers, transform)
    for beta in (0.0, 0.3, 1.0) for tail in (True, False) for teachers in (1, 3)
    for transform in ((1.0, None, 1.0, False), (0.7, 5.0, 1.5, True))
]
# The patch calls flashkd with backend "auto": the Triton kernels on CUDA. The torch rows take the
# whole grid, the kernels (under the interpreter, slow) a quarter of it: every β with the tail and
# without, one and three teachers, both transforms.
RUNS = [(c, "torch") for c in CASES] + [(CASES[i], "triton") for i in (0, 5, 10, 15, 19, 20) if "triton" in BACKENDS]


@pytest.mark.parametrize("case, backend", RUNS, ids=lambda c: "-".join(map(str, c)) if isinstance(c, tuple) else c)
def test_chunked_jsd_loss_matches_trl(case, backend, seed, monkeypatch):
    monkeypatch.setattr(fk_trl, "fused_linear_distill_topk",
                        functools.partial(fk_trl.fused_linear_distill_topk, backend=backend))
    beta, tail, teachers, (scale, cap, tau, bias) = case
    n, v, h, k = 37 if backend == "torch" else 13, 61, 12, 5  # the interpreter runs a program a row
    ids, logps, mask, index = targets(n, v, k, beta, teachers=teachers, temperature=tau)
    inputs = student(n, v, h, bias=bias)
    args = (scale, cap, ids, logps, mask, beta, tau, tail, index, teachers, 16)  # TRL's chunks: 16 rows
    (r0, g0), (r1, g1) = _both(inputs, args, backend)
    names = ("loss", "jsd_sum", "entropy_sum", "teacher_entropy_sum", "per_teacher_stats")
    for name, a, b in zip(names, r1, r0):
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a, b)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert r1[4].shape == (3 * teachers,)
    if index is None:
        assert r1[4].abs().max() == 0
    else:
        assert r1[4][0::3].sum() == n  # every row counted, the one without candidates too
    for name, a, b in zip(("d hidden", "d weight", "d bias"), g1, g0):
        assert _rel(a, b) <= 1e-5, (name, _rel(a, b))
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta, tail", [(0.0, True), (0.3, True), (1.0, True), (0.3, False)])
def test_chunked_jsd_loss_at_trained_magnitudes(beta, tail, backend, seed, monkeypatch):
    """Logits of std ~4 with peaks near 30, the teacher as peaked: TRL's fp32 tail 1 − Σ cancels where the
    candidates hold nearly all of a row's mass; the patch's error against float64 truth (TRL's formula)
    is held to TRL's own, never looser than 1e-5 relative for the results and 1e-4 for the gradients."""
    monkeypatch.setattr(fk_trl, "fused_linear_distill_topk",
                        functools.partial(fk_trl.fused_linear_distill_topk, backend=backend))
    n, v, h, k = 29 if backend == "torch" else 13, 53, 32, 6
    ids, logps, mask, index = targets(n, v, k, beta, teachers=3, teacher_std=6.0)
    inputs = student(n, v, h, bias=True, peaked=True)
    logits = (inputs[0] @ inputs[1].T + inputs[2]).detach()
    assert 3.0 < logits.std() < 6.0 and logits.max() > 25.0, (logits.std(), logits.max())
    args = (1.0, None, ids, logps, mask, beta, 1.0, tail, index, 3, 8)
    (r0, g0), (r1, g1) = _both(inputs, args, backend)
    truth, g_truth = _truth(inputs, ids, logps, mask, beta, tail, index)
    names = ("loss", "jsd_sum", "entropy_sum", "teacher_entropy_sum", "per_teacher_stats")
    for name, a, b, t in zip(names, r1, r0, truth):
        err, err_trl = _rel(a, t), _rel(b, t)
        assert err <= max(2 * err_trl, 1e-5), (name, err, err_trl)
    for name, a, b, t in zip(("d hidden", "d weight", "d bias"), g1, g0, g_truth):
        err, err_trl = _rel(a, t), _rel(b, t)
        assert err <= max(2 * err_trl, 1e-4), (name, err, err_trl)


# Rows of the clamp's regime, by kind: (student peaked on its first candidate, the teacher's rest 1 − Σ p,
# its other candidates' probabilities (about), the row's teacher). "Peaked": the candidates hold all but
# ~1e-10 of the student's mass, log Σ q > −1e-7, so TRL clamps that side's tail at 1 − e^−1e-7.
# Teacher 0: the student clamped against an open teacher, and both open; teacher 1: the student clamped, the
# teacher nearly agreeing (rest 3e-2), and both clamped (Σ p 1 to rounding, past it or short of it); teacher 2:
# an open student against a clamped teacher (rest 1e-9), and against one whose rest, 3e-7, is clamped at
# 1e-6 but not at 1e-7. One dominant candidate on a clamped side keeps TRL's fp32 sums exact there.
CLAMP_ROWS = {"A": (True, 0.3, 0.1, 0), "E": (False, 0.4, 0.1, 0), "a": (True, 3e-2, 1e-5, 1),
              "C": (True, 0.0, 1e-10, 1), "B": (False, 1e-9, 1e-10, 2), "D": (False, 3e-7, 1e-13, 2)}


def clamp_regime(kinds, v, h, k, peaks=8):
    """A student (hidden (n, h), weight (v, h), bias (v,)) and a teacher's candidates (ids, fp32 log-probs,
    mask, teacher index) with rows of `kinds` (CLAMP_ROWS). The first `peaks` tokens' head rows are
    orthogonal to the rest's (hidden dims of their own), so a row's hidden state moved to one of them puts
    its logit at 30 and moves no other logit."""
    n = len(kinds)
    w = torch.zeros(v, h)
    w[:peaks, :peaks] = 2.0 * torch.eye(peaks)
    w[peaks:, peaks:] = torch.randn(v - peaks, h - peaks) * 2.0 / math.sqrt(h - peaks)
    b = 0.5 * torch.randn(v)
    x = torch.randn(n, h)
    ids = torch.stack([torch.randperm(v)[:k] for _ in range(n)])
    logps = torch.empty(n, k, dtype=torch.float64)
    index = torch.empty(n, dtype=torch.long)
    for r, kind in enumerate(kinds):
        peaked, rest, other, index[r] = CLAMP_ROWS[kind]
        if peaked:
            j = int(torch.randint(peaks, ()))
            ids[r, ids[r] == j] = ids[r, 0]
            ids[r, 0] = j
            x[r, j] = (30.0 - b[j]) / 2.0
        others = other * (0.5 + torch.rand(k - 1, dtype=torch.float64))
        logps[r] = torch.cat([(1.0 - rest - others.sum()).reshape(1), others]).log()
    mask = torch.ones(n, k, dtype=torch.bool)
    return [t.requires_grad_() for t in (x, w, b)], ids, logps.float(), mask, index


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_chunked_jsd_loss_where_the_tail_clamps(beta, backend, seed, monkeypatch):
    """TRL's tail clamp at work: rows whose candidates hold all but ~1e-10 of the student's mass, or of the
    teacher's, or both, beside rows where neither side clamps, and a teacher rest clamped at 1e-6 but not at
    1e-7 (CLAMP_ROWS). Against float64 truth (TRL's formula, `oracle.trl_jsd_loss`): the loss, every
    statistic (each per-teacher entry alone: the clamped rows have teachers of their own) and the gradients
    within 1e-5 relative, or 2x TRL's own error where that is larger (over 50 draws both are at most 3.1e-6
    off, the gradients 1.6e-6). A clamp of 1e-6, or none, fails this at every β: the loss moves by 1e-5 to
    1e-1 (at β = 0.3 by ~1e-5 only: the mixture keeps tiny masses from mattering), teacher 1's JSD sum by
    7e-5 or more, teacher 2's entropy by 0.3 to 3x."""
    monkeypatch.setattr(fk_trl, "fused_linear_distill_topk",
                        functools.partial(fk_trl.fused_linear_distill_topk, backend=backend))
    kinds = "AEaCBD" * (4 if backend == "torch" else 2)
    inputs, ids, logps, mask, index = clamp_regime(kinds, 61, 24, 3)
    # the regime as named: log Σ over the candidates above −1e-7 on the clamped sides only, in float64
    lq = torch.log_softmax((inputs[0] @ inputs[1].T + inputs[2]).detach().double(), -1).gather(1, ids)
    clamped = torch.stack([lq.logsumexp(-1), logps.double().logsumexp(-1)], 1) > -1e-7
    want = torch.tensor([[CLAMP_ROWS[c][0], CLAMP_ROWS[c][1] < 1e-7] for c in kinds])
    assert torch.equal(clamped, want), (clamped, want)
    args = (1.0, None, ids, logps, mask, beta, 1.0, True, index, 3, 8)
    (r0, g0), (r1, g1) = _both(inputs, args, backend)
    truth, g_truth = _truth(inputs, ids, logps, mask, beta, True, index)
    names = ("loss", "jsd_sum", "entropy_sum", "teacher_entropy_sum") + tuple(
        f"teacher {i} {s}" for i in range(3) for s in ("count", "jsd", "entropy"))
    for name, a, b, t in zip(names, [*r1[:4], *r1[4]], [*r0[:4], *r0[4]], [*truth[:4], *truth[4]]):
        err, err_trl = _rel(a, t), _rel(b, t)
        assert err <= max(2 * err_trl, 1e-5), (name, err, err_trl)
    for name, a, b, t in zip(("d hidden", "d weight", "d bias"), g1, g0, g_truth):
        err, err_trl = _rel(a, t), _rel(b, t)
        assert err <= max(2 * err_trl, 1e-5), (name, err, err_trl)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta, tail", [(0.0, True), (0.3, True), (1.0, True), (0.3, False)])
def test_chunked_jsd_loss_bf16_student(beta, tail, backend, seed, monkeypatch):
    """A bf16 student (hidden states and head) at a trained model's magnitudes: TRL projects it in fp32, flashkd
    forms the logits as the bf16 GEMM's fp32 accumulator, so the five results are within 1e-5 of float64
    truth, or 2x TRL's error where TRL's own fp32 lands further off (7.6e-5 in 2 of 40 draws). The gradients
    come back in bf16 from both; flashkd rounds dL/ds to bf16 for its gradient GEMMs as well as their output.
    They are held to the exact-logits bound (tests/test_exact.py): against float64 truth, within 1.3x the
    error of the fp32-logit pipeline on the same bf16 inputs (fp32 logits, dL/ds rounded to bf16, GEMMs
    exact then rounded to bf16), the bias's gradient as the head's column for a hidden unit of constant 1.
    Over 20 draws a case on both backends flashkd's error is the pipeline's to 1e-5 of it, often bit for bit."""
    monkeypatch.setattr(fk_trl, "fused_linear_distill_topk",
                        functools.partial(fk_trl.fused_linear_distill_topk, backend=backend))
    n, v, h, k = 40 if backend == "torch" else 13, 97, 32, 6
    ids, logps, mask, index = targets(n, v, k, beta, teachers=3, teacher_std=6.0)
    inputs = [t.detach().bfloat16().requires_grad_() for t in student(n, v, h, bias=True, peaked=True)]
    args = (1.0, None, ids, logps, mask, beta, 1.0, tail, index, 3, 16)
    (r0, g0), (r1, g1) = _both(inputs, args, backend)
    truth, g_truth = _truth(inputs, ids, logps, mask, beta, tail, index)
    for name, a, b, t in zip(("loss", "jsd_sum", "entropy_sum", "teacher_entropy_sum", "per_teacher_stats"),
                             r1, r0, truth):
        assert a.dtype == b.dtype == torch.float32, (name, a.dtype, b.dtype)
        # either bar the test held before: within 1e-5 of TRL's result, or of float64 truth (2x TRL's error)
        assert _rel(a, b) <= 1e-5 or _rel(a, t) <= max(2 * _rel(b, t), 1e-5), (name, _rel(a, b), _rel(a, t), _rel(b, t))
    x, w, bias = (t.detach() for t in inputs)
    eye = torch.eye(v, dtype=torch.float64)

    def of_logits(z):  # TRL's formula on the pipeline's fp32 logits (in float64: the bf16 roundings dominate)
        return trl_jsd_loss(z, eye, None, ids, logps, mask, beta=beta, temperature=1.0, add_tail_bucket=tail,
                            teacher_index=index, num_teachers=3)[0]

    ones = torch.ones(n, 1, dtype=x.dtype)
    dx, dwb = pipeline_grads(of_logits, torch.cat([x, ones], 1), torch.cat([w, bias[:, None]], 1))
    pipeline = (dx[:, :h], dwb[:, :h], dwb[:, h])
    for name, a, b, t, base in zip(("d hidden", "d weight", "d bias"), g1, g0, g_truth,
                                   pipeline):
        assert a.dtype == b.dtype == base.dtype == torch.bfloat16
        assert _rel(a, t) <= RATIO * _rel(base, t), (name, _rel(a, t), _rel(base, t), _rel(b, t))


def test_oracle_is_trls_formula(seed):
    """The float64 oracle of TRL's loss agrees with TRL's own function on tame fp32 inputs (so the trained-
    magnitude test above measures against TRL's formula, not another)."""
    for beta, tail in ((0.0, True), (0.3, True), (1.0, False)):
        ids, logps, mask, index = targets(23, 41, 4, beta, teachers=2)
        x, w, b = student(23, 41, 8, bias=True)
        args = (0.8, 4.0, ids, logps, mask, beta, 1.3, tail, index, 2)
        want = _trl_jsd()(x, w, b, *args, 8)
        got = trl_jsd_loss(x, w, b, ids, logps, mask, beta=beta, temperature=1.3, add_tail_bucket=tail,
                           logit_scale=0.8, softcap=4.0, teacher_index=index, num_teachers=2)
        for a, c in zip(got, want):
            torch.testing.assert_close(a.float(), c, rtol=2e-5, atol=1e-6)


def test_patch_and_unpatch_swap_both_helpers():
    from trl.trainer import distillation_trainer as trl_dt

    dense, sparse = trl_dt._chunked_divergence_loss, _trl_jsd()
    with fk_trl.patch():
        assert trl_ad._chunked_jsd_loss is fk_trl.chunked_jsd_loss
        assert trl_dt._chunked_divergence_loss is fk_trl.chunked_divergence_loss
    assert trl_ad._chunked_jsd_loss is sparse and trl_dt._chunked_divergence_loss is dense
    fk_trl.patch()
    fk_trl.unpatch()
    assert trl_ad._chunked_jsd_loss is sparse


def test_refuses_changed_jsd_helper(monkeypatch):
    def helper(hidden_valid, lm_head_weight, lm_head_bias, logit_scale):
        raise AssertionError

    monkeypatch.setattr(trl_ad, "_chunked_jsd_loss", helper)
    with pytest.raises(RuntimeError, match=r"_chunked_jsd_loss is not what the patch was written for"):
        fk_trl.patch()
    assert not fk_trl.is_patched()


def test_refuses_another_tail_clamp(monkeypatch):
    def bucket(log_probs, valid_mask):  # TRL's, with another clamp
        log_sum = torch.clamp(torch.logsumexp(log_probs, dim=-1, keepdim=True), max=-1e-6)
        return torch.cat([log_probs, torch.log(-torch.expm1(log_sum))], -1), valid_mask

    monkeypatch.setattr(trl_ad, "_add_tail_bucket", bucket)
    with pytest.raises(RuntimeError, match=r"_add_tail_bucket clamping at -1e-07; got .* clamp 9\.99999"):
        fk_trl.patch()
    assert not fk_trl.is_patched()


# ---- AsyncDistillationTrainer end to end, without a vLLM server -------------------------------------


def _trl_stand_ins():
    """The stand-in rollout worker and weight transfer bench_trl_onpolicy.py runs the trainer with, from
    benchmarks/_trl_common.py (loaded by path, as tests/test_bench_trl_onpolicy.py loads that benchmark)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "_trl_common.py"
    spec = importlib.util.spec_from_file_location("_trl_common", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ServedRollouts, module.NoWeightTransfer


ServedRollouts, NoWeightTransfer = _trl_stand_ins()


def scored_samples(teachers, n, k, temperature, seed):
    """n RolloutSamples: prompt + completion drawn from the tiny vocab, scored by `teachers` in turn as a vLLM
    server scores them (`prompt_logprobs`: per position the teacher's top-k at its temperature, plus the
    realized token when outside them; the first position unscored)."""
    import numpy as np
    from trl.experimental.async_distillation.async_rollout_worker import RolloutSample

    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        name, model = teachers[i % len(teachers)]
        prompt, completion = int(torch.randint(2, 5, (), generator=g)), int(torch.randint(3, 7, (), generator=g))
        ids = torch.randint(3, len(tiny_models.WORDS), (prompt + completion,), generator=g)
        with torch.no_grad():
            lp = torch.log_softmax(model(ids[None]).logits[0].double() / temperature, -1)  # position j predicts j + 1
        cand = torch.full((len(ids), k + 1), -1)
        cand_lp = torch.full((len(ids), k + 1), -math.inf)
        for j in range(1, len(ids)):
            top = lp[j - 1].topk(k)
            row, vals = top.indices.tolist(), top.values.tolist()
            if int(ids[j]) not in row:
                row, vals = row + [int(ids[j])], vals + [float(lp[j - 1, ids[j]])]
            cand[j, :len(row)], cand_lp[j, :len(row)] = torch.tensor(row), torch.tensor(vals)
        mask = np.zeros(len(ids), dtype=np.int64)
        mask[prompt:] = 1
        samples.append(RolloutSample(prompt=[], completion=[], input_ids=ids.numpy(), completion_mask=mask,
                                     teacher_topk_ids=cand.numpy(), teacher_topk_logprobs=cand_lp.float().numpy(),
                                     model_version=0, metrics={}, teacher_id=name, prompt_id=i))
    return samples


def _train_async(tmp_path, monkeypatch, *, beta, tail, teachers, steps=4, batch=3):
    from datasets import Dataset

    from trl.experimental.async_distillation import AsyncDistillationConfig, AsyncDistillationTrainer

    path = tmp_path / "student"
    if not path.exists():
        tiny_models.llama(16, 0).save_pretrained(path)
        tiny_models.tokenizer().save_pretrained(path)
    # TRL asks CUDA for the device's peak FLOPs (for its MFU metric): there is none on CPU. Its client of the
    # student's vLLM server is built but, with the worker, weight transfer and token budget given, never called
    monkeypatch.setattr(trl_ad, "get_peak_flops_per_device", lambda accelerator, dtype: None)
    monkeypatch.setattr(trl_ad, "VLLMClient", lambda *args, **kwargs: None)
    named = [(f"t{i}", tiny_models.llama(24, 1 + i, init=1.0)) for i in range(teachers)]
    samples = scored_samples(named, (steps + 2) * batch, 4, 1.0, seed=7)  # the dataloader reads a batch ahead
    args = AsyncDistillationConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=batch, max_steps=steps, learning_rate=1.0,
        optim="sgd", lr_scheduler_type="constant", beta=beta, add_tail_bucket=tail, teacher_top_k=4,
        teacher_server_urls={name: "http://unused" for name, _ in named}, token_budget=0, use_cpu=True, bf16=False,
        dtype="float32", gradient_checkpointing=False, report_to=[], save_strategy="no", disable_tqdm=True,
        logging_steps=1, seed=0, model_init_kwargs={"attn_implementation": "eager"},
    )
    trainer = AsyncDistillationTrainer(
        model=str(path), args=args, train_dataset=Dataset.from_dict({"prompt": [[]] * (steps * batch)}),
        processing_class=tiny_models.tokenizer(), rollout_worker=ServedRollouts(samples),
        weight_transfer=NoWeightTransfer(),
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return logs, trainer.model


@pytest.mark.parametrize("beta, tail, teachers", [(0.0, True, 1), (0.5, False, 3)])
def test_async_trainer_patched_equals_unpatched_step_for_step(tmp_path, monkeypatch, beta, tail, teachers):
    runs = []
    for patched in (False, True):
        with fk_trl.patch() if patched else __import__("contextlib").nullcontext():
            runs.append(_train_async(tmp_path, monkeypatch, beta=beta, tail=tail, teachers=teachers))
    (l0, m0), (l1, m1) = runs
    assert len(l0) == len(l1) == 4
    keys = ["loss", "jsd", "entropy", "teacher_entropy"] + [
        f"{k}/t{i}" for i in range(teachers) if teachers > 1 for k in ("teacher_jsd", "teacher_entropy")]
    for a, b in zip(l1, l0):
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (key, a[key], b[key])
    for (name, a), b in zip(m1.named_parameters(), m0.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    # the steps moved the student (a comparison of two untrained students would pass as well)
    start = tiny_models.llama(16, 0)
    assert max((a - b).abs().max() for a, b in zip(m0.parameters(), start.parameters())) > 1e-3


# ---- ServerDistillationTrainer end to end, its teacher server a local model -------------------------


class LocalTeacherServer:
    """TRL's VLLMClient as ServerDistillationTrainer uses it (`get_sequence_logprobs`), served by a local
    teacher: per completion position its top-k log-probs at the temperature, rank-sorted and padded with
    -inf / id 0, and the sampled token's log-prob (vLLM's prompt_logprobs always hold it)."""

    teacher = None  # set by the test

    def __init__(self, *args, **kwargs):
        pass

    def get_sequence_logprobs(self, sequences, prompt_lengths, top_logprobs=100, temperature=1.0, **kwargs):
        out = {"logprobs": [], "logprob_token_ids": [], "actual_logprobs": [], "actual_token_ids": []}
        for seq, start in zip(sequences, prompt_lengths):
            with torch.no_grad():
                lp = torch.log_softmax(self.teacher(torch.tensor([seq])).logits[0].double() / temperature, -1)
            top = lp[start - 1:len(seq) - 1].topk(top_logprobs, -1)  # position j's distribution predicts token j
            out["logprobs"].append(top.values.tolist())
            out["logprob_token_ids"].append(top.indices.tolist())
            out["actual_logprobs"].append([[float(lp[j - 1, seq[j]])] for j in range(start, len(seq))])
            out["actual_token_ids"].append([[seq[j]] for j in range(start, len(seq))])
        return out


def _train_server(tmp_path, monkeypatch, *, beta, tail, top_k, steps=3, batch=4):
    from datasets import Dataset

    import trl.generation.vllm_client
    from trl.experimental.server_distillation import ServerDistillationConfig, ServerDistillationTrainer

    LocalTeacherServer.teacher = tiny_models.llama(24, 1, init=1.0)
    monkeypatch.setattr(trl.generation.vllm_client, "VLLMClient", LocalTeacherServer)
    student = tiny_models.llama(16, 0)
    args = ServerDistillationConfig(
        output_dir=str(tmp_path / "out"), teacher_model_server_url="http://unused", beta=beta,
        loss_top_k=top_k, loss_add_tail=tail, temperature=1.0, per_device_train_batch_size=batch,
        max_completion_length=6, max_steps=steps, learning_rate=1.0, optim="sgd", lr_scheduler_type="constant",
        logging_steps=1, report_to=[], use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True, seed=0,
        shuffle_dataset=False, gradient_checkpointing=False,
    )
    prompts = Dataset.from_dict({"prompt": tiny_models.sentences(batch * steps, 0, 2, 6)})
    trainer = ServerDistillationTrainer(model=student, args=args, train_dataset=prompts,
                                        processing_class=tiny_models.tokenizer("left"))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], student


@pytest.mark.parametrize("beta, tail, top_k", [(0.0, True, 3), (0.5, False, 1), (1.0, True, 1)])
def test_server_trainer_patched_equals_unpatched_step_for_step(tmp_path, monkeypatch, beta, tail, top_k):
    import inspect

    from trl.experimental.server_distillation import ServerDistillationTrainer

    runs = []
    for patched in (False, True):
        with fk_trl.patch() if patched else __import__("contextlib").nullcontext():
            assert (inspect.unwrap(ServerDistillationTrainer.compute_loss) is fk_trl.server_compute_loss) == patched
            runs.append(_train_server(tmp_path, monkeypatch, beta=beta, tail=tail, top_k=top_k))
    (l0, s0), (l1, s1) = runs
    assert len(l0) == len(l1) == 3 and all(math.isfinite(x) and x > 0 for x in l0)
    torch.testing.assert_close(torch.tensor(l1), torch.tensor(l0), rtol=1e-5, atol=1e-7)
    for (name, a), b in zip(s1.named_parameters(), s0.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    start = tiny_models.llama(16, 0)
    assert max((a - b).abs().max() for a, b in zip(s0.parameters(), start.parameters())) > 1e-3
