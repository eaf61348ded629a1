"""Top-k teacher targets on disk: the format, its writer and its reader + batch collator.

A teacher run once over a corpus, its top-k log-probs kept, and the student distilled from them later
(`fused_linear_distill_topk`) without the teacher in memory.

Format "flashkd.topk", version 2 — a directory:

    index.json
    shard-00000.safetensors
    shard-00001.safetensors
    ...

index.json, one JSON object with exactly these fields:

    "format":              "flashkd.topk"
    "version":             2
    "k":                   K, slots per position, an int in [1, vocab_size]
    "temperature":         τ the log-probs were taken at, a finite number > 0 (distill at this τ)
    "vocab_size":          V, an int in [1, 2^31); every id lies in [0, V) (the student's vocab when
                           the teacher head is padded)
    "logprob_dtype":       "float32", "float16" or "bfloat16", the dtype of every logprobs tensor
    "teacher_description": free-form text (model name, revision, ...) or null
    "shards":              [{"file": "shard-NNNNN.safetensors", "bytes": size, "sha256": hex digest
                           of the file}, ...], shard i named shard-{i:05d}.safetensors (ASCII digits)
    "examples":            {key: {"shard": i, "length": L}}, i an index into "shards", L positions
                           (an int in [0, 2^31)); the order is the order they were written in
    "sha256":              hex SHA-256 of index.json's bytes with the 64 digits of this value
                           replaced by 64 "0"s (so every byte of the file is covered)

No NaN or Infinity, no duplicate keys in any object, no other fields. Version 1 (shards listed by
name, no digests) is refused: its targets must be written again.

Each shard is a regular file (not a symbolic link) in the directory, a safetensors file with metadata
{"format": "flashkd.topk/2"} (one key: safetensors writes several in a random order, and a write's
bytes are meant to be reproducible) holding, for each example the index places in it, and nothing else,

    <key>.ids        (L, K) int32           vocab ids in [0, V), distinct in a row; -1 marks an unused slot
    <key>.logprobs   (L, K) logprob_dtype   log p at those ids, log p = logit/τ − logsumexp(logits/τ)
                                            over the whole vocab: <= 0, never NaN, −inf at unused slots;
                                            a row's probabilities sum to at most 1 (up to the rounding of
                                            logprob_dtype: K^u − 1 + u + 1e-5, u = 2^-24, 2^-11, 2^-8)

The writer here fills all K slots of every row, sorted by decreasing log-prob; -1 slots exist for
targets that come from elsewhere (a served teacher that returned fewer than K).

Keys: strings of 1 to 200 characters from A-Z a-z 0-9 _ - . : / — the key prefixes its tensor names
and appears in JSON, file listings and error messages, so whitespace, quotes and control characters
are kept out.

Integrity. `TopKTargets` checks index.json in full when it opens a directory (its digest, every field,
that each shard is a regular file of the listed size), a shard's SHA-256 and its safetensors header
(exactly the tensors, shapes and dtypes the index lists) the first time the shard is opened, and
each example's ids and log-probs (the ranges, distinct ids and sums above) when it is read. A
failure raises `TargetsError` (a ValueError) naming the file and the field or key; no other error
comes out of a damaged directory. The digest costs one extra read of each shard per process that opens it (SHA-256 runs at
roughly 0.5-2 GB/s on one core, by CPU; DataLoader workers each check the shards they open, again
every epoch unless persistent_workers=True); `check_digests=False` skips it where `verify()` (every
shard and every example, one read of the whole directory) has been run once and the files are trusted
from then on. A shard is checked through the descriptor that reads it, and refused if another file
is at its path once safetensors has opened it; a directory replaced (overwrite=True by another
process) after a reader read its index is refused at the next shard it opens (shards opened before
keep serving the old targets whole). A shard changed in place after it was checked and memory-mapped
is not noticed (flashkd's writer never changes a file in place).

Writing is safe against concurrent writers, crashes and failed overwrites. For out_dir ".../NAME"
the writer uses three siblings of it:

    .NAME.flashkd-lock       a lock file, held with flock(LOCK_EX) for the whole write, so a second
                             writer of the same out_dir is refused at once; it is removed when the
                             write ends (a killed writer's lock file is released by the kernel and
                             taken over). A regular file flashkd did not make found there is used as
                             the lock and kept; anything else there (a directory, a FIFO, a link) is
                             a ValueError naming it. flock (POSIX; the writer needs fcntl) is advisory: it
                             keeps out other writers, on one machine; on NFS, Linux maps it to NFS
                             byte-range locks, which hold across clients only where the server
                             supports locking (not with the "nolock" mount option); some network
                             and FUSE file systems ignore it.
    .NAME.flashkd-partial    the directory the targets are built in: each shard written as .tmp,
                             fsynced and renamed, then a line appended to progress.jsonl (the
                             shard's file, size, digest and examples, in order); index.json last
                             (.tmp, fsync, rename); then progress.jsonl removed and the directory
                             renamed to out_dir.
    .NAME.flashkd-old        with overwrite=True, the old targets between the two renames that swap
                             the new ones in; removed right after.

(An empty out_dir is replaced by the new directory: its permissions are not carried over.)

So out_dir only ever holds nothing, the old targets or the complete new ones: a write that is killed
or fails (the examples raise, the disk fills) leaves out_dir as it was, and TopKTargets refuses a
directory without index.json as unfinished, naming the partial directory where there is one. A crash
between the two renames of an overwrite (two system calls) leaves out_dir absent, the old targets in
.NAME.flashkd-old and the new ones complete in .NAME.flashkd-partial, which resume=True swaps in.
`write_topk_targets(..., resume=True)` continues a write from the shards it finished: it checks their
digests, iterates the examples again, checks that the first ones are the finished keys in their order,
skips them (a zero-argument callable in place of the hidden states is then not called: no teacher
forward) and writes the rest as the interrupted write would have; the result is byte for byte that of
an uninterrupted write with the same examples and options (the options must match: k, temperature,
vocab_size, logprob_dtype, teacher_description, shard_bytes, chunk_size, backend and the teacher
weight's hidden size and dtype; a mismatch is refused). Examples held in memory for the shard
being filled are computed again. A write refuses to start over an unfinished one unless resume=True;
a partial directory with no finished shard is simply removed.

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
import hashlib
import json
import math
import os
import re
import shutil
import stat
from pathlib import Path

import torch

from . import files
from .core.checks import renamed
from .losses import is_finite
from .distill import teacher_topk

FORMAT = "flashkd.topk"
VERSION = 2
_INDEX = "index.json"
_PROGRESS = "progress.jsonl"
_FIELDS = ("format", "version", "k", "temperature", "vocab_size", "logprob_dtype", "teacher_description",
           "shards", "examples", "sha256")
_OPTIONS = _FIELDS[2:7]  # the fields a resumed write must be given alike
_SHARD = re.compile(r"shard-[0-9]{5,}\.safetensors")  # [0-9], not \d: \d also matches '٠' and the like
_KEY = re.compile(r"[A-Za-z0-9_.:/-]{1,200}")
_HEX = re.compile(r"[0-9a-f]{64}")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_NAMES = {v: n for n, v in _DTYPES.items()}
_HEADER_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}  # safetensors' names
_MAX_INT = 2**31  # vocab ids are int32; lengths are bounded alike


class TargetsError(ValueError):
    """A target directory that cannot be read as format flashkd.topk: unfinished, damaged, or not
    written in it. The message names the file and the field or example key."""


def write_topk_targets(
    out_dir: str | os.PathLike,
    examples,  # iterable of (key, hidden_states (L, H) or a callable returning them)
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
    resume: bool = False,
) -> "TopKTargets":
    """Write a teacher's top-k targets for `examples` into `out_dir` (format: this module's docstring).

    examples: (key, hidden_states) pairs, hidden_states (L, H) the teacher's last hidden states of one
    sequence — what its LM head sees, i.e. after the final norm. In HF transformers that is
    `model(input_ids, output_hidden_states=True).hidden_states[-1]` (checked for Llama in transformers
    4.56 to 5.24: the last element is `last_hidden_state`, the final RMSNorm's output, and `lm_head` of
    it gives `.logits`; tests/test_data.py holds it). In place of the tensor, a zero-argument callable
    that returns it: it is called before the next pair is drawn, and not at all for an example that
    resume=True skips. A generator keeps one sequence in memory at a time:

        def examples():
            for key, input_ids in corpus:                       # input_ids (1, L), no padding
                def hidden(input_ids=input_ids):
                    with torch.no_grad():
                        return teacher(input_ids, output_hidden_states=True).hidden_states[-1][0]
                yield key, hidden

    Each sequence goes through `flashkd.teacher_topk(hidden_states, teacher_weight, k, temperature=...,
    teacher_bias=..., vocab_size=..., chunk_size=..., backend=...)` (one chunk of logits at a time);
    its ids are stored as int32 and its log-probs in `logprob_dtype` (float32, float16 or bfloat16;
    see the precision note in the module docstring). Targets wait on the CPU until they reach
    `shard_bytes` (ids + log-probs), then go to the next shard file: the writer never holds more than
    one shard's worth, or one sequence's if that is bigger (such a sequence gets a shard of its own).

    out_dir must be new or an empty directory; overwrite=True replaces targets written there before
    (only a directory that holds nothing but index.json and shard files), and only once the new ones
    are complete. resume=True continues a write into out_dir that was interrupted (killed, or failed
    with an exception) from its finished shards, given the same examples in the same order and the
    same options; the result is that of an uninterrupted write. The targets are built beside out_dir
    and renamed into place (the module docstring says how, and what a crash leaves). Returns a
    `TopKTargets` over out_dir.
    """
    _safetensors()  # a missing package is said before any work
    if not isinstance(teacher_weight, torch.Tensor) or teacher_weight.dim() != 2:
        got = tuple(teacher_weight.shape) if isinstance(teacher_weight, torch.Tensor) else type(teacher_weight).__name__
        raise ValueError(f"teacher_weight: expected a 2-D (vocab, hidden) tensor, got {got}")

    def topk(x):  # one sequence's (ids, log-probs), with every option of this write
        return teacher_topk(x, teacher_weight, k, temperature=temperature, teacher_bias=teacher_bias,
                            vocab_size=vocab_size, chunk_size=chunk_size, backend=backend)

    # Every option checked by teacher_topk itself, on no rows, before a file is touched.
    topk(teacher_weight.new_zeros(0, teacher_weight.shape[1]))
    _check_write_options(temperature, logprob_dtype, shard_bytes, teacher_description, overwrite, resume)
    out = _path("out_dir", out_dir).resolve()  # siblings of the real directory, whatever path leads to it
    if isinstance(examples, (str, bytes, torch.Tensor)) or not isinstance(examples, collections.abc.Iterable):
        raise TypeError(f"examples: expected an iterable of (key, hidden_states) pairs, got {type(examples).__name__}")
    index = _new_index(k, temperature, vocab_size or teacher_weight.shape[0], logprob_dtype, teacher_description)
    # What else decides the bytes written: a resumed write must be given the same.
    writer = {"shard_bytes": shard_bytes, "chunk_size": chunk_size, "backend": backend,
              "hidden_size": teacher_weight.shape[1], "teacher_dtype": str(teacher_weight.dtype).removeprefix("torch.")}

    def targets(key, x):  # one example's (ids, log-probs) as they are stored
        return _targets(key, x, teacher_weight, topk, logprob_dtype, index["vocab_size"])

    _build(out, index, writer, examples, targets, shard_bytes, overwrite, resume)
    return TopKTargets(out)


def _build(out: Path, index: dict, writer: dict, examples, targets, shard_bytes: int, overwrite: bool, resume: bool):
    """Build the targets beside out_dir under its lock, then swap them in (the module docstring says how)."""
    partial = _sibling(out, "partial")
    _sibling(out, "old")  # checked now, not after the work
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = _sibling(out, "lock")
    with files.exclusive(lock, f"out_dir: another write into {out} is running (it holds {lock}); wait for it to end "
                               "or write elsewhere", what="out_dir"):
        _check_out(out, overwrite)
        finished = _start(partial, index, writer, resume)
        try:
            _write_examples(examples, _Shards(partial, index, shard_bytes), list(index["examples"]), finished, targets)
        except BaseException:
            if not index["shards"]:  # nothing finished, nothing to resume from
                shutil.rmtree(partial, ignore_errors=True)
            raise
        _write_atomic(partial / _INDEX, _index_bytes(index))
        (partial / _PROGRESS).unlink(missing_ok=True)
        files.fsync(partial)
        _swap(partial, out, overwrite)


def _check_write_options(temperature, logprob_dtype, shard_bytes, teacher_description, overwrite, resume):
    """The options of `write_topk_targets` that teacher_topk does not check, or checks less strictly."""
    if not math.isfinite(temperature):  # index.json holds no Infinity
        raise ValueError(f"temperature: expected a finite float > 0, got {temperature!r}")
    if logprob_dtype not in _NAMES:
        raise ValueError(f"logprob_dtype: expected torch.float32, torch.float16 or torch.bfloat16, got {logprob_dtype!r}")
    if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes < 1:
        raise ValueError(f"shard_bytes: expected a positive int, got {shard_bytes!r}")
    if teacher_description is not None and not isinstance(teacher_description, str):
        raise TypeError(
            f"teacher_description: expected a str (e.g. the teacher's name and revision) or None, "
            f"got {type(teacher_description).__name__}"
        )
    for name, flag in (("overwrite", overwrite), ("resume", resume)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")


def _new_index(k, temperature, vocab_size, logprob_dtype, teacher_description) -> dict:
    """index.json of a write that has no shard yet (in the order of `_FIELDS`, its digest added last)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "k": k,
        "temperature": float(temperature),
        "vocab_size": vocab_size,
        "logprob_dtype": _NAMES[logprob_dtype],
        "teacher_description": teacher_description,
        "shards": [],
        "examples": {},
    }


