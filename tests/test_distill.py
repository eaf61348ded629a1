"""fused_linear_distill against the float64 oracle: every loss and option, both backends (the Triton backend on
DEVICE: the GPU, or the CPU under Triton's interpreter; the torch backend and the oracle on the CPU)."""

import itertools

import pytest
import torch

import flashkd
from conftest import BACKEND_PARAMS, _device, _on, needs_triton
from helpers.cases import HS, V, make_inputs, read, rel_err
from helpers.ties import drop_tied_rows, logits64
from oracle import distill_loss


def check_against_oracle(backend, dtype, lead, *, ignore, bias, padded, tol, chunk_size, **options):
    ignore_index = options.get("ignore_index", -100)
    xs, ws, xt, wt, labels, bs, bt = make_inputs(lead, dtype, ignore=ignore, bias=bias, padded=padded,
                                                 ignore_index=ignore_index)
    labels = drop_tied_rows(labels, logits64(xs, ws, bs), logits64(xt, wt, bt), **options)
    xs_, ws_, bs_, xt_, wt_, labels_, bt_ = _on(_device(backend), xs, ws, bs, xt, wt, labels, bt)
    loss, soft, hard = flashkd.fused_linear_distill(
        xs_, ws_, xt_, wt_, labels_, student_bias=bs_, teacher_bias=bt_, chunk_size=chunk_size, backend=backend,
        return_soft_hard_loss=True, vocab_size=V if padded else None, **read(options),
    )
    leaves = [xs, ws] + ([bs] if bias else [])
    grads = [g.cpu() for g in torch.autograd.grad(loss, [xs_, ws_] + ([bs_] if bias else []))]

    ref_leaves = [x.detach().double().requires_grad_() for x in leaves]
    ref_loss, ref_soft, ref_hard = distill_loss(
        ref_leaves[0], ref_leaves[1], xt, wt, labels, student_bias=ref_leaves[2] if bias else None,
        teacher_bias=bt, **options,
    )
    ref_grads = torch.autograd.grad(ref_loss, ref_leaves, allow_unused=True)

    assert loss.dtype == torch.promote_types(dtype, torch.float32) and loss.dim() == 0
    for name, got, want in (("loss", loss, ref_loss), ("soft", soft, ref_soft), ("hard", hard, ref_hard)):
        assert abs(got.item() - want.item()) <= tol * max(abs(want.item()), 1.0), (name, got.item(), want.item())
    for name, g, rg, x in zip(("dXs", "dWs", "dbs"), grads, ref_grads, leaves):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert torch.isfinite(g).all(), name
        if rg.abs().max() == 0:
            assert g.abs().max() == 0, name
        else:
            assert rel_err(g, rg) <= tol, (name, rel_err(g, rg))
    if ignore != "none":  # ignored rows get exactly zero gradient
        ignored = (labels == ignore_index).reshape(-1)
        assert grads[0].reshape(-1, HS)[ignored].abs().max() == 0


LOSS_NAMES = ["jsd", "forward_kl", "reverse_kl", "tvd", "cosine"]
GRID = [
    (loss, temperature, beta, *rest)
    for loss, temperature, beta, *rest in itertools.product(
        LOSS_NAMES,
        [1.0, 0.6, 2.3],  # temperature
        [0.0, 0.35, 1.0],  # beta: both JSD endpoints and the interior
        ["none", "some", "all"],  # ignore pattern
        [False, True],  # biases
        [(23,), (3, 7)],  # 2-D and 3-D inputs
        ["mean", "sum"],
    )
    if flashkd.losses.parameter("beta", loss) is not None or beta == 0.35  # one case where beta is not read
]


@pytest.mark.parametrize("loss,temperature,beta,ignore,bias,lead,reduction", GRID)
def test_torch_backend_float64(seed, loss, temperature, beta, ignore, bias, lead, reduction):
    check_against_oracle(
        "torch", torch.float64, lead, ignore=ignore, bias=bias, padded=bias, tol=1e-9, chunk_size=5,
        loss=loss, temperature=temperature, beta=beta, reduction=reduction,
    )


