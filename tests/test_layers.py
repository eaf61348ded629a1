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


# The package's layers, lowest first: a module imports only from its own layer or lower ones. The core
# (flashkd.core: the call, its checks, plan, backend choice and loop, teacher_topk's loop; below it the
# losses, the row backends and the FP8 head) knows nothing of the distributed layer, the public functions,
# the data on disk, the integrations, the records or the bench..
FINE_LAYERS = (
    ("kernels", ("flashkd.losses", "flashkd.backends", "flashkd.fp8")),
    ("core", ("flashkd.core",)),
    ("distributed", ("flashkd.distributed",)),
    ("api", ("flashkd", "flashkd.distill", "flashkd.modules", "flashkd.data")),
    ("integrations", ("flashkd.integrations",)),
    ("records", ("flashkd.records",)),
    ("bench", ("flashkd.bench",)),
    ("command", ("flashkd.cli", "flashkd.__main__")),
)


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own, for its __init__)."""
    return {".".join(("flashkd", *p.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__"): p
            for p in sorted(ROOT.rglob("*.py"))}


def _fine_layer(module: str) -> int:
    """The index in FINE_LAYERS of a module: its longest matching prefix."""
    best, found = -1, None
    for i, (_, prefixes) in enumerate(FINE_LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), i
    assert found is not None, f"{module}: in no layer of FINE_LAYERS"
    return found


def _edges(source: str, module: str, modules) -> tuple[set[str], list[str]]:
    """(the flashkd modules `module` imports, in functions too; the other modules' private names it
    reaches: `from m import _x`, or `m._x` with m an imported flashkd module)."""
    package = module if module in modules and modules[module].name == "__init__.py" else module.rsplit(".", 1)[0]
    tree = ast.parse(source)
    targets, private, aliases = set(), [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "flashkd":
                    targets.add(a.name)
                    aliases[a.asname or a.name.split(".")[0]] = a.asname and a.name or "flashkd"
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
            if not target or target.split(".")[0] != "flashkd":
                continue
            for a in node.names:
                if f"{target}.{a.name}" in modules:  # `from . import chunks`: a module
                    targets.add(f"{target}.{a.name}")
                    aliases[a.asname or a.name] = f"{target}.{a.name}"
                else:
                    targets.add(target)
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        private.append(f"{module} imports {a.name} from {target}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            owner = aliases[node.value.id]
            if owner != module and f"{owner}.{node.attr}" not in modules:
                private.append(f"{module} reads {owner}.{node.attr}")
    return {t for t in targets if t != module}, private


def _graph():
    modules = _modules()
    graph, private = {}, []
    for module, path in modules.items():
        graph[module], found = _edges(path.read_text("utf-8"), module, modules)
        private += found
    return graph, private


def _cycle(graph) -> list[str] | None:
    """One import circle of the graph (its modules, the first repeated at the end), or None."""
    state = {}

    def visit(m, path):
        state[m] = "open"
        for t in sorted(graph.get(m, ())):
            if state.get(t) == "open":
                return path[path.index(t):] + [t]
            if t not in state:
                found = visit(t, path + [t])
                if found:
                    return found
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m, [m])
            if found:
                return found
    return None


def test_the_import_graph_has_no_circle_no_upward_import_no_private_reach():
    """From the code's own imports (inside functions too): no import circle anywhere in the package, no
    module importing from a higher layer (FINE_LAYERS), and no module taking another module's _private
    names (by `from m import _x` or `m._x`)."""
    graph, private = _graph()
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    upward = [f"{m} ({FINE_LAYERS[_fine_layer(m)][0]}) imports {t} ({FINE_LAYERS[_fine_layer(t)][0]})"
              for m, targets in sorted(graph.items()) for t in sorted(targets) if _fine_layer(t) > _fine_layer(m)]
    assert upward == []
    assert private == []


def test_the_graph_checks_can_fail():
    """The checks above see a circle, an upward import inside a function, and both kinds of private reach."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    modules = _modules()
    targets, _ = _edges("def f():\n    from ..distributed import parallel\n", "flashkd.core.loop", modules)
    assert targets == {"flashkd.distributed.parallel"}
    assert _fine_layer("flashkd.distributed.parallel") > _fine_layer("flashkd.core.loop")
    _, private = _edges("from ..core.backend import _cute_on\nfrom . import triton_rows\nx = triton_rows._head\n",
                        "flashkd.backends.triton_topk", modules)
    assert private == ["flashkd.backends.triton_topk imports _cute_on from flashkd.core.backend",
                       "flashkd.backends.triton_topk reads flashkd.backends.triton_rows._head"]
    assert _fine_layer("flashkd.records.site") > _fine_layer("flashkd") > _fine_layer("flashkd.core.topk")


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
    assert lines[0].endswith('pip install -e ".[records]"') and "rfc8785" in lines[0], lines[0]
    assert lines[1].endswith('pip install -e ".[bench]"'), lines[1]


