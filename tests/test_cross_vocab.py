"""flashkd.cross_vocab: a teacher with another vocabulary.

The token map (token_map, TokenMap) against hand-made vocabs; TokenMap.teacher_head through
fused_linear_distill against a float64 oracle of its own (the teacher's softmax over its whole vocab,
gathered at the shared tokens and renormalised); fused_linear_uld against TRL 1.16's own ULDLoss (GOLD)
at float64 on CPU, values and gradients; and the errors, one line each, naming the argument."""

import math
import random
import types
import warnings

import pytest
import torch

import flashkd
from flashkd.cross_vocab import TokenMap, align_by_byte_offsets, fused_linear_uld, token_map, uld_alignment

F64 = torch.float64


# ---------------------------------------------------------------------------------------------------
# token_map


def _vocabs():
    """A student and a teacher vocab sharing some tokens, each with tokens the other lacks, ids in
    different orders."""
    shared = [f"tok{i}" for i in range(10)]
    student = {t: i for i, t in enumerate(["<s>", "s_only0", *shared[:6], "s_only1", *shared[6:], "s_only2"])}
    teacher = {t: i for i, t in enumerate(["t_only0", *reversed(shared), "t_only1", "<s>", "t_only2", "t_only3"])}
    return student, teacher


def test_exact_map_matches_identical_strings():
    student, teacher = _vocabs()
    tmap = token_map(student, teacher)
    assert len(tmap) == len(student) and tmap.teacher_vocab_size == len(teacher)
    for token, sid in student.items():
        assert int(tmap.index[sid]) == teacher.get(token, -1), token
    sid, tid = tmap.matched
    assert sid.tolist() == sorted(sid.tolist()) and len(sid) == 11  # ten shared tokens and <s>
    assert "matched=11" in repr(tmap)


def test_exact_map_does_not_normalise_space_markers():
    tmap = token_map({"\u0120the": 0, "the": 1}, {"\u2581the": 0, "the": 1})
    assert tmap.index.tolist() == [-1, 1]


def test_bytes_map_reads_byte_level_and_sentencepiece_tokens():
    byte_level = {"\u0120the": 0, "\u010a": 1, "a": 2, "\u0120": 3, "\u00e2\u0122\u013b": 4, "<|endoftext|>": 5}
    sentencepiece = {"<unk>": 0, "\u2581the": 1, "<0x0A>": 2, "a": 3, "\u2581": 4, "<0x20>": 5, "\u2019": 6}
    tmap = token_map(byte_level, sentencepiece, normalize="bytes")
    # ' the', '\n', 'a', ' ' (SentencePiece's '▁' and '<0x20>' are both b' ': the lower id), U+2019 in UTF-8
    assert tmap.index.tolist() == [1, 2, 3, 4, 6, -1]
    back = token_map(sentencepiece, byte_level, normalize="bytes")
    assert back.index.tolist() == [-1, 0, 1, 2, 3, -1, 4]


def test_bytes_map_reads_fast_tokenizers_kinds():
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def fast(vocab, byte_level):
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        if byte_level:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
        else:
            tok.pre_tokenizer = pre_tokenizers.Metaspace()
            tok.decoder = decoders.Metaspace()
        return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")

    # no 'Ġ' / '▁' in these strings: only the tokenizers' own decoders tell their kinds
    bl = fast({"<unk>": 0, "<eos>": 1, "\u010a": 2, "x": 3}, True)
    sp = fast({"<unk>": 0, "<0x0A>": 1, "x": 2, "<eos>": 3}, False)
    assert token_map(bl, sp, normalize="bytes").index.tolist() == [0, 3, 1, 2]
    assert token_map(bl, sp).index.tolist() == [0, 3, -1, 2]


def test_pairs_override_and_sizes():
    student, teacher = _vocabs()
    tmap = token_map(student, teacher, pairs={student["s_only0"]: teacher["t_only1"], student["tok0"]: teacher["tok1"]},
                     student_vocab_size=len(student) + 3, teacher_vocab_size=len(teacher) + 5)
    assert len(tmap) == len(student) + 3 and tmap.teacher_vocab_size == len(teacher) + 5
    assert int(tmap.index[student["s_only0"]]) == teacher["t_only1"]
    assert int(tmap.index[student["tok0"]]) == teacher["tok1"]
    assert int(tmap.index[student["tok1"]]) == -1  # its teacher id went to the pair
    assert (tmap.index[len(student):] == -1).all()


