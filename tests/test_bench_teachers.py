"""benchmarks/bench_teachers.py --smoke: every variant (several teachers, the token map, GOLD's hybrid loss)
run at tiny float64 shapes on CPU, each fused value and gradient checked against its naive float64
computation inside the script (a mismatch raises), and results.json written with every variant."""

import importlib.util
import json
import sys
from pathlib import Path

import flashkd.teachers

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_teachers", ROOT / "benchmarks" / "bench_teachers.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


def test_smoke_checks_and_writes_every_variant(tmp_path):
    bench = _bench()
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert (tmp_path / "summary.md").is_file()
    rows = {(r["part"], r["variant"]): r for r in results["rows"]}
    timed = ["one teacher", "routed", "geometric", "sum", "floor one teacher", "floor routed", "floor two teachers"]
    expected = [("teachers", v) for v in timed] + [
        ("token map", "same vocabulary"), ("token map", "token map"), ("token map", "token map gather"),
        ("gold", "flashkd uld"), ("gold", "flashkd uld alignment"), ("gold", "trl uld (float64 logits)"),
        ("gold", "sort full vocab"), ("gold", "sort hybrid chunk"),
        ("learning", "jsd, constant teacher"), ("learning", "mutual"), ("learning", "co_jeffreys"),
        ("learning", "floor six GEMMs")]
    for key in expected:
        assert key in rows, key
    assert ("teachers", "arithmetic") in rows
    if "arithmetic" in flashkd.teachers.COMBINES:
        expected.append(("teachers", "arithmetic"))
    else:
        assert "skipped" in rows["teachers", "arithmetic"]
    trl = "skipped" not in rows["gold", "trl uld (float64 logits)"]
    for key in expected:
        if key == ("gold", "trl uld (float64 logits)") and not trl:
            continue
        assert rows[key]["median_s"] > 0 and len(rows[key]["times_s"]) == 2, key
    # the checks ran (each would have raised on a mismatch) and agree to float64 rounding
    checks = results["checks"]
    names = ["teachers / " + v for v in ("one teacher", "routed", "geometric", "sum")] + ["token map"]
    names += ["learning / mutual", "learning / co_jeffreys"]
    names += ["gold / flashkd float64 vs trl float64"] if trl else []
    names += ["teachers / arithmetic"] if "arithmetic" in flashkd.teachers.COMBINES else []
    for name in names:
        assert checks[name]["max"] <= 1e-9, (name, checks[name])
    # the same loss: the fused value and TRL's on the timed inputs
    if trl:
        assert abs(rows["gold", "flashkd uld"]["loss"] - rows["gold", "trl uld (float64 logits)"]["loss"]) <= 1e-9
    assert {r["ratio"] for r in results["ratios"]} >= {"routed / one teacher", "geometric / its floor",
                                                       "token map / same vocabulary"}
