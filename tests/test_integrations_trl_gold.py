"""flashkd.integrations.trl's GOLDTrainer patch: TRL's own compute_loss vs the patched one on the same
batch (float64 tiny Llamas with two byte-level BPE tokenizers of different vocabularies, built in
memory: values, every student gradient, the logged hybrid terms), a short training run, and
patch / unpatch, on CPU."""

import tempfile
import warnings

import pytest
import torch

trl = pytest.importorskip("trl")
pytest.importorskip("transformers")
pytest.importorskip("datasets")

import flashkd.integrations.trl as fk_trl  # noqa: E402
import tiny_models  # noqa: E402
from helpers.integrations import unpatched  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from trl.experimental.gold import GOLDConfig, GOLDTrainer  # noqa: E402

WORDS = [f"w{i}" for i in range(40)]
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")


_unpatched = unpatched(fk_trl)


def _bpe(size, seed):
    """A byte-level BPE tokenizer of `size` ids trained on a word corpus: two sizes tokenize the same
    text differently (GOLD's byte alignment then merges groups of tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    g = torch.Generator().manual_seed(seed)
    corpus = [" ".join(WORDS[int(i)] for i in torch.randint(0, 40, (12,), generator=g)) for _ in range(200)]
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=["<pad>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus + ["user: assistant:"] * 5, trainer)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    out.chat_template = TEMPLATE
    return out


@pytest.fixture(scope="module")
def setup():
    from datasets import Dataset

    student_tok, teacher_tok = _bpe(275, 1), _bpe(300, 2)
    assert student_tok.get_vocab() != teacher_tok.get_vocab()
    directory = tempfile.mkdtemp()
    teacher_tok.save_pretrained(directory)  # GOLD loads the teacher's tokenizer by name
    g = torch.Generator().manual_seed(3)

    def example():
        words = lambda n: " ".join(WORDS[int(i)] for i in torch.randint(0, 40, (n,), generator=g))  # noqa: E731
        return {"messages": [{"role": "user", "content": words(4)}, {"role": "assistant", "content": words(6)}]}

    return student_tok, directory, Dataset.from_list([example() for _ in range(8)])


def _trainer(setup, dtype=torch.float64, max_steps=1, **config):
    student_tok, directory, dataset = setup
    student = tiny_models.llama(16, 0, vocab=len(student_tok)).to(dtype)
    teacher = tiny_models.llama(24, 1, vocab=301, init=0.2).to(dtype)  # a padded teacher head: 300 ids, 301 rows
    args = GOLDConfig(output_dir=tempfile.mkdtemp(), use_uld_loss=True, teacher_tokenizer_name_or_path=directory,
                      lmbda=0.0, per_device_train_batch_size=4, max_steps=max_steps, report_to=[], use_cpu=True,
                      save_strategy="no", max_length=64, max_completion_length=16, seed=0, learning_rate=1e-3,
                      logging_steps=1, **config)
    return GOLDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=dataset,
                       processing_class=student_tok)


CASES = [
    dict(),
    dict(uld_token_merge_strategy="bayesian"),
    dict(use_extended_uld=False, uld_student_temperature=2.0),
    dict(uld_use_hybrid_loss=True),
    dict(uld_use_hybrid_loss=True, beta=0.0, uld_token_merge_strategy="bayesian", uld_crossentropy_weight=0.5),
    dict(uld_use_hybrid_loss=True, uld_hybrid_matched_weight=0.6, uld_hybrid_unmatched_weight=0.9,
         uld_teacher_temperature=0.5, uld_distillation_weight=0.5),
]


@pytest.mark.parametrize("config", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_patched_compute_loss_matches_trl(setup, config):
    trainer = _trainer(setup, **config)
    batch = next(iter(trainer.get_train_dataloader()))
    model = trainer.model
    results = []
    for patched in (False, True):
        if patched:
            fk_trl.patch()
        model.zero_grad()
        trainer._matched_sum = trainer._unmatched_sum = 0.0
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        logged = (trainer._matched_sum, trainer._unmatched_sum)
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()], logged))
        fk_trl.unpatch()
    (l0, g0, m0), (l1, g1, m1) = results
    assert l1.dtype == torch.float64
    torch.testing.assert_close(l1, l0, rtol=1e-12, atol=1e-14)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)
    assert m1 == pytest.approx(m0, rel=1e-12, abs=1e-14)


def test_patched_training_runs_and_matches_trl_losses(setup):
    """fp32: two optimizer steps, the logged losses as TRL's up to fp32 rounding (the sorted L1's
    gradient is a sign: near-ties make fp32 runs drift apart slowly, so the first steps only)."""
    losses = []
    for patched in (False, True):
        trainer = _trainer(setup, dtype=torch.float32, max_steps=2, uld_use_hybrid_loss=True)
        with fk_trl.patch() if patched else warnings.catch_warnings():
            trainer.train()
        losses.append([h["loss"] for h in trainer.state.log_history if "loss" in h])
    assert len(losses[1]) == 2 and all(map(torch.isfinite, map(torch.tensor, losses[1])))
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]), rtol=1e-3, atol=1e-5)


def test_untouched_paths_run_trls_method(setup, monkeypatch):
    """return_outputs=True (the student's outputs asked for) is TRL's own method."""
    trainer = _trainer(setup)
    batch = next(iter(trainer.get_train_dataloader()))
    calls = []
    original = GOLDTrainer.compute_loss
    fk_trl.patch()
    saved = vars(GOLDTrainer)["_flashkd_saved"]  # TRL's own method, kept on the class while patched
    monkeypatch.setitem(saved, "compute_loss", lambda *a, **k: calls.append(1) or original(*a, **k))
    loss, outputs = trainer.compute_loss(trainer.model, batch, return_outputs=True)
    assert calls == [1] and outputs.logits.shape[-1] == trainer.model.config.vocab_size


def test_patch_unpatch_restores_gold():
    original = GOLDTrainer.__dict__["compute_loss"]
    with fk_trl.patch():
        assert GOLDTrainer.compute_loss is fk_trl.gold_compute_loss
    assert GOLDTrainer.__dict__["compute_loss"] is original


def test_refuses_a_changed_gold_trainer(monkeypatch):
    def compute_loss(self, model, inputs):
        raise AssertionError

    monkeypatch.setattr(GOLDTrainer, "compute_loss", compute_loss)
    with pytest.raises(RuntimeError, match=r"GOLDTrainer is not what the patch was written for"):
        fk_trl.patch()
    assert not fk_trl.is_patched()
