"""The two command-line tools (`flashkd bench`, `flashkd records ...`) fed what a user may feed them: odd
options, damaged or duplicated bundles, odd CSVs. Every refusal is one line naming the argument, with
exit status 2 for a usage error, and nothing is silently skipped or served unchecked. CPU, tiny shapes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import flashkd
from flashkd.bench import cli

FAST = ["--device", "cpu", "--h", "12", "--v", "37", "--rep", "1", "--warmup", "0", "--min-reps", "2"]


def _usage_error(capsys, argv) -> str:
    """`flashkd bench argv` is refused as a usage error: exit status 2 and one line on stderr (also for
    the errors argparse finds: no usage block); that line."""
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", *argv])
    assert e.value.code == 2, e.value.code
    err = capsys.readouterr().err.strip()
    assert err and "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[-1]


# -- flashkd bench: options ---------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["-n", "1e3"], "argument -n/--n: expected a positive integer, got 1e3"),
    (["-n", "0"], "argument -n/--n: expected a positive integer, got 0"),
    (["--softcap", "nan"], "argument --softcap: expected a finite number, got nan"),
    (["--beta", "inf"], "argument --beta: expected a finite number, got inf"),
    (["--weight-hard", "nan"], "argument --weight-hard: expected a finite number, got nan"),
    (["--softcap", "0"], "flashkd bench: --softcap: expected a finite float > 0"),
    (["--softcap", "-1"], "flashkd bench: --softcap: expected a finite float > 0"),
    (["--beta", "2"], "flashkd bench: --beta: expected a value in [0, 1], got 2.0"),
    (["--temperature", "0"], "flashkd bench: --temperature: expected a value > 0, got 0.0"),
    (["--k", "100"], "flashkd bench: --k: expected 1 <= k <= V = 37, got 100"),
    (["--form", "topk", "--loss", "cosine"], "flashkd bench: --loss: expected one of"),
    # the small preset's cosine: the user named no loss, so the message names what they did name
    (["--form", "topk"], "flashkd bench: --form topk: a loss of preset small is not one of this form's: expected one "
                         "of 'jsd', 'forward_kl', 'reverse_kl', 'tvd', 'skew_kl', 'skew_reverse_kl', 'akl', 'jeffreys', "
                         "'alpha_divergence', 'renyi', 'renyi_reverse', 'ab_divergence', 'triangular', 'entropy_adaptive' "
                         "for a top-k teacher, got 'cosine'; name the losses with --loss"),
    (["--h", "1"], "flashkd bench: --h: expected at least 2"),
    (["--device", "nope"], "flashkd bench: --device: expected cpu, cuda or cuda:N, got 'nope'"),
    (["--preset", "seed", "--teacher-precision", "fp8"],
     "flashkd bench: --teacher-precision fp8: needs a CUDA GPU with FP8 tensor cores (sm_89 or newer), not --device cpu"),
    # a list option given twice: argparse kept the last list in silence (N=16 alone, tvd alone)
    (["-n", "8", "--n", "16"], "flashkd bench: error: argument -n/--n: expected once, got -n 8 and --n 16; give its "
                               "values together: -n 8 16"),
    (["--loss", "jsd", "--loss", "tvd"], "argument --loss: expected once, got --loss jsd and --loss tvd; give its "
                                         "values together: --loss jsd tvd"),
    (["--modes", "full", "--modes", "forward"], "argument --modes: expected once"),
    # an option no workload reads: Workload.canonical dropped it in silence
    (["--form", "logits", "--k", "4"], "flashkd bench: --k: no workload of this run reads it: it is for form(s) topk, "
                                       "teacher_topk, and this run (preset small, --form logits) has form(s) logits"),
    (["--form", "heads", "--tail", "renormalize"], "flashkd bench: --tail: no workload of this run reads it: it is for "
                                                   "form(s) topk,"),
    (["--form", "teacher_topk", "--loss", "tvd"], "flashkd bench: --loss: no workload of this run reads it"),
    (["--preset", "teacher-topk", "--weight-soft", "1"], "flashkd bench: --weight-soft: no workload of this run reads "
                                                         "it: it is for form(s) heads, logits, topk, and this run "
                                                         "(preset teacher-topk) has form(s) teacher_topk"),
])
def test_bench_usage_errors_exit_2_naming_the_option(tmp_path, capsys, argv, message):
    err = _usage_error(capsys, [*FAST, *argv, "--out", str(tmp_path / "run")])
    assert message in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("preset", ["seed", "sweep", "topk", "logits", "teacher-topk"])
def test_bench_refuses_gpu_sized_presets_on_cpu_unless_asked(tmp_path, capsys, preset):
    """`--preset sweep` on a CPU ran for minutes printing nothing (hours to finish): refused up front,
    one line saying why and what to do; --large-on-cpu runs it (here only planned)."""
    err = _usage_error(capsys, ["--device", "cpu", "--preset", preset, "--out", str(tmp_path / "run")])
    assert "is sized for a GPU: " in err and "TFLOP of GEMMs a call" in err, err
    assert err.endswith("use --preset small there, or smaller -n/--h/--v, or --large-on-cpu to run it anyway")
    p = cli.plan(cli.parse_bench(["--device", "cpu", "--preset", preset, "--large-on-cpu", "--out", str(tmp_path / "run")]))
    assert p.workloads and not (tmp_path / "run").exists()
    # shrunk to a CPU's size, the preset runs without the flag
    cli.plan(cli.parse_bench(["--device", "cpu", "--preset", preset, "-n", "64", "--h", "64", "--v", "1000"]))


def test_bench_says_what_it_runs_when_not_on_a_terminal(tmp_path, capsys):
    """No terminal (a log, a pipe): no progress bar, so a line as each workload starts, and on a CPU that
    the times are no speed comparison."""
    i = TINY_RUN.index("--loss")
    argv = [*TINY_RUN[:i], "--loss", "jsd", "tvd", *TINY_RUN[i + 2:]]  # two workloads
    assert cli.main(["bench", *argv, "--out", str(tmp_path / "run")]) == 0
    said = capsys.readouterr().out.splitlines()
    assert "flashkd bench: on a CPU the times are wall clock on this machine: a check that every provider runs and " \
           "is right, not a speed comparison of the kernels (they are built for GPUs)" in said
    started = [line for line in said if line.startswith("flashkd bench: workload ")]
    assert [line.split(" (")[0] for line in started] == ["flashkd bench: workload 1/2, jsd N=7",
                                                          "flashkd bench: workload 2/2, tvd N=7"]
    assert started[0].endswith("(step 0 of 8, 0:00 elapsed)")


def test_bench_out_errors_exit_2(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep")
    assert "exists and is not a folder" in _usage_error(capsys, [*FAST, "--out", str(afile)])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert "not empty" in _usage_error(capsys, [*FAST, "--out", str(tmp_path / "full")])
    with pytest.raises(SystemExit) as e:  # python -m flashkd.bench, the same
        cli.bench_main([*FAST, "--out", str(afile)])
    assert e.value.code == 2 and "exists and is not a folder" in capsys.readouterr().err


def test_bench_usage_error_from_the_console_entry_point(tmp_path):
    """The real entry point: exit status 2, one line, no traceback."""
    src = str(Path(flashkd.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "flashkd", "bench", *FAST, "--softcap", "0", "--out",
                           str(tmp_path / "run")], capture_output=True, text=True, env=env)
    assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stdout)
    assert done.stderr.strip() == "flashkd bench: --softcap: expected a finite float > 0 (or None for no cap), got 0.0"


def _entry_point(*argv):
    src = str(Path(flashkd.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "flashkd", *argv], capture_output=True, text=True, env=env)


@pytest.mark.parametrize("argv, line", [
    (["bench", "--loss", "foo"], "flashkd bench: error: argument --loss: invalid choice: 'foo' (choose from "),
    (["bench", "--modes", "fwd"], "flashkd bench: error: argument --modes: invalid choice: 'fwd' (choose from "),
    (["bench", "-n", "0"], "flashkd bench: error: argument -n/--n: expected a positive integer, got 0"),
    (["records", "site", "x"], "flashkd records site: error: the following arguments are required: --out"),
    (["records", "nope"], "flashkd records: error: argument command: invalid choice: 'nope'"),
])
def test_argparse_usage_errors_are_one_line(argv, line):
    """argparse's own errors as flashkd's are: one line naming the argument (and where the options are
    listed), exit status 2; not its usage block."""
    done = _entry_point(*argv)
    assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stdout)
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(line), done.stderr
    assert done.stderr.rstrip().endswith(f"(see flashkd{''.join(' ' + a for a in argv[:2] if a in ('bench', 'records', 'site'))} --help)")


def test_help_lists_every_records_command():
    done = _entry_point("--help")
    assert done.returncode == 0
    assert "import-liger, verify, compare, site" in " ".join(done.stdout.split())
    records = _entry_point("records", "--help").stdout
    listed = {line.split()[0] for line in records.split("positional arguments:")[1].splitlines()[2:] if line.startswith("    ")
              and line.split()}
    assert {"import-liger", "verify", "compare", "site"} <= listed, records


@pytest.mark.parametrize("seed", ["-1", str(2**53), "1.5"])
def test_bench_refuses_a_seed_no_record_can_carry(tmp_path, capsys, seed):
    """A negative seed ran, and wrote records that `records verify` refuses (the site then had 0 runs)."""
    err = _usage_error(capsys, [*FAST, "--seed", seed, "--out", str(tmp_path / "run")])
    assert f"argument --seed: expected an integer from 0 to 2^53 - 1 (what a record carries), got {seed}" in err


TINY_RUN = [*FAST, "-n", "7", "--preset", "seed", "--loss", "jsd", "--modes", "full", "--providers", "flashkd", "torch"]


def _liger_not_installed(monkeypatch):
    from flashkd.bench import providers

    def make(w, x):  # as when liger-kernel cannot be imported: its make skips every workload
        raise providers.Skip(why())

    def why():
        return "liger-kernel is not importable (No module named 'liger_kernel'); pip install liger-kernel==0.8.5"
    monkeypatch.setitem(providers.PROVIDERS, "liger", providers.Provider(make, lambda: "not installed", missing=why))


def test_bench_refuses_a_named_provider_that_is_not_installed(tmp_path, capsys, monkeypatch):
    """`--providers liger` without liger-kernel ran, skipped it in every row and exited 0."""
    _liger_not_installed(monkeypatch)
    err = _usage_error(capsys, [*FAST, "--providers", "flashkd", "liger", "--out", str(tmp_path / "run")])
    assert err == ("flashkd bench: --providers liger: liger-kernel is not importable (No module named 'liger_kernel'); "
                   "pip install liger-kernel==0.8.5")
    assert not (tmp_path / "run").exists()


def test_bench_skips_a_default_provider_that_is_not_installed_with_a_note(tmp_path, capsys, monkeypatch):
    _liger_not_installed(monkeypatch)
    argv = [a for a in TINY_RUN if a not in ("--providers", "flashkd", "torch")]  # the default providers
    assert cli.main(["bench", *argv, "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "liger: liger-kernel is not importable (No module named 'liger_kernel'); pip install liger-kernel==0.8.5" in out
    assert json.loads((tmp_path / "run" / "run.json").read_text())["providers"] == ["flashkd", "liger", "torch", "floor"]


def test_bench_checks_its_records_before_writing_them(tmp_path, capsys, monkeypatch):
    """A record that would not verify is not written: said, and the exit status is 1."""
    import flashkd.records as records

    made = records.bundles_from_results

    def damaged(*args, **kwargs):
        bundles = made(*args, **kwargs)
        bundles[0]["workload"]["manifest"]["spec"]["tensors"]["target"]["data"]["seed"] = -1
        return bundles
    monkeypatch.setattr(records, "bundles_from_results", damaged)
    out = tmp_path / "run"
    assert cli.main(["bench", *TINY_RUN, "--out", str(out)]) == 1
    said = capsys.readouterr().out
    assert "records: not written, distill_jsd_loss · flashkd · full · N=7 would not verify: workload (WorkloadCase) " \
           "schema: spec/tensors/target/data/seed: -1 is less than the minimum of 0" in said
    assert len(list((out / "records").glob("*.json"))) == 1  # torch's
    assert "1 KernelIndex records" in said.strip().splitlines()[-1]


def test_bench_huge_n(tmp_path, capsys):
    """An N past int64 was a traceback from torch.rand; one no machine can hold also was, and no workload
    after it ran. Past 2^53 - 1 it is a usage error; below, the workload's providers are errors, said,
    and the other workloads still run."""
    err = _usage_error(capsys, [*FAST, "-n", str(2**64), "--out", str(tmp_path / "a")])
    assert f"argument -n/--n: expected at most 2^53 - 1 (what a record carries), got {2**64}" in err
    out = tmp_path / "b"
    # --large-on-cpu: without it such an N is refused before anything runs (see the test of GPU-sized presets)
    i = TINY_RUN.index("-n")
    run = TINY_RUN[:i] + TINY_RUN[i + 2:-1]  # -n once: a list option given twice is refused
    assert cli.main(["bench", *run, "-n", "7", str(2**50), "--large-on-cpu", "--out", str(out)]) == 1
    said = capsys.readouterr().out
    assert "inputs or fp32 reference not made: RuntimeError:" in said and "not written" not in said
    rows = [line.split(",") for line in (out / "errors.csv").read_text().splitlines()[1:]]
    assert [(r[1], r[3], r[7]) for r in rows] == [("flashkd", "7", "passed"), ("flashkd", str(2**50), "error")]


def test_gate_passes_exact_zeros():
    """--v 1: one id, so every divergence, CE and gradient is exactly 0. Equal to the reference, yet 0/0
    made the gate's relative error NaN and every correct provider FAILED (exit status 1)."""
    import torch

    from flashkd.bench import measure
    from flashkd.bench.workloads import Workload

    fast = measure.Settings(torch.device("cpu"), rep_ms=1.0, warmup_ms=0.0, min_reps=1)
    results = measure.run([Workload("jsd", 7, h=12, v=1, dtype="float32")], ["flashkd", "torch"], ["full"], fast)
    assert {r.provider: (r.check.status, r.check.loss_err, r.check.dx_err) for r in results} == {
        "flashkd": ("passed", 0.0, 0.0), "torch": ("passed", 0.0, 0.0)}
    assert measure._rel(torch.ones(3), torch.zeros(3)) == float("inf")  # a non-zero answer to a zero truth fails


