"""Bad input, edge cases and autograd behaviour of the public API. The Triton backend on DEVICE (the GPU, or
the CPU under Triton's interpreter), the torch backend and the references on the CPU."""

import pytest
import torch

import flashkd
import flashkd.core
from conftest import BACKEND_PARAMS, _device, _on
from helpers.integrations import error_without
from helpers.ties import drop_tied_rows, logits64
from oracle import distill_loss


def inputs(n=6, v=9, hs=4, ht=5, vt=None, dtype=torch.float32):
    xs = torch.randn(n, hs, dtype=dtype, requires_grad=True)
    ws = torch.randn(v, hs, dtype=dtype, requires_grad=True)
    xt = torch.randn(n, ht, dtype=dtype)
    wt = torch.randn(vt or v, ht, dtype=dtype)
    y = torch.randint(0, v, (n,))
    return xs, ws, xt, wt, y


@pytest.mark.parametrize(
    "change,error,words",
    [
        (dict(teacher_input=torch.randn(7, 5)), ValueError, ["teacher_input", "(6,)", "(7,)"]),
        (dict(labels=torch.zeros(5, dtype=torch.long)), ValueError, ["labels", "(6,)", "(5,)"]),
        (dict(student_input=torch.randn(6, 3)), ValueError, ["student_input", "hidden size 4", "got 3"]),
        (dict(teacher_input=torch.randn(6, 2)), ValueError, ["teacher_input", "hidden size 5", "got 2"]),
        (dict(teacher_weight=torch.randn(8, 5)), ValueError, ["teacher_weight", "expected 9 rows", "got 8"]),
        (dict(teacher_weight=torch.randn(10, 5)), ValueError,
         ["teacher_weight", "expected 9 rows (the student's vocab), got 10: ambiguous", "pass vocab_size=9"]),
        (dict(teacher_weight=torch.randn(10, 5), vocab_size=10), ValueError, ["vocab_size", "expected 9", "got 10"]),
        (dict(vocab_size=0), TypeError, ["vocab_size", "int >= 1", "0"]),
        (dict(student_bias=torch.randn(8)), ValueError, ["student_bias", "(9,)", "(8,)"]),
        (dict(labels=torch.full((6,), 9)), ValueError, ["labels", "[0, 9)", "got 9"]),
        (dict(labels=torch.full((6,), -1)), ValueError, ["labels", "got -1"]),
        (dict(labels=torch.zeros(6)), TypeError, ["labels", "integer", "float32"]),
        (dict(temperature=0.0), ValueError, ["temperature", "> 0", "0.0"]),
        (dict(temperature=-1.0), ValueError, ["temperature", "-1.0"]),
        (dict(beta=1.5), ValueError, ["beta", "[0, 1]", "1.5"]),
        (dict(beta=-0.1), ValueError, ["beta", "-0.1"]),
        (dict(beta=float("nan")), TypeError, ["beta", "nan"]),
        (dict(beta=torch.tensor(0.5)), TypeError, ["beta", "Python float"]),
        (dict(loss="forward_kl", beta=0.35), ValueError, ["beta", "loss='forward_kl' does not read it", "beta=0.35"]),
        (dict(alpha=0.2), ValueError, ["alpha", "loss='jsd' does not read it", "alpha=0.2"]),
        (dict(loss="jsd", head_mass=0.7), ValueError, ["head_mass", "loss='jsd' does not read it", "head_mass=0.7"]),
        (dict(loss="kl"), ValueError, ["loss", "'jsd'", "'kl'"]),
        (dict(reduction="none"), ValueError, ["reduction", "'mean'", "'none'"]),
        (dict(backend="cuda"), ValueError, ["backend", "'cuda'"]),
        (dict(backend="cute"), ValueError, ["backend", "'cute'"]),  # CPU tensors (or no nvidia-cutlass-dsl)
        (dict(chunk_size=0), ValueError, ["chunk_size", "0"]),
        (dict(student_input=torch.randint(0, 3, (6, 4))), TypeError, ["student_input", "floating", "int64"]),
        (dict(teacher_weight=torch.randn(9, 5, dtype=torch.float64)), TypeError,
         ["teacher_weight", "torch.float32", "torch.float64"]),
        (dict(student_weight=torch.randn(9, 4, 1)), ValueError, ["student_weight", "2-D", "(9, 4, 1)"]),
        (dict(labels=None), ValueError, ["weight_hard_loss", "labels is None", "0.5"]),
        (dict(teacher_input=torch.randn(6, 5, device="meta")), ValueError, ["teacher_input", "cpu", "meta"]),
        (dict(student_input=[[1.0]]), TypeError, ["student_input", "torch.Tensor", "list"]),
        (dict(grad_accum_dtype=torch.int32), TypeError, ["grad_accum_dtype", "torch.int32"]),
    ],
)
def test_bad_input_is_named(change, error, words):
    xs, ws, xt, wt, y = inputs()
    args = dict(student_input=xs, student_weight=ws, teacher_input=xt, teacher_weight=wt, labels=y)
    options = {k: change.pop(k) for k in list(change) if k not in args}
    args.update(change)
    with pytest.raises(error) as info:
        flashkd.fused_linear_distill(**args, **options)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("name", ["student_input", "student_weight", "teacher_input", "teacher_weight", "labels",
                                  "teacher_logits", "teacher_ids", "teacher_logprobs"])
