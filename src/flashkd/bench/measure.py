"""Correctness gate, timing and memory; `run` puts them together over workloads x providers x modes.

Per workload: seeded inputs; the fp32 reference (loss, dXs, dWs), then freed down to its three
results; then per provider: one checked forward+backward against the reference (a provider outside
the gate is FAILED and not timed); a provider's first workload then warms it up in every mode
(`_warm_up`); then per mode the speed of the providers that passed, timed in turn (`_time_in_turn`);
then each one's memory.

Modes (what the timed call does):
    forward           loss = fn()            (grad enabled: a graph is built, and fused losses compute grads here)
    backward          loss.backward()        on one loss computed before timing (retain_graph=True)
    full              fn().backward()
    no-grad-forward   fn() under torch.no_grad()
teacher_topk has no gradient: only no-grad-forward applies to it, its other modes are not timed
(`applicable`). Its gate compares top-k ids and log-probs instead of a loss (`_gate_topk`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import time
from typing import Callable

import torch

from ..records.protocol import FP8_TOLERANCE, MODES, QUANTILES, TOLERANCE, applicable  # noqa: F401 (measure.MODES, ...)
from ..losses import logit_transform
from .providers import PROVIDERS, LossFn, Skip, naive_loss, teacher_block
from .workloads import Inputs, Workload, make_inputs

# The reference keeps ~10 fp32 (R, V) tensors for autograd (the power divergences, AKL and DKD up to ~16, and
# the entropy blend's two KLs ~25 at their peak): blocks of at most 1 GiB of fp32 logits, and at most 1/40 of
# the free memory, so that its peak stays under the GPU's (at 1/20 on an H100 the blend's ran out of memory).
# Blocks change only the order of fp32 sums.
_REFERENCE_BLOCK_BYTES = 1 << 30
_REFERENCE_SHARE = 40
_MEMORY_REPS = 5  # peaks repeat exactly from call to call; Liger takes 10


@dataclasses.dataclass(frozen=True)
class Settings:
    device: torch.device
    rep_ms: float = 500.0  # timed repetitions per measurement (do_bench's rep)
    warmup_ms: float = 100.0
    min_reps: int = 10  # rep_ms is raised to fit this many calls, so slow calls get a real spread
    rounds: int = 1  # providers timed in turn this many times over, rep_ms and min_reps split among them


@dataclasses.dataclass(frozen=True)
class Check:
    status: str  # passed | FAILED | unchecked (no loss to check) | skipped | OOM | error
    loss_err: float = math.nan  # |a − b| / |b|; teacher_topk: ‖a − b‖ / ‖b‖ of its top-k probabilities
    dx_err: float = math.nan  # ‖a − b‖ / ‖b‖
    dw_err: float = math.nan
    tol: tuple[float, float] = (math.nan, math.nan)  # (loss, grads); teacher_topk: (probabilities, ids)
    note: str = ""
    ids_err: float = math.nan  # teacher_topk: how far its ids fall short of the true top k (see _gate_topk)


@dataclasses.dataclass(frozen=True)
class Result:
    workload: Workload
    provider: str
    version: str
    check: Check
    mode: str | None = None  # None: the provider was not timed (see check.status)
    speed: tuple[float, float, float] | None = None  # ms at QUANTILES
    peak: tuple[float, float, float] | None = None  # MiB; None where not measured (CPU)
    extra: tuple[float, float, float] | None = None  # MiB over what was allocated before the call
    timestamp: str = ""  # UTC, as Liger writes it


def run(
    workloads: list[Workload],
    providers: list[str],
    modes: list[str],
    settings: Settings,
    advance: Callable[[str, int], None] = lambda label, steps: None,
) -> list[Result]:
    """Every (workload, provider, mode). `advance(label, steps)` reports progress: what runs now (a label
    that starts "<tag> N=<n>", the workload's) and how many of the len(workloads) · len(providers) ·
    (1 + len(modes)) steps just ended."""
    if settings.device.type == "cuda" and settings.device.index is not None:
        torch.cuda.set_device(settings.device)  # do_bench, events and memory stats use the current device
    results = []
    warm: set[str] = set()  # providers warmed up: see _warm_up
    for w in workloads:
        advance(f"{w.tag} N={w.n} inputs and fp32 reference", 0)
        try:
            x = make_inputs(w, settings.device)
            ref = reference(w, x) if any(PROVIDERS[p].has_loss for p in providers) else None
        except Exception as e:  # a workload too large for this machine: a result of its own, the others still run
            x = ref = None
            _free(settings.device)
            check = Check(_failure(e), note=f"inputs or fp32 reference not made: {_one_line(e)}")
            for name in providers:
                results.append(Result(w, name, PROVIDERS[name].version(), check))
                advance(f"{w.tag} N={w.n} {name} {check.status}", 1 + len(modes))
            continue
        _free(settings.device)
        timed = applicable(w, modes)
        gated = {}  # name -> (version, check, fn or None when it is not timed)
        for name in providers:
            gated[name] = _gate_provider(w, x, ref, name, timed, advance)
            _free(settings.device)
        ready = {name: fn for name, (_, _, fn) in gated.items() if fn is not None}
        for name in [n for n in ready if n not in warm]:
            advance(f"{w.tag} N={w.n} {name} warm-up", 0)
            with contextlib.suppress(Exception):  # a failing call fails again where it is timed, and says so
                _warm_up(ready[name], x, timed, settings)
            warm.add(name)
            _free(settings.device)
        speeds = _time_in_turn(w, x, ready, timed, settings, advance)
        for name, (version, check, fn) in gated.items():
            if fn is None:
                results.append(Result(w, name, version, check))
            else:
                for mode in timed:
                    speed = speeds[name, mode]
                    try:
                        if isinstance(speed, Exception):
                            raise speed
                        peak, extra = _memory(fn, x, mode, settings)
                        results.append(Result(w, name, version, check, mode, speed, peak, extra, _utc_now()))
                    except Exception as e:
                        failed = dataclasses.replace(check, status=_failure(e), note=_one_line(e))
                        results.append(Result(w, name, version, failed, mode))
                        _free(settings.device)
                    advance(f"{w.tag} N={w.n} {name} {mode}", 1)
            advance(f"{w.tag} N={w.n} {name}", len(modes) - len(timed))
        # every name that holds the workload's tensors (the providers' closures too, and the loop's last fn)
        # let go before the next workload's inputs and reference are made
        x = ref = ready = gated = speeds = fn = None
        _free(settings.device)
    return results


def _gate_provider(w, x, ref, name, modes, advance):
    """(version, check, fn): fn is None when the provider is not to be timed (failed, skipped, or no
    mode applies); its progress steps are then all reported here."""
    provider = PROVIDERS[name]
    label = f"{w.tag} N={w.n} {name}"
    version = provider.version()
    advance(f"{label} check", 0)
    try:
        fn = provider.make(w, x)
        if not provider.has_loss:
            check = Check("unchecked")
        elif w.has_grad:
            check = gate(fn, x, ref, "no-grad-forward" in modes, _tolerance(w, x.xs.dtype))
        else:
            check = _gate_topk(fn, x, ref, w)
    except Skip as e:
        check = Check("skipped", note=str(e))
    except Exception as e:  # an OOM or a crash in one provider must not lose the others' results
        check = Check(_failure(e), note=_one_line(e))
    if check.status != "passed" and check.status != "unchecked":
        advance(f"{label} {check.status}", 1 + len(modes))
        return version, check, None
    advance(f"{label} {check.status}", 1)
    return version, check, fn if modes else None


# A provider's first timed workload starts only after each of its modes has run this many calls and
# _WARM_UP_FACTOR · warmup_ms beyond the first call (see _warm_up).
_WARM_UP_CALLS = 3
_WARM_UP_FACTOR = 5


def _warm_up(fn: LossFn, x: Inputs, modes: list[str], settings: Settings) -> None:
    """Runs each mode's call of a provider before its first workload is timed.

    The first calls of a provider in a process pay one-time costs of unbounded length: lazy imports
    and initialisation, the allocator growing its pools, kernel compilation and autotuning, CPU
    thread pools starting. The gate's one call pays only part of them, and each measurement's own
    warm-up (warmup_ms) is too short for the rest; without this the first workload's times, and
    every ratio taken against them, would carry them (on CPU, the first workload measured 3× its
    next one). Later workloads of the same provider pay at most a new shape's costs, which the
    measurement's warm-up absorbs."""
    for mode in modes:
        step, grads = _step(fn, x, mode), _grads(x)
        try:
            step()  # the one-time costs: not counted in the time below
            if settings.device.type == "cuda":
                torch.cuda.synchronize()
            t_end = time.perf_counter() + _WARM_UP_FACTOR * settings.warmup_ms / 1e3
            for _ in range(_WARM_UP_CALLS - 1):
                step()
            while time.perf_counter() < t_end:
                step()
                if settings.device.type == "cuda":
                    torch.cuda.synchronize()
        finally:
            for g in grads:
                g.grad = None


def _time_in_turn(w, x, ready, modes, settings: Settings, advance) -> dict:
    """{(provider, mode): ms at QUANTILES, or the exception its timing raised}. Per mode the providers
    are timed in turn, settings.rounds times over (every other round in reverse order), each turn for
    1/rounds of the repetitions, and each one's samples are pooled: a drift of the GPU's clocks while
    the workload runs then falls on every provider alike, and the ratios taken between them are fair."""
    out = {}
    turn = dataclasses.replace(settings, rep_ms=settings.rep_ms / settings.rounds,
                               min_reps=-(-settings.min_reps // settings.rounds))
    for mode in modes:
        samples = {name: [] for name in ready}
        for r in range(settings.rounds):
            for name in list(ready)[:: 1 if r % 2 == 0 else -1]:
                if (name, mode) in out:
                    continue  # its timing failed in an earlier round
                advance(f"{w.tag} N={w.n} {name} {mode} {r + 1}/{settings.rounds}", 0)
                try:
                    samples[name] += _time(ready[name], x, mode, turn)
                except Exception as e:
                    out[name, mode] = e
                    _free(settings.device)
        for name, times in samples.items():
            out.setdefault((name, mode), _quantiles(times))
    return out


def _step(fn: LossFn, x: Inputs, mode: str):
    """The timed call of a mode."""
    if mode == "backward":
        x.xs.grad = x.ws.grad = None
        loss = fn()

        def step():
            loss.backward(retain_graph=True)
    elif mode == "forward":
        step = fn
    elif mode == "full":
        def step():
            fn().backward()
    elif mode == "no-grad-forward":
        def step():
            with torch.no_grad():
                return fn()
    else:
        raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
    return step


def _grads(x: Inputs) -> list[torch.Tensor]:
    return [g for g in (x.xs, x.ws) if g is not None]  # teacher_topk has no student


def _time(fn: LossFn, x: Inputs, mode: str, settings: Settings) -> list[float]:
    """ms of each timed call of one turn (settings: the turn's share of the repetitions)."""
    step, grads = _step(fn, x, mode), _grads(x)
    try:
        return (_time_cuda if settings.device.type == "cuda" else _time_cpu)(step, grads, settings)
    finally:
        for g in grads:
            g.grad = None


def _memory(fn: LossFn, x: Inputs, mode: str, settings: Settings):
    """(peak MiB, extra MiB) of one mode at QUANTILES; None on CPU."""
    if settings.device.type != "cuda":
        return None, None
    grads = _grads(x)
    try:
        return _memory_cuda(_step(fn, x, mode), grads)
    finally:
        for g in grads:
            g.grad = None


@dataclasses.dataclass(frozen=True)
class Reference:
    loss: torch.Tensor  # () fp32
    dxs: torch.Tensor  # (N, Hs) fp32
    dws: torch.Tensor  # (V, Hs) fp32


@dataclasses.dataclass(frozen=True)
class TopkReference:
    top: torch.Tensor  # (N, K) fp32: each row's k largest log-probs, decreasing
    lse: torch.Tensor  # (N,) fp32: logsumexp of the row's logits / τ
    scale: torch.Tensor  # (N,) fp32: max |logit| / τ, the size of the row's rounding errors


def reference(w: Workload, x: Inputs) -> Reference | TopkReference:
    """The naive formula (providers.naive_loss) in fp32 with TF32 off, on the inputs upcast to fp32.

    The teacher's targets of the logits and topk forms are inputs like the others: upcast, not
    recomputed, so the reference and the providers distill the same (rounded) teacher.
    """
    if not w.has_grad:
        return _topk_reference(w, x)
    work = torch.promote_types(x.xs.dtype, torch.float32)
    xs = x.xs.detach().to(work).requires_grad_()  # (N, Hs)
    ws = x.ws.detach().to(work).requires_grad_()  # (V, Hs)
    # Teacher logits and log-probs are upcast block by block, inside the row losses.
    teacher = x._replace(xt=None if x.xt is None else x.xt.to(work), wt=None if x.wt is None else x.wt.to(work))
    spec = w.spec()
    count = (x.y != w.ignore_index).sum().clamp_min(1)
    rows = _reference_rows(w.v * 4, xs.device)
    total = torch.zeros((), device=xs.device, dtype=work)
    with _ieee_fp32():
        for start in range(0, w.n, rows):
            c = slice(start, start + rows)
            loss = naive_loss(xs[c], ws, teacher_block(teacher, c), x.y[c], spec, count)
            loss.backward()
            total += loss.detach()
    return Reference(total, xs.grad, ws.grad)


def _reference_rows(bytes_per_row: int, device: torch.device | None = None) -> int:
    block = _REFERENCE_BLOCK_BYTES
    if device is not None and device.type == "cuda":
        block = min(block, torch.cuda.mem_get_info(device)[0] // _REFERENCE_SHARE)
    return max(1, block // bytes_per_row)


def _topk_reference(w: Workload, x: Inputs) -> TopkReference:
    """teacher_topk's truth: the fp32 (TF32 off) logits of the inputs upcast, block by block."""
    work = torch.promote_types(x.xt.dtype, torch.float32)
    wt = x.wt.to(work)  # (V, Ht)
    top = torch.empty(w.n, w.k, device=wt.device, dtype=work)
    lse = torch.empty(w.n, device=wt.device, dtype=work)
    scale = torch.empty(w.n, device=wt.device, dtype=work)
    rows = _reference_rows(w.v * 4 * 3)  # logits, logits / τ and one temporary
    with _ieee_fp32(), torch.no_grad():
        for start in range(0, w.n, rows):
            c = slice(start, start + rows)
            z = logit_transform(x.xt[c].to(work) @ wt.t(), 1.0, w.softcap) / w.temperature  # (R, V)
            lse[c] = torch.logsumexp(z, dim=-1)
            top[c] = z.topk(w.k, dim=-1).values - lse[c, None]
            scale[c] = z.abs().amax(dim=-1)
            del z
    return TopkReference(top, lse, scale.clamp_min(torch.finfo(work).tiny))


def _logprobs_at(w: Workload, x: Inputs, ref: TopkReference, ids: torch.Tensor) -> torch.Tensor:
    """The reference log-probs (N, K) at the given ids (each in [0, V)), block by block: only the
    K rows of Wt a row asks for are multiplied, in fp32 with TF32 off."""
    work = ref.top.dtype
    out = torch.empty(ids.shape, device=ids.device, dtype=work)
    rows = _reference_rows(w.k * w.h * 4 * 2)  # the gathered (R, K, H) rows of Wt, and their upcast
    with _ieee_fp32(), torch.no_grad():
        for start in range(0, w.n, rows):
            c = slice(start, start + rows)
            z = torch.einsum("rh,rkh->rk", x.xt[c].to(work), x.wt[ids[c]].to(work))  # (R, K)
            out[c] = logit_transform(z, 1.0, w.softcap) / w.temperature - ref.lse[c, None]
    return out


@contextlib.contextmanager
def _ieee_fp32():
    """fp32 matmuls in full fp32 (no TF32) for the reference, whatever the process had set."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def _tolerance(w: Workload, dtype: torch.dtype) -> tuple[float, float]:
    """The gate's (loss, grads) tolerance: the dtype's, or FP8_TOLERANCE for flashkd's FP8 teacher."""
    return FP8_TOLERANCE if w.teacher_precision is not None else TOLERANCE[dtype]



def gate(fn: LossFn, x: Inputs, ref: Reference, no_grad_too: bool, tol: tuple[float, float] | None = None) -> Check:
    """One forward+backward of the provider against the reference; also the no-grad loss when that
    mode is measured (fused losses take another path there). `loss_err` is the worse of the two."""
    x.xs.grad = x.ws.grad = None
    loss = fn()
    loss.backward()
    loss_err = _rel(loss, ref.loss)
    dx_err, dw_err = _rel(x.xs.grad, ref.dxs), _rel(x.ws.grad, ref.dws)
    x.xs.grad = x.ws.grad = None
    del loss
    if no_grad_too:
        with torch.no_grad():
            loss_err = _worst(loss_err, _rel(fn(), ref.loss))
    tol = TOLERANCE[x.xs.dtype] if tol is None else tol
    ok = loss_err <= tol[0] and dx_err <= tol[1] and dw_err <= tol[1]  # False on NaN
    return Check("passed" if ok else "FAILED", loss_err, dx_err, dw_err, tol)


def _gate_topk(fn, x: Inputs, ref: TopkReference, w: Workload) -> Check:
    """teacher_topk against the reference: its ids as a set per row, and its log-probs at them.

    ids: the reference log-probs at the provider's ids, sorted, must equal the reference's own k
    largest place by place, up to ties. Ties are what a rounded input cannot order: the provider
    ranks logits rounded to its dtype (bf16: each within 2^-9 · max|z| of the truth), so two logits
    closer than 2^-8 · max|z| may come out either way round, and at the k-th place either may be in
    its set, equally right. `ids_err` is the largest shortfall relative to the row's max|z|/τ, held
    to the loss tolerance (bf16 1e-2, 2.5× that window; fp32 1e-4, far above fp32 sums in another
    order). A wrong id falls short by its gap to the k-th value, which ties alone keep small. Ids
    outside [0, V) or repeated in a row fail outright.
    log-probs: at the provider's own ids (so swapped ties cannot count against them), compared as
    probabilities, relative L2: the error of p is what a distillation loss sees; a relative error
    of log p, near −log V, would be ~log V times more lenient.
    """
    with torch.no_grad():
        ids, lp = fn()
    tol = _tolerance(w, x.xt.dtype)
    if tuple(ids.shape) != tuple(ref.top.shape) or tuple(lp.shape) != tuple(ref.top.shape):
        note = f"expected ids and logprobs of shape {tuple(ref.top.shape)}, got {tuple(ids.shape)}, {tuple(lp.shape)}"
        return Check("FAILED", tol=(tol[0], tol[0]), note=note)
    ids = ids.long()
    valid = ((ids >= 0) & (ids < w.v)).all().item()
    sorted_ids = ids.sort(dim=-1).values
    distinct = not (sorted_ids[:, 1:] == sorted_ids[:, :-1]).any().item()
    if not (valid and distinct):
        note = "ids outside [0, V)" if not valid else "an id repeated within a row"
        return Check("FAILED", math.inf, ids_err=math.inf, tol=(tol[0], tol[0]), note=note)
    at = _logprobs_at(w, x, ref, ids)  # (N, K)
    shortfall = (ref.top - at.sort(dim=-1, descending=True).values).abs().amax(dim=-1) / ref.scale
    ids_err = shortfall.max().item() if shortfall.numel() else 0.0
    probs_err = _rel(lp.to(at.dtype).exp(), at.exp())
    ok = probs_err <= tol[0] and ids_err <= tol[0]  # False on NaN
    return Check("passed" if ok else "FAILED", probs_err, ids_err=ids_err, tol=(tol[0], tol[0]))


def _worst(*errors: float) -> float:
    return math.nan if any(math.isnan(e) for e in errors) else max(errors)


def _rel(a: torch.Tensor | None, b: torch.Tensor) -> float:
    if a is None:  # the provider gave no gradient: as wrong as it gets
        return math.inf
    b = b.double()
    diff = (a.double() - b).norm()
    return 0.0 if diff.item() == 0.0 else (diff / b.norm()).item()  # equal is no error, also where both are 0


def _time_cuda(step, grads, settings: Settings):
    import triton.testing

    # do_bench fits int(rep / estimate) calls in rep; make sure that is at least min_reps.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    step()
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    rep = max(settings.rep_ms, settings.min_reps * start.elapsed_time(end))
    times = triton.testing.do_bench(step, warmup=settings.warmup_ms, rep=rep, grad_to_none=grads, return_mode="all")
    return [float(t) for t in times]


def event_times(fn, reps: int) -> list[float]:
    """The ms of each of `reps` calls of fn(), one at a time between two CUDA events, synchronised after
    each: the clock of the benchmarks and probes that time single calls (do_bench's batching unwanted)."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def cuda_peak(step) -> tuple[int, int]:
    """(peak bytes allocated during step(), bytes allocated before it), on the current CUDA device:
    Liger's measure (reset the peak, run, read max_memory_allocated), step's result kept until then."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del out
    return peak, before


def _memory_cuda(step, grads):
    # in MiB (Liger's "MB")
    peaks, extras = [], []
    for _ in range(_MEMORY_REPS):
        for g in grads:
            g.grad = None  # grads of the last call are not part of this call's baseline
        peak, before = cuda_peak(step)
        peaks.append(peak / 2**20)
        extras.append((peak - before) / 2**20)
    return _quantiles(peaks), _quantiles(extras)


def _time_cpu(step, grads, settings: Settings):
    # Wall clock: warm up with one call and then warmup_ms more (a first call on a new shape can take
    # longer than all of warmup_ms), then time calls one by one until both rep_ms have passed and
    # min_reps calls were made.
    step()
    t_end = time.perf_counter() + settings.warmup_ms / 1e3
    while time.perf_counter() < t_end:
        step()
    times = []
    while len(times) < settings.min_reps or sum(times) < settings.rep_ms:
        for g in grads:
            g.grad = None
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _quantiles(values) -> tuple[float, float, float]:
    q = torch.quantile(torch.tensor(values, dtype=torch.float64), torch.tensor(QUANTILES, dtype=torch.float64))
    return tuple(q.tolist())


def _free(device: torch.device):
    # Hand the last provider's blocks back to the driver, so the next one (or the naive 50 GB
    # reference) starts from an empty cache. On CPU refcounting frees tensors as they go.
    if device.type == "cuda":
        gc.collect()  # autograd graphs held in reference cycles
        torch.cuda.empty_cache()


def _failure(e: BaseException) -> str:
    # Running out of memory is a result (the naive formula at large N), not a harness failure.
    return "OOM" if isinstance(e, torch.OutOfMemoryError) else "error"


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:200]


def _utc_now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