# -- the records the bench writes ---------------------------------------------------------------------

def _bundles(workloads, providers=("flashkd", "torch")):
    import torch

    from flashkd.bench import measure, report
    from flashkd.records import bundles_from_results

    fast = measure.Settings(torch.device("cpu"), rep_ms=1.0, warmup_ms=0.0, min_reps=1)
    results = measure.run(workloads, list(providers), ["no-grad-forward"], fast)  # the mode every form has
    return results, bundles_from_results(results, report.environment(fast))


def _key(b):
    from flashkd.records import comparison_key

    return comparison_key(*(b[name]["manifest"] for name in ("run", "workload", "protocol", "environment")))


@pytest.mark.parametrize("form", ["heads", "logits", "topk", "teacher_topk"])
def test_a_softcapped_case_is_not_the_uncapped_one(form):
    """--softcap was in no manifest: a capped run and an uncapped one of the same shape had one workload
    digest and fell into one comparison group, ranked against each other."""
    import dataclasses

    from flashkd.bench.workloads import Workload
    from flashkd.records import check_bundle

    base = Workload("forward_kl", 7, h=12, v=37, dtype="float32", weight_hard=0.0, weight_soft=1.0, form=form,
                    k=5).canonical()
    _, plain = _bundles([base])
    _, capped = _bundles([dataclasses.replace(base, softcap=0.05)])
    assert all(check_bundle(b) == [] for b in plain + capped)
    assert {b["workload"]["digest"] for b in plain}.isdisjoint(b["workload"]["digest"] for b in capped)
    assert {_key(b) for b in plain}.isdisjoint(_key(b) for b in capped)
    workload = capped[0]["workload"]["manifest"]
    assert workload["spec"]["scalars"]["softcap"] == {"dtype": "fp32", "value": 0.05}
    assert "c = 0.05" in workload["metadata"]["description"] and "softcap0-05" in workload["metadata"]["name"]
    assert "softcap" not in plain[0]["workload"]["manifest"]["spec"]["scalars"]  # earlier cases keep their digests