@pytest.mark.parametrize("call, error, words", [
    (lambda s, t: token_map(s, t, normalize="nfkc"), ValueError, "normalize"),
    (lambda s, t: token_map(3, t), TypeError, "student_tokenizer"),
    (lambda s, t: token_map(s, {}), ValueError, "teacher_tokenizer"),
    (lambda s, t: token_map(s, t, student_vocab_size=2), ValueError, "student_vocab_size"),
    (lambda s, t: token_map(s, t, pairs={0: 99}), ValueError, "pairs"),
    (lambda s, t: token_map(s, t, pairs=[(0, 1)]), TypeError, "pairs"),
    (lambda s, t: TokenMap(torch.tensor([0.0, 1.0])), TypeError, "index"),
    (lambda s, t: TokenMap(torch.tensor([[0, 1]])), ValueError, "index"),
    (lambda s, t: TokenMap(torch.tensor([0, -2])), ValueError, "index"),
    (lambda s, t: TokenMap(torch.tensor([0, 5]), teacher_vocab_size=5), ValueError, "index"),
    (lambda s, t: TokenMap(torch.tensor([1, 1, -1])), ValueError, "one-to-one"),
    # a tokenizer whose get_vocab() is no {token: id} dict: refused by name, not an AttributeError on its items
    (lambda s, t: token_map(types.SimpleNamespace(get_vocab=lambda: list(s.items())), t), TypeError,
     "student_tokenizer: expected get_vocab"),
    (lambda s, t: token_map(s, types.SimpleNamespace(get_vocab=lambda: None)), TypeError,
     "teacher_tokenizer: expected get_vocab"),
])
def test_map_errors_name_the_argument(call, error, words):
    student, teacher = _vocabs()
    with pytest.raises(error, match=words) as info:
        call(student, teacher)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------------------
# TokenMap.teacher_head through fused_linear_distill


def _random_map(vs, vt, matched, generator):
    """A one-to-one map of `matched` random student ids to random teacher ids."""
    sid = torch.randperm(vs, generator=generator)[:matched]
    tid = torch.randperm(vt, generator=generator)[:matched]
    index = torch.full((vs,), -1, dtype=torch.int64)
    index[sid] = tid
    return TokenMap(index, vt)


def _mapped_oracle(xs, ws, bs, xt, wt, bt, index, loss, beta, tau):
    """float64: the teacher's softmax over its whole vocab, its probabilities at the student's matched
    ids, renormalised; the loss summed over rows."""
    zs = xs.double() @ ws.double().T + (0 if bs is None else bs.double())
    zt = xt.double() @ wt.double().T + (0 if bt is None else bt.double())
    p_full = torch.softmax(zt / tau, -1)
    hit = index >= 0
    p = torch.where(hit, p_full[:, index.clamp(min=0)], torch.zeros(()))
    p = p / p.sum(-1, keepdim=True)
    q = torch.softmax(zs / tau, -1)
    kl = lambda a, b: (torch.xlogy(a, a) - torch.xlogy(a, b)).sum(-1)  # noqa: E731
    if loss == "forward_kl":
        per_row = kl(p, q)
    elif loss == "reverse_kl":
        per_row = kl(q, p)
    elif loss == "tvd":
        per_row = 0.5 * (q - p).abs().sum(-1)
    else:
        m = beta * p + (1 - beta) * q
        per_row = beta * kl(p, m) + (1 - beta) * kl(q, m)
    return per_row.sum()