def test_a_required_tensor_that_is_none_or_sparse_is_named(name):
    """None for a required tensor died in an AttributeError ('NoneType' object has no attribute 'dim'), a
    sparse one in torch's reshape or expand; both are now a TypeError naming the argument."""
    xs, ws, xt, wt, y = inputs()
    if name.startswith("teacher_") and name not in ("teacher_input", "teacher_weight"):
        call = (flashkd.fused_linear_distill_logits if name == "teacher_logits" else flashkd.fused_linear_distill_topk)
        args = (dict(teacher_logits=torch.randn(6, 9)) if name == "teacher_logits" else
                dict(teacher_ids=torch.stack([torch.randperm(9)[:3] for _ in range(6)]), teacher_logprobs=torch.randn(6, 3).log_softmax(-1)))
    else:
        call, args = flashkd.fused_linear_distill, dict(teacher_input=xt, teacher_weight=wt)
    args = dict(student_input=xs, student_weight=ws, labels=y, **args)
    dense = args[name]
    for value, said in ((None, f"{name}: expected a torch.Tensor, got None"),
                        (dense.detach().to_sparse(), f"{name}: expected a dense (strided) tensor, got layout torch.sparse_coo")):
        if value is None and name == "labels":
            continue  # labels may be None (no CE)
        with pytest.raises(TypeError) as info:
            call(**{**args, name: value})
        assert str(info.value).startswith(said), str(info.value)
    call(**args)  # the dense one runs
    with pytest.raises(TypeError, match=r"^teacher_weight: expected a torch.Tensor, got None$"):
        flashkd.teacher_topk(xt, None, 2)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without torch.distributed")
def test_dtensor_weight_is_sharded_on_dim_0_or_named():
    """A DTensor head sharded on dim 0 (an FSDP2 parameter outside its module's forward) gives the local
    call's loss and gradients, which land on the DTensor (flashkd.distributed; several ranks:
    tests/test_distributed.py); any other DTensor is an error naming the argument, not a failure inside a
    GEMM, and its full_tensor(), as the message suggests, works."""
    from torch import distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        xs, ws, xt, wt, y = inputs()
        mesh = init_device_mesh("cpu", (1,))
        sharded = distribute_tensor(ws.detach(), mesh, [Shard(0)]).requires_grad_()
        replicated = distribute_tensor(ws.detach(), mesh, [Replicate()]).requires_grad_()
        with pytest.raises(TypeError, match="student_weight: expected a local torch.Tensor or a DTensor sharded on dim 0"):
            flashkd.fused_linear_distill(xs, replicated, xt, wt, y)
        flashkd.fused_linear_distill(xs, replicated.full_tensor(), xt, wt, y).backward()
        flashkd.fused_linear_distill(xs, sharded, xt, wt, y).backward()
        flashkd.fused_linear_distill(xs, ws, xt, wt, y).backward()
        torch.testing.assert_close(sharded.grad.full_tensor(), ws.grad)
        torch.testing.assert_close(replicated.grad.full_tensor(), ws.grad)
    finally:
        dist.destroy_process_group()