def test_an_fp8_teacher_run_states_the_gate_it_passed():
    """flashkd's FP8 teacher is gated at FP8's tolerance (5e-2); its records stated the dtype's (fp32:
    1e-4), so a run that passed within 5e-2 claimed a policy it had not met; and its implementation was
    the one of the teacher in its own dtype. A GPU run: its result is made here by hand."""
    import torch

    from flashkd.bench import measure, report
    from flashkd.bench.workloads import Workload
    from flashkd.records import bundles_from_results, check_bundle

    env = report.environment(measure.Settings(torch.device("cpu")))
    made = {}
    for dtype in ("float32", "bfloat16"):
        for precision, err in ((None, 3e-5), ("fp8", 3e-2)):
            w = Workload("jsd", 7, h=12, v=37, dtype=dtype, teacher_precision=precision)
            check = measure.Check("passed", err, err, err, measure._tolerance(w, w.torch_dtype))
            result = measure.Result(w, "flashkd", "0", check, "full", (1.0, 0.9, 1.1), None, None, "2026-01-01 00:00:00")
            made[dtype, precision] = bundles_from_results([result], env)[0]
            assert check_bundle(made[dtype, precision]) == []
    fp8, fp32 = made["float32", "fp8"], made["float32", None]
    assert fp8["workload"]["manifest"]["spec"]["correctness"]["maxRelativeError"] == 5e-2
    assert fp32["workload"]["manifest"]["spec"]["correctness"]["maxRelativeError"] == 1e-4
    assert "loss at most 0.05, of dX and dW at most 0.05 (flashkd's fp8 teacher GEMM's tolerance)" in \
        fp8["workload"]["manifest"]["metadata"]["description"]
    assert _key(fp8) != _key(fp32)  # held to another policy: another comparison group
    for dtype in ("float32", "bfloat16"):
        assert made[dtype, "fp8"]["implementation"]["digest"] != made[dtype, None]["implementation"]["digest"]
        assert made[dtype, "fp8"]["implementation"]["manifest"]["spec"]["callable"]["symbol"] == \
            "fused_linear_distill(teacher_precision='fp8')"
    # bf16's pair (1e-2, 5e-2) states 5e-2 as FP8's does: one group, ranked beside the bf16 teacher
    assert _key(made["bfloat16", "fp8"]) == _key(made["bfloat16", None])