def _write_examples(examples, shards: "_Shards", done: list, finished: bool, targets):
    """Draw the (key, hidden_states) pairs and add each one's `targets(key, hidden_states)` to `shards`.
    With resume=True, `done` holds the keys of the interrupted write's finished shards, in order
    (`finished`: its index.json was written too): the first pairs must carry them, and are skipped."""
    n = 0
    for n, item in enumerate(examples, 1):
        i = n - 1
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise TypeError(f"examples: expected (key, hidden_states) pairs, got {type(item).__name__} at position {i}")
        key, x = item
        _check_key(key, f"examples: key at position {i}")
        if i < len(done):
            if key != done[i]:
                raise ValueError(
                    f"examples: resume=True expects the examples of the interrupted write, in its order: "
                    f"position {i} was {done[i]!r} there, got {key!r}"
                )
            continue  # a callable in place of its hidden states is not called: no teacher forward
        if finished:
            raise ValueError(
                f"examples: resume=True expects the examples of the interrupted write, which had finished "
                f"after {len(done)}; got more ({key!r} at position {i})"
            )
        if key in shards.index["examples"]:
            raise ValueError(f"examples: expected distinct keys, got {key!r} twice (again at position {i})")
        shards.add(key, *targets(key, x))
    if n < len(done):
        raise ValueError(
            f"examples: resume=True expects the examples of the interrupted write: it had finished "
            f"{len(done)}, examples gave {n}"
        )
    shards.flush()


