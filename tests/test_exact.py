"""Exactness at a trained model's logit magnitudes (std ~4, peaks ~30): bf16 inputs, every loss and form.

The bar is the fp32-logit pipeline a careful user would write: the same bf16 inputs, logits at fp32
accuracy, the loss and dL/dz in fp32, dL/dz rounded to bf16 for the bf16 gradient GEMMs, whose results
come back in bf16. flashkd's dX and dW must be within 1.3x that pipeline's error against the float64
truth of the same inputs, and its loss within 1e-5 relative of the truth. Logits stored in bf16 fail
this by 3x or more: bf16's ulp is 1/8 on [16, 32), so a top token's probability moves by up to ~6 %.

The Triton backend runs on DEVICE (the GPU, or the CPU under Triton's interpreter), the torch backend, the
truth and the fp32-logit pipeline on the CPU.
"""

import pytest
import torch

import flashkd
from conftest import BACKEND_PARAMS, _device
from helpers.exact import HT, N, OPTIONS, V, check, make_case, pipeline_grads, trained_head, truth_grads
from helpers.ties import drop_tied_rows, logits64
from oracle import distill_loss, head, topk_loss

LOSSES = ["jsd", "forward_kl", "reverse_kl", "tvd", "cosine"]


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_heads_exact_at_trained_magnitudes(backend, loss, option, seed):
    xs, ws, xt, wt, labels = make_case(seed)
    opts = dict(OPTIONS[option], loss=loss)
    labels = drop_tied_rows(labels, logits64(xs, ws), logits64(xt, wt), **opts)
    dev = _device(backend)
    xs_, ws_ = xs.to(dev).clone().requires_grad_(), ws.to(dev).clone().requires_grad_()
    out = flashkd.fused_linear_distill(xs_, ws_, xt.to(dev), wt.to(dev), labels.to(dev), backend=backend, chunk_size=16,
                                       **opts)
    grads = [g.cpu() for g in torch.autograd.grad(out, (xs_, ws_))]
    zt = (xt.double() @ wt.double().T).float()

    def of_logits(zs):  # the fp32 pipeline: fp32 logits, the formula in fp32
        return distill_loss(None, None, None, None, labels, teacher_logits=zt, plain=True, student_logits=zs, **opts)[0]

    truth = truth_grads(lambda x, w: distill_loss(x, w, xt, wt, labels, **opts)[0], xs, ws)
    check(out, grads, truth, pipeline_grads(of_logits, xs, ws))


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("loss", ["jsd", "reverse_kl", "tvd"])
def test_dense_logits_exact_at_trained_magnitudes(backend, loss, seed):
    """The teacher's logits are read as passed: bf16 ones carry their own rounding, which the truth here
    shares (it reads the same bf16 values); the student's side must be exact."""
    xs, ws, xt, wt, labels = make_case(seed)
    tl = (xt.double() @ wt.double().T).to(xs.dtype)
    labels = drop_tied_rows(labels, logits64(xs, ws), tl, loss=loss, temperature=0.9)
    dev = _device(backend)
    xs_, ws_ = xs.to(dev).clone().requires_grad_(), ws.to(dev).clone().requires_grad_()
    out = flashkd.fused_linear_distill_logits(xs_, ws_, tl.to(dev), labels.to(dev), loss=loss, backend=backend,
                                              chunk_size=16, temperature=0.9)
    grads = [g.cpu() for g in torch.autograd.grad(out, (xs_, ws_))]
    opts = dict(loss=loss, temperature=0.9)

    def of_logits(zs):
        return distill_loss(None, None, None, None, labels, teacher_logits=tl.float(), plain=True, student_logits=zs,
                            **opts)[0]

    truth = truth_grads(lambda x, w: distill_loss(x, w, None, None, labels, teacher_logits=tl, **opts)[0], xs, ws)
    check(out, grads, truth, pipeline_grads(of_logits, xs, ws))


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("loss,tail", [("forward_kl", "bucket"), ("reverse_kl", "renormalize"), ("jsd", "bucket"),
                                       ("tvd", "renormalize")])
