"""benchmarks/bench_trl_step.py at tiny shapes on CPU (its checks, not its timings): TRL's DistillationTrainer
with TRL's loss and with flashkd's patch, with the real `datasets` and with the stand-in that the script
puts in place where `datasets` cannot be imported. Seconds each."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("trl")
pytest.importorskip("transformers")

SCRIPT = pathlib.Path(__file__).parent.parent / "benchmarks" / "bench_trl_step.py"
TINY = dict(batch=3, completion=7, warmup=1, steps=2)  # the script's --tiny shapes


def _check(out, datasets):
    summary = json.loads((out / "results.json").read_text())
    assert summary["env"]["datasets"].startswith(datasets)
    runs = {r["variant"]: r for r in summary["results"]}
    assert runs.keys() == {"trl", "flashkd"}
    for r in runs.values():
        assert len(r["step_s"]) == len(r["losses"]) == len(r["grad_norms"]) == TINY["warmup"] + TINY["steps"]
        assert r["timed_steps"] == TINY["steps"] and r["p20_s"] <= r["median_s"] <= r["p80_s"]
        # the loss helper's forward and backward, once a step each, inside the step
        assert len(r["loss_forward_s"]) == len(r["loss_backward_s"]) == len(r["step_s"])
        assert all(0 < f + b < s for f, b, s in zip(r["loss_forward_s"], r["loss_backward_s"], r["step_s"]))
    check = summary["first_step_check"]
    assert check["agree"] and check["relative_difference"] <= 1e-4
    assert runs["trl"]["losses"][0] == check["first_loss_trl"] > 0
    # every step, not only the first: same data, same starting student, fp32
    for a, b in zip(runs["trl"]["losses"], runs["flashkd"]["losses"]):
        assert b == pytest.approx(a, rel=1e-4)
    assert "| flashkd (patched) |" in (out / "summary.md").read_text()
    return runs


def test_tiny_fixed_completions(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_trl_step", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--tiny", "--out", str(tmp_path)]) == 0
    runs = _check(tmp_path, "datasets")
    tokens = TINY["batch"] * TINY["completion"]  # pre-drawn completions: all of --completion-len
    assert all(t == tokens for r in runs.values() for t in r["completion_tokens_per_step"])


def test_tiny_sampled_without_datasets(tmp_path):
    """As on a machine without `datasets`: an import of it fails, the script falls back to its stand-in.
    Without --out, as the README runs it: a new bench-trl-step-* folder where it runs, and nothing left in
    the temporary folder (the trainers' output_dir)."""
    blocker = tmp_path / "blocker" / "datasets"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text('raise ImportError("datasets is not installed")\n')
    (tmp_path / "tmp").mkdir()
    (tmp_path / "run").mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocker.parent), os.environ.get("PYTHONPATH", "")]),
               TMPDIR=str(tmp_path / "tmp"))
    done = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--generation", "student"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path / "run")
    assert done.returncode == 0, done.stderr[-3000:]
    (out,) = (tmp_path / "run").iterdir()
    assert out.name.startswith("bench-trl-step-") and not any((tmp_path / "tmp").iterdir())
    assert done.stdout.strip().splitlines()[-1] == f"wrote {out.name}/results.json, {out.name}/summary.md"
    runs = _check(out, "stand-in")
    # the student sampled the completions: the same ones in both variants (same seed, same weights at step 1)
    assert runs["trl"]["completion_tokens_per_step"][0] == runs["flashkd"]["completion_tokens_per_step"][0]
    assert all(g > 0 for r in runs.values() for g in r["generation_s"])