def _targets(key, x, teacher_weight, topk, logprob_dtype, vocab_size):
    """One example's targets as they are stored, ids int32 and log-probs in logprob_dtype on the CPU, from
    its hidden states `x` (or the callable that returns them); what the reader would refuse is refused."""
    if callable(x):
        x = x()
    h = teacher_weight.shape[1]
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
    try:
        ids, lp = topk(x)
    except ValueError as e:  # its teacher_input is this example's hidden states (a NaN row)
        raise renamed(e, {"teacher_input": f"examples: hidden_states of {key!r}"}) from None
    ids, lp = ids.to(torch.int32).cpu(), lp.to(logprob_dtype).cpu()
    why = _rows_problem(ids, lp, vocab_size)
    if why:
        raise ValueError(f"examples: hidden_states of {key!r}: its targets break the format ({why}); "
                         "are the hidden states finite?")
    return ids, lp


class _Shards:
    """The shards of a write, built in `partial`: examples' targets wait on the CPU until the next one
    would take them past shard_bytes, then go out as one shard (.tmp, fsync, rename) and a line of
    progress.jsonl; `index` gains each shard's entry and each example's."""

    def __init__(self, partial: Path, index: dict, shard_bytes: int):
        self.partial, self.index, self.shard_bytes = partial, index, shard_bytes
        self.pending, self.keys, self.bytes = {}, [], 0

    def add(self, key: str, ids: torch.Tensor, lp: torch.Tensor):
        nbytes = ids.nbytes + lp.nbytes
        if self.pending and self.bytes + nbytes > self.shard_bytes:  # a bigger sequence gets a shard of its own
            self.flush()
        self.pending[f"{key}.ids"], self.pending[f"{key}.logprobs"] = ids, lp
        self.keys.append(key)
        self.bytes += nbytes
        self.index["examples"][key] = {"shard": len(self.index["shards"]), "length": ids.shape[0]}

    def flush(self):
        if not self.pending:
            return
        name = f"shard-{len(self.index['shards']):05d}.safetensors"
        tmp = self.partial / (name + ".tmp")
        _safetensors().torch.save_file(self.pending, tmp, metadata={"format": f"{FORMAT}/{VERSION}"})
        os.chmod(tmp, _file_mode())  # safetensors makes it 0600: readable as index.json is, by the umask
        files.fsync(tmp)
        entry = {"file": name, "bytes": tmp.stat().st_size, "sha256": _file_sha256(tmp)}
        os.replace(tmp, self.partial / name)
        line = {**entry, "examples": [[key, self.index["examples"][key]["length"]] for key in self.keys]}
        with open(self.partial / _PROGRESS, "ab") as f:  # one write of one line: a crash tears the last line at most
            f.write(json.dumps(line, separators=(",", ":")).encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())
        self.index["shards"].append(entry)
        self.pending.clear()
        self.keys.clear()
        self.bytes = 0


