"""The package's layers import only downwards: core (the losses, their functions and modules, the
backends, flashkd.data) < records (KernelIndex bundles) < bench (the harness and the `flashkd`
command). Checked on the source, so an import inside a function counts too."""

import ast
from pathlib import Path

import flashkd

ROOT = Path(flashkd.__file__).resolve().parent
LAYERS = {"core": 0, "records": 1, "bench": 2}


def _layer(module: str) -> str | None:
    """The layer of a flashkd module ("flashkd.records.emit" -> "records"); None outside these layers."""
    parts = module.split(".")
    if parts[0] != "flashkd":
        return None
    if len(parts) > 1 and parts[1] in ("records", "bench"):
        return parts[1]
    if len(parts) > 1 and parts[1] in ("__main__", "cli", "integrations"):
        return None  # the console entry point and the integrations sit above every layer here
    return "core"


def _imports(path: Path) -> set[str]:
    module = ".".join(("flashkd", *path.relative_to(ROOT).with_suffix("").parts))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    return _imported(path.read_text("utf-8"), package)


def _imported(source: str, package: str) -> set[str]:
    """The flashkd modules (and names) that source, a module of `package`, imports."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
            found.add(target)
            found |= {f"{target}.{a.name}" for a in node.names}  # `from . import liger`
    return {name for name in found if name and name.split(".")[0] == "flashkd"}


def test_no_layer_imports_a_higher_one():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        module = ".".join(("flashkd", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
        own = _layer(module)
        if own is None:
            continue
        for target in _imports(path):
            theirs = _layer(target)
            if theirs is not None and LAYERS[theirs] > LAYERS[own]:
                wrong.append(f"{module} ({own}) imports {target} ({theirs})")
    assert wrong == []


def test_the_checker_sees_an_upward_import():
    """The check above can fail: a records module importing the bench, even inside a function, is found."""
    names = _imports(ROOT / "records" / "emit.py")
    assert "flashkd.records.protocol" in names and "flashkd.records.liger" in names
    assert _layer("flashkd.bench.measure") == "bench" and _layer("flashkd.distill") == "core"
    assert "flashkd.bench.measure" in _imported("def f():\n    from ..bench import measure\n", "flashkd.records")
    assert "flashkd.bench" in _imported("import flashkd.bench\n", "flashkd.records")


def test_nothing_reads_a_folder_beside_the_repository():
    """A clone has nothing beside it: tests, examples and the README's commands use only its own files."""
    repo = Path(__file__).resolve().parents[1]
    beside = "shared" + "/data"  # spelled so that this file does not match itself
    files = [*repo.glob("tests/**/*.py"), *repo.glob("examples/**/*.py"), repo / "README.md"]
    assert [str(p.relative_to(repo)) for p in files if beside in p.read_text("utf-8")] == []


# The packages that only `flashkd records` and `flashkd bench` need ([records] extra).
_EXTRAS_ONLY = ("rfc8785", "jsonschema", "jinja2")

_WITHOUT_EXTRAS = r'''
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Block())
import torch
import flashkd

torch.manual_seed(0)
n, h, v = 5, 8, 11
xs = torch.randn(n, h, requires_grad=True)
ws = torch.randn(v, h, requires_grad=True)
xt, wt = torch.randn(n, h), torch.randn(v, h)
y = torch.randint(0, v, (n,))
for loss in flashkd.LOSSES:
    out = flashkd.fused_linear_distill(xs, ws, xt, wt, y, loss=loss, backend="torch")
    out.backward()
    assert torch.isfinite(out) and torch.isfinite(xs.grad).all(), loss
out = flashkd.fused_linear_distill_logits(xs, ws, xt @ wt.t(), y, backend="torch")
ids, lp = flashkd.teacher_topk(xt, wt, 3)
out = out + flashkd.fused_linear_distill_topk(xs, ws, ids, lp, y, backend="torch")
out = out + flashkd.FusedLinearJSDLoss()(xs, ws, xt, wt, y)
out.backward()
assert not [m for m in sys.modules if m.split(".")[0] in BLOCKED]
print("losses ok")
from flashkd.cli import main
for argv in (["records", "verify", "."], ["bench", "--device", "cpu"]):
    code = main(argv)
    print("exit", code)
'''


def test_the_losses_need_no_extra_and_the_command_names_it():
    """`import flashkd` and every loss work without the [records] extra's packages (blocked here as if
    not installed); the `flashkd` command then says, in one line and with exit status 2, which extra
    to install."""
    import subprocess
    import sys

    code = f"BLOCKED = {_EXTRAS_ONLY!r}\n" + _WITHOUT_EXTRAS
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["losses ok", "exit 2", "exit 2"], done.stdout
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr and len(lines) == 2, done.stderr
    assert lines[0].endswith("pip install 'flashkd[records]'") and "rfc8785" in lines[0], lines[0]
    assert lines[1].endswith("pip install 'flashkd[bench]'"), lines[1]
