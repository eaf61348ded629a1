"""The CuTe DSL logits GEMM (`flashkd.backends.cute_gemm`) compiled for sm_90a on this machine, down to a cubin,
without a GPU: each statistics count, two tile widths and each way z is stored; and kept on disk by one process,
loaded by the next (`cute_cache`). Catches code that CuTe DSL's tracer or the NVVM/ptxas backend refuses before a
GPU run does. Skipped where nvidia-cutlass-dsl is not installed (`flashkd[cute]`);
a few seconds a kernel."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("cutlass.cute")

from flashkd.backends import cute_gemm  # noqa: E402

SCRIPT = r"""
import sys
import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor
from cutlass.cute.typing import sym_int
from pathlib import Path
from flashkd.backends import cute_cache, cute_gemm

sums, tile_n, stages, store, epi_stages, gemm = sys.argv[1:7]
m, n, t = sym_int(), sym_int(), sym_int()
if gemm == "logits":  # x (R, K) and w (V, K), K contiguous
    k = sym_int(divisibility=8)
    major, raster = (sym_int(divisibility=8), 1, 1), "m"
else:  # "dw": dSᵀ (V, R) M-major (dS's rows inside S's) and Xᵀ (H, R) N-major, as the chunk loop hands them
    k = sym_int()
    major, raster = (1, sym_int(divisibility=8), 1), "n"
a = make_fake_tensor(cutlass.BFloat16, (m, k, 1), major, assumed_align=16)
b = make_fake_tensor(cutlass.BFloat16, (n, k, 1), major, assumed_align=16)
tma = store in ("tma", "add")  # z's rows 16-byte aligned, as `logits` and `accumulate` require for TMA stores
c = make_fake_tensor(cutlass.Float32, (m, n, 1), (sym_int(divisibility=4 if tma else 1), 1, 1),
                     assumed_align=16 if tma else 4)
p = make_fake_tensor(cutlass.Float32, (m, t), (sym_int(), 1), assumed_align=4)
kernel = cute_gemm._build(int(sums), int(tile_n), int(stages), 132, store, int(epi_stages), raster)
build = lambda: cute.compile(kernel, a, b, c, p, p, p, 1.0, 1.0, cuda.CUstream(0))
if sys.argv[7:] == ["cache"]:  # through the on-disk cache: say whether it compiled or loaded
    fn, how = cute_cache.load_or_compile(("fake",) + tuple(sys.argv[1:7]), Path(cute_gemm.__file__), build)
    print(how, callable(fn))
else:
    build()
    print("compiled")
"""


def _compile(*args):
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a")
    done = subprocess.run([sys.executable, "-c", SCRIPT, *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("sums,tile_n,stages,store", [
    (1, 128, 6, "tma"), (2, 128, 6, "tma"), (1, 128, 6, "direct"), (2, 128, 5, "direct"), (0, 128, 6, "tma"),
    (2, 64, 6, "tma")])
def test_the_logits_gemm_compiles_for_sm_90a(sums, tile_n, stages, store):
    _compile(sums, tile_n, stages, store, cute_gemm.EPI_STAGES, "logits")


@pytest.mark.parametrize("store", ["add", "tma"])
def test_the_weight_gradient_gemm_compiles_for_sm_90a(store):
    """`accumulate`'s kernel: operands of the other major, tiles n-fastest, reduce-add (or plain) TMA stores."""
    cfg = cute_gemm.ACCUMULATE
    _compile(0, cfg["tile_n"], cfg["stages"], store, cfg["epi_stages"], "dw")


def test_the_compiled_gemm_is_kept_on_disk_and_loaded_by_the_next_process(tmp_path):
    """`cute_cache` with the real export (`export_to_c`) and load (`cute.runtime.load_module`): the first
    process compiles and writes the kernel, the second loads it without compiling."""
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", FLASHKD_CACHE_DIR=str(tmp_path))
    args = ["1", "128", "6", "tma", "1", "logits", "cache"]
    outs = [subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, timeout=300, env=env)
            for _ in range(2)]
    assert [o.stdout.split() for o in outs] == [["compiled", "True"], ["cache", "True"]], outs[-1].stderr[-3000:]
    (folder,) = (tmp_path / "cute").iterdir()
    assert sorted(f.name for f in folder.iterdir()) == ["kernel.h", "kernel.o", "manifest.json"]


def test_the_row_pass_beside_the_gemm_probe_compiles_for_sm_90a():
    """probes/probe_cute_rows.py: the logits GEMM with a JSD row pass in warpgroup 0's idle warps (each variant:
    rows idle, rows alone, both)."""
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a")
    probe = os.path.join(os.path.dirname(__file__), "..", "probes", "probe_cute_rows.py")
    done = subprocess.run([sys.executable, probe, "--compile-only", "--rows", "77", "--vocab", "1000"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0 and done.stdout.count("compiled") == 3, done.stderr[-3000:]
