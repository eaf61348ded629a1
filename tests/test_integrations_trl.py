"""flashkd.integrations.trl: TRL's own loss helper vs the patch (values, statistics, gradients), and
TRL's DistillationTrainer end to end with and without the patch, on CPU."""

import math

import pytest
import torch

trl = pytest.importorskip("trl")
pytest.importorskip("transformers")

import flashkd.integrations.trl as fk_trl  # noqa: E402
from oracle import distill_loss  # noqa: E402
import tiny_models  # noqa: E402
from conftest import BACKENDS  # noqa: E402
from helpers.integrations import check_refuses_version, unpatched  # noqa: E402

from trl.trainer import distillation_trainer as trl_dt  # noqa: E402


_unpatched = unpatched(fk_trl)


def _trl_helper():
    assert not fk_trl.is_patched()
    return trl_dt._chunked_divergence_loss


def _inputs(bias, b=3, k=7, hs=12, ht=20, v=97, scale_logits=3.0):
    xs = torch.randn(b, k, hs, requires_grad=True)
    ws = (torch.randn(v, hs) * scale_logits / math.sqrt(hs)).requires_grad_()
    bs = torch.randn(v, requires_grad=True) if bias else None
    xt = torch.randn(b, k, ht)
    wt = torch.randn(v, ht) * scale_logits / math.sqrt(ht)
    bt = torch.randn(v) if bias else None
    mask = (torch.rand(b, k) < 0.7).long()
    mask[0, 0] = 1
    return xs, ws, bs, xt, wt, bt, mask


CASES = [  # beta, temperature, student scale, teacher scale, student softcap, teacher softcap, bias, num_items
    (0.0, 1.0, 1.0, 1.0, None, None, False, None),
    (1.0, 1.0, 1.0, 1.0, None, None, True, None),
    (0.5, 1.0, 1.0, 1.0, None, None, False, 40),
    (0.3, 2.0, 1.0, 1.0, None, None, True, "tensor"),
    (0.7, 0.5, 0.25, 2.0, None, None, False, None),
    (0.0, 1.5, 1.0, 1.0, 3.0, 5.0, True, None),
    (1.0, 1.0, 0.5, 1.0, None, 2.0, False, 17),
    (0.5, 1.0, 1.0, 0.125, 2.5, None, True, None),
    (0.9, 0.7, 3.0, 1.5, 1.0, 0.5, True, "tensor"),  # saturated caps: logits far past them
]


# The patch calls flashkd with backend "auto" (the Triton kernels on CUDA): both backends, the Triton
# kernels under the interpreter here.
RUNS = [(c, b) for b in BACKENDS for c in CASES]


@pytest.mark.parametrize("case, backend", RUNS, ids=lambda c: "-".join(map(str, c)) if isinstance(c, tuple) else c)
def test_patch_matches_trl_helper(case, backend, seed, monkeypatch):
    import functools

    monkeypatch.setattr(fk_trl, "fused_linear_distill", functools.partial(fk_trl.fused_linear_distill, backend=backend))
    beta, tau, s_scale, t_scale, s_cap, t_cap, bias, num_items = case
    xs, ws, bs, xt, wt, bt, mask = _inputs(bias)
    if num_items == "tensor":
        num_items = mask.sum() + 5
    kwargs = dict(num_items_in_batch=num_items, student_lm_head_bias=bs, teacher_lm_head_bias=bt,
                  student_logit_scale=s_scale, teacher_logit_scale=t_scale,
                  student_final_logit_softcapping=s_cap, teacher_final_logit_softcapping=t_cap, temperature=tau)
    students = [t for t in (xs, ws, bs) if t is not None]
    results = []
    for fn in (_trl_helper(), fk_trl.chunked_divergence_loss):
        loss, entropy, count = fn(xs, xt, ws, wt, mask, beta, **kwargs)
        grads = torch.autograd.grad(loss, students)
        results.append((loss, entropy, count, grads))
    (l0, e0, c0, g0), (l1, e1, c1, g1) = results
    assert c1.dtype == c0.dtype and int(c1) == int(c0) == int(mask.sum())
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(e1, e0, rtol=1e-5, atol=1e-5)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_patch_matches_trl_helper_bf16_teacher(seed):
    """A bf16 teacher beside an fp32 student: TRL computes each side in its own dtype; the patch upcasts
    the teacher (exact), so the two agree to fp32 rounding."""
    xs, ws, bs, xt, wt, bt, mask = _inputs(False)
    xt, wt = xt.bfloat16(), wt.bfloat16()
    out = [fn(xs, xt, ws, wt, mask, 0.5) for fn in (_trl_helper(), fk_trl.chunked_divergence_loss)]
    torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[1][1], out[0][1], rtol=1e-5, atol=1e-5)