CASES = [  # loss, beta, temperature, biases
    ("forward_kl", None, 1.0, False),
    ("forward_kl", None, 2.0, True),
    ("jsd", 0.5, 1.0, True),
    ("jsd", 0.1, 0.7, False),
    ("tvd", None, 1.0, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_mapped_teacher_matches_oracle(case, seed):
    loss, beta, tau, bias = case
    g = torch.Generator().manual_seed(seed)
    n, hs, ht, vs, vt = 13, 11, 9, 37, 53  # irregular sizes; unmatched ids on both sides
    tmap = _random_map(vs, vt, 29, g)
    xs = torch.randn(n, hs, dtype=F64, generator=g, requires_grad=True)
    ws = (torch.randn(vs, hs, dtype=F64, generator=g) / math.sqrt(hs)).requires_grad_()
    bs = torch.randn(vs, dtype=F64, generator=g).requires_grad_() if bias else None
    xt = torch.randn(n, ht, dtype=F64, generator=g)
    wt = torch.randn(vt, ht, dtype=F64, generator=g) * 2 / math.sqrt(ht)
    bt = torch.randn(vt, dtype=F64, generator=g) if bias else None
    wt_s, bt_s = tmap.teacher_head(wt, bt)
    assert wt_s.shape == (vs, ht) and bt_s.shape == (vs,)
    assert torch.isneginf(bt_s[tmap.index < 0]).all() and torch.isfinite(bt_s[tmap.index >= 0]).all()
    kwargs = dict(loss=loss, temperature=tau, weight_hard_loss=0.0, weight_soft_loss=1.0, reduction="sum",
                  student_bias=bs, teacher_bias=bt_s, backend="torch")
    if beta is not None:
        kwargs["beta"] = beta
    got = flashkd.fused_linear_distill(xs, ws, xt, wt_s, None, **kwargs)
    ref = _mapped_oracle(xs, ws, bs, xt, wt, bt, tmap.index, loss, beta, tau)
    students = [t for t in (xs, ws, bs) if t is not None]
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got, students), torch.autograd.grad(ref, students)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_mapped_teacher_with_labels_softcap_and_padded_student_head(seed):
    """A padded student head (rows past the map unmatched: teacher probability 0), the teacher's softcap
    (−inf stays −inf), a hard term on labels: the CE is untouched by the map."""
    g = torch.Generator().manual_seed(seed)
    n, hs, ht, vs, vt, pad = 10, 8, 6, 21, 30, 3
    tmap = _random_map(vs, vt, 15, g)
    xs = torch.randn(n, hs, dtype=F64, generator=g, requires_grad=True)
    ws = torch.randn(vs + pad, hs, dtype=F64, generator=g).requires_grad_()
    xt = torch.randn(n, ht, dtype=F64, generator=g)
    wt = torch.randn(vt, ht, dtype=F64, generator=g)
    labels = torch.randint(0, vs + pad, (n,), generator=g)
    labels[2] = -100
    wt_s, bt_s = tmap.teacher_head(wt, vocab_size=vs + pad)
    got = flashkd.fused_linear_distill(xs, ws, xt, wt_s, labels, teacher_bias=bt_s, loss="forward_kl",
                                       teacher_softcap=2.0, weight_hard_loss=0.3, weight_soft_loss=0.7,
                                       reduction="sum", backend="torch")
    index = torch.cat([tmap.index, torch.full((pad,), -1)])
    zt = 2.0 * torch.tanh(xt @ wt.T / 2.0)
    soft_ref = _mapped_oracle(xs, ws, None, torch.eye(n, dtype=F64), zt.T, None, index, "forward_kl", None, 1.0)
    keep = labels != -100
    soft_ref = soft_ref - _mapped_oracle(xs[~keep], ws, None, torch.eye(n, dtype=F64)[~keep], zt.T, None, index,
                                         "forward_kl", None, 1.0)
    ce = torch.nn.functional.cross_entropy(xs[keep] @ ws.T, labels[keep], reduction="sum")
    ref = 0.7 * soft_ref + 0.3 * ce
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got, (xs, ws)), torch.autograd.grad(ref, (xs, ws))):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_reverse_kl_is_infinite_where_the_student_has_unmatched_mass(seed):
    g = torch.Generator().manual_seed(seed)
    tmap = _random_map(12, 15, 8, g)
    xs, ws = torch.randn(4, 5, dtype=F64, generator=g), torch.randn(12, 5, dtype=F64, generator=g)
    xt, wt = torch.randn(4, 6, dtype=F64, generator=g), torch.randn(15, 6, dtype=F64, generator=g)
    wt_s, bt_s = tmap.teacher_head(wt)
    common = dict(teacher_bias=bt_s, weight_hard_loss=0.0, weight_soft_loss=1.0, backend="torch")
    assert math.isinf(flashkd.fused_linear_distill(xs, ws, xt, wt_s, None, loss="reverse_kl", **common).item())
    assert math.isfinite(flashkd.fused_linear_distill(xs, ws, xt, wt_s, None, loss="jsd", beta=0.9, **common).item())