def test_unchecked_bad_label_gives_nan_not_garbage():
    xs, ws, xt, wt, y = inputs()
    y[2] = 50
    loss = flashkd.fused_linear_distill(xs, ws, xt, wt, y, check_labels=False)
    assert torch.isnan(loss)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_all_rows_ignored(backend):
    xs, ws, xt, wt, y = _on(_device(backend), *inputs())
    y.fill_(-100)
    loss = flashkd.fused_linear_distill(xs, ws, xt, wt, y, backend=backend)
    loss.backward()
    assert loss.item() == 0.0
    assert xs.grad.abs().max() == 0 and ws.grad.abs().max() == 0


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_empty_batch(backend):
    xs, ws, xt, wt, y = _on(_device(backend), *inputs(n=0))
    loss = flashkd.fused_linear_distill(xs, ws, xt, wt, y, backend=backend)
    loss.backward()
    assert loss.item() == 0.0 and xs.grad.shape == (0, 4) and ws.grad.abs().max() == 0


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("loss", flashkd.LOSSES)
def test_single_row(backend, loss):
    xs, ws, xt, wt, y = inputs(n=1)
    y = drop_tied_rows(y, logits64(xs, ws), logits64(xt, wt), loss=loss)  # AKL's loss jumps with its head set
    xs_, ws_, xt_, wt_, y_ = _on(_device(backend), xs, ws, xt, wt, y)
    got = flashkd.fused_linear_distill(xs_, ws_, xt_, wt_, y_, loss=loss, backend=backend)
    want, _, _ = distill_loss(xs.detach(), ws.detach(), xt, wt, y, loss=loss)
    got.backward()
    assert torch.isfinite(xs_.grad).all() and torch.isfinite(ws_.grad).all()
    assert abs(got.item() - want.item()) <= 2e-5 * max(1.0, abs(want.item()))


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_non_contiguous_inputs(backend):
    xs, ws, xt, wt, y = inputs(n=8, hs=6)
    dev = _device(backend)  # the same layouts there: each view taken of its base moved whole
    xs_base, ws_base, xt_base = torch.randn(6, 8), torch.randn(6, 9), torch.randn(8, 10)
    xs_t = xs_base.to(dev).t().requires_grad_()  # (8, 6), column-major
    ws_t = ws_base.to(dev).t().requires_grad_()  # (9, 6)
    xt_nc = xt_base.to(dev)[:, ::2]  # (8, 5), strided
    loss = flashkd.fused_linear_distill(xs_t, ws_t, xt_nc, *_on(dev, wt, y), backend=backend, chunk_size=3)
    loss.backward()
    ref_x, ref_w = xs_base.t().clone().requires_grad_(), ws_base.t().clone().requires_grad_()
    ref, _, _ = distill_loss(ref_x, ref_w, xt_base[:, ::2], wt, y)
    ref.backward()
    ref_x, ref_w = ref_x.grad.double(), ref_w.grad.double()
    assert torch.allclose(loss.double().cpu(), ref, rtol=2e-5)
    assert torch.allclose(xs_t.grad.double().cpu(), ref_x, rtol=1e-4, atol=1e-6)
    assert torch.allclose(ws_t.grad.double().cpu(), ref_w, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("grad_output", [0.0, -2.5, 3.0, 1.0])
def test_grad_output_scales(grad_output, backend):
    dev = _device(backend)
    xs, ws, xt, wt, y = _on(dev, *inputs())
    loss = flashkd.fused_linear_distill(xs, ws, xt, wt, y, backend=backend)
    dx, dw = torch.autograd.grad(loss, (xs, ws))
    xs.grad = ws.grad = None
    (loss2 := flashkd.fused_linear_distill(xs, ws, xt, wt, y, backend=backend)).backward(
        torch.tensor(grad_output, device=dev))
    assert torch.equal(xs.grad, dx * grad_output) and torch.equal(ws.grad, dw * grad_output)
    assert torch.isfinite(loss2)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("retain", [False, True])
def test_grad_output_scales_bf16_gradients_in_fp32(backend, retain):
    """A loss divided by a token count before backward (TRL's trainers): bf16 gradients scaled by the fp32
    grad_output and rounded once. grad_output rounded to bf16 first (1/3 → 0.333984) would scale every
    gradient 0.2 % off."""
    dev = _device(backend)
    xs, ws, xt, wt, y = _on(dev, *inputs(dtype=torch.bfloat16))
    loss = flashkd.fused_linear_distill(xs, ws, xt, wt, y, backend=backend)
    dx, dw = torch.autograd.grad(loss, (xs, ws))
    scale = torch.tensor(1.0 / 3.0, device=dev)
    loss = flashkd.fused_linear_distill(xs, ws, xt, wt, y, backend=backend)
    (loss / 3.0).backward(retain_graph=retain)
    for got, once in ((xs.grad, dx), (ws.grad, dw)):
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, (once.float() * scale).bfloat16()), (got, once)


