"""The FP8 teacher head (flashkd.fp8) on CPU: the quantisation's definition and its Triton twin (on DEVICE:
the GPU, or the CPU under the interpreter), the cache, the argument checks, and the whole loss through CPU
torch._scaled_mm against the float64 oracle fed the dequantised teacher logits. The GPU suite runs the cuBLAS
path."""

import os
import zlib

import pytest
import torch

import flashkd
from flashkd import fp8
from flashkd.backends import triton_fp8
from helpers.cases import check_against_oracle, read
from helpers.ties import drop_tied_rows, logits64
from oracle import distill_loss

E4M3 = torch.float8_e4m3fn
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # set by conftest when there is no GPU
DEVICE = "cpu" if INTERPRET else "cuda"  # where the Triton kernels run
needs_kernels = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()),
                                   reason="TRITON_INTERPRET is off and there is no CUDA device")


def _quantize(x, scaling, mp, kp):
    """`triton_fp8.quantize` of x on DEVICE, its (q, scale) back on the CPU."""
    return tuple(t.cpu() for t in triton_fp8.quantize(x.to(DEVICE), scaling, mp, kp))


def _bits(q):
    return q.view(torch.uint8)


def _values():
    """Every finite e4m3 value, the midpoints between neighbours (ties), one fp32 ulp either side of
    each midpoint, and random values, all in [-448, 448], ±0 included."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).float()
    pos = codes[torch.isfinite(codes) & (codes >= 0)].unique()
    mid = (pos[1:] + pos[:-1]) / 2
    near = torch.cat([mid, mid.nextafter(torch.tensor(0.0)), mid.nextafter(torch.tensor(1e9)), pos])
    rand = torch.rand(4000) * 448
    v = torch.cat([near, rand, torch.tensor([0.0, 2.0**-10, 2.0**-11, 3 * 2.0**-11])])
    return torch.cat([v, -v])


@needs_kernels
def test_the_kernels_e4m3_rounding_is_torchs_cast_bit_for_bit():
    v = _values()
    # scale 448 / a = 1 exactly: a row whose max is 448 quantises every value to e4m3_rn(value)
    x = torch.cat([v, torch.tensor([448.0])]).reshape(1, -1)
    q, s = _quantize(x, "rowwise", 1, -(-x.shape[1] // 16) * 16)
    assert s.item() == 1.0
    assert torch.equal(_bits(q[0, : x.shape[1]]), _bits(x[0].to(E4M3)))
    assert _bits(q[0, x.shape[1]:]).eq(0).all()  # padded columns


@needs_kernels
@pytest.mark.parametrize("scaling", ["rowwise", "1x128"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,k", [(1, 1), (5, 37), (33, 300), (7, 1000), (3, 128)])
def test_the_triton_quantisation_is_the_reference_bit_for_bit(scaling, dtype, m, k):
    g = torch.Generator().manual_seed(m * 1000 + k)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    x[0, 0] = -0.0
    if m > 2:
        x[1] = 0  # a row of zeros
        x[2, : min(k, 5)] *= 1000  # outliers in one group
    rows_to = 16
    got = _quantize(x, scaling, -(-m // rows_to) * rows_to, -(-k // 16) * 16)
    want = fp8.quantize_reference(x, scaling, rows_to=rows_to)
    assert got[0].shape == want[0].shape and got[1].shape == want[1].shape
    assert torch.equal(_bits(got[0]), _bits(want[0]))
    assert torch.equal(got[1], want[1])


@pytest.mark.parametrize("scaling", ["rowwise", "1x128"])
def test_quantisation_error_is_within_half_an_e4m3_ulp(scaling):
    x = torch.randn(9, 700, dtype=torch.float64).float() * torch.logspace(-3, 3, 9)[:, None]
    q, s = fp8.quantize_reference(x, scaling)
    back = fp8.dequantize(q, s)[:, :700]
    group = 704 if scaling == "rowwise" else 128
    scale = fp8.dequantize(torch.ones_like(q), s)[:, :700]  # each element's group scale
    # normal e4m3 values: a relative error of at most 2^-4; below 2^-6 · scale, the subnormals' 2^-10 · scale
    bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6)
    assert ((back - x).abs() <= bound).all()
    assert q.shape == (9, 704) and s.shape == (9, -(-704 // group))


@needs_kernels
def test_zero_and_huge_rows_get_finite_scales_and_a_nan_row_stays_nan():
    x = torch.zeros(5, 256)
    x[4, 7] = float("-inf")
    x[1] = 3.0e38  # near fp32's max; bf16 holds it too
    x[2, 0] = 1e-30
    x[3, 5] = float("nan")
    x[3, 200] = float("inf")
    for scaling in ("rowwise", "1x128"):
        for impl in (fp8.quantize_reference, lambda x, s: _quantize(x, s, 5, 256)):
            q, s = impl(x, scaling)
            assert torch.isfinite(s[:3]).all() and (s[:3] > 0).all()
            back = fp8.dequantize(q, s)
            assert back[0].eq(0).all()
            assert torch.isfinite(back[1]).all() and torch.allclose(back[1], x[1], rtol=2.0**-4)
            assert back[2, 0].item() == pytest.approx(1e-30, rel=2.0**-4)
            assert torch.isnan(back[3, :128]).all()  # the NaN's group (the whole row, rowwise)
            assert torch.isnan(back[3, 128:]).all()  # the inf's group
            assert torch.isnan(back[4, :128]).all() and back[4, 128:].isnan().all() == (scaling == "rowwise")
            ref = fp8.quantize_reference(x, scaling)[0]
            nan = ref.float().isnan()  # a NaN's bits are the platform's (the GPU's e4m3 NaN is 0x7f, the CPU's 0xff)
            assert torch.equal(q.float().isnan(), nan) and torch.equal(_bits(q)[~nan], _bits(ref)[~nan])


def test_one_outlier_sets_only_its_groups_scale_with_1x128():
    x = torch.randn(2, 384)
    x[0, 3] = 1000.0
    _, s = fp8.quantize_reference(x, "1x128")
    _, s_row = fp8.quantize_reference(x, "rowwise")
    assert s[0, 0] == s_row[0, 0] and (s[0, 1:] < s[0, 0] / 100).all()


# ---- the head: made from the weight's values at every call ------------------------------------------


def test_the_head_is_the_quantised_weight_and_clear_cache_is_a_no_op():
    w = torch.randn(100, 64)
    h = fp8.head(w, "rowwise")
    q, s = fp8.quantize_reference(w, "rowwise", rows_to=16)
    assert h.v == 100 and torch.equal(_bits(h.q), _bits(q)) and torch.equal(h.scale, s.reshape(1, -1))
    h = fp8.head(w[:50], "1x128")  # a view (a padded head's rows)
    q, s = fp8.quantize_reference(w[:50], "1x128", rows_to=16)
    assert h.v == 50 and torch.equal(_bits(h.q), _bits(q)) and torch.equal(h.scale, s.t())
    assert fp8.clear_cache() == 0 and fp8.cache_bytes() == 0  # kept for callers: nothing is cached


# ---- argument checks -------------------------------------------------------------------------------


def _inputs(dtype=torch.float32, n=37, hs=11, ht=40, v=100, vt=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(n, hs, generator=g).to(dtype).requires_grad_()
    ws = (torch.randn(v, hs, generator=g) / hs**0.5).to(dtype).requires_grad_()
    xt = torch.randn(n, ht, generator=g).to(dtype)
    wt = (torch.randn(vt, ht, generator=g) * 2 / ht**0.5).to(dtype)
    y = torch.randint(0, v, (n,), generator=g)
    y[::5] = -100
    return xs, ws, xt, wt, y


@pytest.mark.parametrize("bad", ["fp16", "FP8", True, 8, "fp8-128x128"])
def test_a_bad_teacher_precision_is_an_error_naming_it(bad):
    xs, ws, xt, wt, y = _inputs()
    with pytest.raises(ValueError, match="teacher_precision"):
        flashkd.fused_linear_distill(xs, ws, xt, wt, y, teacher_precision=bad)
    with pytest.raises(ValueError, match="teacher_precision"):
        flashkd.teacher_topk(xt, wt, 3, teacher_precision=bad)


def test_fp8_on_cpu_is_a_clear_error():
    xs, ws, xt, wt, y = _inputs()
    for call in (lambda: flashkd.fused_linear_distill(xs, ws, xt, wt, y, teacher_precision="fp8"),
                 lambda: flashkd.teacher_topk(xt, wt, 3, teacher_precision="fp8")):
        with pytest.raises(ValueError, match="teacher_precision: 'fp8' needs a CUDA GPU with FP8 tensor cores"):
            call()


def test_fp64_is_refused():
    with pytest.raises(TypeError, match="teacher_precision: an FP8 teacher needs float16, bfloat16 or float32"):
        fp8.check_dtype(torch.float64)


# ---- the whole loss, through CPU torch._scaled_mm --------------------------------------------------


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    """The FP8 path on CPU tensors: the device check skipped, torch's CPU _scaled_mm (rowwise) doing
    the GEMM. The arithmetic is then the GPU's: e4m3 operands, fp32 accumulation, both scales. torch's CPU
    _scaled_mm takes rowwise scales from 2.13 on (2.11's asserts per-tensor ones): skipped before."""
    try:
        q = torch.ones(16, 16).to(torch.float8_e4m3fn)
        torch._scaled_mm(q, q.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.float32)
    except RuntimeError as e:
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm takes no rowwise scales ({str(e)[:60]}...)")
    monkeypatch.setattr(fp8, "scaling_of", lambda precision, device: {"fp8": "rowwise", "fp8-rowwise": "rowwise"}.get(precision))
    fp8.clear_cache()
    yield
    fp8.clear_cache()


def _fp8_logits(xt, wt):
    """The teacher logits the FP8 path computes, in float64 from the dequantised operands."""
    xq, sx = fp8.quantize_reference(xt.reshape(-1, xt.shape[-1]), "rowwise")
    wq, sw = fp8.quantize_reference(wt, "rowwise")
    return fp8.dequantize(xq, sx).double() @ fp8.dequantize(wq, sw).double().T


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not INTERPRET, reason="the FP8 path on CPU tensors (fp8_on_cpu): the Triton rows take them under "
    "TRITON_INTERPRET=1 only (the GPU suite runs the cuBLAS path)"))])
