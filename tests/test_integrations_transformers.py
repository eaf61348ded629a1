"""flashkd.integrations.transformers: the HF Trainer with a live teacher and with flashkd.data top-k
targets, end to end on CPU; the first step against the float64 oracle, accumulation, mixed precision,
logit transforms read from configs, sharded heads."""

import copy
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

import flashkd  # noqa: E402
from flashkd.integrations.transformers import DistillationLossMixin, DistillationTrainer, head_transform  # noqa: E402
from oracle import distill_loss, topk_loss  # noqa: E402
import tiny_models  # noqa: E402
from conftest import BACKENDS  # noqa: E402


def _dataset(n, seed, keys=False):
    from datasets import Dataset

    tok = tiny_models.tokenizer("right")
    ids = [tok(s + " <eos>")["input_ids"] for s in tiny_models.counting(n, seed)]
    columns = {"input_ids": ids}
    if keys:
        columns["key"] = [f"ex-{i}" for i in range(n)]
    return Dataset.from_dict(columns), tok


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    """Each test in its own tmp_path: the Trainer makes its output_dir ("trainer", relative) there, not in
    a fixed folder of /tmp that outlives the tests."""
    monkeypatch.chdir(tmp_path)


def _args(steps, batch, accumulation=1, **kw):
    kw.setdefault("learning_rate", 3e-2)
    return transformers.TrainingArguments(
        output_dir="trainer", per_device_train_batch_size=batch // accumulation,
        gradient_accumulation_steps=accumulation, max_steps=steps, logging_steps=1, report_to=[], use_cpu=True,
        save_strategy="no", disable_tqdm=True, seed=0, lr_scheduler_type="constant", dataloader_num_workers=0, **kw,
    )


def _train(steps, batch=8, accumulation=1, teacher=True, student_config=None, teacher_config=None, topk=None,
           record=None, **kw):
    student = tiny_models.llama(16, 0, **(student_config or {}))
    teach = tiny_models.llama(24, 1, init=1.0, **(teacher_config or {}))
    data, tok = _dataset(batch * steps, 0, keys=topk is not None)
    collator = transformers.DataCollatorForLanguageModeling(tok, mlm=False)
    if topk is not None:
        collator = flashkd.TopKCollator(topk, collator)
        kw["remove_unused_columns"] = False
    options = kw.pop("distill", dict(loss="jsd", beta=0.5, temperature=1.0, weight_hard_loss=0.5, weight_soft_loss=0.5))
    trainer = _Spy(model=student, teacher_model=teach if teacher else None, args=_args(steps, batch, accumulation, **kw),
                   train_dataset=data, data_collator=collator, **options)
    initial = copy.deepcopy(student), copy.deepcopy(teach)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, trainer, initial


