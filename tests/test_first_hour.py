"""What a newcomer meets in the first hour: the `flashkd` command answers --help and a mistyped option without
torch or the records extra, `import flashkd` imports no torch._dynamo, the extras bring what the examples and
the Triton interpreter need, and the messages of a wrong input name the thing to fix. (The site's CPU caveat
and its run pages: tests/test_site.py.)"""

import ast
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flashkd
from flashkd import core
from flashkd.bench import cli

ROOT = Path(__file__).resolve().parents[1]
SRC = str(Path(flashkd.__file__).resolve().parents[1])
RECORDS_EXTRA = ("rfc8785", "jsonschema", "jinja2")


def _python(code: str, *argv: str, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=120)


def _blocked(*argv: str, block=("torch", *RECORDS_EXTRA), cwd=None) -> subprocess.CompletedProcess:
    """`python -m flashkd ARGV` in a process where importing any of `block` fails (None in sys.modules is
    Python's own "import halted"), and which says at exit whether torch was imported after all."""
    code = (f"import runpy, sys; sys.modules.update(dict.fromkeys({list(block)!r})); sys.argv = ['flashkd', *sys.argv[1:]]\n"
            "try:\n    runpy.run_module('flashkd', run_name='__main__', alter_sys=True)\n"
            "finally:\n    print('torch imported:', sys.modules.get('torch') is not None, file=sys.stderr)")
    return _python(code, *argv, cwd=cwd)


def _stderr(done) -> str:
    """stderr without _blocked's last line."""
    return "".join(done.stderr.splitlines(keepends=True)[:-1])


# -- import flashkd, and the CLI before torch ------------------------------------------------------------

def test_import_flashkd_imports_no_dynamo_even_after_a_loss():
    """torch.compiler.disable, a decorator at import, imported torch._dynamo (~0.9 s of a 1.7 s import)."""
    done = _python("import sys, flashkd\n"
                   "assert 'torch._dynamo' not in sys.modules, 'at import'\n"
                   "import torch\n"
                   "xs, ws = torch.randn(3, 4, requires_grad=True), torch.randn(7, 4, requires_grad=True)\n"
                   "flashkd.fused_linear_distill(xs, ws, torch.randn(3, 5), torch.randn(7, 5), torch.tensor([0, 1, 6]),"
                   " backend='torch').backward()\n"
                   "assert 'torch._dynamo' not in sys.modules, 'after a loss and its backward'\n"
                   "print(sorted(flashkd.__all__) == sorted(n for n in flashkd.__all__ if hasattr(flashkd, n)))")
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr


def test_import_flashkd_alone_imports_no_torch_and_every_public_name_resolves():
    done = _python("import sys, flashkd; print('torch' in sys.modules); "
                   "print(all(getattr(flashkd, n) is not None for n in flashkd.__all__)); print('torch' in sys.modules)")
    assert done.returncode == 0 and done.stdout.split() == ["False", "True", "True"], done.stderr
    assert set(flashkd.__all__) <= set(dir(flashkd))
    with pytest.raises(AttributeError, match="no attribute 'fused_linear_distil'"):
        flashkd.fused_linear_distil  # noqa: B018


@pytest.mark.parametrize("argv, words", [
    (["--help"], ["usage: flashkd", "bench", "records"]),
    ([], ["usage: flashkd", "bench", "records"]),  # `flashkd` alone said "error: ... required: command"
    (["bench", "--help"], ["usage: flashkd bench", "--preset", "records/", "site/", "trained"]),
    (["records", "--help"], ["usage: flashkd records", "import-liger", "verify", "compare", "site"]),
    (["records"], ["usage: flashkd records", "import-liger", "verify", "compare", "site"]),  # was a usage error
    (["records", "site", "--help"], ["usage: flashkd records site", "--out", "--replace"]),
])
def test_help_answers_without_torch_or_the_records_extra(argv, words):
    done = _blocked(*argv)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[-1] == "torch imported: False", done.stderr
    text = " ".join(done.stdout.split())
    assert all(w in text for w in words), (words, done.stdout)


