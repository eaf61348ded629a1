"""The benchmark harness on CPU at tiny shapes: CSV schema, correctness gate, presets, plots, CLI."""

import csv
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import flashkd
from flashkd.bench import cli, measure, report
from flashkd.bench.providers import PROVIDERS, Provider
from flashkd.bench.workloads import PRESETS, Workload, make_inputs

LIGER_COLUMNS = [
    "kernel_name", "kernel_provider", "kernel_operation_mode", "metric_name", "metric_unit", "x_name", "x_label",
    "x_value", "y_value_50", "y_value_20", "y_value_80", "extra_benchmark_config_str", "gpu_name", "timestamp",
    "liger_version",
]
LIGER_ROWS = Path(__file__).resolve().parents[2] / "shared/data/liger/distill_benchmark_rows.csv"
FAST = measure.Settings(torch.device("cpu"), rep_ms=1.0, warmup_ms=0.0, min_reps=2)
# N = 7, 11 and V = 37 are primes: no size is a multiple of a block or chunk.
TINY = [Workload("jsd", 7, h=12, v=37, dtype="float32"), Workload("jsd", 11, h=12, v=37, dtype="float32")]
FAST_ARGS = ["--h", "12", "--v", "37", "--rep", "1", "--warmup", "0", "--min-reps", "2"]


def _scaled(factor):
    """A provider that is flashkd with its loss (and so its grads) multiplied by `factor`."""
    def make(w, x):
        fn = PROVIDERS["flashkd"].make(w, x)
        return lambda: fn() * factor
    return Provider(make, lambda: "0")


def _wrong_grads(w, x):
    """flashkd's loss value exactly, plus a zero-valued term whose gradient is not zero."""
    fn = PROVIDERS["flashkd"].make(w, x)

    def loss():
        sq = x.xs.float().square().sum()
        return fn() + 1e-2 * (sq - sq.detach())
    return loss


