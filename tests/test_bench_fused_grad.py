"""benchmarks/bench_fused_grad.py's dX kernel on CPU (its math, not its timings): the dS it forms in its
prologue and the dX it accumulates, against float64, at shapes that are multiples of none of its tiles.

Under the interpreter the kernel's fp32 -> bf16 cast truncates instead of rounding to nearest (Triton
3.6), so the dS it forms may sit one bf16 ulp (at most 2^-7 relative) from the correctly rounded value, where the
GPU is within half of one."""

import importlib.util
import pathlib
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.importorskip("triton")
else:
    pytest.skip("the CPU check of the probe; the GPU runs the probe itself", allow_module_level=True)

SCRIPT = pathlib.Path(__file__).parent.parent / "benchmarks" / "bench_fused_grad.py"
_spec = importlib.util.spec_from_file_location("bench_fused_grad", SCRIPT)
fg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fg)

ULP = 2.0**-7  # one bf16 ulp, relative, at most (8 significant bits)
TILES = (16, 32, 16, 4)


@pytest.fixture(scope="module")
def problem():
    return fg.Problem(40, 200, 48, "cpu", beta=0.3, seed=1)  # V, H: multiples of 8 (TMA strides)


@pytest.mark.parametrize("mode", ["plain", "correction", "full"])
def test_dx_matches_float64(problem, mode):
    pb = problem
    out, side = fg.dx_triton(pb, mode, True, TILES)
    ds = side.double()
    if mode == "plain":
        assert torch.equal(side, pb.ds_bf)  # the A it read is the dS it stores
    else:
        # formed in fp32 from S (and T) and the row constants: each element within an ulp of the truth,
        # plus, for the correction, the rounding of the stored K-free part it starts from
        q = torch.softmax(pb.s.double(), -1)
        bound = ULP * pb.ds.abs() + 1e-12
        if mode == "correction":
            bound += 2.0**-8 * pb.a_kfree.double().abs() + ULP * (pb.r.double()[:, None] * q).abs()
        assert ((ds - pb.ds).abs() <= bound).all()
    # dX = the formed dS times W, accumulated in fp32, rounded once to bf16
    want = ds @ pb.w.double()
    assert ((out.double() - want).abs() <= ULP * want.abs() + 1e-6 * want.abs().max()).all()
    if mode == "plain":
        # against the float64 truth, beside torch.mm on the same rounded dS: a truncated store errs by up to an
        # ulp where torch's rounding errs by half of one (the formed modes' dS carries the truncation too, a
        # bias toward 0 that a sum of products does not average out: their dS is checked above instead)
        mm = (torch.mm(pb.ds_bf, pb.w).double() - pb.dx_ref).abs().max()
        assert (out.double() - pb.dx_ref).abs().max() <= 2 * mm


def test_dry_run_cli():
    r = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--rows", "32", "--vocab", "96",
                        "--hidden", "64", "--tiles", "16x32x16x4", "--rep", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "dry run: every line ran once" in r.stdout
    assert r.stdout.count("max rel error") == 6 and "failed" not in r.stdout and "WRONG" not in r.stdout
