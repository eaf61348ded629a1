"""The benchmark harness on CPU at tiny shapes: CSV schema, correctness gate, presets, plots, CLI."""

import csv
import io
import dataclasses
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
from flashkd.bench.workloads import PRESETS, Workload, expand, make_inputs
from flashkd.records import liger

LIGER_COLUMNS = [
    "kernel_name", "kernel_provider", "kernel_operation_mode", "metric_name", "metric_unit", "x_name", "x_label",
    "x_value", "y_value_50", "y_value_20", "y_value_80", "extra_benchmark_config_str", "gpu_name", "timestamp",
    "liger_version",
]
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
    assert next(csv.reader(io.StringIO(liger.bundled_csv()))) == header  # Liger's published file's header
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


def test_providers_are_timed_in_turn_and_their_calls_pooled(monkeypatch):
    """rounds = 3: per mode, each provider timed 3 times, in turn, every other round reversed; its
    quantiles are those of all its calls; a provider whose timing raises is reported, the rest kept."""
    turns = []

    def fake_time(fn, x, mode, settings):
        name = fn.__name__
        turns.append((mode, name, settings.rep_ms, settings.min_reps))
        if name == "flaky" and len([t for t in turns if t[1] == "flaky"]) == 2:
            raise RuntimeError("lost the GPU")
        return [len(turns) + 0.0] * 2  # each turn's calls: distinct per turn

    def named(name):
        def make(w, x):
            def loss():
                return PROVIDERS["flashkd"].make(w, x)()
            loss.__name__ = name
            return loss
        return Provider(make, lambda: "0")

    for name in ("a", "b", "flaky"):
        monkeypatch.setitem(PROVIDERS, name, named(name))
    monkeypatch.setattr(measure, "_time", fake_time)
    settings = dataclasses.replace(FAST, rep_ms=30.0, min_reps=5, rounds=3)
    results = measure.run(TINY[:1], ["a", "b", "flaky"], ["full", "forward"], settings)
    order = [(mode, name) for mode, name, _, _ in turns]
    rounds = ["a", "b", "flaky"], ["flaky", "b", "a"], ["a", "b", "flaky"]
    assert order == [("full", n) for n in rounds[0] + rounds[1] + rounds[2][:2]] + [  # flaky failed in round 2
        ("forward", n) for n in rounds[0] + rounds[1] + rounds[2]]
    assert {(rep, k) for _, _, rep, k in turns} == {(10.0, 2)}  # rep_ms and min_reps split over the rounds
    by = {(r.provider, r.mode): r for r in results}
    pooled = torch.tensor([1.0, 1, 6, 6, 7, 7], dtype=torch.float64)  # a's calls in turns 1, 6 and 7
    quantiles = torch.quantile(pooled, torch.tensor(measure.QUANTILES, dtype=torch.float64))
    assert by["a", "full"].speed == pytest.approx(tuple(quantiles.tolist()))
    assert by["flaky", "full"].check.status == "error" and by["flaky", "full"].speed is None
    assert by["flaky", "forward"].check.status == "passed" and by["flaky", "forward"].speed is not None
    assert [r.provider for r in results] == ["a", "a", "b", "b", "flaky", "flaky"]


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
    """Speed plots; memory plots only where memory was measured (not on CPU); a workload at one N too."""
    pytest.importorskip("matplotlib")
    results = measure.run([*TINY, Workload("cosine", 5, h=12, v=37, dtype="float32")], ["torch", "floor"],
                          ["full"], FAST)
    paths = report.write_plots(results, tmp_path, report.environment(FAST))
    assert sorted(p.name for p in paths) == ["speed_cosine_full.png", "speed_jsd_full.png"]
    measured = [dataclasses.replace(r, peak=(2.0, 1.0, 3.0), extra=(1.0, 0.5, 1.5)) for r in results]
    paths = report.write_plots(measured, tmp_path, {**report.environment(FAST), "device": "cuda"})
    assert sorted(p.name for p in paths) == ["memory_cosine_full.png", "memory_jsd_full.png",
                                             "speed_cosine_full.png", "speed_jsd_full.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_styles_are_one_per_provider():
    styles = [tuple(report._style(name).values()) for name in PROVIDERS]
    assert len(set(styles)) == len(styles)
    assert report._style("flashkd") == report._style("flashkd") and report._style("unregistered")


def test_warm_up_before_the_first_timed_workload(monkeypatch):
    """A provider's first calls (lazy initialisation, compilation) are slow: they must not be timed.
    On a clock of its own (a shared CPU's wall clock is too noisy): a call takes 1 ms, the first five
    take 200 ms."""
    import types

    now, calls = [0.0], []

    def make(w, x):
        fn = PROVIDERS["flashkd"].make(w, x)

        def loss():
            calls.append(w.n)
            now[0] += 0.2 if len(calls) <= 5 else 0.001
            return fn()
        return loss
    monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=lambda: now[0], strftime=time.strftime,
                                                               gmtime=time.gmtime))
    monkeypatch.setitem(PROVIDERS, "slow_start", Provider(make, lambda: "0"))
    first, second = measure.run(TINY, ["slow_start"], ["full"], FAST)
    assert first.speed == second.speed == pytest.approx((1.0, 1.0, 1.0))  # ms: no slow call timed
    # Warmed up once, before its first workload: its gate call, 3 warm-up calls, the measurement's own
    # warm-up call, then the timed ones; the second workload has the gate and its own warm-up call only.
    assert calls.count(7) == 1 + 3 + 1 + FAST.min_reps and calls.count(11) == 1 + 1 + FAST.min_reps


