"""flashkd.data end to end: a tiny HF Llama teacher -> shards on disk -> reader -> collated batch -> loss."""

import json
import pickle
import sys

import pytest
import torch
from transformers import DataCollatorForLanguageModeling, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import flashkd
from flashkd.data import TopKCollator, TopKTargets, write_topk_targets

V, K, TAU = 97, 8, 1.5
LENGTHS = {"doc:0": 5, "train/1": 9, "a-2": 1, "b_3.x": 13, "c4": 7}


@pytest.fixture(scope="module")
def teacher():
    """A tiny Llama (no download), its input ids per key, last hidden states and full logits."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).eval()
    inputs, hidden, logits = {}, {}, {}
    with torch.no_grad():
        for key, n in LENGTHS.items():
            inputs[key] = torch.randint(0, V, (1, n))
            out = model(inputs[key], output_hidden_states=True)
            hidden[key], logits[key] = out.hidden_states[-1][0], out.logits[0]
    return model, inputs, hidden, logits


def write(path, hidden, weight, **options):
    return write_topk_targets(path, ((key, h) for key, h in hidden.items()), weight, K, temperature=TAU, **options)


def test_hidden_states_last_is_what_lm_head_sees(teacher):
    model, _, hidden, logits = teacher
    for key in LENGTHS:
        torch.testing.assert_close(model.lm_head(hidden[key]), logits[key], rtol=0, atol=0)


def test_round_trip_equals_teacher_topk(teacher, tmp_path):
    model, _, hidden, logits = teacher
    w = model.lm_head.weight.detach()
    # 8 slots x 8 bytes = 64 bytes per position: 600 bytes puts 1 to 9 positions in a shard
    targets = write(tmp_path / "t", hidden, w, shard_bytes=600, teacher_description="tiny llama, seed 0")
    index = json.loads((tmp_path / "t" / "index.json").read_text())
    assert (index["format"], index["version"], index["k"], index["temperature"]) == ("flashkd.topk", 2, K, TAU)
    assert (index["vocab_size"], index["logprob_dtype"], index["teacher_description"]) == (V, "float32", "tiny llama, seed 0")
    assert len(index["shards"]) >= 3 and all((tmp_path / "t" / s["file"]).is_file() for s in index["shards"])
    assert {k: e["length"] for k, e in index["examples"].items()} == LENGTHS

    targets = TopKTargets(tmp_path / "t")  # a fresh reader, as another process would open it
    assert len(targets) == len(LENGTHS) and list(targets) == list(LENGTHS) and "c4" in targets and "c5" not in targets
    assert (targets.k, targets.temperature, targets.vocab_size, targets.logprob_dtype) == (K, TAU, V, torch.float32)
    for key, n in LENGTHS.items():
        ids, lp = targets[key]
        assert ids.dtype == torch.int64 and lp.dtype == torch.float32 and ids.shape == lp.shape == (n, K)
        ref_ids, ref_lp = flashkd.teacher_topk(hidden[key], w, K, temperature=TAU)
        assert torch.equal(ids, ref_ids) and torch.equal(lp, ref_lp)
        # the teacher's own distribution, in float64: log-probs at the stored ids, and they are its top K
        full = torch.log_softmax(logits[key].double() / TAU, -1)
        torch.testing.assert_close(lp.double(), full.gather(-1, ids), rtol=0, atol=1e-5)
        torch.testing.assert_close(lp.double(), full.topk(K, -1).values, rtol=0, atol=1e-5)
        assert targets.length(key) == n


def pad_collate(side, mask=True):
    """A base collate_fn as HF's pad input_ids (0), labels (-100) and attention_mask."""

    def collate(features):
        t = max(len(f["input_ids"]) for f in features)

        def pad(seq, value):
            fill = [value] * (t - len(seq))
            return fill + list(seq) if side == "left" else list(seq) + fill

        batch = {
            "input_ids": torch.tensor([pad(f["input_ids"], 0) for f in features]),
            "labels": torch.tensor([pad(f["input_ids"], -100) for f in features]),
        }
        if mask:
            batch["attention_mask"] = torch.tensor([pad([1] * len(f["input_ids"]), 0) for f in features])
        return batch

    return collate


