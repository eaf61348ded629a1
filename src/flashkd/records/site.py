"""`flashkd records site`: bundles as a static site that opens from disk (no server, no script, nothing fetched).

    index.html                    runs by operation, workload and GPU; the sweeps; every run; the rejected files
    runs/<id>.html                one run: primary measurement with p20/p80, its rank in its comparison group,
                                  identity, correctness, tensors, measurements, protocol, environment,
                                  artifacts, the canonical manifests, how to cite it
    runs/<id>.canonical.json      the run's canonical JSON: the exact bytes its digest hashes
    bundles/<id>.json             the input bundle file, byte for byte
    groups/<key>.html             one comparison group ranked, each run's ratio to #1, a latency chart
    sweeps/<id>.html              groups that differ only in one axis (N): latency against it per implementation
    compare/<a>-vs-<b>.html       two runs side by side: every pair within a comparison group, and the pairs
                                  asked for with --compare (any two runs, e.g. ours against a published one)
    artifacts/<digest>/<name>     evidence files a run cites, found beside its bundle with the stated digest

<id> is the first 16 hex digits of the run's digest. Every bundle is checked with verify.check_bundle first;
a file that fails is not rendered: the index lists it with its problems and build() reports it (the
command exits 1). Ranks are records compare's (ranking.groups and ranking.ranked). Links to other sites are shown
as text, so every link in the site resolves to a file in it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import os
import re
import shutil
import sys
from importlib import resources
from pathlib import Path

from .. import files
from .ranking import CPU_CAVEAT, cpu_caveat, groups, on_cpu, ranked
from .identity import canonical_identity, canonical_json, primary
from .verify import (EMPTY, INTERRUPTED, LINK_OUT, OBJECTS, PARTIAL, bundle_paths, check_bundle, empty_folders,
                     interrupted, links_out, load, loads, same_run_text, same_runs, within)

MARKER = ".flashkd-site"  # marks a folder this module wrote, so a rebuild may replace it
STATIC = ("style.css",)


@dataclasses.dataclass
class Run:
    id: str
    bundle: dict
    path: Path
    key: str
    value: float | None = None  # the primary value when ranked
    rank: int | None = None
    group: "Group | None" = None
    raw: bytes = b""  # the file's bytes as read and checked: what bundles/<id>.json serves

    def __getitem__(self, name):  # run["workload"] -> that object's manifest
        return self.bundle[name]["manifest"]

    @property
    def digest(self) -> str:
        return self.bundle["run"]["digest"]

    @property
    def spec(self) -> dict:
        return self["run"]["spec"]

    @property
    def title(self) -> str:
        return _title(self["run"])

    @property
    def implementation(self) -> str:
        return _title(self["implementation"])

    @property
    def short(self) -> str:
        """The implementation's title without the operation it shares with its group ("jsd · flashkd" -> "flashkd")."""
        return self.implementation.rsplit(" · ", 1)[-1]

    @property
    def case(self) -> str:
        """The workload in a few words, as every page names it: its axes (`shown_axes`) and the float
        dtypes of its tensors. Not its title, whose `hidden=` may be the teacher's width."""
        dtypes = sorted({t["dtype"] for t in self["workload"]["spec"]["tensors"].values()
                         if not t["dtype"].startswith(("int", "uint", "bool"))})
        return self.axes_text + (f" · {'/'.join(dtypes)}" if dtypes else "")

    @property
    def operation_title(self) -> str:
        return _title(self["operation"])

    @property
    def gpu(self) -> str:
        return self["environment"]["spec"]["hardware"]["product"]

    @property
    def on_cpu(self) -> bool:
        return on_cpu(self.bundle)

    @property
    def hardware_text(self) -> str:
        """The host in a few words: "NVIDIA H100 (GPU, sm_90)", "Intel Xeon ... (CPU, x86_64, 2 threads)"."""
        hw = self["environment"]["spec"]["hardware"]
        kind = "CPU" if self.on_cpu else "GPU" if hw.get("count", 1) == 1 else f"{hw['count']} GPUs"
        return f"{hw['product']} ({kind}, {hw['architecture']})"

    @property
    def exactness(self) -> str:
        """How exact, in words: the largest relative error observed against the reference and the policy's
        bound, or why there is none."""
        policy, observed = self["workload"]["spec"].get("correctness", {}), self.spec.get("correctness", {})
        if "maximumRelativeError" in observed:
            bound = policy.get("maxRelativeError")
            return (f"largest relative error {observed['maximumRelativeError']:.3g} against the reference"
                    + (f" (the gate allows {bound:.3g})" if bound is not None else ""))
        if policy.get("comparator") == "not_asserted":
            return "not checked by its source (its numbers are re-published as they were stated)"
        return "no error recorded"

    @property
    def axes_text(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in shown_axes(self["workload"]["spec"]).items())

    @property
    def imported(self) -> bool:
        """A record converted from another harness's published rows (it carries their source), not a run
        measured by the user (`flashkd bench`)."""
        return "sourceNative" in self.spec

    @property
    def refs(self) -> list[tuple[str, str]]:
        """(object, url) of every sourceRef in the six manifests' metadata."""
        return [(name, ref["url"]) for name in OBJECTS for ref in self[name]["metadata"].get("sourceRefs", [])]

    @property
    def metric(self) -> str:
        found = primary(self["run"])
        return found[0] if found else "none"

    @property
    def primary_value(self) -> float | None:
        found = primary(self["run"])
        return found[1] if found else None

    @property
    def spread(self) -> tuple[float | None, float | None]:
        """(p20, p80) of the primary metric where the run states them."""
        metric, _, unit = (self.metric.split(":") + ["", ""])[:3]
        found = {m["statistic"]: m["value"] for m in self.spec.get("measurements", [])
                 if m["metric"] == metric and m["unit"] == unit}
        return found.get("p20"), found.get("p80")

    @property
    def ratio(self) -> float | None:
        best = self.group.best if self.group else None
        return self.value / best.value if self.value is not None and best is not None and best.value else None