def test_backward_tables_say_where_gradients_are_computed():
    results = measure.run(TINY[:1], ["flashkd", "torch", "floor"], ["backward", "full"], FAST)
    titles = [title for title, _, _ in report.tables(results)]
    backward = next(t for t in titles if " · backward · " in t)
    assert "flashkd computes gradients in forward: its backward only scales them" in backward
    assert "(one pass over dX and dW, no loss math)" in backward and "≈ 0" not in backward
    assert not any("gradients in forward" in t for t in titles if " · backward · " not in t)
    # on CPU, what that pass's wall clock is made of (flashkd's and Liger's alike)
    lines = report.notes(results, {"device": "cpu", "timer": "time.perf_counter", "cpu_threads": 2})
    assert any(line.startswith("backward: that pass over dX and dW is small; on a CPU its wall clock is mostly "
                               "waking torch's threads") for line in lines)
    assert any("not a speed comparison" in line for line in lines)
    assert not any(line.startswith("backward:") for line in report.notes(
        results, {"device": "cpu", "timer": "time.perf_counter", "cpu_threads": 1}))


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
        assert "speed_tvd_no-grad-forward.png" in names and not any(n.startswith("memory_") for n in names)
    errors = {(r[0], r[1], r[3]): r[7] for r in _read(out / "errors.csv")[1:]}
    assert errors[("distill_jsd_loss", "flashkd", "7")] == "passed"
    assert errors[("distill_tvd_loss", "liger", "7")] == "skipped"  # Liger has no TVD
    providers = {r[1] for r in _read(out / "results.csv")[1:]}
    assert {"flashkd", "torch", "floor"} <= providers
    said = capsys.readouterr().out
    assert "liger has no fused tvd loss" in said
    last = said.strip().splitlines()[-1]  # every file, where it is
    assert last.startswith(f"wrote {out / 'results.csv'}, {out / 'errors.csv'}, {out / 'run.json'}, ")
    assert f" KernelIndex records {out / 'records' / '*.json'}, their site (" in last
    assert last.endswith(f" {out / 'site' / 'index.html'}") and (out / "site" / "index.html").is_file()


def test_cli_exit_status_is_1_when_a_provider_fails(monkeypatch, tmp_path):
    monkeypatch.setitem(PROVIDERS, "wrong", _scaled(1.1))
    argv = ["--device", "cpu", "-n", "7", "--loss", "jsd", "--modes", "full", "--providers", "flashkd", "wrong",
            *FAST_ARGS, "--out", str(tmp_path / "run")]
    assert cli.bench_main(argv) == 1


