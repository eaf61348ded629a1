"""Top-k teacher targets on disk: the format, its writer and its reader + batch collator.

A teacher run once over a corpus, its top-k log-probs kept, and the student distilled from them later
(`fused_linear_distill_topk`) without the teacher in memory.

Format "flashkd.topk", version 1 — a directory:

    index.json
    shard-00000.safetensors
    shard-00001.safetensors
    ...

index.json, one JSON object:

    "format":              "flashkd.topk"
    "version":             1
    "k":                   K, slots per position
    "temperature":         τ the log-probs were taken at (distill at this τ: `fused_linear_distill_topk`)
    "vocab_size":          V; every id lies in [0, V) (the student's vocab when the teacher head is padded)
    "logprob_dtype":       "float32", "float16" or "bfloat16", the dtype of every logprobs tensor
    "teacher_description": free-form text (model name, revision, ...) or null
    "shards":              the shard file names, in order
    "examples":            {key: {"shard": i, "length": L}}, i an index into "shards", L positions

Each shard is a safetensors file (metadata {"format": "flashkd.topk", "version": "1"}) holding, for
each example stored in it,

    <key>.ids        (L, K) int32           vocab ids; -1 marks an unused slot
    <key>.logprobs   (L, K) logprob_dtype   log p at those ids, log p = logit/τ − logsumexp(logits/τ)
                                            over the whole vocab (−inf at unused slots)

The writer here fills all K slots of every row, sorted by decreasing log-prob; -1 slots exist for
targets that come from elsewhere (a served teacher that returned fewer than K). index.json is written
last, so a directory without it is a write that did not finish.

Keys: strings of 1 to 200 characters from A-Z a-z 0-9 _ - . : / — the key prefixes its tensor names
and appears in JSON, file listings and error messages, so whitespace, quotes and control characters
are kept out.

Alignment: row t of an example is the teacher's distribution at position t, over the token at t + 1,
computed from the teacher's hidden state at t; it lines up with the student's hidden state h at t.
With causal-LM labels as HF collators make them (labels[t] = input_ids[t], the model shifts them),
shift the labels, not the targets: row t is trained against labels[t + 1]. Rows at padding must be
dropped too — with left padding the pad just before the first token would get that token's label —
and a collated batch marks them by -1 ids:

    labels = batch["labels"][:, 1:].masked_fill(batch["teacher_ids"][:, :-1, 0] < 0, -100)
    fused_linear_distill_topk(h[:, :-1], W, batch["teacher_ids"][:, :-1], batch["teacher_logprobs"][:, :-1], labels)

A sequence's last row (the distribution after its last token) is stored but has no label. Pass
labels: with labels=None every row, padding included, counts in the mean.

Precision of the log-prob dtypes. Rounding log p to a float with m mantissa bits moves it by at most
|log p|·2^-(m+1), so p moves by that much relatively: float16 (m = 10) at most |log p|/2048, i.e.
0.05 % at p = 0.37 and 0.34 % at p = 0.001; bfloat16 (m = 7) at most |log p|/256, i.e. 0.4 % at
p = 0.37 and 2.7 % at p = 0.001. The rest mass 1 − Σ p (tail="bucket") inherits the sum of those
errors: measured with K = 32 on 4096 rows of 32000 ids with N(0, 8²) logits, up to 4e-4 in float16
and 4e-3 in bfloat16. Where the true rest is smaller than that (a confident teacher) it becomes noise, and can round
to 0, which makes reverse_kl with tail="bucket" infinite. float16 costs the same disk as bfloat16 and
is 8× finer here (log-probs need no range beyond float16's); disk per position is K·8 bytes in float32,
K·6 in float16 or bfloat16.
"""

from __future__ import annotations

import collections.abc
import json
import os
import re
from pathlib import Path

import torch

from .teacher import teacher_topk