class TopKTargets(collections.abc.Mapping):
    """Read-only mapping over a target directory: key -> (ids (L, K) int64, logprobs (L, K) float32).

    Reads and checks index.json only (in full: digest, fields, each shard a regular file of its listed
    size); a shard is opened (memory-mapped by safetensors) the first time one of its examples is read,
    after its SHA-256 (check_digests=False skips that) and its header are checked, and an example is
    read in full and its values checked when indexed. Any failure raises `TargetsError`. `verify()`
    checks everything at once. Attributes from the index: path, k, temperature, vocab_size,
    logprob_dtype (a torch.dtype), teacher_description. Picklable (for DataLoader workers): open
    shards are not carried along but reopened, and checked again, in each process.
    """

    def __init__(self, path: str | os.PathLike, *, check_digests: bool = True):
        if not isinstance(check_digests, bool):
            raise TypeError(f"check_digests: expected a bool, got {type(check_digests).__name__}")
        self.path = _path("path", path)
        index, self._index_id = _read_index(self.path)
        self.k = index["k"]
        self.temperature = index["temperature"]
        self.vocab_size = index["vocab_size"]
        self.logprob_dtype = _DTYPES[index["logprob_dtype"]]
        self.teacher_description = index["teacher_description"]
        self.check_digests = check_digests
        self._dtype_name = index["logprob_dtype"]
        self._shards = index["shards"]
        self._examples = index["examples"]
        self._keys = [[] for _ in self._shards]  # the keys of each shard, to check its header against
        for key, e in self._examples.items():
            self._keys[e["shard"]].append(key)
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
        f = self._shard(entry["shard"], self.check_digests)
        file = self.path / self._shards[entry["shard"]]["file"]
        try:
            ids, lp = f.get_tensor(f"{key}.ids"), f.get_tensor(f"{key}.logprobs")
        except _safetensors().SafetensorError as e:
            raise TargetsError(f"{file}: {key}: expected its tensors {key}.ids and {key}.logprobs, got {e}") from None
        why = _rows_problem(ids, lp, self.vocab_size)
        if why:
            raise TargetsError(f"{file}: {key}.{why}")
        return ids.long(), lp.float()

    def verify(self) -> None:
        """Check every shard (digest and header) and every example's values: one read of the whole
        directory. Raises `TargetsError` on the first problem."""
        for i in range(len(self._shards)):
            self._shard(i, True)
        for key in self._examples:
            self[key]

    def _shard(self, i, digest):
        if i not in self._open or (digest and not self._open[i][1]):
            entry, keys = self._shards[i], self._keys[i]
            lengths = [(key, self._examples[key]["length"]) for key in keys]
            self._same_index()  # before: no digest of another directory's shard
            f = _open_shard(self.path / entry["file"], entry, lengths, self.k, self._dtype_name, digest)
            self._same_index()  # after: the shard opened is of this index's directory
            self._open[i] = f, digest
        return self._open[i][0]

    def _same_index(self):
        """An overwrite (another process's write_topk_targets) since the index was read puts a new
        directory at path, whose shards, of the same examples, can have the same sizes and headers:
        without digests they were served as this index's."""
        try:
            now = _identity(os.stat(self.path / _INDEX))
        except OSError:
            now = None
        if now != self._index_id:
            raise TargetsError(f"{self.path / _INDEX}: expected the index this reader opened, got "
                               f"{'none' if now is None else 'another file'}: the targets were replaced (an "
                               "overwrite?) since; open the directory again")

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

    targets: a `TopKTargets`, or any mapping key -> (ids (L, K), logprobs (L, K)): tensors, ids int32 or
    int64, logprobs of a floating dtype (read in float32), as `fused_linear_distill_topk` takes them.
    collate_fn: the batch maker this wraps (e.g. an HF `DataCollatorForLanguageModeling`); it must
    return a dict-like batch with `input_ids` (B, T). Default: torch's default_collate, for features
    that are already tensors of one length.

    Each feature carries its example's key in `key_field`; that field is removed before `collate_fn`
    sees the features (HF collators cannot pad strings). The batch gains

        teacher_ids       (B, T, K) int64, -1 (unused slot) at padded positions
        teacher_logprobs  (B, T, K) float32, −inf (probability 0) at padded positions

    An example's L target rows go to the positions where the batch's `attention_mask` is 1 (right or
    left padding alike), and their count must equal L; a mask of another shape than input_ids, or with
    values other than 0 and 1, raises. Without an attention_mask, an example's length
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
        if not isinstance(features, collections.abc.Sequence) or not features:
            got = "an empty list" if isinstance(features, collections.abc.Sequence) else type(features).__name__
            raise ValueError(f"features: expected a non-empty list of examples (a DataLoader's batch), got {got}")
        keys, stripped = [], []
        for i, f in enumerate(features):
            if not isinstance(f, collections.abc.Mapping) or self.key_field not in f:
                got = sorted(f) if isinstance(f, collections.abc.Mapping) else type(f).__name__
                raise ValueError(
                    f"features[{i}]: expected a dict with a {self.key_field!r} field (key_field, the example's "
                    f"key in targets), got {got}"
                )
            if not isinstance(f[self.key_field], collections.abc.Hashable):  # a key of the targets' mapping
                raise TypeError(f"features[{i}][{self.key_field!r}]: expected the example's key in targets (a str "
                                f"for TopKTargets), got {type(f[self.key_field]).__name__}")
            keys.append(f[self.key_field])
            stripped.append({n: v for n, v in f.items() if n != self.key_field})
        batch = self.collate_fn(stripped)
        input_ids = batch["input_ids"] if isinstance(batch, collections.abc.Mapping) and "input_ids" in batch else None
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != len(keys):
            got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"collate_fn: expected a batch with input_ids of shape ({len(keys)}, T), got {got}")
        mask = batch.get("attention_mask")
        b, t = input_ids.shape
        if mask is not None:
            # the targets go where the mask is 1: a mask of another shape, or one holding values other than 0
            # and 1 (which .bool() would read as 1), would place them in silence where it cannot mean
            if not isinstance(mask, torch.Tensor) or mask.shape != input_ids.shape:
                got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
                raise ValueError(f"collate_fn: expected attention_mask of shape {(b, t)} (that of input_ids), got {got}")
            if mask.is_complex() or not ((mask == 0) | (mask == 1)).all():
                odd = mask[(mask != 0) & (mask != 1)]
                odd = odd.unique()[:4].tolist() if not mask.is_complex() else odd[:4].tolist()
                raise ValueError(f"collate_fn: expected an attention_mask of 0s and 1s, got values {odd} "
                                 f"(dtype {mask.dtype})")
        k = None
        for i, key in enumerate(keys):
            if key not in self.targets:
                raise KeyError(f"{self.key_field}: no example {key!r} in targets (features[{i}])")
            ids, lp = _target_pair(self.targets[key], key)
            if ids.dim() != 2 or (k is not None and ids.shape[1] != k) or lp.shape != ids.shape:
                raise ValueError(
                    f"targets[{key!r}]: expected ids and logprobs of shape (length, {'K' if k is None else k}), "
                    f"got {tuple(ids.shape)} and {tuple(lp.shape)}"
                )
            if k is None:
                k = ids.shape[-1]
                teacher_ids = torch.full((b, t, k), -1, dtype=torch.int64)
                teacher_lp = torch.full((b, t, k), -torch.inf, dtype=torch.float32)
            n = ids.shape[0]
            if mask is not None:
                where, field = mask[i].bool(), "attention_mask"
                count = int(where.sum())
            else:
                if "input_ids" not in features[i]:
                    raise ValueError(f"features[{i}]: the batch has no attention_mask, so the example's length is "
                                     f"that of its input_ids feature, and it has none (fields {sorted(features[i])})")
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


