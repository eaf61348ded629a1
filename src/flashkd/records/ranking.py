"""Runs grouped by comparison key and ranked by their primary statistic: `flashkd records compare`'s
order, which the site's pages show too."""

from __future__ import annotations

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
