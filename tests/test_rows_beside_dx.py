"""The row pass beside the dX GEMM (`flashkd.core.pieces`, OVERLAP_PIECES): on CUDA a block's rows run on a second
stream in pieces, each piece's dX GEMM on the call's stream beside the next piece's rows. Here the pieces run
in line (a side stream that queues nothing apart, the CPU's), so that what the pieces compute — each piece's
rows, sums and dX — is checked against the call in one piece on every input that takes the path: the values,
the statistics and all gradients equal, chunk and block edges cut irregularly, ignored rows, row weights."""

import pytest
import torch

import flashkd
from conftest import DEVICE, needs_triton
from flashkd.core import pieces
from helpers.pieces import in_pieces


def test_pieces_cover_a_block_in_order(monkeypatch):
    for start, stop, parts, least, align in ((0, 1000, 4, 256, 64), (37, 1061, 4, 256, 64), (5, 300, 4, 256, 64),
                                             (0, 64, 4, 16, 64), (0, 64, 3, 16, 8), (10, 11, 3, 1, 1), (0, 2048, 4, 256, 64)):
        monkeypatch.setattr(pieces, "LEAST", least)
        monkeypatch.setattr(pieces, "ALIGN", align)
        got = pieces.cut(slice(start, stop), parts)
        assert got[0].start == start and got[-1].stop == stop and len(got) <= parts
        assert all(a.stop == b.start for a, b in zip(got, got[1:]))
        assert all(p.stop - p.start >= min(least, stop - start) for p in got[:-1])
        assert all((p.stop - p.start) % align == 0 for p in got[:-1])
    monkeypatch.setattr(pieces, "LEAST", 256)
    monkeypatch.setattr(pieces, "ALIGN", 64)
    assert [(p.start, p.stop) for p in pieces.cut(slice(0, 1024), 4)] == [(0, 256), (256, 512), (512, 768), (768, 1024)]
    assert len(pieces.cut(slice(0, 300), 4)) == 1


@pytest.mark.parametrize("form", ["heads", "logits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("loss", ["jsd", "forward_kl", "tvd"])
@needs_triton
def test_pieces_equal_one_piece(form, dtype, loss, seed, monkeypatch):
    g = torch.Generator().manual_seed(seed)
    n, v, hs, ht = 203, 70, 12, 9
    xs = torch.randn(n, hs, generator=g) * 2
    ws = torch.randn(v, hs, generator=g)
    xt = torch.randn(n, ht, generator=g) * 2
    wt = torch.randn(v, ht, generator=g)
    y = torch.randint(0, v, (n,), generator=g)
    y[::7] = -100
    rw = torch.rand(n, generator=g) + 0.5
    teacher_logits = xt @ wt.t()
    results = []
    for parts in (1, 3):
        used = in_pieces(monkeypatch, parts, least=16, align=8)
        a = xs.to(DEVICE, dtype).requires_grad_()
        w = ws.to(DEVICE, dtype).requires_grad_()
        opts = dict(labels=y.to(DEVICE), loss=loss, backend="triton", chunk_size=64, row_weight=rw.to(DEVICE),
                    return_stats=True)
        if form == "heads":
            out, stats = flashkd.fused_linear_distill(a, w, xt.to(DEVICE, dtype), wt.to(DEVICE, dtype), **opts)
        else:
            out, stats = flashkd.fused_linear_distill_logits(a, w, teacher_logits.to(DEVICE, dtype), **opts)
        out.backward()
        results.append((out.detach().cpu(), stats, a.grad.cpu(), w.grad.cpu()))
    # the pieces ran, dX a piece at a time: 64-row chunks in three pieces (24, 24, 16), the last chunk's 11 in one
    cuts = [(a[4].start, a[4].stop) for a in used]
    assert cuts[:4] == [(0, 24), (24, 48), (48, 64), (64, 88)] and cuts[-1] == (192, 203)
    (l1, s1, dx1, dw1), (l3, s3, dx3, dw3) = results
    torch.testing.assert_close(l3, l1, rtol=1e-6, atol=0)  # the sums' order moved with the pieces
    for f in ("soft_sum", "hard_sum", "entropy_sum"):
        torch.testing.assert_close(getattr(s3, f).cpu(), getattr(s1, f).cpu(), rtol=1e-6, atol=0)
    assert s3.rows.item() == s1.rows.item() == (y != -100).sum().item()
    assert torch.equal(dx3, dx1)  # each piece's rows of dL/ds and dX are the block's
    assert torch.equal(dw3, dw1)
    # and both are the loss's: the torch rows' (on the CPU) to the rounding of dL/ds to the inputs' dtype
    a, w = xs.to(dtype).requires_grad_(), ws.to(dtype).requires_grad_()
    opts = dict(labels=y, loss=loss, backend="torch", chunk_size=64, row_weight=rw)
    ref = (flashkd.fused_linear_distill(a, w, xt.to(dtype), wt.to(dtype), **opts) if form == "heads" else
           flashkd.fused_linear_distill_logits(a, w, teacher_logits.to(dtype), **opts))
    ref.backward()
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=0, atol=2e-2)
    for got, want in ((dx1, a.grad), (dw1, w.grad)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), want.float(), **{**tol, "atol": tol["atol"] * want.abs().max().item()})


@pytest.mark.gpu
@pytest.mark.parametrize("loss", ["jsd", "forward_kl"])
def test_side_stream_on_the_gpu(loss, seed, monkeypatch):
    """On CUDA, the rows on the side stream and dX in pieces: the same value, statistics and dW as one piece, dX
    within the GEMMs' rounding (cuBLAS may split a thinner GEMM otherwise), at chunks of 1536 rows (four
    pieces of 384), 3000 rows, V 5000, bf16, trained-head magnitudes, ignored rows."""
    g = torch.Generator().manual_seed(seed)
    n, v, hs, ht = 3000, 5000, 256, 384
    xs = torch.randn(n, hs, generator=g)
    ws = torch.randn(v, hs, generator=g) * (4 / hs**0.5)
    xt = torch.randn(n, ht, generator=g)
    wt = torch.randn(v, ht, generator=g) * (4 / ht**0.5)
    y = torch.randint(0, v, (n,), generator=g)
    y[::11] = -100
    results = []
    for parts in (1, 4):
        monkeypatch.setattr(pieces, "OVERLAP_PIECES", parts)
        a = xs.cuda().bfloat16().requires_grad_()
        w = ws.cuda().bfloat16().requires_grad_()
        out, stats = flashkd.fused_linear_distill(a, w, xt.cuda().bfloat16(), wt.cuda().bfloat16(), y.cuda(), loss=loss,
                                                  backend="triton", chunk_size=1536, return_stats=True)
        out.backward()
        torch.cuda.synchronize()
        results.append((out.detach().cpu(), stats.soft_sum.cpu(), a.grad.float().cpu(), w.grad.float().cpu()))
    (l1, s1, dx1, dw1), (l4, s4, dx4, dw4) = results
    torch.testing.assert_close(l4, l1, rtol=1e-6, atol=0)
    torch.testing.assert_close(s4, s1, rtol=1e-6, atol=0)
    assert torch.equal(dw4, dw1)  # dL/ds the same bits: dW's GEMM reads it whole
    torch.testing.assert_close(dx4, dx1, rtol=0, atol=1e-2 * dx1.abs().max().item())
