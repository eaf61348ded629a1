"""The row kernels compiled for an H100/H200 (sm_90) on this machine, no GPU needed.

The CPU tests run the kernels under TRITON_INTERPRET=1, which executes their Python: it accepts code
that the GPU code generator refuses (a name bound in one branch of a runtime `if` and read after it,
a scalar where a block is needed). Every phase of the dense row kernel, for every loss, with and
without a gradient, labels and the stats, and the top-k backend's kernels go through the real
compiler here, down to the cubin (ptxas ships with triton): a kernel that would fail its first launch
on a GPU fails here. The compiler runs in a process of its own, as whether `triton.jit` interprets is
fixed when flashkd's kernels are defined.
"""

from __future__ import annotations

import inspect
import itertools
import os
import subprocess
import sys

import pytest

_INTS = ("V", "stride_scale", "stride_t", "stride_g", "stride_gt", "ignore_index", "label_lo", "world", "stride_part", "stride_tile",
         "stat_tiles")
# (loss, the pass that writes dL/ds, ONLINE_KL, PSI): the power family's PSI, ψ's forms for its two powers
# (`triton_rows._psi_mode`), as Amari's α 0.3, Rényi's order 0.7, 1.4 and ½ (ψ's closed form), and the αβ-divergence
# at (2, 0.05) make them
_LOSSES = (("jsd", 3, False, 0), ("tvd", 3, False, 0), ("forward_kl", 2, False, 0), ("forward_kl", 0, True, 0),
           ("reverse_kl", 2, True, 0), ("reverse_kl", 0, True, 0), ("cosine", 2, False, 0), ("cosine", 0, False, 0),
           ("jeffreys", 3, False, 0), ("triangular", 3, False, 0), ("alpha_divergence", 3, False, 2 + 8 * 3),
           ("renyi", 3, False, 3 + 8 * 2), ("renyi", 3, False, 6 + 8 * 6), ("renyi_reverse", 3, False, 5 + 8 * 1), ("ab_divergence", 0, False, 2 + 8 * 3),
           ("entropy_adaptive", 3, False, 8 * 4), ("dkd", 2, False, 8 * 4), ("akl", 3, False, 8 * 4),
           ("mutual", 3, False, 0), ("co_jeffreys", 3, False, 0))
# AKL runs on whole rows only (phase 0), its head's keys in part_ptr (int64); a learning teacher's dL/dt is
# written on whole rows only (phase 0: T_GRAD where there is a gradient, in bf16 into its fp32 logits' bytes)
_WHOLE_ONLY = ("akl",)
_LEARNING = ("mutual", "co_jeffreys")


