"""The command line: `flashkd bench ...` (main, the console script) and `python -m flashkd.bench ...`
(bench_main). Both return the exit status: 1 when a provider failed the gate or raised, else 0. A bad
option exits with status 2, as argparse's own usage errors do, and one line on stderr naming it.

The arguments are parsed before torch (or the records' packages) is imported: --help and a mistyped
option answer at once, and without the extras a command needs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where they are used, after the arguments are parsed
    import torch

    from . import measure
    from .workloads import Workload

# The options' vocabularies, spelled here so that parsing imports no torch; each is the library's own
# (tests/test_first_hour.py holds them equal): flashkd.losses LOSSES and TAILS, flashkd.bench.workloads
# FORMS, INPUTS, DTYPES and PRESETS, flashkd.records.protocol MODES, flashkd.fp8 PRECISIONS, and the
# providers of flashkd.bench.providers.PROVIDERS (a dict others may add to: checked against it in plan()).
LOSSES = ("jsd", "forward_kl", "reverse_kl", "tvd", "cosine", "skew_kl", "skew_reverse_kl", "akl", "jeffreys",
          "alpha_divergence", "renyi", "renyi_reverse", "ab_divergence", "triangular", "entropy_adaptive", "dkd",
          "mutual", "co_jeffreys")
TAILS = ("bucket", "renormalize")
FORMS = ("heads", "logits", "topk", "teacher_topk")
INPUTS = ("bench", "trained")
DTYPE_NAMES = ("bfloat16", "bf16", "float16", "fp16", "float32", "fp32")
PRESET_NAMES = ("logits", "models", "seed", "small", "sweep", "teacher-topk", "topk", "trained")
MODES = ("full", "forward", "backward", "no-grad-forward")
PRECISIONS = ("fp8", "fp8-rowwise", "fp8-1x128")
PROVIDER_NAMES = ("flashkd", "flashkd-triton", "flashkd-cute", "torch", "liger", "trl", "orda", "floor")

USAGE = """\
Times each provider on the same seeded inputs, after checking its loss and gradients against an fp32
reference. Writes into --out: results.csv (Liger-Kernel's 15-column schema), errors.csv, run.json,
PNG plots, the runs as KernelIndex records (records/*.json) and their static site (site/index.html,
`flashkd records site`); and prints a table with time ratios to the floor, liger and torch.

presets:
  seed          jsd N=8192 and cosine N=4096; H=4096 (student 2048), V=128256, bf16 (the default on CUDA)
  sweep         jsd N=1024 2048 4096 8192 16384; H=4096, V=128256, bf16
  topk          top-k teacher: forward_kl (soft only), K=64, tail bucket; N=8192, H=4096, V=128256, bf16
  logits        dense teacher logits: jsd, N=8192, H=4096, V=128256, bf16
  teacher-topk  teacher_topk (no gradient: no-grad-forward only), K=64; N=8192, H=4096, V=128256, bf16
  trained       exactness at a trained head's logit magnitudes (--inputs trained: std 4, every 4th row
                peaked at 32): jsd N=8192; its soft term alone N=4096; jsd N=8192 with softcap 30 on
                both heads (Gemma's); H=4096, V=128256, bf16
  models        the LM heads of model pairs people distill (Llama-3.x, Qwen3, Gemma-3, Phi, Mistral; student <-
                teacher hidden sizes and vocab of their published configs, workloads.MODEL_HEADS), every loss,
                N=8192 16384, bf16, trained-head logits (narrow it with -n and --loss)
  small         jsd and cosine N=128 256, topk forward_kl and logits jsd N=256; H=256, V=4099, fp32
                (the default on CPU)
  -n, --loss multiply the preset's workloads (--loss jsd tvd: each workload once per loss); --h, --v,
  --dtype, --beta, --form ... replace its values. On a CPU the GPU-sized presets (all but small) are
  refused unless --large-on-cpu: hours of GEMMs there; a CPU's times are wall-clock checks that
  each provider runs and is right, not a speed comparison.
  forms: heads (the teacher's hidden states and head), logits, topk (--k, --tail), teacher_topk.
  An option that no workload of the run reads (--k with --form logits) is refused, and so is a list
  option given twice (-n 1024 -n 4096: write -n 1024 4096).

examples:
  flashkd bench
  flashkd bench --preset sweep --modes full no-grad-forward
  flashkd bench -n 1024 4096 --loss jsd tvd --providers flashkd floor --out out/a
"""
DEFAULT_PROVIDERS = ("flashkd", "liger", "torch", "floor")
# Per device: (rep_ms, warmup_ms, min_reps, rounds). CUDA: long enough for a real p20–p80 spread (Liger's
# 10 ms rep times a 60 ms call once). CPU: the small preset in seconds; wall clock is noisier anyway.
# CUDA: providers in turn 5 times over, so that a drift of the clocks during a workload falls on all.
TIMING = {"cuda": (500.0, 100.0, 10, 5), "cpu": (100.0, 20.0, 5, 1)}


class UsageError(SystemExit):
    """A bad option or --out: exit status 2 (argparse's), its one-line message printed on stderr by
    main and bench_main; str() is the message."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


# The options that set a Workload's (or its LossSpec's) fields, by the field names their errors start with.
_OPTIONS = {
    "loss": "--loss", "form": "--form", "k": "--k", "tail": "--tail", "beta": "--beta", "temperature": "--temperature",
    "weight_hard": "--weight-hard", "weight_soft": "--weight-soft", "student_softcap": "--softcap",
    "teacher_softcap": "--softcap", "teacher_precision": "--teacher-precision", "seed": "--seed",
}


class _Once(argparse._StoreAction):
    """argparse's store action, refusing a list option (-n, --loss, --modes, --providers) given twice:
    argparse keeps the last list in silence, so `-n 1024 -n 4096` timed N=4096 alone and `--loss jsd
    --loss tvd` tvd alone. An option of one value given again replaces it, as in most commands (a
    script's defaults overridden after them)."""

    def __call__(self, parser, namespace, values, option_string=None):
        seen = parser.__dict__.setdefault("_stored", {})  # reset by each parse (_Parser.parse_known_args)
        if self.nargs in ("+", "*") and self.option_strings and self.dest in seen:
            first, old = seen[self.dest]
            parser.error(f"argument {'/'.join(self.option_strings)}: expected once, got {first} {' '.join(map(str, old))} "
                         f"and {option_string} {' '.join(map(str, values))}; give its values together: {first} "
                         f"{' '.join(map(str, [*old, *values]))}")
        seen[self.dest] = (option_string, values)
        super().__call__(parser, namespace, values, option_string)


class _Parser(argparse.ArgumentParser):
    """argparse's parser with its usage errors in one line, as flashkd's own are: "flashkd bench: error:
    argument --loss: invalid choice: 'foo' (choose from ...)", exit status 2, with where to look for
    the options rather than the whole usage block; a list option given twice is one (_Once). Its
    subparsers are of this class too."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("action", None, _Once)
        self.register("action", "store", _Once)

    def parse_known_args(self, args=None, namespace=None):
        self._given = list(sys.argv[1:] if args is None else args)
        self._stored = {}
        return super().parse_known_args(args, namespace)

    def error(self, message):
        # argparse checks for missing required options before it reports unknown ones: `records site x
        # --ot y` said "--out is required", where the mistyped option is what to fix
        unknown = [a for a in itertools.takewhile(lambda a: a != "--", getattr(self, "_given", ()))
                   if self._unknown_option(a)]
        if unknown and message.startswith("the following arguments are required"):
            message = f"unrecognized arguments: {' '.join(unknown)}"
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def _unknown_option(self, arg: str) -> bool:
        """Whether arg is an option this parser has none of, by its name, a unique prefix (argparse's
        abbreviations) or a short option's first two characters (-n5)."""
        if not arg.startswith("-") or arg == "-" or re.fullmatch(r"-\d*\.?\d+", arg):  # a value, not an option
            return False
        name, known = arg.split("=", 1)[0], self._option_string_actions
        return not (name in known or name[:2] in known and not name.startswith("--")
                    or name.startswith("--") and any(k.startswith(name) for k in known))


def _run(args: argparse.Namespace) -> int:
    try:
        code = args.run(args)
        sys.stdout.flush()  # here, so that a reader gone away is the BrokenPipeError below, not one at exit
        return code
    except UsageError as e:
        print(e, file=sys.stderr)
        raise
    except BrokenPipeError:  # `flashkd records compare ... | head`: the reader has what it wanted; stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor an error when Python flushes at exit
        return 1


@dataclasses.dataclass(frozen=True)
class Plan:
    preset: str
    workloads: list[Workload]
    providers: list[str]
    modes: list[str]
    settings: measure.Settings
    out: Path


def main(argv: list[str] | None = None) -> int:
    """`flashkd <command> [options]`; commands: bench."""
    parser = _Parser(prog="flashkd", description="flashkd command-line tools")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    # One subparser per command; a new command adds its parser here with set_defaults(run=...).
    bench_parser = commands.add_parser("bench", help="time and check the fused losses", description=USAGE,
                                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_arguments(bench_parser)
    bench_parser.set_defaults(run=bench)
    from ..records.cli import add_records_parser  # imports no package of the records extra

    records_parser = add_records_parser(commands)
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv == ["records"]:  # a command alone asks what it does: the help, not a usage error
        (records_parser if argv else parser).print_help()
        return 0
    return _run(parser.parse_args(argv))


def bench_main(argv: list[str] | None = None) -> int:
    """`python -m flashkd.bench [bench] [options]`: the bench command alone."""
    args = parse_bench(sys.argv[1:] if argv is None else argv)
    args.run = bench
    return _run(args)


def parse_bench(argv: list[str]) -> argparse.Namespace:
    """The bench command's options; a leading "bench" is accepted, as `flashkd bench` spells it."""
    argv = list(argv)
    if argv[:1] == ["bench"]:
        argv = argv[1:]
    parser = _Parser(prog="python -m flashkd.bench", description=USAGE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_arguments(parser)
    return parser.parse_args(argv)


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=PRESET_NAMES, help="workloads (default: seed on CUDA, small on CPU)")
    p.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda when available)")
    p.add_argument("-n", "--n", type=_positive, nargs="+", metavar="N", help="rows B·T, several allowed")
    p.add_argument("--h", type=_positive, metavar="H", help="teacher hidden size; the student's is H//2")
    p.add_argument("--v", type=_positive, metavar="V",
                   help="vocab size (a preset's K above it becomes V, as each workload's k reports; a --k given must fit)")
    p.add_argument("--dtype", choices=DTYPE_NAMES)
    p.add_argument("--loss", nargs="+", choices=LOSSES, metavar="LOSS", help=f"of {', '.join(LOSSES)}")
    p.add_argument("--form", choices=FORMS, help=f"the teacher's form, of {', '.join(FORMS)} (default: the preset's)")
    p.add_argument("--k", type=_positive, metavar="K", help="teacher ids per row (forms topk, teacher_topk)")
    p.add_argument("--tail", choices=TAILS, help="mass outside the K ids (form topk; default bucket)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), metavar="MODE",
                   help=f"of {', '.join(MODES)} (default: all)")
    p.add_argument("--providers", nargs="+", metavar="P",  # checked in plan(), against PROVIDERS as it is then
                   help=f"of {', '.join(PROVIDER_NAMES)} (default: {' '.join(DEFAULT_PROVIDERS)}, those installed); "
                        "one named here and not installed is an error")
    p.add_argument("--beta", type=_finite, help="JSD β / cosine weight (default 0.5)")
    p.add_argument("--weight-hard", type=_finite, help="weight of the CE term (default 0.5)")
    p.add_argument("--weight-soft", type=_finite, help="weight of the distillation term (default 0.5)")
    p.add_argument("--temperature", type=_finite, help="τ (default 1.0)")
    p.add_argument("--inputs", choices=INPUTS, help="bench: Liger's inputs (logits of a few tenths); trained: a trained "
                   "head's logit magnitudes, std 4 and every 4th row peaked at 32 (default: the preset's)")
    p.add_argument("--softcap", type=_finite, metavar="C", help="both heads' logit softcap, c·tanh(z/c) (default: none)")
    p.add_argument("--teacher-precision", choices=PRECISIONS,
                   help="flashkd's teacher GEMM in FP8 (forms heads, teacher_topk); other providers skip, the "
                        "floor stays bf16's (default: the inputs' dtype)")
    p.add_argument("--seed", type=_seed, help="seed of the inputs, 0 to 2^53 − 1 (default 0)")
    p.add_argument("--rep", type=_ms(0.0, "a finite number of ms above 0"), metavar="MS",
                   help="timed ms per measurement (default: 500 CUDA, 100 CPU)")
    p.add_argument("--warmup", type=_ms(None, "a finite number of ms, 0 or more"), metavar="MS",
                   help="warm-up ms (default: 100 CUDA, 20 CPU)")
    p.add_argument("--min-reps", type=_positive, metavar="K", help="at least K timed calls (default: 10 CUDA, 5 CPU)")
    p.add_argument("--rounds", type=_positive, metavar="K",
                   help="time the providers in turn K times over, pooling their calls (default: 5 CUDA, 1 CPU)")
    p.add_argument("--threads", type=_positive, metavar="K",
                   help="CPU threads for torch, at most the machine's CPUs (default: torch's; 1 is steadier on a "
                        "shared machine)")
    p.add_argument("--out", type=Path,
                   help="output folder, new or empty: a run never mixes its files with another's "
                        "(default: bench-YYYYmmdd-HHMMSS)")
    p.add_argument("--large-on-cpu", action="store_true",
                   help="run workloads sized for a GPU (presets seed, sweep, topk, logits, teacher-topk, models) on a "
                        "CPU anyway: hours; without it they are refused there")


def _int(text: str, otherwise: int) -> int:
    """`text` as an int, or `otherwise` where it is none."""
    try:
        return int(text)
    except ValueError:
        return otherwise


def _positive(text: str) -> int:
    """A positive integer that a record carries exactly (sizes are record axes): at most 2^53 − 1."""
    value = _int(text, 0)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    if value > 2**53 - 1:
        raise argparse.ArgumentTypeError(f"expected at most 2^53 - 1 (what a record carries), got {text}")
    return value


def _seed(text: str) -> int:
    """A seed that a record carries: KernelIndex's schema holds seeds in [0, 2^53 − 1]."""
    value = _int(text, -1)
    if not 0 <= value <= 2**53 - 1:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to 2^53 - 1 (what a record carries), got {text}")
    return value


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text}")
    return value


def _ms(low: float | None, expected: str):
    """An argparse type: a finite float of ms, above `low` (None: 0 or more)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or (value <= low if low is not None else value < 0):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return value
    return parse


def _device(name: str | None) -> torch.device:
    """--device as a torch.device that this machine has; UsageError with one line otherwise."""
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise UsageError(f"flashkd bench: --device: expected cpu, cuda or cuda:N, got {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise UsageError(f"flashkd bench: --device {name}: CUDA is not available ({why}); use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(f"flashkd bench: --device {name}: this machine has {torch.cuda.device_count()} CUDA "
                         f"device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return device


def _check_out(out: Path) -> None:
    """--out must be a new or empty folder that can be made and written: UsageError with one line otherwise.

    A non-empty folder is refused rather than added to: its records/ would mix the bundles of two
    runs, and its plots and CSVs would be partly overwritten.
    """
    if out.exists() and not out.is_dir():
        raise UsageError(f"flashkd bench: --out {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        raise UsageError(f"flashkd bench: --out {out}: not empty (it holds an earlier run?); "
                         "name a new folder or remove this one")
    parent = out if out.is_dir() else next((p for p in out.absolute().parents if p.exists()), None)
    if parent is None or not parent.is_dir():
        raise UsageError(f"flashkd bench: --out {out}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"flashkd bench: --out {out}: {parent} is not writable")


def plan(args: argparse.Namespace) -> Plan:
    """The run that args ask for, every option checked before anything is made: a bad option is a
    UsageError (exit status 2) with a one-line message."""
    from .. import fp8
    from . import measure
    from .providers import PROVIDERS
    from .workloads import PRESETS, default_preset, expand

    device = _device(args.device)
    if args.teacher_precision is not None:
        # flashkd's FP8 teacher needs FP8 tensor cores: said before anything runs, not as an error per workload
        if device.type != "cuda":
            raise UsageError(f"flashkd bench: --teacher-precision {args.teacher_precision}: needs a CUDA GPU with "
                             f"FP8 tensor cores (sm_89 or newer), not --device {device}")
        try:
            fp8.scaling_of(args.teacher_precision, device)
        except ValueError as e:
            raise UsageError(f"flashkd bench: --teacher-precision {args.teacher_precision}: "
                             f"{str(e).partition(': ')[2]}") from None
    preset = args.preset or default_preset(device)
    fields = {name: value for name, value in (
        ("h", args.h), ("v", args.v), ("dtype", args.dtype and _dtype_name(args.dtype)),
        ("beta", args.beta), ("weight_hard", args.weight_hard), ("weight_soft", args.weight_soft),
        ("temperature", args.temperature), ("seed", args.seed), ("form", args.form), ("k", args.k),
        ("tail", args.tail), ("softcap", args.softcap), ("teacher_precision", args.teacher_precision),
        ("inputs", args.inputs),
    ) if value is not None}
    try:  # bad options fail here, before any input is made
        workloads = expand(PRESETS[preset], n=args.n, loss=args.loss, **fields)
        for w in workloads:
            w.spec()
    except (TypeError, ValueError) as e:
        message = _named(str(e))
        if message.startswith("--loss: ") and args.loss is None:  # the preset's loss, not one the user named
            message = (f"--form {args.form}: a loss of preset {preset} is not one of this form's: "
                       f"{message.removeprefix('--loss: ')}; name the losses with --loss")
        raise UsageError(f"flashkd bench: {message}") from None
    _check_read(args, preset, workloads)
    for w in workloads:
        if w.h < 2:
            raise UsageError(f"flashkd bench: --h: expected at least 2 (the student's is H//2), got {w.h}")
    large = max(workloads, key=gemm_flops)
    if device.type == "cpu" and gemm_flops(large) > CPU_FLOPS and not args.large_on_cpu:
        # Said before anything runs: such a run printed nothing for minutes and would take hours.
        raise UsageError(
            f"flashkd bench: {large.tag} N={large.n} (H={large.h}, V={large.v}) is sized for a GPU: "
            f"{gemm_flops(large) / 1e12:.1f} TFLOP of GEMMs a call, hundreds of calls, hours on a CPU; use "
            f"--preset small there, or smaller -n/--h/--v, or --large-on-cpu to run it anyway")
    cpus = os.cpu_count() or 1
    if args.threads is not None and args.threads > cpus:  # past it the timings mean nothing, and far past it
        # OpenMP fails to make its threads and the process dies (a segfault at 100000)
        raise UsageError(f"flashkd bench: --threads: expected at most the {cpus} CPU(s) this machine has, "
                         f"got {args.threads}")
    rep, warmup, min_reps, rounds = TIMING["cuda" if device.type == "cuda" else "cpu"]
    settings = measure.Settings(
        device=device,
        rep_ms=rep if args.rep is None else args.rep,
        warmup_ms=warmup if args.warmup is None else args.warmup,
        min_reps=min_reps if args.min_reps is None else args.min_reps,
        rounds=rounds if args.rounds is None else args.rounds,
    )
    # A provider named with --providers must run: not installed, it is an error, not a row of skips. The
    # default ones that are not installed are skipped, each with its note (pip install ...) in the report.
    for name in dict.fromkeys(args.providers or ()):
        if name not in PROVIDERS:  # argparse's words, as its choices= would have said it
            raise UsageError(f"flashkd bench: error: argument --providers: invalid choice: {name!r} (choose from "
                             f"{', '.join(map(repr, PROVIDERS))})")
    for name in dict.fromkeys(args.providers or ()):
        if why := PROVIDERS[name].missing():
            raise UsageError(f"flashkd bench: --providers {name}: {why}")
    out = args.out or Path(time.strftime("bench-%Y%m%d-%H%M%S"))
    _check_out(out)
    return Plan(preset, workloads, list(dict.fromkeys(args.providers or DEFAULT_PROVIDERS)),
                list(dict.fromkeys(args.modes)), settings, out)


# A CPU run refuses (without --large-on-cpu) a workload whose GEMMs take more than this a call (seconds
# to minutes there, times the hundreds of calls of a run): the small preset's largest takes 1.3 GFLOP, the
# GPU presets' smallest (sweep, N = 1024) 2.7 TFLOP.
CPU_FLOPS = 1e12


def gemm_flops(w: Workload) -> int:
    """The flops of one full (forward + backward) call's GEMMs: the student's logits, dX and dW, and the
    teacher's logits where the teacher comes as hidden states; teacher_topk: the teacher's logits."""
    if w.form == "teacher_topk":
        return 2 * w.n * w.v * w.h
    return 2 * w.n * w.v * (3 * w.hs + (w.h if w.form == "heads" else 0))


def _check_read(args: argparse.Namespace, preset: str, workloads: list[Workload]) -> None:
    """An option that no workload of the run reads is a UsageError: Workload.canonical drops the fields a
    form does not read, so `--form logits --k 4` or `--preset teacher-topk --loss tvd` ran without it."""
    from .workloads import UNREAD

    forms = sorted({w.form for w in workloads})
    for field in ("k", "tail", "teacher_precision", "loss", "beta", "weight_hard", "weight_soft"):
        if getattr(args, field) is not None and all(field in UNREAD[form] for form in forms):
            readers = [form for form in FORMS if field not in UNREAD[form]]
            raise UsageError(f"flashkd bench: {_OPTIONS[field]}: no workload of this run reads it: it is for form(s) "
                             f"{', '.join(readers)}, and this run (preset {preset}"
                             f"{f', --form {args.form}' if args.form else ''}) has form(s) {', '.join(forms)}")


def _named(message: str) -> str:
    """A Workload's or LossSpec's error with its field named as the option that sets it."""
    field, sep, rest = message.partition(": ")
    return f"{_OPTIONS[field]}: {rest}" if sep and field in _OPTIONS else message


def _dtype_name(name: str) -> str:
    from .workloads import DTYPES

    return str(DTYPES[name]).removeprefix("torch.")


def bench(args: argparse.Namespace) -> int:
    import torch

    from . import measure, report

    p = plan(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        p.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"flashkd bench: --out {p.out}: {e.strerror or e}") from None
    env = report.environment(p.settings)
    console = _console()
    _say(console, f"flashkd bench: preset {p.preset}, {len(p.workloads)} workload(s) on {env['gpu_name']}, "
                  f"torch {env['torch']}, flashkd {env['flashkd']} -> {p.out}")
    if p.settings.device.type != "cuda":
        _say(console, "flashkd bench: on a CPU the times are wall clock on this machine: a check that every "
                      "provider runs and is right, not a speed comparison of the kernels (they are built for GPUs)")
    # What was asked and what it resolved to: enough to rerun the same measurement. The run's first
    # file, made exclusively: of two runs started into one new --out, the second stops here.
    try:
        with open(p.out / "run.json", "x") as f:
            f.write(json.dumps({
                "options": {k: v for k, v in vars(args).items() if k not in ("run", "command")},
                "preset": p.preset, "providers": p.providers, "modes": p.modes, "environment": env,
                "workloads": [{**dataclasses.asdict(w), "kernel_name": w.kernel_name} for w in p.workloads],
            }, indent=2, default=str))
    except FileExistsError:
        raise UsageError(f"flashkd bench: --out {p.out}: another run began writing into it after it was "
                         "checked; name a new folder") from None
    for tag, skipped in dict.fromkeys(
            (w.tag, tuple(m for m in p.modes if m not in measure.applicable(w, p.modes))) for w in p.workloads):
        if skipped:
            _say(console, f"{tag}: no gradient, so only no-grad-forward applies; not timed: {', '.join(skipped)}")
    total = len(p.workloads) * len(p.providers) * (1 + len(p.modes))
    with _progress(console, total, len(p.workloads)) as advance:
        results = measure.run(p.workloads, p.providers, p.modes, p.settings, advance)
    report.write_csv(results, p.out / "results.csv", env)
    report.write_errors(results, p.out / "errors.csv")
    report.print_tables(results, env, console)
    try:
        plots = report.write_plots(results, p.out, env)
    except ImportError:
        plots = []
        _say(console, "plots: skipped, matplotlib is not installed (pip install matplotlib)")
    from ..records import bundles_from_results, check_bundle, write_bundles
    from ..records.emit import harness_commit

    bundles = bundles_from_results(results, env, device=p.settings.device, commit=harness_commit(),
                                   logs=p.out / "results.csv")
    # Checked as `records verify` checks them: a record that would not verify is said and not written.
    refused = [(b, problems) for b in bundles if (problems := check_bundle(b))]
    for b, problems in refused:
        title = b.get("run", {}).get("manifest", {}).get("metadata", {}).get("title", "?")
        _say(console, f"records: not written, {title} would not verify: {problems[0]}"
                      + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    records = write_bundles([b for b in bundles if not any(b is r for r, _ in refused)], p.out / "records")
    from ..records.site import build as build_site

    # No records (nothing was timed): no site of them, rather than one listing records/ as unreadable
    site = build_site([p.out / "records"], p.out / "site") if records else None
    for x in site.rejected if site else []:  # every record was checked: a rejection is the harness's bug
        _say(console, f"site: {x.path}: not rendered: {x.problems[0]}")
    _say(console, _wrote(p.out, plots, records, site))
    bad = [r for r in results if r.check.status in ("FAILED", "error")]
    return 1 if bad or refused or (site and site.rejected) else 0


def _wrote(out: Path, plots: list[Path], records: list[Path], site) -> str:
    """The run's last line: every file written, by path (a pattern for the plots and records)."""
    kinds = sorted({p.name.split("_", 1)[0] for p in plots})
    shown = [str(out / name) for name in ("results.csv", "errors.csv", "run.json")]
    if plots:
        shown.append(f"{len(plots)} plots {' '.join(str(out / f'{k}_*.png') for k in kinds)}")
    if not records:
        return "wrote " + ", ".join(shown) + "; no KernelIndex records (nothing was timed), so no site"
    shown.append(f"{len(records)} KernelIndex records {out / 'records' / '*.json'}")
    shown.append(f"their site ({len(site.runs)} runs, {len(site.groups)} comparison groups) {out / 'site' / 'index.html'}")
    return "wrote " + ", ".join(shown)


def _console():
    try:
        from rich.console import Console
    except ImportError:
        return None
    console = Console()
    if not console.is_terminal:  # a log file: no terminal width to fit, keep each table row on one line
        console.width = max(console.width, 200)
    return console


def _say(console, text: str) -> None:
    if console is None:
        print(text)
    else:
        console.print(text, highlight=False, soft_wrap=True)  # a path is never broken across lines


@contextlib.contextmanager
def _progress(console, total: int, workloads: int):
    """Yields advance(label, steps): a rich progress bar on a terminal; elsewhere (a log file, a pipe, no
    rich) one line as each workload starts, with the steps done and the time taken so far."""
    if console is None or not console.is_terminal:
        start, done, seen = time.monotonic(), [0], []

        def advance(label: str, steps: int) -> None:
            done[0] += steps
            workload = " ".join(label.split(" ", 2)[:2])  # measure.run's labels start "<tag> N=<n>"
            if workload not in seen:
                seen.append(workload)
                elapsed = int(time.monotonic() - start)
                _say(console, f"flashkd bench: workload {len(seen)}/{workloads}, {workload} (step {done[0]} of "
                              f"{total}, {elapsed // 60}:{elapsed % 60:02d} elapsed)")
        yield advance
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("", total=total)
        yield lambda label, steps: bar.update(task, advance=steps, description=label)
