"""The nn.Module wrappers (`flashkd.FusedLinearDistillLoss` and the Liger drop-ins) and the TRL / transformers
integrations' entry points, driven as a training loop drives them: options changed between steps, batches
whose tensors do not fit together, TRL's helpers called with what their own signature names. Each case
either computes what the function computes with the same options, or raises an error naming the argument
as the caller passed it. The regressions here: an option set as a module attribute was kept as a plain
attribute no forward read; a mask of another shape was broadcast (TRL's top-k helper, the trainer's
attention_mask) or died in torch with an IndexError / RuntimeError naming nothing; errors of TRL's helpers
named flashkd's arguments, not TRL's; a trainer option given twice was dropped unseen. Tiny CPU tensors."""

import pytest
import torch

import flashkd
import flashkd.integrations.trl as fk_trl
from conftest import BACKENDS

N, H, V = 6, 8, 13


def _dense(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(N, H, generator=g).to(dtype)
    ws = torch.randn(V, H, generator=g).to(dtype)
    xt = 2.0 * torch.randn(N, H, generator=g).to(dtype)
    wt = torch.randn(V, H, generator=g).to(dtype)
    y = torch.randint(0, V, (N,), generator=g)
    y[1] = -100
    return xs, ws, xt, wt, y


# -- the modules' options as attributes ----------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_option_set_as_an_attribute_is_read_by_the_next_forward(backend):
    """`loss_fn.temperature = 1.0` between steps (a schedule, as on torch's and Liger's loss modules) made a
    plain attribute: every later forward still ran at the constructor's 2.0, unseen."""
    xs, ws, xt, wt, y = _dense()
    module = flashkd.FusedLinearDistillLoss("jsd", temperature=2.0, backend=backend)
    first = module(xs, ws, xt, wt, y)
    module.temperature = 1.0
    module.weight_hard_loss = 0.25
    assert module.options["temperature"] == 1.0 and module.temperature == 1.0
    want = flashkd.fused_linear_distill(xs, ws, xt, wt, y, temperature=1.0, weight_hard_loss=0.25, backend=backend)
    got = module(xs, ws, xt, wt, y)
    assert torch.equal(got, want) and not torch.equal(got, first)
    module.loss = "tvd"  # the loss too (`beta` unset: tvd reads none)
    assert torch.equal(module(xs, ws, xt, wt, y), flashkd.fused_linear_distill(
        xs, ws, xt, wt, y, loss="tvd", temperature=1.0, weight_hard_loss=0.25, backend=backend))
    # an option not given reads as the function's default
    assert module.beta is None and module.chunk_size is None and module.reduction == "mean"


def test_a_bad_value_set_as_an_attribute_is_refused_and_not_kept():
    module = flashkd.FusedLinearDistillLoss("tvd")
    for name, value, error, message in (("temperature", 0.0, ValueError, r"temperature: expected a value > 0"),
                                        ("beta", 0.3, ValueError, r"beta: loss='tvd' does not read it"),
                                        ("reduction", "none", ValueError, r"reduction: expected 'mean' or 'sum'"),
                                        ("ignore_index", -100.0, TypeError, r"ignore_index: expected an int"),
                                        ("loss", "JSD", ValueError, r"loss: expected one of")):
        with pytest.raises(error, match="^" + message):
            setattr(module, name, value)
    assert module.options == {"loss": "tvd"}
    module.foo = 1  # not an option: an attribute as on any module
    assert module.foo == 1 and "foo" not in module.options


def test_liger_drop_in_vocab_size_attribute_declares_a_padded_teacher():
    """The drop-ins' own keyword `vocab_size`, set as an attribute, was not read: a padded teacher head was
    still refused, with a message asking for the vocab_size just set."""
    xs, ws, xt, wt, y = _dense()
    padded = torch.cat([wt, torch.randn(3, H)])
    module = flashkd.FusedLinearJSDLoss(beta=0.3)
    module.vocab_size = V
    want = flashkd.fused_linear_distill(xs, ws, xt, padded, y, beta=0.3, vocab_size=V)
    assert torch.equal(module(xs, ws, xt, padded, y), want)
    with pytest.raises(TypeError, match=r"^vocab_size: expected None or an int >= 1"):
        module.vocab_size = True


# -- TRL's helpers ------------------------------------------------------------------------------------------


def _trl_dense(b=2, k=3, hs=8, ht=10, v=11):
    g = torch.Generator().manual_seed(1)
    xs, xt = torch.randn(b, k, hs, generator=g), torch.randn(b, k, ht, generator=g)
    ws, wt = torch.randn(v, hs, generator=g), torch.randn(v, ht, generator=g)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    return xs, xt, ws, wt, mask


def test_trl_divergence_helper_checks_its_rows_and_names_trl_arguments():
    pytest.importorskip("trl")
    xs, xt, ws, wt, mask = _trl_dense()
    f = fk_trl.chunked_divergence_loss
    cases = [  # each failed in indexing with an IndexError naming nothing, or named flashkd's argument
        (lambda: f(xs, xt, ws, wt, mask[:1], 0.5), ValueError,
         r"completion_mask: expected shape \(2, 3\) \(student_hidden_states' leading dims\), got \(1, 3\)"),
        (lambda: f(xs, xt, ws, wt, mask[:, :2], 0.5), ValueError, r"completion_mask: expected shape \(2, 3\)"),
        (lambda: f(xs, xt[:, :2], ws, wt, mask, 0.5), ValueError,
         r"teacher_hidden_states: expected leading dims \(2, 3\) \(those of student_hidden_states\)"),
        (lambda: f(xs, xt, ws, wt, mask.tolist(), 0.5), TypeError, r"completion_mask: expected a torch.Tensor, got list"),
        (lambda: f(xs, xt, ws, wt, mask, 0.5, student_lm_head_bias=torch.zeros(12)), ValueError,
         r"student_lm_head_bias: expected shape \(11,\), got \(12,\)"),
        (lambda: f(xs, xt, ws, wt, mask, 0.5, teacher_final_logit_softcapping=0.0), ValueError,
         r"teacher_final_logit_softcapping: expected a finite float > 0"),
        (lambda: f(xs, xt, ws, wt[:9], mask, 0.5), ValueError, r"teacher_lm_head_weight: expected 11 rows"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match="^" + message):
            call()


def _trl_topk(n=5, k=3, h=8, v=11):
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g)
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n)])
    lp = torch.log_softmax(torch.randn(n, k, generator=g), -1) - 0.2
    mask = torch.ones(n, k, dtype=torch.bool)
    mask[1, 2] = False
    mask[3] = False
    return dict(hidden_valid=x, lm_head_weight=w, lm_head_bias=None, logit_scale=1.0, final_logit_softcapping=None,
                target_ids=ids, teacher_target_logps=lp, valid_candidate_mask=mask, beta=0.5, temperature=1.0,
                add_tail_bucket=True, teacher_id_idx=None, num_teachers=1, chunk_size=2)


