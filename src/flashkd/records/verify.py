"""Checks a bundle: each manifest against KernelIndex's JSON Schema (and the rules the schema cannot
state), each stated digest against the recomputed one, and the references between the six objects:

    run.spec.{implementation,workload,protocol,environment}Digest  = those objects' digests
    workload.spec.operationSpecDigest                                = the operation's digest
    implementation.spec.operation.specDigest                         = the operation's digest
"""

from __future__ import annotations

import json
import math
import os
from functools import cache
from importlib import resources
from pathlib import Path
from urllib.parse import urlparse

from .identity import API_VERSION, canonical_identity, sha256_digest

# Bundle key -> (kind, schema file).
OBJECTS = {
    "operation": ("OperationSpec", "operation-spec"),
    "workload": ("WorkloadCase", "workload-case"),
    "implementation": ("ImplementationRevision", "implementation-revision"),
    "protocol": ("BenchmarkProtocol", "benchmark-protocol"),
    "environment": ("ExecutionEnvironment", "execution-environment"),
    "run": ("BenchmarkRun", "benchmark-run"),
}


@cache
def _validator(name: str):
    import jsonschema

    text = resources.files(__package__).joinpath(f"schemas/{name}.v1alpha1.schema.json").read_text("utf-8")
    schema = json.loads(text)
    return jsonschema.Draft202012Validator(schema)


def schema_errors(manifest: dict, schema: str) -> list[str]:
    """Where the manifest breaks the kind's JSON Schema or the rules the schema cannot state."""
    errors = [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
              for e in sorted(_validator(schema).iter_errors(manifest), key=lambda e: list(map(str, e.path)))]
    if errors:
        return errors
    spec, kind = manifest["spec"], manifest["kind"]
    for ref in manifest["metadata"].get("sourceRefs", []):
        if urlparse(ref["url"]).scheme != "https":
            errors.append(f"metadata/sourceRefs: expected an https URL, got {ref['url']!r}")
    if kind == "OperationSpec":
        for name, axis in spec["axes"].items():
            if axis["role"] == "constant" and "value" not in axis:
                errors.append(f"spec/axes/{name}: a constant axis requires a value")
            if axis["role"] == "derived" and "expression" not in axis:
                errors.append(f"spec/axes/{name}: a derived axis requires an expression")
        for side in ("inputs", "outputs"):
            for i, argument in enumerate(spec[side]):
                if ("tensor" in argument) == ("scalar" in argument):
                    errors.append(f"spec/{side}/{i}: an argument is exactly one of tensor or scalar")
    if kind == "BenchmarkRun" and "timing" in spec:
        latency = spec["timing"]["latencyNs"]
        if "median" not in latency and "mean" not in latency:
            errors.append("spec/timing/latencyNs: requires median or mean")
    for part in ("harness", "projectRevision"):
        url = spec.get(part, {}).get("repository")
        if url is not None and urlparse(url).scheme != "https":
            errors.append(f"spec/{part}/repository: expected an https URL, got {url!r}")
    return errors