def test_topk_exact_at_trained_magnitudes(backend, loss, tail, seed):
    xs, ws, xt, wt, labels = make_case(seed)
    ids, lp = flashkd.teacher_topk(xt.double(), wt.double(), 9, temperature=0.8)
    lp = lp.float()
    dev = _device(backend)
    xs_, ws_ = xs.to(dev).clone().requires_grad_(), ws.to(dev).clone().requires_grad_()
    opts = dict(loss=loss, tail=tail, temperature=0.8, weight_hard_loss=0.5, weight_soft_loss=0.5)
    labels = drop_tied_rows(labels, logits64(xs, ws), ids=ids, logprobs=lp, **opts)
    out = flashkd.fused_linear_distill_topk(xs_, ws_, ids.to(dev), lp.to(dev), labels.to(dev), backend=backend,
                                            chunk_size=16, **opts)
    grads = [g.cpu() for g in torch.autograd.grad(out, (xs_, ws_))]

    def of_logits(zs):
        return topk_loss(None, None, ids, lp, labels, student_logits=zs, **opts)[0]

    truth = truth_grads(lambda x, w: topk_loss(x, w, ids, lp, labels, **opts)[0], xs, ws)
    check(out, grads, truth, pipeline_grads(of_logits, xs, ws))


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("cap", [None, 30.0])
def test_teacher_topk_exact_at_trained_magnitudes(backend, cap, seed):
    """bf16 hidden states and head: the ids and log-probs of the float64 truth of the same inputs, to
    fp32 accuracy (bf16 logits would move a log-prob near 30 by up to 1/16)."""
    gen = torch.Generator().manual_seed(seed)
    xt, wt = trained_head(N, HT, V, gen)
    dev = _device(backend)
    ids, lp = (t.cpu() for t in flashkd.teacher_topk(xt.to(dev), wt.to(dev), 5, backend=backend, teacher_softcap=cap,
                                                     chunk_size=16))
    z = head(xt.double() @ wt.double().T, 1.0, cap)
    want = torch.log_softmax(z, -1)
    got_lp = want.gather(-1, ids)  # the truth's log-probs of the ids flashkd chose
    # the truth's top-k, up to near-ties that fp32 cannot order (bf16 logits move an entry near 30 by 1/16)
    assert (got_lp >= want.topk(5, -1).values[:, -1:] - 1e-4).all()
    assert (lp.double() - got_lp).abs().max().item() <= 2e-5 * max(1.0, got_lp.abs().max().item())


def test_bench_trained_inputs_have_a_trained_heads_magnitudes():
    """The bench's --inputs trained: logits of std ~4, and every 4th row's max at ~32."""
    from flashkd.bench.workloads import Workload, make_inputs

    w = Workload("jsd", 64, h=128, v=2053, dtype="float32", inputs="trained")
    x = make_inputs(w, torch.device("cpu"))
    for h, wt in ((x.xs, x.ws), (x.xt, x.wt)):
        z = (h @ wt.T).detach()
        assert 3.5 < z[1::4].std().item() < 4.5  # rows without a planted peak
        assert torch.allclose(z[::4].max(-1).values, torch.full((16,), 32.0), atol=0.05)
        assert z[1::4].max().item() < 25.0  # the other rows: no planted peak
    with pytest.raises(ValueError, match="inputs: expected one of bench, trained"):
        Workload(inputs="real")


def _gpu_backend(backend):
    """backend, or a skip where backend "cute" cannot run (no nvidia-cutlass-dsl, not sm_90)."""
    if backend == "cute":
        from flashkd.backends import cute_gemm

        if not cute_gemm.available() or torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("backend 'cute' needs nvidia-cutlass-dsl and an sm_90 GPU")
    return backend


