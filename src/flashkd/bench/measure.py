"""Correctness gate, timing and memory; `run` puts them together over workloads x providers x modes.

Per workload: seeded inputs; the fp32 reference (loss, dXs, dWs), then freed down to its three
results; then per provider: one checked forward+backward against the reference (a provider outside
the gate is FAILED and not timed), then per mode: speed, then memory.

Modes (what the timed call does):
    forward           loss = fn()            (grad enabled: a graph is built, and fused losses compute grads here)
    backward          loss.backward()        on one loss computed before timing (retain_graph=True)
    full              fn().backward()
    no-grad-forward   fn() under torch.no_grad()
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import time
from typing import Callable

import torch

from .providers import PROVIDERS, LossFn, Skip, naive_loss
from .workloads import Inputs, Workload, make_inputs

MODES = ("full", "forward", "backward", "no-grad-forward")
QUANTILES = (0.5, 0.2, 0.8)  # Liger's columns y_value_50, y_value_20, y_value_80

# The gate on relative error against the fp32 reference: (loss, grads). It catches wrong results (a
# wrong term, β or scale moves the loss or a gradient by 1e-2 and more); it does not rank precision,
# which the reported errors do. The provider's inputs are the reference's inputs before upcasting,
# so its error is its own arithmetic only. fp32: sums over V and H in another order differ by ~1e-6,
# so 1e-4 leaves 100x. bf16/fp16: logits and dX/dW rounded to 8 (11) bits give ~2e-3 (torch),
# and Liger's bf16 loss math gives 4e-3 on the loss and 1.5e-2 on dX (measured on an H200), so
# 1e-2 / 5e-2 passes every correct implementation known and still fails a 10% error.
TOLERANCE = {
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (1e-2, 5e-2),
    torch.float16: (1e-2, 5e-2),
}

# The reference keeps ~10 fp32 (R, V) tensors for autograd. With at most 4 GiB of logits per block
# that is ~50 GB: the seed workload (N=8192, V=128256) is one block, i.e. the naive formula as it
# stands; larger N go block by block, which changes only the order of fp32 sums.
_REFERENCE_BLOCK_BYTES = 4 << 30
_MEMORY_REPS = 5  # peaks repeat exactly from call to call; Liger takes 10


@dataclasses.dataclass(frozen=True)
class Settings:
    device: torch.device
    rep_ms: float = 500.0  # timed repetitions per measurement (do_bench's rep)
    warmup_ms: float = 100.0
    min_reps: int = 10  # rep_ms is raised to fit this many calls, so slow calls get a real spread


@dataclasses.dataclass(frozen=True)
class Check:
    status: str  # passed | FAILED | unchecked (no loss to check) | skipped | OOM | error
    loss_err: float = math.nan  # |a − b| / |b|
    dx_err: float = math.nan  # ‖a − b‖ / ‖b‖
    dw_err: float = math.nan
    tol: tuple[float, float] = (math.nan, math.nan)  # (loss, grads)
    note: str = ""


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
    """Every (workload, provider, mode). `advance(label, steps)` reports progress: what runs now and
    how many of the len(workloads) · len(providers) · (1 + len(modes)) steps just ended."""
    if settings.device.type == "cuda" and settings.device.index is not None:
        torch.cuda.set_device(settings.device)  # do_bench, events and memory stats use the current device
    results = []
    for w in workloads:
        x = make_inputs(w, settings.device)
        ref = reference(w, x) if any(PROVIDERS[p].has_loss for p in providers) else None
        _free(settings.device)
        for name in providers:
            results += _one_provider(w, x, ref, name, modes, settings, advance)
            _free(settings.device)
        del x, ref
        _free(settings.device)
    return results


def _one_provider(w, x, ref, name, modes, settings, advance) -> list[Result]:
    provider = PROVIDERS[name]
    label = f"{w.loss} N={w.n} {name}"
    version = provider.version()
    advance(f"{label} check", 0)
    try:
        fn = provider.make(w, x)
        check = gate(fn, x, ref, "no-grad-forward" in modes) if provider.has_loss else Check("unchecked")
    except Skip as e:
        check = Check("skipped", note=str(e))
    except Exception as e:  # an OOM or a crash in one provider must not lose the others' results
        check = Check(_failure(e), note=_one_line(e))
    if check.status != "passed" and check.status != "unchecked":
        advance(f"{label} {check.status}", 1 + len(modes))
        return [Result(w, name, version, check)]
    advance(f"{label} {check.status}", 1)
    out = []
    for mode in modes:
        advance(f"{label} {mode}", 0)
        try:
            speed, peak, extra = measure(fn, x, mode, settings)
            out.append(Result(w, name, version, check, mode, speed, peak, extra, _utc_now()))
        except Exception as e:
            failed = dataclasses.replace(check, status=_failure(e), note=_one_line(e))
            out.append(Result(w, name, version, failed, mode))
            _free(settings.device)
        advance(f"{label} {mode}", 1)
    return out


@dataclasses.dataclass(frozen=True)
class Reference:
    loss: torch.Tensor  # () fp32
    dxs: torch.Tensor  # (N, Hs) fp32
    dws: torch.Tensor  # (V, Hs) fp32


def reference(w: Workload, x: Inputs) -> Reference:
    """The naive formula (providers.naive_loss) in fp32 with TF32 off, on the inputs upcast to fp32."""
    work = torch.promote_types(x.xs.dtype, torch.float32)
    xs = x.xs.detach().to(work).requires_grad_()  # (N, Hs)
    ws = x.ws.detach().to(work).requires_grad_()  # (V, Hs)
    xt, wt = x.xt.to(work), x.wt.to(work)  # (N, Ht), (V, Ht)
    spec = w.spec()
    count = (x.y != w.ignore_index).sum().clamp_min(1)
    rows = max(1, _REFERENCE_BLOCK_BYTES // (w.v * 4))
    total = torch.zeros((), device=xs.device, dtype=work)
    with _ieee_fp32():
        for start in range(0, w.n, rows):
            c = slice(start, start + rows)
            loss = naive_loss(xs[c], ws, xt[c], wt, x.y[c], spec, count)
            loss.backward()
            total += loss.detach()
    return Reference(total, xs.grad, ws.grad)


@contextlib.contextmanager
def _ieee_fp32():
    """fp32 matmuls in full fp32 (no TF32) for the reference, whatever the process had set."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def gate(fn: LossFn, x: Inputs, ref: Reference, no_grad_too: bool) -> Check:
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
    tol = TOLERANCE[x.xs.dtype]
    ok = loss_err <= tol[0] and dx_err <= tol[1] and dw_err <= tol[1]  # False on NaN
    return Check("passed" if ok else "FAILED", loss_err, dx_err, dw_err, tol)


