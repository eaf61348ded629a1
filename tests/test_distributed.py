"""Vocab-parallel and FSDP2 calls (flashkd.distributed) against the single-process call, over gloo.

Each test spawns one process group (CPU, gloo, a free loopback port) and runs many cases in it:
every rank makes the sharded call, the same call is made unsharded in the same process, and the
loss, dX and the rank's rows of dW / db must agree. fp64 inputs, so the tolerance is tight. The
unsharded call is itself checked against the float64 oracle by the other test files. The same
cases run with NCCL on GPUs through scripts/gpu_dist_check.sh (FLASHKD_DIST_BACKEND=nccl).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import flashkd
from helpers.distributed import (HS, HT, K, LAYOUTS, V, check_close, compare_sharded, flat_tensors, leaf, rank_device,
                                 sharded_inputs, spawn)
from helpers.ties import drop_tied_rows, logits64


def _vocab_parallel_worker(rank, world, seed):
    start, stop = LAYOUTS[world][rank]
    group = dist.group.WORLD
    device = rank_device()
    gen = torch.Generator().manual_seed(seed)  # the same inputs on every rank
    dtype = torch.float64
    par = dict(process_group=group, vocab_start=start)

    def both(xs, ws, bs, rest_full, rest_shard, kw_full=None, kw_shard=None):
        lf = [leaf(xs), leaf(ws), leaf(bs)]
        ls = [leaf(xs), leaf(ws[start:stop]), leaf(None if bs is None else bs[start:stop])]
        full = dict(args=[lf[0], lf[1], *rest_full], kw=dict(student_bias=lf[2], **(kw_full or {})), leaves=lf)
        shard = dict(args=[ls[0], ls[1], *rest_shard], kw=dict(student_bias=ls[2], **par, **(kw_shard or {})), leaves=ls)
        return full, shard

    heads_cases = [
        dict(loss="jsd", beta=0.3),
        dict(loss="jsd", beta=0.0, temperature=2.0),
        dict(loss="jsd", beta=1.0, temperature_squared=True, temperature=0.7),
        dict(loss="forward_kl"),
        dict(loss="reverse_kl", reduction="sum"),
        dict(loss="tvd", weight_hard_loss=0.2, weight_soft_loss=0.8),
        dict(loss="cosine", beta=0.7),
        dict(loss="cosine", weight_hard_loss=0.0, weight_soft_loss=1.0),
        dict(loss="jsd", weight_hard_loss=1.0, weight_soft_loss=0.0),  # CE alone
        dict(loss="jsd", return_soft_hard_loss=True, chunk_size=4),  # several chunks
        # the heads' transforms (elementwise: they compose with the slices), row weights, stats
        dict(loss="jsd", student_softcap=2.0, teacher_softcap=3.0, student_logit_scale=0.7, teacher_logit_scale=1.3),
        dict(loss="cosine", student_softcap=2.5, return_stats=True),
        dict(loss="reverse_kl", return_stats=True, return_soft_hard_loss=True, row_weight=True),
        dict(loss="tvd", row_weight=True, reduction="sum", chunk_size=5),
        dict(loss="jsd", chunk_size=3, check_shards=False),  # V stays a tensor: no host read of the layout
    ]
    for options in heads_cases:
        if options.get("row_weight"):
            options = dict(options, row_weight=torch.rand(11, generator=gen, dtype=torch.float64).to(device))
        for bias, padded in ((False, False), (True, True)):
            # a padded teacher head: its extra rows come after the vocab, in the last slice
            vt = V + 3 if padded else V
            xs, ws, xt, wt, labels, bs, bt = sharded_inputs(gen, 11, dtype, device, vt=vt, bias=bias)
            t_stop = vt if stop == V else stop
            pad = dict(vocab_size=V) if padded else {}  # declared padding; sharded, V is the group's whole vocab
            full, shard = both(
                xs, ws, bs, [xt, wt, labels], [xt, wt[start:t_stop], labels],
                dict(teacher_bias=bt, **pad), dict(teacher_bias=None if bt is None else bt[start:t_stop], **pad),
            )
            compare_sharded(flashkd.fused_linear_distill, f"heads {options} bias={bias}", full, shard, start, stop, **options)

    # labels=None, and no gradient at all
    xs, ws, xt, wt, _, _, _ = sharded_inputs(gen, 9, dtype, device)
    full, shard = both(xs, ws, None, [xt, wt, None], [xt, wt[start:stop], None])
    compare_sharded(flashkd.fused_linear_distill, "no labels", full, shard, start, stop, weight_hard_loss=0.0)
    with torch.no_grad():
        compare_sharded(flashkd.fused_linear_distill, "no grad", full, shard, start, stop, weight_hard_loss=0.0)

    # the dense-logits form: each rank passes its slice's columns
    for options in (dict(loss="jsd"), dict(loss="tvd", chunk_size=3), dict(loss="cosine")):
        xs, ws, xt, wt, labels, bs, _ = sharded_inputs(gen, 10, dtype, device, bias=True)
        tl = xt @ wt.t()
        full, shard = both(xs, ws, bs, [tl, labels], [tl[:, start:stop], labels])
        compare_sharded(flashkd.fused_linear_distill_logits, f"logits {options}", full, shard, start, stop, **options)

    # the top-k form: global ids, the same on every rank; some unused slots; one row with none
    for options in (
        dict(loss="forward_kl"),
        dict(loss="reverse_kl", tail="renormalize"),
        dict(loss="jsd", beta=0.4, weight_hard_loss=0.5, weight_soft_loss=0.5, temperature=1.5),
        dict(loss="tvd", chunk_size=4),
        dict(loss="forward_kl", student_softcap=2.0, student_logit_scale=1.5, return_stats=True),
        dict(loss="jsd", tail="renormalize", return_stats=True),
    ):
        xs, ws, xt, wt, labels, bs, _ = sharded_inputs(gen, 12, dtype, device, bias=True)
        ids, lp = flashkd.teacher_topk(xt, wt, K, temperature=options.get("temperature", 1.0))
        ids = ids.masked_fill(torch.rand(ids.shape, generator=gen).to(device) < 0.25, -1)
        ids[-1] = -1
        full, shard = both(xs, ws, bs, [ids, lp, labels], [ids, lp, labels])
        compare_sharded(flashkd.fused_linear_distill_topk, f"topk {options}", full, shard, start, stop, **options)
    # ids covering the whole vocab: the bucket is empty on every rank
    xs, ws, xt, wt, labels, _, _ = sharded_inputs(gen, 4, dtype, device)
    ids, lp = flashkd.teacher_topk(xt, wt, V)
    full, shard = both(xs, ws, None, [ids, lp, labels], [ids, lp, labels])
    compare_sharded(flashkd.fused_linear_distill_topk, "topk k=V", full, shard, start, stop, loss="jsd")

    # teacher_topk: the global top-k from every rank's candidates
    for k, options in ((K, {}), (1, dict(temperature=0.5)), (V - 2, dict(vocab_size=V - 2)),
                       (K, dict(teacher_softcap=1.5, teacher_logit_scale=2.0))):
        xt, wt, bt = sharded_inputs(gen, 13, dtype, device, bias=True)[2:][:2] + (None,)
        bt = torch.randn(V, generator=gen, dtype=dtype).to(device)
        want = flashkd.teacher_topk(xt, wt, k, teacher_bias=bt, **options)
        got = flashkd.teacher_topk(xt, wt[start:stop], k, teacher_bias=bt[start:stop], **par, **options)
        assert torch.equal(got[0], want[0]), ("teacher_topk ids", k)
        check_close(f"teacher_topk logprobs k={k}", got[1], want[1])
    # ids >= 3 masked by a −inf bias: whole slices −inf in every row, and k past the finite ids. As
    # unsharded: the 3 finite ids, then masked ids (which of the tied ones is open) with −inf log-probs
    xt, wt = sharded_inputs(gen, 9, dtype, device)[2:4]
    bt = torch.zeros(V, dtype=dtype, device=device)
    bt[3:] = -torch.inf
    for k in (6, 3, V):
        want = flashkd.teacher_topk(xt, wt, k, teacher_bias=bt)
        got = flashkd.teacher_topk(xt, wt[start:stop], k, teacher_bias=bt[start:stop], **par)
        n = min(k, 3)
        assert torch.equal(got[0][:, :n], want[0][:, :n]), ("teacher_topk masked ids", k)
        check_close(f"teacher_topk masked logprobs k={k}", got[1][:, :n], want[1][:, :n])
        assert torch.isfinite(want[1][:, :n]).all() and torch.isneginf(want[1][:, n:]).all()
        rest = got[0][:, n:]
        assert (rest >= 3).all() and (rest < V).all(), ("teacher_topk masked: the tied ids are masked ones", k)
        assert (rest.sort(-1).values.diff(dim=-1) > 0).all(), ("teacher_topk masked: distinct ids", k)
        assert torch.isneginf(got[1][:, n:]).all()

    # modules take the same options
    xs, ws, xt, wt, labels, _, _ = sharded_inputs(gen, 8, dtype, device)
    full, shard = both(xs, ws, None, [xt, wt, labels], [xt, wt[start:stop], labels])
    module = flashkd.FusedLinearDistillLoss("jsd", process_group=group, vocab_start=start)
    got = module(*shard["args"])
    check_close("module", got, flashkd.fused_linear_distill(*full["args"]))

    # an out-of-range label: NaN on its row, not a silently wrong value (check_labels off)
    labels = labels.clone()
    labels[1] = V + 1
    got = flashkd.fused_linear_distill(xs, ws[start:stop], xt, wt[start:stop], labels, check_labels=False, **par)
    assert torch.isnan(got), "an out-of-range label"

    _bad_inputs(rank, world, group, start, stop, device, gen)


def _raises(exc, match, fn, *args, **kw):
    with pytest.raises(exc, match=match):
        fn(*args, **kw)


def _bad_inputs(rank, world, group, start, stop, device, gen):
    xs, ws, xt, wt, labels, _, _ = sharded_inputs(gen, 6, torch.float64, device)
    call = flashkd.fused_linear_distill

    def sharded(vocab_start, lo=start, hi=stop, **kw):
        return call(xs, ws[lo:hi], xt, wt[lo:hi], labels, process_group=group, vocab_start=vocab_start, **kw)

    # every rank raises the same error (none is left waiting in a collective)
    _raises(ValueError, "overlap", sharded, start - 1 if start > 0 else 0, lo=max(start - 1, 0))
    _raises(ValueError, "gap", sharded, start + 1 if start > 0 else 0, lo=min(start + 1, stop - 1) if start > 0 else start)
    _raises(ValueError, "vocab_start: expected a value >= 0", sharded, -1 if rank == 0 else start)
    _raises(TypeError, "vocab_start: expected an int", sharded, None if rank == world - 1 else start)
    _raises(TypeError, "process_group: expected", call, xs, ws, xt, wt, labels, process_group="world", vocab_start=0)
    _raises(ValueError, "vocab_start: expected None without process_group", call, xs, ws, xt, wt, labels, vocab_start=0)
    _raises(ValueError, r"labels: expected values in \[0, 37\)", call, xs, ws[start:stop], xt, wt[start:stop],
            labels.masked_fill(labels == labels.max(), V), process_group=group, vocab_start=start, check_labels=True)
    # replicated rows that differ between ranks: only checked when asked for
    moved = xs + (rank == 1) * 1e-3
    call(moved, ws[start:stop], xt, wt[start:stop], labels, process_group=group, vocab_start=start)
    _raises(ValueError, r"student_input: expected the same tensor on every rank .* rank\(s\) \[1\]",
            call, moved, ws[start:stop], xt, wt[start:stop], labels, process_group=group, vocab_start=start,
            check_replicas=True)
    # the same non-finite rows on every rank are the same rows (NaN == NaN was False: every rank "differed")
    odd = xs.clone()
    odd[0, 0], odd[1, :2] = float("nan"), torch.tensor([torch.inf, -torch.inf], dtype=odd.dtype)
    got = call(odd, ws[start:stop], xt, wt[start:stop], labels, process_group=group, vocab_start=start,
               check_replicas=True)
    assert torch.isnan(got), "NaN rows: a NaN loss"
    _raises(ValueError, r"student_input: expected the same tensor on every rank .* rank\(s\) \[1\]",
            call, odd + (rank == 1) * 1e-3, ws[start:stop], xt, wt[start:stop], labels, process_group=group,
            vocab_start=start, check_replicas=True)


@pytest.mark.parametrize("world", [2, 3])
def test_vocab_parallel_equals_unsharded(world, seed):
    spawn(_vocab_parallel_worker, world, seed)


# The Triton rows' sharded phases: a vocab wide enough that the slices span several tiles of the
# interpreter's 256 columns, a slice of one column, and one of exactly one tile.
TV = 700
TRITON_LAYOUTS = {1: [(0, TV)], 2: [(0, 256), (256, TV)], 3: [(257, TV), (0, 256), (256, 257)]}


def _triton_worker(rank, world, seed, dtype_name):
    """Sharded calls on backend="triton" equal the unsharded Triton call (itself held to the float64
    oracle elsewhere): fp32 reductions reordered only. Dense forms: the row kernel's phases; top-k: the
    stats kernel's outputs merged."""
    from flashkd.distributed.vocab import ShardedVocab

    start, stop = TRITON_LAYOUTS[world][rank]
    group, device = dist.group.WORLD, rank_device()
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, dtype_name)
    gathers = []
    original = ShardedVocab.gather_rows

    def counted(self, part):
        gathers.append(part.shape)
        return original(self, part)

    ShardedVocab.gather_rows = counted  # the kernels' phases ran, not the torch definition
    tol = 2e-5 if dtype == torch.float32 else 2e-2  # bf16: dL/ds rounded once more or less near a tie

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype=dtype, device=device)

    def run(fn, args, options, grad):
        outs = []
        for sharded in (False, True):
            xs, ws, teacher, labels = args
            ws = ws[start:stop] if sharded else ws
            if sharded and len(teacher) == 1:  # the dense logits: the slice's columns
                teacher = (teacher[0][:, start:stop],)
            elif sharded and teacher[1].shape[0] == TV:  # a teacher head: its slice (top-k ids stay global)
                teacher = (teacher[0], teacher[1][start:stop])
            x, w = xs.clone().requires_grad_(grad), ws.clone().requires_grad_(grad)
            extra = dict(process_group=group, vocab_start=start) if sharded else {}
            before = len(gathers)
            out = fn(x, w, *teacher, labels, backend="triton", **options, **extra)
            assert not sharded or len(gathers) > before, "the sharded call ran the Triton phases"
            flat = flat_tensors(out)
            grads = torch.autograd.grad(flat[0], (x, w)) if grad else ()
            outs.append((flat, grads))
        (want, dwant), (got, dgot) = outs
        for i, (g, w) in enumerate(zip(got, want)):
            check_close(f"{options} grad={grad}: output {i}", g, w, tol)
        if grad:
            check_close(f"{options}: dX", dgot[0], dwant[0], tol)
            check_close(f"{options}: dW", dgot[1], dwant[1][start:stop], tol)

    cases = [
        dict(loss="jsd", beta=0.3),
        dict(loss="jsd", temperature=2.0, return_soft_hard_loss=True, chunk_size=3),
        dict(loss="forward_kl"),
        dict(loss="forward_kl", temperature=0.5, return_stats=True),
        dict(loss="reverse_kl", reduction="sum"),
        dict(loss="tvd", weight_hard_loss=0.2, weight_soft_loss=0.8),
        dict(loss="cosine", beta=0.7),
        dict(loss="jsd", weight_hard_loss=1.0, weight_soft_loss=0.0),  # CE alone
        dict(loss="jsd", student_softcap=3.0, teacher_softcap=4.0, student_logit_scale=0.7, teacher_logit_scale=1.3,
             return_stats=True),
        dict(loss="reverse_kl", student_logit_scale=-0.8, row_weight=True, return_soft_hard_loss=True),
        dict(loss="tvd", chunk_size=4, check_shards=False),
    ]
    n = 9
    for options in cases:
        if options.get("row_weight"):
            options = dict(options, row_weight=torch.rand(n, generator=gen).to(device))
        xs, ws = rand(n, HS), rand(TV, HS, scale=1.5)
        xt, wt = rand(n, HT), rand(TV, HT, scale=1.5)
        labels = torch.randint(0, TV, (n,), generator=gen).to(device)
        labels[::4] = -100
        labels[1], labels[3], labels[5] = 256, 0, TV - 1  # a slice's first column; a one-column slice's (world 3)
        labels = drop_tied_rows(labels, logits64(xs, ws), logits64(xt, wt), **options)
        for grad in (True, False):
            run(flashkd.fused_linear_distill, (xs, ws, (xt, wt), labels), options, grad)
    # the dense-logits form, labels None
    for options in (dict(loss="jsd", weight_hard_loss=0.0), dict(loss="forward_kl", weight_hard_loss=0.0, chunk_size=4)):
        xs, ws = rand(n, HS), rand(TV, HS, scale=1.5)
        logits = rand(n, TV, scale=3.0)
        run(flashkd.fused_linear_distill_logits, (xs, ws, (logits,), None), options, True)
    # the top-k form: the stats kernel over each slice, its outputs merged, the expand kernel on the slice
    # (fp32 with several slices: the interpreter's top-k kernels are slow, and the merges are what differ)
    for options in () if dtype != torch.float32 or world == 1 else (dict(loss="forward_kl"), dict(loss="reverse_kl", tail="renormalize"),
                    dict(loss="jsd", beta=0.4, temperature=1.5, return_stats=True),
                    dict(loss="tvd", chunk_size=4, student_softcap=2.0, student_logit_scale=1.5),
                    dict(loss="jsd", tail="renormalize", return_stats=True, weight_hard_loss=0.0, weight_soft_loss=1.0),
                    dict(loss="forward_kl", tail_clamp=1e-7, return_stats=True)):
        xs, ws = rand(n, HS), rand(TV, HS, scale=1.5)
        ids, lp = flashkd.teacher_topk(rand(n, HT), rand(TV, HT, scale=1.5), K)
        for row, at, id_ in ((0, 1, 256), (2, 0, TV - 1)):  # a one-column slice's id (world 3), the last id
            ids[row][ids[row] == id_] = ids[row, at].item()  # where the row has it already: swapped, so ids
            ids[row, at] = id_  # stay distinct (any seed)
        ids[3] = -1  # a row with no teacher ids
        ids[4, :2] = -1
        labels = torch.randint(0, TV, (n,), generator=gen).to(device)
        labels[::4] = -100
        labels[1] = 256
        labels = drop_tied_rows(labels, logits64(xs, ws), ids=ids, logprobs=lp, **options)
        for grad in (True, False):
            run(flashkd.fused_linear_distill_topk, (xs, ws, (ids, lp), labels), options, grad)
    # teacher_topk: each slice's candidates from the top-k kernel, merged; the same ids as unsharded, and
    # log-probs within fp32 (a masked tail: whole slices −inf in some rows)
    # (a softcap far from saturating: tanh rounds to ±1 in fp32 past |y| ≈ 9, and exact ties have no one order)
    for k, options in () if dtype != torch.float32 or world != 3 else (
            (K, {}), (1, dict(temperature=0.5)), (K, dict(teacher_softcap=6.0, teacher_logit_scale=0.7))):
        xt, wt, bt = rand(n, HT), rand(TV, HT, scale=1.5), rand(TV)
        bt[300:] = -torch.inf
        want = flashkd.teacher_topk(xt, wt, k, teacher_bias=bt, backend="triton", **options)
        got = flashkd.teacher_topk(xt, wt[start:stop], k, teacher_bias=bt[start:stop], backend="triton",
                                   process_group=group, vocab_start=start, **options)
        assert torch.equal(got[0], want[0]), ("teacher_topk ids", k, options)
        check_close(f"teacher_topk {k} {options}", got[1], want[1], tol)
    # a label out of [0, V) with check_labels off: NaN, as unsharded
    xs, ws, xt, wt = rand(n, HS), rand(TV, HS), rand(n, HT), rand(TV, HT)
    labels = torch.randint(0, TV, (n,), generator=gen).to(device)
    labels[2] = TV + 3
    got = flashkd.fused_linear_distill(xs, ws[start:stop], xt, wt[start:stop], labels, backend="triton",
                                       check_labels=False, process_group=group, vocab_start=start)
    assert torch.isnan(got), "an out-of-range label"