# The Triton kernel computes in fp32 and runs under the interpreter on CPU: every loss and β endpoint,
# the other options cycled through so each value is seen with each loss (β passed where the loss reads it).
TRITON_GRID = [
    (loss, beta, *opts)
    for (loss, beta), opts in zip(
        itertools.product(LOSS_NAMES, [0.0, 0.35, 1.0]),
        itertools.cycle(itertools.product([1.0, 0.6, 2.3], ["some", "all", "none"], [True, False], [(23,), (3, 7)])),
    )
]


@needs_triton
@pytest.mark.parametrize("loss,beta,temperature,ignore,bias,lead", TRITON_GRID)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_triton_backend_float32(seed, loss, beta, temperature, ignore, bias, lead, reduction):
    check_against_oracle(
        "triton", torch.float32, lead, ignore=ignore, bias=bias, padded=bias, tol=2e-5, chunk_size=5,
        loss=loss, temperature=temperature, beta=beta, reduction=reduction,
    )


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize(
    "options",
    [
        dict(weight_hard_loss=0.0, weight_soft_loss=1.0),  # soft only, as TRL uses
        dict(weight_hard_loss=1.0, weight_soft_loss=0.0),  # hard only: no teacher GEMM needed
        dict(weight_hard_loss=0.0, weight_soft_loss=0.0),
        dict(weight_hard_loss=0.3, weight_soft_loss=0.9, temperature=2.0, temperature_squared=True),
        dict(loss="reverse_kl", ignore_index=7),
    ],
)
def test_options_float32(seed, backend, options):
    check_against_oracle(backend, torch.float32, (19,), ignore="some", bias=False, padded=True, tol=2e-5,
                         chunk_size=4, **options)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("loss", LOSS_NAMES)
def test_no_labels(seed, backend, loss):
    xs, ws, xt, wt, _, _, _ = make_inputs((6,), torch.float32)
    got = flashkd.fused_linear_distill(*_on(_device(backend), xs, ws, xt, wt), loss=loss, weight_hard_loss=0.0,
                                       backend=backend)
    want, _, _ = distill_loss(xs.detach(), ws.detach(), xt, wt, loss=loss, weight_hard_loss=0.0)
    assert abs(got.item() - want.item()) <= 2e-5 * max(abs(want.item()), 1.0)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("chunk_size", [None, 1, 2, 7, 1000])
def test_chunk_size_does_not_change_result(seed, backend, chunk_size):
    check_against_oracle(backend, torch.float32, (2, 5), ignore="some", bias=True, padded=False, tol=2e-5,
                         chunk_size=chunk_size)