def test_no_completion_tokens(seed):
    xs, ws, bs, xt, wt, bt, mask = _inputs(False)
    mask.zero_()
    loss, entropy, count = fk_trl.chunked_divergence_loss(xs, xt, ws, wt, mask, 0.5)
    assert loss.item() == 0.0 and entropy.item() == 0.0 and count.item() == 0
    loss.backward()
    assert xs.grad is not None and not xs.grad.any()


def test_dtensor_heads_gathered(seed):
    """FSDP2's sharded heads (DTensors, here over a one-process gloo group) give the plain heads' results."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        xs, ws, bs, xt, wt, bt, mask = _inputs(True)
        ws_d = torch.nn.Parameter(distribute_tensor(ws.detach(), mesh, [Shard(0)]))
        bs_d = torch.nn.Parameter(distribute_tensor(bs.detach(), mesh, [Shard(0)]))
        # the teacher's head as TRL hands it over: parameters that require grad, though they get none
        wt_d = torch.nn.Parameter(distribute_tensor(wt, mesh, [Shard(0)]))
        bt_d = torch.nn.Parameter(distribute_tensor(bt, mesh, [Shard(0)]))
        loss, entropy, _ = fk_trl.chunked_divergence_loss(xs, xt, ws_d, wt_d, mask, 0.5, student_lm_head_bias=bs_d,
                                                          teacher_lm_head_bias=bt_d)
        loss.backward()
        ref, ref_entropy, _ = fk_trl.chunked_divergence_loss(xs.detach(), xt, ws, wt, mask, 0.5,
                                                             student_lm_head_bias=bs, teacher_lm_head_bias=bt)
        ref.backward()
        torch.testing.assert_close(loss, ref)
        torch.testing.assert_close(entropy, ref_entropy)
        torch.testing.assert_close(ws_d.grad.full_tensor(), ws.grad)
        torch.testing.assert_close(bs_d.grad.full_tensor(), bs.grad)
        assert wt_d.grad is None and bt_d.grad is None
    finally:
        if created:
            dist.destroy_process_group()


def test_patch_unpatch_and_context():
    original = _trl_helper()
    with fk_trl.patch():
        assert trl_dt._chunked_divergence_loss is fk_trl.chunked_divergence_loss
        with fk_trl.patch():  # nested: the inner exit leaves the outer patch in place
            pass
        assert fk_trl.is_patched()
    assert trl_dt._chunked_divergence_loss is original
    fk_trl.patch()
    fk_trl.unpatch()
    fk_trl.unpatch()
    assert trl_dt._chunked_divergence_loss is original


def test_a_stale_context_exit_leaves_a_later_patch_alone():
    original = _trl_helper()
    stale = fk_trl.patch()
    fk_trl.unpatch()
    fk_trl.patch()  # independent of `stale`
    with stale:
        pass
    assert fk_trl.is_patched() and trl_dt._chunked_divergence_loss is fk_trl.chunked_divergence_loss
    with fk_trl.patch():  # already patched: its exit leaves the patch in place
        pass
    assert fk_trl.is_patched()
    fk_trl.unpatch()
    assert trl_dt._chunked_divergence_loss is original


def test_a_nested_context_puts_back_the_options_it_replaced():
    with fk_trl.patch():
        with fk_trl.patch(teacher_precision="fp8"):
            assert fk_trl._options == {"teacher_precision": "fp8"}
        assert fk_trl._options == {}  # the outer patch is TRL's numbers again, not FP8
        with fk_trl.patch(teacher_precision="fp8"), fk_trl.patch():
            assert fk_trl._options == {}
        assert fk_trl._options == {} and fk_trl.is_patched()
    assert not fk_trl.is_patched()


def test_refuses_untested_version(monkeypatch):
    check_refuses_version(fk_trl, monkeypatch, "trl", "9.9.0", r"installed TRL is 9\.9\.0.*tested with TRL 1\.16\.0")


def test_refuses_changed_helper(monkeypatch):
    def helper(student_hidden_states, teacher_hidden_states, student_lm_head_weight, teacher_lm_head_weight,
               completion_mask, beta, temperature=1.0):
        raise AssertionError

    monkeypatch.setattr(trl_dt, "_chunked_divergence_loss", helper)
    with pytest.raises(RuntimeError, match=r"TRL 1\.16\.0's .*_chunked_divergence_loss is not what the patch"):
        fk_trl.patch()
    assert not fk_trl.is_patched()


# ---- DistillationTrainer end to end -------------------------------------------------------------


class _Record(__import__("transformers").TrainerCallback):
    """Each optimizer step's gradients (before the step), flattened."""

    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]).clone())


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    """Each test in its own tmp_path: the trainer makes its output_dir ("trainer", relative) in the test's tmp_path, not in a fixed folder
    of /tmp that outlives the tests."""
    monkeypatch.chdir(tmp_path)


