"""What the divergences' tests (test_divergences.py: skew KL, skew reverse KL, AKL; test_divergence_family.py:
Jeffreys to DKD) share: one loss's call in each form at trained magnitudes against the float64 truth and the
fp32-logit pipeline (tests/helpers/exact.py), every option in float64 against the oracle, masked ids, and
the forms on a vocab split across ranks against the unsharded call. A call on backend "triton" runs on the
GPU, or on the CPU under Triton's interpreter (`device`: conftest.py's `_device`); every other call, and every
reference, on the CPU."""

import torch

import flashkd
from conftest import _device as device  # test_divergences.py imports it by this name
from helpers.cases import read
from helpers.distributed import compare_sharded, leaf
from helpers.exact import check, make_case, pipeline_grads, truth_grads
from helpers.ties import drop_tied_rows, logits64
from oracle import distill_loss, topk_loss


def _on(dev, options):
    """options with their tensors (a row_weight) on dev."""
    return {k: v.to(dev) if torch.is_tensor(v) else v for k, v in options.items()}


def small(seed, n=13, h=8, v=29, scale=1.5):
    """A small float64 case (xs, ws, xt, wt, labels) of odd sizes."""
    g = torch.Generator().manual_seed(seed)
    f = dict(generator=g, dtype=torch.float64)
    return (torch.randn(n, h, **f), torch.randn(v, h, **f) * scale, torch.randn(n, h, **f),
            torch.randn(v, h, **f) * scale, torch.randint(v, (n,), generator=g))


def check_dense_exact(backend, seed, opts, *, logits=False):
    """`fused_linear_distill` (`logits`: `fused_linear_distill_logits` on the teacher's bf16 logits) with
    `opts` on make_case(seed), against the truth at the bar of tests/test_exact.py. Rows whose soft term
    jumps within fp32's reach (TVD's and AKL's, a clamp's) are ignored (`drop_tied_rows`); the others are
    all compared."""
    xs, ws, xt, wt, labels = make_case(seed)
    if logits:
        tl = (xt.double() @ wt.double().T).to(xs.dtype)
        labels = drop_tied_rows(labels, logits64(xs, ws), tl, **opts)
        fn, teacher, zt = flashkd.fused_linear_distill_logits, (tl,), tl.float()
    else:
        labels = drop_tied_rows(labels, logits64(xs, ws), logits64(xt, wt), **opts)
        fn, teacher, zt = flashkd.fused_linear_distill, (xt, wt), (xt.double() @ wt.double().T).float()
    dev = device(backend)
    xs_, ws_ = xs.to(dev).clone().requires_grad_(), ws.to(dev).clone().requires_grad_()
    out = fn(xs_, ws_, *(t.to(dev) for t in teacher), labels.to(dev), backend=backend, chunk_size=16, **_on(dev, opts))
    grads = [g.cpu() for g in torch.autograd.grad(out, (xs_, ws_))]

    def of_logits(zs):
        return distill_loss(None, None, None, None, labels, teacher_logits=zt, plain=True, student_logits=zs, **opts)[0]

    def of_inputs(x, w):
        if logits:
            return distill_loss(x, w, None, None, labels, teacher_logits=tl, **opts)[0]
        return distill_loss(x, w, xt, wt, labels, **opts)[0]

    check(out, grads, truth_grads(of_inputs, xs, ws), pipeline_grads(of_logits, xs, ws))


def check_topk_exact(backend, seed, loss, tail, clamp, params, *, drop_ties):
    """`fused_linear_distill_topk` from a teacher's top-9 log-probs (a row with unused slots) at trained
    magnitudes, against the truth at the bar of tests/test_exact.py (on the Triton backend, the kernels'
    passes over the vocab; the categories' math in torch); `drop_ties`: rows whose soft term jumps within
    fp32's reach ignored."""
    xs, ws, xt, wt, labels = make_case(seed)
    ids, lp = flashkd.teacher_topk(xt.double(), wt.double(), 9, temperature=0.8)
    lp = lp.float()
    ids[2, 3:] = -1  # unused slots
    opts = dict(loss=loss, tail=tail, tail_clamp=clamp, temperature=0.8, weight_hard_loss=0.5, weight_soft_loss=0.5,
                **params)
    if drop_ties:
        labels = drop_tied_rows(labels, logits64(xs, ws), ids=ids, logprobs=lp, **opts)
    dev = device(backend)
    xs_, ws_ = xs.to(dev).clone().requires_grad_(), ws.to(dev).clone().requires_grad_()
    out = flashkd.fused_linear_distill_topk(xs_, ws_, ids.to(dev), lp.to(dev), labels.to(dev), chunk_size=16,
                                            backend=backend, **opts)
    grads = [g.cpu() for g in torch.autograd.grad(out, (xs_, ws_))]

    def of_logits(zs):
        return topk_loss(None, None, ids, lp, labels, student_logits=zs, **opts)[0]

    truth = truth_grads(lambda x, w: topk_loss(x, w, ids, lp, labels, **opts)[0], xs, ws)
    check(out, grads, truth, pipeline_grads(of_logits, xs, ws))


