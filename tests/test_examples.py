"""The examples run as a user would run them (CPU here), so they cannot rot; and they leave nothing
behind in the temporary folder."""

import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = sorted((pathlib.Path(__file__).parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(path, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}  # tempfile's folder: what an example makes there must be gone after
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loss" in done.stdout
    assert not any(tmp.iterdir()), sorted(p.name for p in tmp.iterdir())
    assert [p.name for p in tmp_path.iterdir()] == ["tmp"]  # nor in the folder it ran from
    assert "/tmp" not in path.read_text()  # no fixed folder outside the temporary one either