def test_trl_topk_helper_does_not_broadcast_its_mask():
    """A (N, 1) valid_candidate_mask was broadcast over the K slots by torch.where: a loss over slots TRL's
    helper (which refuses it) never counts, returned unseen."""
    args = _trl_topk()
    mask = args["valid_candidate_mask"]
    with pytest.raises(ValueError, match=r"^valid_candidate_mask: expected shape \(5, 3\) \(that of target_ids\), "
                                         r"got \(5, 1\)"):
        fk_trl.chunked_jsd_loss(**{**args, "valid_candidate_mask": mask[:, :1]})
    with pytest.raises(TypeError, match=r"^valid_candidate_mask: expected dtype torch.bool, got torch.int64"):
        fk_trl.chunked_jsd_loss(**{**args, "valid_candidate_mask": mask.long()})  # was torch.where's RuntimeError


def test_trl_topk_helper_names_trl_arguments():
    args = _trl_topk()
    index = torch.tensor([0, 1, 0, 1, 1])
    cases = [  # each named flashkd's teacher_ids, teacher_logprobs, teacher_index, student_input
        (dict(target_ids=args["target_ids"].float()), TypeError, r"target_ids: expected an integer dtype"),
        (dict(teacher_target_logps=args["teacher_target_logps"][:, :2]), ValueError,
         r"teacher_target_logps: expected shape \(5, 3\)"),
        (dict(teacher_id_idx=index + 5, num_teachers=2), ValueError,
         r"teacher_id_idx: expected values in \[0, 2\) or -1 \(no teacher\), got 5"),
        (dict(hidden_valid=args["hidden_valid"][:, :7]), ValueError, r"hidden_valid: expected hidden size 8"),
        (dict(final_logit_softcapping=-1.0), ValueError, r"final_logit_softcapping: expected a finite float > 0"),
    ]
    for change, error, message in cases:
        with pytest.raises(error, match="^" + message):
            fk_trl.chunked_jsd_loss(**{**args, **change})


