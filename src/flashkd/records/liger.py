"""Liger-Kernel benchmark CSV rows -> KernelIndex bundles, as KernelIndex's Liger importer maps them.

One speed row becomes six manifests:
    OperationSpec           per kernel: the module's tensor signature (axes, inputs, outputs)
    WorkloadCase            per (kernel, bound axes, dtype): concrete shapes, scalars, no asserted correctness
    ImplementationRevision  per (kernel, provider)
    BenchmarkProtocol       per timed pass (forward, backward, full): triton do_bench, median primary
    ExecutionEnvironment    per GPU name: hardware only (the CSV records no driver, CUDA or torch version)
    BenchmarkRun            the row: median (and p20/p80) in integer ns, the CSV values in sourceNative,
                            the CSV timestamp read as UTC, liger_version in metadata.labels

Rows KernelIndex does not import are skipped with a reason: memory rows, kernels outside the curated
set below, unknown providers, GPUs or passes, and config shapes a kernel's binder does not recognise;
so is a row whose bundle `flashkd records verify` would refuse (verify.check_bundle runs on every
bundle before it is returned), e.g. a number outside JSON's safe range or an over-long version.

`bundled_csv()` is Liger-Kernel's published benchmark data for the kernels mapped here, shipped in
data/ (BSD-2-Clause: Liger-Kernel's copyright and licence notice is data/LICENSE.liger-kernel, where
data/NOTICE says where the rows come from).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import sys
import re
from datetime import datetime, timezone
from typing import Callable

from .identity import API_VERSION, MAX_SAFE_INTEGER, digest, js_round
from .verify import check_bundle

LIGER_REPO_URL = "https://github.com/linkedin/Liger-Kernel"
SOURCE = "liger-kernel-bench"
# The Liger-Kernel commit whose benchmark scripts the OperationSpecs cite (metadata only).
LIGER_COMMIT = "ead96b618e5c67bddc6a6e9bcb99bfe6b5ab661c"
COLUMNS = ("kernel_name", "kernel_provider", "kernel_operation_mode", "metric_name", "metric_unit", "x_name",
           "x_label", "x_value", "y_value_50", "y_value_20", "y_value_80", "extra_benchmark_config_str",
           "gpu_name", "timestamp", "liger_version")
DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}
MODES = {
    "forward": "the module forward pass",
    "backward": "the backward pass of the module output given a random upstream gradient",
    "full": "the forward pass plus the backward pass",
}
HARDWARE = {
    "NVIDIA A100-SXM4-80GB": {"vendor": "nvidia", "product": "NVIDIA A100", "architecture": "sm_80",
                              "formFactor": "SXM4-80GB"},
    "NVIDIA H100 80GB HBM3": {"vendor": "nvidia", "product": "NVIDIA H100", "architecture": "sm_90",
                              "formFactor": "80GB HBM3"},
    "NVIDIA H100 PCIe": {"vendor": "nvidia", "product": "NVIDIA H100", "architecture": "sm_90", "formFactor": "PCIe"},
    "NVIDIA B200": {"vendor": "nvidia", "product": "NVIDIA B200", "architecture": "sm_100"},
    "NVIDIA GeForce RTX 3090": {"vendor": "nvidia", "product": "NVIDIA GeForce RTX 3090", "architecture": "sm_86"},
    "NVIDIA GeForce RTX 4090": {"vendor": "nvidia", "product": "NVIDIA GeForce RTX 4090", "architecture": "sm_89"},
}


@dataclasses.dataclass(frozen=True)
class Provider:
    title: str
    language: str
    description: str
    declared: str
    concluded: str | None = None
    pip_package: str | None = None
    role: str | None = None


_LIGER = dict(language="triton", declared="BSD-2-Clause", concluded="BSD-2-Clause", pip_package="liger-kernel")
PROVIDERS = {
    "liger": Provider("Liger", description="Liger-Kernel Triton implementation.", **_LIGER),
    "torch": Provider("PyTorch", "python", "PyTorch reference module.", "BSD-3-Clause", role="baseline"),
    "torch_compile": Provider("torch.compile", "python", "PyTorch reference module compiled with torch.compile.",
                              "BSD-3-Clause"),
    "huggingface": Provider("Transformers", "python", "Hugging Face Transformers reference module.", "Apache-2.0",
                            role="baseline"),
}


@dataclasses.dataclass(frozen=True)
class Binding:
    axes: dict  # concrete integer axes, in the order the kernel binds them
    dtype: str  # the float dtype token of the "cfg" tensors
    scalars: dict | None = None


@dataclasses.dataclass(frozen=True)
class Kernel:
    csv_name: str
    slug: str
    family: str
    title: str
    description: str
    inputs: tuple  # (name, shape, dtype); a shape entry is an axis name or an int; dtype "cfg" = the case's dtype
    outputs: tuple
    bind: Callable[[int, str, dict], Binding | None]
    derived: dict = dataclasses.field(default_factory=dict)  # axis -> expression over the bound axes


def _int(value):
    """A positive integer JSON number that JSON carries exactly (at most 2^53 − 1), else None (JSON
    true is not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value) if float(value).is_integer() and 0 < value <= MAX_SAFE_INTEGER else None