# -- flashkd records: damaged, duplicated and odd inputs ----------------------------------------------

@pytest.fixture(scope="module")
def run_records(tmp_path_factory):
    """A tiny bench run's records folder (jsd, flashkd and torch, full: two bundles)."""
    out = tmp_path_factory.mktemp("bench") / "run"
    assert cli.main(["bench", *TINY_RUN, "--out", str(out)]) == 0
    files = sorted((out / "records").glob("*.json"))
    assert len(files) == 2
    return files


def _records(capsys, *argv):
    """(exit status, stdout, stderr) of `flashkd records argv`; never a traceback."""
    try:
        code = cli.main(["records", *map(str, argv)])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def _copy(tmp_path, src, name="x.json", text=None):
    folder = tmp_path / "in"
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text(src.read_text("utf-8") if text is None else text, encoding="utf-8")
    return path


@pytest.mark.parametrize("damage, problem", [
    # the key's last value is the true one, so the digests hold: only the repeat tells
    (lambda t: t.replace('"median": ', '"median": 1, "median": ', 1), "key 'median' repeated within one object"),
    (lambda t: t.replace('"title": "', '"title": "\\ud800', 1), "a string that is not Unicode text (a lone surrogate)"),
    (lambda t: t.replace('"kind": "', '"kind\\udfff": 1, "kind": "', 1), "a string that is not Unicode text (a lone surrogate): 'kind\\udfff'"),
])
def test_verify_refuses_what_two_readers_read_apart(tmp_path, capsys, run_records, damage, problem):
    """A repeated key (parsers keep either value) or an escaped lone surrogate (no UTF-8 page or
    canonical form carries it) passed verify; a surrogate then ended `records site` half-written."""
    path = _copy(tmp_path, run_records[0], text=damage(run_records[0].read_text("utf-8")))
    code, out, _ = _records(capsys, "verify", path)
    assert code == 1 and f"{path}: cannot read: {problem}" in out, out
    code, _, err = _records(capsys, "compare", path)
    assert code == 2 and problem in err, err
    code, _, err = _records(capsys, "site", path, "--out", tmp_path / "site")
    assert code == 1 and problem in err and (tmp_path / "site" / "index.html").is_file(), err