# -- the transformers trainer ---------------------------------------------------------------------------------


@pytest.fixture
def trainer(tmp_path, monkeypatch):
    """A DistillationTrainer over a tiny student (top-k targets: no teacher model), made in tmp_path."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import tiny_models
    from flashkd.integrations.transformers import DistillationTrainer

    monkeypatch.chdir(tmp_path)
    args = transformers.TrainingArguments(output_dir="trainer", per_device_train_batch_size=2, max_steps=1,
                                          report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)

    def make(**kw):
        return DistillationTrainer(model=tiny_models.llama(16, 0), args=args, **kw)

    return make


def test_trainer_options_not_a_dict_or_given_twice(trainer):
    for options in ("chunk_size", [("chunk_size", 4)], 5):  # a str died in dict(), a list of pairs was taken
        with pytest.raises(TypeError, match=rf"^distill_options: expected a dict of keyword options or None, "
                                            rf"got {type(options).__name__}"):
            trainer(distill_options=options)
    # beta=0.5 won over distill_options' 0.2 unseen
    with pytest.raises(TypeError, match=r"^beta: expected once, as a keyword or in distill_options, got beta=0\.5 "
                                        r"and distill_options\['beta'\]=0\.2"):
        trainer(loss="jsd", beta=0.5, distill_options={"beta": 0.2})
    made = trainer(loss="jsd", distill_options={"beta": 0.2})  # once, either way: kept
    assert made.distill_options == {"beta": 0.2, "loss": "jsd"}


def _batch(t=4, k=3, v=61):
    g = torch.Generator().manual_seed(3)
    input_ids = torch.randint(3, v, (2, t), generator=g)
    mask = torch.ones(2, t, dtype=torch.long)
    mask[1, -1] = 0
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(2 * t)]).reshape(2, t, k)
    lp = torch.log_softmax(torch.randn(2, t, k, generator=g), -1) - 0.1
    return {"input_ids": input_ids, "attention_mask": mask, "teacher_ids": ids, "teacher_logprobs": lp}


def test_trainer_batch_tensors_checked_as_the_batch_holds_them(trainer):
    made = trainer()
    batch = _batch()
    assert torch.isfinite(made.compute_loss(made.model, batch))
    # (2, 4) is the batch's shape: the errors give the shapes as passed, not as shifted by one row
    cases = [
        ({"attention_mask": batch["attention_mask"][:1]}, ValueError,  # was broadcast over the batch
         r"attention_mask: expected shape \(2, 4\) \(that of input_ids\), got \(1, 4\)"),
        ({"attention_mask": batch["attention_mask"][:, 1:]}, ValueError,  # was masked_fill's RuntimeError
         r"attention_mask: expected shape \(2, 4\) \(that of input_ids\), got \(2, 3\)"),
        ({"teacher_logprobs": batch["teacher_logprobs"][:, :, :2]}, ValueError,  # was "(2, 3, 3) ... got (2, 3, 2)"
         r"teacher_logprobs: expected shape \(2, 4, 3\) \(that of teacher_ids\), got \(2, 4, 2\)"),
        ({"labels": batch["input_ids"].tolist()}, TypeError, r"labels: expected a torch.Tensor, got list"),
        ({"teacher_ids": batch["teacher_ids"].tolist()}, TypeError, r"teacher_ids: expected a torch.Tensor, got list"),
        ({"teacher_logprobs": batch["teacher_logprobs"].tolist()}, TypeError,
         r"teacher_logprobs: expected a torch.Tensor, got list"),
    ]
    for change, error, message in cases:
        with pytest.raises(error, match="^" + message):
            made.compute_loss(made.model, {**batch, **change})


@pytest.mark.parametrize("compiled", ["no", 0, None])
def test_liger_drop_in_compiled_is_a_bool(compiled):
    """Liger's `compiled` flag, kept and unused: anything but a bool (a string "no" is truthy) is refused."""
    with pytest.raises(TypeError, match="compiled: expected a bool"):
        flashkd.modules.FusedLinearJSDLoss(compiled=compiled)
    assert flashkd.modules.FusedLinearJSDLoss(compiled=False).compiled is False