def _number(value) -> bool:
    """A finite JSON number (json.loads reads 1e400 as inf, which JSON cannot write back)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return abs(value) <= sys.float_info.max  # math.isfinite of a larger int raises OverflowError
    return isinstance(value, float) and math.isfinite(value)


def _bind_jsd(x, x_name, config):
    if x_name == "V":
        batch, seq = _int(config.get("B")), _int(config.get("T"))
        return Binding({"tokens": batch * seq, "vocab": x}, "fp32") if batch and seq else None
    if x_name == "BT":
        vocab = _int(config.get("vocab_size"))
        return Binding({"tokens": x, "vocab": vocab}, "fp32") if vocab else None
    return None


def _bind_fused_linear_jsd(x, x_name, config):
    hidden, vocab, dtype = _int(config.get("H")), _int(config.get("V")), DTYPES.get(config.get("dtype"))
    if not hidden or not vocab or not dtype or x_name != "BT":
        return None
    return Binding({"tokens": x, "hidden": hidden, "vocab": vocab}, dtype, {"beta": 0.5})


def _bind_distill(x, x_name, config):
    hidden, vocab, dtype = _int(config.get("H")), _int(config.get("V")), DTYPES.get(config.get("dtype"))
    hard, soft = config.get("weight_hard_loss"), config.get("weight_soft_loss")
    if not hidden or not vocab or not dtype or x_name != "BT":
        return None
    if config.get("bias") is not False or hidden % 2 != 0:
        return None
    if not _number(hard) or not _number(soft):
        return None
    return Binding({"tokens": x, "hidden": hidden, "vocab": vocab}, dtype,
                   {"weight_hard_loss": hard, "weight_soft_loss": soft})


_DISTILL_INPUTS = (
    ("student_input", ("tokens", "student_hidden"), "cfg"),
    ("student_weight", ("vocab", "student_hidden"), "cfg"),
    ("teacher_input", ("tokens", "hidden"), "cfg"),
    ("teacher_weight", ("vocab", "hidden"), "cfg"),
    ("target", ("tokens",), "int64"),
)
_LOSS_OUTPUT = (("loss", (1,), "cfg"),)

KERNELS = {k.csv_name: k for k in (
    Kernel(
        "jsd", "liger-jsd", "jsd", "Jensen-Shannon divergence loss",
        "Generalized JSD between student and teacher log-probabilities over tokens×vocab; the benchmark "
        "generates fp32 log-probs.",
        (("student_log_probs", ("tokens", "vocab"), "cfg"), ("teacher_log_probs", ("tokens", "vocab"), "cfg")),
        _LOSS_OUTPUT, _bind_jsd),
    Kernel(
        "fused_linear_jsd", "liger-fused-linear-jsd", "jsd", "Fused linear + JSD",
        "Student and teacher tokens×hidden activations projected through separate vocab×hidden heads fused with "
        "generalized JSD (beta 0.5, batchmean) between the resulting log-distributions.",
        (("student_input", ("tokens", "hidden"), "cfg"), ("student_weight", ("vocab", "hidden"), "cfg"),
         ("teacher_input", ("tokens", "hidden"), "cfg"), ("teacher_weight", ("vocab", "hidden"), "cfg")),
        _LOSS_OUTPUT, _bind_fused_linear_jsd),
    Kernel(
        "distill_jsd_loss", "liger-distill-jsd-loss", "jsd", "Chunked distillation JSD loss",
        "Distillation loss combining hard cross-entropy and soft JSD between a hidden/2 student and a hidden "
        "teacher, each projected through its own LM head (equal hard/soft weights).",
        _DISTILL_INPUTS, _LOSS_OUTPUT, _bind_distill, {"student_hidden": "hidden // 2"}),
    Kernel(
        "distill_cosine_loss", "liger-distill-cosine-loss", "cosine-similarity-loss",
        "Chunked distillation cosine loss",
        "Distillation loss combining hard cross-entropy and a soft cosine-similarity term between a hidden/2 "
        "student and a hidden teacher, each projected through its own LM head (equal hard/soft weights).",
        _DISTILL_INPUTS, _LOSS_OUTPUT, _bind_distill, {"student_hidden": "hidden // 2"}),
)}


def kebab(text: str) -> str:
    """A manifest name: lower-case words joined by '-', at most 100 characters."""
    return _slug(text)[:100]


def _slug(text: str) -> str:
    return re.sub(r"^-+|-+$", "", re.sub(r"[^a-z0-9]+", "-", text.lower()))


def utc_instant(timestamp: str) -> str:
    """"2024-12-03 07:58:46" (UTC by convention) -> "2024-12-03T07:58:46.000Z"."""
    t = datetime.fromisoformat(timestamp.replace(" ", "T").replace("Z", "+00:00").replace("z", "+00:00"))
    t = (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).astimezone(timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def evaluate(expression: str, axes: dict) -> int:
    """A derived-axis expression: integers, axis names, + - * % //, parentheses."""
    tokens = re.findall(r"\d+|[a-z_][a-z0-9_]*|//|[+\-*%()]", expression)
    at = 0

    def factor():
        nonlocal at
        token = tokens[at]
        at += 1
        if token == "(":
            value = total()
            at += 1  # ")"
            return value
        return int(token) if token.isdigit() else axes[token]

    def product():
        nonlocal at
        value = factor()
        while at < len(tokens) and tokens[at] in ("*", "//", "%"):
            op = tokens[at]
            at += 1
            rhs = factor()
            value = value * rhs if op == "*" else value % rhs if op == "%" else value // rhs
        return value

    def total():
        nonlocal at
        value = product()
        while at < len(tokens) and tokens[at] in ("+", "-"):
            op = tokens[at]
            at += 1
            rhs = product()
            value = value + rhs if op == "+" else value - rhs
        return value

    return total()


