"""Mistakes that used to give a result, or an error only deep inside the first training step: a teacher
vocabulary larger than the student's taken as a padded head unannounced, a loss parameter the chosen
loss never reads, teacher logits passed where hidden states go, and a trainer's options checked only
at its first step. Each is now one line naming the argument, what was expected and what came."""

import pytest
import torch

import flashkd
from flashkd.distill import check_options

V, VT, HS, HT, N = 30, 32, 8, 6, 5


def _dense(vt=VT, v=V):
    xs = torch.randn(N, HS, requires_grad=True)
    ws = torch.randn(v, HS, requires_grad=True)
    xt, wt = torch.randn(N, HT), torch.randn(vt, HT)
    return xs, ws, xt, wt, torch.randint(0, v, (N,))


def _one_line(error) -> str:
    text = str(error.value)
    assert "\n" not in text, text
    return text


# -- a teacher vocabulary larger than the student's -----------------------------------------------------

@pytest.mark.parametrize("form", ["heads", "logits"])
def test_a_larger_teacher_vocab_is_refused_naming_both_ways_out(form):
    xs, ws, xt, wt, y = _dense()
    with pytest.raises(ValueError) as e:
        if form == "heads":
            flashkd.fused_linear_distill(xs, ws, xt, wt, y)
        else:
            flashkd.fused_linear_distill_logits(xs, ws, (xt @ wt.T).detach(), y)
    text = _one_line(e)
    name = "teacher_weight" if form == "heads" else "teacher_logits"
    assert text.startswith(f"{name}: expected {V} ") and f"got {VT}" in text, text
    assert f"vocab_size={V}" in text and "another tokenizer" in text, text


@pytest.mark.parametrize("form", ["heads", "logits"])
def test_a_padded_teacher_head_declared_by_vocab_size_drops_its_extra_rows(form):
    xs, ws, xt, wt, y = _dense()
    if form == "heads":
        got = flashkd.fused_linear_distill(xs, ws, xt, wt, y, vocab_size=V)
    else:
        got = flashkd.fused_linear_distill_logits(xs, ws, (xt @ wt.T).detach(), y, vocab_size=V)
    want = flashkd.fused_linear_distill(xs, ws, xt, wt[:V], y)  # the same head without its padding rows
    assert torch.equal(got, want)


@pytest.mark.parametrize("vocab_size,error,words", [
    (V + 1, ValueError, [f"vocab_size: expected {V}", f"got {V + 1}"]),
    (V - 1, ValueError, [f"vocab_size: expected {V}", f"got {V - 1}"]),
    (0, TypeError, ["vocab_size: expected None or an int >= 1", "got 0"]),
    (30.0, TypeError, ["vocab_size", "got 30.0"]),
    (True, TypeError, ["vocab_size", "got True"]),
])
def test_a_wrong_vocab_size_is_refused(vocab_size, error, words):
    xs, ws, xt, wt, y = _dense()
    with pytest.raises(error) as e:
        flashkd.fused_linear_distill(xs, ws, xt, wt, y, vocab_size=vocab_size)
    text = _one_line(e)
    assert all(w in text for w in words), text


def test_a_smaller_teacher_vocab_is_still_refused():
    xs, ws, xt, wt, y = _dense(vt=V - 2)
    with pytest.raises(ValueError) as e:
        flashkd.fused_linear_distill(xs, ws, xt, wt, y)
    assert _one_line(e).startswith(f"teacher_weight: expected {V} rows (the student's vocab), got {V - 2}")


def test_vocab_size_equal_to_both_heads_changes_nothing():
    xs, ws, xt, wt, y = _dense(vt=V)
    assert torch.equal(flashkd.fused_linear_distill(xs, ws, xt, wt, y, vocab_size=V),
                       flashkd.fused_linear_distill(xs, ws, xt, wt, y))


# -- a keyword the chosen loss does not read ------------------------------------------------------------

ALPHA = ("loss='skew_kl', loss='skew_reverse_kl', loss='alpha_divergence', loss='renyi', loss='renyi_reverse', "
         "loss='ab_divergence', loss='dkd'")
BETA = "loss='jsd', loss='cosine', loss='ab_divergence', loss='dkd'"