def _functions(source: str):
    """(dotted name within the module, node) of every function in source, nested ones too."""
    found = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if not isinstance(child, ast.ClassDef):
                    found.append((prefix + child.name, child))
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(ast.parse(source), "")
    return found


# The layers whose functions take their arguments by name: no **kwargs passed through (a public
# module class's options may gather them: the constructor's keywords are fused_linear_distill's).
_NAMED_LAYERS = ("kernels", "core", "distributed", "api")
_KWARGS_ALLOWED = {"flashkd.modules.FusedLinearDistillLoss.__init__"}
# Functions longer than a reader can hold, being split: this list only shrinks (empty: none is).
_LONG_ALLOWED: set[str] = set()
MAX_LINES = 150


def _kwargs_in(source: str, module: str) -> list[str]:
    return [f"{module}.{name}" for name, node in _functions(source) if node.args.kwarg is not None]


def _long_in(source: str, module: str) -> list[str]:
    return [f"{module}.{name} ({node.end_lineno - node.lineno + 1} lines)" for name, node in _functions(source)
            if node.end_lineno - node.lineno + 1 > MAX_LINES]


def test_no_kwargs_in_the_core_and_no_function_over_150_lines():
    """The core, the distributed layer and the public functions pass their arguments by name (no
    **kwargs but a public module class's options); no function in src/flashkd is over MAX_LINES lines,
    but those of _LONG_ALLOWED, each still over it (a split one leaves the list)."""
    kwargs, long, seen = [], [], set()
    for module, path in _modules().items():
        source = path.read_text("utf-8")
        if FINE_LAYERS[_fine_layer(module)][0] in _NAMED_LAYERS:
            kwargs += [f for f in _kwargs_in(source, module) if f not in _KWARGS_ALLOWED]
        for entry in _long_in(source, module):
            name = entry.split(" (")[0]
            seen.add(name)
            if name not in _LONG_ALLOWED:
                long.append(entry)
    assert kwargs == []
    assert long == []
    assert sorted(_LONG_ALLOWED - seen) == [], "no longer over the limit: take it off _LONG_ALLOWED"


def test_the_size_and_kwargs_checks_can_fail():
    body = "".join(f"        x{i} = {i}\n" for i in range(MAX_LINES))
    assert _long_in(f"class A:\n    def f(self):\n{body}", "m") == [f"m.A.f ({MAX_LINES + 1} lines)"]
    assert _kwargs_in("def f(a, *, b):\n    def g(**kw):\n        pass\n", "m") == ["m.f.g"]


def test_the_call_is_frozen_and_the_keywords_are_the_signatures():
    """A call is one frozen value, made by one parse (core.call.parse, parse_teacher_topk); the public
    functions' keyword options are distill.KEYWORDS, which the modules and integrations read."""
    import dataclasses
    import inspect

    from flashkd import distill
    from flashkd.core import call as calls
    from flashkd.distributed.sharding import Sharding

    for cls in (calls.Call, calls.Student, calls.Heads, calls.Logits, calls.TopK, calls.Options,
                calls.TeacherTopK, Sharding):
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls
    assert [f.name for f in dataclasses.fields(calls.Call)] == ["spec", "student", "teacher", "options"]
    for name, keywords in distill.KEYWORDS.items():
        params = inspect.signature(getattr(distill, name)).parameters.values()
        assert {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY} == keywords, name


