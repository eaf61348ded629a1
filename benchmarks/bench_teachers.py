"""Several teachers, a teacher through an exact token map, and GOLD's hybrid ULD loss: forward + backward of
flashkd's calls against their GEMM floors, the same-vocabulary call and TRL's ULDLoss, in one process.

Part "teachers" (the seed shape: N 8192, student Hs 2048, teachers Ht 4096, V 128256, bf16, JSD β 0.5,
labels, hard / soft weights 0.5 / 0.5): "one teacher" (`flashkd.fused_linear_distill`), and
`flashkd.fused_linear_distill_teachers` with two teacher heads: "routed" (teacher_index: a random half of
the rows to each), "geometric" and "sum" (weights 0.5, 0.5), "arithmetic" where flashkd.teachers.COMBINES
has it (else a row saying it was skipped); and their GEMM floors, plain torch.mm calls (forward: the
student's logits and each teacher's logits over the rows it scores; backward: dX and dW from a stand-in
dL/dS): "floor one teacher" (4 GEMMs), "floor routed" (the student's logits, each teacher's over its half,
dX, dW) and "floor two teachers" (the student's 3 GEMMs, both teachers' logits over every row: the floor of
geometric, sum and arithmetic alike; sum runs the student's GEMMs once per teacher, so it cannot reach it).
Targets (ratios in summary.md): routed ≤ 1.05× one teacher; geometric ≤ 1.05× its floor; arithmetic ≤ 1.10×.

Part "token map": a Qwen-sized teacher head (Vt 151936, Ht 4096) gathered into the student's vocab order by
`flashkd.TokenMap(index).teacher_head` (index: a random injection of the student's ids into the teacher's,
--unmatched of them −1), then `fused_linear_distill` on it with its −inf bias ("token map"), against the
same-vocabulary call ("same vocabulary": the one-teacher call); the gather alone ("token map gather",
no backward: made once for a frozen teacher). Target: ≤ 1.05× the same-vocabulary call.

Part "gold": GOLD's hybrid loss (TRL 1.16 `trl.experimental.gold` ULDLoss with uld_use_hybrid_loss, β 0.5,
the adaptive weights, the extended byte alignment, "observed" merges, both EOS skipped), a Llama-3 student
(Vs 128256, Hs 2048) and a Qwen3 teacher (Vt 151936, Ht 4096), --gold-matched shared ids, --gold-batch
sequences of a prompt and N / batch aligned groups each (every 16th group two tokens on the student's side,
another every 16th two on the teacher's): N 8192 aligned rows. "flashkd uld": `flashkd.uld_alignment` from
the labels, ids and byte offsets (as the GOLDTrainer patch does every step) and `flashkd.cross_vocab.
fused_linear_uld` from both hidden states and heads; "flashkd uld alignment": the alignment alone; "trl uld
(bf16 logits)": both models' full logits from the same hidden states and heads in the models' dtype (as
GOLDTrainer gets them from a bf16 model), the teacher's under no_grad, then ULDLoss; "trl uld (fp32
logits)": the same on fp32 logits. "sort": torch.sort of one chunk's fp32 probabilities (R rows, R the
fused call's chunk rows) over the teacher's whole vocab ("sort full vocab"), and the hybrid's two sorts of a
chunk (the student's and the teacher's unmatched ids: "sort hybrid chunk"), forward only, with their total
over the call's chunks in the summary. Targets: flashkd ≥ 5× faster than TRL, ≤ 0.2× its peak memory.
Before the timings (on the GPU) both are checked at a small shape (--gold-check-groups aligned rows, the
real vocabs and hidden sizes): TRL in float64 as the truth, flashkd in float64 and in float32, TRL in
float32: relative errors (‖Δ‖ / ‖truth‖) of the value and of dX and dW, and their max. Without trl the
TRL rows and the check are skipped with a note.

Part "learning": a teacher trained by the same loss (`loss="mutual"` and `"co_jeffreys"`, the teacher's hidden
states and head requiring grad; the seed shape, one teacher), against the constant teacher's JSD call and the
six-GEMM floor ("floor six GEMMs": both logits, then dX, dW, dXt, dWt from a stand-in dL/dS). Target: ≤ 1.05× the
floor. Checked first against the definition in float64 (docs/divergences.md: mutual's value J with the gradient of
each side's KL toward the other held constant; co_jeffreys J's own) on all four tensors.

Timed: CUDA events around one forward + backward (loss.backward(): gradients to the student's hidden states
and head), median and 20th / 80th percentiles over --reps after --warmup, each variant in turn. Memory:
peak allocated during it minus what was allocated before (inputs and parameters; their gradients freed). A
variant that runs out of memory is reported as such.

--smoke: tiny shapes in float64 on CPU, every variant run, and each fused value and gradient checked against
a naive float64 computation over the full logits with autograd (teachers: the explicit route / mixture / sum;
token map: the teacher's softmax gathered at the shared ids and renormalised; GOLD: TRL's ULDLoss on the same
inputs, skipped without trl); a mismatch raises.

Usage: python benchmarks/bench_teachers.py [--out DIR] [--parts teachers token-map gold learning]   (one GPU)
       python benchmarks/bench_teachers.py --smoke [--out DIR]                           (CPU: checks only)
results.json and summary.md go into --out (default: a new bench-teachers-YYYYmmdd-HHMMSS/).
The GOLD part needs trl==1.16.0 (and `datasets`, or the stand-in in benchmarks/_datasets_stub).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import types
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _trl_common import out_dir, timed_steps, write_summary  # noqa: E402

import flashkd  # noqa: E402
import flashkd.teachers  # noqa: E402
from flashkd.bench.providers import Floor  # noqa: E402
from flashkd.cross_vocab import TokenMap, fused_linear_uld, uld_alignment  # noqa: E402

PARTS = ("teachers", "token-map", "gold", "learning")
BETA = 0.5  # JSD's β (flashkd's default), and GOLD's hybrid β
W_HARD = W_SOFT = 0.5


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="tiny float64 shapes on CPU: every variant checked, no timings to read")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    p.add_argument("--tokens", type=int, default=8192, help="rows (teachers, token map); GOLD's aligned rows")
    p.add_argument("--vocab", type=int, default=128256, help="the student's vocab (and the teachers' in part teachers)")
    p.add_argument("--hidden", type=int, default=2048, help="the student's hidden size")
    p.add_argument("--teacher-hidden", type=int, default=4096)
    p.add_argument("--teacher-vocab", type=int, default=151936, help="the other-vocabulary teacher's (token map, GOLD)")
    p.add_argument("--unmatched", type=float, default=0.1, help="token map: the share of student ids without a teacher id")
    p.add_argument("--gold-matched", type=int, default=100000, help="GOLD: ids both vocabularies share")
    p.add_argument("--gold-batch", type=int, default=8, help="GOLD: sequences (tokens / batch aligned groups each)")
    p.add_argument("--gold-prompt", type=int, default=32, help="GOLD: prompt tokens per sequence")
    p.add_argument("--gold-check-groups", type=int, default=256, help="GOLD: aligned rows of the GPU check")
    p.add_argument("--gold-chunk", type=int, default=None, help="fused_linear_uld's chunk_size (default: its own)")
    p.add_argument("--trl-logits", nargs="*", default=["bf16", "fp32"], choices=["bf16", "fp32"],
                   help="the dtypes of TRL's logits to time (GPU)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.smoke:
        args.tokens, args.vocab, args.hidden, args.teacher_hidden, args.teacher_vocab = 24, 40, 8, 12, 48
        args.gold_matched, args.gold_batch, args.gold_prompt, args.warmup, args.reps = 30, 2, 3, 1, 2
        args.trl_logits = ["float64"]
    return args


# ---------------------------------------------------------------------------------------------------
# timing


def timed(fn, leaves, args, device, backward=True):
    """fn(*leaves) -> a scalar loss, timed by `timed_steps` (with its backward where `backward`): its times, peak
    memory and the last loss."""
    result, value = timed_steps(lambda *ls: (fn(*ls),) * 2, leaves, args, device, backward)
    loss = value.item() if isinstance(value, torch.Tensor) and value.dim() == 0 else None
    return {**result, "loss": loss}


def measure(rows, part, name, fn, leaves, args, device, backward=True, **extra):
    try:
        result = timed(fn, leaves, args, device, backward)
    except torch.OutOfMemoryError:
        rows.append({"part": part, "variant": name, "oom": True, **extra})
        torch.cuda.empty_cache()
        print(f"  {part} / {name}: OOM", flush=True)
        return None
    rows.append({"part": part, "variant": name, **result, **extra})
    print(f"  {part} / {name}: {result['median_s'] * 1e3:.2f} ms", flush=True)
    return result


def skip(rows, part, name, why):
    rows.append({"part": part, "variant": name, "skipped": why})
    print(f"  {part} / {name}: skipped ({why})", flush=True)


# ---------------------------------------------------------------------------------------------------
# naive float64 references (full logits, autograd)


def naive_distill(zs, p, labels):
    """flashkd's heads-form loss from the definition: w_hard · CE + w_soft · JSD_β(p ‖ q), both averaged over
    the rows with a label; p: the teacher's probabilities (N, V), or a list of (weight, p) summed."""
    q = torch.softmax(zs, -1)
    valid = labels != -100

    def jsd(p):
        m = BETA * p + (1 - BETA) * q
        kl = lambda a, b: (torch.xlogy(a, a) - torch.xlogy(a, b)).sum(-1)  # noqa: E731
        return BETA * kl(p, m) + (1 - BETA) * kl(q, m)

    soft = sum(w * jsd(pm) for w, pm in p) if isinstance(p, list) else jsd(p)
    hard = F.cross_entropy(zs, labels, ignore_index=-100, reduction="none")
    n = max(int(valid.sum()), 1)
    return W_HARD * hard[valid].sum() / n + W_SOFT * soft[valid].sum() / n