@pytest.mark.parametrize("loss,options,readers", [
    ("jsd", dict(alpha=0.3), ALPHA),
    ("skew_kl", dict(head_mass=0.3), "loss='akl'"),
    ("forward_kl", dict(beta=0.3), BETA),
    ("tvd", dict(beta=0.5), BETA),  # the default's value, given: still refused
    ("akl", dict(alpha=0.1), ALPHA),
    ("jeffreys", dict(gate_width=0.2), "loss='entropy_adaptive'"),
])
def test_a_parameter_the_loss_does_not_read_is_refused(loss, options, readers):
    xs, ws, xt, wt, y = _dense(vt=V)
    (name, value), = options.items()
    with pytest.raises(ValueError) as e:
        flashkd.fused_linear_distill(xs, ws, xt, wt, y, loss=loss, **options)
    assert _one_line(e) == (f"{name}: loss={loss!r} does not read it (it is read by {readers}); "
                            f"got {name}={value!r}, leave it out")
    with pytest.raises(ValueError, match=f"^{name}: loss={loss!r} does not read it"):  # a module, at construction
        flashkd.FusedLinearDistillLoss(loss, **options)


def test_a_parameter_the_topk_loss_does_not_read_is_refused():
    xs, ws, _, _, y = _dense(vt=V)
    ids = torch.stack([torch.randperm(V)[:4] for _ in range(N)])
    lp = torch.log_softmax(torch.randn(N, 4), -1) - 0.5
    with pytest.raises(ValueError, match=r"^beta: loss='forward_kl' does not read it"):
        flashkd.fused_linear_distill_topk(xs, ws, ids, lp, y, beta=0.2)
    flashkd.fused_linear_distill_topk(xs, ws, ids, lp, y, loss="jsd", beta=0.2)  # read there


@pytest.mark.parametrize("loss,options", [("jsd", dict(beta=0.2)), ("cosine", dict(beta=0.7)),
                                          ("skew_kl", dict(alpha=0.3)), ("skew_reverse_kl", dict(alpha=0.3)),
                                          ("akl", dict(head_mass=0.3))])
def test_a_parameter_its_loss_reads_changes_the_loss(loss, options):
    xs, ws, xt, wt, y = _dense(vt=V)
    given = flashkd.fused_linear_distill(xs, ws, xt, wt, y, loss=loss, **options)
    default = flashkd.fused_linear_distill(xs, ws, xt, wt, y, loss=loss)
    assert not torch.equal(given, default)


# -- teacher logits where hidden states go --------------------------------------------------------------

def test_teacher_logits_as_teacher_input_point_to_the_logits_form():
    xs, ws, xt, wt, y = _dense(vt=V)
    logits = (xt @ wt.T).detach()  # (N, V): the last dim is the teacher head's vocab
    with pytest.raises(ValueError) as e:
        flashkd.fused_linear_distill(xs, ws, logits, wt, y)
    text = _one_line(e)
    assert text.startswith(f"teacher_input: expected hidden size {HT}") and "looks like logits" in text, text
    assert "fused_linear_distill_logits" in text and "transposed" not in text, text


def test_a_transposed_teacher_head_still_says_transposed():
    xs, ws, xt, wt, y = _dense(vt=V)
    with pytest.raises(ValueError) as e:
        flashkd.fused_linear_distill(xs, ws, xt, wt.T.contiguous(), y)
    text = _one_line(e)
    assert "teacher_weight looks transposed" in text and "logits" not in text, text


def test_student_logits_as_student_input_say_so():
    xs, ws, xt, wt, y = _dense(vt=V)
    with pytest.raises(ValueError) as e:
        flashkd.fused_linear_distill((xs @ ws.T).detach(), ws, xt, wt, y)
    text = _one_line(e)
    assert "student_input looks like logits" in text and "hidden states" in text, text


# -- options checked where they are given ---------------------------------------------------------------

@pytest.mark.parametrize("function,options,error,start", [
    ("fused_linear_distill", dict(loss="kl"), ValueError, "loss: expected one of"),
    ("fused_linear_distill", dict(head_mass=2.0), ValueError, "head_mass: loss='jsd' does not read it"),
    ("fused_linear_distill", dict(loss="akl", head_mass=2.0), ValueError, "head_mass: expected a value in [0, 1]"),
    ("fused_linear_distill", dict(vocab_size=-3), TypeError, "vocab_size: expected None or an int >= 1"),
    ("fused_linear_distill_topk", dict(tail="none"), ValueError, "tail: expected 'bucket' or 'renormalize'"),
    ("fused_linear_distill_topk", dict(beta=0.3), ValueError, "beta: loss='forward_kl' does not read it"),
])
def test_check_options_is_the_calls_parse(function, options, error, start):
    with pytest.raises(error) as e:
        check_options(options, function)
    assert _one_line(e).startswith(start)


