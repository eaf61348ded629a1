"""The chunk plan's cost model (core.plan.chunk_rows with a teacher head's width, core.plan.accum_share): which plans
it picks at the model heads, the bounds it keeps at any shape, and a call on a grown plan against the oracle (the
Triton backend on DEVICE: the GPU, or the CPU under Triton's interpreter; the oracle on the CPU)."""

import os

import pytest
import torch

import flashkd
from flashkd import core
from oracle import distill_loss

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # set by conftest when there is no GPU
DEVICE = "cpu" if INTERPRET else "cuda"  # where the Triton backend runs


def _plan(n, v, hs, ht=0, form="heads", accum=4, dtype=torch.bfloat16):
    xs, ws = torch.empty(n, hs, device="meta", dtype=dtype), torch.empty(v, hs, device="meta", dtype=dtype)
    return core.plan.chunk_rows(None, xs, ws, "triton", form, accum, v, ht)


def test_accum_share_counts_bytes_against_flops():
    # Gemma-3 4B <- 12B at 512 rows: 2·V·Hs·4 bytes at 160 FLOP a byte over 2·512·V·(3·2560 + 3840) FLOPs
    v, hs, ht = 262144, 2560, 3840
    assert core.plan.accum_share(512, v, hs, ht, 4) == pytest.approx(8 * hs * 160 / (2 * 512 * (3 * hs + ht)))
    assert core.plan.accum_share(1024, v, hs, ht, 4) == pytest.approx(core.plan.accum_share(512, v, hs, ht, 4) / 2)
    assert core.plan.accum_share(512, v, hs, ht, 2) == pytest.approx(core.plan.accum_share(512, v, hs, ht, 4) / 2)


def test_plans_at_the_model_heads():
    # the heads measured on an H200: grown to whole 1024-row chunks where the accumulator's traffic or a
    # ragged row tile cost time; the seed's and the wide-head plans as the budget gave them
    assert _plan(8192, 262144, 2560) == (512, 512)  # no teacher width: the budget's plan, 16 chunks
    assert _plan(8192, 262144, 2560, 3840) == (1024, 1024)  # Gemma-3 4B <- 12B: 8 chunks
    assert _plan(8192, 200064, 3072, 5120) == (1024, 1024)  # 13 chunks of 631 -> 8
    assert _plan(16384, 151936, 1024, 4096) == (1024, 1024)  # Qwen3 0.6B <- 8B: 19 chunks of 863 -> 16
    assert _plan(8192, 128256, 2048, 4096) == (1024, 1024)  # the seed: unchanged
    assert _plan(8192, 128256, 4096, 8192) == (1024, 1024)  # Llama-3.1 8B <- 70B: unchanged
    assert _plan(8192, 32064, 3072, 5120) == (4096, 4096)  # Phi-3: 2 chunks, nothing to gain
    assert _plan(2048, 128256, 2048, 4096) == (2048, 1024)  # one chunk (no accumulator) still wins first
    # only teacher heads with a dW accumulator: the other forms and no-dW calls keep the budget's plan
    assert _plan(8192, 262144, 2560, 3840, form="topk") == _plan(8192, 262144, 2560, form="topk")
    assert _plan(8192, 262144, 2560, 3840, accum=0) == (512, 512)


def test_a_learning_teacher_weighs_its_own_accumulator():
    """A learning teacher's dWt accumulator (2·V·Ht·A bytes a chunk) and its two GEMMs (4·R·V·Ht FLOPs) join the
    share: at the seed (1.40x the six GEMMs at 1024-row chunks on an H100) the chunks grow to 1536 rows, where the
    constant teacher's stay at 1024; still within ACCUM_GROWTH times the budget."""
    v, hs, ht = 128256, 2048, 4096
    want = 2 * v * (hs + ht) * 4 * 160 / (2 * 1024 * v * (3 * hs + 3 * ht))
    assert core.plan.accum_share(1024, v, hs, ht, 4, learning=True) == pytest.approx(want)
    xs, ws = (torch.empty(r, hs, device="meta", dtype=torch.bfloat16) for r in (8192, v))
    plan = lambda learning: core.plan.chunk_rows(None, xs, ws, "triton", "heads", 4, v, ht, learning)  # noqa: E731
    assert plan(False) == (1024, 1024) and plan(True) == (1536, 1536)