def test_default_chunks_fit_the_budget_and_are_even(seed):
    """The planned rows per chunk never exceed what fits, take no more chunks than needed, split n rows
    evenly, and are a multiple of 256 whenever that costs no extra chunk."""
    from flashkd.core.plan import even_chunks as _even_chunks

    g = torch.Generator().manual_seed(seed)
    cases = [(8192, 2092), (16384, 2092), (8192, 4186), (1, 5), (0, 5), (10, 3), (5000, 2092), (257, 256)]
    cases += [tuple(torch.randint(1, 20000, (2,), generator=g).tolist()) for _ in range(200)]
    for n, fit in cases:
        rows = _even_chunks(n, fit)
        count = -(-n // rows)
        assert 1 <= rows <= max(fit, 1) and (n <= fit) == (rows >= n), (n, fit, rows)
        if n > fit:
            assert count == -(-n // fit), (n, fit, rows)
            even = -(-n // count)
            assert rows - even < 256 and n - (count - 1) * rows > 0, (n, fit, rows)  # no chunk near empty
            assert (rows % 256 == 0) == (-(-even // 256) * 256 <= fit), (n, fit, rows)
    assert _even_chunks(8192, 2092) == 2048 and _even_chunks(8192, 4186) == 4096


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("loss", ["jsd", "cosine"])
def test_teacher_blocks_inside_a_chunk(seed, backend, loss, monkeypatch):
    """A chunk's teacher logits computed a few rows at a time (blocks not dividing the chunk) give the
    oracle's results."""
    monkeypatch.setattr(flashkd.core.plan, "chunk_rows", lambda *args: (7, 3))
    check_against_oracle(backend, torch.float32, (3, 7), ignore="some", bias=True, padded=True, tol=2e-5,
                         chunk_size=None, loss=loss, temperature=1.3)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_logits_freed_before_the_next_are_made(seed, backend, monkeypatch):
    """The memory formula's premise: when a chunk's student logits are made, no earlier logits are alive,
    and when a teacher block's are, only the chunk's own student logits."""
    import weakref

    made, linear = [], flashkd.core.loop.linear

    def tracked(x, w, b):
        alive = [student for student, ref in made if ref() is not None]
        student = w is ws
        assert alive == ([] if student else [True]), (student, alive)
        out = linear(x, w, b)
        made.append((student, weakref.ref(out)))
        return out

    monkeypatch.setattr(flashkd.core.loop, "linear", tracked)
    xs, ws = torch.randn(11, 4, requires_grad=True), torch.randn(13, 4, requires_grad=True)
    xt, wt, y = torch.randn(11, 6), torch.randn(13, 6), torch.randint(0, 13, (11,))
    xs, ws, xt, wt, y = _on(_device(backend), xs, ws, xt, wt, y)
    for chunk, teacher in ((4, 4), (4, 3), (11, 6)):
        monkeypatch.setattr(flashkd.core.plan, "chunk_rows", lambda *args: (chunk, teacher))
        flashkd.fused_linear_distill(xs, ws, xt, wt, y, backend=backend).backward()
    assert len(made) == (3 + 3) + (3 + 5) + (1 + 2)  # chunks + teacher blocks of each plan


def test_default_plan_one_chunk_when_no_higher(seed):
    """The default (triton) plan: 1 GiB of logits in equal chunks, or all rows in one chunk with the
    teacher in two blocks when dW is wanted and that chunk's peak (no dW accumulator) is no higher."""
    from flashkd.core.plan import LOGITS_BUDGET as _LOGITS_BUDGET, chunk_rows as _chunk_rows, even_chunks as _even_chunks, peak_bytes as _peak_bytes

    def plan(n, v, hs, form="heads", accum=4, dtype=torch.bfloat16):
        xs, ws = torch.empty(n, hs, device="meta", dtype=dtype), torch.empty(v, hs, device="meta", dtype=dtype)
        return _chunk_rows(None, xs, ws, "triton", form, accum)

    # bf16 inputs: fp32 logits (4 bytes), dL/ds in bf16 inside them (beside them for a top-k teacher)
    assert plan(8192, 128256, 2048) == (1024, 1024)
    assert plan(2048, 128256, 2048) == (2048, 1024)  # one chunk, teacher in halves, no accumulator
    assert plan(2048, 128256, 2048, accum=2) == (2048, 1024)  # a bf16 accumulator: the same peak, one GEMM
    assert plan(2048, 128256, 2048, accum=0) == (1024, 1024)  # no dW: nothing to save
    assert plan(1800, 128256, 2048) == (1800, 900)
    assert plan(2600, 128256, 2048) == (2600, 1300)  # S + T of 2600 rows: 1908 MiB, chunks + accumulator 2004
    assert plan(3500, 128256, 2048) == (1024, 1024)  # one chunk's logits would peak higher
    assert plan(1024, 128256, 2048) == (1024, 1024)
    assert plan(5000, 128256, 2048, form="topk") == (1792, 1792)  # S + dS of 5000 rows > 1792 rows + accumulator
    assert plan(3000, 128256, 4096, form="topk") == (3000, 3000)  # a wider head: its accumulator pays
    assert plan(8192, 128256, 2048, form="logits") == (2048, 2048)
    assert plan(8192, 128256, 2048, dtype=torch.float32) == (1024, 1024)  # fp32 inputs: fp32 logits, no dS copy
    g = torch.Generator().manual_seed(seed)
    for _ in range(300):
        n, v, hs = (int(torch.randint(lo, hi, (), generator=g)) for lo, hi in ((1, 40000), (1000, 260000), (64, 8192)))
        form = ("heads", "logits", "topk")[int(torch.randint(0, 3, (), generator=g))]
        accum = (0, 2, 4)[int(torch.randint(0, 3, (), generator=g))]
        rows, teacher = plan(n, v, hs, form, accum)
        blocks, row = (2 if form == "heads" else 1), v * 4  # fp32 logits of the bf16 inputs
        even = _even_chunks(n, _LOGITS_BUDGET["triton"] // (row * blocks))
        assert even * row * blocks <= _LOGITS_BUDGET["triton"] or even == 1, (n, v, hs, form)
        one = -(-n // 2) if form == "heads" else n
        peak_one, peak_even = (_peak_bytes(n, v, hs, 2, r, t, form=form, accum_bytes=accum) for r, t in ((n, one), (even, even)))
        if even < n and accum and peak_one <= peak_even:  # one chunk where the budget wanted several
            assert (rows, teacher) == (n, one), (n, v, hs, form, accum, rows, teacher)
        else:
            assert (rows, teacher) == (even, even), (n, v, hs, form, accum, rows, teacher)


def test_peak_bytes_formula():
    """The peak formula against the sizes the chunk loop holds at once, worked by hand for the seed head
    (V = 128256, Hs = 2048, bf16; MiB): fp32 logits of R rows 0.4893·R, dS of R rows in bf16 0.2446·R
    (inside S's bytes, but for a top-k teacher's, or where moved out of them), dX 16·N/4096, dW 501, fp32
    accumulator 1002."""
    from flashkd.core.plan import peak_bytes as _peak_bytes

    v, hs, mib = 128256, 2048, 2**20
    row, ds, dw = v * 4 / mib, v * 2 / mib, v * hs * 2 / mib
    peak = lambda n, r, rt, accum, form="heads", e=2: _peak_bytes(n, v, hs, e, r, rt, form=form, accum_bytes=accum) / mib
    # one chunk, teacher in halves: S + T (1.5 N rows); or S (holding dS) + dW after T is freed; or, where dW
    # outweighs dS, dS moved out of S (the copy beside S) and dW made once S is freed
    assert peak(4096, 4096, 2048, 4) == pytest.approx(16 + 1.5 * 4096 * row)
    assert peak(4096, 4096, 4096, 4, form="logits") == pytest.approx(16 + 4096 * row + dw)
    assert peak(1024, 1024, 256, 4) == pytest.approx(4 + 1024 * ds + max(1024 * row, dw))
    assert peak(256, 256, 128, 4) == pytest.approx(1 + 256 * ds + dw)
    # chunks with an fp32 accumulator: S + T + accumulator, or accumulator + its bf16 copy at the end
    assert peak(8192, 1024, 1024, 4) == pytest.approx(32 + 2048 * row + 2 * dw)
    assert peak(8192, 256, 256, 4) == pytest.approx(32 + 3 * dw)
    # a bf16 accumulator is dW itself: no copy; no dW wanted: the logits alone
    assert peak(8192, 256, 256, 2) == pytest.approx(32 + 512 * row + dw)
    assert peak(8192, 1024, 1024, 0) == pytest.approx(32 + 2048 * row)
    assert peak(8192, 1024, 0, 4, form="topk") == pytest.approx(32 + 1024 * row + 1024 * ds + 2 * dw)
    # fp32 inputs: fp32 logits, dS written over them
    assert peak(8192, 1024, 1024, 4, e=4) == pytest.approx(64 + 2048 * row + 2 * dw)


@pytest.mark.parametrize("loss", LOSS_NAMES)
def test_gradcheck(seed, loss):
    xs = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    ws = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    bs = torch.randn(5, dtype=torch.float64, requires_grad=True)
    xt, wt = torch.randn(4, 2, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    labels = torch.tensor([1, -100, 4, 0])

    def f(xs, ws, bs):
        return flashkd.fused_linear_distill(xs, ws, xt, wt, labels, student_bias=bs, temperature=1.7, chunk_size=3,
                                            backend="torch", **read(dict(loss=loss, beta=0.3)))

    assert torch.autograd.gradcheck(f, (xs, ws, bs))