@pytest.mark.gpu
@pytest.mark.parametrize("r,v,h", [(77, 1000, 72), (1, 260, 8), (300, 5000, 600), (1000, 30000, 2560)])
def test_gpu_cute_weight_gradient_gemm_against_float64(r, v, h, seed, monkeypatch):
    """`cute_gemm.accumulate`, the chunk loop's dW (V, H) = dSᵀ · X then += the next chunk's, with dS in the
    bf16 half of fp32 rows (`triton_rows.grad_view`: row stride 2V) as the loop hands it: one tile a CTA or
    none, several (an odd and an even count a warpgroup), against float64 at fp32's rounding."""
    _gpu_backend("cute")
    from flashkd.backends import cute_gemm

    g = torch.Generator(device="cuda").manual_seed(seed)
    ds = [torch.randn(r, 2 * v, device="cuda", generator=g).to(torch.bfloat16)[:, :v] for _ in range(3)]
    x = [torch.randn(r, h, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3)]
    out = torch.full((v, h), float("nan"), device="cuda")
    want = torch.zeros(v, h, device="cuda", dtype=torch.float64)
    launches = []  # the kernel's launches (`cute_gemm._launch`, spied on): each call runs it
    launch = cute_gemm._launch
    monkeypatch.setattr(cute_gemm, "_launch", lambda *a, **k: (launches.append(a), launch(*a, **k))[1])
    for i in range(3):
        assert cute_gemm.accumulate_eligible(out, ds[i].t(), x[i].t())
        cute_gemm.accumulate(out, ds[i].t(), x[i].t(), add=i > 0)
        want += ds[i].t().double() @ x[i].double()
        err = ((out.double() - want).abs().max() / want.abs().max()).item()
        assert err < 4e-6, (i, err)  # fp32 sums over K = r: ~1e-6 at r = 1000
    assert len(launches) == 3


def _cute_runs(loss, opts, grad=True):
    """Whether backend "cute" takes this call's logits GEMMs (else it runs the Triton path)."""
    from flashkd.backends import triton_rows
    from flashkd.losses import LossSpec

    spec = {k: v for k, v in opts.items() if k != "loss"}
    return triton_rows.tiles_fit(LossSpec(loss=loss, **spec), grad, False, True)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cute"])
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_gpu_exact_at_irregular_shapes(backend, loss, option, seed, monkeypatch):
    """The GPU kernels on the irregular shapes above (several chunks), trained-head magnitudes: within 1.3x
    the fp32-logit pipeline. On backend "cute" the CuTe logits GEMMs run where they fit (and are counted)."""
    backend = _gpu_backend(backend)
    xs, ws, xt, wt, labels = (t.cuda() for t in make_case(seed))
    opts = dict(OPTIONS[option], loss=loss)
    labels = drop_tied_rows(labels, logits64(xs, ws), logits64(xt, wt), **opts)
    xs_, ws_ = xs.clone().requires_grad_(), ws.clone().requires_grad_()
    if backend == "cute":
        from flashkd.backends import cute_gemm

        launches = []  # the logits GEMMs' launches (`cute_gemm._launch` with statistics planes, spied on)
        launch = cute_gemm._launch
        monkeypatch.setattr(cute_gemm, "_launch",
                            lambda *a, **k: (launches.append(a[3] is not None), launch(*a, **k))[1])
    out = flashkd.fused_linear_distill(xs_, ws_, xt, wt, labels, backend=backend, chunk_size=16, **opts)
    grads = torch.autograd.grad(out, (xs_, ws_))
    if backend == "cute":  # two chunks: two student and two teacher GEMMs
        assert sum(launches) == (4 if _cute_runs(loss, opts) else 0)
    zt = (xt.double() @ wt.double().T).float()

    def of_logits(zs):
        return distill_loss(None, None, None, None, labels, teacher_logits=zt, plain=True, student_logits=zs, **opts)[0]

    truth = truth_grads(lambda x, w: distill_loss(x, w, xt, wt, labels, **opts)[0], xs, ws)
    check(out, grads, truth, pipeline_grads(of_logits, xs, ws))


