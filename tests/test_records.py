"""KernelIndex records: digests against KernelIndex's published test vector, canonical JSON, the Liger
importer, verify, compare, and emit -> verify on a tiny CPU bench run."""

import copy
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from flashkd.bench import measure, report
from flashkd.bench.providers import PROVIDERS, Provider
from flashkd.bench.workloads import Workload
from flashkd.records import (
    bundles_from_results, canonical_json, check_bundle, comparison_key, correctness_key, digest, liger,
)
from flashkd.records.cli import add_records_parser, write_bundles
from flashkd.records.ranking import CPU_CAVEAT, cpu_caveat, groups, ranked
from flashkd.records.emit import harness_commit

# KernelIndex's test vector (tests/data/kernelindex/NOTICE) and Liger-Kernel's published rows, which
# flashkd ships as package data (src/flashkd/records/data/NOTICE).
VECTOR = json.loads((Path(__file__).parent / "data/kernelindex/liger-distill-jsd-forward-h100-bt8192.json").read_text())
CSV_TEXT = liger.bundled_csv()
VECTOR_ID = VECTOR["run"]["manifest"]["spec"]["sourceNative"]["externalId"]
OBJECTS = ("operation", "workload", "implementation", "protocol", "environment", "run")


def _cli(argv):
    import argparse

    parser = argparse.ArgumentParser(prog="flashkd")
    add_records_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.run(args)


def _sha(text):
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


# -- identity ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", OBJECTS)
def test_vector_digests(name):
    assert digest(VECTOR[name]["manifest"]) == VECTOR[name]["digest"]


def test_vector_run_canonical_json():
    m = VECTOR["run"]["manifest"]
    body = canonical_json({"apiVersion": m["apiVersion"], "kind": m["kind"], "spec": m["spec"]})
    assert body == VECTOR["run"]["canonical"]


@pytest.mark.parametrize("value, expected", [
    (1.0, "1"), (100.0, "100"), (-0.0, "0"), (1e-06, "0.000001"), (1e-7, "1e-7"), (1e21, "1e+21"),
    (60.24163055419922, "60.24163055419922"), (0.1 + 0.2, "0.30000000000000004"), (5e-324, "5e-324"),
    ("é😀\u2028", '"é😀\u2028"'), ("\u001f\"\\\n", '"\\u001f\\"\\\\\\n"'),
    ({"b": {"z": 1, "a": [3, {"y": 1, "x": 2}]}, "a": None}, '{"a":null,"b":{"a":[3,{"x":2,"y":1}],"z":1}}'),
    ({"\ue000": 1, "\U0001f600": 2}, '{"😀":2,"\ue000":1}'),  # UTF-16 order: the surrogate D83D sorts first
])
def test_canonical_json(value, expected):
    assert canonical_json(value) == expected


def test_python_json_is_not_canonical():
    value = {"b": 1.0, "a": 1e-06}
    assert json.dumps(value, sort_keys=True, separators=(",", ":")) == '{"a":1e-06,"b":1.0}'
    assert canonical_json(value) == '{"a":0.000001,"b":1}'


def test_metadata_is_not_identity():
    m = copy.deepcopy(VECTOR["run"]["manifest"])
    m["metadata"] = {"name": "other", "labels": {"liger_version": "9"}}
    assert digest(m) == VECTOR["run"]["digest"]


def test_normalisation():
    run = VECTOR["run"]["manifest"]
    spelled = copy.deepcopy(run)
    spelled["spec"]["timing"]["latencyNs"]["median"] = "60241.631 us"
    spelled["spec"]["timing"]["samples"] = None  # optional and absent
    assert digest(spelled) == VECTOR["run"]["digest"]
    spelled["spec"]["timing"]["latencyNs"]["median"] = "60.2416315 ms"  # not a whole ns
    with pytest.raises(ValueError, match="ambiguous duration"):
        digest(spelled)
    impl = copy.deepcopy(VECTOR["implementation"]["manifest"])
    impl["spec"]["support"] = {"hardwareArchitectures": ["sm_90", "sm_80", "sm_90"], "dtypes": ["fp32", "bf16"]}
    same = copy.deepcopy(impl)
    same["spec"]["support"] = {"hardwareArchitectures": ["sm_80", "sm_90"], "dtypes": ["bf16", "fp32"]}
    assert digest(impl) == digest(same) != VECTOR["implementation"]["digest"]
    assert impl["spec"]["support"]["hardwareArchitectures"] == ["sm_90", "sm_80", "sm_90"]  # input untouched