@pytest.mark.parametrize("argv, line", [
    (["records", "site", "x", "--ot", "y"],
     "flashkd records site: error: unrecognized arguments: --ot (see flashkd records site --help)"),
    (["records", "site", "x", "--ot=y", "--replace"],
     "flashkd records site: error: unrecognized arguments: --ot=y (see flashkd records site --help)"),
    (["records", "import-liger", "--otu", "x"],
     "flashkd records import-liger: error: unrecognized arguments: --otu (see flashkd records import-liger --help)"),
    (["bench", "--lss", "jsd"], "flashkd: error: unrecognized arguments: --lss jsd (see flashkd --help)"),
    (["bench", "-n", "0"], "flashkd bench: error: argument -n/--n: expected a positive integer, got 0 "
                           "(see flashkd bench --help)"),
    (["bench", "--loss", "kl"], "flashkd bench: error: argument --loss: invalid choice: 'kl' (choose from "),
    (["records", "site", "x"], "flashkd records site: error: the following arguments are required: --out "
                               "(see flashkd records site --help)"),
])
def test_argument_errors_answer_without_torch(argv, line):
    """A mistyped option is named as argparse names it, not as the required option it kept from being read."""
    done = _blocked(*argv)
    assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stdout, done.stderr)
    assert done.stderr.splitlines()[-1] == "torch imported: False"
    assert len(_stderr(done).splitlines()) == 1 and _stderr(done).startswith(line), done.stderr