def _target_pair(pair, key):
    """A mapping's (ids, logprobs), in the dtypes the top-k loss takes: another would be cast in silence
    below (float ids truncated, so an unused slot's -1 + 0.7 would become id 0)."""
    if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(isinstance(x, torch.Tensor) for x in pair):
        got = (f"a {type(pair).__name__} of ({', '.join(type(x).__name__ for x in pair)})"
               if isinstance(pair, (tuple, list)) else type(pair).__name__)
        raise TypeError(f"targets[{key!r}]: expected a pair (ids, logprobs) of torch.Tensors, got {got}")
    ids, lp = pair
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"targets[{key!r}]: expected ids of dtype torch.int32 or torch.int64, got {ids.dtype}")
    if lp.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"targets[{key!r}]: expected logprobs of a floating dtype (float16, bfloat16, float32, "
                        f"float64), got {lp.dtype}")
    return ids, lp


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


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _same(a, b):
    return type(a) is type(b) and a == b  # True is not 1, 1.0 is not 1


# Writing: the lock, the build directory, atomic files, the swap.


def _path(name: str, value) -> Path:
    """A str or os.PathLike argument as a Path; else TypeError, or ValueError for a NUL in it, naming it."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name}: expected a str or os.PathLike path, got {type(value).__name__}")
    path = Path(value)
    if "\0" in str(path):
        raise ValueError(f"{name}: expected a path without NUL characters, got {str(path)!r}")
    return path


def _sibling(out: Path, tag: str, checked: bool = True) -> Path:
    """The lock file, the build directory ("partial") or the old targets set aside ("old") beside out_dir.
    The two directories, `checked`: a directory or nothing there, anything else (a file, a link, a FIFO,
    which rmtree would open and wait on) refused with ValueError."""
    path = out.parent / f".{out.name}.flashkd-{tag}"
    return files.dir_or_nothing(path, "out_dir") if checked and tag != "lock" else path


def _file_mode() -> int:
    """0o666 less the process's umask: the mode open() gives a new file."""
    try:  # Linux says it without changing it
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def _check_out(out: Path, overwrite: bool):
    """out_dir must be new or empty, or with overwrite a directory of targets and nothing else (so a
    mistyped path cannot erase unrelated files)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir: expected a directory, got the file {out}")
    entries = sorted(out.iterdir()) if out.exists() else []
    if entries and not overwrite:
        raise ValueError(
            f"out_dir: expected a new or empty directory, got {out} holding {len(entries)} entries "
            f"({entries[0].name!r}, ...); pass overwrite=True to replace targets written there"
        )
    for e in entries:
        name = e.name.removesuffix(".tmp")  # .tmp: what a version-1 writer left when it was stopped
        if not (name == _INDEX or _SHARD.fullmatch(name)) or e.is_symlink() or not e.is_file():
            what = " (a link)" if e.is_symlink() else " (a directory)" if e.is_dir() else ""
            raise ValueError(
                f"out_dir: overwrite=True replaces a directory of targets, but {out} also holds {e.name!r}{what}; "
                "remove it or pick another directory"
            )


def _start(partial: Path, index: dict, writer: dict, resume: bool) -> bool:
    """Make `partial` the build directory: a new one, or with resume=True the interrupted write's, its
    finished shards checked and taken into `index`. Returns whether that write had finished."""
    finished, progress = (partial / _INDEX).exists(), partial / _PROGRESS
    if partial.exists() and not finished and (not progress.exists() or progress.read_bytes().count(b"\n") < 2):
        shutil.rmtree(partial)  # no finished shard: nothing to keep
    if not partial.exists():
        partial.mkdir()
        head = {"format": FORMAT, "version": VERSION, "options": {f: index[f] for f in _OPTIONS}, "writer": writer}
        _write_atomic(progress, json.dumps(head, separators=(",", ":")).encode() + b"\n")
        return False
    if not resume:
        raise ValueError(
            f"out_dir: an earlier write into it did not finish; {partial} holds its finished shards: pass "
            "resume=True to continue it (with the same examples and options), or remove that directory"
        )
    if finished:
        state, _ = _read_index(partial)
        _check_same(state, None, index, writer, partial)
        for entry in state["shards"]:
            _check_shard_file(partial / entry["file"], entry["bytes"], entry["sha256"])
    else:
        state = _read_progress(progress, index, writer)
    keep = {_INDEX, _PROGRESS} | {e["file"] for e in state["shards"]}
    for p in partial.iterdir():  # a shard the progress file never listed, .tmp files
        if p.name not in keep:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    index["shards"].extend(state["shards"])
    index["examples"].update(state["examples"])
    return finished


def _check_same(options: dict, old_writer: dict | None, index: dict, writer: dict, partial: Path):
    for field in _OPTIONS:
        if not _same(options[field], index[field]):
            raise ValueError(
                f"{field}: resume=True continues the write in {partial}, made with {field}={options[field]!r}; "
                f"got {index[field]!r}"
            )
    for field, value in writer.items() if old_writer is not None else ():
        if not _same(old_writer.get(field), value):
            arg = "teacher_weight" if field in ("hidden_size", "teacher_dtype") else field
            raise ValueError(
                f"{arg}: resume=True continues the write in {partial}, made with {field}={old_writer.get(field)!r}; "
                f"got {value!r}"
            )


def _read_progress(file: Path, index: dict, writer: dict) -> dict:
    """The state of an interrupted write from its progress file: its options (checked against this
    write's), finished shards (each checked: size, digest, header) and their examples. A torn last
    line (a crash during its write) is cut off."""
    raw = file.read_bytes()
    *lines, torn = raw.split(b"\n")
    head = _loads(lines[0], f"{file}: line 1")
    if not (isinstance(head, dict) and set(head) == {"format", "version", "options", "writer"}
            and head["format"] == FORMAT and _same(head["version"], VERSION)
            and isinstance(head["options"], dict) and set(head["options"]) == set(_OPTIONS)
            and isinstance(head["writer"], dict)):
        raise TargetsError(f"{file}: line 1: expected the header of a flashkd.topk version {VERSION} write, got {head!r}")
    _check_same(head["options"], head["writer"], index, writer, file.parent)
    state = {"shards": [], "examples": {}}
    for n, line in enumerate(lines[1:]):
        where = f"{file}: line {n + 2}"
        e = _loads(line, where)
        if not (isinstance(e, dict) and set(e) == {"file", "bytes", "sha256", "examples"} and isinstance(e["examples"], list)):
            raise TargetsError(f"{where}: expected {{file, bytes, sha256, examples}}, got {e!r}")
        entry = {f: e[f] for f in ("file", "bytes", "sha256")}
        _check_shard_entry(entry, n, where)
        for pair in e["examples"]:
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str) and _KEY.fullmatch(pair[0])
                    and pair[0] not in state["examples"] and _is_int(pair[1]) and 0 <= pair[1] < _MAX_INT):
                raise TargetsError(f"{where}: examples: expected [key, length] pairs of new keys, got {pair!r}")
            state["examples"][pair[0]] = {"shard": n, "length": pair[1]}
        _open_shard(file.parent / entry["file"], entry, e["examples"], index["k"], index["logprob_dtype"], True)
        state["shards"].append(entry)
    if torn:
        os.truncate(file, len(raw) - len(torn))
    return state


def _write_atomic(file: Path, data: bytes):
    tmp = file.with_name(file.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, file)


def _swap(partial: Path, out: Path, overwrite: bool):
    """Put the finished targets in `partial` at `out` (`files.replace_dir`)."""
    _check_out(out, overwrite)  # again: something may have been put there during the write
    files.replace_dir(partial, out, _sibling(out, "old"), what="out_dir")


def _index_bytes(index: dict) -> bytes:
    """index.json's bytes, its "sha256" (the last field) that of the bytes with those digits zeroed."""
    raw = (json.dumps({**index, "sha256": "0" * 64}, indent=1, allow_nan=False) + "\n").encode()
    head, zeros, tail = raw.rpartition(b"0" * 64)
    return head + hashlib.sha256(raw).hexdigest().encode() + tail


# Reading: strict JSON, the index, the shards.


def _read_index(path: Path) -> tuple[dict, tuple]:
    """The checked index of the directory at `path`, and the identity of the index.json read (`_identity`)."""
    file = path / _INDEX
    if not os.path.lexists(file):
        partial = _sibling(path.resolve(), "partial", checked=False)  # only named in the message
        if (path / _PROGRESS).exists():
            why = "a write that did not finish, and this its build directory: finish it with resume=True"
        elif partial.is_dir():
            why = f"a write into it did not finish: {partial} holds its finished shards; finish it with resume=True"
        elif not path.exists():
            why = "no such directory"
        else:
            why = "not a directory of top-k targets, or a write that did not finish"
        raise TargetsError(f"path: expected a directory with {_INDEX}, got {path} ({why})")
    raw, identity = _read_regular(file)
    index = _loads(raw, str(file))
    _check_index(index, raw, file)
    for entry in index["shards"]:
        _check_shard_file(path / entry["file"], entry["bytes"])
    return index, identity


def _identity(s: os.stat_result) -> tuple:
    """What tells one file from the one that replaced it at its path (a new file of a later write):
    no st_dev, which differs between the hosts that mount one network file system."""
    return s.st_ino, s.st_size, s.st_mtime_ns


def _read_regular(file: Path) -> bytes:
    # O_NONBLOCK: opening a FIFO (or some devices) must not wait for a writer; what was opened is then
    # checked on its descriptor (no race with a swap of the path) before a byte is read
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:  # a link (ELOOP), a socket (ENXIO), ...: named by what it is, not by the errno's text
        try:
            mode = os.lstat(file).st_mode
        except OSError:
            mode = None
        if mode is None or stat.S_ISREG(mode):  # gone, or one we may not read
            raise TargetsError(f"{file}: cannot open it: {e.strerror}") from None
        raise TargetsError(f"{file}: expected a regular file, got {files.kind(mode)}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise TargetsError(f"{file}: expected a regular file, got {files.kind(mode)}")
    with os.fdopen(fd, "rb") as f:
        return f.read(), _identity(os.fstat(f.fileno()))


def _loads(raw: bytes, where: str):
    """Strict JSON: UTF-8, no NaN or Infinity (nor numbers that overflow to it), no duplicate keys."""

    def unique(pairs):
        obj = dict(pairs)
        if len(obj) != len(pairs):
            seen = set()
            raise ValueError(f"duplicate key {next(k for k, _ in pairs if k in seen or seen.add(k))!r}")
        return obj

    def finite(text):
        if not math.isfinite(value := float(text)):
            raise ValueError(f"number {text} out of range")
        return value

    def constant(text):
        raise ValueError(f"{text} is not JSON")

    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=unique, parse_float=finite, parse_constant=constant)
    except RecursionError:  # the C decoder recurses per level: a deep document must not escape as one
        raise TargetsError(f"{where}: expected JSON a few levels deep, got a document nested too deeply to parse") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, the hooks', int()'s digit limit
        raise TargetsError(f"{where}: expected strict JSON, got: {e}") from None


def _check_index(index, raw: bytes, file: Path):
    def bad(field, expected):
        return TargetsError(f"{file}: {field}: expected {expected}, got {index.get(field, 'nothing')!r}")

    if not isinstance(index, dict):
        raise TargetsError(f"{file}: expected a JSON object, got {type(index).__name__}")
    if index.get("format") != FORMAT:
        raise bad("format", repr(FORMAT))
    if not _same(index.get("version"), VERSION):
        raise bad("version", f"{VERSION} (the version this flashkd reads; version 1, without digests, must be "
                             "written again; a newer flashkd may read later ones)")
    if set(index) != set(_FIELDS):
        missing, extra = [f for f in _FIELDS if f not in index], [f for f in index if f not in _FIELDS]
        raise TargetsError(f"{file}: expected the fields {', '.join(_FIELDS)}; missing {missing}, unexpected {extra}")
    v, t = index["vocab_size"], index["temperature"]
    if not (_is_int(v) and 1 <= v < _MAX_INT):
        raise bad("vocab_size", f"an int in [1, {_MAX_INT})")
    if not (_is_int(index["k"]) and 1 <= index["k"] <= v):
        raise bad("k", f"an int in [1, {v}] (vocab_size)")
    if not (isinstance(t, (int, float)) and not isinstance(t, bool) and is_finite(t) and t > 0):
        raise bad("temperature", "a finite number > 0")
    if not (isinstance(index["logprob_dtype"], str) and index["logprob_dtype"] in _DTYPES):
        raise bad("logprob_dtype", "one of " + ", ".join(map(repr, _DTYPES)))
    if not (index["teacher_description"] is None or isinstance(index["teacher_description"], str)):
        raise bad("teacher_description", "a string or null")
    if not isinstance(index["shards"], list):
        raise bad("shards", "a list of {file, bytes, sha256}")
    for i, entry in enumerate(index["shards"]):
        _check_shard_entry(entry, i, f"{file}: shards[{i}]")
    if not isinstance(index["examples"], dict):
        raise bad("examples", "an object key -> {shard, length}")
    n = len(index["shards"])
    for key, e in index["examples"].items():
        if not (_KEY.fullmatch(key) and isinstance(e, dict) and set(e) == {"shard", "length"}
                and _is_int(e["shard"]) and 0 <= e["shard"] < n and _is_int(e["length"]) and 0 <= e["length"] < _MAX_INT):
            raise TargetsError(
                f"{file}: examples: {key!r}: expected a key of 1 to 200 characters from A-Z a-z 0-9 _ - . : / and "
                f"{{\"shard\": 0..{n - 1}, \"length\": an int >= 0}}, got {e!r}"
            )
    d = index["sha256"]
    if not (isinstance(d, str) and _HEX.fullmatch(d)):
        raise bad("sha256", "64 lowercase hex digits")
    got = hashlib.sha256(raw.replace(d.encode(), b"0" * 64)).hexdigest()
    if got != d:
        raise TargetsError(f"{file}: sha256: expected the digest of the file ({got}), got {d!r}: the file changed or is damaged")


def _check_shard_entry(entry, i: int, where: str):
    name = f"shard-{i:05d}.safetensors"
    if not (isinstance(entry, dict) and set(entry) == {"file", "bytes", "sha256"} and entry["file"] == name
            and _is_int(entry["bytes"]) and 0 <= entry["bytes"] < 2**53
            and isinstance(entry["sha256"], str) and _HEX.fullmatch(entry["sha256"])):
        raise TargetsError(f"{where}: expected {{\"file\": {name!r}, \"bytes\": an int >= 0, \"sha256\": 64 hex digits}}, got {entry!r}")


def _check_shard_file(file: Path, size: int, sha256: str | None = None):
    """A shard is a regular file in the directory (a link could lead anywhere) of the listed size and,
    where given, digest."""
    os.close(_shard_fd(file, size, sha256))


def _shard_fd(file: Path, size: int, sha256: str | None) -> int:
    """A descriptor of the shard `_check_shard_file` checks: its size and digest are those of what it
    reads, whatever is put at the path meanwhile."""
    try:
        s = os.lstat(file)
    except FileNotFoundError:
        raise TargetsError(f"{file}: expected the shard the index lists, got no such file") from None
    if not stat.S_ISREG(s.st_mode):  # lstat: a link is one
        raise TargetsError(f"{file}: expected a regular file, got {files.kind(s.st_mode)}")
    try:  # O_NOFOLLOW, O_NONBLOCK: a link or a FIFO put there since the lstat is not followed or waited on
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise TargetsError(f"{file}: expected the shard the index lists, got no such file") from None
    except OSError as e:
        raise TargetsError(f"{file}: cannot read it: {e.strerror}") from None
    try:
        s = os.fstat(fd)
        if not stat.S_ISREG(s.st_mode):
            raise TargetsError(f"{file}: expected a regular file, got {files.kind(s.st_mode)}")
        if s.st_size != size:
            raise TargetsError(f"{file}: expected {size} bytes (the index), got {s.st_size}: the file is truncated or changed")
        if sha256 is not None and (got := _file_sha256(fd)) != sha256:
            raise TargetsError(f"{file}: expected SHA-256 {sha256} (the index), got {got}: the file changed or is damaged")
    except BaseException as e:
        os.close(fd)
        if isinstance(e, OSError):
            raise TargetsError(f"{file}: cannot read it: {e.strerror}") from None
        raise
    return fd


def _file_sha256(file: Path | int) -> str:
    """The SHA-256 of a file, by path or from the start of a descriptor (left open)."""
    h = hashlib.sha256()
    with open(file, "rb", closefd=isinstance(file, Path)) as f:
        f.seek(0)
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _open_shard(file: Path, entry: dict, lengths, k: int, dtype_name: str, digest: bool):
    """Open a shard (safetensors memory-maps it) after checking the file, and its header against the
    index: exactly the tensors of `lengths` ((key, L) pairs), each (L, k) of its dtype."""
    fd = _shard_fd(file, entry["bytes"], entry["sha256"] if digest else None)
    st = _safetensors()
    try:
        f = st.safe_open(file, framework="pt")
        meta = f.metadata()
        header = {n: (f.get_slice(n).get_shape(), f.get_slice(n).get_dtype()) for n in f.keys()}
        # safetensors opens the path again, and torch once more: a file put there since the one checked
        # above (a rename over it) is not the one whose size and digest passed
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(file))
        except FileNotFoundError:
            same = False
    except PermissionError as e:
        raise TargetsError(f"{file}: cannot read it: {e.strerror}") from None
    except (st.SafetensorError, OSError, RuntimeError) as e:  # RuntimeError: torch's second open of the file
        raise TargetsError(f"{file}: expected a safetensors file, got: {e}") from None
    finally:
        os.close(fd)  # held open until now: its inode cannot be reused by a file put at the path
    if not same:
        raise TargetsError(f"{file}: expected the shard that was checked, got another file at its path: it was "
                           "replaced while it was opened (a write into the directory?)")
    if meta != {"format": f"{FORMAT}/{VERSION}"}:
        raise TargetsError(f"{file}: metadata: expected {{'format': '{FORMAT}/{VERSION}'}}, got {meta!r}")
    want = {}
    for key, n in lengths:
        want[f"{key}.ids"], want[f"{key}.logprobs"] = ([n, k], "I32"), ([n, k], _HEADER_DTYPES[dtype_name])
    for name in sorted(want.keys() | header.keys()):
        if header.get(name) != want.get(name):
            expected = "no such tensor" if name not in want else "shape {} {}".format(*want[name])
            got = "none" if name not in header else "shape {} {}".format(*header[name])
            raise TargetsError(f"{file}: {name}: expected {expected} (from the index), got {got}")
    return f