def check_bundle(bundle) -> list[str]:
    """Every problem with one bundle, each a line; [] when it is sound."""
    if not isinstance(bundle, dict):
        return ["not a JSON object"]
    problems = []
    missing = [k for k in OBJECTS if k not in bundle]
    extra = [k for k in bundle if k not in OBJECTS]
    if missing or extra:
        return [f"expected keys {', '.join(OBJECTS)}; missing: {', '.join(missing) or '-'}; "
                f"unexpected: {', '.join(extra) or '-'}"]
    computed = {}
    for key, (kind, schema) in OBJECTS.items():
        entry = bundle[key]
        if not isinstance(entry, dict) or set(entry) - {"digest", "manifest", "canonical"} or \
                not {"digest", "manifest"} <= set(entry):
            problems.append(f"{key}: expected {{digest, manifest}}")
            continue
        manifest = entry["manifest"]
        if not isinstance(manifest, dict) or manifest.get("kind") != kind or manifest.get("apiVersion") != API_VERSION:
            problems.append(f"{key}: expected a {API_VERSION} {kind} manifest, got kind "
                            f"{manifest.get('kind') if isinstance(manifest, dict) else type(manifest).__name__!r}")
            continue
        errors = schema_errors(manifest, schema)
        problems += [f"{key} ({kind}) schema: {e}" for e in errors]
        if errors:
            continue
        try:
            canonical = canonical_identity(manifest)
        except (ValueError, TypeError) as e:
            problems.append(f"{key} ({kind}): cannot canonicalise: {e}")
            continue
        computed[key] = sha256_digest(canonical)
        if entry["digest"] != computed[key]:
            problems.append(f"{key} ({kind}) digest: stated {entry['digest']}, computed {computed[key]}")
        if "canonical" in entry and entry["canonical"] != canonical:
            problems.append(f"{key} ({kind}): the stated canonical JSON is not the manifest's")
    refs = (
        ("run", ("implementationDigest",), "implementation"),
        ("run", ("workloadDigest",), "workload"),
        ("run", ("protocolDigest",), "protocol"),
        ("run", ("environmentDigest",), "environment"),
        ("workload", ("operationSpecDigest",), "operation"),
        ("implementation", ("operation", "specDigest"), "operation"),
    )
    for holder, path, target in refs:
        if holder not in computed or target not in computed:
            continue
        value = bundle[holder]["manifest"]["spec"]
        for step in path:
            value = value[step]
        if value != computed[target]:
            problems.append(f"{holder}.spec.{'.'.join(path)}: {value} is not the {target}'s digest {computed[target]}")
    return problems


def bundle_paths(paths) -> list[Path]:
    """The JSON files named, a folder standing for every *.json under it that stays in it (`links_out`)."""
    out = []
    for p in map(Path, paths):
        out += [q for q in sorted(p.rglob("*.json")) if within(q, p)] if p.is_dir() else [p]
    return out


# Records folders are downloaded: a link in one may lead anywhere on the machine that reads it. What the
# user names is read where it leads; a link found in a folder only where it stays in that folder.
LINK_OUT = "a symbolic link that leads out of the folder read: not followed (a records folder is read within itself)"


def within(path: Path, folder: Path) -> bool:
    """Whether `path`, found under `folder`, stays in it, every symbolic link on the way followed
    (realpath: a loop of links stays where it is, and is an error when read)."""
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))


def links_out(paths) -> list[Path]:
    """The symbolic links under the folders named that lead out of them where a bundle would be read: a
    *.json (to a file, a folder or nothing) or a folder."""
    return [q for p in map(Path, paths) if p.is_dir() for q in sorted(p.rglob("*"))
            if q.is_symlink() and (q.suffix == ".json" or q.is_dir()) and not within(q, p)]


def empty_folders(paths) -> list[Path]:
    """The folders named that hold no *.json at all: a path given for bundles that gave none."""
    return [p for p in map(Path, paths) if p.is_dir() and next(p.rglob("*.json"), None) is None]


EMPTY = "a folder without bundle files (*.json)"

# The suffix of a bundle file being written (cli.write_bundle); one left behind is an interrupted write.
PARTIAL = ".partial"
INTERRUPTED = "left by an interrupted write (a bundle never finished): write the records again, or remove it"


def interrupted(paths) -> list[Path]:
    """The unfinished bundle files (*.partial) under the folders named."""
    return [q for p in map(Path, paths) if p.is_dir() for q in sorted(p.rglob(f"*{PARTIAL}"))]


# A bundle is about eight levels deep; a deeper document is refused before any check walks it (the
# checks and the JSON parser recurse, and a RecursionError is no answer).
MAX_DEPTH = 64


def load(path: Path):
    """A bundle file's JSON; ValueError where it is not strict JSON (NaN, Infinity, a number past
    float range), repeats a key within an object, holds a string that is not Unicode text (an escaped
    lone surrogate) or nests deeper than MAX_DEPTH; OSError where it cannot be read."""
    return loads(Path(path).read_bytes())