@pytest.mark.parametrize("loss", ["jsd", "forward_kl", "reverse_kl", "tvd", "cosine"])
def test_the_fp8_teacher_is_the_loss_of_its_dequantised_logits(fp8_on_cpu, backend, loss):
    # a padded teacher head (Vt > V); seeds fixed per loss (str hashes change from process to process)
    seed = zlib.crc32(loss.encode()) % 1000
    xs, ws, xt, wt, y = _inputs(vt=107, seed=seed)
    bt = torch.randn(107, generator=torch.Generator().manual_seed(seed + 1))
    opts = dict(loss=loss, beta=0.3, temperature=1.7, teacher_bias=bt, teacher_softcap=5.0)
    y = drop_tied_rows(y, logits64(xs, ws), _fp8_logits(xt, wt) + bt.double(), **opts)
    out = flashkd.fused_linear_distill(xs, ws, xt, wt, y, teacher_precision="fp8", backend=backend,
                                       return_soft_hard_loss=True, chunk_size=16, vocab_size=100, **read(opts))
    grads = torch.autograd.grad(out[0], (xs, ws))
    leaves = [z.detach().double().requires_grad_() for z in (xs, ws)]
    ref = distill_loss(*leaves, None, None, y, teacher_logits=_fp8_logits(xt, wt[:100]), **opts)
    ref_grads = torch.autograd.grad(ref[0], leaves)
    check_against_oracle(out, ref, grads, ref_grads, (xs, ws), 2e-5, labels=y)
    # and it is not the bf16 teacher's loss: the FP8 rounding is really there
    plain = flashkd.fused_linear_distill(xs, ws, xt, wt, y, backend=backend, vocab_size=100, **read(opts))
    assert abs(plain.item() - out[0].item()) > 1e-6 * abs(plain.item())