def test_no_gradient_work_without_grad(monkeypatch):
    calls = []
    real = flashkd.backends.torch_rows.rows
    monkeypatch.setattr(flashkd.backends.torch_rows, "rows", lambda *a: calls.append(a[-1]) or real(*a))
    monkeypatch.setattr(flashkd.core.loop, "accumulate_mm", lambda *a: pytest.fail("dW GEMM under no_grad"))
    xs, ws, xt, wt, y = inputs()
    with torch.no_grad():
        flashkd.fused_linear_distill(xs, ws, xt, wt, y, chunk_size=2)
    flashkd.fused_linear_distill(xs.detach(), ws.detach(), xt, wt, y, chunk_size=2)
    assert calls and not any(calls)


def test_only_the_wanted_grads_are_computed(monkeypatch):
    monkeypatch.setattr(flashkd.core.loop, "accumulate_mm", lambda *a: pytest.fail("dW GEMM for a frozen head"))
    xs, ws, xt, wt, y = inputs()
    ws.requires_grad_(False)
    flashkd.fused_linear_distill(xs, ws, xt, wt, y).backward()
    assert xs.grad is not None and ws.grad is None


def test_soft_and_hard_are_detached_terms():
    xs, ws, xt, wt, y = inputs()
    loss, soft, hard = flashkd.fused_linear_distill(xs, ws, xt, wt, y, weight_hard_loss=0.25,
                                                    weight_soft_loss=2.0, return_soft_hard_loss=True)
    assert not soft.requires_grad and not hard.requires_grad
    assert torch.allclose(loss, 0.25 * hard + 2.0 * soft)


def test_modules_match_the_function():
    xs, ws, xt, wt, y = inputs()
    for module, loss in ((flashkd.FusedLinearJSDLoss(beta=0.2), "jsd"),
                         (flashkd.FusedLinearCosineSimilarityLoss(beta=0.2), "cosine"),
                         (flashkd.FusedLinearDistillLoss("tvd"), "tvd")):
        want = flashkd.fused_linear_distill(xs, ws, xt, wt, y, loss=loss, beta=0.2 if loss != "tvd" else None)
        assert torch.equal(module(xs, ws, xt, wt, y), want)
    assert "tvd" in repr(flashkd.FusedLinearDistillLoss("tvd"))
    # beta is not read by tvd: a tvd module given one is refused where it is made
    with pytest.raises(ValueError) as e:
        flashkd.FusedLinearDistillLoss("tvd", beta=0.2)
    assert str(e.value) == ("beta: loss='tvd' does not read it (it is read by loss='jsd', loss='cosine', "
                            "loss='ab_divergence', loss='dkd'); got beta=0.2, leave it out")



@pytest.mark.parametrize("make,error,words", [
    (lambda: flashkd.FusedLinearDistillLoss(loss="bogus"), ValueError, ["loss", "'bogus'"]),
    (lambda: flashkd.FusedLinearDistillLoss("jsd", temperature=0.0), ValueError, ["temperature", "0.0"]),
    (lambda: flashkd.FusedLinearDistillLoss("jsd", reduction="max"), ValueError, ["reduction", "'max'"]),
    (lambda: flashkd.FusedLinearDistillLoss("jsd", return_stats=1), TypeError, ["return_stats", "bool"]),
    (lambda: flashkd.FusedLinearDistillLoss("jsd", teacher_precision="fp4"), ValueError, ["teacher_precision"]),
    (lambda: flashkd.FusedLinearJSDLoss(beta=-1.0), ValueError, ["beta", "-1.0"]),
    (lambda: flashkd.FusedLinearCosineSimilarityLoss(weight_soft_loss=float("nan")), TypeError, ["weight_soft_loss"]),
    (lambda: flashkd.FusedLinearJSD(1.5), ValueError, ["jsd_beta", "1.5"]),
    (lambda: flashkd.FusedLinearDistillLoss("jsd", backend="bogus"), ValueError, ["backend", "'triton'", "'bogus'"]),
    (lambda: flashkd.FusedLinearDistillLoss("jsd", chunk_size=0), ValueError, ["chunk_size", "positive int", "0"]),
    (lambda: flashkd.FusedLinearDistillLoss("jsd", grad_accum_dtype=torch.int32), TypeError,
     ["grad_accum_dtype", "float32", "torch.int32"]),
    (lambda: flashkd.FusedLinearJSDLoss(chunk_size=2.5), ValueError, ["chunk_size", "2.5"]),
    (lambda: flashkd.FusedLinearJSD(accum_dtype=torch.int32), TypeError, ["accum_dtype", "torch.int32"]),
])
def test_modules_check_their_options_when_made(make, error, words):
    """A bad option value is refused where the module is made, with the call's own message naming the
    argument as it was passed, not at the first forward (which may come much later, inside a trainer)."""
    with pytest.raises(error) as e:
        make()
    assert str(e.value).startswith(words[0] + ":") and all(w in str(e.value) for w in words), str(e.value)