class _Spy(DistillationTrainer):
    """Keeps the first batch it computes a loss on, and the num_items_in_batch it was given."""

    first = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.first is None:
            self.first = ({k: v.clone() for k, v in inputs.items()}, num_items_in_batch)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def _reference(trainer, initial, topk=False, **options):
    """Step 1's loss from the initial models' full logits, in float64 (tests/oracle.py)."""
    student, teacher = initial
    inputs, num_items = trainer.first
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    labels = inputs["labels"][:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    with torch.no_grad():
        hs = student.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
        if topk:
            labels = labels.masked_fill(~(inputs["teacher_ids"][:, :-1] >= 0).any(-1), -100)
            total = topk_loss(hs, student.lm_head.weight, inputs["teacher_ids"][:, :-1],
                              inputs["teacher_logprobs"][:, :-1], labels, reduction="sum", **options)[0]
        else:
            ht = teacher.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
            total = distill_loss(hs, student.lm_head.weight, ht, teacher.lm_head.weight, labels, reduction="sum",
                                 **options)[0]
    assert num_items is not None and int(num_items) == int((labels != -100).sum())
    return float(total / num_items)


def test_live_teacher_loss_falls_first_step_is_reference():
    losses, trainer, initial = _train(24)
    assert sum(losses[-4:]) < 0.8 * sum(losses[:4]), losses
    assert losses[0] == pytest.approx(_reference(trainer, initial, loss="jsd", beta=0.5, temperature=1.0, weight_hard_loss=0.5,
                                           weight_soft_loss=0.5), rel=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_live_teacher_transforms_from_configs(backend):
    """Gemma's softcap and Cohere's scale on the student, Granite's divisor and a softcap on the teacher."""
    options = dict(loss="forward_kl", temperature=2.0, weight_hard_loss=0.3, weight_soft_loss=0.7)
    losses, trainer, initial = _train(2, student_config=dict(final_logit_softcapping=0.5, logit_scale=4.0),
                                      teacher_config=dict(logits_scaling=0.25, final_logit_softcapping=3.0),
                                      distill=dict(options, distill_options={"backend": backend}))
    ref = _reference(trainer, initial, **options, student_logit_scale=4.0, student_softcap=0.5,
                     teacher_logit_scale=4.0, teacher_softcap=3.0)
    assert losses[0] == pytest.approx(ref, rel=1e-5)


def test_live_teacher_accumulation_2x4_equals_1x8():
    runs = [_train(3, batch=8, accumulation=a, optim="sgd", learning_rate=1.0) for a in (2, 1)]
    (l_acc, t_acc, _), (l_one, t_one, _) = runs
    torch.testing.assert_close(torch.tensor(l_acc), torch.tensor(l_one), rtol=1e-5, atol=1e-7)
    for a, b in zip(t_acc.model.parameters(), t_one.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_live_teacher_bf16_mixed_precision(monkeypatch):
    """bf16 autocast: the backbones and the loss's GEMMs run in bf16, the fp32 master weights train."""
    import flashkd.integrations.transformers as integration

    l32, _, _ = _train(1)
    dtypes = []

    def spy(*args, **kwargs):
        dtypes.append({a.dtype for a in args[:4]})
        return flashkd.fused_linear_distill(*args, **kwargs)

    monkeypatch.setattr(integration, "fused_linear_distill", spy)
    l16, trainer, _ = _train(3, bf16=True)
    assert dtypes and all(d == {torch.bfloat16} for d in dtypes)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert l16[0] == pytest.approx(l32[0], rel=3e-2)
    assert l16[-1] < l16[0]


@pytest.fixture(scope="module")
def topk_targets(tmp_path_factory):
    """The teacher's top-k targets of the training examples, written by flashkd.data."""
    teacher = tiny_models.llama(24, 1, init=1.0)
    data, _ = _dataset(8 * 24, 0, keys=True)

    def examples():
        with torch.no_grad():
            for row in data:
                ids = torch.tensor(row["input_ids"])[None]
                yield row["key"], teacher.model(input_ids=ids).last_hidden_state[0]

    out = tmp_path_factory.mktemp("targets")
    flashkd.write_topk_targets(out, examples(), teacher.lm_head.weight, k=8, temperature=1.0)
    return flashkd.TopKTargets(out)


def test_topk_targets_loss_falls_first_step_is_reference(topk_targets):
    options = dict(loss="forward_kl", temperature=1.0, weight_hard_loss=0.5, weight_soft_loss=0.5)
    losses, trainer, initial = _train(24, teacher=False, topk=topk_targets, distill=options)
    assert sum(losses[-4:]) < 0.8 * sum(losses[:4]), losses
    assert losses[0] == pytest.approx(_reference(trainer, initial, topk=True, tail="bucket", **options), rel=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_targets_student_transform_from_config(topk_targets, backend):
    options = dict(loss="jsd", beta=0.4, temperature=1.0, weight_hard_loss=0.2, weight_soft_loss=0.8)
    losses, trainer, initial = _train(2, teacher=False, topk=topk_targets,
                                      student_config=dict(final_logit_softcapping=0.75, lm_head_multiplier=2.0),
                                      distill=dict(options, distill_options={"backend": backend, "tail": "renormalize"}))
    ref = _reference(trainer, initial, topk=True, tail="renormalize", student_logit_scale=2.0, student_softcap=0.75,
                     **options)
    assert losses[0] == pytest.approx(ref, rel=1e-5)


def test_topk_targets_accumulation_2x4_equals_1x8(topk_targets):
    options = dict(loss="jsd", beta=0.3, weight_hard_loss=0.0, weight_soft_loss=1.0)
    runs = [_train(3, batch=8, accumulation=a, teacher=False, topk=topk_targets, distill=options, optim="sgd",
                   learning_rate=1.0) for a in (2, 1)]
    (l_acc, t_acc, _), (l_one, t_one, _) = runs
    torch.testing.assert_close(torch.tensor(l_acc), torch.tensor(l_one), rtol=1e-5, atol=1e-7)
    for a, b in zip(t_acc.model.parameters(), t_one.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_head_transform_reads_configs_as_trl():
    cfg = types.SimpleNamespace
    assert head_transform(cfg()) == (1.0, None)
    assert head_transform(cfg(logit_scale=None, final_logit_softcapping=30.0)) == (1.0, 30.0)  # MPT's None, Gemma
    assert head_transform(cfg(logit_scale=0.0625)) == (0.0625, None)  # Cohere
    assert head_transform(cfg(output_multiplier=2.0)) == (2.0, None)
    assert head_transform(cfg(lm_head_multiplier=0.5, logits_scaling=8.0)) == (0.5, None)  # Falcon-H1 first
    assert head_transform(cfg(logits_scaling=8.0, model_type="granite")) == (0.125, None)
    assert head_transform(cfg(logits_scaling=8.0, model_type="hyperclovax")) == (8.0, None)
    text = cfg(logit_scale=3.0, final_logit_softcapping=None)
    assert head_transform(cfg(get_text_config=lambda: text, logit_scale=9.0)) == (3.0, None)  # a VLM's text config


def test_mixin_composes_and_rejects_bad_options():
    class Other(transformers.Trainer):
        pass

    class Mine(DistillationLossMixin, Other):
        pass

    data, tok = _dataset(4, 0)
    args = _args(1, 4)
    trainer = Mine(model=tiny_models.llama(16, 0), teacher_model=tiny_models.llama(24, 1), args=args,
                   train_dataset=data, data_collator=transformers.DataCollatorForLanguageModeling(tok, mlm=False))
    trainer.train()
    metrics = trainer.evaluate(data)  # prediction_step: the same loss, without gradients
    assert metrics["eval_loss"] > 0 and torch.isfinite(torch.tensor(metrics["eval_loss"]))
    with pytest.raises(ValueError, match="distill_options: reduction"):
        Mine(model=tiny_models.llama(16, 0), args=args, distill_options={"reduction": "mean"})
    with pytest.raises(TypeError, match="teacher_model: expected a torch.nn.Module"):
        Mine(model=tiny_models.llama(16, 0), args=args, teacher_model="gpt2")
    no_teacher = Mine(model=tiny_models.llama(16, 0), args=args)
    batch = transformers.DataCollatorForLanguageModeling(tok, mlm=False)([data[0], data[1]])
    with pytest.raises(ValueError, match="teacher_model: expected a model, or top-k targets"):
        no_teacher.compute_loss(no_teacher.model, batch)


def test_dtensor_head_gathered():
    """An FSDP2-sharded LM head (a DTensor, over a one-process gloo group) gives the plain head's loss and
    gradient, gathered with full_tensor()."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        data, tok = _dataset(4, 0)
        batch = transformers.DataCollatorForLanguageModeling(tok, mlm=False)([data[i] for i in range(4)])
        args = _args(1, 4)
        plain = DistillationTrainer(model=tiny_models.llama(16, 0), teacher_model=tiny_models.llama(24, 1), args=args)
        sharded = DistillationTrainer(model=tiny_models.llama(16, 0), teacher_model=tiny_models.llama(24, 1), args=args)
        mesh = init_device_mesh("cpu", (1,))
        for m in (sharded.model, sharded.teacher_model):
            m.lm_head.weight = torch.nn.Parameter(distribute_tensor(m.lm_head.weight.detach(), mesh, [Shard(0)]))
        losses = []
        for t in (plain, sharded):
            loss = t.compute_loss(t.model, batch)
            loss.backward()
            losses.append(loss)
        torch.testing.assert_close(losses[1], losses[0])
        torch.testing.assert_close(sharded.model.lm_head.weight.grad.full_tensor(), plain.model.lm_head.weight.grad)
    finally:
        if created:
            dist.destroy_process_group()


def test_zero3_heads_gathered_for_the_call(monkeypatch):
    """Under DeepSpeed ZeRO-3 the heads are partitioned (empty) outside their module's forward: the loss
    gathers them for the call. DeepSpeed is stood in for by a partitioning that empties the weights."""
    import contextlib
    import sys

    data, tok = _dataset(4, 0)
    batch = transformers.DataCollatorForLanguageModeling(tok, mlm=False)([data[i] for i in range(4)])
    trainer = DistillationTrainer(model=tiny_models.llama(16, 0), teacher_model=tiny_models.llama(24, 1),
                                  args=_args(1, 4))
    with torch.no_grad():
        expected = trainer.compute_loss(trainer.model, batch)

    status = types.SimpleNamespace(NOT_AVAILABLE="not available", AVAILABLE="available")
    heads = [trainer.model.lm_head.weight, trainer.teacher_model.lm_head.weight]
    full = {id(p): p.data for p in heads}
    gathered = []

    def partition(p):
        p.data, p.ds_status = torch.empty(0), status.NOT_AVAILABLE

    @contextlib.contextmanager
    def gathered_parameters(params, modifier_rank=None):
        gathered.append([id(p) for p in params])
        for p in params:
            p.data, p.ds_status = full[id(p)], status.AVAILABLE
        yield
        for p in params:
            partition(p)

    for p in heads:
        partition(p)
    fake = types.ModuleType("deepspeed")
    fake.zero = types.SimpleNamespace(GatheredParameters=gathered_parameters)
    parts = types.ModuleType("deepspeed.runtime.zero.partition_parameters")
    parts.ZeroParamStatus = status
    for name, module in {"deepspeed": fake, "deepspeed.runtime": types.ModuleType("deepspeed.runtime"),
                         "deepspeed.runtime.zero": types.ModuleType("deepspeed.runtime.zero"),
                         "deepspeed.runtime.zero.partition_parameters": parts}.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(transformers.integrations.deepspeed, "is_deepspeed_zero3_enabled", lambda: True)
    import accelerate.utils.other  # it would look for the real DeepSpeed's engine class in the stand-in

    monkeypatch.setattr(accelerate.utils.other, "is_deepspeed_available", lambda: False)
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    assert gathered == [[id(p) for p in heads]]
    assert all(p.numel() == 0 for p in heads)  # partitioned again after the call
    torch.testing.assert_close(loss, expected)