# What is not a bundle is said without quoting it: the file may be anything (a key, a password file).
NOT_JSON = "not a JSON bundle (one JSON object, {...}): "


def loads(data: bytes):
    """load() of a bundle file's bytes."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{NOT_JSON}not UTF-8 text (at byte {e.start})") from None
    try:
        value = json.loads(text, parse_constant=_reject, parse_float=_float, object_pairs_hook=_object)
    except json.JSONDecodeError as e:
        if text[:e.pos].strip():  # JSON that breaks off or goes wrong later: the parser's words say where
            raise
        # no JSON at all (a README, a CSV, an empty file): the parser's "Expecting value: line 1 column 1"
        # reads as a damaged bundle
        raise ValueError(NOT_JSON + ("the file does not begin with JSON" if text.strip() else "the file is empty")) \
            from None
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels") from None
    if _depth(value) > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
    return value


def _object(pairs) -> dict:
    """A JSON object with each key once: parsers differ on which of two values they keep (Python's and
    JavaScript's the last, others the first), so a repeated key is two readings of one file."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key[:40]!r} repeated within one object")
        out[key] = value
    return out


def _text(s: str) -> None:
    """A string that UTF-8 can write: JSON's \\ud800 escapes can spell a lone surrogate, which no page
    or canonical form can carry."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"a string that is not Unicode text (a lone surrogate): {s[:40]!r}") from None


def _depth(value) -> int:
    """Nesting depth of a JSON value, without recursion; each string on the way checked by _text."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            _text(node)
        elif isinstance(node, dict):
            for key in node:
                _text(key)
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_DEPTH:  # past it the answer is known
                stack += [(child, depth + 1) for child in (node.values() if isinstance(node, dict) else node)]
    return deepest


def _reject(constant):
    raise ValueError(f"{constant} is not JSON")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is outside the range of a JSON number (an IEEE double)")
    return value


def same_runs(bundles) -> list[tuple[Path, Path, bool]]:
    """(path, earlier path, identical) for each sound (path, bundle) whose run digest an earlier one
    has. Identical files are one record given twice; files that differ (in metadata, which no digest
    covers) are two readings of one run, of which compare and site could show only one."""
    first, out = {}, []
    for path, bundle in bundles:
        # what a file says of each object: its manifest (a stated "canonical" was checked to be its form)
        said = {name: entry["manifest"] for name, entry in bundle.items()}
        earlier = first.setdefault(bundle["run"]["digest"], (path, said))
        if earlier[0] is not path:
            out.append((path, earlier[0], said == earlier[1]))
    return out


def same_run_text(earlier: Path, identical: bool) -> str:
    """What same_runs found of a file, to follow its path."""
    if identical:
        return f"the same bundle as {earlier} (one run, counted once)"
    return (f"the run of {earlier} (the same run digest), but the two files differ outside the digests "
            "(metadata): one run, two descriptions of it")


def verify_paths(paths, notes: list[str] | None = None) -> tuple[int, list[str]]:
    """(bundles checked, problem lines prefixed by their file). A sound file holding the run of an
    earlier one is a problem where the two differ, else a line in `notes`."""
    files = bundle_paths(paths)
    problems, sound = [], []
    for path in files:
        try:
            bundle = load(path)
        except (OSError, ValueError) as e:
            problems.append(f"{path}: cannot read: {e}")
            continue
        found = check_bundle(bundle)
        problems += [f"{path}: {p}" for p in found]
        if not found:
            sound.append((path, bundle))
    problems += [f"{path}: {INTERRUPTED}" for path in interrupted(paths)]
    problems += [f"{path}: {LINK_OUT}" for path in links_out(paths)]
    problems += [f"{path}: {EMPTY}" for path in empty_folders(paths)]
    for path, earlier, identical in same_runs(sound):
        (notes if identical and notes is not None else problems if not identical else []).append(
            f"{path}: {same_run_text(earlier, identical)}")
    return len(files), problems