@pytest.mark.parametrize("side,mask", [("right", True), ("left", True), ("right", False), ("left", False)])
def test_collated_batch_gives_the_in_memory_loss(teacher, tmp_path, side, mask):
    model, inputs, hidden, _ = teacher
    w = model.lm_head.weight.detach()
    targets = write(tmp_path / "t", hidden, w, shard_bytes=600)
    keys = ["train/1", "a-2", "b_3.x", "doc:0"]
    features = [{"key": key, "input_ids": inputs[key][0].tolist()} for key in keys]
    batch = TopKCollator(targets, pad_collate(side, mask), padding_side=side)(features)
    b, t = batch["input_ids"].shape
    assert "key" not in batch and batch["teacher_ids"].shape == (b, t, K) and batch["teacher_logprobs"].shape == (b, t, K)

    torch.manual_seed(1)
    hs = 16
    student = {key: torch.randn(LENGTHS[key], hs) for key in keys}
    x = torch.zeros(b, t, hs)
    for i, key in enumerate(keys):
        n = LENGTHS[key]
        rows = slice(0, n) if side == "right" else slice(t - n, t)
        x[i, rows] = student[key]
        assert torch.equal(batch["teacher_ids"][i, rows], targets[key][0])
        pad = torch.ones(t, dtype=torch.bool)
        pad[rows] = False
        assert (batch["teacher_ids"][i, pad] == -1).all() and (batch["teacher_logprobs"][i, pad] == -torch.inf).all()
    x.requires_grad_(True)
    ws = (0.1 * torch.randn(V, hs)).requires_grad_(True)
    options = dict(loss="jsd", temperature=TAU, weight_hard_loss=0.3, weight_soft_loss=0.7)

    # Row t is the teacher's distribution over token t + 1: shift the labels, not the targets, and
    # drop rows at padding (with left padding, the pad before the first token would get its label).
    labels = batch["labels"][:, 1:].masked_fill(batch["teacher_ids"][:, :-1, 0] < 0, -100)
    loss = flashkd.fused_linear_distill_topk(
        x[:, :-1], ws, batch["teacher_ids"][:, :-1], batch["teacher_logprobs"][:, :-1], labels, **options
    )
    loss.backward()
    assert torch.isfinite(loss) and loss > 0
    assert torch.isfinite(ws.grad).all() and ws.grad.abs().sum() > 0
    for i, key in enumerate(keys):
        n = LENGTHS[key]
        rows = slice(0, n) if side == "right" else slice(t - n, t)
        valid = torch.zeros(t, dtype=torch.bool)
        valid[rows] = True
        assert (x.grad[i, ~valid] == 0).all()  # padding gets no gradient

    # the same rows, unpadded, with targets straight from teacher_topk
    xs, ids, lps, labels = [], [], [], []
    for key in keys:
        i_, lp_ = flashkd.teacher_topk(hidden[key], w, K, temperature=TAU)
        xs.append(student[key][:-1]), ids.append(i_[:-1]), lps.append(lp_[:-1]), labels.append(inputs[key][0, 1:])
    ws_ref = ws.detach().clone().requires_grad_(True)
    ref = flashkd.fused_linear_distill_topk(torch.cat(xs), ws_ref, torch.cat(ids), torch.cat(lps), torch.cat(labels), **options)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ws.grad, ws_ref.grad, rtol=1e-4, atol=1e-6)


def test_hf_collator_and_dataloader(teacher, tmp_path):
    from tokenizers import Tokenizer, models

    model, inputs, hidden, _ = teacher
    targets = write(tmp_path / "t", hidden, model.lm_head.weight.detach())
    vocab = {f"t{i}": i for i in range(V)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")), pad_token="t0", padding_side="left"
    )
    collate = TopKCollator(pickle.loads(pickle.dumps(targets)), DataCollatorForLanguageModeling(tokenizer, mlm=False))
    data = [{"key": key, "input_ids": inputs[key][0].tolist()} for key in LENGTHS]
    for batch in torch.utils.data.DataLoader(data, batch_size=2, collate_fn=collate):
        mask = batch["attention_mask"].bool()
        assert mask[:, -1].all()  # left padded
        assert ((batch["teacher_ids"] >= 0).all(-1) == mask).all()
        assert (batch["labels"][~mask] == -100).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_logprobs(tmp_path, dtype):
    torch.manual_seed(2)
    w = torch.randn(V + 3, 24)  # a padded teacher head: ids >= V never stored
    hidden = {"x": torch.randn(6, 24), "empty": torch.randn(0, 24)}
    targets = write(tmp_path / "t", hidden, w, logprob_dtype=dtype, vocab_size=V)
    assert (targets.vocab_size, targets.logprob_dtype) == (V, dtype)
    ids, lp = targets["x"]
    ref_ids, ref_lp = flashkd.teacher_topk(hidden["x"], w, K, temperature=TAU, vocab_size=V)
    assert torch.equal(ids, ref_ids) and ids.max() < V
    assert lp.dtype == torch.float32 and torch.equal(lp, ref_lp.to(dtype).float())
    assert [t.shape for t in targets["empty"]] == [(0, K), (0, K)]


def test_pickled_reader_reopens_shards(teacher, tmp_path):
    model, _, hidden, _ = teacher
    targets = write(tmp_path / "t", hidden, model.lm_head.weight.detach(), shard_bytes=600)
    first = targets["c4"]
    again = pickle.loads(pickle.dumps(targets))["c4"]
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert "TopKTargets(" in repr(targets) and "5 examples" in repr(targets)