def _js_number(text: str) -> float:
    """JavaScript's Number(text) for the decimal spellings a CSV holds; NaN where it is not one."""
    text = text.strip()
    if text == "":
        return 0.0
    if not re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|[+-]?Infinity", text):
        return math.nan
    return float(text.replace("Infinity", "inf"))


def case_key(binding: Binding) -> str:
    return "-".join(f"{axis}{value}" for axis, value in sorted(binding.axes.items())) + f"-{binding.dtype}"


def _manifest(kind, metadata, spec):
    return {"apiVersion": API_VERSION, "kind": kind, "metadata": metadata, "spec": spec}


def operation(kernel: Kernel, commit: str = LIGER_COMMIT) -> dict:
    names = [d for _, shape, _ in kernel.inputs + kernel.outputs for d in shape
             if isinstance(d, str) and d not in kernel.derived]
    axes = {name: {"role": "variable", "type": "integer"} for name in dict.fromkeys(names)}
    axes.update({name: {"role": "derived", "type": "integer", "expression": e} for name, e in kernel.derived.items()})

    def arguments(entries):  # "cfg" tensors take the case's float dtype: the signature says "float"
        return [{"name": name, "tensor": {"shape": list(shape), "dtype": "float" if dtype == "cfg" else dtype}}
                for name, shape, dtype in entries]

    return _manifest("OperationSpec", {
        "name": kernel.slug, "title": kernel.title, "description": kernel.description,
        "sourceRefs": [{"url": f"{LIGER_REPO_URL}/blob/{commit}/benchmark/scripts/benchmark_{kernel.csv_name}.py"}],
    }, {
        "family": kernel.family, "axes": axes, "inputs": arguments(kernel.inputs),
        "outputs": arguments(kernel.outputs), "semantics": {"mutation": "none", "determinism": "unspecified"},
    })


