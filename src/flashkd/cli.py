"""The `flashkd` command (the console script and `python -m flashkd`): `flashkd bench` and `flashkd
records`, in flashkd.bench and flashkd.records. They need packages the losses do not: without them,
one line naming the extra to install, and exit status 2. The arguments are parsed first, without them
and without torch: --help and a mistyped option answer at once, before any extra is installed."""

from __future__ import annotations

import sys

# The packages of the [records] extra (the [bench] extra brings them too); the bench's own, rich and
# matplotlib, are optional there (plain text, no plots) and Liger-Kernel is a provider it skips.
_RECORDS = ("rfc8785", "jsonschema", "jinja2")


def main(argv: list[str] | None = None) -> int:
    """`flashkd <command> [options]`: flashkd.bench.cli.main, or its missing package named."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        from .bench.cli import main as run

        return run(argv)
    except ModuleNotFoundError as e:
        package = (e.name or "").split(".")[0]
        if package not in _RECORDS:
            raise
        extra = "records" if argv[:1] == ["records"] else "bench"
        print(f"flashkd: this command needs the package {package!r}, which the losses do not: "
              f'pip install -e ".[{extra}]"', file=sys.stderr)  # the README's form
        return 2