@dataclasses.dataclass
class Group:
    id: str
    key: str
    runs: list[Run]  # in rank order; unranked (failed, untimed) last

    @property
    def best(self) -> Run | None:
        return self.runs[0] if self.runs and self.runs[0].rank == 1 else None

    @property
    def first(self) -> Run:
        return self.runs[0]

    @property
    def ranked_count(self) -> int:
        return sum(r.rank is not None for r in self.runs)

    @property
    def imported(self) -> bool:
        return all(r.imported for r in self.runs)

    @property
    def on_cpu(self) -> bool:
        return any(r.on_cpu for r in self.runs)

    @property
    def title(self) -> str:
        """The operation, the workload (`Run.case`) and the protocol, whose timed pass (forward, full, ...)
        is what groups of one workload differ in."""
        r = self.first
        return f"{r.operation_title} · {r.case} · {_title(r['protocol'])}"


@dataclasses.dataclass
class Sweep:
    id: str
    axis: str
    fixed: dict  # the other axes
    groups: list[Group]  # by axis value

    @property
    def first(self) -> Run:
        return self.groups[0].first

    @property
    def fixed_text(self) -> str:
        """The other axes, named as the site names them (`shown_axes`)."""
        shown = shown_axes({"axes": self.fixed, "tensors": self.first["workload"]["spec"].get("tensors", {})})
        return ", ".join(f"{k} = {v}" for k, v in shown.items())

    def series(self) -> list[tuple[str, list[tuple[float, Run]]]]:
        """(implementation title, [(axis value, run)]) per implementation with a ranked run."""
        out: dict[str, tuple[str, list]] = {}
        for g in self.groups:
            for r in g.runs:
                if r.rank is not None and r.value > 0:  # a log axis
                    out.setdefault(r.bundle["implementation"]["digest"], (r.short, []))[1].append(
                        (r["workload"]["spec"]["axes"][self.axis], r))
        return list(out.values())


@dataclasses.dataclass
class Rejected:
    path: Path
    problems: list[str]


@dataclasses.dataclass
class Site:
    runs: list[Run]
    groups: list[Group]
    sweeps: list[Sweep]
    compares: list[tuple[Run, Run]]
    rejected: list[Rejected]
    files: int
    pages: int = 0
    duplicates: list[str] = dataclasses.field(default_factory=list)  # files given again, each a line
    refused_evidence: list[Path] = dataclasses.field(default_factory=list)  # links out, not followed (by write)


def _title(manifest: dict) -> str:
    return manifest["metadata"].get("title") or manifest["metadata"]["name"]


