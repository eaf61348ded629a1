"""The bench harness's results as KernelIndex bundles, in flashkd's own protocol family.

    OperationSpec           the distillation loss's tensor signature; for jsd and cosine the very spec
                            KernelIndex holds for Liger's distill_jsd_loss / distill_cosine_loss
    WorkloadCase            the bound case: shapes, dtype, loss options, seeded inputs, and the gate's
                            policy: relative L2 error against the fp32 reference (TF32 off) within
                            measure.TOLERANCE (loss and gradients; maxRelativeError is the looser one,
                            the exact pair is in metadata.description)
    ImplementationRevision  per provider (flashkd, torch = the naive formula, liger); "floor" is not an
                            implementation of the loss and has no record
    BenchmarkProtocol       harness "flashkd-bench": warm-up, rep and minimum calls, quantiles, timer
                            (CUDA events via triton.testing.do_bench, or time.perf_counter per call on CPU)
    ExecutionEnvironment    the device, CUDA, torch and library versions as they are
    BenchmarkRun            status from the gate, observed errors, median latency in integer ns with p20/p80,
                            peak and extra memory in bytes (CUDA)

Every provider of one bench process shares operation, workload, protocol and environment, so their
runs fall into one comparison group.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import math
import os
import platform
import re
import subprocess
import time
from pathlib import Path

import torch

import flashkd
from ..bench import measure
from . import liger
from .identity import API_VERSION, digest, js_round

HARNESS = "flashkd-bench"
COMPARATOR = "fp32_reference_relative_l2"
_DTYPE_TOKENS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_STATUS = {"passed": "passed", "FAILED": "incorrect_numerical", "OOM": "resource_exceeded", "error": "runtime_error"}
_MODE_TEXT = {
    "forward": "loss = fn() with autograd recording (fused losses compute their gradients here)",
    "backward": "loss.backward(retain_graph=True) on one loss computed before timing",
    "full": "fn().backward()",
    "no-grad-forward": "fn() under torch.no_grad()",
}


def _manifest(kind, metadata, spec):
    return {"apiVersion": API_VERSION, "kind": kind, "metadata": metadata, "spec": spec}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def operation(w: measure.Workload) -> dict:
    kernel = liger.KERNELS.get(w.kernel_name)
    if kernel is not None:
        spec = liger.operation(kernel)["spec"]
    else:
        spec = liger.operation(liger.KERNELS["distill_jsd_loss"])["spec"]
        spec["family"] = liger.kebab(w.loss)
    return _manifest("OperationSpec", {
        "name": liger.kebab(f"flashkd-{w.kernel_name}"),
        "title": f"Fused linear distillation loss · {w.loss}",
        "description": f"Hard cross-entropy plus the soft {w.loss} term between a hidden/2 student and a hidden "
                       "teacher, each projected through its own LM head; mean over non-ignored rows.",
    }, spec)


def workload(w: measure.Workload, operation_digest: str) -> dict:
    dtype = _DTYPE_TOKENS[w.torch_dtype]
    loss_tol, grad_tol = measure.TOLERANCE[w.torch_dtype]

    def tensor(shape, dt, generator):
        return {"shape": list(shape), "dtype": dt, "data": {"generator": generator, "seed": w.seed}}

    return _manifest("WorkloadCase", {
        "name": liger.kebab(f"flashkd-{w.kernel_name}-hidden{w.h}-tokens{w.n}-vocab{w.v}-{dtype}-seed{w.seed}"),
        "title": f"{w.kernel_name} · tokens={w.n}, hidden={w.h}, vocab={w.v} · {dtype}",
        "description": f"Gate: relative error against the fp32 reference (TF32 off) of the loss at most {loss_tol:g}, "
                       f"of dX and dW at most {grad_tol:g}. Inputs drawn in this order from torch.manual_seed(seed): "
                       "student_input, teacher_input (torch.rand in fp32, then rounded), student_weight, "
                       "teacher_weight (nn.Linear default init), target (randint(0, vocab)).",
    }, {
        "operationSpecDigest": operation_digest,
        "axes": {"tokens": w.n, "hidden": w.h, "vocab": w.v},
        "tensors": {
            "student_input": tensor((w.n, w.hs), dtype, "torch_rand"),
            "student_weight": tensor((w.v, w.hs), dtype, "torch_linear_init"),
            "teacher_input": tensor((w.n, w.h), dtype, "torch_rand"),
            "teacher_weight": tensor((w.v, w.h), dtype, "torch_linear_init"),
            "target": tensor((w.n,), "int64", "torch_randint"),
        },
        "scalars": {
            "weight_hard_loss": {"dtype": "fp32", "value": w.weight_hard},
            "weight_soft_loss": {"dtype": "fp32", "value": w.weight_soft},
            "beta": {"dtype": "fp32", "value": w.beta},
            "temperature": {"dtype": "fp32", "value": w.temperature},
            "ignore_index": {"dtype": "int64", "value": w.ignore_index},
        },
        "correctness": {"comparator": COMPARATOR, "maxRelativeError": max(loss_tol, grad_tol),
                        "nanPolicy": "reject"},
    })


def implementation(provider: str, version: str, w: measure.Workload, operation_digest: str, cuda: bool,
                   repository: str | None, commit: str | None) -> dict:
    ours = {"version": flashkd.__version__, **({"repository": repository} if repository else {}),
            **({"commit": commit} if commit else {})}
    if provider == "flashkd":
        title, project, licence = "flashkd", ours, "Apache-2.0"
        callable_ = {"language": "triton" if cuda else "python", "path": "flashkd",
                     "symbol": "fused_linear_distill"}
        variants = None
    elif provider == "torch":
        title, project, licence = "naive PyTorch formula", ours, "Apache-2.0"
        callable_ = {"language": "python", "path": "flashkd.bench.providers", "symbol": "naive_loss"}
        variants = None
    elif provider == "liger":
        symbol = {"jsd": "jsd_loss.LigerFusedLinearJSDFunction",
                  "cosine": "cosine_similarity_loss.LigerFusedLinearCosineSimilarityFunction"}.get(w.loss)
        title, project, licence = "Liger-Kernel", {"repository": liger.LIGER_REPO_URL, "version": version}, \
            "BSD-2-Clause"
        callable_ = {"language": "python", "path": "liger_kernel.chunked_loss", **({"symbol": symbol} if symbol else {})}
        variants = [{"name": "pip-torch-compile" if cuda else "pip-eager",
                     "install": {"kind": "pip", "package": "liger-kernel", "version": version}}]
    else:
        title, project, licence = provider, {"version": version}, None
        callable_ = {"language": "python"}
        variants = None
    spec = {"projectRevision": project, "operation": {"specDigest": operation_digest}, "callable": callable_,
            "support": {"hardwareArchitectures": [], "dtypes": []}}
    if variants:
        spec["buildVariants"] = variants
    spec["licensing"] = {"declared": licence} if licence else {}
    return _manifest("ImplementationRevision", {
        "name": liger.kebab(f"flashkd-bench-{w.kernel_name}-{provider}-{version}"),
        "title": f"{w.kernel_name} · {title}",
    }, spec)


def protocol(mode: str, env: dict, repository: str | None, commit: str | None) -> dict:
    cuda = env["device"] == "cuda"
    quantiles = "/".join(f"{q:g}" for q in measure.QUANTILES)
    timed = (f"triton.testing.do_bench, rep {env['rep_ms']:g} ms raised to fit at least {env['min_reps']} calls, "
             f"gradients set to None between calls, TF32 matmul {'on' if env['tf32'] else 'off'}") if cuda else \
            (f"time.perf_counter around each call until {env['rep_ms']:g} ms and at least {env['min_reps']} calls, "
             f"{env['cpu_threads']} CPU threads")
    harness = {"name": HARNESS, "version": flashkd.__version__}
    if repository:
        harness["repository"] = repository
    if commit:
        harness["commit"] = commit
    return _manifest("BenchmarkProtocol", {
        "name": liger.kebab(f"flashkd-bench-{env['device']}-{mode}"),
        "title": f"flashkd bench · {mode} · {env['device']}",
    }, {
        "harness": harness,
        "measurement": {
            "timer": "cuda_events" if cuda else "wall_clock",
            "compileIncluded": False,  # the gate's call and the warm-up run first
            "setupIncluded": False,
            "warmupDuration": js_round(env["warmup_ms"] * 1e6),
            "inputRegeneration": "none",
            "primaryStatistic": "median",
        },
        "correctness": {"reference": "the naive formula in fp32 with TF32 off on the inputs upcast to fp32",
                        "comparator": COMPARATOR},
        "comparability": {
            "family": "flashkd_bench",
            "notes": f"Timed: {_MODE_TEXT.get(mode, mode)}; {timed}; quantiles {quantiles} (median with p20/p80). "
                     "Every provider of one process runs on the same inputs after passing the correctness gate.",
        },
    })


def _cpu_vendor() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                vendor = line.split(":", 1)[1].strip()
                return {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(vendor, liger.kebab(vendor).replace("-", "_"))
    except OSError:
        pass
    return None


def _nvidia_driver() -> str | None:
    """The NVIDIA driver version (e.g. "580.159.04"), from nvidia-smi; None where there is none."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.split()
    return lines[0] if out.returncode == 0 and lines else None


