"""Identity of a KernelIndex manifest: canonical JSON, content digests and the comparison key.

    digest(m)          = "sha256:" + hex(sha256(JCS({apiVersion, kind, spec: normalize(kind, spec)})))
    correctness_key(w) = "sha256:" + hex(sha256(JCS({"correctness": w.spec.correctness})))
    comparison_key     = "sha256:" + hex(sha256(JCS({"v": 1, "operation", "workload", "protocol",
                                                   "environment", "correctness", "metric"})))

JCS is RFC 8785: keys sorted by UTF-16 code units, no whitespace, numbers spelled as ECMAScript
spells them (1.0 -> 1, 1e-06 -> 0.000001). `metadata` is editorial and never part of a digest.

normalize is what KernelIndex's schema parser does to a spec before hashing it:
    durations           "0.008 ms" -> 8000 (integer ns; a value that is not a whole ns is rejected)
    set-like lists      ImplementationRevision.spec.support.* sorted and de-duplicated
    optional fields     a key whose value is None is absent
The implementation is not part of the comparison key: a comparison group holds the implementations
of one workload, timed one way, on one environment.
"""

from __future__ import annotations

import hashlib
import math
import re

import rfc8785

API_VERSION = "kernelindex.dev/v1alpha1"
KINDS = ("OperationSpec", "WorkloadCase", "ImplementationRevision", "BenchmarkProtocol",
         "ExecutionEnvironment", "BenchmarkRun")

_DURATION = re.compile(r"^([0-9]+(?:\.[0-9]+)?)\s?(ns|us|µs|ms|s)$")
_NS_PER = {"ns": 1, "us": 1e3, "µs": 1e3, "ms": 1e6, "s": 1e9}
MAX_SAFE_INTEGER = 2**53 - 1
_LATENCY_FIELDS = ("median", "mean", "p05", "p95", "minimum", "maximum", "mad")
_SET_LIKE = ("hardwareArchitectures", "productsTested", "axes", "dtypes", "layouts")


def canonical_json(value) -> str:
    """RFC 8785 canonical JSON of a JSON value (dicts, lists, str, int, float, bool, None)."""
    return rfc8785.dumps(value).decode("utf-8")


def sha256_digest(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def duration_ns(value) -> int:
    """An integer ns count, or a string such as "0.008 ms", as integer nanoseconds."""
    if isinstance(value, bool):
        raise ValueError(f"duration: expected integer ns or '<number> ns|us|ms|s', got {value!r}")
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        if value < 0:
            raise ValueError(f"duration: negative {value!r}")
        return int(value)
    match = _DURATION.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"duration: expected integer ns or '<number> ns|us|ms|s', got {value!r}")
    ns = float(match.group(1)) * _NS_PER[match.group(2)]
    if not (ns.is_integer() and ns <= MAX_SAFE_INTEGER):
        raise ValueError(f"ambiguous duration: {value} is not an integer nanosecond count")
    return int(ns)


def _drop_none(value):
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def _utf16_key(text: str) -> bytes:
    return text.encode("utf-16-be")  # JavaScript's string order: UTF-16 code units


def normalize(kind: str, spec: dict) -> dict:
    """The spec as KernelIndex hashes it (see the module docstring). The input is not modified."""
    spec = _drop_none(spec)
    if kind == "BenchmarkProtocol":
        measurement = spec.get("measurement")
        if isinstance(measurement, dict) and "warmupDuration" in measurement:
            measurement["warmupDuration"] = duration_ns(measurement["warmupDuration"])
    elif kind == "BenchmarkRun":
        latency = (spec.get("timing") or {}).get("latencyNs") if isinstance(spec.get("timing"), dict) else None
        if isinstance(latency, dict):
            for name in _LATENCY_FIELDS:
                if name in latency:
                    latency[name] = duration_ns(latency[name])
            if isinstance(latency.get("confidence95"), list):
                latency["confidence95"] = [duration_ns(v) for v in latency["confidence95"]]
    elif kind == "ImplementationRevision":
        support = spec.get("support")
        if isinstance(support, dict):
            for name in _SET_LIKE:
                if isinstance(support.get(name), list):
                    support[name] = sorted(set(support[name]), key=_utf16_key)
    return spec


def canonical_identity(manifest: dict) -> str:
    """The canonical JSON that a manifest's digest hashes: apiVersion, kind and the normalised spec."""
    kind = manifest["kind"]
    return canonical_json({"apiVersion": manifest["apiVersion"], "kind": kind,
                           "spec": normalize(kind, manifest["spec"])})


def digest(manifest: dict) -> str:
    """KernelIndex's content digest of a manifest, "sha256:<64 hex>"."""
    return sha256_digest(canonical_identity(manifest))


def correctness_key(workload: dict) -> str:
    """Key of a WorkloadCase's correctness policy (its spec.correctness)."""
    return sha256_digest(canonical_json({"correctness": _drop_none(workload["spec"]["correctness"])}))


def primary(run: dict) -> tuple[str, float] | None:
    """(metric key, value) of a run's primary result: its central latency, else its first
    measurement; None when it has neither."""
    spec = run["spec"]
    timing = spec.get("timing")
    if timing:
        latency = normalize("BenchmarkRun", spec)["timing"]["latencyNs"]
        first, second = ("mean", "median") if timing["primaryStatistic"] == "mean" else ("median", "mean")
        value = latency.get(first, latency.get(second))
        if value is not None:
            return f"latency:{timing['primaryStatistic']}:ns", value
    measurements = spec.get("measurements") or []
    if measurements:
        m = measurements[0]
        return f"{m['metric']}:{m['statistic']}:{m['unit']}", m["value"]
    return None


def metric_key(run: dict) -> str:
    found = primary(run)
    return found[0] if found else "none"


def comparison_key(run: dict, workload: dict, protocol: dict, environment: dict) -> str:
    """The comparison group of a run: operation, workload, protocol, environment, correctness
    policy and primary metric, never the implementation."""
    return comparison_key_of(
        operation=workload["spec"]["operationSpecDigest"],
        workload=run["spec"]["workloadDigest"],
        protocol=digest(protocol),
        environment=digest(environment),
        correctness=correctness_key(workload),
        metric=metric_key(run),
    )


def comparison_key_of(*, operation: str, workload: str, protocol: str, environment: str, correctness: str,
                      metric: str) -> str:
    """The comparison key from its parts: five digests and a metric key such as "latency:median:ns"."""
    return sha256_digest(canonical_json({
        "v": 1, "operation": operation, "workload": workload, "protocol": protocol,
        "environment": environment, "correctness": correctness, "metric": metric,
    }))


def js_round(x: float) -> int:
    """JavaScript's Math.round: the nearest integer, halves toward +infinity."""
    f = math.floor(x)
    return int(f) + 1 if x - f >= 0.5 else int(f)
