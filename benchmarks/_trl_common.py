"""What the two TRL benchmarks (bench_trl_step.py, bench_trl_onpolicy.py) share: `datasets` or its
stand-in put in place before TRL is imported, the options both take, their clocks and loss-helper
wrapping, and the stand-ins AsyncDistillationTrainer runs with in place of vLLM (which
tests/test_integrations_trl_onpolicy.py loads too). bench_verl.py and bench_axolotl.py take the clocks
and the timed forward + backward loop (`timed_steps`) from here too."""

from __future__ import annotations

import argparse
import contextlib
import queue
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers  # lazy: TrainerCallback's module neither imports `datasets` nor asks whether it is there


def import_datasets() -> str:
    """'datasets X.Y' or 'stand-in': TRL imports `datasets`; where it is missing, put the stand-in in its place."""
    try:
        import datasets
    except ImportError:
        sys.modules.pop("datasets", None)
        sys.path.insert(0, str(Path(__file__).resolve().parent / "_datasets_stub"))
        import datasets
    return "stand-in" if getattr(datasets, "STAND_IN", None) is True else f"datasets {datasets.__version__}"


def arguments(doc: str, name: str) -> argparse.ArgumentParser:
    """A parser with the options both benchmarks take (the output folder, --tiny, the models' vocab and
    depth, the sequences' lengths, warmup, seed); each adds its own. `name`: the output folder's prefix."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None,
                   help=f"folder for results.json and summary.md (default: {name}-YYYYmmdd-HHMMSS)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes in fp32 (CPU where there is no GPU): checks, not timings")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--layers", type=int, default=2, help="decoder layers of each model")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--completion-len", type=int, default=1536)
    p.add_argument("--warmup", type=int, default=3, help="untimed runs before the timed ones (steps, loss calls)")
    p.add_argument("--seed", type=int, default=0)
    return p


def parse(p: argparse.ArgumentParser, argv, tiny: dict):
    """The arguments; with --tiny, `tiny`'s values in place of every default the command line left alone, and
    args.dtype float32 (else bfloat16)."""
    args = p.parse_args(argv)
    if args.tiny:
        for name, value in tiny.items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    args.dtype = torch.float32 if args.tiny else torch.bfloat16
    return args


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


def timed_steps(step, leaves, args, device, backward=True):
    """`step(*leaves)` -> (a loss, a tensor to keep) on fresh copies of the leaves (requiring grad where
    `backward`), then the loss's backward (else the step under no_grad), args.warmup + args.reps times; the
    reps' seconds (median, p20, p80, each), the peak memory a run allocates beyond what was allocated before
    it (CUDA), and the last run's kept tensor, in float64 on the CPU. The GPU benchmarks time their variants
    with it."""
    cuda = device.type == "cuda"
    times, kept, peak = [], None, None
    for rep in range(args.warmup + args.reps):
        fresh = [t.detach().requires_grad_(backward) for t in leaves]
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        a = stamp()
        with torch.enable_grad() if backward else torch.no_grad():
            loss, keep = step(*fresh)
            if backward:
                loss.backward()
        b = stamp()
        sync()
        if cuda:
            peak = torch.cuda.max_memory_allocated() - before
        if rep >= args.warmup:
            times.append(seconds(a, b))
        kept = keep.detach().double().cpu() if isinstance(keep, torch.Tensor) else keep
        del loss, keep, fresh
    times.sort()
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
    return {"median_s": statistics.median(times), "p20_s": q(0.2), "p80_s": q(0.8), "times_s": times,
            "peak_extra_bytes": peak}, kept


def write_summary(out, title: str, table: str) -> int:
    """summary.md (the title, then the table) into out, the table printed: a benchmark's last step."""
    (out / "summary.md").write_text(f"{title}\n\n{table}\n")
    print(table)
    print(f"wrote {out}/results.json, {out}/summary.md")
    return 0


def out_dir(args, name: str) -> "Path":
    """--out, or a new bench-<name>-<timestamp>/ folder; made."""
    from pathlib import Path

    out = args.out or Path(time.strftime(f"bench-{name}-%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    return out


@contextlib.contextmanager
def wrapped(module, name: str, wrap):
    """`module.name` (TRL's loss helper: its own or, inside flashkd's patch, the patch's) replaced by
    `wrap(helper)` in the block, which is given the helper; put back however the block ends."""
    helper = getattr(module, name)
    setattr(module, name, wrap(helper))
    try:
        yield helper
    finally:
        setattr(module, name, helper)


class Clock(transformers.TrainerCallback):
    """Seconds per optimizer step (on_step_begin to on_step_end, device synchronized at both ends)."""

    def __init__(self):
        self.steps = []

    def on_step_begin(self, args, state, control, **kwargs):
        sync()
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        sync()
        self.steps.append(time.perf_counter() - self._t0)


def quantile(xs, q):
    """The q-quantile of xs, linearly interpolated."""
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# ---- AsyncDistillationTrainer without vLLM ---------------------------------------------------------------


class ServedRollouts:
    """A stand-in rollout worker (TRL's `RolloutWorkerProtocol`): pre-drawn `RolloutSample`s, served in order,
    each stamped with the trainer's current model version as it is taken."""

    def __init__(self, samples):
        worker = self

        class Served(queue.Queue):
            def get(self, block=True, timeout=None):
                sample = super().get(block, timeout)
                sample.model_version = worker.version
                return sample

        self.rollout_buffer, self.metrics_queue, self.version = Served(), queue.Queue(), 0
        for sample in samples:
            self.rollout_buffer.put_nowait(sample)

    def start(self):
        pass

    def stop(self):
        pass

    def update_model_version(self, model_version):
        self.version = model_version

    def check_health(self, stale_after_s):
        pass


class NoWeightTransfer:
    """TRL's weight transfer with no server to send to: each sync reads the weights, as a transfer does, and
    drops them."""

    def init_weight_transfer(self):
        pass

    def pause(self):
        pass

    def send_weights(self, iterator):
        for _ in iterator:
            pass

    def resume(self):
        pass

    def destroy(self):
        pass