@pytest.mark.parametrize("world,dtype", [(1, "float32"), (2, "float32"), (3, "float32"), (3, "bfloat16")])
def test_vocab_parallel_triton_rows_equal_unsharded(world, dtype, seed):
    pytest.importorskip("triton")
    spawn(_triton_worker, world, seed, dtype, timeout=600)


def _one_rank_differs_worker(rank, world, seed):
    """Calls wrong on one rank only (the last): every rank raises the same error at once, none waits
    in a collective (the group's timeout is short: a rank left waiting fails the test)."""
    import time

    group, device = dist.group.WORLD, rank_device()
    start, stop = LAYOUTS[world][rank]
    gen = torch.Generator().manual_seed(seed)
    xs, ws, xt, wt, labels, _, _ = sharded_inputs(gen, 6, torch.float64, device)
    odd = rank == world - 1
    par = dict(process_group=group, vocab_start=start)
    ids, lp = flashkd.teacher_topk(xt, wt, K)
    tl = xt @ wt.t()

    def heads(xs=xs, ws=ws[start:stop], xt=xt, wt=wt[start:stop], labels=labels, **kw):
        return flashkd.fused_linear_distill(xs, ws, xt, wt, labels, **par, **kw)

    def logits(ws=ws[start:stop], tl=tl[:, start:stop], **kw):
        return flashkd.fused_linear_distill_logits(xs, ws, tl, labels, **par, **kw)

    def topk(ws=ws[start:stop], ids=ids, lp=lp, labels=labels, **kw):
        return flashkd.fused_linear_distill_topk(xs, ws, ids, lp, labels, **{"weight_hard_loss": 0.5, **par, **kw})

    def targets(wt=wt[start:stop], k=K, xt=xt, **kw):
        return flashkd.teacher_topk(xt, wt, k, **par, **kw)

    def at(vocab_start):
        return lambda: flashkd.fused_linear_distill(xs, ws[start:stop], xt, wt[start:stop], labels, process_group=group,
                                                    vocab_start=vocab_start)

    def wider(x):  # one more hidden column
        return torch.cat([x, x[:, :1]], 1)

    def at_row_1(x, value):  # row 1 counts (rows 0 and 4 are ignored)
        x = x.clone()
        x.view(x.shape[0], -1)[1, 0] = value
        return x

    empty = slice(stop, stop) if odd else slice(start, stop)
    cases = [
        # a check that fails on one rank: an empty vocab slice (each form and teacher_topk), a bad option,
        # a tensor of the wrong shape or dtype
        (ValueError, r"student_weight: expected a 2-D \(vocab, hidden\) tensor, both >= 1, got shape \(0, 6\)",
         heads, dict(ws=ws[empty], wt=wt[empty])),
        (ValueError, r"student_weight: expected a 2-D", logits, dict(ws=ws[empty], tl=tl[:, empty])),
        (ValueError, r"student_weight: expected a 2-D", topk, dict(ws=ws[empty])),
        (ValueError, r"teacher_weight: expected a 2-D \(vocab, hidden\) tensor, both >= 1", targets, dict(wt=wt[empty])),
        (ValueError, r"beta: expected a value in \[0, 1\], got 2.0", heads, dict(beta=2.0 if odd else 0.5)),
        (TypeError, r"labels: expected an integer dtype", heads, dict(labels=labels.double() if odd else labels)),
        (ValueError, r"teacher_input: expected shape", targets, dict(xt=xt[:, :-1] if odd else xt)),
        (ValueError, r"row_weight: expected", heads, dict(row_weight=torch.ones(5 if odd else 6, dtype=torch.float64, device=device))),
        (TypeError, r"check_shards: expected a bool or None", heads, dict(check_shards="yes" if odd else None)),
        # ints too large for a float or for int64 (their repr past 4300 digits raises)
        (TypeError, r"temperature: expected a finite Python float, got ~10\*\*400 \(an int too large for a float\)",
         heads, dict(temperature=10**400 if odd else 1.0)),
        (ValueError, r"vocab_start: expected an int64 value .*, got 1180591620717411303424", at(2**70 if odd else start),
         {}),
        (ValueError, r"chunk_size: expected the same value on every rank", heads, dict(chunk_size=10**5000 if odd else 3)),
        # options that differ between ranks, each valid: named on every rank
        (ValueError, r"temperature: expected the same value on every rank of process_group", heads,
         dict(temperature=2.0 if odd else 1.0)),
        (ValueError, r"loss: expected the same value on every rank", heads, dict(loss="tvd" if odd else "jsd")),
        (ValueError, r"beta: expected the same value on every rank", logits, dict(beta=0.3 if odd else 0.5)),
        (ValueError, r"weight_hard_loss: expected the same value on every rank", topk,
         dict(weight_hard_loss=0.25 if odd else 0.5)),
        (ValueError, r"weight_soft_loss: expected the same value", heads, dict(weight_soft_loss=0.25 if odd else 0.5)),
        (ValueError, r"reduction: expected the same value", heads, dict(reduction="sum" if odd else "mean")),
        (ValueError, r"temperature_squared: expected the same value", heads, dict(temperature_squared=odd)),
        (ValueError, r"ignore_index: expected the same value", heads, dict(ignore_index=-1 if odd else -100)),
        (ValueError, r"student_softcap: expected the same value", heads, dict(student_softcap=3.0 if odd else None)),
        (ValueError, r"chunk_size: expected the same value", heads, dict(chunk_size=2 if odd else 3)),
        (ValueError, r"tail: expected the same value", topk, dict(tail="renormalize" if odd else "bucket")),
        (ValueError, r"k: expected the same value", targets, dict(k=K - 1 if odd else K)),
        (ValueError, r"temperature: expected the same value", targets, dict(temperature=0.5 if odd else 1.0)),
        (ValueError, r"labels given: expected the same value", heads,
         dict(labels=None if odd else labels, weight_hard_loss=0.0)),
        (ValueError, r"student_input: expected the same number of rows on every rank", heads,
         dict(xs=xs[:5] if odd else xs, xt=xt[:5] if odd else xt, labels=labels[:5] if odd else labels)),
        (ValueError, r"teacher_input: expected the same number of rows on every rank", targets,
         dict(xt=xt[:5] if odd else xt)),
        # hidden sizes that differ, each call right on its rank: dX's all-reduce aborted both processes
        (ValueError, r"student_input's hidden size: expected the same value on every rank", heads,
         dict(xs=leaf(wider(xs) if odd else xs), ws=leaf(wider(ws[start:stop]) if odd else ws[start:stop]))),
        (ValueError, r"teacher_input's hidden size: expected the same value on every rank", heads,
         dict(xt=wider(xt) if odd else xt, wt=wider(wt[start:stop]) if odd else wt[start:stop])),
        (ValueError, r"teacher_input's hidden size: expected the same value on every rank", targets,
         dict(xt=wider(xt) if odd else xt, wt=wider(wt[start:stop]) if odd else wt[start:stop])),
        # values checked against the group's vocab, which only the exchange gives: they raised on one rank alone
        (ValueError, r"labels: expected values in \[0, 37\) or ignore_index=-100, got 40", heads,
         dict(labels=at_row_1(labels, V + 3) if odd else labels, check_labels=True)),
        (ValueError, r"labels: expected values in \[0, 37\) or ignore_index=-100, got -7", topk,
         dict(labels=at_row_1(labels, -7) if odd else labels)),  # check_labels=None: on CPU tensors, on
        (ValueError, r"teacher_ids: expected ids in \[0, 37\) or -1 \(unused slot\), got 39", topk,
         dict(ids=at_row_1(ids, V + 2) if odd else ids)),
        (ValueError, r"teacher_ids: expected ids in \[0, 37\) or -1 \(unused slot\), got -2", topk,
         dict(ids=at_row_1(ids, -2) if odd else ids, check_teacher=True)),
        (ValueError, r"teacher_logprobs: expected log-probabilities <= 0", topk, dict(lp=at_row_1(lp, 0.5) if odd else lp)),
        # checked after the exchange: a wrong value on one rank raised there alone
        (ValueError, r"grad_accum_dtype: expected the same value on every rank", heads,
         dict(xs=leaf(xs), grad_accum_dtype=torch.float16 if odd else None)),
    ]
    try:
        import triton  # noqa: F401
    except ImportError:
        pass
    else:  # the backends' merges are different collectives: "triton" beside "torch" (on fp32) is refused
        cases.append((ValueError, r"backend: expected the same value on every rank", heads,
                      dict(xs=xs.float(), ws=ws[start:stop].float(), xt=xt.float(), wt=wt[start:stop].float(),
                           backend="torch" if odd else "triton")))
    for exc, match, fn, kw in cases:
        began = time.monotonic()
        _raises(exc, match, fn, **kw)
        assert time.monotonic() - began < 10, (match, "every rank raised, but after waiting")
    # the group is in step after all that: a right call is the unsharded one; an id or label out of range in
    # a row that does not count (its label ignore_index) is no error, as in an unsharded call
    bad_ignored = ids.clone()
    bad_ignored[0, 0] = V + 2
    check_close("an ignored row", topk(ids=bad_ignored if odd else ids),
           flashkd.fused_linear_distill_topk(xs, ws, ids, lp, labels, weight_hard_loss=0.5))
    check_close("after the errors", heads(), flashkd.fused_linear_distill(xs, ws, xt, wt, labels))
    got = targets()
    assert torch.equal(got[0], ids)
    # agreeing options that are equal values of other types: 2 and 2.0
    check_close("2 and 2.0", heads(temperature=2 if odd else 2.0), flashkd.fused_linear_distill(xs, ws, xt, wt, labels,
                                                                                          temperature=2.0))