def check_every_option_in_float64(backend, seed, loss, params):
    """fp64 inputs: the loss and every gradient (x, W, bias) to ~1e-10 of the oracle, with temperature and
    τ², both heads' transforms, biases, row weights, ignored rows, "sum", and the loss's `params`."""
    xs, ws, xt, wt, labels = small(seed)
    labels[::5] = -100
    bs = torch.randn(ws.shape[0], dtype=torch.float64)
    rw = torch.rand(xs.shape[0], dtype=torch.float64)
    opts = dict(loss=loss, temperature=1.7, temperature_squared=True, student_logit_scale=0.8, teacher_logit_scale=1.2,
                student_softcap=3.0, teacher_softcap=4.0, reduction="sum", weight_hard_loss=0.3, weight_soft_loss=0.7,
                **params)
    dev = device(backend)
    leaves = [t.to(dev).clone().requires_grad_() for t in (xs, ws, bs)]
    out = flashkd.fused_linear_distill(leaves[0], leaves[1], xt.to(dev), wt.to(dev), labels.to(dev),
                                       student_bias=leaves[2], row_weight=rw.to(dev), backend=backend, chunk_size=5,
                                       **read(opts))
    ref_leaves = [xs.clone().requires_grad_(), ws.clone().requires_grad_(), bs.clone().requires_grad_()]
    want = distill_loss(ref_leaves[0], ref_leaves[1], xt, wt, labels, student_bias=ref_leaves[2], row_weight=rw,
                        **opts)[0]
    torch.testing.assert_close(out.cpu(), want, rtol=1e-10, atol=1e-12)
    for got, ref in zip(torch.autograd.grad(out, leaves), torch.autograd.grad(want, ref_leaves)):
        torch.testing.assert_close(got.cpu(), ref, rtol=1e-9, atol=1e-11)


def check_masked_ids(xs, ws, tl, labels, bias, opts, *, oracle=None, **call):
    """`fused_linear_distill_logits` with −inf teacher logits `tl` and a −inf student `bias`: a finite loss
    and a finite dX, both against the oracle's (given `oracle`, the options it takes whole)."""
    dev = device(call.get("backend"))
    x = xs.to(dev).clone().requires_grad_()
    out = flashkd.fused_linear_distill_logits(x, ws.to(dev), tl.to(dev), None if labels is None else labels.to(dev),
                                              student_bias=bias.to(dev), **call, **read(opts))
    xr = xs.clone().requires_grad_()
    want = distill_loss(None, None, None, None, labels, teacher_logits=tl, student_logits=xr @ ws.T + bias,
                        **(oracle or opts))[0]
    assert torch.isfinite(out)
    torch.testing.assert_close(out.cpu(), want, rtol=1e-10, atol=1e-12)
    got_dx = torch.autograd.grad(out, x)[0].cpu()
    assert torch.isfinite(got_dx).all()
    torch.testing.assert_close(got_dx, torch.autograd.grad(want, xr)[0], rtol=1e-9, atol=1e-12)


def compare_forms_sharded(options, inputs, start, stop, par, *, topk=True):
    """One loss's `options` in the heads and logits forms (and, with `topk`, from the teacher's top-5 with
    tail "renormalize") on this rank's vocab slice [start, stop) against the unsharded call; `inputs`:
    (xs, ws, xt, wt, labels, bs) the same on every rank, `par`: the sharding keywords."""
    xs, ws, xt, wt, labels, bs = inputs
    for form in ("heads", "logits"):
        lf = [leaf(xs), leaf(ws), leaf(bs)]
        ls = [leaf(xs), leaf(ws[start:stop]), leaf(bs[start:stop])]
        if form == "heads":
            fn, full_t, shard_t = flashkd.fused_linear_distill, [xt, wt], [xt, wt[start:stop]]
        else:
            tl = xt @ wt.t()
            fn, full_t, shard_t = flashkd.fused_linear_distill_logits, [tl], [tl[:, start:stop]]
        full = dict(args=[lf[0], lf[1], *full_t, labels], kw=dict(student_bias=lf[2]), leaves=lf)
        shard = dict(args=[ls[0], ls[1], *shard_t, labels], kw=dict(student_bias=ls[2], **par), leaves=ls)
        compare_sharded(fn, f"{form} {options}", full, shard, start, stop, **options)
    if not topk:
        return
    ids, lp = flashkd.teacher_topk(xt, wt, 5)
    lf, ls = [leaf(xs), leaf(ws), None], [leaf(xs), leaf(ws[start:stop]), None]
    full = dict(args=[lf[0], lf[1], ids, lp, labels], kw={}, leaves=lf)
    shard = dict(args=[ls[0], ls[1], ids, lp, labels], kw=dict(par), leaves=ls)
    compare_sharded(flashkd.fused_linear_distill_topk, f"topk {options}", full, shard, start, stop,
                    tail="renormalize", **options)