def _read(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_results_csv_has_liger_schema(tmp_path):
    results = measure.run(TINY, ["flashkd", "torch", "floor"], ["full", "backward"], FAST)
    env = report.environment(FAST)
    report.write_csv(results, tmp_path / "results.csv", env)
    header, *rows = _read(tmp_path / "results.csv")
    assert header == LIGER_COLUMNS
    if LIGER_ROWS.exists():  # the published file itself, where the shared folder is beside the repository
        assert _read(LIGER_ROWS)[0] == header
    # 2 workloads x 3 providers x 2 modes x (speed, memory, memory_extra)
    assert len(rows) == 2 * 3 * 2 * 3 and all(len(r) == 15 for r in rows)
    versions = {"flashkd": flashkd.__version__, "torch": torch.__version__, "floor": torch.__version__}
    for r in map(dict, (zip(header, row) for row in rows)):
        assert r["kernel_name"] == "distill_jsd_loss"
        assert r["kernel_operation_mode"] in ("full", "backward")
        assert (r["x_name"], r["x_label"], r["x_value"]) in {("BT", "B x T", "7"), ("BT", "B x T", "11")}
        assert r["liger_version"] == versions[r["kernel_provider"]]
        assert r["gpu_name"] == env["gpu_name"]
        time.strptime(r["timestamp"], "%Y-%m-%d %H:%M:%S")
        config = json.loads(r["extra_benchmark_config_str"])
        assert list(config)[:3] == ["H", "V", "mode"]  # Liger's keys lead, in Liger's order
        assert (config["H"], config["V"], config["student_H"], config["dtype"]) == (12, 37, 6, "torch.float32")
        assert config["mode"] == r["kernel_operation_mode"]
        p50, p20, p80 = (float(r[k]) for k in ("y_value_50", "y_value_20", "y_value_80"))
        if r["metric_name"] == "speed":
            assert r["metric_unit"] == "ms" and 0 < p20 <= p50 <= p80 < 60_000
        else:  # memory is not measured on CPU: nan, and labelled
            assert r["metric_name"] in ("memory", "memory_extra") and r["metric_unit"] == "MB"
            assert math.isnan(p50) and config["memory"] == "not measured on cpu"
        if r["kernel_provider"] == "floor":
            assert config["status"] == "unchecked" and config["loss_rel_err"] is None
        else:
            assert config["status"] == "passed" and config["dx_rel_err"] <= config["grad_tol"] == 1e-4


@pytest.mark.parametrize("wrong", [_scaled(1.1), Provider(_wrong_grads, lambda: "0")], ids=["loss*1.1", "grads"])
def test_gate_fails_a_wrong_provider_and_does_not_time_it(monkeypatch, tmp_path, wrong):
    monkeypatch.setitem(PROVIDERS, "wrong", wrong)
    results = measure.run(TINY[:1], ["flashkd", "wrong"], ["full", "forward"], FAST)
    ours = [r for r in results if r.provider == "flashkd"]
    bad = [r for r in results if r.provider == "wrong"]
    assert [r.check.status for r in ours] == ["passed", "passed"]
    assert len(bad) == 1 and bad[0].check.status == "FAILED" and bad[0].speed is None
    assert bad[0].check.dx_err > 1e-2
    if wrong.make is not _wrong_grads:
        assert bad[0].check.loss_err == pytest.approx(0.1, rel=1e-3)
    report.write_csv(results, tmp_path / "results.csv", report.environment(FAST))
    report.write_errors(results, tmp_path / "errors.csv")
    assert {r[1] for r in _read(tmp_path / "results.csv")[1:]} == {"flashkd"}
    statuses = {r[1]: r[7] for r in _read(tmp_path / "errors.csv")[1:]}
    assert statuses == {"flashkd": "passed", "wrong": "FAILED"}


def test_a_provider_that_raises_is_reported_and_the_rest_still_run(monkeypatch):
    def make(w, x):
        def loss():
            raise RuntimeError("boom\nsecond line")
        return loss
    monkeypatch.setitem(PROVIDERS, "boom", Provider(make, lambda: "0"))
    results = measure.run(TINY[:1], ["boom", "flashkd"], ["full"], FAST)
    assert [(r.provider, r.check.status, r.check.note) for r in results] == [
        ("boom", "error", "RuntimeError: boom"), ("flashkd", "passed", "")]
    assert results[1].speed is not None


def test_gate_tolerance_is_tighter_for_fp32_than_bf16():
    assert measure.TOLERANCE[torch.float32][1] < measure.TOLERANCE[torch.bfloat16][1] <= 5e-2


def test_reference_in_row_blocks_equals_the_whole(monkeypatch):
    """Large N are referenced block by block (memory); that must change only the order of fp32 sums."""
    w = Workload("jsd", 10, h=12, v=37, dtype="bfloat16")
    x = make_inputs(w, torch.device("cpu"))
    whole = measure.reference(w, x)
    monkeypatch.setattr(measure, "_REFERENCE_BLOCK_BYTES", 3 * w.v * 4)  # 3 rows per block
    blocks = measure.reference(w, x)
    assert whole.dxs.dtype == torch.float32
    for a, b in zip((whole.loss, whole.dxs, whole.dws), (blocks.loss, blocks.dxs, blocks.dws)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def test_default_preset_is_small_on_cpu_and_seed_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    p = cli.plan(cli.parse_bench([]))
    assert (p.preset, p.settings.device.type, p.workloads) == ("small", "cpu", list(PRESETS["small"]))
    assert p.out.name.startswith("bench-")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    p = cli.plan(cli.parse_bench(["bench"]))
    assert (p.preset, p.settings.device.type) == ("seed", "cuda")
    assert [(w.loss, w.n, w.h, w.v, w.dtype) for w in p.workloads] == [
        ("jsd", 8192, 4096, 128256, "bfloat16"), ("cosine", 4096, 4096, 128256, "bfloat16")]
    assert (p.settings.rep_ms, p.settings.warmup_ms) == (500.0, 100.0)


def test_overrides_multiply_the_preset():
    p = cli.plan(cli.parse_bench(["--preset", "seed", "-n", "64", "32", "--loss", "tvd", "jsd", "--dtype", "fp32",
                                  "--beta", "0.3", "--device", "cpu"]))
    assert [(w.loss, w.n) for w in p.workloads] == [("tvd", 32), ("tvd", 64), ("jsd", 32), ("jsd", 64)]
    assert {(w.dtype, w.beta, w.h) for w in p.workloads} == {("float32", 0.3, 4096)}


def test_plots_written(tmp_path):
    pytest.importorskip("matplotlib")
    results = measure.run(TINY, ["torch", "floor"], ["full"], FAST)
    paths = report.write_plots(results, tmp_path, report.environment(FAST))
    assert sorted(p.name for p in paths) == ["memory_jsd_full.png", "speed_jsd_full.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["bench", "--device", "cpu", "-n", "7", "--loss", "jsd", "tvd", "--modes", "full", "no-grad-forward",
            *FAST_ARGS, "--out", str(out)]
    assert cli.main(argv) == 0
    names = {p.name for p in out.iterdir()}
    assert {"results.csv", "errors.csv", "run.json"} <= names
    if "speed_jsd_full.png" not in names:  # plots need matplotlib
        assert "matplotlib is not installed" in capsys.readouterr().out
    else:
        assert {"speed_tvd_no-grad-forward.png", "memory_jsd_full.png"} <= names
    errors = {(r[0], r[1], r[3]): r[7] for r in _read(out / "errors.csv")[1:]}
    assert errors[("distill_jsd_loss", "flashkd", "7")] == "passed"
    assert errors[("distill_tvd_loss", "liger", "7")] == "skipped"  # Liger has no TVD
    providers = {r[1] for r in _read(out / "results.csv")[1:]}
    assert {"flashkd", "torch", "floor"} <= providers
    assert "liger has no fused tvd loss" in capsys.readouterr().out


def test_cli_exit_status_is_1_when_a_provider_fails(monkeypatch, tmp_path):
    monkeypatch.setitem(PROVIDERS, "wrong", _scaled(1.1))
    argv = ["--device", "cpu", "-n", "7", "--loss", "jsd", "--modes", "full", "--providers", "flashkd", "wrong",
            *FAST_ARGS, "--out", str(tmp_path / "run")]
    assert cli.bench_main(argv) == 1


def test_python_dash_m_help():
    src = str(Path(flashkd.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "flashkd.bench", "--help"], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and "--preset" in done.stdout and "--providers" in done.stdout