def _worst(*errors: float) -> float:
    return math.nan if any(math.isnan(e) for e in errors) else max(errors)


def _rel(a: torch.Tensor | None, b: torch.Tensor) -> float:
    if a is None:  # the provider gave no gradient: as wrong as it gets
        return math.inf
    b = b.double()
    return ((a.double() - b).norm() / b.norm()).item()


def measure(fn: LossFn, x: Inputs, mode: str, settings: Settings):
    """(speed ms, peak MiB, extra MiB) of one mode, each at QUANTILES; memory None on CPU."""
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
    grads = [x.xs, x.ws]
    if settings.device.type == "cuda":
        speed = _time_cuda(step, grads, settings)
        peak, extra = _memory_cuda(step, grads)
    else:
        speed, peak, extra = _time_cpu(step, grads, settings), None, None
    for g in grads:
        g.grad = None
    return speed, peak, extra


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
    ms = triton.testing.do_bench(
        step, warmup=settings.warmup_ms, rep=rep, grad_to_none=grads, quantiles=list(QUANTILES)
    )
    return tuple(float(m) for m in ms)


def _memory_cuda(step, grads):
    # Liger's measure: reset the peak, run, read max_memory_allocated; in MiB (its "MB").
    peaks, extras = [], []
    for _ in range(_MEMORY_REPS):
        for g in grads:
            g.grad = None  # grads of the last call are not part of this call's baseline
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        del out
        peaks.append(peak / 2**20)
        extras.append((peak - before) / 2**20)
    return _quantiles(peaks), _quantiles(extras)


def _time_cpu(step, grads, settings: Settings):
    # Wall clock: warm up for warmup_ms (at least one call), then time calls one by one until both
    # rep_ms have passed and min_reps calls were made.
    t_end = time.perf_counter() + settings.warmup_ms / 1e3
    step()
    while time.perf_counter() < t_end:
        step()
    times = []
    while len(times) < settings.min_reps or sum(times) < settings.rep_ms:
        for g in grads:
            g.grad = None
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return _quantiles(times)


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
