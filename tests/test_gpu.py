"""GPU suite (`pytest -m gpu` on a CUDA machine): realistic vocabularies, bf16/fp16/fp32, every loss.

Errors are judged against a float64 ground truth with TF32 off: the loss within 5e-4 relative, the
gradients no worse than 1.5× the error of the same formula written in plain torch on the same inputs.
"""

import itertools

import pytest
import torch

import flashkd
from flashkd import fp8
from flashkd.losses import LossSpec, topk_row_losses
from helpers.cases import read
from oracle import distill_loss, topk_loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LOSSES = ["jsd", "forward_kl", "reverse_kl", "tvd", "cosine"]
NEW_LOSSES = ["skew_kl", "skew_reverse_kl", "akl"]  # α = 0.1, μ = 0.5 (the defaults, the oracle's too)
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (V, Vt): a Llama-3 vocabulary, GPT-2's odd one, and Qwen's padded teacher head (151646 ids in a 151936 head)
VOCABS = [(128256, 128256), (50257, 50257), (151646, 151936)]
OPTIONS = [
    dict(beta=0.5, temperature=1.0),
    dict(beta=0.0, temperature=2.0, bias=True),
    dict(beta=1.0, temperature=0.7, weight_hard_loss=0.0, weight_soft_loss=1.0),
    dict(beta=0.3, temperature=1.5, reduction="sum", temperature_squared=True),
]
CASES = [
    (loss, dtype, vocab, opts)
    for (loss, dtype), vocab, opts in zip(
        itertools.product(LOSSES, DTYPES), itertools.cycle(VOCABS), itertools.cycle(OPTIONS)
    )
] + [(loss, torch.bfloat16, vocab, opts) for loss, vocab, opts in zip(NEW_LOSSES, VOCABS, OPTIONS[1:])] + [
    # the skew losses in the dense Triton row kernel away from α = 0.1 (α = 0: the KLs' kernels)
    ("skew_kl", torch.float16, VOCABS[0], dict(alpha=0.5, temperature=0.7)),
    ("skew_kl", torch.float32, VOCABS[2], dict(alpha=0.0, bias=True)),
    ("skew_reverse_kl", torch.float16, VOCABS[1], dict(alpha=0.9, temperature=2.0, reduction="sum")),
    ("skew_reverse_kl", torch.float32, VOCABS[0], dict(alpha=0.3, weight_hard_loss=0.0, weight_soft_loss=1.0)),
]


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("loss,dtype,vocab,opts", CASES, ids=lambda c: str(c))
def test_against_fp64_truth(backend, loss, dtype, vocab, opts, seed):
    if backend == "torch" and dtype != torch.bfloat16:
        pytest.skip("the torch backend is covered on CPU; one dtype here")
    torch.manual_seed(seed)
    opts = dict(opts)
    bias = opts.pop("bias", False)
    (v, vt), n, hs, ht = vocab, 999, 512, 768
    dev = "cuda"
    xs = torch.rand(n, hs, device=dev, dtype=dtype).requires_grad_()
    xt = torch.rand(n, ht, device=dev, dtype=dtype)
    ws = torch.nn.Linear(hs, v, device=dev, dtype=dtype).weight.detach().requires_grad_()
    wt = torch.nn.Linear(ht, vt, device=dev, dtype=dtype).weight.detach()
    bs = (0.1 * torch.randn(v, device=dev, dtype=dtype)).requires_grad_() if bias else None
    bt = 0.1 * torch.randn(vt, device=dev, dtype=dtype) if bias else None
    y = torch.randint(0, v, (n,), device=dev)
    y[torch.rand(n, device=dev) < 0.2] = -100
    kw = dict(loss=loss, student_bias=bs, teacher_bias=bt, **opts)
    leaves = [xs, ws] + ([bs] if bias else [])

    got = flashkd.fused_linear_distill(xs, ws, xt, wt, y, backend=backend, check_labels=True,
                                       vocab_size=v if vt > v else None, **read(kw))  # Qwen's: padding
    got_grads = torch.autograd.grad(got, leaves)
    plain, plain_grads = _naive(leaves, xt, wt, bt, y, kw, double=False)
    truth, truth_grads = _naive(leaves, xt, wt, bt, y, kw, double=True)

    loss_err = abs(got.item() - truth.item()) / abs(truth.item())
    assert loss_err <= 5e-4, loss_err
    for name, g, p, t in zip(("dXs", "dWs", "dbs"), got_grads, plain_grads, truth_grads):
        assert torch.isfinite(g).all(), name
        err, base = rel(g, t), rel(p, t)
        assert err <= 1.5 * base + 1e-6, (name, err, base)


