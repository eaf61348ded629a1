"""What a run leaves behind: the terminal table, results.csv, errors.csv and the PNG plots.

results.csv uses Liger-Kernel's 15-column benchmark schema, so our rows can be read by the same
tools as Liger's published ones (benchmark/data/all_benchmark_data.csv there):
    kernel_name       distill_<loss>_loss (teacher heads: Liger's names), distill_logits_<loss>_loss,
                      distill_topk_<loss>_loss, teacher_topk
    kernel_provider   flashkd | torch | liger | floor
    metric_name       speed (ms) | memory (peak, "MB" = MiB as Liger writes it) | memory_extra (peak −
                      allocated before the call, MiB)
    x_name, x_label   BT, "B x T"; x_value = N
    y_value_50/20/80  the median, p20, p80 (nan: not measured, e.g. memory on CPU)
    extra_benchmark_config_str   JSON: Liger's keys (H, V, mode, dtype, bias, weights, ignore_index),
                      then ours: loss options, the teacher's form (form, k, tail; absent for heads),
                      the gate's observed errors and tolerances, the timer. teacher_topk: loss_rel_err
                      is the error of its top-k probabilities, ids_err that of its ids (measure._gate_topk)
    gpu_name, timestamp (UTC), liger_version = the version of the provider that ran (flashkd,
                      liger-kernel, or torch for torch and floor)
errors.csv has one row per (workload, provider): the gate's status, observed errors and tolerances.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import platform
import zlib
from pathlib import Path

import torch

import flashkd
from ..records.liger import COLUMNS  # Liger-Kernel's 15-column CSV schema, which the importer reads
from .measure import Result, Settings
from .providers import PROVIDERS

ERROR_COLUMNS = (
    "kernel_name", "kernel_provider", "x_name", "x_value", "H", "V", "dtype", "status", "loss_rel_err",
    "dx_rel_err", "dw_rel_err", "ids_err", "loss_tol", "grad_tol", "provider_version", "note",
)
BASELINES = ("floor", "liger", "torch")  # the table's ratio columns: t / t_baseline, same workload and mode


def environment(settings: Settings) -> dict:
    """Where and how the run was timed; rides in every row's extra config."""
    cuda = settings.device.type == "cuda"
    return {
        "device": settings.device.type,
        "gpu_name": torch.cuda.get_device_name(settings.device) if cuda else _cpu_name(),
        "timer": "triton.testing.do_bench" if cuda else "time.perf_counter",
        "rep_ms": settings.rep_ms, "warmup_ms": settings.warmup_ms, "min_reps": settings.min_reps,
        "rounds": settings.rounds,
        "tf32": bool(torch.backends.cuda.matmul.allow_tf32) if cuda else False,
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__, "flashkd": flashkd.__version__, "harness": "flashkd.bench",
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU {line.split(':', 1)[1].strip()}"
    except OSError:
        pass
    return f"CPU {platform.processor() or platform.machine()}"


def _num(v: float):
    return None if v is None or math.isnan(v) else v


def _timed(results: list[Result]) -> list[Result]:
    return [r for r in results if r.speed is not None]


def csv_rows(results: list[Result], env: dict) -> list[dict]:
    rows = []
    for r in _timed(results):
        w, c = r.workload, r.check
        config = w.config()
        config = {"H": config.pop("H"), "V": config.pop("V"), "mode": r.mode, **config}
        config.update(status=c.status, loss_rel_err=_num(c.loss_err), dx_rel_err=_num(c.dx_err),
                      dw_rel_err=_num(c.dw_err))
        if not math.isnan(c.ids_err):
            config["ids_err"] = c.ids_err
        config.update(loss_tol=_num(c.tol[0]), grad_tol=_num(c.tol[1]),
                      **{k: v for k, v in env.items() if k != "gpu_name"})
        if r.peak is None:
            config["memory"] = f"not measured on {env['device']}"
        for metric, unit, values in (
            ("speed", "ms", r.speed), ("memory", "MB", r.peak), ("memory_extra", "MB", r.extra)
        ):
            p50, p20, p80 = values or (math.nan,) * 3
            rows.append(dict(zip(COLUMNS, (
                w.kernel_name, r.provider, r.mode, metric, unit, "BT", "B x T", w.n, p50, p20, p80,
                json.dumps(config), env["gpu_name"], r.timestamp, r.version,
            ))))
    return rows


def write_csv(results: list[Result], path: Path, env: dict) -> None:
    with open(path, "w", newline="") as f:
        out = csv.DictWriter(f, fieldnames=COLUMNS)
        out.writeheader()
        out.writerows(csv_rows(results, env))


def write_errors(results: list[Result], path: Path) -> None:
    first, remarks = {}, {}  # one row per (workload, provider): the gate's result, and every note
    for r in results:
        key = (r.workload, r.provider)
        first.setdefault(key, r)
        if r.check.note:
            remarks.setdefault(key, []).append(f"{r.mode}: {r.check.note}" if r.mode else r.check.note)
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(ERROR_COLUMNS)
        for key, r in first.items():
            w, c = r.workload, r.check
            status = c.status if r.mode is None else _gate_status(c)
            out.writerow((
                w.kernel_name, r.provider, "BT", w.n, w.h, w.v, str(w.torch_dtype), status,
                *(("" if math.isnan(e) else f"{e:.3e}") for e in (c.loss_err, c.dx_err, c.dw_err, c.ids_err, *c.tol)),
                r.version, "; ".join(dict.fromkeys(remarks.get(key, []))),
            ))


def _gate_status(c) -> str:
    """What the gate said of a provider that went on to be timed (a later OOM or error is a note)."""
    if c.status in ("OOM", "error"):
        return "unchecked" if math.isnan(c.loss_err) else "passed"
    return c.status


def _groups(results: list[Result]) -> dict[tuple, list[Result]]:
    """Results by (workload less N, mode); untimed results go into every mode of their workload."""
    modes = list(dict.fromkeys(r.mode for r in results if r.mode is not None)) or ["not timed"]
    groups: dict[tuple, list[Result]] = {}
    for r in results:
        base = dataclasses.replace(r.workload, n=0)
        for mode in [r.mode] if r.mode is not None else modes:
            groups.setdefault((base, mode), []).append(r)
    return groups


def tables(results: list[Result]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) as strings, for rich or plain text: the gate once, then one table of
    speed and memory per (workload less N, mode)."""
    return [_gate_table(results), *_speed_tables(results)]


def _gate_table(results):
    # teacher_topk's errors: "err loss" holds its probabilities', "err ids" (shown only then) its ids'.
    ids = any(not math.isnan(r.check.ids_err) for r in results)
    header = ["workload", "N", "provider", "err loss", "err dX", "err dW", *(["err ids"] if ids else []),
              "tol loss/grads", "status"]
    rows, seen = [], set()
    for r in results:
        if (r.workload, r.provider) in seen:
            continue
        seen.add((r.workload, r.provider))
        c = r.check
        errors = ["" if math.isnan(e) else f"{e:.1e}" for e in (c.loss_err, c.dx_err, c.dw_err,
                                                                 *([c.ids_err] if ids else []))]
        tol = "" if math.isnan(c.tol[0]) else "/".join(f"{t:.0e}".replace("e-0", "e-") for t in c.tol)
        status = c.status if r.mode is None else _gate_status(c)
        rows.append([r.workload.tag, str(r.workload.n), r.provider, *errors, tol, status])
    return "correctness: relative error against the fp32 reference (TF32 off)", header, rows


def _speed_tables(results):
    header = ["N", "provider", "ms", "p20–p80", *(f"÷{b}" for b in BASELINES), "peak MiB", "extra MiB"]
    p50 = {(r.workload, r.mode, r.provider): r.speed[0] for r in _timed(results)}
    out = []
    for (w, mode), rs in _groups(results).items():
        rows = []
        for r in sorted(rs, key=lambda r: r.workload.n):
            if r.speed is None:  # not timed: say why where the time would be
                rows.append([str(r.workload.n), r.provider, r.check.status] + [""] * (len(header) - 3))
                continue
            ms = r.speed[0]
            ratios = []
            for b in BASELINES:
                base = p50.get((r.workload, mode, b))
                ratios.append(f"{ms / base:.2f}" if base and b != r.provider else "")
            rows.append([
                str(r.workload.n), r.provider, _ms(ms), f"{_ms(r.speed[1])}–{_ms(r.speed[2])}", *ratios,
                f"{r.peak[0]:.0f}" if r.peak else "n/m", f"{r.extra[0]:.0f}" if r.extra else "n/m",
            ])
        note = backward_note(r.provider for r in rs if r.speed is not None) if mode == "backward" else ""
        out.append((f"{w.kernel_name} · {mode} · {w.describe()}" + (f"\n{note}" if note else ""), header, rows))
    return out


def _ms(v: float) -> str:
    return f"{v:.{3 if v < 10 else 2 if v < 100 else 1}f}"  # four or five significant digits


def notes(results: list[Result], env: dict) -> list[str]:
    lines = list(dict.fromkeys(f"{r.provider}: {r.check.note}" for r in results if r.check.note))
    if any(not r.workload.has_grad for r in results):
        lines.append("teacher_topk: err loss is the error of its top-k probabilities, err ids how far its ids fall "
                     "short of the true top k (ties within rounding pass); tol probabilities/ids")
    if env["device"] != "cuda":
        lines.append(f"memory: not measured on {env['device']} (n/m); times are wall clock ({env['timer']}) on "
                     "this machine: a check that everything runs, not a speed comparison of the kernels (built "
                     "for GPUs)")
        if env.get("cpu_threads") != 1 and any(
                r.mode == "backward" and getattr(PROVIDERS.get(r.provider), "grads_in_forward", False)
                for r in _timed(results)):
            # measured: flashkd's and Liger's backward alike, 20 ms at 2 threads on a busy 2-core machine, 0.6-0.9 at 1
            lines.append("backward: that pass over dX and dW is small; on a CPU its wall clock is mostly waking "
                         "torch's threads, milliseconds on a busy machine (--threads 1 steadies it)")
    lines.append("÷b: this provider's median time / provider b's, same workload and mode (< 1: faster than b)")
    return lines


def print_tables(results: list[Result], env: dict, console=None) -> None:
    try:
        from rich import box
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text when rich is not installed
        for title, header, rows in tables(results):
            print(f"\n{title}")
            widths = [max(len(x) for x in col) for col in zip(header, *rows)]
            for row in [header, *rows]:
                print("  ".join(x.rjust(n) for x, n in zip(row, widths)))
        print("\n".join(notes(results, env)))
        return
    console = console or Console()
    loud = {"FAILED": "bold red", "error": "bold red", "OOM": "yellow", "skipped": "dim"}
    for title, header, rows in tables(results):
        t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 0))
        for name in header:
            t.add_column(name, justify="left" if name in ("workload", "provider", "status") else "right", no_wrap=True)
        for row in rows:
            t.add_row(*row, style=next((loud[x] for x in row if x in loud), None))
        console.print(t)
    for line in notes(results, env):
        console.print(line, style="dim", highlight=False)


_MARKERS = "osD^vPX*ph"


def _style(provider: str) -> dict:
    """One colour and marker per provider, the same in every plot (of every run): by its place in
    PROVIDERS, or from its name for one that is not registered."""
    names = list(PROVIDERS)
    i = names.index(provider) if provider in names else len(names) + zlib.crc32(provider.encode()) % 6
    return {"color": f"C{i % 10}", "marker": _MARKERS[i % len(_MARKERS)]}


def backward_note(providers) -> str:
    """What a backward time means for the providers that compute their gradients in the forward call."""
    fused = [p for p in dict.fromkeys(providers) if getattr(PROVIDERS.get(p), "grads_in_forward", False)]
    if not fused:
        return ""
    # What runs there: one elementwise pass over dX and dW (flashkd: × grad_output, a copy here since the
    # timing keeps the graph; Liger: autograd copying its saved grads into .grad), no loss math, no GEMM.
    return (f"{' and '.join(fused)} compute{'s' if len(fused) == 1 else ''} gradients in forward: "
            f"{'its' if len(fused) == 1 else 'their'} backward only scales them (one pass over dX and dW, "
            f"no loss math), see full")


def _log_labels(axis, low: float, high: float) -> None:
    """Labels on a log axis dense enough to read a value off: every 1-9 within a decade, 1-2-5 up
    up to four decades, decades beyond; plain numbers (20, not 2×10¹)."""
    import matplotlib.ticker as ticker

    decades = math.log10(high / low) if low > 0 and high > low else 0.0
    subs = tuple(range(1, 10)) if decades <= 1 else (1, 2, 5) if decades <= 4 else (1,)
    axis.set_major_locator(ticker.LogLocator(base=10, subs=subs))
    axis.set_major_formatter(ticker.FuncFormatter(lambda y, _: f"{y:g}"))
    axis.set_minor_locator(ticker.NullLocator() if len(subs) == 9 else ticker.LogLocator(base=10, subs=range(2, 10)))
    axis.set_minor_formatter(ticker.NullFormatter())


def write_plots(results: list[Result], out: Path, env: dict) -> list[Path]:
    """speed_<tag>_<mode>.png and, where memory was measured (CUDA), memory_<tag>_<mode>.png (tag: the
    loss, or form_loss, or teacher_topk): the median with p20–p80 bars against N on log axes, or,
    for a workload timed at one N, one bar per provider. Each provider keeps its colour and marker
    in every plot (`_style`)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    paths = []
    for (w, mode), rs in _groups(_timed(results)).items():
        providers = list(dict.fromkeys(r.provider for r in rs))
        ns = sorted({r.workload.n for r in rs})
        for metric in ("speed", "memory"):
            if metric == "memory" and all(r.peak is None for r in rs):
                continue  # not measured (CPU): no empty plot
            fig, ax = plt.subplots(figsize=(7, 4.5))
            series = []  # (provider, label, ns, medians, p20s, p80s, dashed)
            for name in providers:
                mine = sorted((r for r in rs if r.provider == name), key=lambda r: r.workload.n)
                if metric == "speed":
                    series.append((name, name, mine, [r.speed for r in mine], False))
                elif mine[0].peak is not None:
                    series.append((name, f"{name} peak", mine, [r.peak for r in mine], False))
                    series.append((name, f"{name} extra", mine, [r.extra for r in mine], True))
            unit = "ms" if metric == "speed" else "MiB"
            if len(ns) == 1:
                _bars(ax, series, unit)
                ax.set_xlabel(f"N = B x T = {ns[0]} rows")
            else:
                values = []
                for name, label, mine, q, dashed in series:
                    mid = [v[0] for v in q]
                    err = [[m - v[1] for m, v in zip(mid, q)], [v[2] - m for m, v in zip(mid, q)]]
                    style = _style(name)
                    ax.errorbar([r.workload.n for r in mine], mid, yerr=err, capsize=3, label=label,
                                ls="--" if dashed else "-", mfc="none" if dashed else style["color"], **style)
                    values += [v for t in q for v in t if v > 0]
                ax.set_xscale("log", base=2)
                ax.set_xlim(ns[0] / 1.4, ns[-1] * 1.4)
                ax.set_xticks(ns, [str(n) for n in ns])
                ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
                ax.set_yscale("log")
                if values:
                    ax.set_ylim(min(values) / 1.25, max(values) * 1.25)
                    _log_labels(ax.yaxis, *ax.get_ylim())
                ax.set_xlabel("N = B x T (rows)")
                ax.legend(fontsize=8)
            ax.set_ylabel(f"{unit} (median, p20–p80)" if metric == "speed" else "MiB (peak; extra hollow, dashed)")
            note = backward_note(providers) if mode == "backward" and metric == "speed" else ""
            ax.set_title(f"{w.kernel_name} {mode}: {w.describe()}\n{env['gpu_name']}" + (f"\n{note}" if note else ""),
                         fontsize=10 if not note else 8)
            ax.grid(True, which="both", axis="y" if len(ns) == 1 else "both", alpha=0.3)
            path = out / f"{metric}_{w.tag}_{mode}.png"
            if path in paths:  # the same loss and mode at another shape or dtype
                path = out / f"{metric}_{w.tag}_{mode}_H{w.h}_V{w.v}_{w.dtype}_{len(paths)}.png"
            fig.tight_layout()
            fig.savefig(path, dpi=120)
            plt.close(fig)
            paths.append(path)
    return paths


def _bars(ax, series, unit: str) -> None:
    """One bar per series (a provider, or its peak and extra memory) at a single N, each with its
    p20–p80 bar and its median written above it."""
    at = list(range(len(series)))
    for i, (name, label, mine, q, dashed) in zip(at, series):
        p50, p20, p80 = q[0]
        style = _style(name)
        ax.bar(i, p50, color=style["color"], alpha=0.45 if dashed else 0.85, hatch="//" if dashed else None,
               edgecolor=style["color"])
        ax.errorbar(i, p50, yerr=[[p50 - p20], [p80 - p50]], fmt=style["marker"], color="black", capsize=4, ms=4)
        ax.annotate(f"{_ms(p50)} {unit}" if unit == "ms" else f"{p50:.0f} {unit}", (i, p80), ha="center",
                    va="bottom", fontsize=8, xytext=(0, 3), textcoords="offset points")
    ax.set_xticks(at, [label for _, label, _, _, _ in series], rotation=20 if len(series) > 5 else 0)
    ax.set_ylim(0, max(q[0][2] for *_, q, _ in series) * 1.15 if series else 1)
