"""Runs grouped by comparison key and ranked by their primary statistic: `flashkd records compare`'s
order, which the site's pages show too."""

from __future__ import annotations

import re
from pathlib import Path

from .identity import comparison_key, primary


def groups(bundles: list[tuple[Path, dict]]) -> dict[str, list[tuple[Path, dict]]]:
    """Bundles by the comparison key of their run (each run once)."""
    out: dict[str, list] = {}
    seen = set()
    for path, b in bundles:
        if b["run"]["digest"] in seen:
            continue
        seen.add(b["run"]["digest"])
        key = comparison_key(b["run"]["manifest"], b["workload"]["manifest"], b["protocol"]["manifest"],
                             b["environment"]["manifest"])
        out.setdefault(key, []).append((path, b))
    return out


def ranked(members: list[tuple[Path, dict]]) -> list[tuple[Path, dict, float | None]]:
    """Passed runs with a primary value, lowest first, then the rest (value None)."""
    scored = []
    for path, b in members:
        found = primary(b["run"]["manifest"])
        ok = b["run"]["manifest"]["spec"]["status"] == "passed" and found is not None
        scored.append((path, b, found[1] if ok else None))
    return sorted(scored, key=lambda t: (t[2] is None, t[2] if t[2] is not None else 0.0))


def on_cpu(bundle: dict) -> bool:
    """Measured on a CPU: its host's architecture is not a GPU's (sm_XX, gfxNNN). Its times are wall
    clock on a machine the kernels are not built for: a check that each ran, not a speed comparison."""
    return not re.match(r"(sm|gfx)_?\d", bundle["environment"]["manifest"]["spec"]["hardware"]["architecture"])


# Said wherever runs measured on a CPU are ranked or compared (the site's pages, `records compare`):
# the order of their times says that each ran, not which is faster.
CPU_CAVEAT = "CPU wall-clock checks, not a speed comparison."


def cpu_caveat(hosts: list[str]) -> str:
    """What follows CPU_CAVEAT, for runs measured on a CPU; `hosts`: each such run's host (its product)."""
    runs = "These runs were" if len(hosts) > 1 else "This run was"
    return (f"{runs} timed on a CPU ({', '.join(dict.fromkeys(hosts))}) by the wall clock: each time says that the "
            "implementation ran, passed or failed its check, and how long it took on that host. The kernels are built "
            "for GPUs, so a rank or a ratio here is not which is faster.")