def _train(steps, batch=8, accumulation=1, seed=0, record=None, optim="adamw_torch", lr=3e-2):
    from datasets import Dataset

    student = tiny_models.llama(16, seed)
    teacher = tiny_models.llama(24, seed + 1, init=1.0)  # peaked: a loss that has somewhere to fall
    prompts = Dataset.from_dict({"prompt": tiny_models.sentences(batch * steps, seed, 2, 6)})
    args = trl.DistillationConfig(
        output_dir="trainer", per_device_train_batch_size=batch // accumulation,  # in the test's tmp_path
        gradient_accumulation_steps=accumulation, max_completion_length=8, max_steps=steps, learning_rate=lr, optim=optim, lr_scheduler_type="constant",
        logging_steps=1, report_to=[], use_cpu=True, bf16=False, save_strategy="no", beta=0.5, temperature=1.0,
        disable_tqdm=True, seed=seed, shuffle_dataset=False, gradient_checkpointing=False,
    )
    trainer = trl.DistillationTrainer(model=student, teacher_model=teacher, args=args, train_dataset=prompts,
                                      processing_class=tiny_models.tokenizer("left"),
                                      callbacks=[record] if record is not None else None)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    entropies = [h["entropy"] for h in trainer.state.log_history if "entropy" in h]
    return losses, entropies, student


# Plain SGD where weights are compared: AdamW normalises each element's step, so a 1e-7 difference in a
# near-zero gradient would move that weight by a sizeable part of lr.
_SGD = dict(optim="sgd", lr=1.0)


def test_trainer_patched_equals_unpatched_step_for_step():
    runs = []
    for patched in (False, True):
        record = _Record()
        with fk_trl.patch() if patched else __import__("contextlib").nullcontext():
            losses, entropies, student = _train(5, batch=4, record=record, **_SGD)
        runs.append((losses, entropies, record.grads, student))
    (l0, e0, g0, s0), (l1, e1, g1, s1) = runs
    assert len(l1) == len(l0) == 5 and len(g1) == len(g0) == 5
    torch.testing.assert_close(torch.tensor(l1), torch.tensor(l0), rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(torch.tensor(e1), torch.tensor(e0), rtol=1e-4, atol=1e-6)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)
    for a, b in zip(s1.parameters(), s0.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_trainer_patched_loss_falls_and_first_step_is_the_reference():
    seen = []

    def spy(*args, **kwargs):
        seen.append(([a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args], dict(kwargs)))
        return fk_trl.chunked_divergence_loss(*args, **kwargs)

    with fk_trl.patch():
        trl_dt._chunked_divergence_loss = spy  # the patched helper, watched
        losses, _, _ = _train(16)
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-4:]) < 0.85 * sum(losses[:4]), losses
    # step 1's loss against the naive full-logits formula in float64 on the very inputs TRL passed
    (xs, xt, ws, wt, mask, beta), kw = seen[0][0][:6], seen[0][1]
    labels = torch.where(mask != 0, 0, -100)
    ref = distill_loss(xs, ws, xt, wt, labels, loss="jsd", beta=beta, temperature=kw["temperature"],
                       weight_hard_loss=0.0, weight_soft_loss=1.0, reduction="sum")[0] / kw["num_items_in_batch"]
    assert losses[0] == pytest.approx(float(ref), rel=1e-4)