# -- the HF DistillationTrainer checks at construction --------------------------------------------------

def _trainer(tmp_path, teacher_vocab=None, **kw):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import tiny_models
    from transformers import TrainingArguments

    from flashkd.integrations.transformers import DistillationTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no")
    teacher = tiny_models.llama(24, 1, **({} if teacher_vocab is None else dict(vocab=teacher_vocab)))
    return DistillationTrainer(model=tiny_models.llama(16, 0), teacher_model=teacher, args=args, **kw)


@pytest.mark.parametrize("kw,error,start", [
    (dict(loss="kl"), ValueError, "loss: expected one of"),
    (dict(distill_options={"head_mass": 2.0}), ValueError, "head_mass: loss='jsd' does not read it"),
    (dict(loss="akl", distill_options={"head_mass": 2.0}), ValueError, "head_mass: expected a value in [0, 1]"),
    (dict(distill_options={"tail": "bucket"}), TypeError, "distill_options: 'tail' is not a keyword option"),
    (dict(teacher_vocab=50), ValueError, "teacher_model: expected 61 LM-head rows (the student's vocab), got 50"),
    (dict(teacher_vocab=64), ValueError, "teacher_model: expected 61 LM-head rows (the student's vocab), got 64"),
    (dict(teacher_vocab=64, distill_options={"vocab_size": 60}), ValueError, "vocab_size: expected 61"),
])
def test_the_trainer_refuses_at_construction(tmp_path, kw, error, start):
    with pytest.raises(error) as e:
        _trainer(tmp_path, **kw)
    assert _one_line(e).startswith(start), str(e.value)


def test_the_trainer_names_its_own_keyword_for_a_padded_teacher(tmp_path):
    with pytest.raises(ValueError) as e:
        _trainer(tmp_path, teacher_vocab=64)
    assert 'distill_options={"vocab_size": 61}' in _one_line(e)
    _trainer(tmp_path, teacher_vocab=64, distill_options={"vocab_size": 61})  # declared: accepted


# -- a patch says it is active ----------------------------------------------------------------------------

def test_a_patch_says_once_that_it_is_installed(capsys):
    pytest.importorskip("trl")
    import logging

    from flashkd.integrations import trl as fk_trl

    logger = logging.getLogger("flashkd")
    saved = logger.handlers[:], logger.level, logger.propagate
    logger.handlers, logger.level = [], logging.NOTSET  # as in a fresh process
    was = fk_trl.is_patched()
    fk_trl.unpatch()
    try:
        with fk_trl.patch():
            fk_trl.patch()  # again: a no-op, nothing more to say
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("flashkd: TRL's DistillationTrainer") and "patch" in err, err
        logger.setLevel(logging.WARNING)  # the application's choice is kept: silent
        with fk_trl.patch():
            pass
        assert capsys.readouterr().err == ""
    finally:
        logger.handlers, logger.level, logger.propagate = saved
        if was:
            fk_trl.patch()


def test_a_patch_keeps_the_original_on_what_it_patches_and_restores_it_exactly():
    """`flashkd.integrations.replace` keeps the library's own attribute on the module or class it patches
    (the first time only: patching twice keeps the original), and `restore` puts back exactly that: an
    attribute the class had inherited is deleted again, not left as a copy of its base's."""
    import types

    from flashkd.integrations import is_replaced, original, replace, restore

    class Base:
        def step(self):
            return "base"

    class Trainer(Base):
        def loss(self):
            return "library"

    library, ours = Trainer.loss, lambda self: "flashkd"  # noqa: E731
    record = replace(Trainer, "loss", ours)
    assert replace(Trainer, "loss", ours) is record and Trainer().loss() == "flashkd"
    assert original(Trainer, "loss") is library and is_replaced(Trainer, "loss")
    replace(Trainer, "step", ours)
    assert Trainer().step() == "flashkd" and original(Trainer, "step") is Base.step
    restore(Trainer, "loss", "step")
    assert Trainer.loss is library and "step" not in vars(Trainer) and "_flashkd_saved" not in vars(Trainer)
    assert not record and not is_replaced(Trainer, "loss") and original(Trainer, "loss") is library
    restore(Trainer, "loss")  # not patched: nothing to do
    module = types.ModuleType("m")
    module.helper = len
    replace(module, "helper", abs)
    assert module.helper is abs and original(module, "helper") is len
    restore(module, "helper")
    assert module.helper is len and vars(module).keys() == {"__name__", "__doc__", "__package__", "__loader__",
                                                              "__spec__", "helper"}