def test_grown_plans_keep_their_bounds(seed):
    g = torch.Generator().manual_seed(seed)
    budget = core.plan.LOGITS_BUDGET["triton"]
    for _ in range(500):
        n, v, hs, ht = (int(torch.randint(lo, hi, (), generator=g))
                        for lo, hi in ((1, 40000), (1000, 260000), (64, 8192), (64, 16384)))
        accum = (2, 4)[int(torch.randint(0, 2, (), generator=g))]
        base, _ = _plan(n, v, hs, 0, accum=accum)
        rows, teacher = _plan(n, v, hs, ht, accum=accum)
        assert base <= rows <= max(n, 1) and (rows == teacher or rows == n), (n, v, hs, ht, base, rows)
        if base == n:  # one chunk, no accumulator: the cost model has nothing to weigh
            assert (rows, teacher) == _plan(n, v, hs, 0, accum=accum), (n, v, hs, ht)
        if rows != base:  # grown: whole row tiles or all rows, within ACCUM_GROWTH × the budget of S + T
            assert rows % 256 == 0 or rows == n, (n, v, hs, ht, rows)
            assert rows * v * 4 * 2 <= core.plan.ACCUM_GROWTH * budget, (n, v, hs, ht, rows)
            # the formula still bounds it: the grown logits over the base plan's, and no more
            grow = core.plan.peak_bytes(n, v, hs, 2, rows, rows, form="heads", accum_bytes=accum)
            was = core.plan.peak_bytes(n, v, hs, 2, base, base, form="heads", accum_bytes=accum)
            assert grow - was <= (rows - base) * v * 4 * 2, (n, v, hs, ht, base, rows)


@pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()), reason="TRITON_INTERPRET is off and there is no "
                    "CUDA device")
@pytest.mark.parametrize("loss", ["jsd", "forward_kl", "cosine"])
def test_a_grown_plan_gives_the_oracles_results(seed, monkeypatch, loss):
    """A small budget (base plan 150-row chunks, accumulator share ≈ 0.5) grows to 256-row chunks, the last
    ragged; loss and grads at a trained head's magnitudes (logits std ≈ 4, peaks ≈ 30) against float64."""
    n, hs, ht, v = 300, 8, 12, 37
    monkeypatch.setitem(core.plan.LOGITS_BUDGET, "triton", 150 * v * 4 * 2)
    planned = []
    plan = core.plan.chunk_rows
    monkeypatch.setattr(core.plan, "chunk_rows", lambda *a, **k: planned.append(plan(*a, **k)) or planned[-1])
    xs = (torch.randn(n, hs) * 1.4).requires_grad_()
    ws = (torch.randn(v, hs) * 1.4).requires_grad_()
    xt, wt = torch.randn(n, ht) * 1.2, torch.randn(v, ht) * 1.2
    xt[::4] *= 2.5  # peaked rows
    y = torch.randint(0, v, (n,))
    y[::7] = -100
    leaves = [t.detach().to(DEVICE).requires_grad_() for t in (xs, ws)]
    out = flashkd.fused_linear_distill(*leaves, xt.to(DEVICE), wt.to(DEVICE), y.to(DEVICE), loss=loss, backend="triton")
    dxs, dws = (g.cpu() for g in torch.autograd.grad(out, leaves))
    assert planned == [(256, 256)]
    ref_x, ref_w = xs.detach().double().requires_grad_(), ws.detach().double().requires_grad_()
    ref = distill_loss(ref_x, ref_w, xt.double(), wt.double(), y, loss=loss)[0]
    rdx, rdw = torch.autograd.grad(ref, (ref_x, ref_w))
    assert abs(out.item() - ref.item()) <= 1e-5 * max(abs(ref.item()), 1.0)
    for got, want in ((dxs, rdx), (dws, rdw)):
        assert ((got.double() - want).norm() / want.norm()).item() <= 1e-5


class _OnGpu:
    """Stands for a CUDA tensor where `pick_backend` only asks where it lives and its dtype."""
    is_cuda = True
    dtype = torch.bfloat16


def test_auto_runs_the_triton_rows_on_a_gpu(monkeypatch):
    """backend "auto" on a GPU with triton: the Triton rows (every loss has its dense rows in the kernel); without
    triton, the torch rows."""
    monkeypatch.setattr(core.backend, "_has_triton", lambda: True)
    assert core.backend.pick_backend("auto", _OnGpu()) == "triton"
    monkeypatch.setattr(core.backend, "_has_triton", lambda: False)
    assert core.backend.pick_backend("auto", _OnGpu()) == "torch"


def test_routed_blocks_are_one_teachers_rows():
    """The routed form's teacher blocks: at most the plan's rows, cut at every group's start inside the chunk as
    well, covering it in order (so that a block's logits are one GEMM, and the plan's blocks are full size);
    empty groups cut nothing."""
    from flashkd.core import mixture

    starts = [0, 5, 5, 12, 30]  # four teachers, the second with no rows
    teacher = (None, None, None, starts, None, None)
    for c in (slice(0, 30), slice(3, 13), slice(12, 20)):
        for rows in (1, 4, 7, 100):
            blocks = mixture.routed_blocks(teacher, c, rows)
            assert blocks[0].start == c.start and blocks[-1].stop == c.stop
            assert all(a.stop == b.start for a, b in zip(blocks, blocks[1:]))
            for b in blocks:
                assert 0 < b.stop - b.start <= rows
                assert not any(b.start < x < b.stop for x in starts), (c, rows, b)
    assert mixture.routed_blocks(teacher, slice(0, 30), 100) == [slice(0, 5), slice(5, 12), slice(12, 30)]