def _naive(leaves, xt, wt, bt, y, kw, double):
    """The oracle's loss and grads on copies of the student leaves: plain torch, or float64 truth."""
    cast = (lambda x: x.double()) if double else (lambda x: x)
    copies = [cast(x.detach()).requires_grad_() for x in leaves]
    kw = dict(kw, student_bias=copies[2] if len(copies) > 2 else None,
              teacher_bias=None if bt is None else cast(bt))
    loss, _, _ = distill_loss(copies[0], copies[1], cast(xt), cast(wt), y, plain=not double, **kw)
    return loss, torch.autograd.grad(loss, copies)


def _peak_extra(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def test_memory_stays_within_the_formula():
    """Peak extra memory of a bf16 forward+backward at N = 8192 and 4096, V = 128256 stays under the documented bound
    (distill.py): no copy of the grads in backward, whatever grad_output is."""
    v, hs, ht, dtype = 128256, 2048, 4096, torch.bfloat16
    ws = torch.nn.Linear(hs, v, bias=False, device="cuda", dtype=dtype).weight.detach().requires_grad_()
    wt = torch.nn.Linear(ht, v, bias=False, device="cuda", dtype=dtype).weight.detach()
    for n in (8192, 4096):  # chunked, and one chunk (no accumulator) at defaults
        xs = torch.rand(n, hs, device="cuda", dtype=dtype).requires_grad_()
        xt = torch.rand(n, ht, device="cuda", dtype=dtype)
        y = torch.randint(0, v, (n,), device="cuda")
        ids, lp = flashkd.teacher_topk(xt, wt, 64)
        forms = {
            "heads": lambda **kw: flashkd.fused_linear_distill(xs, ws, xt, wt, y, **kw),
            "topk": lambda **kw: flashkd.fused_linear_distill_topk(xs, ws, ids, lp, **kw),
        }
        for (form, run), (accum, chunk) in itertools.product(forms.items(), ((None, None), (torch.bfloat16, 1024))):
            xs.grad = ws.grad = None
            e, a = 2, 4 if accum is None else 2
            extra = _peak_extra(lambda: (3.0 * run(grad_accum_dtype=accum, chunk_size=chunk)).backward())
            rows, teacher = flashkd.core.plan.chunk_rows(chunk, xs, ws, "triton", form, a)
            # the formula in distill.py, with the grads left in .grad; slack for cuBLAS workspaces
            bound = flashkd.core.plan.peak_bytes(n, v, hs, e, rows, teacher, form=form, accum_bytes=a)
            print(f"N={n} {form} accum={accum} plan={rows}:{teacher}: extra {extra / 2**20:.0f} MiB, "
                  f"formula {bound / 2**20:.0f} MiB")
            assert extra <= bound + (64 << 20), (n, form, accum, extra / 2**20, bound / 2**20)
    # teacher_topk holds one chunk of fp32 logits (+ the outputs)
    extra = _peak_extra(lambda: flashkd.teacher_topk(xt, wt, 64, chunk_size=1024))
    assert extra <= 1024 * v * 4 + n * 64 * 12 + (64 << 20), extra / 2**20


TOPK_CASES = [
    (loss, tail, dtype, v, opts)
    for (loss, tail), dtype, v, opts in zip(
        itertools.product(["forward_kl", "reverse_kl", "jsd", "tvd"], ["bucket", "renormalize"]),
        itertools.cycle(DTYPES),
        itertools.cycle([128256, 50257, 151936]),
        itertools.cycle([dict(), dict(temperature=2.0, weight_hard_loss=0.5), dict(temperature=0.7, beta=0.3)]),
    )
] + [(loss, tail, torch.bfloat16, 128256, dict(temperature=1.5)) for loss in NEW_LOSSES
       for tail in ("bucket", "renormalize")]


@pytest.mark.parametrize("loss,tail,dtype,v,opts", TOPK_CASES, ids=lambda c: str(c))
def test_topk_against_fp64_truth(loss, tail, dtype, v, opts, seed):
    """Top-k teacher, K = 64, on the kernel: loss within 5e-4 of the float64 truth, grads no worse than
    1.5× plain torch (the torch definition on the input-dtype logits, fp32 math)."""
    torch.manual_seed(seed)
    n, hs, ht, k, dev = 999, 512, 768, 64, "cuda"
    xs = torch.rand(n, hs, device=dev, dtype=dtype).requires_grad_()
    ws = torch.nn.Linear(hs, v, device=dev, dtype=dtype).weight.detach().requires_grad_()
    teacher = torch.nn.Linear(ht, v, device=dev)
    ids, lp = flashkd.teacher_topk(4.0 * torch.rand(n, ht, device=dev), teacher.weight.detach(), k,
                                   temperature=opts.get("temperature", 1.0))
    y = torch.randint(0, v, (n,), device=dev)
    y[torch.rand(n, device=dev) < 0.2] = -100
    kw = dict(loss=loss, tail=tail, **opts)
    got = flashkd.fused_linear_distill_topk(xs, ws, ids, lp, y, check_teacher=True, check_labels=True,
                                            **read(kw, "forward_kl"))
    got_grads = torch.autograd.grad(got, [xs, ws])

    x64, w64 = (x.detach().double().requires_grad_() for x in (xs, ws))
    truth = topk_loss(x64, w64, ids, lp, y, **kw)[0]
    truth_grads = torch.autograd.grad(truth, [x64, w64])
    xp, wp = (x.detach().requires_grad_() for x in (xs, ws))
    spec = LossSpec(loss=loss, beta=kw.get("beta", 0.5), temperature=kw.get("temperature", 1.0),
                    weight_hard=kw.get("weight_hard_loss", 0.0), weight_soft=1.0, tail=tail)
    soft, hard = topk_row_losses(xp @ wp.t(), (ids, lp), y, spec)
    plain = spec.total(soft.sum(), hard.sum()) / (y != -100).sum()
    plain_grads = torch.autograd.grad(plain, [xp, wp])

    loss_err = abs(got.item() - truth.item()) / abs(truth.item())
    assert loss_err <= 5e-4, loss_err
    for name, g, p, t in zip(("dXs", "dWs"), got_grads, plain_grads, truth_grads):
        assert torch.isfinite(g).all(), name
        err, base = rel(g, t), rel(p, t)
        assert err <= 1.5 * base + 1e-6, (name, err, base)


@pytest.mark.parametrize("loss", LOSSES + NEW_LOSSES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_logits_against_fp64_truth(loss, dtype, seed):
    torch.manual_seed(seed)
    n, hs, v, vt, dev = 999, 512, 151646, 151936, "cuda"
    xs = torch.rand(n, hs, device=dev, dtype=dtype).requires_grad_()
    ws = torch.nn.Linear(hs, v, device=dev, dtype=dtype).weight.detach().requires_grad_()
    logits_t = (2.0 * torch.randn(n, vt, device=dev)).to(dtype)  # a padded teacher head's logits
    y = torch.randint(0, v, (n,), device=dev)
    kw = dict(loss=loss, beta=0.4, temperature=1.3, weight_hard_loss=0.5, weight_soft_loss=0.5)
    got = flashkd.fused_linear_distill_logits(xs, ws, logits_t, y, vocab_size=v, **read(kw))
    _against_logits_truth(got, torch.autograd.grad(got, [xs, ws]), xs, ws, y, logits_t, kw)


def _against_logits_truth(got, got_grads, xs, ws, y, logits_t, kw):
    """The logits form's loss within 5e-4 of the oracle's float64 truth, its dX and dW no worse than 1.5× the error
    of the oracle written as plain torch (fp32 logits) on the same inputs."""
    results = []
    for double in (True, False):
        cast = (lambda x: x.double()) if double else (lambda x: x)
        leaves = [cast(x.detach()).requires_grad_() for x in (xs, ws)]
        ref = distill_loss(*leaves, None, None, y, teacher_logits=cast(logits_t), plain=not double, **kw)[0]
        results.append((ref, torch.autograd.grad(ref, leaves)))
    (truth, truth_grads), (_, plain_grads) = results
    assert torch.isfinite(got) and abs(got.item() - truth.item()) / abs(truth.item()) <= 5e-4, (got.item(), truth.item())
    for name, g, p, t in zip(("dXs", "dWs"), got_grads, plain_grads, truth_grads):
        assert torch.isfinite(g).all(), name
        err, base = rel(g, t), rel(p, t)
        assert err <= 1.5 * base + 1e-6, (name, err, base)


@pytest.mark.parametrize("k", [64, 100, 200])  # the kernel's 256, 512 and 1024 lanes
@pytest.mark.parametrize("dtype", DTYPES)
def test_teacher_topk_on_gpu(dtype, k):
    """ids are a top-k of the logits the GEMM made (ties in bf16 allow any of the tied ids), log-probs
    are the float64 log-softmax of those logits at the ids."""
    torch.manual_seed(0)
    n, h, v, dev = 999, 768, 151936, "cuda"
    x = torch.rand(n, h, device=dev, dtype=dtype)
    w = torch.nn.Linear(h, v, bias=False, device=dev, dtype=dtype).weight.detach()
    ids, lp = flashkd.teacher_topk(x, w, k, temperature=0.8, chunk_size=300)
    logits = torch.mm(x, w.t(), out_dtype=torch.float32)  # the same GEMM, its fp32 accumulator
    chosen = logits.gather(1, ids)
    others = logits.scatter(1, ids, float("-inf"))
    assert (chosen.min(1).values >= others.max(1).values).all()
    truth = torch.log_softmax(logits.double() / 0.8, -1).gather(1, ids)
    assert (lp.double() - truth).abs().max() <= 2e-5 * truth.abs().max().clamp_min(1.0)


HEADS = [  # (student σ, c, teacher σ, c): at these inputs' logits (~±0.5), σ = 20 puts them past c
    dict(student_logit_scale=20.0, student_softcap=5.0, teacher_logit_scale=15.0, teacher_softcap=6.0),
    dict(student_logit_scale=-8.0, teacher_logit_scale=3.0),
    dict(student_logit_scale=4.0, teacher_softcap=0.3),
]


@pytest.mark.parametrize("heads", range(len(HEADS)))
@pytest.mark.parametrize("loss,dtype", [("jsd", torch.bfloat16), ("forward_kl", torch.float32),
                                        ("reverse_kl", torch.bfloat16), ("tvd", torch.float16),
                                        ("cosine", torch.bfloat16), ("skew_kl", torch.bfloat16),
                                        ("skew_reverse_kl", torch.float16)])
def test_heads_and_row_weight_against_fp64_truth(loss, dtype, heads, seed):
    """Logit scales and softcaps (saturated ones too) and row weights at V = 128256, on the kernel."""
    torch.manual_seed(seed)
    n, hs, ht, v, dev = 999, 512, 768, 128256, "cuda"
    xs = torch.rand(n, hs, device=dev, dtype=dtype).requires_grad_()
    xt = torch.rand(n, ht, device=dev, dtype=dtype)
    ws = torch.nn.Linear(hs, v, device=dev, dtype=dtype).weight.detach().requires_grad_()
    wt = torch.nn.Linear(ht, v, device=dev, dtype=dtype).weight.detach()
    y = torch.randint(0, v, (n,), device=dev)
    y[torch.rand(n, device=dev) < 0.2] = -100
    kw = dict(loss=loss, temperature=1.3, row_weight=2.0 * torch.rand(n, device=dev), **HEADS[heads])
    got = flashkd.fused_linear_distill(xs, ws, xt, wt, y, check_labels=True, **kw)
    got_grads = torch.autograd.grad(got, [xs, ws])
    plain, plain_grads = _naive([xs, ws], xt, wt, None, y, kw, double=False)
    truth, truth_grads = _naive([xs, ws], xt, wt, None, y, kw, double=True)
    assert abs(got.item() - truth.item()) / abs(truth.item()) <= 5e-4
    for name, g, p, t in zip(("dXs", "dWs"), got_grads, plain_grads, truth_grads):
        assert torch.isfinite(g).all(), name
        err, base = rel(g, t), rel(p, t)
        assert err <= 1.5 * base + 1e-6, (name, err, base)


# ---- the FP8 teacher head (flashkd.fp8): sm_89+ ----------------------------------------------------

fp8_gpu = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                             reason="needs FP8 tensor cores (sm_89+)")
FP8_CASES = [("jsd", torch.bfloat16, (128256, 128256), "fp8"), ("forward_kl", torch.float16, (50257, 50257), "fp8"),
             ("reverse_kl", torch.bfloat16, (151646, 151936), "fp8-1x128"), ("tvd", torch.float32, (50257, 50257), "fp8-1x128")]


def _fp8_inputs(dtype, v, vt, n=1000, hs=512, ht=1000, bias=True):
    g = torch.Generator(device="cuda").manual_seed(v)
    xs = torch.rand(n, hs, device="cuda", generator=g).to(dtype).requires_grad_()
    xt = torch.rand(n, ht, device="cuda", generator=g).to(dtype)
    ws = ((torch.rand(v, hs, device="cuda", generator=g) * 2 - 1) / hs**0.5).to(dtype).requires_grad_()
    wt = ((torch.rand(vt, ht, device="cuda", generator=g) * 2 - 1) / ht**0.5).to(dtype)
    bt = (torch.randn(vt, device="cuda", generator=g) * 0.1).to(dtype) if bias else None
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    y[::7] = -100
    return xs, ws, xt, wt, bt, y


@fp8_gpu
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9, reason="1x128: sm_90")
@pytest.mark.parametrize("loss,dtype,vocab,precision", FP8_CASES, ids=str)
def test_fp8_teacher_is_the_loss_of_its_own_logits(loss, dtype, vocab, precision):
    """The fused loss with an FP8 teacher = the dense-logits loss fed the FP8 GEMM's logits (the
    wiring: chunks, padded heads, bias, scale layouts); and those logits are the dequantised product."""
    v, vt = vocab
    xs, ws, xt, wt, bt, y = _fp8_inputs(dtype, v, vt)
    opts = dict(loss=loss, beta=0.3, temperature=1.3, chunk_size=384)
    opts = read(opts)  # beta where the loss reads it
    got = flashkd.fused_linear_distill(xs, ws, xt, wt, y, teacher_bias=bt, teacher_precision=precision,
                                       vocab_size=v if vt > v else None, **opts)
    g_got = torch.autograd.grad(got, (xs, ws))
    scaling = fp8.scaling_of(precision, xt.device)
    h = fp8.head(wt[:v], scaling)
    t = fp8.linear(xt, h, bt[:v])
    want = flashkd.fused_linear_distill_logits(xs, ws, t, y, **opts)
    g_want = torch.autograd.grad(want, (xs, ws))
    assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item())
    for a, b in zip(g_got, g_want):
        assert rel(a, b) <= 2e-3  # the same logits up to the GEMM's rounding in another row split
    xq, sx = fp8.quantize(xt, scaling)
    ref = fp8.dequantize(xq, sx) @ fp8.dequantize(h.q, h.scale.t()).t()[:, :v] + bt[:v].float()
    assert rel(t, ref) <= 5e-4  # t: the product in fp32, up to the FP8 GEMM's accumulation (1e-4); bf16 output: ~1e-3
    again = fp8.head(wt[:v], scaling)  # quantised anew every call: the same bits from the same weight
    assert torch.equal(again.q.view(torch.uint8), h.q.view(torch.uint8)) and torch.equal(again.scale, h.scale)