def test_a_call_wrong_on_one_rank_raises_on_every_rank_at_once(seed):
    spawn(_one_rank_differs_worker, 2, seed, timeout=20)


class _Student(torch.nn.Module):
    """A tiny LM: embedding, one layer, and a head the loss reads (forward returns hidden states)."""

    def __init__(self, bias):
        super().__init__()
        self.embed = torch.nn.Embedding(V, HS)
        self.layer = torch.nn.Linear(HS, HS)
        self.lm_head = torch.nn.Linear(HS, V, bias=bias)

    def forward(self, tokens):
        return torch.tanh(self.layer(self.embed(tokens)))


def _fsdp_worker(rank, world, seed, backend="torch"):
    """The FSDP2 routes' training steps against the unsharded model's. backend "torch": fp64, tight; "triton":
    fp32 through the Triton rows' sharded phases (on the rows route), held to fp32's rounding."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from flashkd import core
    from flashkd.distributed import fsdp
    from flashkd.losses import LossSpec

    device = rank_device()
    mesh = init_device_mesh(device.type, (world,))
    dtype = torch.float64 if backend == "torch" else torch.float32
    tol, tol_steps = (1e-9, 1e-9) if backend == "torch" else (1e-5, 1e-4)  # fp32: three SGD steps of rounding
    gen = torch.Generator().manual_seed(seed)
    counts = [5 + 2 * r for r in range(world)]  # each rank's own batch, of its own length
    steps = 3
    batches = [[torch.randint(0, V, (1, n), generator=gen).to(device) for n in counts] for _ in range(steps)]
    labels = [[torch.randint(0, V, (1, n), generator=gen).to(device) for n in counts] for _ in range(steps)]
    for step in labels:
        for y in step:
            y[0, ::3] = -100
    xt = [[torch.randn(1, n, HT, generator=gen, dtype=dtype).to(device) for n in counts] for _ in range(steps)]
    wt = torch.randn(V, HT, generator=gen, dtype=dtype).to(device)

    def loss_fn(form, h, w, b, step, r, wt_arg, **kw):
        kw["backend"] = backend  # torch: fp64 math on GPUs too
        if form == "heads":
            return flashkd.fused_linear_distill(h, w, xt[step][r], wt_arg, labels[step][r], student_bias=b, **kw)
        if form == "topk":
            ids, lp = flashkd.teacher_topk(xt[step][r], wt, K)
            return flashkd.fused_linear_distill_topk(h, w, ids, lp, labels[step][r], student_bias=b,
                                                     weight_hard_loss=0.5, weight_soft_loss=0.5, **kw)
        logits = xt[step][r] @ wt.t()
        return flashkd.fused_linear_distill_logits(h, w, logits, labels[step][r], student_bias=b, **kw)

    cases = [
        ("heads", "rows", False, False, dict(loss="jsd", chunk_size=4)),
        ("heads", "rows", True, True, dict(loss="forward_kl", student_softcap=3.0, teacher_softcap=4.0)),
        ("heads", "heads", True, False, dict(loss="tvd")),
        ("heads", "auto", False, True, dict(loss="jsd", reduction="sum")),
        ("topk", "rows", False, False, dict(loss="forward_kl")),
        ("logits", "auto", True, False, dict(loss="reverse_kl")),
    ]
    for form, gather, bias, sharded_teacher, options in cases:
        case = f"{form} {gather} bias={bias} sharded_teacher={sharded_teacher} {options}"
        torch.manual_seed(seed)
        ref = _Student(bias).to(device=device, dtype=dtype)
        model = _Student(bias).to(device=device, dtype=dtype)
        model.load_state_dict(ref.state_dict())
        fully_shard(model.lm_head, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        wt_arg = distribute_tensor(wt, mesh, [Shard(0)]) if sharded_teacher else wt
        for step in range(steps):
            # the unsharded model on every rank's batch: the mean of the ranks' losses
            ref_losses = [loss_fn(form, ref(batches[step][r]), ref.lm_head.weight, ref.lm_head.bias, step, r, wt, **options)
                          for r in range(world)]
            opt_ref.zero_grad()
            (sum(ref_losses) / world).backward()
            opt_ref.step()
            head = model.lm_head.weight
            assert isinstance(head, DTensor), case
            mine = loss_fn(form, model(batches[step][rank]), head, model.lm_head.bias, step, rank, wt_arg,
                           fsdp_gather=gather, **options)
            check_close(f"{case}: step {step} loss", mine.detach(), ref_losses[rank].detach(), tol)
            opt.zero_grad()
            mine.backward()
            assert isinstance(head.grad, DTensor) and head.grad.placements == head.placements, case
            opt.step()
        for (name, p_ref), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
            check_close(f"{case}: {name} after {steps} steps", p.full_tensor(), p_ref.detach(), tol_steps)
    if backend != "torch":
        return

    # the route formulas: rows when the union's rows are fewer than the vocab's, heads otherwise
    w = distribute_tensor(torch.randn(V, HS, dtype=dtype, device=device), mesh, [Shard(0)])
    args = dict(teacher_input=torch.zeros(1, HT, dtype=dtype, device=device))
    call = core.call.Call(LossSpec(), core.call.Student(None, w), core.call.Heads(args["teacher_input"], None))
    few = fsdp.route_bytes(call, {}, 8, world)
    many = fsdp.route_bytes(call, {}, 4 * V, world)
    assert few["rows"] < few["heads"] and many["rows"] > many["heads"], (few, many)

    # teacher_topk of a DTensor teacher head: each rank its own rows' global top-k
    for gather in ("rows", "heads"):
        wt_d = distribute_tensor(wt, mesh, [Shard(0)])
        want = flashkd.teacher_topk(xt[0][rank], wt, K)
        got = flashkd.teacher_topk(xt[0][rank], wt_d, K, fsdp_gather=gather)
        assert torch.equal(got[0], want[0]), ("teacher_topk ids", gather)
        check_close(f"teacher_topk {gather}", got[1], want[1])

    # errors every rank raises alike
    model = _Student(False).to(device=device, dtype=dtype)
    fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    h = model(batches[0][rank])
    logits = xt[0][rank] @ wt.t()
    _raises(ValueError, "not available for dense teacher logits", flashkd.fused_linear_distill_logits, h,
            model.lm_head.weight, logits, labels[0][rank], fsdp_gather="rows")
    _raises(ValueError, "fsdp_gather: expected", flashkd.fused_linear_distill, h, model.lm_head.weight, xt[0][rank],
            wt, labels[0][rank], fsdp_gather="both")
    from torch.distributed.tensor import Replicate

    replicated = distribute_tensor(torch.randn(V, HS, dtype=dtype, device=device), mesh, [Replicate()])
    _raises(TypeError, "student_weight: expected a local torch.Tensor or a DTensor sharded on dim 0",
            flashkd.fused_linear_distill, h, replicated, xt[0][rank], wt, labels[0][rank])


def test_fsdp2_training_steps_equal_unsharded(seed):
    spawn(_fsdp_worker, 2, seed)


def test_fsdp2_training_steps_on_the_triton_rows_equal_unsharded(seed):
    pytest.importorskip("triton")
    spawn(_fsdp_worker, 2, seed, "triton", timeout=600)