def environment(env: dict, device: torch.device | None = None) -> dict:
    cuda = env["device"] == "cuda"
    if cuda:
        index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        major, minor = torch.cuda.get_device_capability(index)
        is_hip = torch.version.hip is not None
        hardware = {"vendor": "amd" if is_hip else "nvidia", "product": env["gpu_name"],
                    "architecture": re.sub(r"[^a-z0-9_]", "_", props.gcnArchName.lower()) if is_hip
                    else f"sm_{major}{minor}",
                    "memoryBytes": props.total_memory, "count": 1}
    else:
        machine = re.sub(r"[^a-z0-9_]", "_", platform.machine().lower()) or "unknown"
        hardware = {"vendor": _cpu_vendor() or "unknown", "product": env["gpu_name"].removeprefix("CPU "),
                    "architecture": machine if machine[0].isalpha() else f"arch_{machine}"}
    software = {"operatingSystem": platform.system(), "kernel": platform.release()}
    if cuda and (driver := _nvidia_driver()) is not None:
        software["driver"] = driver
    if cuda and torch.version.cuda:
        software["cudaToolkit"] = torch.version.cuda
    software["framework"] = {"name": "pytorch", "version": torch.__version__}
    libraries = {"flashkd": flashkd.__version__}
    for package, token in (("triton", "triton"), ("liger-kernel", "liger_kernel")):
        if (v := _version(package)) is not None:
            libraries[token] = v
    software["libraries"] = libraries
    return _manifest("ExecutionEnvironment", {
        "name": liger.kebab(f"flashkd-bench-{env['gpu_name']}"), "title": f"flashkd bench host · {env['gpu_name']}",
    }, {"hardware": hardware, "software": software})