@fp8_gpu
def test_fp8_teacher_error_against_the_fp32_truth():
    """On the bench's inputs the FP8 teacher moves the JSD by ~1e-3 (BENCHMARKS.md); far more means a
    wrong scale; the student's gradients stay within a few % of the truth's."""
    xs, ws, xt, wt, _, y = _fp8_inputs(torch.bfloat16, 128256, 128256, n=512, hs=1024, ht=2048, bias=False)
    got = flashkd.fused_linear_distill(xs, ws, xt, wt, y, teacher_precision="fp8")
    grads = torch.autograd.grad(got, (xs, ws))
    leaves = [z.detach().double().requires_grad_() for z in (xs, ws)]
    truth = distill_loss(*leaves, xt.double(), wt.double(), y)[0]
    t_grads = torch.autograd.grad(truth, leaves)
    assert abs(got.item() - truth.item()) <= 5e-3 * abs(truth.item())
    for a, b in zip(grads, t_grads):
        assert rel(a, b) <= 5e-2


@fp8_gpu
def test_fp8_quantisation_on_gpu_is_the_reference_and_never_nan_from_scales():
    x = torch.randn(3000, 4096, device="cuda").to(torch.bfloat16)
    x[5] = 0
    x[6] = 3e38
    x[7, :9] = 1e-30
    for scaling in ("rowwise", "1x128"):
        q, s = fp8.quantize(x, scaling)
        qr, sr = fp8.quantize_reference(x, scaling)
        assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)
        assert torch.isfinite(s).all() and torch.isfinite(fp8.dequantize(q, s)).all()
        w = torch.randn(1000, 4096, device="cuda").to(torch.bfloat16) / 64
        t = fp8.linear(x[:8], fp8.head(w, scaling), None)
        assert torch.isfinite(t[:6]).all() and t[5].eq(0).all() and torch.isfinite(t[7]).all()