def workload(kernel: Kernel, operation_digest: str, binding: Binding) -> dict:
    bound = dict(binding.axes)
    for name, expression in kernel.derived.items():
        bound[name] = evaluate(expression, bound)
    spec = {
        "operationSpecDigest": operation_digest,
        "axes": dict(binding.axes),
        "tensors": {name: {"shape": [d if isinstance(d, int) else bound[d] for d in shape],
                           "dtype": binding.dtype if dtype == "cfg" else dtype}
                    for name, shape, dtype in kernel.inputs},
    }
    if binding.scalars:
        spec["scalars"] = {name: {"dtype": "fp32", "value": v} for name, v in binding.scalars.items()}
    spec["correctness"] = {"comparator": "not_asserted"}  # the benchmark scripts assert nothing per run
    axes = ", ".join(f"{a}={v}" for a, v in binding.axes.items())
    return _manifest("WorkloadCase", {
        "name": kebab(f"{kernel.slug}-{case_key(binding)}"), "title": f"{kernel.title} · {axes} · {binding.dtype}",
    }, spec)


def implementation(kernel: Kernel, provider: str, operation_digest: str) -> dict:
    p = PROVIDERS[provider]
    metadata = {"name": kebab(f"liger-bench-{kernel.csv_name}-{provider}"), "title": f"{kernel.title} · {p.title}",
                "description": p.description}
    if p.role:
        metadata["labels"] = {"role": p.role}
    metadata["sourceRefs"] = [{"url": LIGER_REPO_URL}]
    spec = {
        "projectRevision": {},
        "operation": {"specDigest": operation_digest},
        "callable": {"language": p.language},
        "support": {"hardwareArchitectures": [], "dtypes": []},
    }
    if p.pip_package:
        spec["buildVariants"] = [{"name": "pip", "install": {"kind": "pip", "package": p.pip_package}}]
    spec["licensing"] = {"declared": p.declared, **({"concluded": p.concluded} if p.concluded else {})}
    return _manifest("ImplementationRevision", metadata, spec)


def protocol(mode: str) -> dict:
    return _manifest("BenchmarkProtocol", {
        "name": kebab(f"liger-bench-do-bench-{mode}"), "title": f"Liger benchmark harness · {mode} pass",
    }, {
        "harness": {"name": "Liger-Kernel benchmark scripts", "repository": LIGER_REPO_URL},
        "measurement": {"timer": "cuda_events", "primaryStatistic": "median"},
        "comparability": {
            "family": "liger_kernel_bench",
            "notes": f"Timed: {MODES.get(mode, mode)}, via triton.testing.do_bench with quantiles 0.5/0.2/0.8 "
                     "(median with p20/p80 spread). The upstream CSV records no CUDA, driver, or torch version; the "
                     "Liger release rides each run's labels. Comparable only within one kernel, workload, timed "
                     "pass, and GPU.",
        },
    })


def environment(gpu_name: str) -> dict:
    return _manifest("ExecutionEnvironment", {
        "name": kebab(f"liger-bench-{gpu_name}"),
        "title": f"Liger benchmark host · {re.sub(r'^NVIDIA ', '', gpu_name)}",
    }, {"hardware": dict(HARDWARE[gpu_name]), "software": {}})


