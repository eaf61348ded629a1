"""A teacher with another vocabulary (another tokenizer): two ways to distil from it.

1. An exact token map, `token_map(student_tokenizer, teacher_tokenizer) -> TokenMap`: for each student
   id the teacher id of the same token, or −1. `TokenMap.teacher_head(teacher_weight, teacher_bias)`
   gathers the teacher's LM-head rows into the student's vocab order, with a bias of −inf at the student
   ids the teacher lacks, so that every dense loss of flashkd runs on it unchanged:

       wt_s, bt_s = tmap.teacher_head(teacher_weight, teacher_bias, vocab_size=student_weight.shape[0])
       loss = flashkd.fused_linear_distill(xs, student_weight, xt, wt_s, labels, teacher_bias=bt_s, loss="jsd")

   The teacher's distribution is then its softmax over the shared tokens only: the mass it puts on
   tokens the student lacks is dropped and the rest renormalised, and the student's unmatched ids have
   teacher probability 0. Cost: one V_s·Ht gather (and a V_s bias), made once for a frozen teacher;
   the loss itself is the ordinary heads form. Losses that divide by the teacher's probability, or
   take its log where the student has mass (reverse KL, β = 1 JSD, Jeffreys, ...), are +inf as soon as
   the student puts any mass on an unmatched id; forward KL, JSD with β < 1, the skew losses and TVD
   are finite. A mode that keeps the teacher's unmatched mass in a tail bucket is not offered: that
   bucket's logit, log Σ over the teacher's unmatched ids of e^z, is no row of a linear head, so it
   would need a change to the loss kernels, not a head.

2. TRL's GOLD loss (`GOLDTrainer` with `use_uld_loss=True`: Universal Logit Distillation, and its hybrid
   mode), from both models' hidden states and heads: `fused_linear_uld(...)` with a `UldAlignment`
   (made by `uld_alignment` from the batch as GOLD sees it). It is the value and gradient of TRL 1.16's
   `ULDLoss`, computed a chunk of aligned rows at a time: at most one chunk's (R × V) logits (and the
   probabilities, sorts and gradients of that chunk) exist at once.

GOLD's loss, per batch item i with n_i aligned groups g (a group: the student and teacher positions
between two byte boundaries both tokenizations share):
- each side's group distribution is its softmax at its temperature at one base position (the group's
  first position, "observed", or its last, "bayesian", whose rows start one position earlier), times
  the probabilities, clamped at 1e-8, that the side's other positions of the group give the tokens
  actually there: unnormalised, q_g (student) and p_g (teacher);
- ULD: ℓ_g = Σ_k |sort↓(q_g)_k − sort↓(p_g)_k|, both sorted vectors zero-padded to max(V_s, V_t);
- hybrid (`matched` given, the (student id, teacher id) pairs of the same token): ℓ_g = a · JSD_β over
  the matched ids (on log(max(·, 1e-8)) of the unnormalised q_g, p_g; β = 0 KL(p‖q), β = 1 KL(q‖p),
  else the generalized JSD with mixture (1 − β) q + β p) + b · the sorted L1 over the unmatched ids
  of each side (0 if either side has none); a = K / V_t and b = 1 − a by default (K pairs);
- loss = w_dist · (1/B) Σ_i (1/n_i) Σ_g ℓ_g  (+ w_ce · the mean CE of the student's rows with a label).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping

import torch

from .losses import check_finite_float, check_logit_transform, logit_transform

EPS = 1e-8  # GOLD's clamp of a merged position's probability and of the hybrid JSD's probabilities
NORMALIZE = ("exact", "bytes")


# ---------------------------------------------------------------------------------------------------
# The token map


@dataclasses.dataclass(frozen=True, eq=False)
class TokenMap:
    """index (V_s,) int64: the teacher id of each student id, −1 where the teacher has no such token.
    Each teacher id appears at most once (the map is one-to-one on the ids it matches).
    teacher_vocab_size: the teacher's vocab (its ids lie below it), or None (unknown: not checked)."""

    index: torch.Tensor
    teacher_vocab_size: int | None = None

    def __post_init__(self):
        index = self.index
        if not isinstance(index, torch.Tensor) or index.dtype not in (torch.int64, torch.int32):
            got = index.dtype if isinstance(index, torch.Tensor) else type(index).__name__
            raise TypeError(f"index: expected an int64 or int32 tensor (a teacher id or -1 per student id), got {got}")
        if index.dim() != 1 or index.numel() == 0:
            raise ValueError(f"index: expected a non-empty 1-D tensor (one entry per student id), got shape {tuple(index.shape)}")
        tv = self.teacher_vocab_size
        if tv is not None and (isinstance(tv, bool) or not isinstance(tv, int) or tv < 1):
            raise TypeError(f"teacher_vocab_size: expected None or an int >= 1, got {tv!r}")
        if index.device.type == "meta":  # its ids are read below (range, one-to-one): a meta tensor has none
            raise ValueError("index: expected a tensor with values (a teacher id or -1 per student id), got one on "
                             "the meta device")
        index = index.detach().to(torch.int64)
        lo, hi = int(index.min()), int(index.max())
        if lo < -1 or (tv is not None and hi >= tv):
            raise ValueError(f"index: expected teacher ids in [0, {tv if tv is not None else 'V_t'}) or -1, "
                             f"got values in [{lo}, {hi}]")
        matched = index[index >= 0]
        if matched.unique().numel() != matched.numel():
            raise ValueError("index: a teacher id appears at more than one student id (the map must be one-to-one)")
        object.__setattr__(self, "index", index)

    @property
    def student_vocab_size(self) -> int:
        return self.index.numel()

    @property
    def matched(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(student ids, teacher ids) (K,) of the shared tokens, by student id."""
        student = (self.index >= 0).nonzero().flatten()
        return student, self.index[student]

    def __len__(self) -> int:
        return self.index.numel()

    def __repr__(self) -> str:
        return (f"TokenMap(student_vocab_size={self.student_vocab_size}, teacher_vocab_size={self.teacher_vocab_size}, "
                f"matched={int((self.index >= 0).sum())})")

    def padded(self, vocab_size: int) -> "TokenMap":
        """The map over a student head of `vocab_size` rows (≥ the map's length): ids past it unmatched."""
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
            raise TypeError(f"vocab_size: expected an int (the student head's rows), got {vocab_size!r}")
        if vocab_size < len(self):
            raise ValueError(f"vocab_size: expected at least {len(self)} (the map's student ids), got {vocab_size}; "
                             "the map was built for a larger student vocabulary")
        extra = self.index.new_full((vocab_size - len(self),), -1)
        return TokenMap(torch.cat([self.index, extra]), self.teacher_vocab_size)

    def teacher_head(self, teacher_weight: torch.Tensor, teacher_bias: torch.Tensor | None = None, *,
                     vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's LM head in the student's vocab order: (weight (V_s, Ht), bias (V_s,)), the
        teacher's row (and bias) at each matched student id, a zero row and a bias of −inf at the others
        (teacher probability 0 there, under any logit scale or softcap). In teacher_weight's dtype and
        on its device, detached (the teacher is a constant). vocab_size: the student head's rows, when
        more than the map's student ids (a padded head): the ids past the map are unmatched.

        `fused_linear_distill(xs, ws, xt, *tmap.teacher_head(wt, bt), labels)` distils from the teacher
        renormalised over the shared tokens (pass the bias as teacher_bias=...). One gather of V_s rows:
        make it once for a frozen teacher."""
        tmap = self if vocab_size is None else self.padded(vocab_size)
        if not isinstance(teacher_weight, torch.Tensor) or not teacher_weight.is_floating_point():
            got = teacher_weight.dtype if isinstance(teacher_weight, torch.Tensor) else type(teacher_weight).__name__
            raise TypeError(f"teacher_weight: expected a float tensor (Vt, Ht), got {got}")
        if teacher_weight.layout != torch.strided:  # gathered by rows below: a sparse head fails there, unnamed
            raise TypeError(f"teacher_weight: expected a dense (strided) tensor, got layout {teacher_weight.layout}")
        if teacher_weight.dim() != 2 or 0 in teacher_weight.shape:  # no rows to gather, or no hidden size
            raise ValueError(f"teacher_weight: expected a 2-D tensor (Vt, Ht), both >= 1, got shape "
                             f"{tuple(teacher_weight.shape)}")
        rows = teacher_weight.shape[0]
        top = int(tmap.index.max())
        if top < 0:
            # every teacher logit −inf: the teacher's distribution over the student's ids is 0/0, a NaN loss
            raise ValueError(f"index: expected at least one student id matched to a teacher id (the teacher's "
                             f"distribution over the shared tokens), got none of {len(tmap)}: the tokenizers share "
                             "no token (pass pairs= to token_map, or use fused_linear_uld)")
        tv = tmap.teacher_vocab_size
        if tv is not None and rows < tv:
            # the map's teacher has tv ids: a head with fewer rows is another model's (a padded head has more)
            raise ValueError(f"teacher_weight: expected at least {tv} rows (the map's teacher_vocab_size), got {rows}")
        if top >= rows:
            raise ValueError(f"teacher_weight: expected at least {top + 1} rows (the map's teacher ids reach {top}), "
                             f"got {rows}")
        if teacher_bias is not None:
            if not isinstance(teacher_bias, torch.Tensor) or teacher_bias.dtype != teacher_weight.dtype:
                got = teacher_bias.dtype if isinstance(teacher_bias, torch.Tensor) else type(teacher_bias).__name__
                raise TypeError(f"teacher_bias: expected None or a tensor of teacher_weight's dtype "
                                f"{teacher_weight.dtype}, got {got}")
            if teacher_bias.layout != torch.strided:
                raise TypeError(f"teacher_bias: expected a dense (strided) tensor, got layout {teacher_bias.layout}")
            if teacher_bias.device != teacher_weight.device:  # not copied across devices unasked
                raise ValueError(f"teacher_bias: expected a tensor on {teacher_weight.device} (teacher_weight's "
                                 f"device), got {teacher_bias.device}")
            if teacher_bias.shape != (rows,):
                raise ValueError(f"teacher_bias: expected shape ({rows},) (teacher_weight's rows), got {tuple(teacher_bias.shape)}")
        with torch.no_grad():
            index = tmap.index.to(teacher_weight.device)
            hit = index >= 0
            safe = index.clamp(min=0)
            weight = teacher_weight.detach()[safe] * hit[:, None].to(teacher_weight.dtype)
            if teacher_bias is None:
                bias = torch.zeros(len(tmap), dtype=teacher_weight.dtype, device=teacher_weight.device)
            else:
                bias = teacher_bias.detach()[safe]
            bias = bias.masked_fill(~hit, float("-inf"))
        return weight, bias


def token_map(student_tokenizer, teacher_tokenizer, *, normalize: str = "exact",
              pairs: Mapping[int, int] | None = None, student_vocab_size: int | None = None,
              teacher_vocab_size: int | None = None) -> TokenMap:
    """The exact token map between two tokenizers (Hugging Face tokenizers, read with `get_vocab()`, or
    plain {token string: id} dicts): for each student id, the teacher id of the same token, or −1.

    normalize: how token strings are compared.
    - "exact" (default): the vocab strings, as they are, special tokens included (TRL's GOLD hybrid
      loss compares them so). Right for two tokenizers of one family of pre-tokenisation: two
      byte-level BPEs (GPT-2's byte alphabet: Llama 3, Qwen 2/3, Mistral Nemo, ...) write the same bytes
      with the same string ('Ġthe'); two SentencePiece models likewise ('▁the'). Across the families it
      matches only the tokens without a space or byte marker ('the', digits, punctuation).
    - "bytes": each token is compared by the bytes it stands for: a byte-level BPE token through GPT-2's
      byte alphabet ('Ġthe' → b' the', 'Ċ' → b'\\n'), a SentencePiece token with '▁' as a space and
      '<0xNN>' as the byte NN, any other vocab as UTF-8. The kind is read from a fast tokenizer's
      decoder / pre-tokenizer (ByteLevel; Metaspace, '▁' or ByteFallback), a slow SentencePiece
      tokenizer by its `sp_model`, a plain dict from its strings (a 'Ġ' in any token: byte-level; a
      '▁': SentencePiece). Special and added tokens (`get_added_vocab()`) are compared by their
      content, only with the other side's special and added tokens.
    Where several teacher ids stand for one key (e.g. a SentencePiece '▁' and '<0x20>'), the lowest
    teacher id is used, and it goes to the lowest student id with that key: the map is one-to-one.
    Special tokens that differ in name but not in role (Llama 3's '<|eot_id|>', Qwen's '<|im_end|>') are
    not matched: pass them in `pairs`.

    pairs: {student id: teacher id} set after the matching, overriding it (a teacher id paired here is
    taken from any student id the matching gave it to).
    student_vocab_size, teacher_vocab_size: the vocab sizes, when larger than the tokenizers' (max id +
    1); the map has student_vocab_size entries (a padded student head: see also TokenMap.padded).
    """
    if normalize not in NORMALIZE:
        raise ValueError(f"normalize: expected one of {', '.join(map(repr, NORMALIZE))}, got {normalize!r}")
    s_vocab = _vocab("student_tokenizer", student_tokenizer)
    t_vocab = _vocab("teacher_tokenizer", teacher_tokenizer)
    vs = _size("student_vocab_size", student_vocab_size, s_vocab)
    vt = _size("teacher_vocab_size", teacher_vocab_size, t_vocab)
    s_keys = _keys(student_tokenizer, s_vocab, normalize)
    t_keys = _keys(teacher_tokenizer, t_vocab, normalize)
    teacher_of: dict = {}
    for tid, key in sorted(t_keys.items()):
        teacher_of.setdefault(key, tid)  # a key several teacher ids share: the lowest
    index = [-1] * vs
    used = set()
    for sid, key in sorted(s_keys.items()):
        tid = teacher_of.get(key)
        if tid is not None and tid not in used:  # ... to the lowest student id with that key
            index[sid] = tid
            used.add(tid)
    if pairs is not None:
        if not isinstance(pairs, Mapping):
            raise TypeError(f"pairs: expected None or a {{student id: teacher id}} mapping, got {type(pairs).__name__}")
        owner = {t: s for s, t in enumerate(index) if t >= 0}
        paired: dict = {}
        for sid, tid in pairs.items():
            if isinstance(sid, bool) or isinstance(tid, bool) or not isinstance(sid, int) or not isinstance(tid, int):
                raise TypeError(f"pairs: expected int ids, got {sid!r}: {tid!r}")
            if not (0 <= sid < vs and 0 <= tid < vt):
                raise ValueError(f"pairs: expected student ids in [0, {vs}) and teacher ids in [0, {vt}), got {sid}: {tid}")
            if tid in paired:  # the later pair would take it from the earlier one: one of them silently lost
                raise ValueError(f"pairs: expected each teacher id at most once (the map is one-to-one), got teacher "
                                 f"id {tid} for student ids {paired[tid]} and {sid}")
            paired[tid] = sid
            if tid in owner:
                index[owner[tid]] = -1
            if index[sid] >= 0:
                owner.pop(index[sid], None)
            index[sid] = tid
            owner[tid] = sid
    return TokenMap(torch.tensor(index, dtype=torch.int64), vt)


def _vocab(name, tokenizer) -> dict[str, int]:
    if isinstance(tokenizer, Mapping):
        vocab = dict(tokenizer)
    elif callable(getattr(tokenizer, "get_vocab", None)):
        vocab = tokenizer.get_vocab()
        if not isinstance(vocab, Mapping):  # read as {token: id} below: anything else fails there, unnamed
            raise TypeError(f"{name}: expected get_vocab() to return a {{token: id}} dict, got {type(vocab).__name__}")
        vocab = dict(vocab)
    else:
        raise TypeError(f"{name}: expected a tokenizer with get_vocab() or a {{token: id}} dict, got {type(tokenizer).__name__}")
    bad = next(((k, v) for k, v in vocab.items() if not isinstance(k, str) or isinstance(v, bool)
                or not isinstance(v, int) or v < 0), None)
    if bad is not None or not vocab:
        raise ValueError(f"{name}: expected a non-empty vocab of {{str: int >= 0}}, got {'an empty one' if bad is None else bad}")
    return vocab


def _size(name, given, vocab) -> int:
    need = max(vocab.values()) + 1
    if given is None:
        return need
    if isinstance(given, bool) or not isinstance(given, int):
        raise TypeError(f"{name}: expected None or an int, got {given!r}")
    if given < need:
        raise ValueError(f"{name}: expected at least {need} (the tokenizer's largest id + 1), got {given}")
    return given


def _keys(tokenizer, vocab: dict[str, int], normalize: str) -> dict[int, tuple]:
    """{id: the key its token is compared by}."""
    by_id: dict[int, str] = {}
    for token, i in vocab.items():
        if i not in by_id or token < by_id[i]:  # an id with two strings: one of them, deterministically
            by_id[i] = token
    if normalize == "exact":
        return {i: ("s", t) for i, t in by_id.items()}
    added = set()
    if not isinstance(tokenizer, Mapping):
        if callable(getattr(tokenizer, "get_added_vocab", None)):
            added |= set(tokenizer.get_added_vocab())
        added |= set(getattr(tokenizer, "all_special_tokens", ()) or ())
    kind = _kind(tokenizer, vocab)
    out = {}
    for i, token in by_id.items():
        data = None if token in added else _token_bytes(token, kind)
        out[i] = ("special", token) if token in added else ("b", data) if data is not None else ("s", token)
    return out


def _kind(tokenizer, vocab) -> str:
    backend = None if isinstance(tokenizer, Mapping) else getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        text = json.dumps([spec.get("decoder"), spec.get("pre_tokenizer")], ensure_ascii=False)
        if '"ByteLevel"' in text:
            return "byte_level"
        if "Metaspace" in text or "\u2581" in text or "ByteFallback" in text:
            return "sentencepiece"
        return "plain"
    if not isinstance(tokenizer, Mapping) and hasattr(tokenizer, "sp_model"):
        return "sentencepiece"
    if any("\u0120" in t for t in vocab):
        return "byte_level"
    if any("\u2581" in t for t in vocab):
        return "sentencepiece"
    return "plain"


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: {the character standing for a byte: the byte}."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_ALPHABET = _byte_alphabet()
_SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _token_bytes(token: str, kind: str) -> bytes | None:
    """The bytes a vocab string stands for, None where it cannot be read so (compared as a string)."""
    if kind == "byte_level":
        try:
            return bytes(_BYTE_ALPHABET[c] for c in token)
        except KeyError:
            return None
    if kind == "sentencepiece":
        m = _SP_BYTE.fullmatch(token)
        if m:
            return bytes([int(m.group(1), 16)])
        return token.replace("\u2581", " ").encode("utf-8")
    return token.encode("utf-8")


# ---------------------------------------------------------------------------------------------------
# GOLD's ULD loss: the alignment


@dataclasses.dataclass(frozen=True, eq=False)
class UldAlignment:
    """GOLD's alignment of a batch, as rows of the flattened student and teacher hidden states.

    Group g (one aligned row of the loss): `student_rows[g]` and `teacher_rows[g]` (G,) are the rows
    whose whole distribution is the group's base, `weight[g]` (G,) its weight in the loss (GOLD's:
    w_dist / (B · n_i)), `item[g]` its batch item. The other positions of a group multiply its
    distribution by their probability of the token there: `*_factor_rows`, `*_factor_ids`,
    `*_factor_groups` (M,) each (row, token id, group); none where every group is one position."""

    student_rows: torch.Tensor
    teacher_rows: torch.Tensor
    weight: torch.Tensor
    item: torch.Tensor
    student_factor_rows: torch.Tensor
    student_factor_ids: torch.Tensor
    student_factor_groups: torch.Tensor
    teacher_factor_rows: torch.Tensor
    teacher_factor_ids: torch.Tensor
    teacher_factor_groups: torch.Tensor

    def __len__(self) -> int:
        return self.student_rows.numel()

    def to(self, device) -> "UldAlignment":
        return UldAlignment(**{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)})


MERGES = ("observed", "bayesian")


def uld_alignment(student_labels: torch.Tensor, teacher_labels: torch.Tensor, student_input_ids: torch.Tensor,
                  teacher_input_ids: torch.Tensor, student_byte_offsets: torch.Tensor | None = None,
                  teacher_byte_offsets: torch.Tensor | None = None, *, merge: str = "observed",
                  extended: bool = True, skip_student_eos: bool = True, skip_teacher_eos: bool = True,
                  weight: float = 1.0, ignore_index: int = -100) -> UldAlignment:
    """GOLD's alignment (TRL 1.16's `ULDLoss._compute_distillation_loss`) of a batch of B sequences
    (labels and input ids (B, T_s) and (B, T_t), byte offsets (B, T, 2) as GOLD's collator and
    `build_teacher_inputs_from_texts` make them), as a `UldAlignment` over rows b · T + t.

    Per item, the answer is the labels' first non-ignored position and their count (less one with
    skip_*_eos); an item whose answer is empty on either side has no group, and still counts in B.
    extended: groups from the byte offsets (a group closes where both sides' tokens end at one byte;
    GOLD drops a pair with an empty side), each merged from its positions as `merge` says ("observed":
    the first position's distribution times the later ones' token probabilities; "bayesian": rows one
    position earlier, the last position's distribution times the earlier ones'; with an answer at
    position 0 on either side, its first group is skipped). Without `extended`: one position each,
    the first min(n_s, n_t) positions paired. weight: GOLD's `uld_distillation_weight`."""
    if merge not in MERGES:
        raise ValueError(f"merge: expected one of {', '.join(map(repr, MERGES))}, got {merge!r}")
    check_finite_float("weight", weight)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index: expected an int, got {ignore_index!r}")
    for name, flag in (("extended", extended), ("skip_student_eos", skip_student_eos),
                       ("skip_teacher_eos", skip_teacher_eos)):
        if not isinstance(flag, bool):  # a string or a tensor would be read as its truth value
            raise TypeError(f"{name}: expected a bool, got {flag!r}")
    for name, t in (("student_labels", student_labels), ("teacher_labels", teacher_labels),
                    ("student_input_ids", student_input_ids), ("teacher_input_ids", teacher_input_ids)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not _integer(t):
            got = (t.dtype if t.dim() == 2 else tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected an integer tensor (batch, length), got {got}")
        if t.device.type == "meta":  # read on the host below
            raise ValueError(f"{name}: expected a tensor with values, got one on the meta device")
    for name, t in (("student_labels", student_labels), ("teacher_labels", teacher_labels)):
        # narrower ones would wrap ignore_index: -100 is 156 in uint8, so that label 156 would read as ignored
        if t.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name}: expected an integer dtype (torch.int64 or torch.int32), got {t.dtype}")
    if student_input_ids.shape != student_labels.shape:
        raise ValueError(f"student_input_ids: expected shape {tuple(student_labels.shape)} (student_labels'), "
                         f"got {tuple(student_input_ids.shape)}")
    if teacher_input_ids.shape != teacher_labels.shape:
        raise ValueError(f"teacher_input_ids: expected shape {tuple(teacher_labels.shape)} (teacher_labels'), "
                         f"got {tuple(teacher_input_ids.shape)}")
    b, ts = student_labels.shape
    tt = teacher_labels.shape[1]
    if teacher_labels.shape[0] != b:
        raise ValueError(f"teacher_labels: expected {b} sequences (student_labels'), got {teacher_labels.shape[0]}")
    if extended:
        for name, off, t in (("student_byte_offsets", student_byte_offsets, ts),
                             ("teacher_byte_offsets", teacher_byte_offsets, tt)):
            if not isinstance(off, torch.Tensor) or off.shape != (b, t, 2):
                got = tuple(off.shape) if isinstance(off, torch.Tensor) else type(off).__name__
                raise ValueError(f"{name}: expected shape ({b}, {t}, 2) with extended=True, got {got}")
            if not _integer(off):
                raise TypeError(f"{name}: expected an integer tensor of byte offsets, got {off.dtype}")
            if off.device.type == "meta":  # read on the host below
                raise ValueError(f"{name}: expected a tensor with values, got one on the meta device")
    s_start, s_size = _answers(student_labels, ignore_index)
    t_start, t_size = _answers(teacher_labels, ignore_index)
    s_size = [n - 1 for n in s_size] if skip_student_eos else s_size
    t_size = [n - 1 for n in t_size] if skip_teacher_eos else t_size
    bayes = merge == "bayesian"
    s_ids, t_ids = student_input_ids.tolist(), teacher_input_ids.tolist()
    s_off = student_byte_offsets.tolist() if extended else None
    t_off = teacher_byte_offsets.tolist() if extended else None
    out = {k: [] for k in ("sr", "tr", "w", "item", "sfr", "sfi", "sfg", "tfr", "tfi", "tfg")}
    for i in range(b):
        ss, sn, st, tn = s_start[i], s_size[i], t_start[i], t_size[i]
        if sn <= 0 or tn <= 0:
            continue
        if bayes and (ss == 0 or st == 0):  # no row predicts the first answer token: its group is dropped
            if extended:
                sg, tg = align_by_byte_offsets(s_off[i][ss:ss + sn], t_off[i][st:st + tn])
                if not sg or not tg:
                    continue
                sd, td = len(sg[0]), len(tg[0])
            else:
                sd = td = 1
            ss, sn, st, tn = ss + sd, sn - sd, st + td, tn - td
            if sn <= 0 or tn <= 0:
                continue
        if extended:
            sg, tg = align_by_byte_offsets(s_off[i][ss:ss + sn], t_off[i][st:st + tn])
            groups = [(a, c) for a, c in zip(sg, tg) if a and c]
        else:
            groups = [([k], [k]) for k in range(min(sn, tn))]
        s0, t0 = i * ts + ss - bayes, i * tt + st - bayes  # the row of answer position 0
        for sgroup, tgroup in groups:
            g = len(out["sr"])
            for side, group, row0, start, ids in (("s", sgroup, s0, ss, s_ids[i]), ("t", tgroup, t0, st, t_ids[i])):
                base, factors = (group[-1], group[:-1]) if bayes else (group[0], group[1:])
                out[f"{side}r"].append(row0 + base)
                for k in factors:
                    out[f"{side}fr"].append(row0 + k)
                    out[f"{side}fi"].append(ids[start + k])
                    out[f"{side}fg"].append(g)
            out["w"].append(weight / (b * len(groups)))
            out["item"].append(i)
    long = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return UldAlignment(long(out["sr"]), long(out["tr"]), torch.tensor(out["w"], dtype=torch.float64), long(out["item"]),
                        long(out["sfr"]), long(out["sfi"]), long(out["sfg"]),
                        long(out["tfr"]), long(out["tfi"]), long(out["tfg"]))


def _integer(t: torch.Tensor) -> bool:
    """An integer dtype: not floating, complex or bool (a bool tensor's True reads as id 1)."""
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _answers(labels, ignore_index):
    mask = labels != ignore_index
    size = mask.sum(1).tolist()
    first = torch.where(mask.any(1), mask.int().argmax(1), 0).tolist()
    return first, size


def align_by_byte_offsets(s_offsets, t_offsets) -> tuple[list[list[int]], list[list[int]]]:
    """GOLD's byte alignment: walk both tokenizations' (start, end) byte offsets, advancing the side
    whose token ends first; a group closes where both end at one byte. What is left forms a last group."""
    s_groups, t_groups = [], []
    s_start = t_start = s = t = 0
    n_s, n_t = len(s_offsets), len(t_offsets)
    while s < n_s and t < n_t:
        s_end, t_end = s_offsets[s][1], t_offsets[t][1]
        if s_end < t_end:
            s += 1
        elif s_end > t_end:
            t += 1
        else:
            s += 1
            t += 1
            s_groups.append(list(range(s_start, s)))
            t_groups.append(list(range(t_start, t)))
            s_start, t_start = s, t
    if s < n_s or t < n_t:
        s_groups.append(list(range(s_start, n_s)))
        t_groups.append(list(range(t_start, n_t)))
    return s_groups, t_groups


# ---------------------------------------------------------------------------------------------------
# GOLD's ULD loss: the chunked computation


@dataclasses.dataclass
class _Side:
    x: torch.Tensor  # (N, H)
    w: torch.Tensor  # (V, H)
    b: torch.Tensor | None
    scale: float
    cap: float | None
    tau: float

    def logits(self, rows, acc):
        z = self.x[rows] @ self.w.T
        if self.b is not None:
            z = z + self.b
        return z.to(acc)

    def probs(self, z):
        return torch.softmax(logit_transform(z, self.scale, self.cap) / self.tau, dim=-1)


def fused_linear_uld(
    student_input: torch.Tensor,  # (..., Hs)
    student_weight: torch.Tensor,  # (Vs, Hs)
    teacher_input: torch.Tensor,  # (..., Ht), its own leading dims
    teacher_weight: torch.Tensor,  # (Vt, Ht)
    alignment: UldAlignment,
    *,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    student_temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    matched: TokenMap | tuple[torch.Tensor, torch.Tensor] | None = None,
    matched_weight: float | None = None,
    unmatched_weight: float | None = None,
    beta: float | None = None,
    labels: torch.Tensor | None = None,
    ce_weight: float = 0.0,
    ignore_index: int = -100,
    student_logit_scale: float = 1.0,
    student_softcap: float | None = None,
    teacher_logit_scale: float = 1.0,
    teacher_softcap: float | None = None,
    chunk_size: int | None = None,
    return_parts: bool = False,
):
    """TRL's GOLD / ULD loss (see the module doc) from both models' last hidden states and LM heads, and
    a `UldAlignment` (rows of the flattened `student_input` and `teacher_input`).

    matched: None (ULD: the sorted L1 over the whole vocabs), or the shared tokens for the hybrid loss:
    a TokenMap, or (student ids, teacher ids) (K,) int64, each teacher id once; matched_weight /
    unmatched_weight (a, b): floats, both or neither (then a = K / Vt, b = 1 − a, as GOLD); beta: the hybrid JSD's β
    (None: 0.5, GOLD's default; like the weights, only with `matched`: plain ULD has no JSD to take it).
    labels (...) like student_input's leading dims, ignore_index where none, and ce_weight: GOLD's
    cross-entropy term, ce_weight · the mean CE of the student's rows with a label (labels already
    shifted: the row's next token). The logit transform (scale, then softcap) applies before the
    temperature, as in a model whose logits include it.

    Returns the scalar loss (fp32; fp64 for fp64 inputs), with return_parts (loss, matched, unmatched):
    each group's detached hybrid JSD and sorted-L1 terms (G,) before their weights (None without
    `matched`). Gradients flow to student_input, student_weight and student_bias (computed in the call,
    scaled by the backward's grad_output); the teacher is a constant. Memory beyond the inputs: one
    chunk of aligned rows' (R × V) logits and their temporaries, plus fp32 (fp64) gradient accumulators
    of the student's head and hidden states. chunk_size: rows per chunk (None: 2^24 / max(Vs, Vt), at
    least 1). The sort per row is torch's, per chunk; ties are broken as torch sorts them (as in TRL).
    """
    if not isinstance(return_parts, bool):
        raise TypeError(f"return_parts: expected a bool, got {return_parts!r}")
    plan = _plan(student_input, student_weight, teacher_input, teacher_weight, alignment, student_bias, teacher_bias,
                 student_temperature, teacher_temperature, matched, matched_weight, unmatched_weight, beta, labels,
                 ce_weight, ignore_index, student_logit_scale, student_softcap, teacher_logit_scale, teacher_softcap,
                 chunk_size)
    loss = _Uld.apply(student_input, student_weight, student_bias, plan)
    if return_parts:
        return loss, plan.parts[0], plan.parts[1]
    return loss


class _Plan:
    pass


def _check_labels(labels, xs):
    """labels: None, or an int64 / int32 tensor of student_input's leading dims on its device (narrower ints
    would wrap ignore_index: -100 is 156 in uint8; nothing is copied across devices unasked)."""
    if labels is None:
        return
    if not isinstance(labels, torch.Tensor) or labels.shape != xs.shape[:-1]:
        got = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(f"labels: expected a tensor of student_input's leading dims {tuple(xs.shape[:-1])}, got {got}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels: expected an integer dtype (torch.int64 or torch.int32), got {labels.dtype}")
    if labels.device != xs.device:
        raise ValueError(f"labels: expected a tensor on {xs.device} (the device of student_input), got {labels.device}")


def _plan(xs, ws, xt, wt, al, bs, bt, s_tau, t_tau, matched, a, b, beta, labels, ce_weight, ignore_index,
          s_scale, s_cap, t_scale, t_cap, chunk_size):
    for name, t in (("student_input", xs), ("student_weight", ws), ("teacher_input", xt), ("teacher_weight", wt)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name}: expected a float tensor, got {got}")
    if ws.dim() != 2 or wt.dim() != 2 or 0 in ws.shape or 0 in wt.shape:  # an empty vocab has no distribution
        name, t = ("student_weight", ws) if ws.dim() != 2 or 0 in ws.shape else ("teacher_weight", wt)
        raise ValueError(f"{name}: expected a 2-D tensor (V, H), both >= 1, got shape {tuple(t.shape)}")
    for name, x in (("student_input", xs), ("teacher_input", xt)):
        if x.dim() < 1:
            raise ValueError(f"{name}: expected a tensor of shape (..., H), got a 0-d tensor")
    if xs.shape[-1] != ws.shape[1] or xt.shape[-1] != wt.shape[1]:
        name, x, w = ("student_input", xs, ws) if xs.shape[-1] != ws.shape[1] else ("teacher_input", xt, wt)
        raise ValueError(f"{name}: expected a last dim of {w.shape[1]} (the head's hidden size), got {x.shape[-1]}")
    if xs.dtype != ws.dtype or xt.dtype != wt.dtype:
        name, x, w = ("student_weight", xs, ws) if xs.dtype != ws.dtype else ("teacher_weight", xt, wt)
        raise TypeError(f"{name}: expected its input's dtype {x.dtype}, got {w.dtype}")
    for name, bias, w in (("student_bias", bs, ws), ("teacher_bias", bt, wt)):
        if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (w.shape[0],)):
            got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(f"{name}: expected None or shape ({w.shape[0]},), got {got}")
        if bias is not None and bias.dtype != w.dtype:  # added to the logits, it would promote or cast them
            raise TypeError(f"{name}: expected None or a tensor of its weight's dtype {w.dtype}, got {bias.dtype}")
    # one device, dense: the two sides' probabilities meet in each chunk's loss (a teacher elsewhere fails there,
    # or on the meta device gives a loss of no logits), and the gradients are gathered by rows
    for name, t in (("student_input", xs), ("student_weight", ws), ("student_bias", bs), ("teacher_input", xt),
                    ("teacher_weight", wt), ("teacher_bias", bt)):
        if t is not None and t.layout != torch.strided:
            raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")
        if t is not None and t.device != xs.device:
            raise ValueError(f"{name}: expected a tensor on {xs.device} (the device of student_input), got {t.device}")
    if not isinstance(al, UldAlignment):
        raise TypeError(f"alignment: expected a flashkd.UldAlignment (flashkd.uld_alignment), got {type(al).__name__}")
    for f in dataclasses.fields(al):  # a public dataclass, built by hand too: its fields are read below
        t = getattr(al, f.name)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"alignment.{f.name}: expected a tensor, got {type(t).__name__}")
        if t.device.type == "meta":  # moved to student_input's device below, and its indices checked on the host
            raise ValueError(f"alignment.{f.name}: expected a tensor with values, got one on the meta device")
    for name, tau in (("student_temperature", s_tau), ("teacher_temperature", t_tau)):
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau > 0 or tau == float("inf"):
            raise ValueError(f"{name}: expected a finite float > 0, got {tau!r}")
    check_logit_transform("student_logit_scale", s_scale, "student_softcap", s_cap)
    check_logit_transform("teacher_logit_scale", t_scale, "teacher_softcap", t_cap)
    check_finite_float("ce_weight", ce_weight)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index: expected an int, got {ignore_index!r}")
    if beta is not None:
        check_finite_float("beta", beta)
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta: expected a float in [0, 1], got {beta!r}")
    for name, w in (("matched_weight", a), ("unmatched_weight", b)):
        if w is not None:
            check_finite_float(name, w)
    ns, nt = xs.numel() // xs.shape[-1], xt.numel() // xt.shape[-1]
    vs, vt = ws.shape[0], wt.shape[0]
    device = ws.device
    g = len(al)
    for name, rows, n in (("student_rows", al.student_rows, ns), ("teacher_rows", al.teacher_rows, nt),
                          ("student_factor_rows", al.student_factor_rows, ns),
                          ("teacher_factor_rows", al.teacher_factor_rows, nt),
                          ("student_factor_ids", al.student_factor_ids, vs),
                          ("teacher_factor_ids", al.teacher_factor_ids, vt),
                          ("student_factor_groups", al.student_factor_groups, g),
                          ("teacher_factor_groups", al.teacher_factor_groups, g)):
        _check_index(f"alignment.{name}", rows, n)
    for name, t, like in (("student_rows", al.student_rows, g), ("teacher_rows", al.teacher_rows, g),
                          ("weight", al.weight, g), ("item", al.item, g),
                          ("student_factor_ids", al.student_factor_ids, al.student_factor_rows.numel()),
                          ("student_factor_groups", al.student_factor_groups, al.student_factor_rows.numel()),
                          ("teacher_factor_ids", al.teacher_factor_ids, al.teacher_factor_rows.numel()),
                          ("teacher_factor_groups", al.teacher_factor_groups, al.teacher_factor_rows.numel())):
        if t.dim() != 1 or t.numel() != like:
            raise ValueError(f"alignment.{name}: expected shape ({like},), got {tuple(t.shape)}")
    if not isinstance(al.weight, torch.Tensor) or not al.weight.is_floating_point():
        got = al.weight.dtype if isinstance(al.weight, torch.Tensor) else type(al.weight).__name__
        raise TypeError(f"alignment.weight: expected a float tensor, got {got}")
    if al.weight.requires_grad:  # a constant of the loss: no gradient flows to it, and none should be dropped unseen
        raise TypeError("alignment.weight: expected a constant tensor (requires_grad=False): no gradient flows to it; "
                        "got one that requires grad (pass weight.detach())")
    if al.weight.device.type == "cpu" and not bool(al.weight.isfinite().all()):
        raise ValueError("alignment.weight: expected finite values")
    if not isinstance(al.item, torch.Tensor) or al.item.dtype not in (torch.int64, torch.int32):
        got = al.item.dtype if isinstance(al.item, torch.Tensor) else type(al.item).__name__
        raise TypeError(f"alignment.item: expected an int64 or int32 tensor, got {got}")
    p = _Plan()
    p.acc = torch.float64 if xs.dtype == torch.float64 else torch.float32
    p.student = _Side(xs.reshape(ns, -1), ws, bs, float(s_scale), s_cap, float(s_tau))
    p.teacher = _Side(xt.detach().reshape(nt, -1), wt.detach(), None if bt is None else bt.detach(), float(t_scale),
                      t_cap, float(t_tau))
    p.al = al.to(device)
    p.hybrid = None
    if matched is not None:
        if isinstance(matched, TokenMap):
            if len(matched) > vs:
                raise ValueError(f"matched: expected a TokenMap of at most {vs} student ids (student_weight's rows), "
                                 f"got {len(matched)}")
            tv = matched.teacher_vocab_size
            if tv is not None and tv > vt:  # a map of another teacher's vocab: its ids may fall in range by chance
                raise ValueError(f"matched: expected a TokenMap of at most {vt} teacher ids (teacher_weight's rows), "
                                 f"got teacher_vocab_size={tv}")
            sid, tid = matched.matched
        elif isinstance(matched, (tuple, list)) and len(matched) == 2:
            sid, tid = matched
        else:
            raise TypeError(f"matched: expected None, a TokenMap or (student ids, teacher ids), got {type(matched).__name__}")
        _check_index("matched student ids", sid, vs)
        _check_index("matched teacher ids", tid, vt)
        if sid.dim() != 1 or sid.shape != tid.shape:
            raise ValueError(f"matched: expected two 1-D id tensors of one length, got {tuple(sid.shape)} and {tuple(tid.shape)}")
        if tid.unique().numel() != tid.numel():  # GOLD's pairs are keyed by teacher id: each at most once
            raise ValueError("matched teacher ids: expected each teacher id at most once (one student id each), got "
                             "a teacher id more than once")
        order = tid.argsort()  # GOLD's order: by teacher id
        sid, tid = sid[order].to(device), tid[order].to(device)
        if (a is None) != (b is None):
            raise ValueError(f"matched_weight, unmatched_weight: expected both floats or both None, got {a!r}, {b!r}")
        if a is None:
            a = sid.numel() / max(1, vt)
            b = 1.0 - a
        s_un = torch.ones(vs, dtype=torch.bool, device=device)
        s_un[sid] = False
        t_un = torch.ones(vt, dtype=torch.bool, device=device)
        t_un[tid] = False
        p.hybrid = (sid, tid, s_un.nonzero().flatten(), t_un.nonzero().flatten(), float(a), float(b),
                    0.5 if beta is None else float(beta))
    elif a is not None or b is not None:
        raise ValueError("matched_weight, unmatched_weight: only with matched= (the hybrid loss)")
    elif beta is not None:  # the plain ULD loss has no JSD: a β given there would change nothing, unseen
        raise ValueError(f"beta: only with matched= (the hybrid loss's JSD), got {beta!r} without it")
    p.labels = None
    p.ce_weight = float(ce_weight)
    _check_labels(labels, xs)  # as given, even where ce_weight is 0 and the loss does not read them
    if labels is not None and p.ce_weight != 0.0:
        y = labels.reshape(-1).to(device)
        rows = (y != ignore_index).nonzero().flatten()
        _check_index("labels", y[rows], vs)
        p.labels = (rows, y[rows])
    elif p.ce_weight != 0.0:
        raise ValueError("labels: expected the student's labels with ce_weight != 0, got None")
    if chunk_size is None:
        chunk_size = max(1, 2**24 // max(vs, vt))
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected None or an int >= 1, got {chunk_size!r}")
    p.chunk = chunk_size
    p.parts = (None, None)
    return p


def _check_index(name, t, n):
    # int64 or int32 only: a uint8 tensor indexes as a mask, int16 is refused deep inside index_add_
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name}: expected an int64 or int32 tensor, got "
                        f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= n):
        raise ValueError(f"{name}: expected values in [0, {n}), got values in [{int(t.min())}, {int(t.max())}]")