def test_records_tools_follow_no_link_out_of_the_folder(tmp_path, capsys, run_records):
    """Records folders are downloaded: verify followed a link in one to /etc/passwd and quoted its start
    ("not a JSON bundle ...: the file begins 'root:x:0:0:root'"), and site copied the target of a linked
    evidence file into the site. A link that stays in the folder is read; a loop of links is a file
    that cannot be read, not a traceback."""
    from flashkd.records.verify import LINK_OUT

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (outside / "other.json").write_bytes(run_records[1].read_bytes())  # a sound bundle, but not the folder's
    run = tmp_path / "run"
    folder = run / "records"
    folder.mkdir(parents=True)
    (folder / "good.json").write_bytes(run_records[0].read_bytes())
    (folder / "passwd.json").symlink_to(outside / "passwd")
    (folder / "more").symlink_to(outside, target_is_directory=True)
    (folder / "alias.json").symlink_to("good.json")  # stays in the folder
    (folder / "loop.json").symlink_to("loop.json")
    # the evidence the bundles cite (results.csv, one folder up): the right bytes, but a link out
    (outside / "results.csv").write_bytes((run_records[0].parents[1] / "results.csv").read_bytes())
    (run / "results.csv").symlink_to(outside / "results.csv")
    refused = [f"{folder / 'more'}: {LINK_OUT}", f"{folder / 'passwd.json'}: {LINK_OUT}"]

    code, out, _ = _records(capsys, "verify", folder)
    assert code == 1 and [line for line in out.splitlines() if LINK_OUT in line] == refused, out
    assert f"{folder / 'good.json'}: the same bundle as {folder / 'alias.json'}" in out
    assert f"{folder / 'loop.json'}: cannot read: " in out and "root:x" not in out
    assert out.splitlines()[-1] == "3 bundle(s) checked, 3 problem(s)"  # alias, good, loop; the two links, the loop
    code, out, err = _records(capsys, "compare", folder)
    assert code == 2 and out == "" and err.splitlines() == [f"flashkd records compare: {line}" for line in refused]
    code, out, err = _records(capsys, "site", folder, "--out", tmp_path / "site")
    assert code == 1 and all(line in err for line in refused) and "root:x" not in err, err
    assert f"{run / 'results.csv'}: {LINK_OUT}" in err and "1 run(s)" in out
    site = tmp_path / "site"
    assert not (site / "artifacts").exists()
    assert not any("root:x" in p.read_text("utf-8", "replace") for p in site.rglob("*") if p.is_file())
    assert "results.csv is a symbolic link out of its folder: not followed" in next((site / "runs").glob("*.html")).read_text()
    # the same evidence as a plain file is copied
    (run / "results.csv").unlink()
    (run / "results.csv").write_bytes((outside / "results.csv").read_bytes())
    for name in ("passwd.json", "more", "loop.json"):
        (folder / name).unlink()
    code, _, err = _records(capsys, "site", folder, "--out", site, "--replace")
    assert code == 0 and len(list((site / "artifacts").rglob("results.csv"))) == 1, err