FORMAT = "flashkd.topk"
VERSION = 1
_INDEX = "index.json"
_SHARD = re.compile(r"shard-\d{5}\.safetensors")
_KEY = re.compile(r"[A-Za-z0-9_.:/-]{1,200}")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def write_topk_targets(
    out_dir: str | os.PathLike,
    examples,  # iterable of (key, hidden_states (L, H))
    teacher_weight: torch.Tensor,  # (Vt, H)
    k: int,
    *,
    temperature: float = 1.0,
    teacher_bias: torch.Tensor | None = None,  # (Vt,)
    vocab_size: int | None = None,
    logprob_dtype: torch.dtype = torch.float32,
    shard_bytes: int = 1 << 30,
    chunk_size: int | None = None,
    backend: str = "auto",
    teacher_description: str | None = None,
    overwrite: bool = False,
) -> "TopKTargets":
    """Write a teacher's top-k targets for `examples` into `out_dir` (format: this module's docstring).

    examples: (key, hidden_states) pairs, hidden_states (L, H) the teacher's last hidden states of one
    sequence — what its LM head sees, i.e. after the final norm. In HF transformers that is
    `model(input_ids, output_hidden_states=True).hidden_states[-1]` (checked for Llama in transformers
    4.56 to 5.24: the last element is `last_hidden_state`, the final RMSNorm's output, and `lm_head` of
    it gives `.logits`; tests/test_data.py holds it).
    A generator keeps one sequence in memory at a time:

        def examples():
            for key, input_ids in corpus:                       # input_ids (1, L), no padding
                with torch.no_grad():
                    out = teacher(input_ids, output_hidden_states=True)
                yield key, out.hidden_states[-1][0]

    Each sequence goes through `flashkd.teacher_topk(hidden_states, teacher_weight, k, temperature=...,
    teacher_bias=..., vocab_size=..., chunk_size=..., backend=...)` (one chunk of logits at a time);
    its ids are stored as int32 and its log-probs in `logprob_dtype` (float32, float16 or bfloat16;
    see the precision note in the module docstring). Targets wait on the CPU until they reach
    `shard_bytes` (ids + log-probs), then go to the next shard file: the writer never holds more than
    one shard's worth, or one sequence's if that is bigger (such a sequence gets a shard of its own).

    out_dir must be new or empty; overwrite=True replaces targets written there before (only a
    directory that holds nothing but index.json and shards). Returns a `TopKTargets` over out_dir.
    """
    st = _safetensors()
    if not isinstance(teacher_weight, torch.Tensor) or teacher_weight.dim() != 2:
        got = tuple(teacher_weight.shape) if isinstance(teacher_weight, torch.Tensor) else type(teacher_weight).__name__
        raise ValueError(f"teacher_weight: expected a 2-D (vocab, hidden) tensor, got {got}")
    # Every option checked by teacher_topk itself, on no rows, before a file is touched.
    teacher_topk(
        teacher_weight.new_zeros(0, teacher_weight.shape[1]), teacher_weight, k, temperature=temperature,
        teacher_bias=teacher_bias, vocab_size=vocab_size, chunk_size=chunk_size, backend=backend,
    )
    names = {v: n for n, v in _DTYPES.items()}
    if logprob_dtype not in names:
        raise ValueError(f"logprob_dtype: expected torch.float32, torch.float16 or torch.bfloat16, got {logprob_dtype!r}")
    if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes < 1:
        raise ValueError(f"shard_bytes: expected a positive int, got {shard_bytes!r}")
    if teacher_description is not None and not isinstance(teacher_description, str):
        raise TypeError(
            f"teacher_description: expected a str (e.g. the teacher's name and revision) or None, "
            f"got {type(teacher_description).__name__}"
        )
    out = Path(out_dir)
    _prepare_dir(out, overwrite)

    index = {
        "format": FORMAT,
        "version": VERSION,
        "k": k,
        "temperature": float(temperature),
        "vocab_size": vocab_size or teacher_weight.shape[0],
        "logprob_dtype": names[logprob_dtype],
        "teacher_description": teacher_description,
        "shards": [],
        "examples": {},
    }
    pending, pending_bytes = {}, 0

    def flush():
        name = f"shard-{len(index['shards']):05d}.safetensors"
        st.torch.save_file(pending, out / (name + ".tmp"), metadata={"format": FORMAT, "version": str(VERSION)})
        os.replace(out / (name + ".tmp"), out / name)
        index["shards"].append(name)
        pending.clear()

    h = teacher_weight.shape[1]
    for i, item in enumerate(examples):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise TypeError(f"examples: expected (key, hidden_states) pairs, got {type(item).__name__} at position {i}")
        key, x = item
        _check_key(key, f"examples: key at position {i}")
        if key in index["examples"]:
            raise ValueError(f"examples: expected distinct keys, got {key!r} twice (again at position {i})")
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != h:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"examples: hidden_states of {key!r}: expected a (length, {h}) tensor (one sequence, no batch "
                f"dim; teacher_weight is {tuple(teacher_weight.shape)}), got {got}"
            )
        if x.dtype != teacher_weight.dtype or x.device != teacher_weight.device:
            raise ValueError(
                f"examples: hidden_states of {key!r}: expected {teacher_weight.dtype} on {teacher_weight.device} "
                f"(those of teacher_weight), got {x.dtype} on {x.device}"
            )
        ids, lp = teacher_topk(
            x, teacher_weight, k, temperature=temperature, teacher_bias=teacher_bias,
            vocab_size=vocab_size, chunk_size=chunk_size, backend=backend,
        )
        ids, lp = ids.to(torch.int32).cpu(), lp.to(logprob_dtype).cpu()
        nbytes = ids.nbytes + lp.nbytes
        if pending and pending_bytes + nbytes > shard_bytes:
            flush()
            pending_bytes = 0
        pending[f"{key}.ids"], pending[f"{key}.logprobs"] = ids, lp
        pending_bytes += nbytes
        index["examples"][key] = {"shard": len(index["shards"]), "length": x.shape[0]}
    if pending:
        flush()
    tmp = out / (_INDEX + ".tmp")
    tmp.write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, out / _INDEX)
    return TopKTargets(out)