def test_correctness_and_comparison_keys():
    w = VECTOR["workload"]["manifest"]
    assert correctness_key(w) == _sha('{"correctness":{"comparator":"not_asserted"}}')
    key = comparison_key(VECTOR["run"]["manifest"], w, VECTOR["protocol"]["manifest"], VECTOR["environment"]["manifest"])
    assert key == _sha(canonical_json({
        "v": 1, "operation": VECTOR["operation"]["digest"], "workload": VECTOR["workload"]["digest"],
        "protocol": VECTOR["protocol"]["digest"], "environment": VECTOR["environment"]["digest"],
        "correctness": correctness_key(w), "metric": "latency:median:ns",
    }))


# -- Liger import -----------------------------------------------------------------------------------

def _imported():
    return list(liger.import_rows(liger.read_rows(CSV_TEXT)))


def test_import_reproduces_vector():
    bundles = [b for _, b, _ in _imported() if b and b["run"]["manifest"]["spec"]["sourceNative"]["externalId"] == VECTOR_ID]
    assert len(bundles) == 1
    for name in OBJECTS:
        assert bundles[0][name]["manifest"] == VECTOR[name]["manifest"], name
        assert bundles[0][name]["digest"] == VECTOR[name]["digest"], name


def test_import_every_speed_row():
    rows = liger.read_rows(CSV_TEXT)
    out = _imported()
    speed = [line for line, row in enumerate(rows, start=2) if row["metric_name"] == "speed"]
    assert [line for line, b, _ in out if b] == speed
    assert len(speed) == 96
    assert {why for _, b, why in out if b is None} == {"memory row: only speed rows are imported"}
    assert all(check_bundle(b) == [] for _, b, _ in out if b)
    kernels = {b["run"]["manifest"]["spec"]["sourceNative"]["benchmark"].split("/")[0] for _, b, _ in out if b}
    assert kernels == {"distill_jsd_loss", "distill_cosine_loss", "fused_linear_jsd", "jsd"}


def test_import_skips_with_reason():
    row = dict(liger.read_rows(CSV_TEXT)[-1], metric_name="speed")
    for change, reason in (
        ({"kernel_name": "rope"}, "kernel 'rope' is not among"),
        ({"kernel_provider": "triton_magic"}, "unknown provider 'triton_magic'"),
        ({"gpu_name": "NVIDIA H200"}, "unknown GPU 'NVIDIA H200'"),
        ({"kernel_operation_mode": "sideways"}, "unknown timed pass 'sideways'"),
        ({"x_name": "V"}, "x_value or config not understood for jsd with x_name 'V'"),
        ({"y_value_50": "nan"}, "invalid median: expected a positive finite number of ms"),
        ({"timestamp": "garbage"}, "timestamp not understood"),
    ):
        with pytest.raises(liger.Skipped, match=reason):
            liger.bundle_from_row({**row, **change})


