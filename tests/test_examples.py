"""The examples run as a user would run them (CPU here), so they cannot rot; and they leave nothing
behind in the temporary folder."""

import ast
import builtins
import os
import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLES = sorted((pathlib.Path(__file__).parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(path, tmp_path, tmp_path_factory):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}  # tempfile's folder: what an example makes there must be gone after
    # torch's own compile cache (torchinductor_<user>, under TMPDIR by default) is torch's, not the example's
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("torchinductor")))
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loss" in done.stdout
    # a warning a user would see on their first run, e.g. a deprecated argument the example passes
    assert not re.search(r"\w+Warning: ", done.stderr), done.stderr[-2000:]
    assert not any(tmp.iterdir()), sorted(p.name for p in tmp.iterdir())
    assert [p.name for p in tmp_path.iterdir()] == ["tmp"]  # nor in the folder it ran from
    assert "/tmp" not in path.read_text()  # no fixed folder outside the temporary one either


README = pathlib.Path(__file__).parent.parent / "README.md"
RUNS_AS_PASTED = "<!-- snippet: runs as pasted"


def _python_blocks():
    """(first line number, code, marked to run as pasted) of each ```python block of the README."""
    lines, blocks, i = README.read_text("utf-8").splitlines(), [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            end = lines.index("```", i + 1)
            marked = i > 0 and lines[i - 1].startswith(RUNS_AS_PASTED)
            blocks.append((i + 2, "\n".join(lines[i + 1:end]) + "\n", marked))
            i = end
        i += 1
    return blocks


def test_readme_snippets_are_python():
    """Every python snippet of the README at least parses (most are fragments that name a user's models)."""
    blocks = _python_blocks()
    assert len(blocks) >= 5
    for line, code, _ in blocks:
        compile(code, f"README.md:{line}", "exec")


@pytest.mark.filterwarnings("ignore:You are importing from 'trl.experimental'")  # the on-policy snippet does
def test_readme_snippets_define_what_they_use():
    """Pasted into a fresh interpreter, a snippet fails only on the user's own objects, which its
    `# yours: a, b` line names: it imports what it uses, and its imports import."""
    for line, code, _ in _python_blocks():
        tree = ast.parse(code)
        yours = {n.strip() for names in re.findall(r"^# yours: (.*)$", code, re.M) for n in names.split(",")}
        defined = set(dir(builtins)) | yours
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
                exec(compile(ast.Module([node], []), f"README.md:{line}", "exec"), {})
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.arg) or isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(getattr(node, "arg", None) or node.id)
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        assert used <= defined, f"README.md:{line}: {sorted(used - defined)} neither imported nor marked as yours"


@pytest.mark.parametrize("line, code", [(line, code) for line, code, marked in _python_blocks() if marked],
                         ids=lambda x: f"README.md:{x}" if isinstance(x, int) else "")
def test_readme_snippet_runs_as_pasted(line, code, tmp_path):
    """The snippets marked as running as pasted (the quickstart) do, in a fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loss" in done.stdout


def test_readme_marks_a_snippet_that_runs():
    assert any(marked for _, _, marked in _python_blocks())