def _refused(capsys, argv, message):
    """The bench exits with one line naming the problem, and leaves no folder behind."""
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", *argv])
    said = str(e.value.code) if not isinstance(e.value.code, int) else capsys.readouterr().err.strip().splitlines()[-1]
    assert message in said and "\n" not in said, said
    return said


@pytest.mark.parametrize("argv, message", [
    *((["--rep", v], f"argument --rep: expected a finite number of ms above 0, got {v}") for v in ("inf", "0", "nan")),
    *((["--warmup", v], f"argument --warmup: expected a finite number of ms, 0 or more, got {v}") for v in ("inf", "-1")),
    *((["--device", v], f"flashkd bench: --device: expected cpu, cuda or cuda:N, got {v!r}") for v in ("nope", "mps")),
])
def test_bench_refuses_bad_options(tmp_path, capsys, argv, message):
    _refused(capsys, [*argv, "-n", "7", *FAST_ARGS[:4], "--out", str(tmp_path / "run")], message)
    assert not (tmp_path / "run").exists()


def test_bench_refuses_a_cuda_device_it_does_not_have(tmp_path, capsys, monkeypatch):
    out = ["--out", str(tmp_path / "run")]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _refused(capsys, ["--device", "cuda", *out], "flashkd bench: --device cuda: CUDA is not available")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    _refused(capsys, ["--device", "cuda:3", *out], "--device cuda:3: this machine has 1 CUDA device(s)")
    assert not (tmp_path / "run").exists()


