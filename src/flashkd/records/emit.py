"""The bench harness's results as KernelIndex bundles, in flashkd's own protocol family.

    OperationSpec           the distillation loss's tensor signature; for jsd and cosine the very spec
                            KernelIndex holds for Liger's distill_jsd_loss / distill_cosine_loss. The
                            teacher's other forms (dense logits, top-k with its tail) and teacher_topk
                            are operations of their own: their signature and a semantics expression
    WorkloadCase            the bound case: shapes, dtype, loss options, seeded inputs (and how the
                            teacher's logits or top-k targets were made from them), and the gate's
                            policy: relative L2 error against the fp32 reference (TF32 off) within
                            protocol.tolerance (the dtype's, an FP8 teacher's own; maxRelativeError the looser one,
                            the exact pair is in metadata.description); teacher_topk: its ids up to
                            ties and its probabilities (bench.measure._gate_topk)
    ImplementationRevision  per provider (flashkd, torch = the naive formula, liger, trl); "floor" is not an
                            implementation of the loss and has no record
    BenchmarkProtocol       harness "flashkd-bench": warm-up, rep and minimum calls, quantiles, timer
                            (CUDA events via triton.testing.do_bench, or time.perf_counter per call on CPU)
    ExecutionEnvironment    the device, CUDA, torch and library versions as they are
    BenchmarkRun            status from the gate, observed errors, median latency in integer ns with p20/p80,
                            peak and extra memory in bytes (CUDA)

Every provider of one bench process shares operation, workload, protocol and environment, so their
runs fall into one comparison group. The functions read flashkd.bench's Workload and Result objects by
their attributes; this module imports nothing from the bench, which sits above the records (what both
need, the modes, quantiles and tolerances, is in records.protocol).
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
from . import liger
from .protocol import QUANTILES, applicable, tolerance
from .identity import API_VERSION, digest, js_round

HARNESS = "flashkd-bench"
COMPARATOR = "fp32_reference_relative_l2"
TOPK_COMPARATOR = "fp32_reference_topk_ids_up_to_ties"
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


# The signatures of the teacher's other forms, as liger.Kernel states Liger's: (name, shape in axis
# names, dtype; "cfg" = the case's float dtype).
_STUDENT = (("student_input", ("tokens", "student_hidden"), "cfg"),
            ("student_weight", ("vocab", "student_hidden"), "cfg"))
_TARGET = (("target", ("tokens",), "int64"),)
_LOSS = (("loss", (1,), "fp32"),)
_TOPK = (("teacher_ids", ("tokens", "k"), "int64"), ("teacher_logprobs", ("tokens", "k"), "fp32"))
_SIGNATURES = {
    "logits": (_STUDENT + (("teacher_logits", ("tokens", "vocab"), "cfg"),) + _TARGET, _LOSS),
    "topk": (_STUDENT + _TOPK + _TARGET, _LOSS),
    "teacher_topk": ((("teacher_input", ("tokens", "hidden"), "cfg"), ("teacher_weight", ("vocab", "hidden"), "cfg")),
                     (("ids", ("tokens", "k"), "int64"), ("logprobs", ("tokens", "k"), "fp32"))),
    # heads with a student of its own hidden size (a model pair), not Liger's hidden/2: student_hidden an axis
    "heads": (_STUDENT + (("teacher_input", ("tokens", "hidden"), "cfg"), ("teacher_weight", ("vocab", "hidden"), "cfg"))
              + _TARGET, _LOSS),
}
_TAIL_TEXT = {
    "bucket": "over K + 1 categories, the K teacher ids and one bucket for the rest of the vocab "
              "(p_rest = max(1 − Σ p, 0), q_rest = 1 − Σ q)",
    "renormalize": "over the K teacher ids, q and p each renormalised over them",
}


def _expression(w) -> str:
    """What the operation computes, in one line: the identity of the forms that Liger has no spec for."""
    if w.form == "teacher_topk":
        return ("ids, logprobs = topk(log_softmax((teacher_input @ teacher_weight^T) / τ), k) per row, by "
                "decreasing log-prob")
    student = "S = student_input @ student_weight^T, q = softmax(S / τ)"
    if w.form == "heads":
        soft = f"{w.loss}(q, p), p = softmax(teacher_input @ teacher_weight^T / τ)"
    elif w.form == "logits":
        soft = f"{w.loss}(q, p), p = softmax(teacher_logits / τ)"
    else:
        soft = f"{w.loss}(q, p) {_TAIL_TEXT[w.tail]}, p = exp(teacher_logprobs) at teacher_ids (−1: unused)"
    return (f"loss = (w_hard · Σ CE(S, target) + w_soft · Σ {soft}) / rows whose target is not ignore_index; "
            f"{student}; flashkd.losses")


def operation(w) -> dict:
    own_student = w.form == "heads" and w.hs != w.h // 2  # Liger's signatures derive student_hidden = hidden // 2
    kernel = None if own_student else liger.KERNELS.get(w.kernel_name)
    if kernel is not None:
        spec = liger.operation(kernel)["spec"]
    elif w.form == "heads" and not own_student:
        spec = liger.operation(liger.KERNELS["distill_jsd_loss"])["spec"]
        spec["family"] = liger.kebab(w.loss)
    else:
        inputs, outputs = _SIGNATURES[w.form]
        family = "top-k" if w.form == "teacher_topk" else liger.kebab(w.loss)
        spec = liger.operation(liger.Kernel(w.kernel_name, "", family, "", "", inputs, outputs, None))["spec"]
        spec["semantics"]["expression"] = _expression(w)
    if w.form == "teacher_topk":
        title = "A teacher's top-k log-probs"
        description = ("The k most likely ids of each row of a teacher's LM-head logits and their log-probs at "
                       "temperature τ: the targets of a top-k distillation loss.")
    else:
        teacher = {"heads": "a hidden teacher projected through its own LM head",
                   "logits": "a teacher given as precomputed dense logits",
                   "topk": f"a teacher given as its top-k ids and log-probs (tail {w.tail})"}[w.form]
        title = f"Fused linear distillation loss · {w.loss}" + ("" if w.form == "heads" else f" · {w.form} teacher")
        student = "a student of its own hidden size" if own_student else "a hidden/2 student"
        description = (f"Hard cross-entropy plus the soft {w.loss} term between {student} (through its "
                       f"LM head) and {teacher}; mean over non-ignored rows.")
    return _manifest("OperationSpec", {
        "name": liger.kebab(f"flashkd-{w.kernel_name}" + (f"-{w.tail}" if w.form == "topk" else "")
                            + ("-student-hidden" if own_student else "")),
        "title": title, "description": description,
    }, spec)


def workload(w, operation_digest: str) -> dict:
    dtype = _DTYPE_TOKENS[w.torch_dtype]
    loss_tol, grad_tol = tolerance(w)  # the gate's: the dtype's, or an FP8 teacher's

    def tensor(shape, dt, generator, **parameters):
        data = {"generator": generator, "seed": w.seed, **({"parameters": parameters} if parameters else {})}
        return {"shape": list(shape), "dtype": dt, "data": data}

    drawn = ("Inputs drawn in this order from torch.manual_seed(seed): student_input, teacher_input (torch.rand in "
             "fp32, then rounded), student_weight, teacher_weight (nn.Linear default init), target "
             "(randint(0, vocab))")
    student = {"student_input": tensor((w.n, w.hs), dtype, "torch_rand"),
               "student_weight": tensor((w.v, w.hs), dtype, "torch_linear_init")}
    teacher = {"teacher_input": tensor((w.n, w.h), dtype, "torch_rand"),
               "teacher_weight": tensor((w.v, w.h), dtype, "torch_linear_init")}
    target = {"target": tensor((w.n,), "int64", "torch_randint")}
    scalars = {
        "weight_hard_loss": {"dtype": "fp32", "value": w.weight_hard},
        "weight_soft_loss": {"dtype": "fp32", "value": w.weight_soft},
        "beta": {"dtype": "fp32", "value": w.beta},
        "temperature": {"dtype": "fp32", "value": w.temperature},
        "ignore_index": {"dtype": "int64", "value": w.ignore_index},
    }
    gate = (f"Gate: relative error against the fp32 reference (TF32 off) of the loss at most {loss_tol:g}, "
            f"of dX and dW at most {grad_tol:g}"
            + (f" (flashkd's {w.teacher_precision} teacher GEMM's tolerance)" if w.teacher_precision else "") + ". ")
    correctness = {"comparator": COMPARATOR, "maxRelativeError": max(loss_tol, grad_tol), "nanPolicy": "reject"}
    name = f"flashkd-{w.kernel_name}-hidden{w.h}-tokens{w.n}-vocab{w.v}"
    if w.form == "heads":
        axes, tensors = {"tokens": w.n, "hidden": w.h, "vocab": w.v}, {**student, **teacher, **target}
        made = "."
        if w.hs != w.h // 2:
            axes["student_hidden"] = w.hs
            name += f"-student{w.hs}"
    elif w.form == "logits":
        axes = {"tokens": w.n, "student_hidden": w.hs, "vocab": w.v}
        tensors = {**student, "teacher_logits": tensor((w.n, w.v), dtype, "teacher_input_at_teacher_weight",
                                                       hidden=w.h), **target}
        made = f"; teacher_logits = teacher_input @ teacher_weight^T in {dtype}, teacher hidden = {w.h}."
    elif w.form == "topk":
        axes = {"tokens": w.n, "student_hidden": w.hs, "vocab": w.v, "k": w.k}
        made_by = dict(hidden=w.h, temperature=w.temperature)
        tensors = {**student, "teacher_ids": tensor((w.n, w.k), "int64", "flashkd_teacher_topk", **made_by),
                   "teacher_logprobs": tensor((w.n, w.k), "fp32", "flashkd_teacher_topk", **made_by), **target}
        made = (f"; teacher_ids, teacher_logprobs = flashkd.teacher_topk(teacher_input, teacher_weight, {w.k}, "
                f"temperature={w.temperature:g}), teacher hidden = {w.h}.")
        name += f"-k{w.k}-{w.tail}"
    else:
        axes, tensors = {"tokens": w.n, "hidden": w.h, "vocab": w.v, "k": w.k}, teacher
        scalars = {"temperature": scalars["temperature"]}
        gate = (f"Gate (measure._gate_topk): ids are the fp32 reference's (TF32 off) top-k set up to ties within "
                f"{loss_tol:g} of the row's max|logit|/τ, and probabilities at them within relative L2 error "
                f"{loss_tol:g}. ")
        correctness = {"comparator": TOPK_COMPARATOR, "maxRelativeError": loss_tol, "nanPolicy": "reject"}
        made = " (the student's tensors and target are drawn and unused, so the teacher is every form's)."
        name += f"-k{w.k}"
    # Part of the case (a run without it is another case): absent when unset, so the digests of the
    # cases without it are what they always were.
    if w.softcap is not None:
        scalars["softcap"] = {"dtype": "fp32", "value": w.softcap}
        made += (f" {'The teacher' if w.form == 'teacher_topk' else 'Both heads'}' logits softcapped, c·tanh(z/c) with "
                 f"c = {w.softcap:g}"
                 + (" (the teacher's in its top-k targets)." if w.form == "topk" else "."))
        name += f"-softcap{w.softcap:g}"
    if w.teacher_precision is not None:  # its gate's tolerance is in the correctness policy
        name += f"-teacher-{w.teacher_precision}"
    return _manifest("WorkloadCase", {
        "name": liger.kebab(f"{name}-{dtype}-seed{w.seed}"),
        "title": f"{w.kernel_name} · tokens={w.n}, hidden={w.h}, vocab={w.v}"
                 + (f", k={w.k}" if w.form in ("topk", "teacher_topk") else "") + f" · {dtype}",
        "description": gate + drawn + made,
    }, {
        "operationSpecDigest": operation_digest,
        "axes": axes,
        "tensors": tensors,
        "scalars": scalars,
        "correctness": correctness,
    })


def implementation(provider: str, version: str, w, operation_digest: str, cuda: bool,
                   repository: str | None, commit: str | None) -> dict:
    ours = {"version": flashkd.__version__, **({"repository": repository} if repository else {}),
            **({"commit": commit} if commit else {})}
    if provider == "flashkd":
        title, project, licence = "flashkd", ours, "Apache-2.0"
        symbol = {"heads": "fused_linear_distill", "logits": "fused_linear_distill_logits",
                  "topk": "fused_linear_distill_topk", "teacher_topk": "teacher_topk"}[w.form]
        if w.teacher_precision is not None:  # another code path, and its own gate: part of the identity
            symbol += f"(teacher_precision={w.teacher_precision!r})"
            title += f" (teacher GEMM {w.teacher_precision})"
        callable_ = {"language": "triton" if cuda else "python", "path": "flashkd", "symbol": symbol}
        variants = None
    elif provider == "torch":
        title, project, licence = "naive PyTorch formula", ours, "Apache-2.0"
        symbol = "naive_loss" if w.has_grad else "naive_teacher_topk"
        callable_ = {"language": "python", "path": "flashkd.bench.providers", "symbol": symbol}
        variants = None
    elif provider == "liger":
        symbol = {"jsd": "jsd_loss.LigerFusedLinearJSDFunction",
                  "cosine": "cosine_similarity_loss.LigerFusedLinearCosineSimilarityFunction"}.get(w.loss)
        title, project, licence = "Liger-Kernel", {"repository": liger.LIGER_REPO_URL, "version": version}, \
            "BSD-2-Clause"
        callable_ = {"language": "python", "path": "liger_kernel.chunked_loss", **({"symbol": symbol} if symbol else {})}
        variants = [{"name": "pip-torch-compile" if cuda else "pip-eager",
                     "install": {"kind": "pip", "package": "liger-kernel", "version": version}}]
    elif provider == "trl":
        title, project, licence = "TRL", {"repository": "https://github.com/huggingface/trl", "version": version}, \
            "Apache-2.0"
        callable_ = {"language": "triton" if cuda else "python", "path": "trl.kernels.chunked_divergence",
                     "symbol": "ChunkedDivergenceFunction"}
        variants = [{"name": "pip", "install": {"kind": "pip", "package": "trl", "version": version}}]
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
    quantiles = "/".join(f"{q:g}" for q in QUANTILES)
    timed = (f"triton.testing.do_bench, rep {env['rep_ms']:g} ms raised to fit at least {env['min_reps']} calls, "
             f"gradients set to None between calls, TF32 matmul {'on' if env['tf32'] else 'off'}") if cuda else \
            (f"time.perf_counter around each call until {env['rep_ms']:g} ms and at least {env['min_reps']} calls, "
             f"{env['cpu_threads']} CPU threads")
    rounds = env.get("rounds", 1)  # a results.csv without the key was timed in one round
    if rounds > 1:
        timed += (f"; the providers timed in turn {rounds} times over (every other round reversed), "
                  "rep and calls split among the rounds, each provider's calls pooled")
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


def _run(r, mode: str, digests: dict, observed_at: str, logs: dict | None) -> dict:
    c, w = r.check, r.workload
    spec = {**{f"{k}Digest": digests[k] for k in ("implementation", "workload", "protocol", "environment")},
            "status": _STATUS.get(c.status, "runtime_error")}
    named = (("loss", c.loss_err), ("dx", c.dx_err), ("dw", c.dw_err)) if w.has_grad else (("probs", c.loss_err),)
    errors = [(name, e) for name, e in (*named, ("ids", c.ids_err)) if not math.isnan(e)]
    finite = [e for _, e in errors if math.isfinite(e)]
    if finite:
        spec["correctness"] = {"comparator": COMPARATOR if w.has_grad else TOPK_COMPARATOR,
                               "maximumRelativeError": max(finite)}
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


def bundles_from_results(results: list, env: dict, *, device: torch.device | None = None,
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
        for mode in [r.mode] if r.mode is not None else applicable(r.workload, modes):
            objects = {**shared, "protocol": protocol(mode, env, repository, commit)}
            digests = {k: digest(m) for k, m in objects.items()}
            objects["run"] = _run(r, mode, digests, observed, evidence)
            digests["run"] = digest(objects["run"])
            bundles.append({k: {"digest": digests[k], "manifest": objects[k]}
                            for k in ("operation", "workload", "implementation", "protocol", "environment", "run")})
    return bundles
