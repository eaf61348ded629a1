"""Seeds, the Triton interpreter where there is no GPU, and where each backend's tests run (`_device`).

Every test runs seeded: torch's, Python's and numpy's global generators, and Hypothesis, all from one
seed, which the `seed` fixture also returns. By default it is derived from a fixed base and the test's
id, so a run is the same on every machine and in every order; FLASHKD_TEST_SEED=<n> gives every test
the seed n (the replay of a failure), FLASHKD_TEST_SEED=random fresh ones. A failing test's report
names its seed and the command that replays it (tests/README.md).
"""

import os
import random
import shlex
import zlib

import numpy
import pytest
import torch

# Without a GPU the Triton kernels run under Triton's interpreter; it must be chosen before triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _has_triton():
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


HAS_TRITON = _has_triton()
BACKENDS = ["torch"] + (["triton"] if HAS_TRITON else [])

# Where the tests that take a backend run it, defined once for every test file: the Triton backend needs CUDA
# tensors on a machine with a GPU, and the interpreter's CPU tensors elsewhere (TRITON_INTERPRET=1, set above where
# there is no GPU); where it can have neither, its cases are skipped. The torch backend and the references run on
# the CPU.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"  # where the Triton backend and its kernels run
TRITON_RUNS = "triton" in BACKENDS and (INTERPRET or torch.cuda.is_available())
needs_triton = pytest.mark.skipif(not TRITON_RUNS, reason="triton is not installed, or TRITON_INTERPRET is off "
                                  "and there is no CUDA device")
BACKEND_PARAMS = [pytest.param(b, marks=needs_triton) if b == "triton" else b for b in BACKENDS]


def _device(backend):
    """Where a test runs `backend`: the Triton one on DEVICE, any other (the torch one, None) on the CPU."""
    return DEVICE if backend == "triton" else "cpu"


def _on(device, *args):
    """args on `device` (tensors, lists of them; None and anything else as is): themselves on the CPU, else
    copies there (a tensor that requires grad a leaf there)."""
    def move(t):
        if isinstance(t, list):
            return [move(u) for u in t]
        return t.detach().to(device).requires_grad_(t.requires_grad) if torch.is_tensor(t) else t

    return args if device == "cpu" else tuple(move(a) for a in args)


SEED_BASE = 20260101  # change it and every derived seed changes
SEED_KEY = pytest.StashKey[int]()  # on a test item: its seed
MODE_KEY = pytest.StashKey[object]()  # on the config: what _seed_mode() returned


def _seed_mode():
    """None (derived seeds), "random", or the int every test gets, from FLASHKD_TEST_SEED."""
    value = os.environ.get("FLASHKD_TEST_SEED", "").strip()
    if value in ("", "random"):
        return value or None
    try:
        n = int(value)
    except ValueError:
        n = -1
    if not 0 <= n < 2**32:
        raise pytest.UsageError(f"FLASHKD_TEST_SEED: expected an int in [0, 2**32) or 'random', got {value!r}")
    return n


def seed_of(nodeid, mode):
    """The seed of the test `nodeid`: crc32, not hash(), which Python salts per process."""
    if mode is None:
        return zlib.crc32(f"{SEED_BASE}:{nodeid}".encode())
    if mode == "random":
        return int.from_bytes(os.urandom(4), "little")
    return mode


def pytest_configure(config):
    config.stash[MODE_KEY] = _seed_mode()  # a bad value stops the session here
    try:
        from hypothesis import settings
    except ImportError:
        return
    # no example database: what ran before must not change what runs now (each test also gets its seed below)
    settings.register_profile("flashkd", derandomize=config.stash[MODE_KEY] != "random", database=None)
    settings.load_profile("flashkd")


@pytest.fixture(autouse=True)
def _seeded(request):
    """Seeds every test, whether or not it asks for `seed`."""
    s = seed_of(request.node.nodeid, request.config.stash[MODE_KEY])
    request.node.stash[SEED_KEY] = s
    torch.manual_seed(s)
    random.seed(s)
    numpy.random.seed(s)
    fn = getattr(request.node, "function", None)
    if getattr(fn, "is_hypothesis_test", False):
        from hypothesis import seed as hypothesis_seed

        hypothesis_seed(s)(fn)
    return s


@pytest.fixture
def seed(_seeded):
    """This test's seed (torch's global generator is seeded with it already)."""
    return _seeded


def _replay(nodeid, s):
    return f"FLASHKD_TEST_SEED={s} python -m pytest {shlex.quote(nodeid)}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    s = item.stash.get(SEED_KEY, None)
    if report.failed and s is not None:
        report.sections.append(("flashkd seed", f"seed {s}; replay: {_replay(item.nodeid, s)}"))
        report.flashkd_seed = s
    return report


def pytest_terminal_summary(terminalreporter):
    failed = [r for r in terminalreporter.stats.get("failed", []) + terminalreporter.stats.get("error", [])
              if hasattr(r, "flashkd_seed")]
    if failed:
        terminalreporter.section("flashkd seeds of the failures")
        for r in failed:
            terminalreporter.line(_replay(r.nodeid, r.flashkd_seed))


@pytest.fixture
def one_thread():
    """One intra-op thread, for tests whose tensors are tiny: on a loaded machine two threads make each
    small op wait for the other's core (7 ms a 16 x 32 linear against 33 us, measured here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def kernel_calls(monkeypatch):
    """The losses `triton_rows.rows` (the dense Triton row kernel's launcher) was called for in the test."""
    if not HAS_TRITON:
        return []
    from flashkd.backends import triton_rows

    calls, real = [], triton_rows.rows

    def rows(s, t, labels, spec, *args, **kwargs):
        calls.append(spec.loss)
        return real(s, t, labels, spec, *args, **kwargs)

    monkeypatch.setattr(triton_rows, "rows", rows)
    return calls