@fp8_gpu
def test_teacher_topk_with_an_fp8_teacher():
    _, _, xt, wt, bt, _ = _fp8_inputs(torch.bfloat16, 128256, 128256, n=700)
    ids, lp = flashkd.teacher_topk(xt, wt, 64, teacher_bias=bt, teacher_precision="fp8")
    t = fp8.linear(xt, fp8.head(wt, "rowwise"), bt).float()
    want = torch.log_softmax(t, -1).topk(64, dim=-1)
    assert torch.allclose(lp, want.values, atol=1e-4)
    # the ids are those values' (bf16 logits tie often, so which of equal logits is returned may differ)
    full = torch.log_softmax(t, -1)
    assert torch.allclose(full.gather(1, ids), lp, atol=1e-4)
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all()  # distinct


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_arithmetic_teachers_against_fp64_truth(dtype, seed):
    """Two teacher heads mixed per row, p = Σ w_m softmax(z_m / τ) (`fused_linear_distill_teachers`,
    combine="arithmetic"), at a trained head's magnitudes: the loss within 5e-4 of the float64 truth, the
    gradients no worse than 1.5× the same formula in plain torch (fp32 math on the input-dtype logits)."""
    torch.manual_seed(seed)
    n, hs, hts, v, tau, dev = 999, 512, (768, 640), 128256, 1.3, "cuda"
    xs = (torch.randn(n, hs, device=dev) / 4).to(dtype).requires_grad_()
    ws = (torch.randn(v, hs, device=dev) / 4).to(dtype).requires_grad_()
    xts = [torch.randn(n, h, device=dev).to(dtype) for h in hts]
    wts = [(4 * torch.randn(v, h, device=dev) / h**0.5).to(dtype) for h in hts]  # logits of std ~4
    w = torch.rand(n, 2, device=dev)
    w = w / w.sum(-1, keepdim=True)
    y = torch.randint(0, v, (n,), device=dev)
    y[torch.rand(n, device=dev) < 0.2] = -100
    got = flashkd.fused_linear_distill_teachers(xs, ws, xts, wts, y, combine="arithmetic", teacher_weights=w,
                                                temperature=tau, loss="jsd", beta=0.3)
    got_grads = torch.autograd.grad(got, [xs, ws])

    def loss_of(cast, math):
        """cast: the GEMMs' operands (float64 for the truth; as they are for plain torch), math: the rest's dtype."""
        zs = [(cast(x) @ cast(t).T).to(math) for x, t in zip(xts, wts)]
        mixed = tau * torch.stack([torch.log_softmax(z / tau, -1) + w[:, m:m + 1].to(math).log()
                                   for m, z in enumerate(zs)]).logsumexp(0)
        copies = [cast(t.detach()).requires_grad_() for t in (xs, ws)]
        value = distill_loss(copies[0], copies[1], None, None, y, teacher_logits=mixed, temperature=tau,
                             loss="jsd", beta=0.3, plain=math != torch.float64)[0]
        return value, torch.autograd.grad(value, copies)

    truth, truth_grads = loss_of(lambda t: t.double(), torch.float64)
    _, plain_grads = loss_of(lambda t: t, torch.float32)
    assert abs(got.item() - truth.item()) / abs(truth.item()) <= 5e-4
    for name, g, p, t in zip(("dXs", "dWs"), got_grads, plain_grads, truth_grads):
        assert torch.isfinite(g).all(), name
        err, base = rel(g, t), rel(p, t)
        assert err <= 1.5 * base + 1e-6, (name, err, base)


