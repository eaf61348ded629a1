"""What the two TRL benchmarks (bench_trl_step.py, bench_trl_onpolicy.py) share: `datasets` or its
stand-in put in place before TRL is imported, and their clocks."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch


def import_datasets() -> str:
    """'datasets X.Y' or 'stand-in': TRL imports `datasets`; where it is missing, put the stand-in in its place."""
    try:
        import datasets
    except ImportError:
        sys.modules.pop("datasets", None)
        sys.path.insert(0, str(Path(__file__).resolve().parent / "_datasets_stub"))
        import datasets
    return "stand-in" if getattr(datasets, "STAND_IN", None) is True else f"datasets {datasets.__version__}"


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def stamp():
    """A point in time: a recorded CUDA event (read after the run, no sync now), or perf_counter on CPU."""
    if torch.cuda.is_available():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def seconds(a, b):
    return a.elapsed_time(b) / 1e3 if isinstance(a, torch.cuda.Event) else b - a


def quantile(xs, q):
    """The q-quantile of xs, linearly interpolated."""
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