class TopKTargets(collections.abc.Mapping):
    """Read-only mapping over a target directory: key -> (ids (L, K) int64, logprobs (L, K) float32).

    Reads and checks index.json only; a shard is opened (memory-mapped by safetensors) the first time
    one of its examples is read, and an example is read in full when indexed. Attributes from the
    index: path, k, temperature, vocab_size, logprob_dtype (a torch.dtype), teacher_description.
    Picklable (for DataLoader workers): open shards are not carried along but reopened.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        index = _read_index(self.path)
        self.k = index["k"]
        self.temperature = index["temperature"]
        self.vocab_size = index["vocab_size"]
        self.logprob_dtype = _DTYPES[index["logprob_dtype"]]
        self.teacher_description = index["teacher_description"]
        self._shards = index["shards"]
        self._examples = index["examples"]
        self._open = {}

    def __len__(self):
        return len(self._examples)

    def __iter__(self):
        return iter(self._examples)

    def __contains__(self, key):
        return key in self._examples

    def length(self, key: str) -> int:
        """Positions of example `key`, from the index (no shard is read)."""
        return self._entry(key)["length"]

    def __getitem__(self, key: str):
        entry = self._entry(key)
        i = entry["shard"]
        if i not in self._open:
            self._open[i] = _safetensors().safe_open(self.path / self._shards[i], framework="pt")
        f = self._open[i]
        try:
            ids, lp = f.get_tensor(f"{key}.ids"), f.get_tensor(f"{key}.logprobs")
        except _safetensors().SafetensorError as e:
            raise ValueError(f"{self._shards[i]}: expected tensors {key}.ids and {key}.logprobs (index.json lists them), {e}") from None
        want = (entry["length"], self.k)
        if tuple(ids.shape) != want or tuple(lp.shape) != want or ids.dtype != torch.int32 or lp.dtype != self.logprob_dtype:
            raise ValueError(
                f"{self._shards[i]}: {key}: expected ids {want} int32 and logprobs {want} {self.logprob_dtype} "
                f"(from index.json), got {tuple(ids.shape)} {ids.dtype} and {tuple(lp.shape)} {lp.dtype}"
            )
        return ids.long(), lp.float()

    def _entry(self, key):
        entry = self._examples.get(key) if isinstance(key, str) else None
        if entry is None:
            raise KeyError(f"key: no example {key!r} in {self.path}")
        return entry

    def __getstate__(self):
        return {**self.__dict__, "_open": {}}

    def __repr__(self):
        return (
            f"TopKTargets({str(self.path)!r}: {len(self)} examples, k={self.k}, temperature={self.temperature}, "
            f"vocab_size={self.vocab_size}, logprob_dtype={str(self.logprob_dtype).removeprefix('torch.')})"
        )


class TopKCollator:
    """A DataLoader collate_fn: `collate_fn`'s batch plus the teacher's targets, padded like it.

    targets: a `TopKTargets`, or any mapping key -> (ids (L, K), logprobs (L, K)).
    collate_fn: the batch maker this wraps (e.g. an HF `DataCollatorForLanguageModeling`); it must
    return a dict-like batch with `input_ids` (B, T). Default: torch's default_collate, for features
    that are already tensors of one length.

    Each feature carries its example's key in `key_field`; that field is removed before `collate_fn`
    sees the features (HF collators cannot pad strings). The batch gains

        teacher_ids       (B, T, K) int64, -1 (unused slot) at padded positions
        teacher_logprobs  (B, T, K) float32, −inf (probability 0) at padded positions

    An example's L target rows go to the positions where the batch's `attention_mask` is 1 (right or
    left padding alike), and their count must equal L. Without an attention_mask, an example's length
    is that of its `input_ids` feature (unpadded) and `padding_side` says where the padding is.
    A length that differs from L raises: targets are per position, so a truncated or differently
    tokenized sequence would be silently misaligned. (HF Trainer drops dataset columns that its model's
    forward does not take: keep the key with `remove_unused_columns=False`.)
    """

    def __init__(self, targets, collate_fn=None, *, key_field: str = "key", padding_side: str = "right"):
        if not isinstance(targets, collections.abc.Mapping):
            raise TypeError(f"targets: expected a TopKTargets or a mapping key -> (ids, logprobs), got {type(targets).__name__}")
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn: expected a callable (features -> batch) or None, got {type(collate_fn).__name__}")
        if padding_side not in ("right", "left"):
            raise ValueError(f"padding_side: expected 'right' or 'left', got {padding_side!r}")
        self.targets = targets
        self.collate_fn = collate_fn or torch.utils.data.default_collate
        self.key_field = key_field
        self.padding_side = padding_side

    def __call__(self, features):
        keys, stripped = [], []
        for i, f in enumerate(features):
            if not isinstance(f, collections.abc.Mapping) or self.key_field not in f:
                got = sorted(f) if isinstance(f, collections.abc.Mapping) else type(f).__name__
                raise ValueError(
                    f"features[{i}]: expected a dict with a {self.key_field!r} field (key_field, the example's "
                    f"key in targets), got {got}"
                )
            keys.append(f[self.key_field])
            stripped.append({n: v for n, v in f.items() if n != self.key_field})
        batch = self.collate_fn(stripped)
        input_ids = batch["input_ids"] if isinstance(batch, collections.abc.Mapping) and "input_ids" in batch else None
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != len(keys):
            got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"collate_fn: expected a batch with input_ids of shape ({len(keys)}, T), got {got}")
        mask = batch.get("attention_mask")
        b, t = input_ids.shape
        k = None
        for i, key in enumerate(keys):
            if key not in self.targets:
                raise KeyError(f"{self.key_field}: no example {key!r} in targets (features[{i}])")
            ids, lp = self.targets[key]
            if k is None:
                k = ids.shape[-1]
                teacher_ids = torch.full((b, t, k), -1, dtype=torch.int64)
                teacher_lp = torch.full((b, t, k), -torch.inf, dtype=torch.float32)
            if ids.dim() != 2 or ids.shape[1] != k or lp.shape != ids.shape:
                raise ValueError(
                    f"targets[{key!r}]: expected ids and logprobs of shape (length, {k}), "
                    f"got {tuple(ids.shape)} and {tuple(lp.shape)}"
                )
            n = ids.shape[0]
            if mask is not None:
                where, field = mask[i].bool(), "attention_mask"
                count = int(where.sum())
            else:
                count, field = len(features[i]["input_ids"]), "input_ids"
                where = slice(0, count) if self.padding_side == "right" else slice(t - count, t)
            if count != n or n > t:
                raise ValueError(
                    f"{field}: example {i} ({self.key_field} {key!r}) has {count} tokens in a batch of length {t}, "
                    f"but its teacher targets have {n} positions"
                )
            teacher_ids[i, where] = ids.to(torch.int64)
            teacher_lp[i, where] = lp.to(torch.float32)
        if k is not None:
            batch["teacher_ids"], batch["teacher_logprobs"] = teacher_ids, teacher_lp
        return batch


def _safetensors():
    """The safetensors package, imported on first use: flashkd itself does not need it."""
    try:
        import safetensors
        import safetensors.torch
    except ImportError:
        raise ImportError(
            "flashkd.data needs the safetensors package: pip install 'flashkd[data]' (or pip install safetensors)"
        ) from None
    return safetensors


def _check_key(key, what):
    if not isinstance(key, str):
        raise TypeError(f"{what}: expected a str, got {type(key).__name__} {key!r} (use str(key) for a number)")
    if not _KEY.fullmatch(key):
        raise ValueError(f"{what}: expected 1 to 200 characters from A-Z a-z 0-9 _ - . : /, got {key!r}")


def _prepare_dir(out: Path, overwrite: bool):
    """Make `out` an empty directory: refuse one holding anything unless overwrite, and even then
    anything but targets (so a mistyped path cannot erase unrelated files)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir: expected a directory, got the file {out}")
    entries = sorted(p.name for p in out.iterdir()) if out.exists() else []
    if entries and not overwrite:
        raise ValueError(
            f"out_dir: expected a new or empty directory, got {out} holding {len(entries)} entries "
            f"({entries[0]!r}, ...); pass overwrite=True to replace targets written there"
        )
    others = [e for e in entries if e not in (_INDEX, _INDEX + ".tmp") and not _SHARD.fullmatch(e.removesuffix(".tmp"))]
    if others:
        raise ValueError(
            f"out_dir: overwrite=True replaces a directory of targets, but {out} also holds {others[0]!r}; "
            "remove it or pick another directory"
        )
    # index.json first: an interrupted clean-up must not leave an index pointing at missing shards
    for name in sorted(entries, key=lambda e: e != _INDEX):
        (out / name).unlink()
    out.mkdir(parents=True, exist_ok=True)