def test_liger_style_attributes_check_the_value_set():
    module = flashkd.FusedLinearJSDLoss()
    with pytest.raises(ValueError, match="beta"):
        module.beta = 2.0
    assert module.beta == 0.5  # unchanged
    module.beta = 0.25
    assert module.options["beta"] == 0.25
    with pytest.raises(ValueError, match="chunk_size"):
        module.chunk_size = 0
    assert module.chunk_size is None

def test_inside_torch_compile():
    xs, ws, xt, wt, y = inputs()

    @torch.compile(backend="aot_eager", fullgraph=False)
    def step(xs, ws):
        return 2.0 * flashkd.fused_linear_distill(xs, ws, xt, wt, y) + 1.0

    out = step(xs, ws)
    out.backward()
    want = 2.0 * flashkd.fused_linear_distill(xs.detach(), ws.detach(), xt, wt, y) + 1.0
    assert torch.allclose(out, want) and xs.grad is not None and torch.isfinite(ws.grad).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_are_as_accurate_as_plain_torch(seed, dtype):
    """Judged against fp32 truth: no worse than the naive formula run in the same dtype."""
    xs, ws, xt, wt, y = inputs(n=33, v=301, hs=16, ht=24, dtype=dtype)
    loss = flashkd.fused_linear_distill(xs, ws, xt, wt, y, chunk_size=8)
    dx, dw = torch.autograd.grad(loss, (xs, ws))
    truth_x, truth_w = xs.detach().double().requires_grad_(), ws.detach().double().requires_grad_()
    truth, _, _ = distill_loss(truth_x, truth_w, xt.double(), wt.double(), y)
    tdx, tdw = torch.autograd.grad(truth, (truth_x, truth_w))
    # plain torch in the same dtype: logits in `dtype`, its usual fp32 upcast for the softmax
    px, pw = xs.detach().clone().requires_grad_(), ws.detach().clone().requires_grad_()
    s, t = (px @ pw.T).float(), (xt @ wt.T).float()
    q, p = s.log_softmax(-1), t.log_softmax(-1)
    m = torch.logsumexp(torch.stack([q, p]) + torch.tensor(0.5).log(), 0)
    soft = 0.5 * (q.exp() * (q - m)).sum(-1) + 0.5 * (p.exp() * (p - m)).sum(-1)
    plain = 0.5 * torch.nn.functional.cross_entropy(s, y) + 0.5 * soft.mean()
    pdx, pdw = torch.autograd.grad(plain, (px, pw))

    def err(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    assert abs(loss.item() - truth.item()) / abs(truth.item()) <= max(3 * abs(plain.item() - truth.item()) / abs(truth.item()), 1e-5)
    assert err(dx, tdx) <= 1.5 * err(pdx, tdx) + 1e-4
    assert err(dw, tdw) <= 1.5 * err(pdw, tdw) + 1e-4


def test_hf_integration_without_transformers_names_the_extra():
    """As on a machine without transformers (its import blocked): the import error says what to install,
    as flashkd.data's and flashkd.integrations.trl's do."""
    last = error_without("transformers", "from flashkd.integrations.transformers import DistillationTrainer\n")
    assert last.startswith("ImportError: flashkd.integrations.transformers needs transformers"), last
    assert 'pip install "flashkd[hf]"' in last
