"""The probes in probes/ on CPU, seconds. probe_logit_repr.py at small shapes: its representations keep the
error bound they claim, and its fp32 line (the exact pipeline) meets the bar while the 2-byte lines' loss errors
do not. The CuTe probes: where they cannot run, they say so."""

import importlib.util
import math
import pathlib

import pytest
import torch

SCRIPT = pathlib.Path(__file__).parent.parent / "probes" / "probe_logit_repr.py"


def _probe():
    spec = importlib.util.spec_from_file_location("probe_logit_repr", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tile_relative_error_stays_under_the_half_ulp_of_the_distance_to_the_row_max(seed):
    probe = _probe()
    gen = torch.Generator().manual_seed(seed)
    z = (4 * torch.randn(5, 300, generator=gen)).float()
    z[0, 7], z[1, 5] = 30.0, -math.inf
    z[2, 16:32] = -math.inf  # a whole tile masked
    for dtype, eps in ((torch.float16, 2.0**-11), (torch.bfloat16, 2.0**-8)):
        r = probe.tile_relative(z, 16, dtype)
        assert r.dtype == torch.float32 and r.shape == z.shape
        assert torch.equal(r.isinf(), z.isinf())
        finite = z.isfinite()
        dist = (z.amax(-1, keepdim=True) - z).double()
        # |z − m_tile| ≤ |z − m_row|; the half-ulp of a value d is ≤ eps·d, plus fp32's rounding of m_tile + d
        bound = eps * dist + 2.0**-23 * z.abs().double() + 1e-30
        assert ((r.double() - z.double()).abs() <= bound)[finite].all()


def test_the_probe_separates_the_exact_line_from_the_two_byte_ones(capsys):
    probe = _probe()
    import sys

    argv, sys.argv = sys.argv, ["probe", "--n", "8", "--v", "4096", "--seeds", "1"]
    try:
        probe.main()
    finally:
        sys.argv = argv
    worst = {}
    for line in capsys.readouterr().out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 6 and cells[0] in probe.REPRS:
            worst[(cells[0], cells[1])] = (float(cells[2]), cells[5])
    assert worst[("fp32", "soft")][1] == worst[("fp32", "soft+CE")][1] == "yes"
    assert worst[("fp32", "soft")][0] <= 1e-5
    assert worst[("bf16rel", "soft")][0] > 1e-5  # a representation that fails the bar is reported as failing


@pytest.mark.parametrize("name", ["probe_cute_gemm", "probe_cute_rows"])
def test_the_cute_probes_say_what_they_need_where_they_cannot_run(name):
    """The CuTe probes are GPU only (CuTe DSL compiles for the GPU): without one, or without the package, each
    exits non-zero with one line saying so, not a traceback."""
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the probe runs in scripts/gpu_check.sh cute")
    done = subprocess.run([sys.executable, str(SCRIPT.parent / f"{name}.py")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    assert f"{name}: needs" in done.stderr and "Traceback" not in done.stderr, done.stderr