def _compile_phase(phase: int) -> int:
    """Compile every specialisation of one phase for sm_90; returns how many."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flashkd.backends import triton_rows
    from flashkd.losses import LOSS_ID

    kernel = triton_rows._rows_kernel
    names = list(inspect.signature(kernel.fn).parameters)
    count = 0
    for (loss, grad_pass, online, psi), (labels, stats, softcap) in itertools.product(
            _LOSSES, [(True, False, False), (False, True, True)]):
        if loss in _WHOLE_ONLY and phase != 0:
            continue
        labels = labels or loss == "dkd"  # DKD reads the label
        grad = grad_pass != 0
        learns = loss in _LEARNING and phase == 0 and grad
        constexprs = dict(
            LOSS=LOSS_ID["jeffreys" if loss in _LEARNING else loss], PULL=loss == "mutual", T_GRAD=learns, T_IN_PLACE=learns, T_RTNE_BITS=False, SOFT=True, CE=labels, LABELS=labels, GRAD_SOFT=grad, GRAD_CE=grad and labels,
            GRAD_PASS=grad_pass, CE_IS_Q=labels and loss != "cosine", ONLINE_KL=online, S_HEAD=2 if softcap else 0,
            T_HEAD=0, SCALED=softcap, STATS=stats, RTNE_BITS=False, RCP_FMA=0, IN_PLACE=grad, PSI=psi, PHASE=phase, WORLD_BLOCK=4,
            BLOCK_V=1024)
        signature = {}
        for name in names:
            if name.endswith("_ptr"):
                signature[name] = {"s_ptr": "*bf16", "g_ptr": "*bf16", "t_ptr": "*fp32" if learns else "*bf16", "gt_ptr": "*bf16",
                                   "labels_ptr": "*i64",
                                   "part_ptr": "*i64" if loss == "akl" else "*fp32"}.get(name, "*fp32")
            else:
                signature[name] = "i32" if name in _INTS else "constexpr" if name in constexprs else "fp32"
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, maxnreg=32))
        assert compiled.asm.get("cubin"), (loss, grad_pass, labels)
        count += 1
    return count


def _compile_topk() -> int:
    """The top-k backend's kernels (stats, expand, teacher top-k), each mode, for sm_90; returns how many."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flashkd.backends import triton_topk

    from flashkd.backends import triton_rows

    ints = ("V", "K", "k", "R", "stride_t", "search", "G_STRIDE")
    pointers = {"s_ptr": "*fp32", "g_ptr": "*bf16", "x_ptr": "*bf16", "ids_ptr": "*i64", "labels_ptr": "*i64", "redo_ptr": "*i8",
                "scratch_ptr": "*i64", "own_ptr": "*i8", "out_ptr": "*i64", "count_ptr": "*i32",
                "keep_ptr": "*i32", "const_ptr": "*fp64", "weight_ptr": "*fp64", "bounds_ptr": "*fp32",
                "pred_ptr": "*fp32", "u_ptr": "*fp32", "kept_ptr": "*i8", "lanes_ptr": "*i32"}
    variants = [(triton_topk.stats_kernel, dict(STREAM=stream, ONE=one, HEAD=head, STATS=stats, BLOCK_V=1024, BLOCK_K=64))
                for stream, one, head, stats in ((True, True, 0, True), (True, False, 2, False), (False, False, 0, False))]
    variants += [(triton_topk.expand_kernel, dict(REST=rest, CE=ce, HEAD=head, RTNE_BITS=False, BLOCK_V=1024, BLOCK_K=64))
                 for rest, ce, head in ((True, True, 0), (True, False, 2), (False, True, 1), (False, False, 0))]
    variants += [(triton_topk._topk_kernel, dict(HEAD=head, SLOTS=4, CAP=256, BLOCK_V=256)) for head in (0, 2)]
    # verl's membership: θ from the stats kernel, the rank count in the expand kernel's read (K 32 and 128)
    variants += [(triton_topk.stats_kernel, dict(STREAM=True, ONE=False, HEAD=0, STATS=False, BLOCK_V=1024, BLOCK_K=128,
                                                 OWN=True))]
    variants += [(triton_topk.expand_kernel, dict(REST=True, CE=False, HEAD=0, RTNE_BITS=False, BLOCK_V=1024,
                                                  BLOCK_K=32, OWN=own, CAP=512, ALIASED=True)) for own in (True, False)]
    variants += [(triton_topk.rank_kernel, dict(CAP=512, CH=32, BLOCK_K=block_k)) for block_k in (32, 128)]
    # AKL's head, the teacher bf16 and fp32, with and without a transform at load
    variants += [(triton_rows._akl_head_kernel, dict(T_HEAD=head, PARTS=16, BLOCK_V=256, SCAN=1024, t_dtype=t_dtype))
                 for head, t_dtype in ((0, "*bf16"), (3, "*fp32"))]
    variants += [(triton_rows._akl_top_kernel, dict(T_HEAD=head, SCAN=1024, t_dtype=t_dtype))
                 for head, t_dtype in ((0, "*bf16"), (3, "*fp32"))]
    variants += [(triton_rows._akl_candidates_kernel, dict(T_HEAD=head, SCAN=1024)) for head in (0, 3)]
    # verl's forward KL row math (float64), with and without the clamp and the gradient
    variants += [(triton_topk._clamped_kl_kernel, dict(CLAMP=clamp, GRAD=grad, WEIGHTS=weights, LO=True, HI=False,
                                                       BLOCK_R=16, BLOCK_K=32))
                 for clamp, grad, weights in ((True, True, 2), (False, False, 0))]
    for kernel, constexprs in variants:
        constexprs = dict(constexprs)
        t_dtype = constexprs.pop("t_dtype", "*bf16")
        for name, param in inspect.signature(kernel.fn).parameters.items():  # constexprs left at their defaults
            if name not in constexprs and param.default is not inspect.Parameter.empty and not name.endswith("_ptr"):
                constexprs[name] = param.default
        signature = {}
        for name in inspect.signature(kernel.fn).parameters:
            if name.endswith("_ptr"):
                signature[name] = t_dtype if name == "t_ptr" else pointers.get(name, "*fp32")
            else:
                signature[name] = "i32" if name in ints else "constexpr" if name in constexprs else "fp32"
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
        assert compiled.asm.get("cubin"), (kernel.fn.__name__, constexprs)
    return len(variants)


@pytest.mark.parametrize("phase", [0, 1, 2, 3, 4, "topk"])
def test_the_row_kernel_compiles_for_sm90_in_every_phase(phase, tmp_path):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # compiled afresh, not served from an earlier run
    done = subprocess.run([sys.executable, __file__, str(phase)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    every = 2 * (len(_LOSSES) - (len(_WHOLE_ONLY) if phase != 0 else 0))
    assert done.stdout.strip() == f"compiled {22 if phase == 'topk' else every}", done.stdout


if __name__ == "__main__":
    print(f"compiled {_compile_topk() if sys.argv[1] == 'topk' else _compile_phase(int(sys.argv[1]))}")