# the divergences whose pass 1 the CuTe GEMMs' per-tile statistics stand in for on backend "cute" (`tiles_fit`)
TILED = [("jeffreys", {}), ("triangular", {}), ("alpha_divergence", dict(alpha=0.3)), ("renyi", dict(alpha=0.7)),
         ("renyi_reverse", dict(alpha=1.4)), ("ab_divergence", dict(alpha=0.6, beta=1.3)),
         ("entropy_adaptive", dict(gate_min=0.1, gate_max=0.8, gate_center=0.4, gate_width=0.2))]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cute"])
@pytest.mark.parametrize("case", TILED, ids=[c[0] for c in TILED])
@pytest.mark.parametrize("option", ["plain", "tau"])
def test_gpu_divergences_exact_on_either_gemm(backend, case, option, seed, monkeypatch):
    """The α / Rényi / αβ family, Jeffreys, triangular and the entropy blend on the GPU at the irregular shapes
    above, trained-head magnitudes: within 1.3x the fp32-logit pipeline, on cuBLAS's GEMMs and the rows' three
    passes ("triton") and on the CuTe GEMMs whose per-tile statistics stand in for pass 1 ("cute", counted)."""
    backend = _gpu_backend(backend)
    xs, ws, xt, wt, labels = (t.cuda() for t in make_case(seed))
    opts = dict(OPTIONS[option], loss=case[0], **case[1])
    xs_, ws_ = xs.clone().requires_grad_(), ws.clone().requires_grad_()
    launches = []
    if backend == "cute":
        from flashkd.backends import cute_gemm

        launch = cute_gemm._launch
        monkeypatch.setattr(cute_gemm, "_launch",
                            lambda *a, **k: (launches.append(a[3] is not None), launch(*a, **k))[1])
    out = flashkd.fused_linear_distill(xs_, ws_, xt, wt, labels, backend=backend, chunk_size=16, **opts)
    grads = torch.autograd.grad(out, (xs_, ws_))
    assert sum(launches) == (4 if backend == "cute" else 0)  # two chunks: two student and two teacher GEMMs
    zt = (xt.double() @ wt.double().T).float()

    def of_logits(zs):
        return distill_loss(None, None, None, None, labels, teacher_logits=zt, plain=True, student_logits=zs, **opts)[0]

    truth = truth_grads(lambda x, w: distill_loss(x, w, xt, wt, labels, **opts)[0], xs, ws)
    check(out, grads, truth, pipeline_grads(of_logits, xs, ws))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cute"])
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("option", ["plain", "softcap"])
@pytest.mark.parametrize("chunk_size", [None, 160])
def test_gpu_exact_at_the_seed_vocab(backend, loss, option, chunk_size):
    """The real kernels (the logits GEMMs' fp32 output, the Triton rows) at the seed's vocab and hidden
    sizes, trained-head magnitudes, against the float64 truth on the GPU: within 1.3x the fp32-logit
    pipeline. In one chunk dW comes from one GEMM; in three (160, 160, 64 rows) it is accumulated at fp32."""
    backend = _gpu_backend(backend)
    gen = torch.Generator(device="cuda").manual_seed(7)
    n, v = 384, 128256
    xs, ws = trained_head(n, 2048, v, gen)
    xt, wt = trained_head(n, 4096, v, gen)
    labels = torch.randint(v, (n,), generator=gen, device="cuda")
    labels[1::7] = -100
    opts = dict(OPTIONS[option], loss=loss)
    xs_, ws_ = xs.clone().requires_grad_(), ws.clone().requires_grad_()
    out = flashkd.fused_linear_distill(xs_, ws_, xt, wt, labels, backend=backend, chunk_size=chunk_size, **opts)
    grads = torch.autograd.grad(out, (xs_, ws_))
    zt = (xt.double() @ wt.double().T).float()

    def of_logits(zs):
        return distill_loss(None, None, None, None, labels, teacher_logits=zt, plain=True, student_logits=zs, **opts)[0]

    truth = truth_grads(lambda x, w: distill_loss(x, w, xt, wt, labels, **opts)[0], xs, ws)
    check(out, grads, truth, pipeline_grads(of_logits, xs, ws))