def shown_axes(workload_spec: dict) -> dict:
    """A workload's axes as the site names them: a `hidden` axis that is the teacher's width (its
    teacher_input's last dim) is shown as `teacher_hidden`, beside the student's (`student_hidden`, from
    student_input), so every form and harness reads alike. Display only: the record's axes, which its
    digest covers, are as written."""
    axes, tensors = workload_spec["axes"], workload_spec.get("tensors", {})

    def width(name):
        shape = tensors.get(name, {}).get("shape")
        return shape[-1] if isinstance(shape, list) and len(shape) == 2 else None

    out = {}
    for name, value in axes.items():
        if name == "hidden" and width("teacher_input") == value:
            if "student_hidden" not in axes and width("student_input") is not None:
                out["student_hidden"] = width("student_input")
            out["teacher_hidden"] = value
        else:
            out[name] = value
    return out


def _hex(digest: str, n: int = 16) -> str:
    return digest.removeprefix("sha256:")[:n]


# -- reading ----------------------------------------------------------------------------------------

def read(paths, compare_pairs=(), out=None) -> Site:
    """Loads and checks every bundle under `paths`, groups and ranks the sound ones; `compare_pairs` are
    (run, run) spellings (a bundle file, or a run digest or its first hex digits) that get compare pages.
    `out`: a site's folder, skipped with its builds in progress where `paths` hold it (its copies of the
    bundles are not inputs). Raises ValueError when a pair names no run or several."""
    ours = _own_output(out)
    files = [p for p in bundle_paths(paths) if not ours(p)]
    good, rejected, raw = [], [], {}
    for path in files:
        try:  # read once: the bytes checked are the bytes served, whatever the file holds by then
            raw[path] = Path(path).read_bytes()
            bundle = loads(raw[path])
        except (OSError, ValueError) as e:
            rejected.append(Rejected(path, [f"cannot read: {e}"]))
            continue
        problems = check_bundle(bundle)
        if problems:
            rejected.append(Rejected(path, problems))
        else:
            good.append((path, bundle))
    rejected += [Rejected(path, [INTERRUPTED]) for path in interrupted(paths) if not ours(path)]
    rejected += [Rejected(path, [LINK_OUT]) for path in links_out(paths) if not ours(path)]
    duplicates = []  # a run given twice is rendered once; two files that differ on it, not the second
    for path, earlier, identical in same_runs(good):
        good = [(p, b) for p, b in good if p is not path]
        if identical:
            duplicates.append(f"{path}: {same_run_text(earlier, identical)}")
        else:
            rejected.append(Rejected(path, [same_run_text(earlier, identical)]))
    runs, all_groups = [], []
    for key, members in groups(good).items():
        group = Group(_hex(key), key, [])
        rank = 0
        for path, bundle, value in ranked(members):
            rank += value is not None
            run = Run(_hex(bundle["run"]["digest"]), bundle, path, key, value, rank if value is not None else None,
                      group, raw[path])
            group.runs.append(run)
            runs.append(run)
        all_groups.append(group)
    for kind, items in (("run", runs), ("comparison group", all_groups)):
        if len({x.id for x in items}) != len(items):
            raise ValueError(f"two {kind}s share the first 16 hex digits of their digest")
    all_groups.sort(key=lambda g: (g.imported, *_group_order(g)))  # the user's own runs first
    runs = [r for g in all_groups for r in g.runs]
    pairs = [(a, b) for g in all_groups for a, b in itertools.combinations(g.runs, 2)]
    for spelled in compare_pairs:
        a, b = (_find(runs, s) for s in spelled)
        if a is b:
            raise ValueError(f"--compare {spelled[0]} {spelled[1]}: the same run twice")
        if (a, b) not in pairs and (b, a) not in pairs:
            pairs.append((a, b))
    return Site(runs, all_groups, _sweeps(all_groups), pairs, rejected, len(files), duplicates=duplicates)


def _own_output(out):
    """A test of paths: under `out`, or under one of its builds (.NAME.<pid>.partial beside it) or the
    site a rebuild is replacing (.NAME.old)."""
    if out is None:
        return lambda path: False
    out = Path(os.path.realpath(out))  # not Path.resolve(), which raises at a loop of links
    building = re.compile(re.escape(f".{out.name}.") + r"(\d+" + re.escape(PARTIAL) + "|old)")

    def ours(path):
        path = Path(os.path.realpath(path))
        return any(p == out or (p.parent == out.parent and building.fullmatch(p.name)) for p in (path, *path.parents))

    return ours