def _rows_problem(ids: torch.Tensor, lp: torch.Tensor, vocab_size: int) -> str | None:
    """What breaks the format in one example's (ids, logprobs), or None: O(L·K), on the CPU."""
    bad = (ids < -1) | (ids >= vocab_size)
    if bad.any():
        return f"ids: expected ids in [-1, {vocab_size}) (vocab_size; -1 an unused slot), got {int(ids[bad][0])}"
    bad = ~(lp <= 0)
    if bad.any():
        return f"logprobs: expected log-probs <= 0 (and not NaN), got {float(lp[bad][0])}"
    bad = (ids == -1) & (lp != -torch.inf)
    if bad.any():
        return f"logprobs: expected -inf at unused slots (id -1), got {float(lp[bad][0])}"
    # Top-k ids of one distribution: distinct (the loss counts a repeated id twice, unchecked on a GPU),
    # and their probabilities sum to at most 1 (the bucket would renormalise a larger sum, unchecked on
    # a GPU), but for the rounding of log-probs stored in fewer bits: by up to u·|log p| each, which
    # lifts the sum by at most K^u − 1 (+ u, and 1e-5 for the fp32 log-softmax, as the loss allows)
    ordered = torch.where(ids >= 0, ids, -1 - torch.arange(ids.shape[-1], dtype=ids.dtype)).sort(-1).values
    bad = ordered[:, 1:] == ordered[:, :-1]
    if bad.any():
        row = int(bad.any(-1).nonzero()[0, 0])
        return f"ids: expected distinct ids in a row (the top k), got id {int(ordered[:, 1:][bad][0])} twice in row {row}"
    u = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}.get(lp.dtype, 2.0**-24)
    tol = ids.shape[-1] ** u - 1.0 + u + 1e-5
    mass = lp.double().exp().sum(-1)  # exp(-inf) = 0 at unused slots
    bad = mass > 1.0 + tol
    if bad.any():
        row = int(bad.nonzero()[0, 0])
        return (f"logprobs: expected probabilities summing to at most 1 in a row (log-probs over the whole vocab; "
                f"tolerance {tol:.2g} for their rounding), got {float(mass[row]):.6g} in row {row}")
    return None