def _run(r: measure.Result, mode: str, digests: dict, observed_at: str, logs: dict | None) -> dict:
    c, w = r.check, r.workload
    spec = {**{f"{k}Digest": digests[k] for k in ("implementation", "workload", "protocol", "environment")},
            "status": _STATUS.get(c.status, "runtime_error")}
    errors = [(name, e) for name, e in (("loss", c.loss_err), ("dx", c.dx_err), ("dw", c.dw_err)) if not math.isnan(e)]
    finite = [e for _, e in errors if math.isfinite(e)]
    if finite:
        spec["correctness"] = {"comparator": COMPARATOR, "maximumRelativeError": max(finite)}
    measurements = []
    if r.speed is not None:
        p50, p20, p80 = r.speed
        spec["timing"] = {"primaryStatistic": "median", "latencyNs": {"median": js_round(p50 * 1e6)}}
        measurements += [{"metric": "latency", "unit": "ns", "statistic": s, "value": js_round(v * 1e6)}
                         for s, v in (("p20", p20), ("p80", p80))]
    for metric, values in (("peak_memory_allocated", r.peak), ("extra_memory_allocated", r.extra)):
        if values is not None:
            measurements += [{"metric": metric, "unit": "bytes", "statistic": s, "value": js_round(v * 2**20)}
                             for s, v in zip(("median", "p20", "p80"), values)]
    measurements += [{"metric": f"{name}_relative_error", "unit": "ratio", "statistic": "observed", "value": e}
                     for name, e in errors if math.isfinite(e)]
    if measurements:
        spec["measurements"] = measurements
    if logs:
        spec["evidence"] = {"logs": logs}
    spec["observedAt"] = observed_at
    stamp = r.timestamp or observed_at
    return _manifest("BenchmarkRun", {
        "name": liger.kebab(f"flashkd-bench-{w.kernel_name}-{mode}-{r.provider}-n{w.n}-{stamp}"),
        "title": f"{w.kernel_name} · {r.provider} · {mode} · N={w.n}",
        **({"description": c.note[:2000]} if c.note else {}),
    }, spec)


