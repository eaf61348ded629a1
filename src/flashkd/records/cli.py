"""`flashkd records ...`: import-liger, verify, compare, site. Each returns the exit status: 2 for a usage
error (a PATH that does not exist, an --out that cannot be written), said in one line on stderr.

The parser imports none of the records extra's packages (rfc8785, jsonschema, jinja2): the commands import
them when they run, so --help answers without them."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

USAGE = """\
KernelIndex (kernelindex.dev/v1alpha1) benchmark records. A bundle is one JSON file with the keys
operation, workload, implementation, protocol, environment, run, each {"digest", "manifest"}.

commands:
  import-liger [CSV] --out DIR  Liger-Kernel benchmark rows -> one bundle per imported row; without
                                CSV, Liger-Kernel's published rows that flashkd ships (BSD-2-Clause)
  verify PATH...                recompute digests, check references and schemas; exit 1 on any problem
  compare PATH...               runs grouped by comparison key, ranked by primary statistic (lower first)
  site PATH... --out DIR        static HTML pages (run, group, compare, index) that open from disk;
                                --replace to rebuild a site written before at DIR
PATH is a bundle file or a folder of them.
"""


def add_records_parser(commands) -> argparse.ArgumentParser:
    """Adds `records` to an argparse subparsers object; each command sets args.run(args) -> int."""
    p = commands.add_parser("records", help="KernelIndex records: import-liger, verify, compare, site",
                            description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="records_command", required=True, metavar="command")
    q = sub.add_parser("import-liger", help="Liger-Kernel benchmark CSV -> bundles")
    q.add_argument("csv", type=Path, nargs="?", default=None,
                   help="a CSV in Liger-Kernel's 15-column benchmark schema (default: the published rows "
                        "of its distillation and JSD kernels shipped with flashkd)")
    q.add_argument("--out", type=Path, required=True, help="folder for the bundle files")
    q.add_argument("--liger-commit", type=_git_ref,
                   help="Liger-Kernel commit (or tag) the operations' sourceRefs cite (metadata only; default: "
                        "the commit of the shipped rows' benchmark scripts)")
    q.set_defaults(run=import_liger)
    q = sub.add_parser("verify", help="check bundles: digests, references, schemas")
    q.add_argument("paths", nargs="+", type=Path, metavar="PATH")
    q.set_defaults(run=verify)
    q = sub.add_parser("compare", help="rank runs within each comparison group")
    q.add_argument("paths", nargs="+", type=Path, metavar="PATH")
    q.set_defaults(run=compare)
    q = sub.add_parser("site", help="static HTML pages of the runs, ranked, that open from disk")
    q.add_argument("paths", nargs="+", type=Path, metavar="PATH")
    q.add_argument("--out", type=Path, required=True,
                   help="folder for the site (index.html): new or empty, or a site written before with --replace")
    q.add_argument("--replace", action="store_true", help="replace the site written before at --out")
    q.add_argument("--compare", nargs=2, action="append", default=[], metavar=("RUN", "RUN"),
                   help="also a compare page for these two runs (bundle files or run digest prefixes)")
    q.set_defaults(run=site)
    return p


def _git_ref(text: str) -> str:
    """A commit or tag name that a sourceRef's https URL can carry (it was pasted in: a long or odd one
    made every row's bundle fail to verify, so every row was skipped)."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,99}", text):
        raise argparse.ArgumentTypeError(f"expected a commit (40 hex digits) or a tag, at most 100 characters of "
                                         f"A-Z a-z 0-9 . _ / -, got {text[:60]!r}")
    return text


def site(args: argparse.Namespace) -> int:
    if missing := _missing("site", args.paths):
        return missing
    from .site import main  # imports jinja2

    return main(args)


def _missing(command: str, paths: list[Path]) -> int:
    """2, with a line on stderr for each PATH that does not exist (a usage error, as argparse's are,
    before any file is read), else 0."""
    absent = [p for p in paths if not os.path.lexists(p)]
    for path in absent:
        print(f"flashkd records {command}: {path}: no such file or folder", file=sys.stderr)
    return 2 if absent else 0