class _Uld(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xs, ws, bs, plan):
        need = ctx.needs_input_grad[:3]
        loss, grads = _run(plan, any(need))
        ctx.like = [(t.shape, t.dtype) if t is not None else None for t in (xs, ws, bs)]
        ctx.save_for_backward(*[g if n else None for g, n in zip(grads, need)])
        return loss

    @staticmethod
    def backward(ctx, grad):
        out = []
        for g, like in zip(ctx.saved_tensors, ctx.like):
            out.append(None if g is None else (g * grad.to(g.dtype)).reshape(like[0]).to(like[1]))
        return (*out, None)


def _run(p, need):
    """The loss and, with `need`, its gradients to (xs, ws, bs), a chunk of rows at a time."""
    s, t, al, acc = p.student, p.teacher, p.al, p.acc
    g = len(al)
    gx = torch.zeros(s.x.shape, dtype=acc, device=s.x.device) if need else None
    gw = torch.zeros(s.w.shape, dtype=acc, device=s.w.device) if need else None
    gb = torch.zeros(s.w.shape[0], dtype=acc, device=s.w.device) if need and s.b is not None else None

    def accumulate(rows, dz):
        dz_ = dz.to(s.w.dtype)
        gx.index_add_(0, rows, (dz_ @ s.w).to(acc))
        gw.add_((dz_.T @ s.x[rows]).to(acc))
        if gb is not None:
            gb.add_(dz.sum(0))

    # the factors: each group's product of its other positions' clamped token probabilities
    with torch.no_grad():
        s_fac = _factors(s, al.student_factor_rows, al.student_factor_ids, p.chunk, acc)
        t_fac = _factors(t, al.teacher_factor_rows, al.teacher_factor_ids, p.chunk, acc)
        ones = torch.ones(g, dtype=acc, device=s.w.device)
        c_s = ones.scatter_reduce(0, al.student_factor_groups, s_fac, "prod")
        c_t = ones.scatter_reduce(0, al.teacher_factor_groups, t_fac, "prod")
    total = torch.zeros((), dtype=acc, device=s.w.device)
    gc = torch.zeros(g, dtype=acc, device=s.w.device)
    matched_parts, unmatched_parts = [], []
    weight = al.weight.to(acc)
    for a in range(0, g, p.chunk):
        e = min(g, a + p.chunk)
        rs = al.student_rows[a:e]
        with torch.no_grad():
            qt = t.probs(t.logits(al.teacher_rows[a:e], acc)) * c_t[a:e, None]
            zs = s.logits(rs, acc)
        with torch.enable_grad():
            zs.requires_grad_(need)
            cs = c_s[a:e].clone().requires_grad_(need)
            q = s.probs(zs) * cs[:, None]
            per_group, jsd, l1 = _group_loss(q, qt, p.hybrid)
            chunk_loss = (per_group * weight[a:e]).sum()
        if need:
            dz, dc = torch.autograd.grad(chunk_loss, (zs, cs))
            accumulate(rs, dz)
            gc[a:e] = dc
        total += chunk_loss.detach()
        if jsd is not None:
            matched_parts.append(jsd.detach())
            unmatched_parts.append(l1.detach())
        del q, qt, zs
    if p.hybrid is not None:
        empty = torch.zeros(0, dtype=acc, device=s.w.device)
        p.parts = (torch.cat(matched_parts) if matched_parts else empty, torch.cat(unmatched_parts) if unmatched_parts else empty)
    # the factors' gradients: dL/ds_m = dL/dc_g · Π of the group's other factors
    m = al.student_factor_rows.numel()
    if need and m:
        groups = al.student_factor_groups
        log_c = torch.zeros(g, dtype=acc, device=s.w.device).index_add(0, groups, s_fac.log())
        g_fac = gc[groups] * torch.exp(log_c[groups] - s_fac.log())
        for a in range(0, m, p.chunk):
            e = min(m, a + p.chunk)
            rows = al.student_factor_rows[a:e]
            zs = s.logits(rows, acc)
            with torch.enable_grad():
                zs.requires_grad_(True)
                f = _token_probs(s, zs, al.student_factor_ids[a:e])
                (dz,) = torch.autograd.grad(f, zs, g_fac[a:e])
            accumulate(rows, dz)
    # GOLD's cross-entropy term: the mean over the rows with a label
    if p.labels is not None:
        rows_all, y_all = p.labels
        n = rows_all.numel()
        for a in range(0, n, p.chunk):
            e = min(n, a + p.chunk)
            rows = rows_all[a:e]
            zs = s.logits(rows, acc)
            with torch.enable_grad():
                zs.requires_grad_(need)
                ce = torch.nn.functional.cross_entropy(logit_transform(zs, s.scale, s.cap), y_all[a:e], reduction="sum")
                ce = ce * (p.ce_weight / n)
            if need:
                (dz,) = torch.autograd.grad(ce, zs)
                accumulate(rows, dz)
            total += ce.detach()
    return total, (gx, gw, gb)