def harness_commit() -> str | None:
    """The git commit of flashkd's source tree when the package's files are all committed; where the tree is not a git
    checkout at all (a copy), $FLASHKD_COMMIT when it holds a full commit; else None."""
    root = Path(flashkd.__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=root,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        commit = dirty = None
    if commit is None or commit.returncode != 0:
        sha = os.environ.get("FLASHKD_COMMIT", "")
        return sha if re.fullmatch(r"[0-9a-f]{40}", sha) else None
    sha = commit.stdout.strip()
    ok = dirty.returncode == 0 and not dirty.stdout.strip()
    return sha if ok and re.fullmatch(r"[0-9a-f]{40}", sha) else None


def _artifact(path: Path) -> dict:
    return {"uri": path.name, "digest": "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()}


def bundles_from_results(results: list[measure.Result], env: dict, *, device: torch.device | None = None,
                         repository: str | None = None, commit: str | None = None,
                         logs: Path | None = None) -> list[dict]:
    """One bundle per (workload, provider, mode) of `results`; `env` is report.environment(settings).

    A provider that failed the gate (untimed) gets a run per mode measured in `results`, without
    timing. Providers whose value is not a loss ("unchecked", e.g. floor) and skipped providers get
    none. `repository` (https) and `commit` (40 hex) name the harness's source when known; `logs`
    is a file (results.csv, a log) cited by digest as evidence.
    """
    modes = list(dict.fromkeys(r.mode for r in results if r.mode is not None))
    environment_m = environment(env, device)
    evidence = _artifact(Path(logs)) if logs else None
    now = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())
    bundles = []
    for r in results:
        if r.check.status in ("unchecked", "skipped"):
            continue
        op = operation(r.workload)
        op_digest = digest(op)
        shared = {
            "operation": op,
            "workload": workload(r.workload, op_digest),
            "implementation": implementation(r.provider, r.version, r.workload, op_digest, env["device"] == "cuda",
                                             repository, commit),
            "environment": environment_m,
        }
        observed = liger.utc_instant(r.timestamp) if r.timestamp else now
        for mode in [r.mode] if r.mode is not None else modes:
            objects = {**shared, "protocol": protocol(mode, env, repository, commit)}
            digests = {k: digest(m) for k, m in objects.items()}
            objects["run"] = _run(r, mode, digests, observed, evidence)
            digests["run"] = digest(objects["run"])
            bundles.append({k: {"digest": digests[k], "manifest": objects[k]}
                            for k in ("operation", "workload", "implementation", "protocol", "environment", "run")})
    return bundles