def _globals_in(source: str, module: str) -> list[str]:
    return [f"{module}: global {', '.join(node.names)}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Global)]


def test_no_global_state_written_in_the_backends():
    """The kernels keep no module state a call rewrites (counters that exist for tests included): tests
    observe launches by wrapping the launch function (a spy), as tests/test_exact.py does."""
    found = []
    for module, path in _modules().items():
        if module.startswith("flashkd.backends."):
            found += _globals_in(path.read_text("utf-8"), module)
    assert found == []
    assert _globals_in("n = 0\ndef f():\n    global n\n    n += 1\n", "m") == ["m: global n"]


def _module_state_written_in(source: str, module: str) -> list[str]:
    """`global` statements, and writes through `globals()`, in a module's source."""
    found = _globals_in(source, module)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "globals":
            found.append(f"{module}:{node.lineno}: globals()")
    return found


def test_no_global_state_written_in_the_integrations():
    """A patch keeps its state with what it patches (`flashkd.integrations.replace` saves the library's
    original on the patched module or class, `restore` puts it back), not in module globals of flashkd
    that patch() rebinds: no `global` statement, no `globals()` in flashkd.integrations."""
    found = []
    for module, path in _modules().items():
        if module == "flashkd.integrations" or module.startswith("flashkd.integrations."):
            found += _module_state_written_in(path.read_text("utf-8"), module)
    assert found == []
    assert _module_state_written_in("_saved = None\ndef patch():\n    global _saved\n", "m") == ["m: global _saved"]
    assert _module_state_written_in("def get(name):\n    globals()[name] = 1\n", "m") == ["m:2: globals()"]


def test_test_modules_import_no_other_test_module():
    """tests/test_*.py share code through tests/helpers/ (and oracle.py, tiny_models.py), never by
    importing one another: a test module imported by another has its tests' module-level state and
    fixtures pulled into the importer. Checked on the source, imports inside functions included."""
    tests = Path(__file__).resolve().parent
    names = {p.stem for p in tests.glob("test_*.py")}
    found = []
    for path in sorted(tests.glob("test_*.py")) + sorted((tests / "helpers").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                modules = [node.module or ""]
            else:
                continue
            for module in modules:
                top = module.removeprefix("tests.").split(".")[0]
                if top in names and top != path.stem:
                    found.append(f"{path.relative_to(tests)}:{node.lineno} imports {module}")
    assert found == []


# The core's files each hold one of its jobs (the call, the checks, the plan, the backend choice, the loop,
# teacher_topk's loop, the entry): none grows past a reader's sitting.
CORE_MAX_LINES = 400


def _over(sources: dict, limit: int) -> list[str]:
    """The files of sources ({name: text}) over `limit` lines."""
    return [f"{name} ({len(text.splitlines())} lines)" for name, text in sorted(sources.items())
            if len(text.splitlines()) > limit]


def test_no_file_of_the_core_is_over_400_lines():
    sources = {str(p.relative_to(ROOT)): p.read_text("utf-8") for p in sorted((ROOT / "core").glob("*.py"))}
    assert len(sources) >= 7 and _over(sources, CORE_MAX_LINES) == []


def test_the_core_size_check_can_fail():
    assert _over({"core/loop.py": "x = 1\n" * (CORE_MAX_LINES + 1), "core/plan.py": "x = 1\n"}, CORE_MAX_LINES) == [
        f"core/loop.py ({CORE_MAX_LINES + 1} lines)"]


# torch.distributed's collectives, and the VocabSlice's exchanges that run them: the backends compute, and
# take the exchanged statistics as inputs (their sliced row functions yield them); the core's row function
# has the slice exchange them (`flashkd.core.backend.exchanged`).
_COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
                "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
                "isend", "irecv", "gather_rows", "sum_rows", "exchange"}
# names that are collectives only on torch.distributed (torch.gather, Tensor.scatter, a GPU barrier are not)
_ON_DIST_ONLY = {"broadcast", "barrier", "gather", "scatter", "reduce", "merge"}


def _collectives_in(source: str, module: str) -> list[str]:
    """The collectives source runs: an import of torch.distributed, or a call of a _COLLECTIVES name on a
    module alias of it or on any object (a VocabSlice's); those of _ON_DIST_ONLY only on torch.distributed."""
    found, dist = [], set()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("torch.distributed"):
                    found.append(f"{module}: import {a.name}")
                    dist.add(a.asname or a.name)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            found.append(f"{module}: from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and any(a.name == "distributed" for a in node.names):
            found.append(f"{module}: from torch import distributed")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner, name = ast.unparse(node.func.value), node.func.attr
            on_dist = owner in dist or "distributed" in owner
            if (name in _COLLECTIVES and name not in _ON_DIST_ONLY) or (name in _ON_DIST_ONLY and on_dist):
                found.append(f"{module}: {owner}.{name}(...)")
    return found


def test_no_collective_in_the_backends():
    found = []
    for module, path in _modules().items():
        if module.startswith("flashkd.backends"):
            found += _collectives_in(path.read_text("utf-8"), module)
    assert found == []


def test_the_collective_check_can_fail():
    assert _collectives_in("import torch.distributed as dist\ndist.all_reduce(x)\n", "m") == [
        "m: import torch.distributed", "m: dist.all_reduce(...)"]
    assert _collectives_in("def f(vocab, x):\n    return vocab.gather_rows(x)\n", "m") == ["m: vocab.gather_rows(...)"]
    assert _collectives_in("y = torch.gather(x, 1, i)\ncute.arch.barrier()\n", "m") == []
    assert _collectives_in("torch.distributed.barrier()\n", "m") == ["m: torch.distributed.barrier(...)"]


# The teacher's forms and the call's types are told apart by their `form` (a ClassVar), never by
# isinstance, but where the call is made from the public keywords (core/call.py).
_CALL_TYPES = {"Call", "Student", "Heads", "Logits", "TopK", "TeacherTopK"}


def _isinstance_on_call_types(source: str, module: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            kinds = node.args[1]
            names = {n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", None)
                     for n in (kinds.elts if isinstance(kinds, ast.Tuple) else [kinds])}
            if names & _CALL_TYPES:
                found.append(f"{module}: {ast.unparse(node)}")
    return found


def test_no_isinstance_on_call_types_outside_the_parse():
    found = []
    for module, path in _modules().items():
        if module != "flashkd.core.call":
            found += _isinstance_on_call_types(path.read_text("utf-8"), module)
    assert found == []
    assert _isinstance_on_call_types("if isinstance(t, calls.TopK):\n    pass\n", "m") == ["m: isinstance(t, calls.TopK)"]


# The modules that carry a call's keywords from the public signatures to where their values are consumed.
_CARRIERS = ("flashkd.distill", "flashkd.teachers", "flashkd.modules", "flashkd.core.call", "flashkd.core.entry",
             "flashkd.distributed", "flashkd.distributed.agreement", "flashkd.distributed.sharding",
             "flashkd.distributed.parallel")
# Scopes (a function's qualified name, or a module-level name) whose keywords are public signatures
# beyond flashkd.__all__: the Liger drop-ins' shared constructor.
_PUBLIC_TOO = frozenset({"_LigerDropIn"})
# The restatements left, each with why: {(module, scope): why}.
_RESTATED = {
    ("flashkd.modules", "FusedLinearDistillLoss.__init__"): "the constructor's positional loss, kept among the options",
    ("flashkd.modules", "FusedLinearJSD._keywords"): "a Liger drop-in's constructor: Liger's names mapped to ours",
    ("flashkd.modules", "FusedLinearJSD"): "the same mapping, for its errors: ours renamed to Liger's",
    ("flashkd.distributed.agreement", "_agreed"): "the backend each rank picks (not as passed), under its keyword's name",
    ("flashkd.teachers", "_PER_TEACHER"): "what the teachers' calls set per teacher (its head's transform)",
    ("flashkd.teachers", "_PER_CALL"): "what the teachers' calls set per group of rows, or return here",
    ("flashkd.teachers", "_summed"): "the CE's own pass: the student's head stands in, no teacher precision or padding",
    ("flashkd.teachers", "fused_linear_distill_teachers"): "a routed call that runs no group: its tensors checked as "
                                                           "one call's, at no teacher precision (nothing runs)",
}


def _restatements(source: str, module: str, keywords, public) -> list[tuple[str, str, str]]:
    """(module, scope, keyword) of each restatement of a keyword in source (the rule: the test below)."""
    tree = ast.parse(source)
    skip = set()  # the public signatures' parameters, and the keywords of calls of a public function
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            callee = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if callee in public:
                skip |= {id(k) for k in node.keywords}
    found = []

    def visit(node, scope: str, public_scope: bool):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = f"{scope}.{node.name}" if scope else node.name
            public_scope = public_scope or node.name in public
        elif isinstance(node, ast.Assign) and not scope and isinstance(node.targets[0], ast.Name):
            scope = node.targets[0].id  # a module-level name
        names = []
        if isinstance(node, ast.arguments) and not public_scope:
            names = [a.arg for a in node.kwonlyargs]
        elif isinstance(node, ast.keyword) and id(node) not in skip:
            names = [node.arg]
        elif isinstance(node, ast.Dict):
            names = [k.value for k in node.keys if isinstance(k, ast.Constant)]
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            names = [e.value for e in node.elts if isinstance(e, ast.Constant)]
        found.extend((module, scope, name) for name in names if name in keywords)
        for child in ast.iter_child_nodes(node):
            visit(child, scope, public_scope)

    visit(tree, "", False)
    return found


def test_a_keyword_is_written_in_its_signatures_its_docstring_and_the_table():
    """A public keyword (a name of the one keyword table, flashkd.core.keywords.TABLE) is *restated* where a
    module that carries a call's keywords (_CARRIERS: the public functions, the modules, the teachers, the
    parse, the entry, the distributed layer and the ranks' agreement) names it to carry or list it: as a
    keyword argument (`f(head_mass=...)`), a keyword-only parameter (`def f(*, head_mass)`), a string key of
    a dict display (`{"head_mass": ...}`) or a string in a tuple, list or set display (`("head_mass", ...)`).
    Not restatements: the public functions' and classes' signatures (flashkd.__all__, _PUBLIC_TOO) and their
    docstrings; the table itself (core/keywords.py, and losses.PARAMETERS for the losses' own parameters,
    outside _CARRIERS); where a value is consumed under its name: an attribute read (`spec.head_mass`,
    `call.options.chunk_size`: LossSpec's, Options' and Sharding's own fields), a subscript, a variable or a
    positional parameter, an error message; and a call of a public function by its keywords (a use of the
    API, as a user's). Every restatement left is in _RESTATED, with why; no entry there is stale."""
    from flashkd.core.keywords import TABLE

    public = set(flashkd.__all__) | _PUBLIC_TOO
    found = []
    for module, path in _modules().items():
        if module in _CARRIERS:
            found += _restatements(path.read_text("utf-8"), module, TABLE, public)
    assert [f for f in found if f[:2] not in _RESTATED] == []
    assert sorted(set(_RESTATED) - {f[:2] for f in found}) == [], "no longer restated: take it off _RESTATED"


def test_the_keyword_count_can_fail():
    """The rule sees a parse closure that restates the keywords, a hand-written list of names, a dict of
    options and a keyword-only parameter; it passes a public signature and a call of a public function."""
    source = ("NAMES = ('head_mass', 'beta')\n"
              "def api(x, *, head_mass=None):\n"
              "    def parse():\n"
              "        return calls.parse(x, head_mass=head_mass)\n"
              "    api(x, head_mass=0.5)\n"
              "    return {'head_mass': head_mass}\n"
              "def _inner(x, *, beta):\n"
              "    return x.beta + beta\n")
    found = _restatements(source, "m", {"head_mass", "beta"}, {"api"})
    assert found == [("m", "NAMES", "head_mass"), ("m", "NAMES", "beta"), ("m", "api.parse", "head_mass"),
                     ("m", "api", "head_mass"), ("m", "_inner", "beta")], found


def test_the_keyword_table_is_where_the_call_keeps_each_keyword():
    """Each keyword of the table goes to a field of that name (LossSpec's `field` where it differs) of the
    group it names: the parse and the agreement read the fields by the table."""
    import dataclasses

    from flashkd.core import call as calls
    from flashkd.core import keywords
    from flashkd.losses import PARAMETERS, LossSpec

    def names(*classes):
        return {f.name for cls in classes for f in dataclasses.fields(cls)}

    where = {keywords.PARAMETER: names(LossSpec), keywords.SPEC: names(LossSpec), keywords.OPTION: names(calls.Options),
             keywords.TENSOR: names(calls.Student, calls.Heads, calls.TopK), keywords.SHARDING: names(keywords.Sharding)}
    for name, kw in keywords.TABLE.items():
        assert (kw.field or name) in where[kw.goes], name
    assert {n for n, kw in keywords.TABLE.items() if kw.goes == keywords.PARAMETER} == set(PARAMETERS)
    assert {n for n, kw in keywords.TABLE.items() if kw.goes == keywords.OPTION} == names(calls.Options)
    assert {n for n, kw in keywords.TABLE.items() if kw.goes == keywords.SHARDING} == names(keywords.Sharding)
