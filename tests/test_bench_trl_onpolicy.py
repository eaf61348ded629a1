"""benchmarks/bench_trl_onpolicy.py at tiny shapes on CPU (its checks, not its timings): TRL's
`_chunked_jsd_loss` and flashkd's patch on the same inputs, and AsyncDistillationTrainer's steps with
each (a stand-in rollout worker, no vLLM)."""

import importlib.util
import json
import pathlib
import tempfile

import pytest

pytest.importorskip("trl")
pytest.importorskip("transformers")

SCRIPT = pathlib.Path(__file__).parent.parent / "benchmarks" / "bench_trl_onpolicy.py"


def test_tiny(tmp_path, monkeypatch, capsys):
    """Without --out: a new bench-trl-onpolicy-* folder where it runs (git ignores /bench-*/), and nothing
    left in the temporary folder (the trainers' student and output_dir)."""
    spec = importlib.util.spec_from_file_location("bench_trl_onpolicy", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    (tmp_path / "tmp").mkdir()
    (tmp_path / "run").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.chdir(tmp_path / "run")
    assert bench.main(["--tiny"]) == 0
    (out,) = (tmp_path / "run").iterdir()
    assert out.name.startswith("bench-trl-onpolicy-") and not any((tmp_path / "tmp").iterdir())
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"wrote {out.name}/results.json, {out.name}/summary.md"
    summary = json.loads((out / "results.json").read_text())
    assert [r["k"] for r in summary["loss"]] == [2, 5]
    for r in summary["loss"]:
        assert r["slots"] == (2 if r["k"] == 2 else r["k"] + 1) and r["agree"]
        trl, fk = r["trl"], r["flashkd"]
        assert len(trl["times_s"]) == len(fk["times_s"]) == 2 and fk["p20_s"] <= fk["median_s"] <= fk["p80_s"]
        # (loss, jsd, entropy, teacher entropy): fp32 on both sides
        for a, b in zip(trl["results"], fk["results"]):
            assert b == pytest.approx(a, rel=1e-5)
    steps = {r["variant"]: r for r in summary["step"]}
    assert steps.keys() == {"trl", "flashkd"}
    for r in steps.values():
        assert len(r["step_s"]) == len(r["losses"]) == 3  # --warmup 1 + --steps 2
        assert len(r["loss_forward_s"]) == len(r["loss_backward_s"]) == 3
    # the same rollouts, the same student: step for step the same losses
    assert steps["flashkd"]["losses"] == pytest.approx(steps["trl"]["losses"], rel=1e-5)
    assert summary["step_check"]["agree"]
    assert "| flashkd (patched) |" in (out / "summary.md").read_text()