# the divergences from Jeffreys on, in the dense Triton row kernel, each at interior parameters
FAMILY = [("jeffreys", {}), ("triangular", {}), ("alpha_divergence", dict(alpha=0.3)), ("renyi", dict(alpha=0.7)),
          ("renyi_reverse", dict(alpha=1.4)), ("ab_divergence", dict(alpha=0.6, beta=1.3)),
          ("entropy_adaptive", dict(gate_min=0.1, gate_max=0.8, gate_center=0.4, gate_width=0.2)),
          ("dkd", dict(alpha=1.0, beta=8.0))]


def family_at_trained_magnitudes(loss, params, dtype, seed, n=999, hs=512, v=151646, vt=151936, dev="cuda"):
    """A trained head's logits (std ~4, the teacher's label peaked at ~30 on a third of the rows): the loss within
    5e-4 of the float64 truth, dX and dW no worse than 1.5× the plain fp32-logit pipeline's error (JSD's bar)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    xs = (torch.randn(n, hs, generator=g) / 4).to(dev, dtype).requires_grad_()
    ws = (torch.randn(v, hs, generator=g) * (16 / hs**0.5)).to(dev, dtype).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g).to(dev)
    logits_t = 4.0 * torch.randn(n, vt, generator=g)
    logits_t[::3].scatter_(1, y[::3, None].cpu(), 30.0)
    logits_t = logits_t.to(dev, dtype)
    kw = dict(loss=loss, temperature=1.3, weight_hard_loss=0.5, weight_soft_loss=0.5, **params)
    got = flashkd.fused_linear_distill_logits(xs, ws, logits_t, y, vocab_size=v, backend="triton", **kw)
    _against_logits_truth(got, torch.autograd.grad(got, [xs, ws]), xs, ws, y, logits_t, kw)


@pytest.mark.parametrize("case", FAMILY, ids=[c[0] for c in FAMILY])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_divergence_family_at_trained_magnitudes(case, dtype, seed):
    family_at_trained_magnitudes(*case, dtype, seed)


@pytest.mark.parametrize("k", [32, 128])
def test_verl_membership_in_the_expand_read(k, seed):
    """verl's overlap diagnostics on the GPU: the student's top-K membership the expand kernel counts in
    its read (`triton_topk.expand_kernel`'s OWN) against each id's rank over the same fp32 logits, at
    Qwen's vocabulary with a trained head's magnitudes (std 4, peaks 30) and a block of tied bf16-valued
    rows; the gradient it writes is the one written without it."""
    from flashkd.integrations import verl as fk_verl

    g = torch.Generator(device="cuda").manual_seed(seed)
    r, v = 96, 151936
    s = torch.randn(r, v, generator=g, device="cuda") * 4
    s[::7, :40] += 26.0  # peaks
    s[-16:] = s[-16:].bfloat16().float()  # bf16's grid: exact ties among the top logits
    t = torch.randn(r, v, generator=g, device="cuda") * 4 + s * 0.5
    ids = t.topk(k, -1).indices  # the teacher's top ids: most, not all, high for the student too
    want = fk_verl._own_by_rank(s, ids, s.gather(1, ids))
    id_grad = torch.randn(r, k, generator=g, device="cuda", dtype=torch.float64)
    rest_grad = torch.randn(r, generator=g, device="cuda", dtype=torch.float64)
    runs = []
    for later in (False, True):
        x = s.clone()
        rel_k, rel_rest, shift, log2_rest, own, _ = fk_verl._stats(x, ids, 1.0, "triton", not later, later)
        ds = torch.empty(r, v, device="cuda", dtype=torch.bfloat16)
        runs.append(fk_verl._expand(x, ds, ids, id_grad, rest_grad, shift, log2_rest, rel_rest, 1.0, "triton",
                                    own if later else None))
    ds, members, redo = runs[1]
    assert torch.equal(ds, runs[0])
    assert not redo[:-16].any() and redo[-16:].sum() <= 8  # a redone row is settled by torch.topk (`_diagnostics`)
    assert torch.equal(members[~redo], want[~redo])
    assert want.any() and not want.all()