def test_a_misspelt_option_or_forward_argument_set_as_an_attribute_is_refused():
    """`m.temprature = 5.0` (near an option's name) or `m.row_weight = w` (forward's per-call data) would make an
    attribute no forward reads; other attributes of the user's own stay settable, `compiled` a bool."""
    m = flashkd.FusedLinearDistillLoss()
    with pytest.raises(TypeError, match="temprature: not an option.*'temperature'"):
        m.temprature = 5.0
    with pytest.raises(TypeError, match="row_weight: an argument of forward"):
        m.row_weight = torch.ones(3)
    m.step_count = 3
    assert m.step_count == 3 and m.options == {"loss": "jsd"}
    jsd = flashkd.modules.FusedLinearJSDLoss()
    with pytest.raises(TypeError, match="compiled: expected a bool"):
        jsd.compiled = "no"
    jsd.compiled = False
    assert jsd.compiled is False


def test_liger_drop_in_errors_name_true_labels():
    """An error that names labels in its text names them as Liger's forward does: true_labels."""
    m = flashkd.modules.FusedLinearJSDLoss()
    with pytest.raises(ValueError, match=r"^weight_hard_loss: expected 0 when true_labels is None"):
        m(torch.randn(4, 6), torch.randn(10, 6), torch.randn(4, 5), torch.randn(10, 5), None)


def test_an_option_set_on_a_shallow_copy_leaves_the_original_alone():
    """copy.copy(module) shared its `options` dict, and `copy.temperature = 3.0` changed the original's
    temperature too (a plain attribute, as on torch's own loss modules, would not)."""
    import copy

    xs, ws, xt, wt, y = _dense()
    for module in (flashkd.FusedLinearDistillLoss("jsd", temperature=2.0), flashkd.FusedLinearJSDLoss(temperature=2.0)):
        before = module(xs, ws, xt, wt, y)
        other = copy.copy(module)
        other.temperature = 3.0
        assert module.temperature == 2.0 and other.temperature == 3.0
        assert torch.equal(module(xs, ws, xt, wt, y), before)


def test_liger_fused_linear_jsd_attributes_checked_when_set():
    """FusedLinearJSD (LigerFusedLinearJSD's drop-in): `.beta = 0.9` (flashkd's name of its jsd_beta) or a
    misspelt attribute made one no forward reads, the loss unchanged; a bad jsd_beta was kept until the next
    forward. Now refused where set, the value before kept."""
    xs, ws, xt, wt, y = _dense()
    m = flashkd.modules.FusedLinearJSD(jsd_beta=0.3)
    want = m(xs, ws, xt, wt, y)
    with pytest.raises(TypeError, match=r"^beta: not an option of FusedLinearJSD \(did you mean 'jsd_beta'\?\)"):
        m.beta = 0.9
    with pytest.raises(TypeError, match=r"^temprature: not an option.*'temperature'"):
        m.temprature = 2.0
    with pytest.raises(ValueError, match=r"^jsd_beta: expected a value in \[0, 1\]"):
        m.jsd_beta = 2.0
    assert m.jsd_beta == 0.3 and torch.equal(m(xs, ws, xt, wt, y), want)
    m.jsd_beta = 0.7  # its own attributes stay settable, read by the next forward
    assert torch.equal(m(xs, ws, xt, wt, y), flashkd.fused_linear_distill(
        xs, ws, xt, wt, y, beta=0.7, weight_hard_loss=0.0, weight_soft_loss=1.0))
    m.step_count = 1
    assert m.step_count == 1