@pytest.mark.parametrize("call, error, words", [
    (lambda m, w, b: m.teacher_head(w[:5]), ValueError, "teacher_weight"),
    (lambda m, w, b: m.teacher_head(w.long()), TypeError, "teacher_weight"),
    (lambda m, w, b: m.teacher_head(w[0]), ValueError, "teacher_weight"),
    (lambda m, w, b: m.teacher_head(w, b.float()), TypeError, "teacher_bias"),
    (lambda m, w, b: m.teacher_head(w, b[:-1]), ValueError, "teacher_bias"),
    (lambda m, w, b: m.teacher_head(w, vocab_size=3), ValueError, "vocab_size"),
    (lambda m, w, b: m.teacher_head(w, vocab_size=12.0), TypeError, "vocab_size"),
])
def test_teacher_head_errors_name_the_argument(call, error, words, seed):
    g = torch.Generator().manual_seed(seed)
    tmap = TokenMap(torch.tensor([3, -1, 7, 0, -1, 9, 1, -1, 2, 4]), 10)
    wt, bt = torch.randn(10, 4, dtype=F64, generator=g), torch.randn(10, dtype=F64, generator=g)
    with pytest.raises(error, match=words) as info:
        call(tmap, wt, bt)
    assert "\n" not in str(info.value)


def test_a_map_of_the_wrong_length_is_refused_by_the_loss(seed):
    """A map made for another student vocab gives a teacher head whose rows are not the student's."""
    g = torch.Generator().manual_seed(seed)
    tmap = _random_map(12, 15, 8, g)
    wt_s, bt_s = tmap.teacher_head(torch.randn(15, 4, dtype=F64, generator=g))
    xs, ws = torch.randn(3, 5, dtype=F64, generator=g), torch.randn(14, 5, dtype=F64, generator=g)
    with pytest.raises(ValueError, match="teacher_weight"):
        flashkd.fused_linear_distill(xs, ws, torch.randn(3, 4, dtype=F64), wt_s, None, teacher_bias=bt_s,
                                     weight_hard_loss=0.0, weight_soft_loss=1.0)


# ---------------------------------------------------------------------------------------------------
# GOLD's ULD loss against TRL's ULDLoss


def _gold():
    pytest.importorskip("trl")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.gold.gold_trainer import ULDLoss
    return ULDLoss


def _config(**changes):
    base = dict(uld_crossentropy_weight=0.0, uld_distillation_weight=1.0, uld_student_temperature=1.0,
                uld_teacher_temperature=1.0, uld_skip_student_eos=True, uld_skip_teacher_eos=True,
                use_extended_uld=True, uld_token_merge_strategy="observed", uld_use_hybrid_loss=False,
                uld_hybrid_matched_weight=None, uld_hybrid_unmatched_weight=None, beta=0.5)
    return types.SimpleNamespace(**{**base, **changes})