def test_bench_refuses_an_out_it_cannot_use(tmp_path, capsys, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("keep")
    _refused(capsys, ["--device", "cpu", "--out", str(afile)], f"--out {afile}: exists and is not a folder")
    _refused(capsys, ["--device", "cpu", "--out", str(afile / "run")], f"--out {afile / 'run'}: {afile} is not a folder")
    assert afile.read_text() == "keep"
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as an unwritable folder answers (root writes anywhere)
    _refused(capsys, ["--device", "cpu", "--out", str(tmp_path / "new" / "run")], f"{tmp_path} is not writable")
    assert not (tmp_path / "new").exists()


def test_bench_refuses_a_reused_out(tmp_path, capsys):
    """A second run into the same --out would mix its records/ with the first's: refused, nothing touched."""
    out = tmp_path / "run"
    argv = ["bench", "--device", "cpu", "-n", "7", "--loss", "jsd", "--modes", "full", "--providers", "flashkd",
            *FAST_ARGS, "--out", str(out)]
    assert cli.main(argv) == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    _refused(capsys, argv[1:], f"--out {out}: not empty")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    (tmp_path / "empty").mkdir()  # an empty folder is fine
    argv[-1] = str(tmp_path / "empty")
    assert cli.main(argv) == 0


def test_python_dash_m_help():
    src = str(Path(flashkd.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "flashkd.bench", "--help"], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and "--preset" in done.stdout and "--providers" in done.stdout


# -- the teacher's forms: dense logits, top-k, and teacher_topk ---------------------------------------

TINY_TOPK = Workload("forward_kl", 11, h=12, v=37, dtype="float32", weight_hard=0.0, weight_soft=1.0, form="topk", k=5)
TINY_LOGITS = Workload("jsd", 11, h=12, v=37, dtype="float32", form="logits")
TINY_TEACHER_TOPK = Workload(n=11, h=12, v=37, dtype="float32", form="teacher_topk", k=5)
FORMS = {
    "topk-bucket": TINY_TOPK,
    "topk-renormalize-jsd-hard": dataclasses.replace(TINY_TOPK, loss="jsd", tail="renormalize", weight_hard=0.5,
                                                     temperature=2.0),
    "logits": TINY_LOGITS,
    "teacher_topk": TINY_TEACHER_TOPK,
}


@pytest.mark.parametrize("w", FORMS.values(), ids=FORMS.keys())
def test_forms_run_end_to_end(w):
    results = measure.run([w], ["flashkd", "torch", "liger", "floor"], list(measure.MODES), FAST)
    by = {}
    for r in results:
        by.setdefault(r.provider, []).append(r)
    timed_modes = list(measure.MODES) if w.has_grad else ["no-grad-forward"]
    for name in ("flashkd", "torch", "floor"):
        assert [r.mode for r in by[name]] == timed_modes and all(r.speed is not None for r in by[name])
    assert {r.check.status for r in by["flashkd"] + by["torch"]} == {"passed"}
    assert {r.check.status for r in by["floor"]} == {"unchecked"}
    [liger] = by["liger"]
    assert liger.check.status == "skipped" and liger.check.note.startswith("liger has no ")
    if w.has_grad:
        assert all(r.check.dx_err <= 1e-4 and math.isnan(r.check.ids_err) for r in by["flashkd"])
    else:  # ids and probabilities checked; no gradients
        assert all(r.check.ids_err <= 1e-4 and r.check.loss_err <= 1e-4 for r in by["flashkd"] + by["torch"])
        assert math.isnan(by["flashkd"][0].check.dx_err)


def _form_wrong_providers():
    """Per new form, providers with a plausible bug: each must fail the gate."""
    def topk_other_tail(w, x):
        other = "renormalize" if w.tail == "bucket" else "bucket"
        return PROVIDERS["flashkd"].make(dataclasses.replace(w, tail=other), x)

    def logits_rows_shifted(w, x):  # the teacher's logits one row off from the student's
        return PROVIDERS["flashkd"].make(w, x._replace(tl=x.tl.roll(1, dims=0)))

    def teacher_topk_ranks_2_to_k1(w, x):  # an off-by-one in the ranking: the top id dropped
        def fn():
            ids, lp = PROVIDERS["torch"].make(dataclasses.replace(w, k=w.k + 1), x)()
            return ids[:, 1:], lp[:, 1:]
        return fn

    def teacher_topk_unnormalised(w, x):  # logits/τ instead of log-probs (no logsumexp)
        def fn():
            ids, _ = PROVIDERS["torch"].make(w, x)()
            return ids, (x.xt @ x.wt.t()).gather(1, ids) / w.temperature
        return fn

    def teacher_topk_repeated(w, x):  # the top id twice, the k-th dropped: values nearly right
        def fn():
            ids, lp = PROVIDERS["torch"].make(w, x)()
            ids[:, -1], lp[:, -1] = ids[:, 0], lp[:, 0]
            return ids, lp
        return fn

    return [
        (TINY_TOPK, _scaled(1.1)), (TINY_TOPK, Provider(_wrong_grads, lambda: "0")),
        (TINY_TOPK, Provider(topk_other_tail, lambda: "0")),
        (TINY_LOGITS, _scaled(1.1)), (TINY_LOGITS, Provider(_wrong_grads, lambda: "0")),
        (TINY_LOGITS, Provider(logits_rows_shifted, lambda: "0")),
        (TINY_TEACHER_TOPK, Provider(teacher_topk_ranks_2_to_k1, lambda: "0")),
        (TINY_TEACHER_TOPK, Provider(teacher_topk_unnormalised, lambda: "0")),
        (TINY_TEACHER_TOPK, Provider(teacher_topk_repeated, lambda: "0")),
    ]


@pytest.mark.parametrize("w, wrong", _form_wrong_providers(), ids=[
    "topk-loss*1.1", "topk-grads", "topk-other-tail", "logits-loss*1.1", "logits-grads", "logits-rows-shifted",
    "teacher_topk-off-by-one", "teacher_topk-unnormalised", "teacher_topk-repeated-id"])
def test_gate_fails_a_wrong_provider_of_each_form(monkeypatch, w, wrong):
    monkeypatch.setitem(PROVIDERS, "wrong", wrong)
    results = measure.run([w], ["flashkd", "wrong"], ["full", "no-grad-forward"], FAST)
    ours = [r for r in results if r.provider == "flashkd"]
    [bad] = [r for r in results if r.provider == "wrong"]
    assert ours and {r.check.status for r in ours} == {"passed"}
    assert bad.check.status == "FAILED" and bad.speed is None


def test_topk_gate_tolerates_ties_within_rounding_only():
    """teacher_topk's ids are a set; at the k-th place any id tied with the k-th value within the
    tolerance (relative to the row's max |logit|) is as right as the reference's own pick."""
    w = dataclasses.replace(TINY_TEACHER_TOPK, n=3)
    x = make_inputs(w, torch.device("cpu"))
    xt = x.xt[:1].expand(3, -1).contiguous()  # one row thrice: one ranking
    z = xt[0] @ x.wt.t()  # (V,)
    order = z.argsort(descending=True)
    kth, twin = order[w.k - 1], order[w.v // 2]  # a middling id (not the row's max |z|) becomes the k-th's twin
    tol = measure.TOLERANCE[torch.float32][0]
    for gap, ok in ((0.0, True), (0.3 * tol, True), (10 * tol, False)):
        wt = x.wt.clone()
        # z_twin = z_kth − gap · max|z|, exactly up to fp32 rounding
        wt[twin] = wt[kth] - gap * z.abs().max() * xt[0] / xt[0].square().sum()
        ids = torch.cat([order[: w.k - 1].flip(0), twin[None]])[None].expand(3, -1).contiguous()  # any order
        lp = torch.log_softmax(xt @ wt.t(), dim=-1).gather(1, ids)
        x2 = x._replace(xt=xt, wt=wt)
        check = measure._gate_topk(lambda: (ids, lp), x2, measure.reference(w, x2), w)
        assert (check.status == "passed") == ok, (gap, check)
        assert check.ids_err == pytest.approx(gap, abs=1e-6)


def test_forms_have_their_own_kernel_names_and_identity():
    heads = Workload("jsd", 7, h=12, v=37, dtype="float32")
    # The heads form is exactly what it was: Liger's kernel name and config keys.
    assert heads.kernel_name == "distill_jsd_loss" and Workload("cosine").kernel_name == "distill_cosine_loss"
    assert heads.config() == {
        "H": 12, "V": 37, "dtype": "torch.float32", "bias": False, "weight_hard_loss": 0.5, "weight_soft_loss": 0.5,
        "ignore_index": -100, "beta": 0.5, "temperature": 1.0, "student_H": 6, "seed": 0, "loss": "jsd"}
    forms = [heads, dataclasses.replace(heads, form="logits"), dataclasses.replace(heads, form="topk", k=5),
             dataclasses.replace(heads, form="topk", k=5, tail="renormalize"),
             dataclasses.replace(heads, form="topk", k=6), dataclasses.replace(heads, form="teacher_topk", k=5)]
    assert [w.kernel_name for w in forms] == [
        "distill_jsd_loss", "distill_logits_jsd_loss", "distill_topk_jsd_loss", "distill_topk_jsd_loss",
        "distill_topk_jsd_loss", "teacher_topk"]
    assert TINY_TOPK.kernel_name == "distill_topk_forward_kl_loss"
    configs = [json.dumps(w.config(), sort_keys=True) for w in forms]
    assert len(set(configs)) == len(forms)  # each form (and K, tail) is its own case
    assert forms[3].config()["tail"] == "renormalize" and forms[4].config()["k"] == 6
    assert "loss" not in forms[-1].config()
    from flashkd.records import digest
    from flashkd.records.emit import operation, workload

    digests = [digest(workload(w, digest(operation(w)))) for w in forms]
    assert len(set(digests)) == len(forms)
    with pytest.raises(ValueError, match="form: expected one of"):
        Workload(form="dense")
    with pytest.raises(ValueError, match="k: expected 1 <= k <= V = 37"):
        Workload(v=37, form="topk", k=38)


def test_expand_gives_each_form_its_case_once():
    base = (Workload("jsd", 8, form="teacher_topk", k=64), Workload("jsd", 8, form="topk", k=64))
    out = expand(base, loss=["jsd", "tvd"], v=37)
    # teacher_topk has no loss to multiply; the preset's K is cut to the smaller V
    assert [(w.tag, w.k) for w in out] == [("teacher_topk", 37), ("topk_jsd", 37), ("topk_tvd", 37)]
    assert expand((Workload("jsd", 8, k=5),), v=37) == [Workload("jsd", 8, v=37)]  # K means nothing to heads


def test_gpu_presets_of_the_forms():
    shape = dict(n=8192, h=4096, v=128256, dtype="bfloat16")
    [topk] = PRESETS["topk"]
    assert topk == Workload("forward_kl", weight_hard=0.0, weight_soft=1.0, form="topk", k=64, tail="bucket", **shape)
    [logits] = PRESETS["logits"]
    assert logits == Workload("jsd", weight_hard=0.5, weight_soft=0.5, form="logits", **shape)
    [teacher] = PRESETS["teacher-topk"]
    assert teacher == Workload(form="teacher_topk", k=64, **shape) and teacher.hs == 2048


def test_cli_teacher_topk_times_no_grad_forward_only(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["bench", "--device", "cpu", "--preset", "teacher-topk", "-n", "7", "--k", "5", "--dtype", "fp32",
            "--providers", "flashkd", "torch", *FAST_ARGS, "--out", str(out)]
    assert cli.main(argv) == 0
    said = capsys.readouterr().out
    assert "teacher_topk: no gradient, so only no-grad-forward applies; not timed: full, forward, backward" in said
    rows = _read(out / "results.csv")[1:]
    assert {(r[0], r[2]) for r in rows} == {("teacher_topk", "no-grad-forward")}
    config = json.loads(rows[0][11])
    assert (config["form"], config["k"], config["ids_err"] <= config["loss_tol"]) == ("teacher_topk", 5, True)
    assert [r[7] for r in _read(out / "errors.csv")[1:]] == ["passed", "passed"]
    # nothing that applies: checked, reported, not timed, no crash
    argv[argv.index("--out") + 1] = str(tmp_path / "none")
    assert cli.main([*argv, "--modes", "full"]) == 0
    assert _read(tmp_path / "none" / "results.csv")[1:] == []
    assert [r[7] for r in _read(tmp_path / "none" / "errors.csv")[1:]] == ["passed", "passed"]


def test_records_of_the_forms_verify(tmp_path, capsys, monkeypatch):
    from flashkd.records import bundles_from_results, check_bundle, write_bundles

    monkeypatch.setitem(PROVIDERS, "wrong", _scaled(1.1))
    workloads = [TINY_TOPK, dataclasses.replace(TINY_TOPK, tail="renormalize"), TINY_LOGITS, TINY_TEACHER_TOPK]
    results = measure.run(workloads, ["flashkd", "torch", "floor", "wrong"], ["full", "no-grad-forward"], FAST)
    env = report.environment(FAST)
    report.write_csv(results, tmp_path / "results.csv", env)
    bundles = bundles_from_results(results, env, logs=tmp_path / "results.csv")
    assert [check_bundle(b) for b in bundles] == [[]] * len(bundles)
    kinds = {}
    for b in bundles:
        run = b["run"]["manifest"]
        kinds.setdefault(run["metadata"]["title"].split(" · ")[0], set()).add(run["spec"]["status"])
    assert kinds == {"distill_topk_forward_kl_loss": {"passed", "incorrect_numerical"},
                     "distill_logits_jsd_loss": {"passed", "incorrect_numerical"},
                     "teacher_topk": {"passed", "runtime_error"}}
    # teacher_topk: each provider in its one mode; "wrong" scales a loss and so raises on its (ids, logprobs)
    teacher = [b for b in bundles if b["workload"]["manifest"]["spec"]["correctness"]["comparator"]
               == "fp32_reference_topk_ids_up_to_ties"]
    assert len(teacher) == 3 and all("no-grad-forward" in b["protocol"]["manifest"]["metadata"]["name"]
                                     for b in teacher)
    tails = {b["workload"]["digest"] for b in bundles if "topk_forward_kl" in b["run"]["manifest"]["metadata"]["title"]}
    assert len(tails) == 2  # bucket and renormalize are different cases
    write_bundles(bundles, tmp_path / "records")
    capsys.readouterr()
    assert cli.main(["records", "verify", str(tmp_path / "records")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"{len(bundles)} bundle(s) checked, 0 problem(s)"


def test_models_preset_lists_the_model_families_heads():
    from flashkd.bench.workloads import MODEL_HEADS
    from flashkd.losses import LOSSES

    models = PRESETS["models"]
    shapes = {(w.n, w.hs, w.h, w.v) for w in models}
    # the shapes of the table of measured heads, each at its N
    for shape in [(16384, 2048, 3072, 128256), (16384, 1024, 4096, 151936), (8192, 2560, 3840, 262144),
                  (8192, 3072, 5120, 200064), (8192, 4096, 8192, 128256)]:
        assert shape in shapes
    families = {label.split()[0].split("-")[0] for label, *_ in MODEL_HEADS}
    assert {"Llama", "Qwen3", "Gemma", "Phi", "Ministral"} <= families
    # every head at N 8192 and 16384, every loss, bf16 and a trained head's magnitudes, the student narrower
    assert shapes == {(n, hs, ht, v) for _, hs, ht, v in MODEL_HEADS for n in (8192, 16384)}
    assert len(models) == len(MODEL_HEADS) * 2 * len(LOSSES) == len(set(models))
    for w in models:
        assert (w.form, w.dtype, w.inputs, w.student_h) == ("heads", "bfloat16", "trained", w.hs)
        assert w.hs < w.h and w.hs % 8 == 0 and w.h % 8 == 0
    assert {w.loss for w in models} == set(LOSSES)
    # -n, --loss narrow it as any preset; sized for a GPU, so a CPU refuses it without --large-on-cpu
    narrowed = expand(PRESETS["models"], n=[8192], loss=["jsd", "cosine"])
    assert len(narrowed) == len(MODEL_HEADS) * 2 and {(w.hs, w.h) for w in narrowed} == {(hs, ht) for _, hs, ht, _ in MODEL_HEADS}
    args = cli.parse_bench(["--preset", "models", "--device", "cpu"])
    with pytest.raises(cli.UsageError, match="sized for a GPU"):
        cli.plan(args)


def test_a_student_of_its_own_width(tmp_path, capsys):
    """student_h sets the student's hidden size (a model pair); its records name that axis and verify."""
    from flashkd.records import bundles_from_results, check_bundle

    assert Workload("jsd", 7, h=12, v=37, student_h=6).canonical() == Workload("jsd", 7, h=12, v=37)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="student_h: expected None or a positive int"):
            Workload(student_h=bad)
    w = Workload("jsd", 7, h=12, v=37, dtype="float32", student_h=8)
    x = make_inputs(w, torch.device("cpu"))
    assert x.xs.shape == (7, 8) and x.ws.shape == (37, 8) and x.xt.shape == (7, 12)
    assert w.config()["student_H"] == 8 and "student 8" in w.describe()
    results = measure.run([w, TINY[0]], ["flashkd", "floor"], ["full"], FAST)
    assert {r.check.status for r in results if r.provider == "flashkd"} == {"passed"}
    bundles = bundles_from_results(results, report.environment(FAST), logs=None)
    assert [check_bundle(b) for b in bundles] == [[]] * len(bundles)
    own = [b for b in bundles if b["workload"]["manifest"]["spec"]["axes"].get("student_hidden") == 8]
    assert own and all(b["workload"]["manifest"]["spec"]["tensors"]["student_input"]["shape"] == [7, 8] for b in own)
    assert len({b["workload"]["digest"] for b in bundles}) == 2  # not the hidden/2 case's