def test_no_examples(tmp_path):
    targets = write_topk_targets(tmp_path / "t", [], torch.randn(V, 8), K)
    assert len(targets) == 0 and json.loads((tmp_path / "t" / "index.json").read_text())["shards"] == []


# Bad inputs: each error names the argument or field.


@pytest.fixture
def small(tmp_path):
    torch.manual_seed(3)
    w = torch.randn(V, 8)
    hidden = {"a": torch.randn(4, 8), "b": torch.randn(3, 8)}
    return tmp_path / "t", w, hidden


def test_reader_errors(small):
    path, w, hidden = small
    with pytest.raises(ValueError, match="path: expected a directory with index.json.*no such directory"):
        TopKTargets(path)
    targets = write(path, hidden, w)
    with pytest.raises(KeyError, match="key: no example 'nope'"):
        targets["nope"]
    (path / "index.json").unlink()
    with pytest.raises(ValueError, match="path: .*did not finish"):
        TopKTargets(path)


def test_writer_errors(small):
    path, w, hidden = small
    with pytest.raises(ValueError, match=r"examples: expected distinct keys, got 'a' twice"):
        write_topk_targets(path, [("a", hidden["a"]), ("b", hidden["b"]), ("a", hidden["a"])], w, K)
    write(path, hidden, w, overwrite=True)
    with pytest.raises(ValueError, match="out_dir: expected a new or empty directory.*overwrite=True"):
        write(path, hidden, w)
    assert len(write(path, hidden, w, overwrite=True)) == 2
    (path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="out_dir: overwrite=True .*'notes.txt'"):
        write(path, hidden, w, overwrite=True)
    assert (path / "notes.txt").exists() and (path / "index.json").exists()

    fresh = path.parent / "fresh"
    with pytest.raises(ValueError, match="logprob_dtype: expected"):
        write_topk_targets(fresh, [], w, K, logprob_dtype=torch.int8)
    with pytest.raises(ValueError, match="shard_bytes: expected a positive int"):
        write_topk_targets(fresh, [], w, K, shard_bytes=0)
    with pytest.raises(ValueError, match=r"k: expected an int in \[1, 97\]"):
        write_topk_targets(fresh, [], w, 0)
    assert not fresh.exists()  # argument errors come before the directory is made
    for key in ["", "a b", "x\ny", "quote'", "é", "k" * 201]:
        with pytest.raises(ValueError, match=r"examples: key at position 0: expected 1 to 200 characters"):
            write_topk_targets(fresh, [(key, hidden["a"])], w, K)
    with pytest.raises(TypeError, match=r"examples: key at position 0: expected a str, got int"):
        write_topk_targets(fresh, [(7, hidden["a"])], w, K)
    with pytest.raises(ValueError, match=r"examples: hidden_states of 'a': expected a \(length, 8\) tensor"):
        write_topk_targets(fresh, [("a", hidden["a"][None])], w, K)
    with pytest.raises(ValueError, match=r"examples: hidden_states of 'a': expected torch.float32"):
        write_topk_targets(fresh, [("a", hidden["a"].double())], w, K)
    with pytest.raises(TypeError, match=r"examples: expected \(key, hidden_states\) pairs"):
        write_topk_targets(fresh, [hidden["a"]], w, K)


def test_collator_errors(small):
    path, w, hidden = small
    targets = write(path, hidden, w)
    features = [{"key": "a", "input_ids": [1, 2, 3, 4]}, {"key": "b", "input_ids": [1, 2]}]  # b has 3 positions
    with pytest.raises(ValueError, match=r"attention_mask: example 1 \(key 'b'\) has 2 tokens .* targets have 3 positions"):
        TopKCollator(targets, pad_collate("right"))(features)
    with pytest.raises(ValueError, match=r"input_ids: example 1 \(key 'b'\) has 2 tokens"):
        TopKCollator(targets, pad_collate("left", mask=False), padding_side="left")(features)
    with pytest.raises(ValueError, match=r"features\[0\]: expected a dict with a 'id' field \(key_field"):
        TopKCollator(targets, pad_collate("right"), key_field="id")(features)
    with pytest.raises(KeyError, match=r"key: no example 'c' in targets \(features\[1\]\)"):
        TopKCollator(targets, pad_collate("right"))([features[0], {"key": "c", "input_ids": [1]}])
    with pytest.raises(ValueError, match=r"collate_fn: expected a batch with input_ids of shape \(2, T\)"):
        TopKCollator(targets, lambda f: {"ids": 0})(features)
    with pytest.raises(ValueError, match="padding_side: expected 'right' or 'left'"):
        TopKCollator(targets, padding_side="top")


def test_missing_safetensors_is_named(small, monkeypatch):
    path, w, hidden = small
    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(ImportError, match=r"safetensors package: pip install 'flashkd\[data\]'"):
        write(path, hidden, w)
