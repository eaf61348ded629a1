"""backend="cute"'s chunk loop on CPU, its GEMM stood in for: `flashkd.backends.cute_gemm.logits` replaced by a
torch function that makes the same outputs (fp32 logits, each (row, vocab tile)'s max and sums of
2^((z − max)·k) into the planes it is handed), the Triton rows under the interpreter. What this checks is the
glue: which calls take the CuTe GEMMs, the planes each GEMM fills, the constants, the chunks and teacher
blocks, the rows' PHASE 4; the results must be the Triton backend's. The kernel itself is checked on the GPU
(probes/probe_cute_gemm.py, tests/test_exact.py -m gpu) and compiled on CPU (tests/test_cute_compile.py)."""

import pytest
import torch

pytest.importorskip("triton")

import flashkd  # noqa: E402
from flashkd import core  # noqa: E402
from flashkd.backends import cute_gemm  # noqa: E402
from helpers.ties import drop_tied_rows, logits64  # noqa: E402

TILE = 64  # the stand-in's vocab tile: several a row at V = 300


def _stand_in(calls):
    def logits(x, w, planes, k1=1.0, k2=None, out=None, **_):
        calls.append((tuple(x.shape), tuple(w.shape), planes.shape[0], k1, k2))
        z = x.float() @ w.float().t()
        assert planes.shape == ((2 if k2 is None else 3), z.shape[0], -(-z.shape[1] // TILE))
        m, sums = cute_gemm.tile_stats(z, [k1] + ([] if k2 is None else [k2]), TILE)
        planes[0] = m
        planes[1:] = torch.stack(sums)
        return z

    return logits


def _accumulate_stand_in(calls):
    def accumulate(out, a, b, add):  # dW (V, H) = / += dSᵀ · X, at fp32 like the TMA unit's reduce-add
        calls.append(("accumulate", tuple(a.shape), tuple(b.shape), add))
        z = a.float() @ b.float().t()
        return out.add_(z) if add else out.copy_(z)

    return accumulate


@pytest.fixture
def cute_on_cpu(monkeypatch):
    calls = []
    real_pick = core.backend.pick_backend
    monkeypatch.setattr(core.backend, "pick_backend", lambda b, x, *loss: "triton" if b == "cute" else real_pick(b, x, *loss))
    monkeypatch.setattr(cute_gemm, "eligible", lambda x, w: True)
    monkeypatch.setattr(cute_gemm, "n_tiles", lambda v, tile_n=TILE: -(-v // TILE))
    monkeypatch.setattr(cute_gemm, "logits", _stand_in(calls))
    monkeypatch.setattr(cute_gemm, "accumulate_eligible", lambda out, a, b: out.dtype == torch.float32)
    monkeypatch.setattr(cute_gemm, "accumulate", _accumulate_stand_in(calls))
    return calls


def _case(seed, n=37, hs=24, ht=40, v=300, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    xs, xt = torch.randn(n, hs, generator=g).to(dtype), torch.randn(n, ht, generator=g).to(dtype)
    ws, wt = (torch.randn(v, hs, generator=g) / 2).to(dtype), (torch.randn(v, ht, generator=g) / 2).to(dtype)
    y = torch.randint(v, (n,), generator=g)
    y[::5] = -100
    return xs, ws, xt, wt, y


@pytest.mark.parametrize("loss,opts,takes", [
    ("jsd", {}, True), ("jsd", {"temperature": 0.7, "beta": 0.2}, True), ("tvd", {}, True),
    ("forward_kl", {"student_logit_scale": 0.8, "teacher_logit_scale": 1.25}, True),
    ("reverse_kl", {}, False), ("cosine", {}, False), ("jsd", {"student_softcap": 20.0}, False),
])
@pytest.mark.parametrize("labels", [True, False])
def test_cute_path_gives_the_triton_results(cute_on_cpu, seed, loss, opts, takes, labels):
    xs, ws, xt, wt, y = _case(seed)
    # TVD's gradient jumps where q = p, and the two paths' softmax statistics round apart: rows tied within
    # fp32's reach count on neither side (label −100, or without labels weight 0)
    tied = drop_tied_rows(torch.zeros_like(y), logits64(xs, ws), logits64(xt, wt), loss=loss, **opts) == -100
    y = y.masked_fill(tied, -100)
    if not labels:
        y, opts = None, dict(opts, weight_hard_loss=0.0, **({"row_weight": (~tied).float()} if tied.any() else {}))
    out = {}
    for backend in ("triton", "cute"):
        a, b = xs.clone().requires_grad_(), ws.clone().requires_grad_()
        loss_ = flashkd.fused_linear_distill(a, b, xt, wt, y, loss=loss, backend=backend, chunk_size=16, **opts)
        out[backend] = (loss_, *torch.autograd.grad(loss_, (a, b)))
    # 3 chunks of at most 16 rows: a student and a teacher GEMM each, where the CuTe GEMMs take the call, and
    # the chunk's dW GEMM (stored by the first, added by the others)
    gemms = [c for c in cute_on_cpu if c[0] != "accumulate"]
    assert len(gemms) == (6 if takes else 0)
    if takes:
        tempered_ce = labels and opts.get("temperature", 1.0) != 1.0
        assert [c[2] for c in gemms] == [3 if tempered_ce else 2, 2] * 3  # the CE's own sum only then
        dw = [c for c in cute_on_cpu if c[0] == "accumulate"]
        assert [(c[1], c[2], c[3]) for c in dw] == [((300, r), (24, r), i > 0) for i, r in enumerate((16, 16, 5))]
    for got, want in zip(out["cute"], out["triton"]):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-7)


def test_cute_path_keeps_to_triton_where_its_gemm_does_not_fit(cute_on_cpu, seed):
    """Biases, a call without grad for forward KL (its loss is then taken in pass 1), return_stats: the
    Triton path, no CuTe GEMM."""
    xs, ws, xt, wt, y = _case(seed)
    bias = torch.randn(ws.shape[0])
    flashkd.fused_linear_distill(xs, ws, xt, wt, y, backend="cute", student_bias=bias)
    flashkd.fused_linear_distill(xs, ws, xt, wt, y, backend="cute", teacher_bias=bias)
    with torch.no_grad():
        flashkd.fused_linear_distill(xs, ws, xt, wt, y, loss="forward_kl", backend="cute")
    flashkd.fused_linear_distill(xs, ws, xt, wt, y, backend="cute", return_stats=True)
    assert cute_on_cpu == []
    with torch.no_grad():  # JSD without grad does take it
        flashkd.fused_linear_distill(xs, ws, xt, wt, y, backend="cute")
    assert len(cute_on_cpu) == 2


@pytest.mark.parametrize("here", [True, False])
def test_auto_takes_the_cute_gemms_for_the_losses_measured_faster(cute_on_cpu, monkeypatch, seed, here):
    """backend="auto" on an sm_90 GPU with nvidia-cutlass-dsl installed (stood in for: `_cute_here`): the CuTe
    GEMMs for JSD, TVD, forward KL, Rényi, Jeffreys (`core.backend.AUTO_CUTE_LOSSES`), not for reverse KL or cosine
    (which do not fit), DKD or AKL (whose pass 1 is more than the tiles give) nor forward KL without grad; elsewhere
    none. The results are the Triton backend's either way."""
    real_pick = core.backend.pick_backend
    monkeypatch.setattr(core.backend, "pick_backend", lambda b, x, *loss: "triton" if b in ("cute", "auto") else real_pick(b, x, *loss))
    monkeypatch.setattr(core.backend, "_cute_here", lambda x: here)
    xs, ws, xt, wt, y = _case(seed)
    xs, ws = xs.requires_grad_(), ws.requires_grad_()
    for loss, takes in (("jsd", here), ("tvd", here), ("forward_kl", here), ("reverse_kl", False), ("renyi", here),
                        ("jeffreys", here), ("dkd", False), ("akl", False)):
        del cute_on_cpu[:]
        got = flashkd.fused_linear_distill(xs, ws, xt, wt, y, loss=loss, backend="auto", chunk_size=16)
        assert len([c for c in cute_on_cpu if c[0] != "accumulate"]) == (6 if takes else 0), loss
        want = flashkd.fused_linear_distill(xs, ws, xt, wt, y, loss=loss, backend="triton", chunk_size=16)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-7)
    with torch.no_grad():  # forward KL's loss is then taken in pass 1: no CuTe GEMM
        del cute_on_cpu[:]
        flashkd.fused_linear_distill(xs, ws, xt, wt, y, loss="forward_kl", backend="auto", chunk_size=16)
        assert cute_on_cpu == []


def test_cute_here_is_false_off_hopper_and_without_the_package(monkeypatch):
    import importlib.util

    assert not core.backend._cute_here(torch.zeros(2, 8))  # CPU tensors
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    fake = torch.zeros(2, 8)
    monkeypatch.setattr(type(fake), "is_cuda", property(lambda self: True))
    core.backend._cute_on.cache_clear()  # its answer is kept for the process
    try:
        assert not core.backend._cute_here(fake)  # an sm_90 GPU, no nvidia-cutlass-dsl
    finally:
        core.backend._cute_on.cache_clear()


def test_the_gemm_refuses_what_it_cannot_run():
    """Checked before CuTe DSL is imported: a ping-pong tile wider than a warpgroup's registers hold, an unknown
    store, statistics on the reduce-add store; the dW GEMM takes no CPU tensors."""
    with pytest.raises(ValueError, match="tile_n: schedule 'pingpong' takes at most 128 columns, got 256"):
        cute_gemm._build(1, tile_n=256)
    with pytest.raises(ValueError, match="store: expected"):
        cute_gemm._build(1, store="none")
    with pytest.raises(ValueError, match="sums: store 'add' takes no statistics"):
        cute_gemm._build(1, store="add")
    out, a, b = torch.zeros(300, 24), torch.zeros(300, 16, dtype=torch.bfloat16), torch.zeros(24, 16, dtype=torch.bfloat16)
    assert not cute_gemm.accumulate_eligible(out, a, b)
    with pytest.raises(ValueError, match="accumulate: expected"):
        cute_gemm.accumulate(out, a, b, add=False)