def _batch(seed, b=4, ts=13, tt=15, hs=7, ht=9, vs=29, vt=41, spans=None):
    """Hidden states, heads, labels, ids and completion-relative byte offsets as GOLD's collator and
    build_teacher_inputs_from_texts lay them out: a prompt, the answer, padding; the teacher's last
    answer token a zero-width EOS."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    xs = torch.randn(b, ts, hs, dtype=F64, generator=g, requires_grad=True)
    ws = (torch.randn(vs, hs, dtype=F64, generator=g) * 3 / math.sqrt(hs)).requires_grad_()
    bs = torch.randn(vs, dtype=F64, generator=g).requires_grad_()
    xt = torch.randn(b, tt, ht, dtype=F64, generator=g)
    wt = torch.randn(vt, ht, dtype=F64, generator=g) * 3 / math.sqrt(ht)
    bt = torch.randn(vt, dtype=F64, generator=g)
    s_ids, t_ids = torch.randint(0, vs, (b, ts), generator=g), torch.randint(0, vt, (b, tt), generator=g)
    s_lab, t_lab = torch.full((b, ts), -100), torch.full((b, tt), -100)
    s_off, t_off = torch.zeros(b, ts, 2, dtype=torch.long), torch.zeros(b, tt, 2, dtype=torch.long)
    spans = spans or [(2, 7, 3, 8), (1, 11, 0, 12), (4, 4, 5, 9), (0, 1, 2, 1)]
    for i, (ps, ns, pt, nt) in enumerate(spans[:b]):
        text = 3 * max(ns, nt) + 5  # bytes in the completion
        for lab, ids, off, p, n in ((s_lab, s_ids, s_off, ps, ns), (t_lab, t_ids, t_off, pt, nt)):
            lab[i, p:p + n] = ids[i, p:p + n]
            cuts = sorted(rng.sample(range(1, text), n - 2)) + [text] if n >= 2 else []
            starts = [0] + cuts[:-1]
            ends = list(zip(starts, cuts)) + [(text, text)] if n >= 2 else [(text, text)][:n]
            for k, (a, e) in enumerate(ends[:n]):
                off[i, p + k] = torch.tensor([a, e])
    return xs, ws, bs, xt, wt, bt, s_lab, t_lab, s_ids, t_ids, s_off, t_off


def _vocab_tokenizers(vs, vt, seed):
    """Stand-ins for two tokenizers (ULDLoss reads get_vocab()): some shared strings, in other orders."""
    rng = random.Random(seed)
    shared = rng.sample(range(vt), vs // 2)
    t_vocab = {f"x{i}": i for i in range(vt)}
    s_ids = rng.sample(range(vs), len(shared))
    s_vocab = {f"s{i}": i for i in range(vs)}
    for sid, tid in zip(s_ids, shared):
        del s_vocab[f"s{sid}"]
        s_vocab[f"x{tid}"] = sid
    return types.SimpleNamespace(get_vocab=lambda: s_vocab), types.SimpleNamespace(get_vocab=lambda: t_vocab)


ULD_CASES = [
    dict(),
    dict(uld_token_merge_strategy="bayesian"),
    dict(use_extended_uld=False),
    dict(use_extended_uld=False, uld_token_merge_strategy="bayesian"),
    dict(uld_skip_student_eos=False, uld_skip_teacher_eos=False),
    dict(uld_student_temperature=2.0, uld_teacher_temperature=0.5, uld_distillation_weight=0.7),
    dict(uld_crossentropy_weight=0.3),
    dict(uld_use_hybrid_loss=True),
    dict(uld_use_hybrid_loss=True, beta=0.0, uld_token_merge_strategy="bayesian"),
    dict(uld_use_hybrid_loss=True, beta=1.0, uld_student_temperature=1.5),
    dict(uld_use_hybrid_loss=True, uld_hybrid_matched_weight=0.8, uld_hybrid_unmatched_weight=0.4, beta=0.3,
         uld_crossentropy_weight=0.5, use_extended_uld=False),
]


@pytest.mark.parametrize("chunk_size", [1, 3, None])
@pytest.mark.parametrize("case", ULD_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_uld_matches_trl(case, chunk_size, seed):
    ULDLoss = _gold()
    cfg = _config(**case)
    xs, ws, bs, xt, wt, bt, s_lab, t_lab, s_ids, t_ids, s_off, t_off = _batch(seed)
    st, tt = _vocab_tokenizers(ws.shape[0], wt.shape[0], seed)
    uld = ULDLoss(cfg, st, tt)
    ref = uld(xs @ ws.T + bs, xt @ wt.T + bt, s_lab, t_lab, s_ids, t_ids, s_off, t_off)
    al = uld_alignment(s_lab, t_lab, s_ids, t_ids, s_off, t_off, merge=cfg.uld_token_merge_strategy,
                       extended=cfg.use_extended_uld, skip_student_eos=cfg.uld_skip_student_eos,
                       skip_teacher_eos=cfg.uld_skip_teacher_eos, weight=cfg.uld_distillation_weight)
    matched = None
    if cfg.uld_use_hybrid_loss:  # the same pairs as TRL's mapping, from the vocabs by flashkd's map
        matched = token_map(st.get_vocab(), tt.get_vocab())
        assert sorted(matched.matched[1].tolist()) == sorted(uld._vocab_mapping)
    labels = torch.cat([s_lab[:, 1:], torch.full_like(s_lab[:, :1], -100)], 1)
    got, m_parts, u_parts = fused_linear_uld(
        xs, ws, xt, wt, al, student_bias=bs, teacher_bias=bt, student_temperature=cfg.uld_student_temperature,
        teacher_temperature=cfg.uld_teacher_temperature, matched=matched, matched_weight=cfg.uld_hybrid_matched_weight,
        unmatched_weight=cfg.uld_hybrid_unmatched_weight, beta=cfg.beta if matched is not None else None, labels=labels,
        ce_weight=cfg.uld_crossentropy_weight, chunk_size=chunk_size, return_parts=True)
    assert got.dtype == F64
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-14)
    for a, b in zip(torch.autograd.grad(got, (xs, ws, bs)), torch.autograd.grad(ref, (xs, ws, bs))):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)
    if matched is not None:  # TRL keeps the last item's terms
        last = al.item == al.item[-1]
        torch.testing.assert_close(m_parts[last].mean(), uld.last_matched_loss.detach())
        torch.testing.assert_close(u_parts[last].mean(), uld.last_unmatched_loss.detach())
    else:
        assert m_parts is None and u_parts is None


def test_uld_without_any_answer_is_zero_with_zero_gradients(seed):
    xs, ws, bs, xt, wt, bt, s_lab, t_lab, s_ids, t_ids, s_off, t_off = _batch(seed)
    s_lab[:] = -100
    al = uld_alignment(s_lab, t_lab, s_ids, t_ids, s_off, t_off)
    assert len(al) == 0
    loss = fused_linear_uld(xs, ws, xt, wt, al)
    loss.backward()
    assert loss.item() == 0.0 and not xs.grad.any() and not ws.grad.any()


def test_uld_grad_output_scales_and_shapes(seed):
    xs, ws, bs, xt, wt, bt, s_lab, t_lab, s_ids, t_ids, s_off, t_off = _batch(seed)
    al = uld_alignment(s_lab, t_lab, s_ids, t_ids, s_off, t_off)
    loss = fused_linear_uld(xs, ws, xt, wt, al, student_bias=bs, teacher_bias=bt)
    g1 = torch.autograd.grad(loss, (xs, ws, bs))
    loss = fused_linear_uld(xs, ws, xt, wt, al, student_bias=bs, teacher_bias=bt)
    g3 = torch.autograd.grad(loss * 3.0, (xs, ws, bs))
    for a, b, t in zip(g1, g3, (xs, ws, bs)):
        assert a.shape == t.shape and a.dtype == t.dtype
        torch.testing.assert_close(3.0 * a, b)


def test_uld_float32_logits_math(seed):
    """fp32 inputs: an fp32 loss within fp32 rounding of the float64 one."""
    xs, ws, bs, xt, wt, bt, s_lab, t_lab, s_ids, t_ids, s_off, t_off = _batch(seed)
    al = uld_alignment(s_lab, t_lab, s_ids, t_ids, s_off, t_off)
    ref = fused_linear_uld(xs, ws, xt, wt, al)
    got = fused_linear_uld(xs.detach().float(), ws.detach().float(), xt.float(), wt.float(), al)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref.detach(), rtol=1e-5, atol=1e-6)


def test_align_by_byte_offsets_is_trls():
    ULDLoss = _gold()
    rng = random.Random(0)
    for _ in range(50):
        s = sorted(rng.sample(range(1, 30), rng.randint(1, 12)))
        t = sorted(rng.sample(range(1, 30), rng.randint(1, 12)))
        s_off, t_off = [(0, e) for e in s], [(0, e) for e in t]
        assert align_by_byte_offsets(s_off, t_off) == ULDLoss._align_by_byte_offsets(s_off, t_off)


@pytest.mark.parametrize("change, error, words", [
    (lambda a: dict(alignment=None), TypeError, "alignment"),
    (lambda a: dict(alignment=type(a)(**{**vars(a), "student_rows": a.student_rows + 1000})), ValueError,
     "alignment.student_rows"),
    (lambda a: dict(alignment=type(a)(**{**vars(a), "teacher_rows": a.teacher_rows[:-1]})), ValueError,
     "alignment.teacher_rows"),
    (lambda a: dict(alignment=type(a)(**{**vars(a), "student_factor_ids": a.student_factor_ids + 999})), ValueError,
     "alignment.student_factor_ids"),
    (lambda a: dict(alignment=type(a)(**{**vars(a), "teacher_rows": a.teacher_rows.float()})), TypeError,
     "alignment.teacher_rows"),
    # a weight that requires grad would have its gradient dropped unseen: the loss takes none to it
    (lambda a: dict(alignment=type(a)(**{**vars(a), "weight": a.weight.clone().requires_grad_()})), TypeError,
     "alignment.weight: expected a constant"),
    (lambda a: dict(matched=(torch.tensor([0, 1]), torch.tensor([0, 99]))), ValueError, "matched teacher ids"),
    (lambda a: dict(matched=TokenMap(torch.arange(40))), ValueError, "matched"),
    (lambda a: dict(matched=torch.tensor([0, 1])), TypeError, "matched"),
    (lambda a: dict(matched_weight=0.5), ValueError, "matched_weight"),
    (lambda a: dict(matched=(torch.tensor([0]), torch.tensor([0])), matched_weight=0.5), ValueError, "unmatched_weight"),
    (lambda a: dict(student_temperature=0.0), ValueError, "student_temperature"),
    (lambda a: dict(beta=0.3), ValueError, "beta: only with matched"),  # plain ULD has no JSD to take it
    (lambda a: dict(ce_weight=1.0), ValueError, "labels"),
    (lambda a: dict(ce_weight=1.0, labels=torch.zeros(3, dtype=torch.long)), ValueError, "labels"),
    (lambda a: dict(student_bias=torch.zeros(3, dtype=F64)), ValueError, "student_bias"),
    (lambda a: dict(chunk_size=0), ValueError, "chunk_size"),
    (lambda a: dict(student_softcap=-1.0), ValueError, "student_softcap"),
])
def test_uld_errors_name_the_argument(change, error, words, seed):
    xs, ws, bs, xt, wt, bt, s_lab, t_lab, s_ids, t_ids, s_off, t_off = _batch(seed)
    al = uld_alignment(s_lab, t_lab, s_ids, t_ids, s_off, t_off)
    kwargs = dict(alignment=al)
    kwargs.update(change(al))
    with pytest.raises(error, match=words) as info:
        fused_linear_uld(xs, ws, xt, wt, **kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("change, error, words", [
    (dict(merge="first"), ValueError, "merge"),
    (dict(student_byte_offsets=None), ValueError, "student_byte_offsets"),
    (dict(teacher_input_ids=torch.zeros(4, 3, dtype=torch.long)), ValueError, "teacher_input_ids"),
    (dict(student_labels=torch.zeros(4, 13)), ValueError, "student_labels"),
])
def test_uld_alignment_errors_name_the_argument(change, error, words, seed):
    xs, ws, bs, xt, wt, bt, s_lab, t_lab, s_ids, t_ids, s_off, t_off = _batch(seed)
    kwargs = {**dict(student_labels=s_lab, teacher_labels=t_lab, student_input_ids=s_ids, teacher_input_ids=t_ids,
                     student_byte_offsets=s_off, teacher_byte_offsets=t_off), **change}
    with pytest.raises(error, match=words) as info:
        uld_alignment(**kwargs)
    assert "\n" not in str(info.value)


def test_uld_checks_labels_it_does_not_read_and_return_parts(seed):
    """labels given with ce_weight 0 (the loss reads none): still checked as given, shape and dtype; return_parts
    a bool."""
    xs, ws, bs, xt, wt, bt, s_lab, t_lab, s_ids, t_ids, s_off, t_off = _batch(seed)
    al = uld_alignment(s_lab, t_lab, s_ids, t_ids, s_off, t_off)
    with pytest.raises(TypeError, match="labels: expected an integer dtype"):
        fused_linear_uld(xs, ws, xt, wt, al, labels=torch.zeros(xs.shape[:-1]))
    with pytest.raises(ValueError, match="labels: expected a tensor of student_input's leading dims"):
        fused_linear_uld(xs, ws, xt, wt, al, labels=torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError, match="return_parts: expected a bool, got 'no'"):
        fused_linear_uld(xs, ws, xt, wt, al, return_parts="no")
    fine = fused_linear_uld(xs, ws, xt, wt, al, labels=torch.zeros(xs.shape[:-1], dtype=torch.long))
    torch.testing.assert_close(fine, fused_linear_uld(xs, ws, xt, wt, al))