def test_teacher_topk_with_fp8_is_the_topk_of_the_dequantised_logits(fp8_on_cpu):
    _, _, xt, wt, _ = _inputs(vt=120)
    ids, lp = flashkd.teacher_topk(xt, wt, 7, temperature=0.8, teacher_precision="fp8", vocab_size=110)
    z = _fp8_logits(xt, wt[:110]) / 0.8
    want = torch.log_softmax(z, -1).topk(7, dim=-1)
    assert torch.equal(ids, want.indices)
    assert torch.allclose(lp.double(), want.values, atol=1e-5)


def test_a_bf16_fp8_teacher_rounds_its_logits_to_bf16(fp8_on_cpu):
    xs, ws, xt, wt, y = (z.detach() for z in _inputs(torch.bfloat16))
    loss = flashkd.fused_linear_distill(xs, ws, xt, wt, y, teacher_precision="fp8", backend="torch")
    t = _fp8_logits(xt.float(), wt.float()).to(torch.bfloat16)
    want = flashkd.fused_linear_distill_logits(xs, ws, t, y, backend="torch")
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)


def test_the_trl_patch_passes_teacher_precision_on(monkeypatch):
    pytest.importorskip("trl")
    from flashkd.integrations import trl as trl_patch

    seen = {}

    def fake(*args, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop")

    monkeypatch.setattr(trl_patch, "fused_linear_distill", fake)
    with pytest.raises(ValueError, match="teacher_precision"):
        trl_patch.patch(teacher_precision="int4")
    x, w = torch.randn(2, 3, 4), torch.randn(5, 4)
    mask = torch.ones(2, 3)
    with trl_patch.patch(teacher_precision="fp8"):
        with pytest.raises(RuntimeError, match="stop"):
            trl_patch.chunked_divergence_loss(x, x, w, w, mask, 0.5)
    assert seen["teacher_precision"] == "fp8"
    seen.clear()
    with trl_patch.patch():
        with pytest.raises(RuntimeError, match="stop"):
            trl_patch.chunked_divergence_loss(x, x, w, w, mask, 0.5)
    assert "teacher_precision" not in seen


def _fused_step(opt):
    def update(w):
        step = opt([w], lr=0.1, fused=True)
        w.grad = torch.randn_like(w)
        step.step()

    return update


def _alias(w):
    """Another tensor on w's storage (its own version counter)."""
    return torch.empty(0, dtype=w.dtype).set_(w.untyped_storage(), w.storage_offset(), w.shape, w.stride())


def _same_address_swap(w):
    """`.data =` a tensor that shares w's storage (so the same address), then written through that tensor."""
    new = _alias(w.data)
    w.data = new
    new.mul_(0.5).add_(1.0)


# Updates that leave the version counter of the tensor passed as teacher_weight as it was
UPDATES = {
    "fused AdamW": _fused_step(torch.optim.AdamW),
    "fused Adam": _fused_step(torch.optim.Adam),
    "fused SGD": _fused_step(torch.optim.SGD),
    "EMA through .data": lambda w: w.data.mul_(0.9).add_(torch.randn_like(w.data), alpha=0.1),
    ".data = swap": _same_address_swap,
    "numpy view": lambda w: w.detach().numpy().__imul__(-1.5),
    "untyped_storage().copy_": lambda w: w.untyped_storage().copy_(torch.randn_like(w.data).untyped_storage()),
    "another tensor on the storage": lambda w: _alias(w.detach()).add_(0.25),
}


@pytest.mark.parametrize("update", list(UPDATES))
def test_an_updated_teacher_weight_is_never_served_stale(fp8_on_cpu, update):
    """Every way a weight's values change, the FP8 loss and top-k targets are those of its new values
    (those of a fresh copy of it), at every call."""
    xs, ws, xt, wt, y = _inputs(seed=7)
    w = torch.nn.Parameter(wt.clone())
    kd = dict(teacher_precision="fp8", backend="torch", loss="jsd")

    def loss(weight):
        return flashkd.fused_linear_distill(xs, ws, xt, weight, y, **kd).item()

    def topk(weight):
        return flashkd.teacher_topk(xt, weight, 5, teacher_precision="fp8")

    before, (ids_before, _) = loss(w), topk(w)
    UPDATES[update](w)
    fresh = w.detach().clone()  # a tensor no call has seen
    assert not torch.equal(fresh, wt)  # the update did change the values
    assert loss(w) == loss(fresh) != before
    ids, lp = topk(w)
    ids_fresh, lp_fresh = topk(fresh)
    assert torch.equal(ids, ids_fresh) and torch.equal(lp, lp_fresh) and not torch.equal(ids, ids_before)


def test_a_teacher_weight_made_under_inference_mode_works_like_bf16(fp8_on_cpu):
    xs, ws, xt, wt, y = _inputs(seed=3)
    with torch.inference_mode():
        wi = wt.clone()
    kd = dict(teacher_precision="fp8", backend="torch")
    got = flashkd.fused_linear_distill(xs, ws, xt, wi, y, **kd)
    want = flashkd.fused_linear_distill(xs, ws, xt, wt, y, **kd)
    assert got.item() == want.item()
    assert torch.equal(torch.autograd.grad(got, xs)[0], torch.autograd.grad(want, xs)[0])
    ids, lp = flashkd.teacher_topk(xt, wi, 4, teacher_precision="fp8")
    ids_want, lp_want = flashkd.teacher_topk(xt, wt, 4, teacher_precision="fp8")
    assert torch.equal(ids, ids_want) and torch.equal(lp, lp_want)