def run(row: dict, kernel: Kernel, binding: Binding, digests: dict) -> dict:
    ms50, ms20, ms80 = (_js_number(row[c]) for c in ("y_value_50", "y_value_20", "y_value_80"))
    if not (math.isfinite(ms50) and ms50 > 0):
        raise Skipped("invalid median: expected a positive finite number of ms")
    if max(ms50, *(v for v in (ms20, ms80) if math.isfinite(v))) * 1e6 > MAX_SAFE_INTEGER:
        raise Skipped("latency over 2^53 − 1 ns, JSON's safe integer range")
    spread = math.isfinite(ms20) and math.isfinite(ms80)
    mode, provider, gpu, stamp = (row[c] for c in ("kernel_operation_mode", "kernel_provider", "gpu_name",
                                                    "timestamp"))
    key = case_key(binding)
    spec = {
        "implementationDigest": digests["implementation"],
        "workloadDigest": digests["workload"],
        "protocolDigest": digests["protocol"],
        "environmentDigest": digests["environment"],
        "status": "passed",
        "timing": {"primaryStatistic": "median", "latencyNs": {"median": js_round(ms50 * 1e6)}},
    }
    if spread:
        spec["measurements"] = [{"metric": "latency", "unit": "ns", "statistic": s, "value": js_round(v * 1e6)}
                                for s, v in (("p20", ms20), ("p80", ms80))]
    spec["sourceNative"] = {
        "source": SOURCE,
        "benchmark": f"{kernel.csv_name}/{mode}",
        "externalId": "/".join((kernel.csv_name, mode, provider, kebab(gpu), key, kebab(stamp))),
        "metrics": {"ms_50": ms50, **({"ms_20": ms20, "ms_80": ms80} if spread else {})},
    }
    spec["observedAt"] = utc_instant(stamp)
    return _manifest("BenchmarkRun", {
        "name": kebab(f"liger-{kernel.csv_name}-{mode}-{provider}-{gpu}-{key}-{stamp}"),
        "title": f"{kernel.title} · {provider} · {mode}",
        "labels": {"liger_version": row["liger_version"]},
    }, spec)


class Skipped(Exception):
    """A row KernelIndex does not import; the message says why, in one line, the same for every row
    skipped for that reason (so that a summary can count them), never quoting a whole row."""


def bundle_from_row(row: dict, commit: str = LIGER_COMMIT) -> dict:
    """The six {digest, manifest} objects of one CSV row (a dict keyed by COLUMNS); raises Skipped."""
    if row["metric_name"] != "speed":
        raise Skipped(f"{row['metric_name']} row: only speed rows are imported")
    kernel = KERNELS.get(row["kernel_name"])
    if kernel is None:
        raise Skipped(f"kernel '{row['kernel_name']}' is not among the mapped kernels ({', '.join(KERNELS)})")
    if row["kernel_operation_mode"] not in MODES:
        raise Skipped(f"unknown timed pass '{row['kernel_operation_mode']}' (known: {', '.join(MODES)})")
    if row["kernel_provider"] not in PROVIDERS:
        raise Skipped(f"unknown provider '{row['kernel_provider']}' (known: {', '.join(PROVIDERS)})")
    x = _js_number(row["x_value"])
    try:
        config = json.loads(row["extra_benchmark_config_str"], parse_constant=_reject)
    except ValueError:
        raise Skipped("extra_benchmark_config_str is not JSON") from None
    except RecursionError:
        raise Skipped("extra_benchmark_config_str is nested too deeply") from None
    binding = None
    if isinstance(config, dict) and _int(x):
        binding = kernel.bind(int(x), row["x_name"], config)
    if binding is None:
        raise Skipped(f"x_value or config not understood for {kernel.csv_name} with x_name {row['x_name']!r}")
    if row["gpu_name"] not in HARDWARE:
        raise Skipped(f"unknown GPU '{row['gpu_name']}'")
    try:
        utc_instant(row["timestamp"])
    except ValueError:
        raise Skipped("timestamp not understood (expected 'YYYY-MM-DD HH:MM:SS', UTC)") from None
    out = {"operation": operation(kernel, commit)}
    try:  # rfc8785 refuses integers past 2^53 − 1 and non-finite floats (ValueErrors) that got this far
        op = digest(out["operation"])
        out["workload"] = workload(kernel, op, binding)
        out["implementation"] = implementation(kernel, row["kernel_provider"], op)
        out["protocol"] = protocol(row["kernel_operation_mode"])
        out["environment"] = environment(row["gpu_name"])
        digests = {name: digest(m) for name, m in out.items()}
        out["run"] = run(row, kernel, binding, digests)
        digests["run"] = digest(out["run"])
    except ValueError:
        raise Skipped("a number outside what JSON carries exactly (integers up to 2^53 − 1, finite floats)") from None
    bundle = {name: {"digest": digests[name], "manifest": m} for name, m in out.items()}
    problems = check_bundle(bundle)  # never hand on what `records verify` refuses
    if problems:
        raise Skipped(f"its bundle would not verify: {_short(problems[0])}")
    return bundle