@pytest.mark.parametrize("data, said", [
    (b"root:x:0:0:root:/root:/bin/bash\n", "the file does not begin with JSON"),
    (b"\x89PNG\r\n\x1a\n secret", "not UTF-8 text (at byte 0)"),
    (b" \n", "the file is empty"),
])
def test_what_is_not_a_bundle_is_said_without_quoting_it(tmp_path, capsys, data, said):
    path = tmp_path / "x.json"
    path.write_bytes(data)
    code, out, _ = _records(capsys, "verify", path)
    assert code == 1 and out.splitlines()[0] == f"{path}: cannot read: not a JSON bundle (one JSON object, {{...}}): {said}"
    code, _, err = _records(capsys, "compare", path)
    assert code == 2 and said in err and "root:x" not in err and "PNG" not in err


def test_one_run_in_two_files(tmp_path, capsys, run_records):
    """Two files of one run: compare and site showed one of them and said nothing; where the two differ
    (in metadata, which no digest covers) either description could be the one shown."""
    a = _copy(tmp_path, run_records[0], "a.json")
    b = _copy(tmp_path, run_records[0], "b.json")
    other = _copy(tmp_path, run_records[1], "c.json")
    code, out, _ = _records(capsys, "verify", tmp_path / "in")
    assert code == 0 and f"{b}: the same bundle as {a} (one run, counted once)" in out
    assert out.strip().endswith("3 bundle(s) checked, 0 problem(s)")
    code, out, err = _records(capsys, "compare", tmp_path / "in")
    assert code == 0 and f"{b}: the same bundle as {a} (one run, counted once): shown once" in err
    assert out.count("  distill_jsd_loss · ") == 2 and "a.json" in out and "b.json" not in out  # flashkd, torch
    code, out, err = _records(capsys, "site", tmp_path / "in", "--out", tmp_path / "site")
    assert code == 0 and "shown once" not in err and f"{b}: the same bundle as {a}" in err and "rendered once" in err
    assert "2 run(s)" in out

    bundle = json.loads(b.read_text("utf-8"))
    bundle["run"]["manifest"]["metadata"]["title"] = "another title"
    b.write_text(json.dumps(bundle), encoding="utf-8")
    said = f"{b}: the run of {a} (the same run digest), but the two files differ outside the digests (metadata)"
    code, out, _ = _records(capsys, "verify", a, b, other)
    assert code == 1 and said in out and out.strip().endswith("3 bundle(s) checked, 1 problem(s)")
    code, _, err = _records(capsys, "compare", a, b, other)
    assert code == 1 and said in err
    code, _, err = _records(capsys, "site", a, b, other, "--out", tmp_path / "site", "--replace")
    assert code == 1 and said in err and "1 file(s) rejected" in err


def test_site_serves_the_bytes_it_checked(tmp_path, run_records):
    """The site checked each bundle, then copied the file into bundles/ by reading it again: a file
    rewritten in between (a concurrent writer) was served unchecked."""
    from flashkd.records import site

    path = _copy(tmp_path, run_records[0])
    checked = path.read_bytes()
    read = site.read([path])
    path.write_text('{"operation": "rewritten after the check"}', encoding="utf-8")
    site.write(read, tmp_path / "site")
    (served,) = (tmp_path / "site" / "bundles").iterdir()
    assert served.read_bytes() == checked