def _read_index(path: Path) -> dict:
    file = path / _INDEX
    if not file.is_file():
        why = "no such directory" if not path.exists() else "not a directory of top-k targets, or a write that did not finish"
        raise ValueError(f"path: expected a directory with {_INDEX}, got {path} ({why})")
    try:
        index = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: expected JSON, got a parse error: {e}") from None

    def bad(field, expected):
        got = index.get(field, "nothing") if isinstance(index, dict) else type(index).__name__
        return ValueError(f"{file}: {field}: expected {expected}, got {got!r}")

    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise bad("format", repr(FORMAT))
    if index.get("version") != VERSION:
        raise bad("version", f"{VERSION} (the version this flashkd reads; a newer flashkd may read others)")
    for field, ok, expected in (
        ("k", lambda v: _is_int(v) and v >= 1, "an int >= 1"),
        ("temperature", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0, "a number > 0"),
        ("vocab_size", lambda v: _is_int(v) and v >= 1, "an int >= 1"),
        ("logprob_dtype", lambda v: v in _DTYPES, "one of " + ", ".join(map(repr, _DTYPES))),
        ("teacher_description", lambda v: v is None or isinstance(v, str), "a string or null"),
        ("shards", lambda v: isinstance(v, list) and all(isinstance(s, str) and _SHARD.fullmatch(s) for s in v),
         "a list of shard file names shard-NNNNN.safetensors"),
        ("examples", lambda v: isinstance(v, dict), "an object key -> {shard, length}"),
    ):
        if field not in index or not ok(index[field]):
            raise bad(field, expected)
    n = len(index["shards"])
    for key, e in index["examples"].items():
        if not (isinstance(e, dict) and _is_int(e.get("shard")) and 0 <= e["shard"] < n
                and _is_int(e.get("length")) and e["length"] >= 0):
            raise ValueError(f"{file}: examples: {key!r}: expected {{\"shard\": 0..{n - 1}, \"length\": an int >= 0}}, got {e!r}")
    for s in index["shards"]:
        if not (path / s).is_file():
            raise ValueError(f"{file}: shards: expected the file {path / s} (listed in the index), got no such file")
    return index


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)