def _short(problem: str) -> str:
    """A verify problem with long quoted values cut, so that rows skipped for one reason read alike."""
    return re.sub(r"'([^']{24})[^']{8,}'", r"'\1…'", problem)[:300]


def _reject(constant):
    raise ValueError(f"{constant} is not JSON")


BUNDLED_CSV = "data/liger_distill_benchmark_rows.csv"


def bundled_csv() -> str:
    """The text of Liger-Kernel's published benchmark rows shipped with flashkd (see data/NOTICE)."""
    from importlib import resources

    return resources.files(__package__).joinpath(BUNDLED_CSV).read_text("utf-8")


def read_rows(text: str) -> list[dict]:
    """CSV text -> rows keyed by COLUMNS; raises ValueError when the text is empty, or a column is
    missing or named twice (a row would give one of its two values and drop the other). A leading
    byte-order mark (spreadsheets write one) is not part of the first column's name."""
    reader = csv.DictReader(io.StringIO(text.removeprefix("\ufeff"), newline=""))
    if not reader.fieldnames:
        raise ValueError("empty: expected a header row of the 15 columns")
    missing = [c for c in COLUMNS if c not in reader.fieldnames]
    if missing:
        raise ValueError(f"missing column(s): {', '.join(missing)}")
    twice = [c for c in dict.fromkeys(reader.fieldnames) if reader.fieldnames.count(c) > 1]
    if twice:
        raise ValueError(f"column(s) named twice in the header: {', '.join(twice)}")
    return list(reader)


def import_rows(rows: list[dict], commit: str = LIGER_COMMIT):
    """Yields (line number, bundle or None, skip reason or None) per row; a row whose run repeats an
    earlier row's externalId is skipped as a duplicate."""
    seen = set()
    for line, row in enumerate(rows, start=2):
        if None in row or any(row.get(c) is None for c in COLUMNS):
            yield line, None, f"expected {len(COLUMNS)} fields"
            continue
        try:
            bundle = bundle_from_row(row, commit)
        except Skipped as e:
            yield line, None, str(e)
            continue
        external = bundle["run"]["manifest"]["spec"]["sourceNative"]["externalId"]
        if external in seen:
            yield line, None, "duplicate of an earlier row (same kernel, pass, provider, GPU, case and timestamp)"
            continue
        seen.add(external)
        yield line, bundle, None


def bundle_filename(bundle: dict) -> str:
    """The source's external id when the run has one, else the run's name and digest."""
    run = bundle["run"]
    native = run["manifest"]["spec"].get("sourceNative")
    stem = native["externalId"] if native and "externalId" in native else \
        f"{run['manifest']['metadata']['name']}-{run['digest'].removeprefix('sha256:')[:12]}"
    return _slug(stem) + ".json"
