"""GPU suite (`pytest -m gpu` on a CUDA machine): realistic vocabularies, bf16/fp16/fp32, every loss.

Errors are judged against a float64 ground truth with TF32 off: the loss within 5e-4 relative, the
gradients no worse than 1.5× the error of the same formula written in plain torch on the same inputs.
"""

import itertools

import pytest
import torch

import flashkd
from oracle import distill_loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LOSSES = ["jsd", "forward_kl", "reverse_kl", "tvd", "cosine"]
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
def test_against_fp64_truth(backend, loss, dtype, vocab, opts):
    if backend == "torch" and dtype != torch.bfloat16:
        pytest.skip("the torch backend is covered on CPU; one dtype here")
    torch.manual_seed(hash((loss, str(dtype), vocab)) % 2**31)
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

    got = flashkd.fused_linear_distill(xs, ws, xt, wt, y, backend=backend, check_labels=True, **kw)
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


def test_memory_stays_within_the_formula():
    """Peak extra memory of a bf16 forward+backward at N=8192, V=128256 stays under the documented bound."""
    n, v, hs, ht, dtype = 8192, 128256, 2048, 4096, torch.bfloat16
    xs = torch.rand(n, hs, device="cuda", dtype=dtype).requires_grad_()
    xt = torch.rand(n, ht, device="cuda", dtype=dtype)
    ws = torch.nn.Linear(hs, v, bias=False, device="cuda", dtype=dtype).weight.detach().requires_grad_()
    wt = torch.nn.Linear(ht, v, bias=False, device="cuda", dtype=dtype).weight.detach()
    y = torch.randint(0, v, (n,), device="cuda")
    for accum, chunk in ((None, None), (torch.bfloat16, 512)):
        xs.grad = ws.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        flashkd.fused_linear_distill(xs, ws, xt, wt, y, grad_accum_dtype=accum, chunk_size=chunk).backward()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before
        rows = chunk or flashkd.distill._chunk_rows(None, xs, ws, "triton")
        e, a = 2, 4 if accum is None else 2
        # distill.py's formula: max(forward, backward) + the grads left in .grad; slack for cuBLAS workspaces
        bound = max(2 * rows * v * e + n * hs * e + v * hs * a, n * hs * e + v * hs * (a + e),
                    2 * n * hs * e + 2 * v * hs * e) + (64 << 20)
        assert extra <= bound, (accum, extra / 2**20, bound / 2**20)