def _find(runs: list[Run], spelled: str) -> Run:
    path = Path(spelled)
    if path.is_file():
        try:
            digest = load(path)["run"]["digest"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--compare {spelled}: not a bundle ({e})") from None
        found = [r for r in runs if r.digest == digest]
    else:
        prefix = spelled.removeprefix("sha256:").lower()
        found = [r for r in runs if re.fullmatch(r"[0-9a-f]{6,64}", prefix) and _hex(r.digest, 64).startswith(prefix)]
    if len(found) != 1:
        raise ValueError(f"--compare {spelled}: expected one sound run (a bundle file or a run digest prefix of at "
                         f"least 6 hex digits), found {len(found)}")
    return found[0]


def _axes_order(run: Run) -> tuple:
    return tuple(sorted((k, v) for k, v in run["workload"]["spec"]["axes"].items()))


def _group_order(g: Group) -> tuple:
    r = g.first
    return (_title(r["operation"]), _axes_order(r), _title(r["workload"]),
            r["environment"]["spec"]["hardware"]["product"], _title(r["environment"]), _title(r["protocol"]), g.key)


def _sweeps(all_groups: list[Group]) -> list[Sweep]:
    """Groups alike in everything but their workload's axes, split so that one axis varies: "tokens"
    when it does, else the first that does."""
    families: dict[str, list[Group]] = {}
    for g in all_groups:
        r = g.first
        workload = {k: v for k, v in r["workload"]["spec"].items() if k not in ("axes", "tensors")}
        families.setdefault(canonical_json({
            "operation": r.bundle["operation"]["digest"], "protocol": r.bundle["protocol"]["digest"],
            "environment": r.bundle["environment"]["digest"], "workload": workload, "metric": r.metric,
        }), []).append(g)
    sweeps = []
    for members in families.values():
        axes = lambda g: g.first["workload"]["spec"]["axes"]  # noqa: E731
        names = sorted({a for g in members for a in axes(g)})
        varying = [a for a in names if len({repr(axes(g).get(a)) for g in members}) > 1]
        if not varying:
            continue
        axis = "tokens" if "tokens" in varying else varying[0]
        split: dict[str, list[Group]] = {}
        for g in members:
            fixed = {a: axes(g).get(a) for a in names if a != axis}
            split.setdefault(canonical_json(fixed), []).append(g)
        for fixed_text, gs in split.items():
            gs = [g for g in gs if g.best is not None]  # a sweep of runs none of which is ranked says nothing
            values = [axes(g).get(axis) for g in gs]
            if len(set(values)) < 2 or not all(isinstance(v, (int, float)) and v > 0 for v in values):
                continue
            gs.sort(key=lambda g: axes(g)[axis])
            ident = hashlib.sha256("|".join(g.key for g in gs).encode()).hexdigest()[:16]
            fixed = {a: v for a, v in axes(gs[0]).items() if a != axis}
            sweeps.append(Sweep(ident, axis, fixed, gs))
    return sweeps


# -- formatting -------------------------------------------------------------------------------------

def quantity(value, unit: str) -> str:
    """A measured value as records compare prints it: ns as ms with 4 decimals, bytes as MiB."""
    if value is None:
        return "—"
    if unit == "ns":
        return f"{value / 1e6:.4f} ms"
    if unit == "bytes":
        return f"{value / 2**20:.2f} MiB"
    if unit == "ratio":
        return f"{value:g}"
    return f"{value:g} {unit}" if isinstance(value, (int, float)) else f"{value} {unit}"


def ratio(value: float | None) -> str:
    return "" if value is None else f"×{value:.2f}"


def flatten(value, prefix: str = "") -> dict[str, str]:
    """A JSON value as {dotted path: scalar text}; lists of scalars joined."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else k))
        return out or {prefix: "{}"}
    if isinstance(value, list):
        if all(not isinstance(v, (dict, list)) for v in value):
            return {prefix: ", ".join(map(_scalar, value)) if value else "[]"}
        out = {}
        for i, v in enumerate(value):
            out.update(flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: _scalar(value)}


def _scalar(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return v
    return canonical_json(v)


def shape(tensor_shape) -> str:
    return " × ".join(map(str, tensor_shape)) if tensor_shape else "scalar"


# -- charts (inline SVG) ----------------------------------------------------------------------------

PALETTE = ("#2f6db5", "#d8772a", "#3a9a5b", "#b8405e", "#7a5ab8", "#8a6d3b", "#4a9fb0", "#666666")


def _esc(text: str) -> str:
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def bar_chart(rows: list[tuple[str, float, float | None, float | None]], unit: str, title: str) -> str:
    """Horizontal bars (label, value, low, high), low–high drawn as a whisker; values in `unit`."""
    label_w, bar_w, row_h, top = 260, 420, 26, 28
    hi = max(max(v, h or v) for _, v, _, h in rows) or 1.0
    height = top + row_h * len(rows) + 24
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {label_w + bar_w + 120} {height}" '
             f'role="img" aria-label="{_esc(title)}">', f'<title>{_esc(title)}</title>',
             f'<text x="0" y="16" class="chart-title">{_esc(title)}</text>']
    for i, (label, v, lo, up) in enumerate(rows):
        y = top + i * row_h
        w = max(v / hi * bar_w, 1)
        parts.append(f'<text x="{label_w - 8}" y="{y + 17}" text-anchor="end">{_esc(label[:40])}</text>')
        parts.append(f'<rect x="{label_w}" y="{y + 4}" width="{w:.1f}" height="{row_h - 8}" '
                     f'fill="{PALETTE[0] if i else PALETTE[2]}"/>')
        if lo is not None and up is not None:
            x0, x1, ym = label_w + lo / hi * bar_w, label_w + up / hi * bar_w, y + row_h / 2
            parts.append(f'<path d="M{x0:.1f} {ym - 5}v10M{x0:.1f} {ym}H{x1:.1f}M{x1:.1f} {ym - 5}v10" '
                         f'class="whisker"/>')
        parts.append(f'<text x="{label_w + max(w, (up or 0) / hi * bar_w) + 6:.1f}" y="{y + 17}">'
                     f'{_esc(quantity(v, unit))}</text>')
    parts.append(f'<text x="{label_w}" y="{height - 6}" class="axis-note">bar: {_esc(title.split(" ")[0].lower())}; '
                 'whisker: p20–p80</text>')
    return "".join(parts) + "</svg>"


def _ticks(lo: float, hi: float) -> list[tuple[float, str]]:
    """1-2-5 ticks covering [10^lo, 10^hi] on a log scale, as (log10, label): bounds and ticks in
    log10, since a measurement may lie near the double's ends, where the range with its margins (or a
    tick) is past them. Without a 1-2-5 tick in the range, its two ends."""
    out = []
    for e in range(math.floor(lo) - 1, math.ceil(hi) + 1):
        out += [(math.log10(m) + e, _tick_label(math.log10(m) + e)) for m in (1, 2, 5) if lo <= math.log10(m) + e <= hi]
    return out or [(lo, _tick_label(lo)), (hi, _tick_label(hi))]


def _tick_label(log10: float) -> str:
    e = math.floor(log10)
    if -300 < e < 300:
        return f"{10.0 ** log10:g}"
    return f"{10.0 ** (log10 - e):.3g}e{e:+03d}"  # as :g writes it, for values past (or near) float's range


def line_chart(series: list[tuple[str, list[tuple[float, float]]]], axis: str, unit: str, title: str) -> str:
    """Log–log lines, one per (label, [(x, y)]), x ticks at the data's x values."""
    left, right, top, plot_w, plot_h = 70, 220, 28, 460, 260
    xs = sorted({x for _, pts in series for x, _ in pts})
    ys = [y for _, pts in series for _, y in pts]
    scale_y = 1e6 if unit == "ns" else 2**20 if unit == "bytes" else 1.0
    shown = {"ns": "ms", "bytes": "MiB"}.get(unit, unit)
    # the axes' ranges in log10, with margins: values near the double's maximum (or minimum) would
    # overflow them as plain numbers
    log_scale = math.log10(scale_y)
    y_lo, y_hi = math.log10(min(ys)) - log_scale - math.log10(1.25), math.log10(max(ys)) - log_scale + math.log10(1.25)
    x_lo, x_hi = math.log10(xs[0]) - math.log10(1.15), math.log10(xs[-1]) + math.log10(1.15)

    def X(x):
        return left + (math.log10(x) - x_lo) / (x_hi - x_lo) * plot_w

    def Y(log_y):  # log10 of a value in the shown unit
        return top + plot_h - (log_y - y_lo) / (y_hi - y_lo) * plot_h

    def Y_of(y):  # a measured value, in the record's unit
        return Y(math.log10(y) - log_scale)

    height = top + plot_h + 44
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {left + plot_w + right} {height}" '
             f'role="img" aria-label="{_esc(title)}">', f'<title>{_esc(title)}</title>',
             f'<text x="0" y="16" class="chart-title">{_esc(title)}</text>',
             f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" class="frame"/>']
    for t, label in _ticks(y_lo, y_hi):
        parts.append(f'<path d="M{left} {Y(t):.1f}h{plot_w}" class="grid"/>'
                     f'<text x="{left - 6}" y="{Y(t) + 4:.1f}" text-anchor="end">{label}</text>')
    for x in xs:
        parts.append(f'<path d="M{X(x):.1f} {top}v{plot_h}" class="grid"/>'
                     f'<text x="{X(x):.1f}" y="{top + plot_h + 16}" text-anchor="middle">{x:g}</text>')
    parts.append(f'<text x="{left + plot_w / 2}" y="{height - 6}" text-anchor="middle">{_esc(axis)} (log)</text>')
    parts.append(f'<text x="12" y="{top + plot_h / 2}" transform="rotate(-90 12 {top + plot_h / 2})" '
                 f'text-anchor="middle">{_esc(shown)} (log)</text>')
    for i, (label, pts) in enumerate(series):
        color = PALETTE[i % len(PALETTE)]
        pts = sorted(pts)
        path = "M" + "L".join(f"{X(x):.1f} {Y_of(y):.1f}" for x, y in pts)
        parts.append(f'<path d="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        parts += [f'<circle cx="{X(x):.1f}" cy="{Y_of(y):.1f}" r="3.5" fill="{color}"/>' for x, y in pts]
        ly = top + 10 + i * 18
        parts.append(f'<path d="M{left + plot_w + 12} {ly}h18" stroke="{color}" stroke-width="3"/>'
                     f'<text x="{left + plot_w + 36}" y="{ly + 4}">{_esc(label[:28])}</text>')
    return "".join(parts) + "</svg>"


# -- writing ----------------------------------------------------------------------------------------

def _environment():
    import jinja2

    class Missing(jinja2.StrictUndefined):
        """An absent optional field tests false (`{% if x.notes %}`, `x.labels or {}`); printing one raises."""

        def __bool__(self):
            return False

    env = jinja2.Environment(loader=jinja2.PackageLoader("flashkd.records", "templates"),
                             autoescape=jinja2.select_autoescape(["html"], default=True), undefined=Missing,
                             trim_blocks=True, lstrip_blocks=True)
    env.filters.update(quantity=quantity, ratio=ratio, flatten=flatten, shape=shape, hex=_hex, scalar=_scalar)
    env.globals.update(OBJECTS=OBJECTS, CPU_CAVEAT=CPU_CAVEAT, cpu_caveat_text=cpu_caveat)
    return env


def _artifacts(run: Run, out: Path, refused: list[Path]) -> list[dict]:
    """Each evidence file the run cites: copied into the site when a file of that name with the stated
    digest lies beside the bundle (or one folder up), else listed as not found. One that is a symbolic
    link out of its folder is not read: added to `refused`."""
    found = []
    for kind, ref in sorted(run.spec.get("evidence", {}).items()):
        if not isinstance(ref, dict) or "uri" not in ref:
            continue
        item = {"kind": kind, "uri": ref["uri"], "digest": ref.get("digest"), "href": None,
                "note": "not found beside the bundle"}
        name = ref["uri"]
        if re.fullmatch(r"[A-Za-z0-9._-]+", name) and name not in (".", ".."):
            for folder in (run.path.parent, run.path.parent.parent):
                candidate = folder / name
                if not within(candidate, folder):
                    item["note"] = f"{name} is a symbolic link out of its folder: not followed"
                    if candidate not in refused:
                        refused.append(candidate)
                    continue
                if not candidate.is_file():
                    continue
                data = candidate.read_bytes()
                if "sha256:" + hashlib.sha256(data).hexdigest() != ref.get("digest"):
                    item["note"] = f"a file {name} lies beside the bundle, but its digest differs"
                    continue
                target = out / "artifacts" / _hex(ref["digest"], 64) / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
                item["href"] = f"../artifacts/{_hex(ref['digest'], 64)}/{name}"
                item["note"] = "digest checked"
                break
        elif ref.get("uri"):
            item["note"] = "not a file name beside the bundle"
        found.append(item)
    return found


def _cite(run: Run) -> str:
    year = run.spec["observedAt"][:4]
    native = run.spec.get("sourceNative", {})
    source = f" Source: {native['source']}, {native['externalId']}." if "externalId" in native else ""
    return (f"{run.implementation}. {run.operation_title} · {run.case}; {_title(run['protocol'])}; "
            f"{_title(run['environment'])}. Benchmark run, observed {run.spec['observedAt']} ({year}). "
            f"KernelIndex record {run.digest} (kernelindex.dev/v1alpha1), comparison key {run.key}.{source}")


def compare_name(a: Run, b: Run) -> str:
    return f"{a.id}-vs-{b.id}.html"


def check_out(out: Path, replace: bool = False) -> None:
    """`out` may be written: new, an empty folder, or, with `replace`, a site this module wrote before.
    Anything else is refused with ValueError: a non-empty folder, as `flashkd bench` refuses one for its
    --out, and an earlier site unless its replacement is asked for."""
    out = Path(out)
    try:  # one listing: another build may swap the folder between two looks
        entries = set(os.listdir(out)) if out.is_dir() else None
    except FileNotFoundError:
        return
    if entries is None and not out.exists():
        return
    if entries is None or (entries and MARKER not in entries):
        raise ValueError(f"--out {out}: exists and is not a site written by flashkd records site; "
                         "name a new or empty folder")
    if entries and not replace:
        raise ValueError(f"--out {out}: holds a site written before; pass --replace to replace it, "
                         "or name a new folder")


def write(site: Site, out: Path, replace: bool = False) -> int:
    """Writes the site into `out`, whole or not at all: built in a hidden sibling (.NAME.<pid>.partial)
    and renamed into place when complete, so a killed or failing build never leaves half a site there.
    A folder this module wrote before is replaced only with `replace`; other folders are refused
    (`check_out`). One build at a time per `out`: it holds a lock on a file beside it (.NAME.lock,
    removed when it ends), and a second build meanwhile is refused with ValueError. Returns the number
    of pages."""
    out = Path(out)
    parent = out.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    lock = parent / f".{out.absolute().name}.lock"
    with files.exclusive(lock, f"--out {out}: another `flashkd records site` is building it now (it holds {lock}); "
                               "nothing written, run again when that one has finished", what=f"--out {out}",
                         required=False):
        check_out(out, replace)  # again, under the lock: what another build left there counts
        building = parent / f".{out.absolute().name}.{os.getpid()}{PARTIAL}"
        shutil.rmtree(building, ignore_errors=True)
        try:
            pages = _write(site, building)
            # by renames: a build starting meanwhile (its first check runs before it asks for the lock)
            # sees a whole site or none, not a half-removed folder it would call foreign
            files.replace_dir(building, out, parent / f".{out.absolute().name}.old", what=f"--out {out}")
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            raise
    return pages


def _write(site: Site, out: Path) -> int:
    for sub in ("runs", "groups", "compare", "sweeps", "bundles"):
        (out / sub).mkdir(parents=True)
    (out / MARKER).write_text("written by flashkd records site; rebuilt whole, then renamed into place\n")
    env = _environment()
    static = resources.files(__package__).joinpath("templates")
    for name in STATIC:
        (out / name).write_text(static.joinpath(name).read_text("utf-8"), encoding="utf-8")
    compares = {}
    for a, b in site.compares:
        compares.setdefault(a.id, {})[b.id] = compare_name(a, b)
        compares.setdefault(b.id, {})[a.id] = compare_name(a, b)
    sweep_of = {g.id: s for s in site.sweeps for g in s.groups}
    pages = 0

    def page(path: str, template: str, **context):
        nonlocal pages
        root = "../" * path.count("/")
        html = env.get_template(template).render(root=root, site=site, **context)
        (out / path).write_text(html, encoding="utf-8")
        pages += 1

    for run in site.runs:
        (out / "bundles" / f"{run.id}.json").write_bytes(run.raw)
        canonical = {name: canonical_identity(run.bundle[name]["manifest"]) for name in OBJECTS}
        (out / "runs" / f"{run.id}.canonical.json").write_text(canonical["run"], encoding="utf-8")
        p20, p80 = run.spread
        page(f"runs/{run.id}.html", "run.html", run=run, p20=p20, p80=p80, canonical=canonical,
             compares=compares.get(run.id, {}), artifacts=_artifacts(run, out, site.refused_evidence), cite=_cite(run),
             sweep=sweep_of.get(run.group.id), unit=run.metric.rsplit(":", 1)[-1])
    for g in site.groups:
        unit = g.first.metric.rsplit(":", 1)[-1]
        rows = [(r.short, r.value, *r.spread) for r in g.runs if r.value is not None]
        chart = bar_chart(rows, unit, f"{g.first.metric.split(':')[0].capitalize()} per implementation, "
                                      f"{g.first.metric.split(':')[1]}") if len(rows) >= 2 else None
        page(f"groups/{g.id}.html", "group.html", group=g, chart=chart, compares=compares,
             sweep=sweep_of.get(g.id), unit=unit)
    for s in site.sweeps:
        unit = s.first.metric.rsplit(":", 1)[-1]
        series = [(label, [(x, r.value) for x, r in pts]) for label, pts in s.series()]
        chart = line_chart(series, s.axis, unit, f"{s.first.metric.split(':')[1].capitalize()} "
                                                 f"{s.first.metric.split(':')[0]} against {s.axis}") if series else None
        page(f"sweeps/{s.id}.html", "sweep.html", sweep=s, chart=chart, unit=unit)
    for a, b in site.compares:
        same = a.key == b.key
        objects = [(name, a.bundle[name]["digest"] == b.bundle[name]["digest"], flatten(a[name]["spec"]),
                    flatten(b[name]["spec"])) for name in OBJECTS]
        alike = {name: {k for k, v in x.items() if y.get(k) == v} for name, _, x, y in objects}
        page(f"compare/{compare_name(a, b)}", "compare.html", a=a, b=b, same=same, objects=objects, alike=alike,
             unit=a.metric.rsplit(":", 1)[-1],
             b_over_a=b.primary_value / a.primary_value if a.primary_value and b.primary_value is not None
             and a.metric == b.metric else None)
    page("index.html", "index.html", compares=compares)
    return pages


def build(paths, out, compare_pairs=(), replace=False) -> Site:
    """read() then write(); the Site says what was rendered and what was rejected. Raises ValueError
    when no bundle file is found, a --compare pair is not two runs, or `out` may not be written
    (`check_out`: checked first)."""
    check_out(out, replace)
    site = read(paths, compare_pairs, out)
    if not site.files:
        raise ValueError("no bundle files found")
    site.pages = write(site, out, replace)
    return site


def main(args) -> int:
    """`flashkd records site PATH... --out DIR [--compare RUN RUN]...`: 0, 1 when a file was rejected
    (the site is still written, the file listed on its index) or an evidence file was a link out of its
    folder, 2 when nothing could be written."""
    try:
        site = build(args.paths, args.out, [tuple(p) for p in args.compare], args.replace)
    except ValueError as e:
        print(f"flashkd records site: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a folder it may not write or read: one line, as the command's other errors
        where = f": {e.filename}" if e.filename else ""
        print(f"flashkd records site: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    for x in site.rejected:
        for problem in x.problems:
            print(f"{x.path}: {problem}", file=sys.stderr)
    for line in site.duplicates:
        print(f"{line}: rendered once", file=sys.stderr)
    evidence = [p for p in site.refused_evidence if p not in {x.path for x in site.rejected}]  # not said twice
    for path in evidence:
        print(f"{path}: {LINK_OUT}", file=sys.stderr)
    for path in empty_folders(args.paths):
        print(f"flashkd records site: {path}: {EMPTY}", file=sys.stderr)
    print(f"{len(site.runs)} run(s) in {len(site.groups)} comparison group(s), {site.pages} pages: "
          f"{Path(args.out) / 'index.html'}")
    if site.rejected:
        print(f"flashkd records site: {len(site.rejected)} file(s) rejected, not rendered (listed on the index)",
              file=sys.stderr)
    return 1 if site.rejected or evidence else 0


__all__ = ["build", "read", "write", "Site", "Run", "Group", "Sweep", "Rejected"]