def test_an_unknown_provider_is_argparses_error_in_one_line(capsys, tmp_path):
    """--providers is checked against PROVIDERS when the command runs (a test or a user may add to it)."""
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--device", "cpu", "-n", "3", "--providers", "flashkd", "nope", "--out", str(tmp_path / "o")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("flashkd bench: error: argument --providers: invalid choice: 'nope' (choose from 'flashkd', ")
    assert len(err.splitlines()) == 1 and not (tmp_path / "o").exists()


@pytest.mark.parametrize("package, argv", [("rfc8785", ["verify", "b.json"]),
                                           ("jinja2", ["site", "b.json", "--out", "site"])])
def test_a_command_without_the_records_extra_names_it_in_the_readmes_form(tmp_path, package, argv):
    (tmp_path / "b.json").write_bytes((ROOT / "tests" / "data" / "liger-distill-jsd-forward-h100-bt8192.json").read_bytes())
    readme = (ROOT / "README.md").read_text()
    assert 'pip install -e ".[records]"' in readme
    done = _blocked("records", *argv, block=(package,), cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert _stderr(done).strip() == (f"flashkd: this command needs the package {package!r}, which the losses "
                                     'do not: pip install -e ".[records]"')
    assert not (tmp_path / "site").exists()


def test_the_option_vocabularies_are_the_librarys():
    """Spelled in flashkd.bench.cli so that parsing imports no torch: each must be the library's own."""
    from flashkd import fp8, losses
    from flashkd.bench import providers, workloads
    from flashkd.records import protocol

    assert cli.LOSSES == losses.LOSSES and cli.TAILS == losses.TAILS
    assert cli.FORMS == workloads.FORMS and cli.INPUTS == workloads.INPUTS
    assert cli.DTYPE_NAMES == tuple(workloads.DTYPES) and cli.PRESET_NAMES == tuple(sorted(workloads.PRESETS))
    assert cli.MODES == protocol.MODES
    assert cli.PRECISIONS == tuple(p for p in fp8.PRECISIONS if p is not None)
    assert cli.PROVIDER_NAMES == tuple(providers.PROVIDERS)


def test_bench_help_describes_every_preset_and_what_it_writes():
    from flashkd.bench.workloads import PRESETS

    presets = cli.USAGE.split("presets:\n", 1)[1].split("\n\n", 1)[0]
    described = {line.split()[0] for line in presets.splitlines() if line.startswith("  ") and not line.startswith("   ")}
    assert set(PRESETS) <= described, set(PRESETS) - described
    text = " ".join(cli.USAGE.split())
    assert "records/*.json" in text and "site/index.html" in text and "not a speed comparison" in text


# -- the extras ----------------------------------------------------------------------------------------

def _extras() -> dict[str, list[str]]:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {"": project["dependencies"], **project["optional-dependencies"]}


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


@pytest.mark.parametrize("example", ["hf_trainer_distill.py", "hf_trainer_topk.py"])
def test_the_hf_extra_brings_what_the_trainer_examples_import(example):
    """`pip install -e ".[hf,data]"`, then the example ended in No module named 'datasets'."""
    extras = _extras()
    # What the extra's packages bring themselves (transformers brings tokenizers) is read from their
    # installed metadata: without them (the README's bench venv, `.[bench]`) there is nothing to read.
    absent = [n for n in map(_name, extras["hf"]) if importlib.util.find_spec(n.replace("-", "_")) is None]
    if absent:
        pytest.skip(f"the hf extra is not installed here ({', '.join(absent)} missing): pip install -e \".[hf]\"")
    given = {_name(r) for extra in ("", "hf", "data") for r in extras[extra]}
    for name in list(given):
        try:
            given |= {_name(r) for r in importlib.metadata.requires(name) or () if "extra ==" not in r}
        except importlib.metadata.PackageNotFoundError:
            pass
    tree = ast.parse((ROOT / "examples" / example).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    third_party = {m for m in imported if m not in sys.stdlib_module_names and m != "flashkd"}
    assert "datasets" in third_party  # what the check is about
    assert third_party <= given, third_party - given


def test_the_triton_and_bench_extras_pin_the_numpy_tritons_interpreter_needs():
    specifiers = pytest.importorskip("packaging.specifiers")
    extras = _extras()
    for extra in ("triton", "bench", "test"):
        pins = [r for r in extras[extra] if _name(r) == "numpy"]
        assert pins, extra
        allowed = specifiers.SpecifierSet(pins[0][len("numpy"):].split(";")[0])
        assert "2.3.5" in allowed and "2.4.0" not in allowed and "2.5.1" not in allowed, (extra, pins)


@pytest.fixture
def numpy_version(monkeypatch):
    """Sets the numpy version the backend pick sees (its answer is cached once a process: cleared around)."""
    import numpy

    core.backend._interpreter_problem.cache_clear()
    yield lambda v: monkeypatch.setattr(numpy, "__version__", v)
    monkeypatch.undo()
    core.backend._interpreter_problem.cache_clear()


def _heads(n=3, v=11, h=4):
    return (torch.randn(n, h, requires_grad=True), torch.randn(v, h, requires_grad=True), torch.randn(n, h),
            torch.randn(v, h), torch.randint(0, v, (n,)))


def test_triton_under_the_interpreter_with_numpy_2_4_is_one_line(numpy_version, monkeypatch):
    """Triton 3.6's interpreter under numpy 2.4 ended in InterpreterError: TypeError('only 0-dimensional
    arrays ...') from deep inside the first kernel."""
    triton = pytest.importorskip("triton")
    if tuple(map(int, re.findall(r"\d+", triton.__version__)[:2])) > (3, 6):
        pytest.skip(f"Triton {triton.__version__}: the interpreter's numpy 2.4 failure is Triton 3.6's")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    numpy_version("2.4.1")
    for call in (lambda: flashkd.fused_linear_distill(*_heads(), backend="triton"),
                 lambda: flashkd.teacher_topk(torch.randn(3, 4), torch.randn(11, 4), 2, backend="triton")):
        with pytest.raises(RuntimeError) as e:
            call()
        message = str(e.value)
        assert "\n" not in message and "TRITON_INTERPRET=1" in message and "numpy 2.4.1" in message
        assert f"Triton {triton.__version__}" in message and 'pip install "numpy<2.4"' in message
    # the torch backend and fp64 inputs (which take the torch rows) are not the interpreter's
    flashkd.fused_linear_distill(*_heads(), backend="torch")
    flashkd.fused_linear_distill(*(t.double() if t.is_floating_point() else t for t in _heads()), backend="triton")


def test_triton_with_numpy_2_3_runs(numpy_version, monkeypatch):
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        # Triton reads it where a kernel is defined: on a GPU the kernels are (or, made under the variable set
        # here, would stay for the rest of the session) the compiled ones, which take no CPU tensors
        pytest.skip("the interpreter's run: TRITON_INTERPRET is off in this process (a GPU)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    numpy_version("2.3.5")
    xs, ws, xt, wt, y = _heads()
    loss = flashkd.fused_linear_distill(xs, ws, xt, wt, y, backend="triton")
    want = flashkd.fused_linear_distill(xs, ws, xt, wt, y, backend="torch")
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)


def test_triton_not_installed_says_what_to_install(monkeypatch):
    readme = (ROOT / "README.md").read_text()
    assert 'pip install -e ".[triton]"' in readme
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` fails, as where it is not installed
    with pytest.raises(ValueError) as e:
        flashkd.fused_linear_distill(*_heads(), backend="triton")
    assert str(e.value) == ("backend: 'triton' was asked for, but the triton package is not installed "
                            '(pip install -e ".[triton]")')


# -- messages --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("who", ["student", "teacher"])
def test_a_transposed_head_is_named_with_the_input(who):
    """A (hidden, vocab) head blamed only the input ("student_input: expected hidden size 50 (student_weight
    is (8, 50)), got 8"), where the weight is the likely culprit."""
    xs, ws, xt, wt, y = torch.randn(5, 8), torch.randn(50, 8), torch.randn(5, 6), torch.randn(50, 6), torch.randint(0, 50, (5,))
    if who == "student":
        ws = ws.T.contiguous()
    else:
        wt = wt.T.contiguous()
    with pytest.raises(ValueError) as e:
        flashkd.fused_linear_distill(xs, ws, xt, wt, y)
    message = str(e.value)
    assert message.startswith(f"{who}_input: expected hidden size ") and f"{who}_weight looks transposed" in message
    assert f"pass {who}_weight.T, of shape (50, {8 if who == 'student' else 6})" in message
    # a hidden size that is simply wrong is not called transposed
    with pytest.raises(ValueError) as e:
        flashkd.fused_linear_distill(torch.randn(5, 7), torch.randn(50, 8), xt, torch.randn(50, 6), y)
    assert "transposed" not in str(e.value)


def _records(*argv, cwd) -> subprocess.CompletedProcess:
    return _python("import sys; from flashkd.cli import main; raise SystemExit(main())", "records", *argv, cwd=cwd)


def test_verify_says_a_readme_is_not_a_json_bundle(tmp_path):
    (tmp_path / "README.md").write_text("# notes\n\nnot a bundle\n")
    (tmp_path / "empty.json").write_text("")
    done = _records("verify", "README.md", "empty.json", cwd=tmp_path)
    assert done.returncode == 1
    assert "README.md: cannot read: not a JSON bundle (one JSON object, {...}): the file does not begin with JSON" \
        in done.stdout
    assert "# notes" not in done.stdout  # what is not a bundle is not quoted: it may be anything
    assert "empty.json: cannot read: not a JSON bundle (one JSON object, {...}): the file is empty" in done.stdout
    assert "Expecting value" not in done.stdout


@pytest.mark.parametrize("command", [["verify"], ["compare"], ["site", "--out", "site"]])
def test_a_path_that_does_not_exist_is_a_usage_error_in_every_records_command(tmp_path, command):
    """verify counted it as "1 bundle(s) checked" on stdout with exit 1; compare exited 2 on stderr."""
    (tmp_path / "real.json").write_text("{}")
    done = _records(command[0], "real.json", "nonexistent.json", *command[1:], cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stdout, done.stderr)
    assert done.stderr == f"flashkd records {command[0]}: nonexistent.json: no such file or folder\n"
    assert not (tmp_path / "site").exists()