def test_a_bundle_is_written_whole_or_not_at_all(tmp_path, capsys, run_records, monkeypatch):
    """A write killed half-way left a truncated bundle under its final name (verify said "cannot read",
    but the file was there to be served); now the bundle appears only when complete, and what a killed
    write leaves behind is reported by verify and site."""
    from flashkd.records import cli as records_cli

    bundle = json.loads(run_records[0].read_text("utf-8"))
    folder = tmp_path / "records"
    real = Path.write_text

    def killed(self, text, *args, **kwargs):
        real(self, text[: len(text) // 2], *args, **kwargs)
        raise KeyboardInterrupt
    monkeypatch.setattr(Path, "write_text", killed)
    with pytest.raises(KeyboardInterrupt):
        records_cli.write_bundle(bundle, folder, "a.json")
    monkeypatch.undo()
    assert list(folder.iterdir()) == []  # neither half a bundle nor its partial file
    path = records_cli.write_bundle(bundle, folder, "a.json")
    assert json.loads(path.read_text("utf-8")) == bundle and [p.name for p in folder.iterdir()] == ["a.json"]

    (folder / ".b.json.123.partial").write_text(json.dumps(bundle)[:100])  # what a SIGKILL leaves
    code, out, _ = _records(capsys, "verify", folder)
    assert code == 1 and f"{folder / '.b.json.123.partial'}: left by an interrupted write" in out
    code, _, err = _records(capsys, "site", folder, "--out", tmp_path / "site")
    assert code == 1 and "left by an interrupted write" in err and "1 file(s) rejected" in err


def test_two_bench_runs_into_one_out(tmp_path, capsys, monkeypatch):
    """Two runs started at once into one new --out both passed its check and wrote into it, their
    records and CSVs mixed; now the one that comes second to run.json, the first file, stops there."""
    out = tmp_path / "run"
    real = cli.plan

    def raced(args):
        p = real(args)  # --out checked: new
        out.mkdir()
        (out / "run.json").write_text("the other run's")
        return p
    monkeypatch.setattr(cli, "plan", raced)
    err = _usage_error(capsys, [*TINY_RUN, "--out", str(out)])
    assert f"flashkd bench: --out {out}: another run began writing into it after it was checked" in err
    assert [p.name for p in out.iterdir()] == ["run.json"] and (out / "run.json").read_text() == "the other run's"


# -- flashkd records import-liger ---------------------------------------------------------------------

def _liger_rows(n=3) -> list[str]:
    from flashkd.records import liger

    lines = liger.bundled_csv().splitlines(keepends=True)
    speed = [line for line in lines[1:] if ",speed," in line]
    return [lines[0], *speed[:n]]


@pytest.mark.parametrize("text, message", [
    ("", "empty: expected a header row of the 15 columns"),
    ("a,b,c\n1,2,3\n", "missing column(s): kernel_name, kernel_provider"),
    (None, "column(s) named twice in the header: kernel_name"),
])
def test_import_refuses_a_csv_it_cannot_read_as_the_schema(tmp_path, capsys, text, message):
    if text is None:  # the row's second kernel_name would have won, silently
        header, row = _liger_rows(1)
        text = header.rstrip("\n") + ",kernel_name\n" + row.rstrip("\n") + ",fused_linear_jsd\n"
    path = tmp_path / "rows.csv"
    path.write_text(text, encoding="utf-8")
    code, out, err = _records(capsys, "import-liger", path, "--out", tmp_path / "out")
    assert code == 2 and err.startswith(f"flashkd records import-liger: {path}: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_import_reads_a_csv_with_a_byte_order_mark(tmp_path, capsys):
    """A CSV saved by a spreadsheet starts with a BOM: it was refused as missing column kernel_name."""
    path = tmp_path / "rows with spaces ü.csv"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(_liger_rows(3)).encode("utf-8"))
    code, out, err = _records(capsys, "import-liger", path, "--out", tmp_path / "out ü")
    assert code == 0 and err == "" and f"3 bundle(s) from {path} written to {tmp_path / 'out ü'}" in out
    code, out, _ = _records(capsys, "verify", tmp_path / "out ü")
    assert code == 0 and "3 bundle(s) checked, 0 problem(s)" in out


def test_output_into_a_closed_pipe(tmp_path, capsys):
    """`flashkd records compare ... | head -1`: the reader leaves, and the writer ended in a traceback."""
    assert cli.main(["records", "import-liger", "--out", str(tmp_path / "liger")]) == 0
    src = str(Path(flashkd.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    reader_gone = subprocess.Popen([sys.executable, "-m", "flashkd", "records", "compare", str(tmp_path / "liger")],
                                   env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    reader_gone.stdout.close()  # more than a pipe buffer's worth follows
    err = reader_gone.stderr.read().decode()
    assert reader_gone.wait() == 1 and err == "", err


def test_a_folder_named_that_holds_no_bundle(tmp_path, capsys, run_records):
    """`verify records/ typo/` where typo/ holds no bundle checked records/ alone and said nothing of it."""
    empty = tmp_path / "empty ü"
    empty.mkdir()
    (empty / "notes.txt").write_text("not a bundle")
    good = _copy(tmp_path, run_records[0])
    code, out, _ = _records(capsys, "verify", good, empty)
    assert code == 1 and f"{empty}: a folder without bundle files (*.json)" in out
    assert out.strip().endswith("1 bundle(s) checked, 1 problem(s)")
    code, out, err = _records(capsys, "compare", good, empty)
    assert code == 0 and f"flashkd records compare: {empty}: a folder without bundle files (*.json)" in err
    code, out, err = _records(capsys, "site", good, empty, "--out", tmp_path / "site")
    assert code == 0 and f"flashkd records site: {empty}: a folder without bundle files (*.json)" in err
    code, _, err = _records(capsys, "verify", empty)
    assert code == 2 and "no bundle files found" in err


def test_bench_refuses_more_threads_than_cpus(tmp_path, capsys, monkeypatch):
    """--threads 100000 killed the process (OpenMP cannot make the threads: a segfault)."""
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    err = _usage_error(capsys, [*FAST, "--threads", "5", "--out", str(tmp_path / "run")])
    assert "flashkd bench: --threads: expected at most the 4 CPU(s) this machine has, got 5" in err
    assert cli.plan(cli.parse_bench([*FAST, "--threads", "4", "--out", str(tmp_path / "run")])).settings


@pytest.mark.parametrize("ref", ["a" * 3000, 'x"<>', ""])
def test_import_refuses_a_liger_commit_no_url_carries(tmp_path, capsys, ref):
    """A 3000-character --liger-commit made every bundle fail to verify: all 96 rows skipped, exit 0."""
    with pytest.raises(SystemExit) as e:
        cli.main(["records", "import-liger", "--liger-commit", ref, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and "argument --liger-commit: expected a commit (40 hex digits) or a tag" in err
    assert not (tmp_path / "out").exists()
    assert cli.main(["records", "import-liger", "--liger-commit", "v0.5.10", "--out", str(tmp_path / "ok")]) == 0


def test_a_site_is_written_whole_or_not_at_all(tmp_path, capsys, run_records, monkeypatch):
    """A site build killed half-way left half a site at --out (the earlier one already removed)."""
    from flashkd.records import site

    _copy(tmp_path, run_records[0])
    _copy(tmp_path, run_records[1], "y.json")
    out = tmp_path / "site"
    code, _, _ = _records(capsys, "site", tmp_path / "in", "--out", out)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    real, calls = site.canonical_identity, []

    def killed(manifest):
        calls.append(1)
        if len(calls) > 8:  # the second run's page
            raise KeyboardInterrupt
        return real(manifest)
    monkeypatch.setattr(site, "canonical_identity", killed)
    with pytest.raises(KeyboardInterrupt):
        cli.main(["records", "site", str(tmp_path / "in"), "--out", str(out), "--replace"])
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "site"]  # no partial build left beside it
    monkeypatch.undo()
    with pytest.raises(KeyboardInterrupt):  # a first build killed: no --out at all
        monkeypatch.setattr(site, "canonical_identity", killed)
        cli.main(["records", "site", str(tmp_path / "in"), "--out", str(tmp_path / "new")])
    assert not (tmp_path / "new").exists() and code == 0


def test_bench_that_times_nothing_writes_no_site_of_no_records(tmp_path, capsys):
    """teacher_topk with --modes full times nothing: no record was written, and the run's own site
    listed its records/ folder as a file it could not read."""
    out = tmp_path / "run"
    argv = [*FAST, "-n", "7", "--preset", "teacher-topk", "--modes", "full", "--providers", "flashkd", "--out", str(out)]
    assert cli.main(["bench", *argv]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.endswith("; no KernelIndex records (nothing was timed), so no site"), last
    assert not (out / "site").exists() and not (out / "records").exists()