def rel_err(got, want):
    got, want = got.detach().double(), want.detach().double()
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


def compare(name, fused, leaves, naive, naive_leaves, checks, tol):
    """The value and gradients of `fused` (a scalar over leaves) and `naive` (over naive_leaves, their float64
    copies): relative errors, recorded in checks; above tol (when given) raises."""
    errs = {"value": rel_err(fused, naive)}
    grads = zip(("dX", "dW", "dXt", "dWt"), torch.autograd.grad(fused, leaves), torch.autograd.grad(naive, naive_leaves))
    for label, a, b in grads:
        errs[label] = rel_err(a, b)
    errs["max"] = max(errs.values())
    checks[name] = errs
    print(f"  check {name}: max rel err {errs['max']:.2e}", flush=True)
    if tol is not None and not errs["max"] <= tol:
        raise AssertionError(f"{name}: fused and naive differ: {errs}")


# ---------------------------------------------------------------------------------------------------
# part 1: several teachers


def teacher_inputs(n, hs, ht, v, dtype, device, g, m=2):
    """The seed inputs (flashkd.bench.workloads): uniform hidden states, nn.Linear-initialised heads."""
    def head(rows, cols):
        return ((torch.rand(rows, cols, generator=g, device=device) * 2 - 1) / cols**0.5).to(dtype)

    xs = torch.rand(n, hs, generator=g, device=device).to(dtype)
    ws = head(v, hs)
    xts = [torch.rand(n, ht, generator=g, device=device).to(dtype) for _ in range(m)]
    wts = [head(v, ht) for _ in range(m)]
    labels = torch.randint(0, v, (n,), generator=g, device=device)
    half = torch.randperm(n, generator=g, device=device)[: n // 2]
    index = torch.zeros(n, dtype=torch.int64, device=device)
    index[half] = 1
    return xs, ws, xts, wts, labels, index


def arithmetic_available():
    return "arithmetic" in getattr(flashkd.teachers, "COMBINES", ())


def teacher_variants(xts, wts, labels, index):
    call = lambda combine, **kw: (lambda xs, ws: flashkd.fused_linear_distill_teachers(  # noqa: E731
        xs, ws, xts, wts, labels, combine=combine, loss="jsd", **kw))
    out = {"one teacher": lambda xs, ws: flashkd.fused_linear_distill(xs, ws, xts[0], wts[0], labels, loss="jsd"),
           "routed": call("routed", teacher_index=index),
           "geometric": call("geometric", teacher_weights=[0.5, 0.5]),
           "sum": call("sum", teacher_weights=[0.5, 0.5])}
    if arithmetic_available():
        out["arithmetic"] = call("arithmetic", teacher_weights=[0.5, 0.5])
    return out


def naive_teachers(name, xs, ws, xts, wts, labels, index):
    zs = xs @ ws.T
    z = [x @ w.T for x, w in zip(xts, wts)]
    p = [torch.softmax(zm, -1) for zm in z]
    if name == "one teacher":
        return naive_distill(zs, p[0], labels)
    if name == "routed":
        return naive_distill(zs, torch.where(index[:, None] == 0, p[0], p[1]), labels)
    if name == "geometric":
        return naive_distill(zs, torch.softmax(0.5 * z[0] + 0.5 * z[1], -1), labels)
    if name == "sum":
        return naive_distill(zs, [(0.5, p[0]), (0.5, p[1])], labels)
    if name == "arithmetic":
        return naive_distill(zs, 0.5 * p[0] + 0.5 * p[1], labels)
    raise KeyError(name)


def check_teachers(args, device, dtype, checks, tol, shape):
    n, hs, ht, v = shape
    g = torch.Generator(device=device).manual_seed(args.seed + 1)
    xs, ws, xts, wts, labels, index = teacher_inputs(n, hs, ht, v, dtype, device, g)
    labels[::5] = -100
    for name, fn in teacher_variants(xts, wts, labels, index).items():
        a, b = xs.detach().requires_grad_(), ws.detach().requires_grad_()
        fused = fn(a, b)
        a64, b64 = xs.detach().double().requires_grad_(), ws.detach().double().requires_grad_()
        naive = naive_teachers(name, a64, b64, [x.double() for x in xts], [w.double() for w in wts], labels, index)
        compare(f"teachers / {name}", fused, (a, b), naive, (a64, b64), checks, tol)


def run_teachers(args, device, dtype, rows):
    n, v = args.tokens, args.vocab
    g = torch.Generator(device=device).manual_seed(args.seed)
    xs, ws, xts, wts, labels, index = teacher_inputs(n, args.hidden, args.teacher_hidden, v, dtype, device, g)
    for name, fn in teacher_variants(xts, wts, labels, index).items():
        measure(rows, "teachers", name, fn, (xs, ws), args, device)
    if not arithmetic_available():
        skip(rows, "teachers", "arithmetic", f"combine='arithmetic' is not in flashkd.teachers.COMBINES "
             f"{tuple(flashkd.teachers.COMBINES)}")
    ds = torch.randn(n, v, generator=g, device=device).to(dtype) * 1e-3  # a stand-in dL/dS (random: clocks see data)
    sel = [(index == t).nonzero().flatten() for t in range(2)]
    routed_x = [xts[t][sel[t]].contiguous() for t in range(2)]  # the rows each teacher scores, gathered untimed
    floors = {
        "floor one teacher": lambda: torch.mm(xts[0], wts[0].t()),
        "floor routed": lambda: [torch.mm(routed_x[t], wts[t].t()) for t in range(2)],
        "floor two teachers": lambda: [torch.mm(xts[t], wts[t].t()) for t in range(2)],
    }
    for name, teachers in floors.items():
        measure(rows, "teachers", name, lambda a, b, teachers=teachers: Floor.apply(a, b, ds, teachers),
                (xs, ws), args, device)
    del ds, xs, ws, xts, wts, routed_x


# ---------------------------------------------------------------------------------------------------
# part "learning": a teacher trained by the same loss (mutual, co_jeffreys)

LEARNING = ("mutual", "co_jeffreys")


class SixGemms(torch.autograd.Function):
    """The GEMMs of a step whose teacher learns too, and nothing else: both logits forward, then dX, dW and the
    teacher's dXt, dWt from one stand-in dL/dS (the floor of `mutual` / `co_jeffreys` with a learning teacher)."""

    @staticmethod
    def forward(ctx, xs, ws, xt, wt, ds):
        ctx.save_for_backward(xs, ws, xt, wt, ds)
        s = xs @ ws.t()
        t = xt @ wt.t()  # made while s is alive, as the loss needs both
        del s, t
        return xs.new_zeros(())

    @staticmethod
    def backward(ctx, _grad):
        xs, ws, xt, wt, ds = ctx.saved_tensors
        return ds @ ws, ds.t() @ xs, ds @ wt, ds.t() @ xt, None


def naive_learning(loss, xs, ws, xt, wt, labels):
    """The learning teacher's loss from the definition (docs/divergences.md): w_hard · the student's CE +
    w_soft · J, J = KL(p‖q) + KL(q‖p), over the rows with a label; co_jeffreys differentiates J on both sides,
    mutual each side's KL toward the other taken as a constant (value J, gradient of KL(p̄‖q) + KL(q̄‖p))."""
    zs, zt = xs @ ws.T, xt @ wt.T
    lq, lp = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    q, p = lq.exp(), lp.exp()
    j = ((q - p) * (lq - lp)).sum(-1)
    if loss == "mutual":
        pull = (p.detach() * (lp.detach() - lq)).sum(-1) + (q.detach() * (lq.detach() - lp)).sum(-1)
        j = pull + (j - pull).detach()
    valid = labels != -100
    n = max(int(valid.sum()), 1)
    hard = F.cross_entropy(zs, labels, ignore_index=-100, reduction="none")
    return W_HARD * hard[valid].sum() / n + W_SOFT * j[valid].sum() / n


def check_learning(args, device, dtype, checks, tol, shape):
    n, hs, ht, v = shape
    g = torch.Generator(device=device).manual_seed(args.seed + 3)
    xs, ws, xts, wts, labels, _ = teacher_inputs(n, hs, ht, v, dtype, device, g, m=1)
    labels[::5] = -100
    for loss in LEARNING:
        leaves = [t.detach().requires_grad_() for t in (xs, ws, xts[0], wts[0])]
        fused = flashkd.fused_linear_distill(*leaves, labels, loss=loss)
        wide = [t.detach().double().requires_grad_() for t in (xs, ws, xts[0], wts[0])]
        compare(f"learning / {loss}", fused, leaves, naive_learning(loss, *wide, labels), wide, checks, tol)


def run_learning(args, device, dtype, rows):
    n, v = args.tokens, args.vocab
    g = torch.Generator(device=device).manual_seed(args.seed)
    xs, ws, xts, wts, labels, _ = teacher_inputs(n, args.hidden, args.teacher_hidden, v, dtype, device, g, m=1)
    measure(rows, "learning", "jsd, constant teacher",
            lambda a, b: flashkd.fused_linear_distill(a, b, xts[0], wts[0], labels, loss="jsd"), (xs, ws), args, device)
    for loss in LEARNING:
        measure(rows, "learning", loss, lambda a, b, c, d, loss=loss: flashkd.fused_linear_distill(
            a, b, c, d, labels, loss=loss), (xs, ws, xts[0], wts[0]), args, device)
    ds = torch.randn(n, v, generator=g, device=device).to(dtype) * 1e-3  # a stand-in dL/dS, as the other floors'
    measure(rows, "learning", "floor six GEMMs", lambda a, b, c, d: SixGemms.apply(a, b, c, d, ds),
            (xs, ws, xts[0], wts[0]), args, device)
    del ds, xs, ws, xts, wts


# ---------------------------------------------------------------------------------------------------
# part 2: the exact token map


def token_map_inputs(vs, vt, ht, unmatched, dtype, device, g):
    """A teacher head (Vt, Ht) and a TokenMap: each student id a distinct random teacher id, `unmatched` of
    them −1."""
    perm = torch.randperm(vt, generator=g, device=device)[:vs]
    drop = torch.rand(vs, generator=g, device=device) < unmatched
    index = torch.where(drop, -1, perm)
    wq = ((torch.rand(vt, ht, generator=g, device=device) * 2 - 1) / ht**0.5).to(dtype)
    return wq, TokenMap(index.cpu(), vt)


def naive_token_map(xs, ws, xt, wq, tmap, labels):
    index = tmap.index.to(xs.device)
    pt = torch.softmax(xt @ wq.T, -1)  # the teacher over its whole vocab
    hit = index >= 0
    p = torch.where(hit[None], pt[:, index.clamp_min(0)], torch.zeros((), dtype=pt.dtype, device=pt.device))
    return naive_distill(xs @ ws.T, p / p.sum(-1, keepdim=True), labels)


def check_token_map(args, device, dtype, checks, tol, shape):
    n, hs, ht, v, vt = shape
    g = torch.Generator(device=device).manual_seed(args.seed + 2)
    xs, ws, xts, _, labels, _ = teacher_inputs(n, hs, ht, v, dtype, device, g, m=1)
    labels[::5] = -100
    wq, tmap = token_map_inputs(v, vt, ht, max(args.unmatched, 0.1), dtype, device, g)
    wt_s, bt_s = tmap.teacher_head(wq)
    a, b = xs.detach().requires_grad_(), ws.detach().requires_grad_()
    fused = flashkd.fused_linear_distill(a, b, xts[0], wt_s, labels, teacher_bias=bt_s, loss="jsd")
    a64, b64 = xs.detach().double().requires_grad_(), ws.detach().double().requires_grad_()
    naive = naive_token_map(a64, b64, xts[0].double(), wq.double(), tmap, labels)
    compare("token map", fused, (a, b), naive, (a64, b64), checks, tol)


def run_token_map(args, device, dtype, rows):
    n, v = args.tokens, args.vocab
    g = torch.Generator(device=device).manual_seed(args.seed)
    xs, ws, xts, wts, labels, _ = teacher_inputs(n, args.hidden, args.teacher_hidden, v, dtype, device, g, m=1)
    wq, tmap = token_map_inputs(v, args.teacher_vocab, args.teacher_hidden, args.unmatched, dtype, device, g)
    matched = int((tmap.index >= 0).sum())
    measure(rows, "token map", "same vocabulary",
            lambda a, b: flashkd.fused_linear_distill(a, b, xts[0], wts[0], labels, loss="jsd"), (xs, ws), args, device)
    wt_s, bt_s = tmap.teacher_head(wq)
    measure(rows, "token map", "token map",
            lambda a, b: flashkd.fused_linear_distill(a, b, xts[0], wt_s, labels, teacher_bias=bt_s, loss="jsd"),
            (xs, ws), args, device, matched=matched)
    measure(rows, "token map", "token map gather", lambda w: tmap.teacher_head(w)[0], (wq,), args, device,
            backward=False, matched=matched)
    del xs, ws, xts, wts, wq, wt_s, bt_s


# ---------------------------------------------------------------------------------------------------
# part 3: GOLD's hybrid ULD loss


def load_uld():
    """TRL's ULDLoss, or None and why not (its module imports `datasets`: the stand-in where missing)."""
    try:
        from _trl_common import import_datasets

        import_datasets()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from trl.experimental.gold.gold_trainer import ULDLoss
        return ULDLoss, None
    except Exception as e:  # ImportError, or whatever TRL's imports raise without their extras
        return None, f"trl's GOLD is not importable ({type(e).__name__}: {e}); pip install trl==1.16.0"


def gold_config():
    return types.SimpleNamespace(
        uld_crossentropy_weight=0.0, uld_distillation_weight=1.0, uld_student_temperature=1.0,
        uld_teacher_temperature=1.0, uld_skip_student_eos=True, uld_skip_teacher_eos=True, use_extended_uld=True,
        uld_token_merge_strategy="observed", uld_use_hybrid_loss=True, uld_hybrid_matched_weight=None,
        uld_hybrid_unmatched_weight=None, beta=BETA)


def gold_inputs(b, groups, prompt, vs, vt, hs, ht, matched, dtype, device, g, split_every=16):
    """A GOLD batch: b sequences of `prompt` tokens, then `groups` aligned groups of 4 bytes each (group j two
    tokens on the student's side where j % split_every == 3, on the teacher's where j % split_every ==
    (split_every // 2 + 3) % split_every, else one each) and a zero-width EOS; labels on the answer, completion-relative
    byte offsets, random ids; hidden states (b, T, H), heads with logits of std about 2; the shared ids: a
    TokenMap of `matched` random pairs, and tokenizer stand-ins (get_vocab) whose equal strings are those
    pairs (ULDLoss's own mapping)."""
    t_split = (split_every // 2 + 3) % split_every

    def side(split):
        sizes = [2 if j % split_every == split else 1 for j in range(groups)]
        t = prompt + sum(sizes) + 1
        offsets, k = torch.zeros(b, t, 2, dtype=torch.int64), prompt
        for j, size in enumerate(sizes):
            cuts = [4 * j, 4 * j + 2, 4 * j + 4] if size == 2 else [4 * j, 4 * j + 4]
            for a, e in zip(cuts, cuts[1:]):
                offsets[:, k] = torch.tensor([a, e])
                k += 1
        offsets[:, k] = 4 * groups  # the EOS: zero width at the text's end
        return t, offsets

    ts, s_off = side(3)
    tt, t_off = side(t_split)
    cpu = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,), generator=g, device=device)))
    s_ids, t_ids = torch.randint(0, vs, (b, ts), generator=cpu), torch.randint(0, vt, (b, tt), generator=cpu)
    s_lab, t_lab = torch.full((b, ts), -100), torch.full((b, tt), -100)
    s_lab[:, prompt:], t_lab[:, prompt:] = s_ids[:, prompt:], t_ids[:, prompt:]
    perm_s, perm_t = torch.randperm(vs, generator=cpu)[:matched], torch.randperm(vt, generator=cpu)[:matched]
    index = torch.full((vs,), -1, dtype=torch.int64)
    index[perm_s] = perm_t
    tmap = TokenMap(index, vt)
    s_vocab = {(f"x{int(t)}" if t >= 0 else f"s{i}"): i for i, t in enumerate(index.tolist())}
    t_vocab = {f"x{i}": i for i in range(vt)}
    tokenizers = (types.SimpleNamespace(get_vocab=lambda: s_vocab), types.SimpleNamespace(get_vocab=lambda: t_vocab))
    xs = torch.randn(b, ts, hs, generator=g, device=device).to(dtype)
    ws = (torch.randn(vs, hs, generator=g, device=device) * (2.0 / hs**0.5)).to(dtype)
    xt = torch.randn(b, tt, ht, generator=g, device=device).to(dtype)
    wt = (torch.randn(vt, ht, generator=g, device=device) * (2.0 / ht**0.5)).to(dtype)
    batch = dict(student_labels=s_lab, teacher_labels=t_lab, student_input_ids=s_ids, teacher_input_ids=t_ids,
                 student_byte_offsets=s_off, teacher_byte_offsets=t_off)
    return xs, ws, xt, wt, {k: t.to(device) for k, t in batch.items()}, tmap, tokenizers