def test_import_cli(tmp_path, capsys):
    """Without a CSV the shipped rows are imported; a path to the same rows gives the same bundles."""
    assert _cli(["records", "import-liger", "--out", str(tmp_path / "bundled")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["skipped 44 row(s) (lines 2-13, 54-61, 78-85, 102-109, 134-141): memory row: only speed rows are imported",
                   f"96 bundle(s) from Liger-Kernel's published rows (shipped with flashkd) written to "
                   f"{tmp_path / 'bundled'}, 44 row(s) skipped"]
    files = sorted((tmp_path / "bundled").glob("*.json"))
    assert len(files) == 96
    vector = json.loads((tmp_path / "bundled" / liger.bundle_filename(VECTOR)).read_text())
    assert {k: v["digest"] for k, v in vector.items()} == {k: VECTOR[k]["digest"] for k in OBJECTS}
    csv_path = tmp_path / "rows.csv"
    csv_path.write_text(CSV_TEXT)
    assert _cli(["records", "import-liger", str(csv_path), "--out", str(tmp_path / "named")]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"96 bundle(s) from {csv_path} written to")
    assert [p.read_text() for p in sorted((tmp_path / "named").glob("*.json"))] == [p.read_text() for p in files]


def test_bundled_rows_and_notice():
    """The shipped rows keep Liger-Kernel's copyright and licence notice beside them."""
    from importlib import resources

    data = resources.files("flashkd.records").joinpath("data")
    notice = data.joinpath("LICENSE.liger-kernel").read_text("utf-8")
    assert notice.startswith("BSD 2-CLAUSE LICENSE\nCopyright 2024 LinkedIn Corporation")
    assert "THIS SOFTWARE IS PROVIDED BY THE COPYRIGHT HOLDERS AND CONTRIBUTORS" in notice
    assert "LICENSE.liger-kernel" in data.joinpath("NOTICE").read_text("utf-8")
    rows = liger.read_rows(CSV_TEXT)
    assert len(rows) == 140 and {r["kernel_name"] for r in rows} == set(liger.KERNELS)


def _one_row(tmp_path, **change):
    """A CSV of one speed row of the shipped data (the test vector's), with fields changed."""
    import csv

    row = next(r for r in liger.read_rows(CSV_TEXT) if r["kernel_name"] == "distill_jsd_loss"
               and r["metric_name"] == "speed")
    path = tmp_path / "row.csv"
    with open(path, "w", newline="") as f:
        out = csv.DictWriter(f, fieldnames=liger.COLUMNS)
        out.writeheader()
        out.writerow({**row, **change})
    return path


def _one_line_error(capsys, prefix):
    err = capsys.readouterr().err
    assert err.startswith(prefix) and err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("change, reason", [
    ({"x_value": "9007199254740993"}, "x_value or config not understood"),  # past 2^53 − 1
    ({"x_value": "1e400"}, "x_value or config not understood"),  # Infinity
    ({"x_value": "Infinity"}, "x_value or config not understood"),
    ({"y_value_50": "1e10"}, "latency over 2^53 − 1 ns"),
    ({"y_value_80": "1e300"}, "latency over 2^53 − 1 ns"),
    ({"y_value_50": "Infinity"}, "invalid median"),
    ({"extra_benchmark_config_str": '{"H": 4096, "V": 1e400, "dtype": "torch.bfloat16", "bias": false, '
                                    '"weight_hard_loss": 0.5, "weight_soft_loss": 0.5}'}, "config not understood"),
    ({"extra_benchmark_config_str": '{"H": 4096, "V": 128256, "dtype": "torch.bfloat16", "bias": false, '
                                    '"weight_hard_loss": 1e400, "weight_soft_loss": 0.5}'}, "config not understood"),
    ({"extra_benchmark_config_str": '{"H": 4096, "V": 128256, "dtype": "torch.bfloat16", "bias": false, '
                                    '"weight_hard_loss": 100000000000000000000, "weight_soft_loss": 0.5}'},
     "a number outside what JSON carries exactly"),
    ({"liger_version": "9" * 3000}, "its bundle would not verify: run (BenchmarkRun) schema: "
                                    "metadata/labels/liger_version: '999999999999999999999999…' is too long"),
])
def test_import_never_writes_what_verify_refuses(tmp_path, capsys, change, reason):
    """Numbers outside JSON's safe range, infinities and an over-long version skip the row (with one
    summary line) instead of a traceback or a bundle that `records verify` would then reject."""
    assert _cli(["records", "import-liger", str(_one_row(tmp_path)), "--out", str(tmp_path / "ok")]) == 0
    capsys.readouterr()
    assert _cli(["records", "verify", str(tmp_path / "ok")]) == 0  # the unchanged row imports and verifies
    capsys.readouterr()
    changed = _one_row(tmp_path, **change)
    assert _cli(["records", "import-liger", str(changed), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0].startswith("skipped 1 row(s) (line 2): ") and reason in out[0], out
    assert out[1] == f"0 bundle(s) from {changed} written to {tmp_path / 'out'}, 1 row(s) skipped"
    assert not list((tmp_path / "out").glob("*.json"))


def test_import_out_not_a_writable_folder(tmp_path, capsys, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("")
    for out in (afile, afile / "under"):
        assert _cli(["records", "import-liger", "--out", str(out)]) == 2
        _one_line_error(capsys, f"flashkd records import-liger: --out {out}: ")
    assert afile.read_text() == ""
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.access(locked, os.W_OK):  # root writes anywhere: make the write fail as it would for a user
        def refuse(self, *args, **kwargs):
            raise PermissionError(13, "Permission denied", str(self))
        monkeypatch.setattr(Path, "write_text", refuse)
    assert _cli(["records", "import-liger", "--out", str(locked / "x")]) == 2
    _one_line_error(capsys, f"flashkd records import-liger: --out {locked / 'x'}: Permission denied: ")


def test_import_missing_csv(tmp_path, capsys):
    assert _cli(["records", "import-liger", str(tmp_path / "nope.csv"), "--out", str(tmp_path / "o")]) == 2
    _one_line_error(capsys, f"flashkd records import-liger: {tmp_path / 'nope.csv'}: ")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a":' * 5000 + "1" + "}" * 5000,
                                  '{"run":' + "[" * 200 + "]" * 200 + "}", '{"x": 1e400}'])
@pytest.mark.parametrize("command", ["verify", "compare"])
def test_verify_and_compare_refuse_deep_or_non_json_numbers(tmp_path, capsys, text, command):
    """Deeply nested JSON and numbers past a double's range: a one-line problem and a non-zero exit."""
    path = tmp_path / "deep.json"
    path.write_text(text)
    assert _cli(["records", command, str(path)]) != 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "RecursionError" not in captured.out + captured.err
    lines = [line for line in (captured.out + captured.err).splitlines() if str(path) in line]
    assert len(lines) == 1 and ("nested deeper than 64 levels" in lines[0] or "outside the range" in lines[0]), lines


# -- verify -----------------------------------------------------------------------------------------

# One identity-bearing string per object; each edit changes one character.
EDITS = [
    ("operation", ("spec", "family"), "jsd", "jsx"),
    ("operation", ("spec", "axes", "student_hidden", "expression"), "hidden // 2", "hidden // 3"),
    ("workload", ("spec", "tensors", "target", "dtype"), "int64", "int32"),
    ("workload", ("spec", "correctness", "comparator"), "not_asserted", "not_asserteb"),
    ("implementation", ("spec", "callable", "language"), "triton", "tritom"),
    ("protocol", ("spec", "measurement", "timer"), "cuda_events", "cuda_eventz"),
    ("environment", ("spec", "hardware", "architecture"), "sm_90", "sm_91"),
    ("run", ("spec", "observedAt"), "2024-12-03T07:58:46.000Z", "2024-12-03T07:58:47.000Z"),
    ("run", ("spec", "sourceNative", "benchmark"), "distill_jsd_loss/forward", "distill_jsd_loss/forwarb"),
]


def _edit(bundle, name, path, old, new):
    node = bundle[name]["manifest"]
    for step in path[:-1]:
        node = node[step]
    assert node[path[-1]] == old
    node[path[-1]] = new


def test_vector_verifies():
    assert check_bundle(VECTOR) == []


@pytest.mark.parametrize("name, path, old, new", EDITS)
def test_one_character_edit_is_caught(name, path, old, new):
    bundle = copy.deepcopy(VECTOR)
    bundle[name].pop("canonical", None)
    _edit(bundle, name, path, old, new)
    problems = check_bundle(bundle)
    assert any(p.startswith(f"{name} ({bundle[name]['manifest']['kind']}) digest: stated {VECTOR[name]['digest']}")
               for p in problems), problems
    # Restating the edited object's digest moves the mismatch to whatever refers to it.
    bundle[name]["digest"] = digest(bundle[name]["manifest"])
    referrers = {"operation": ("workload.spec.operationSpecDigest", "implementation.spec.operation.specDigest"),
                 "run": ()}.get(name, (f"run.spec.{name}Digest",))
    problems = check_bundle(bundle)
    assert [p.split(":")[0] for p in problems] == list(referrers)


def test_schema_and_shape_problems():
    bundle = copy.deepcopy(VECTOR)
    bundle["run"]["manifest"]["spec"]["status"] = "passes"
    bundle["protocol"]["manifest"]["spec"]["measurement"]["extra"] = 1
    bundle["environment"]["manifest"]["spec"]["hardware"]["count"] = None
    problems = check_bundle(bundle)
    assert any(p.startswith("run (BenchmarkRun) schema: spec/status: 'passes' is not one of") for p in problems)
    assert any("protocol (BenchmarkProtocol) schema: spec/measurement: Additional properties" in p for p in problems)
    assert any(p.startswith("environment (ExecutionEnvironment) schema: spec/hardware/count: None") for p in problems)
    assert check_bundle({k: VECTOR[k] for k in OBJECTS[:-1]})[0].startswith("expected keys")
    edited = copy.deepcopy(VECTOR)
    edited["run"]["canonical"] = edited["run"]["canonical"].replace("60241631", "60241632", 1)
    assert check_bundle(edited) == ["run (BenchmarkRun): the stated canonical JSON is not the manifest's"]


def test_verify_cli(tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(VECTOR))
    assert _cli(["records", "verify", str(good)]) == 0
    bad = copy.deepcopy(VECTOR)
    bad["run"].pop("canonical")
    _edit(bad, *EDITS[2])
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    capsys.readouterr()
    assert _cli(["records", "verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"{tmp_path / 'bad.json'}: workload (WorkloadCase) digest: stated {VECTOR['workload']['digest']}" in out
    assert out.splitlines()[-1] == "2 bundle(s) checked, 2 problem(s)"


# -- compare ----------------------------------------------------------------------------------------

def test_compare_groups_liger_and_torch(tmp_path, capsys):
    assert _cli(["records", "import-liger", "--out", str(tmp_path)]) == 0
    bundles = [(p, json.loads(p.read_text())) for p in sorted(tmp_path.glob("*.json"))]
    grouped = groups(bundles)
    assert len(grouped) == 48 and all(len(m) == 2 for m in grouped.values())  # liger and torch, every case
    members = next(m for m in grouped.values() if any(b["run"]["digest"] == VECTOR["run"]["digest"] for _, b in m))
    values = [v for _, _, v in ranked(members)]
    assert values == sorted(values) and 60241631 in values
    capsys.readouterr()
    assert _cli(["records", "compare", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "60.2416 ms" in out and "x1.00" in out
    assert CPU_CAVEAT not in out  # Liger's rows were measured on H100s


def test_compare_says_cpu_times_are_no_speed_comparison(tmp_path, capsys):
    """compare ranked CPU runs ("x873.15") without the caveat the site's pages and the bench's table show."""
    env = report.environment(FAST)
    w = Workload("jsd", 7, h=12, v=37, dtype="float32")
    check = measure.Check("passed", 0.0, 0.0, 0.0, measure._tolerance(w, w.torch_dtype))
    results = [measure.Result(w, provider, "0", check, "full", (ms, ms, ms), None, None, "2026-01-01 00:00:00")
               for provider, ms in (("flashkd", 1.0), ("torch", 873.15))]
    write_bundles(bundles_from_results(results, env), tmp_path)
    capsys.readouterr()
    assert _cli(["records", "compare", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first == f"{CPU_CAVEAT} {cpu_caveat([env['gpu_name'].removeprefix('CPU ')] * 2)}", first
    assert first.startswith(f"{CPU_CAVEAT} These runs were timed on a CPU (") and "x873.15" in out


# -- emit -------------------------------------------------------------------------------------------

FAST = measure.Settings(torch.device("cpu"), rep_ms=1.0, warmup_ms=0.0, min_reps=2)


@pytest.fixture
def wrong_provider():
    def make(w, x):
        fn = PROVIDERS["flashkd"].make(w, x)
        return lambda: fn() * 1.5
    PROVIDERS["wrong"] = Provider(make, lambda: "0")
    yield "wrong"
    del PROVIDERS["wrong"]


def test_emit_verify_round_trip(tmp_path, capsys, wrong_provider):
    workloads = [Workload("jsd", 7, h=12, v=37, dtype="float32"), Workload("cosine", 11, h=12, v=37, dtype="float32")]
    results = measure.run(workloads, ["flashkd", "torch", "floor", wrong_provider], ["full", "forward"], FAST)
    env = report.environment(FAST)
    log = tmp_path / "results.csv"
    report.write_csv(results, log, env)
    bundles = bundles_from_results(results, env, commit="0" * 40, repository="https://example.org/flashkd", logs=log)
    # flashkd and torch timed in two modes, wrong once per mode untimed, floor not recorded; per workload.
    assert len(bundles) == 2 * (2 + 2 + 2)
    assert [check_bundle(b) for b in bundles] == [[]] * len(bundles)
    runs = [b["run"]["manifest"]["spec"] for b in bundles]
    statuses = sorted(r["status"] for r in runs)
    assert statuses == ["incorrect_numerical"] * 4 + ["passed"] * 8
    for b in bundles:
        spec, workload = b["run"]["manifest"]["spec"], b["workload"]["manifest"]["spec"]
        assert workload["correctness"]["maxRelativeError"] == max(measure.TOLERANCE[torch.float32])
        assert b["protocol"]["manifest"]["spec"]["harness"] == {
            "name": "flashkd-bench", "version": "0.1.0", "repository": "https://example.org/flashkd", "commit": "0" * 40}
        assert spec["evidence"]["logs"]["digest"] == "sha256:" + hashlib.sha256(log.read_bytes()).hexdigest()
        if spec["status"] == "passed":
            assert isinstance(spec["timing"]["latencyNs"]["median"], int)
            assert spec["correctness"]["maximumRelativeError"] <= 1e-4
        else:
            assert "timing" not in spec and spec["correctness"]["maximumRelativeError"] > 0.1
    jsd = [b for b in bundles if b["operation"]["manifest"]["spec"]["family"] == "jsd"]
    assert {b["operation"]["digest"] for b in jsd} == {VECTOR["operation"]["digest"]}  # Liger's operation
    grouped = groups([(None, b) for b in bundles if b["run"]["manifest"]["spec"]["status"] == "passed"])
    assert sorted(len(m) for m in grouped.values()) == [2, 2, 2, 2]  # flashkd and torch share every group
    paths = write_bundles(bundles, tmp_path)
    assert len(set(paths)) == len(bundles)
    log.rename(tmp_path / "results.txt")
    capsys.readouterr()
    assert _cli(["records", "verify", str(tmp_path)]) == 0
    assert _cli(["records", "compare", str(tmp_path)]) == 0
    assert "incorrect_numerical" in capsys.readouterr().out


def test_harness_commit():
    commit = harness_commit()
    assert commit is None or (len(commit) == 40 and set(commit) <= set("0123456789abcdef"))


def test_an_int_too_large_for_a_double_is_not_a_number_of_a_record():
    """json.loads reads 10**400 as an int, whose math.isfinite raised OverflowError."""
    from flashkd.records import liger

    assert [liger._number(x) for x in (10**400, -(10**400), 5, 1.5, float("inf"), True)] == [
        False, False, True, True, False, False]