def test_trainer_accumulation_2x4_equals_1x8():
    with fk_trl.patch():
        l_acc, _, s_acc = _train(3, batch=8, accumulation=2, **_SGD)
        l_one, _, s_one = _train(3, batch=8, accumulation=1, **_SGD)
    torch.testing.assert_close(torch.tensor(l_acc), torch.tensor(l_one), rtol=1e-4, atol=1e-7)
    for a, b in zip(s_acc.parameters(), s_one.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# ---- flashkd bench's trl provider -----------------------------------------------------------------


@pytest.mark.parametrize("loss, beta, temperature, softcap", [
    ("jsd", 0.3, 1.0, None), ("forward_kl", 0.5, 2.0, None), ("reverse_kl", 0.5, 1.0, None), ("jsd", 0.5, 1.0, 0.5),
])
def test_bench_trl_provider_passes_the_gate(loss, beta, temperature, softcap):
    from flashkd.bench import measure
    from flashkd.bench.workloads import Workload

    w = Workload(loss, 11, h=12, v=37, dtype="float32", beta=beta, temperature=temperature, weight_hard=0.0,
                 weight_soft=0.7, softcap=softcap)
    settings = measure.Settings(torch.device("cpu"), rep_ms=1.0, warmup_ms=0.0, min_reps=2)
    results = measure.run([w], ["trl"], ["full"], settings)
    assert {r.check.status for r in results} == {"passed"}
    assert all(r.speed is not None for r in results)


@pytest.mark.parametrize("w, why", [
    (dict(loss="jsd", weight_hard=0.5), "soft term only"),
    (dict(loss="tvd", weight_hard=0.0), "no tvd loss"),
    (dict(loss="forward_kl", weight_hard=0.0, form="topk", k=5), "hidden states and head only"),
])
def test_bench_trl_provider_skips_what_it_cannot_run(w, why):
    from flashkd.bench import measure
    from flashkd.bench.workloads import Workload

    settings = measure.Settings(torch.device("cpu"), rep_ms=1.0, warmup_ms=0.0, min_reps=2)
    results = measure.run([Workload(n=11, h=12, v=37, dtype="float32", **w)], ["trl"], ["full"], settings)
    assert [r.check.status for r in results] == ["skipped"] and why in results[0].check.note


def test_bench_trl_records_verify(tmp_path):
    from flashkd.bench import measure, report
    from flashkd.bench.workloads import Workload
    from flashkd.records import bundles_from_results, check_bundle

    w = Workload("jsd", 11, h=12, v=37, dtype="float32", weight_hard=0.0, weight_soft=1.0)
    settings = measure.Settings(torch.device("cpu"), rep_ms=1.0, warmup_ms=0.0, min_reps=2)
    results = measure.run([w], ["flashkd", "trl"], ["full"], settings)
    env = report.environment(settings)
    report.write_csv(results, tmp_path / "results.csv", env)
    bundles = bundles_from_results(results, env, logs=tmp_path / "results.csv")
    assert [check_bundle(b) for b in bundles] == [[]] * len(bundles)
    trl_impl = [b["implementation"]["manifest"] for b in bundles if "· TRL" in b["implementation"]["manifest"]["metadata"]["title"]]
    assert len(trl_impl) == 1 and trl_impl[0]["spec"]["callable"]["symbol"] == "ChunkedDivergenceFunction"


def test_a_refused_patch_keeps_the_last_options(monkeypatch):
    """patch(teacher_precision=...) refused (an untested TRL) changes no option: the patch in place keeps its own."""
    import importlib.metadata

    with fk_trl.patch(teacher_precision="fp8"):
        assert fk_trl._options == {"teacher_precision": "fp8"}
        real = importlib.metadata.version
        monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.9.0" if name == "trl" else real(name))
        with pytest.raises(RuntimeError, match="9.9.0"):
            fk_trl.patch()
        assert fk_trl._options == {"teacher_precision": "fp8"}
        monkeypatch.undo()