def _token_probs(side, z, ids):
    """Each row's probability of its token, clamped at EPS (GOLD's merge factor)."""
    return side.probs(z).gather(1, ids[:, None]).squeeze(1).clamp_min(EPS)


def _factors(side, rows, ids, chunk, acc):
    out = torch.empty(rows.numel(), dtype=acc, device=side.w.device)
    for a in range(0, rows.numel(), chunk):
        e = min(rows.numel(), a + chunk)
        out[a:e] = _token_probs(side, side.logits(rows[a:e], acc), ids[a:e])
    return out


def _sorted_l1(q, p):
    """Σ_k |sort↓(q)_k − sort↓(p)_k| per row, the shorter side zero-padded."""
    qs = q.sort(dim=-1, descending=True).values
    ps = p.sort(dim=-1, descending=True).values
    width = max(qs.shape[-1], ps.shape[-1])
    qs = torch.nn.functional.pad(qs, (0, width - qs.shape[-1]))
    ps = torch.nn.functional.pad(ps, (0, width - ps.shape[-1]))
    return (qs - ps).abs().sum(-1)


def _gold_jsd(q, p, beta):
    """GOLD's generalized JSD on (unnormalised) probabilities, summed per row (its
    `generalized_jsd_loss(..., logits_are_probs=True)` before the batch mean)."""
    s = torch.log(q.clamp_min(EPS))
    t = torch.log(p.clamp_min(EPS))
    if beta == 0:
        d = t.exp() * (t - s)
    elif beta == 1:
        d = s.exp() * (s - t)
    else:
        b = torch.tensor(beta, dtype=s.dtype, device=s.device)
        m = torch.logsumexp(torch.stack([s + torch.log1p(-b), t + torch.log(b)]), dim=0)
        d = beta * (t.exp() * (t - m)) + (1 - beta) * (s.exp() * (s - m))
    return d.sum(-1)


def _group_loss(q, p, hybrid):
    """Each row's ℓ_g, and (hybrid only) its JSD and sorted-L1 terms."""
    if hybrid is None:
        return _sorted_l1(q, p), None, None
    sid, tid, s_un, t_un, a, b, beta = hybrid
    jsd = _gold_jsd(q[:, sid], p[:, tid], beta) if sid.numel() else q.new_zeros(q.shape[0])
    if s_un.numel() and t_un.numel():
        l1 = _sorted_l1(q[:, s_un], p[:, t_un])
    else:
        l1 = q.new_zeros(q.shape[0])
    return a * jsd + b * l1, jsd, l1