def write_bundle(bundle: dict, folder: Path, name: str | None = None) -> Path:
    """Writes the bundle whole or not at all: into a hidden sibling (.NAME.<pid>.partial), renamed into
    place when complete, so no reader ever sees half a bundle; a killed write leaves only that sibling,
    which verify and site report. Two writers of one name: the last rename wins, each file whole."""
    from . import liger
    from .verify import PARTIAL

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (name or liger.bundle_filename(bundle))
    partial = folder / f".{path.name}.{os.getpid()}{PARTIAL}"
    try:
        partial.write_text(json.dumps(bundle, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return path


def write_bundles(bundles: list[dict], folder: Path) -> list[Path]:
    return [write_bundle(b, Path(folder)) for b in bundles]


def import_liger(args: argparse.Namespace) -> int:
    from . import liger

    source = args.csv or "Liger-Kernel's published rows (shipped with flashkd)"
    try:
        rows = liger.read_rows(args.csv.read_text(encoding="utf-8") if args.csv else liger.bundled_csv())
    except (OSError, ValueError) as e:
        print(f"flashkd records import-liger: {source}: {e}", file=sys.stderr)
        return 2
    # every row checked before anything is written
    imported = list(liger.import_rows(rows, args.liger_commit or liger.LIGER_COMMIT))
    try:
        prepare_folder(args.out)
        for _, bundle, _ in imported:
            if bundle is not None:
                write_bundle(bundle, args.out)
    except OSError as e:
        print(f"flashkd records import-liger: --out {args.out}: {_os_error(e)}", file=sys.stderr)
        return 2
    skipped: dict[str, list[int]] = {}
    for line, bundle, reason in imported:
        if bundle is None:
            skipped.setdefault(reason, []).append(line)
    for reason, lines in skipped.items():
        print(f"skipped {len(lines)} row(s) ({'line' if len(lines) == 1 else 'lines'} {_spans(lines)}): {reason}")
    written = len(imported) - sum(map(len, skipped.values()))
    print(f"{written} bundle(s) from {source} written to {args.out}, {len(imported) - written} row(s) skipped")
    return 0


def prepare_folder(folder: Path) -> None:
    """Creates `folder` (and its parents) or checks that it is a writable folder; raises OSError."""
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError("exists and is not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError("not writable")


def _os_error(e: OSError) -> str:
    """An OSError in one line: "Permission denied: out/x.json"."""
    return f"{e.strerror}: {e.filename}" if e.strerror and e.filename else str(e)


def _spans(lines: list[int]) -> str:
    """[2, 3, 4, 9] -> "2-4, 9"."""
    out, start = [], lines[0]
    for prev, cur in zip(lines, lines[1:] + [None]):
        if cur != prev + 1:
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(out)


def verify(args: argparse.Namespace) -> int:
    if missing := _missing("verify", args.paths):
        return missing
    from .verify import verify_paths

    notes: list[str] = []
    count, problems = verify_paths(args.paths, notes)
    for line in problems + notes:
        print(line)
    if count == 0:
        print("flashkd records verify: no bundle files found", file=sys.stderr)
        return 2
    print(f"{count} bundle(s) checked, {len(problems)} problem(s)")
    return 1 if problems else 0


def compare(args: argparse.Namespace) -> int:
    if missing := _missing("compare", args.paths):
        return missing
    from .identity import primary
    from .ranking import CPU_CAVEAT, cpu_caveat, groups, on_cpu, ranked
    from .verify import (EMPTY, LINK_OUT, bundle_paths, check_bundle, empty_folders, links_out, load, same_run_text,
                         same_runs)

    bundles = []
    for path in empty_folders(args.paths):
        print(f"flashkd records compare: {path}: {EMPTY}", file=sys.stderr)
    if refused := links_out(args.paths):  # as a file it cannot read: nothing ranked
        for path in refused:
            print(f"flashkd records compare: {path}: {LINK_OUT}", file=sys.stderr)
        return 2
    for path in bundle_paths(args.paths):
        try:
            bundle = load(path)
        except (OSError, ValueError) as e:
            print(f"flashkd records compare: {path}: {e}", file=sys.stderr)
            return 2
        problems = check_bundle(bundle)
        if problems:
            print(f"flashkd records compare: {path}: {problems[0]} (run `flashkd records verify`)", file=sys.stderr)
            return 1
        bundles.append((path, bundle))
    for path, earlier, identical in same_runs(bundles):
        if not identical:
            print(f"flashkd records compare: {path}: {same_run_text(earlier, identical)} (run `flashkd records verify`)",
                  file=sys.stderr)
            return 1
        print(f"flashkd records compare: {path}: {same_run_text(earlier, identical)}: shown once", file=sys.stderr)
    if not bundles:
        print("flashkd records compare: no bundle files found", file=sys.stderr)
        return 2
    grouped = groups(bundles)
    hosts = [b["environment"]["manifest"]["spec"]["hardware"]["product"] for members in grouped.values()
             for _, b in members if on_cpu(b)]
    if hosts:  # said before any rank, as the site's pages do
        print(f"{CPU_CAVEAT} {cpu_caveat(hosts)}")
    for key, members in grouped.items():
        b = members[0][1]
        meta = lambda name: b[name]["manifest"]["metadata"]  # noqa: E731
        metric = (primary(b["run"]["manifest"]) or ("none",))[0]
        print(f"\n{meta('workload').get('title', meta('workload')['name'])}")
        print(f"  protocol {meta('protocol')['name']} · environment {meta('environment')['name']} · {metric}")
        print(f"  comparison key {key}")
        rows = ranked(members)
        best = next((v for _, _, v in rows if v is not None), None)
        unit = metric.rsplit(":", 1)[-1]
        for i, (path, m, value) in enumerate(rows, start=1):
            impl = m["implementation"]["manifest"]["metadata"]
            name = impl.get("title", impl["name"])
            if value is None:
                status = m["run"]["manifest"]["spec"]["status"]
                print(f"  {'-':>3}  {name:<48} {'':>14} {'':>8}  {status}  {path.name}")
                continue
            shown = f"{value / 1e6:.4f} ms" if unit == "ns" else f"{value:g} {unit}"
            ratio = f"x{value / best:.2f}" if best else ""
            print(f"  {i:>3}  {name:<48} {shown:>14} {ratio:>8}  {path.name}")
    return 0