def flashkd_uld(xt, wt, batch, tmap, cfg, chunk):
    """The GOLDTrainer patch's loss: the alignment from the batch, then the fused loss."""
    def fn(xs, ws):
        al = uld_alignment(*batch.values(), merge=cfg.uld_token_merge_strategy, extended=cfg.use_extended_uld,
                           skip_student_eos=cfg.uld_skip_student_eos, skip_teacher_eos=cfg.uld_skip_teacher_eos,
                           weight=cfg.uld_distillation_weight)
        return fused_linear_uld(xs, ws, xt, wt, al, matched=tmap, beta=cfg.beta, chunk_size=chunk,
                                student_temperature=cfg.uld_student_temperature,
                                teacher_temperature=cfg.uld_teacher_temperature)
    return fn


def trl_uld(uld, xt, wt, batch, logits_dtype):
    """TRL's path: both models' full logits from the hidden states and heads (the teacher's under no_grad,
    as GOLDTrainer runs it), in `logits_dtype`, then ULDLoss."""
    def fn(xs, ws):
        zs = (xs @ ws.T).to(logits_dtype)
        with torch.no_grad():
            zt = (xt @ wt.T).to(logits_dtype)
        return uld(zs, zt, *batch.values())
    return fn


def check_gold(args, device, ULDLoss, checks, tol, groups, dtypes):
    """TRL's ULDLoss in float64 as the truth; flashkd (and TRL) in each of `dtypes` against it."""
    vs, vt = args.vocab, args.teacher_vocab
    b = min(args.gold_batch, max(1, groups // 4))
    g = torch.Generator(device=device).manual_seed(args.seed + 3)
    matched = min(args.gold_matched, vs - 1, vt - 1)
    xs, ws, xt, wt, batch, tmap, (st, tt) = gold_inputs(
        b, groups // b, min(args.gold_prompt, 4), vs, vt, args.hidden, args.teacher_hidden, matched, torch.float64,
        device, g, split_every=4 if groups // b < 16 else 16)
    cfg = gold_config()
    uld = ULDLoss(cfg, st, tt, device=device)
    assert sorted(tmap.matched[1].tolist()) == sorted(uld._vocab_mapping)  # the same shared ids as TRL's
    leaves64 = [xs.detach().requires_grad_(), ws.detach().requires_grad_()]
    truth = trl_uld(uld, xt, wt, batch, torch.float64)(*leaves64)
    g_truth = torch.autograd.grad(truth, leaves64)
    for dt in dtypes:
        for who in ("flashkd", "trl"):
            if who == "trl" and dt == torch.float64:
                continue
            leaves = [xs.detach().to(dt).requires_grad_(), ws.detach().to(dt).requires_grad_()]
            xt_, wt_ = xt.to(dt), wt.to(dt)
            fn = flashkd_uld(xt_, wt_, batch, tmap, cfg, args.gold_chunk) if who == "flashkd" else \
                trl_uld(uld, xt_, wt_, batch, dt)
            got = fn(*leaves)
            errs = {"value": rel_err(got, truth)}
            for label, a, want in zip(("dX", "dW"), torch.autograd.grad(got, leaves), g_truth):
                errs[label] = rel_err(a, want)
            errs["max"] = max(errs.values())
            name = f"gold / {who} {str(dt).replace('torch.', '')} vs trl float64"
            checks[name] = {**errs, "groups": len(uld_alignment(*batch.values()))}
            print(f"  check {name}: max rel err {errs['max']:.2e}", flush=True)
            if tol is not None and who == "flashkd" and dt == torch.float64 and not errs["max"] <= tol:
                raise AssertionError(f"{name}: fused and TRL's ULDLoss differ: {errs}")


def run_gold(args, device, dtype, rows, ULDLoss, why_not):
    vs, vt, b = args.vocab, args.teacher_vocab, args.gold_batch
    groups = args.tokens // b
    g = torch.Generator(device=device).manual_seed(args.seed)
    xs, ws, xt, wt, batch, tmap, (st, tt) = gold_inputs(b, groups, args.gold_prompt, vs, vt, args.hidden,
                                                        args.teacher_hidden, args.gold_matched, dtype, device, g)
    cfg = gold_config()
    al = uld_alignment(*batch.values())
    info = {"aligned_rows": len(al), "student_rows": xs.shape[0] * xs.shape[1], "teacher_rows": xt.shape[0] * xt.shape[1],
            "matched": int((tmap.index >= 0).sum())}
    chunk = args.gold_chunk or max(1, 2**24 // max(vs, vt))  # fused_linear_uld's default rows per chunk
    chunk = min(chunk, max(1, len(al)))  # ... of which the call has this many at most
    measure(rows, "gold", "flashkd uld", flashkd_uld(xt, wt, batch, tmap, cfg, args.gold_chunk), (xs, ws), args,
            device, chunk_rows=chunk, **info)
    measure(rows, "gold", "flashkd uld alignment", lambda: uld_alignment(*batch.values()), (), args, device,
            backward=False)
    if ULDLoss is None:
        for logits in args.trl_logits:
            skip(rows, "gold", f"trl uld ({logits} logits)", why_not)
    else:
        uld = ULDLoss(cfg, st, tt, device=device)
        for logits in args.trl_logits:
            dt = {"bf16": torch.bfloat16, "fp32": torch.float32, "float64": torch.float64}[logits]
            measure(rows, "gold", f"trl uld ({logits} logits)", trl_uld(uld, xt, wt, batch, dt), (xs, ws), args,
                    device, **info)
        del uld
    # the sort alone: one chunk's fp32 probabilities, forward only
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    n_chunks = math.ceil(len(al) / chunk)
    p_full = torch.softmax(torch.randn(chunk, vt, generator=g, device=device, dtype=acc) * 2, -1)
    s_un = (tmap.index < 0).nonzero().flatten().to(device)
    t_un = torch.ones(vt, dtype=torch.bool)
    t_un[tmap.matched[1]] = False
    t_un = t_un.nonzero().flatten().to(device)
    q_un = torch.softmax(torch.randn(chunk, vs, generator=g, device=device, dtype=acc) * 2, -1)[:, s_un].contiguous()
    p_un = p_full[:, t_un].contiguous()
    measure(rows, "gold", "sort full vocab", lambda p: p.sort(dim=-1, descending=True).values, (p_full,), args, device,
            backward=False, chunk_rows=chunk, chunks=n_chunks, width=vt)
    measure(rows, "gold", "sort hybrid chunk",
            lambda q, p: (q.sort(dim=-1, descending=True).values, p.sort(dim=-1, descending=True).values)[1],
            (q_un, p_un), args, device, backward=False, chunk_rows=chunk, chunks=n_chunks,
            width=[int(s_un.numel()), int(t_un.numel())])


# ---------------------------------------------------------------------------------------------------
# the summary


def ratios(rows):
    by = {(r["part"], r["variant"]): r for r in rows if "median_s" in r}
    out = []

    def add(label, num, den, target):
        a, b = by.get(num), by.get(den)
        if a is None or b is None:
            out.append({"ratio": label, "value": None, "target": target, "note": "not measured"})
            return
        value = a["median_s"] / b["median_s"]
        entry = {"ratio": label, "value": value, "target": target}
        if target is not None:
            entry["meets"] = value <= target
        out.append(entry)

    t = "teachers"
    add("routed / one teacher", (t, "routed"), (t, "one teacher"), 1.05)
    add("one teacher / its floor", (t, "one teacher"), (t, "floor one teacher"), None)
    add("routed / its floor", (t, "routed"), (t, "floor routed"), None)
    add("geometric / its floor", (t, "geometric"), (t, "floor two teachers"), 1.05)
    add("sum / the two teachers' floor", (t, "sum"), (t, "floor two teachers"), None)
    add("arithmetic / its floor", (t, "arithmetic"), (t, "floor two teachers"), 1.10)
    add("token map / same vocabulary", ("token map", "token map"), ("token map", "same vocabulary"), 1.05)
    for loss in LEARNING:
        add(f"{loss}, learning teacher / six GEMMs", ("learning", loss), ("learning", "floor six GEMMs"), 1.05)
        add(f"{loss}, learning teacher / jsd, constant teacher", ("learning", loss),
            ("learning", "jsd, constant teacher"), None)
    fk = by.get(("gold", "flashkd uld"))
    for r in rows:
        if r["part"] == "gold" and r["variant"].startswith("trl uld") and "median_s" in r and fk is not None:
            out.append({"ratio": f"{r['variant']} time / flashkd uld time", "value": r["median_s"] / fk["median_s"],
                        "target": 5.0, "meets": r["median_s"] / fk["median_s"] >= 5.0, "direction": ">="})
            if fk.get("peak_extra_bytes") and r.get("peak_extra_bytes"):
                m = fk["peak_extra_bytes"] / r["peak_extra_bytes"]
                out.append({"ratio": f"flashkd uld memory / {r['variant']} memory", "value": m, "target": 0.2,
                            "meets": m <= 0.2})
    return out


def summary_md(summary):
    rows = summary["rows"]
    lines = ["| part | variant | median ms | p20–p80 ms | peak extra GB | loss |", "|---|---|---:|---|---:|---:|"]
    for r in rows:
        if r.get("oom"):
            lines.append(f"| {r['part']} | {r['variant']} | OOM | | | |")
        elif "skipped" in r:
            lines.append(f"| {r['part']} | {r['variant']} | skipped: {r['skipped']} | | | |")
        else:
            mem = "" if r["peak_extra_bytes"] is None else f"{r['peak_extra_bytes'] / 1e9:.2f}"
            loss = "" if r.get("loss") is None else f"{r['loss']:.6g}"
            lines.append(f"| {r['part']} | {r['variant']} | {r['median_s'] * 1e3:.2f} | "
                         f"{r['p20_s'] * 1e3:.2f}–{r['p80_s'] * 1e3:.2f} | {mem} | {loss} |")
    lines += ["", "| ratio | value | target | meets |", "|---|---:|---|---|"]
    for q in summary["ratios"]:
        value = "" if q["value"] is None else f"{q['value']:.3f}"
        target = "" if q["target"] is None else f"{q.get('direction', '<=')} {q['target']}"
        meets = {True: "yes", False: "no"}.get(q.get("meets"), q.get("note", ""))
        lines.append(f"| {q['ratio']} | {value} | {target} | {meets} |")
    sorts = [r for r in rows if r["part"] == "gold" and r["variant"].startswith("sort") and "median_s" in r]
    fk = next((r for r in rows if r["part"] == "gold" and r["variant"] == "flashkd uld" and "median_s" in r), None)
    if sorts:
        lines += ["", "The sort alone (forward, one chunk of R rows, times the call's chunks):", ""]
        for r in sorts:
            total = r["median_s"] * r["chunks"]
            share = f", {total / fk['median_s']:.0%} of flashkd uld's forward + backward" if fk else ""
            lines.append(f"- {r['variant']} (R {r['chunk_rows']}, width {r['width']}): {r['median_s'] * 1e3:.3f} ms a "
                         f"chunk, {total * 1e3:.1f} ms over {r['chunks']} chunks{share}")
    if summary["checks"]:
        lines += ["", "| check | value | dX | dW | dXt | dWt | max rel err |", "|---|---:|---:|---:|---:|---:|---:|"]
        cell = lambda e, k: f"{e[k]:.2e}" if k in e else ""  # noqa: E731  (the teacher's only where it learns)
        for name, e in summary["checks"].items():
            lines.append(f"| {name} | " + " | ".join(cell(e, k) for k in ("value", "dX", "dW", "dXt", "dWt", "max")) + " |")
    for note in summary["notes"]:
        lines += ["", f"Note: {note}"]
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float64
    out = out_dir(args, "teachers")
    rows, checks, notes = [], {}, []
    ULDLoss, why_not = load_uld() if "gold" in args.parts else (None, None)
    if why_not:
        notes.append(f"GOLD: {why_not}: TRL's rows and the GOLD check skipped")
    if not arithmetic_available():
        notes.append("combine='arithmetic' is not in flashkd.teachers.COMBINES yet: its row is skipped")
    # the checks: float64 on CPU (--smoke, raising), or float32 on the GPU at small shapes against float64
    tol = 1e-9 if args.smoke else None
    cdt = torch.float64 if args.smoke else torch.float32
    print("checks", flush=True)
    if "teachers" in args.parts:
        shape = (args.tokens, args.hidden, args.teacher_hidden, args.vocab) if args.smoke else (256, 256, 384, 4099)
        check_teachers(args, device, cdt, checks, tol, shape)
    if "token-map" in args.parts:
        shape = ((args.tokens, args.hidden, args.teacher_hidden, args.vocab, args.teacher_vocab) if args.smoke
                 else (256, 256, 384, 4099, 5003))
        check_token_map(args, device, cdt, checks, tol, shape)
    if "learning" in args.parts:
        shape = (args.tokens, args.hidden, args.teacher_hidden, args.vocab) if args.smoke else (256, 256, 384, 4099)
        check_learning(args, device, cdt, checks, tol, shape)
    if "gold" in args.parts and ULDLoss is not None:
        groups = args.tokens if args.smoke else args.gold_check_groups
        check_gold(args, device, ULDLoss, checks, tol, groups,
                   [torch.float64] if args.smoke else [torch.float64, torch.float32])
    print("timings", flush=True)
    if "teachers" in args.parts:
        run_teachers(args, device, dtype, rows)
    if "token-map" in args.parts:
        run_token_map(args, device, dtype, rows)
    if "learning" in args.parts:
        run_learning(args, device, dtype, rows)
    if "gold" in args.parts:
        run_gold(args, device, dtype, rows, ULDLoss, why_not)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    summary = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": str(dtype),
               "torch": torch.__version__, "smoke": args.smoke, "tokens": args.tokens, "vocab": args.vocab,
               "hidden": args.hidden, "teacher_hidden": args.teacher_hidden, "teacher_vocab": args.teacher_vocab,
               "gold_matched": args.gold_matched, "gold_batch": args.gold_batch, "warmup": args.warmup,
               "reps": args.reps, "combines": list(flashkd.teachers.COMBINES), "rows": rows, "checks": checks,
               "notes": notes}
    summary["ratios"] = ratios(rows)
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    table = summary_md(summary)
    title = (f"Several teachers, token map, GOLD: {summary['device']}, {dtype}, N {args.tokens}, V {args.vocab}, "
             f"Hs {args.hidden}, Ht {args.teacher_hidden}, Vt {args.teacher_vocab}")
    return write_summary(out, title, table)


if __name__ == "__main__":
    sys.exit(main())
