"""Process groups for the vocab-parallel and FSDP2 tests: `spawn` runs a worker on every rank (CPU, gloo,
or NCCL with FLASHKD_DIST_BACKEND=nccl), and `compare_sharded` holds a sharded call to the unsharded one.

A rank's stdout and stderr (Python's, and C++'s: gloo's messages, libstdc++'s "terminate called ...")
go to its log file, with faulthandler's Python stacks and torch's native stacks of every thread should
it die by a signal; a failing test's message carries every rank's log.
"""

from __future__ import annotations

import datetime
import math
import os
import sys
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

V, HS, HT, K = 37, 6, 5, 5
TOL = 1e-9  # fp64 throughout; the sharded sums only reorder fp64 additions
# Vocab slices [start, stop) held by ranks 0, 1, ...: uneven, a one-row slice, and not in rank order.
LAYOUTS = {2: [(0, 15), (15, V)], 3: [(26, V), (0, 25), (25, 26)]}


def spawn(worker, world: int, seed: int, *args, timeout=120):
    """worker(rank, world, seed, *args) on every rank (seed: the test's, from its `seed` fixture); a
    collective waiting past `timeout` seconds raises.

    A rank that fails, by a Python error or by a signal (from C++), fails the test with every rank's log:
    the stages each rank reached, what it wrote to stdout and stderr, and at a signal the Python stack
    (faulthandler) and the native stack (torch's fatal-signal handler) of every thread.
    """
    if os.environ.get("FLASHKD_DIST_BACKEND") == "nccl" and torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    with tempfile.TemporaryDirectory(prefix="flashkd-dist-") as tmp:
        try:
            mp.spawn(_entry, args=(worker, world, tmp, seed, timeout, *args), nprocs=world, join=True)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            logs = "\n".join(f"--- rank {r}:\n{_read(os.path.join(tmp, f'rank{r}.log'))}" for r in range(world))
            raise AssertionError(f"{e} (seed {seed})\n{logs}") from None


def _read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()[-20000:]
    except OSError as e:
        return f"(no log: {e})"


def _entry(rank, worker, world, tmp, seed, timeout, *args):
    import faulthandler

    log = open(os.path.join(tmp, f"rank{rank}.log"), "w", buffering=1)
    # fds 1 and 2 to the log: C++ writes there, not through sys.stderr
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.enable(log, all_threads=True)
    # at SIGSEGV, SIGABRT, ...: every thread's native stack, then faulthandler's Python stacks (it chains)
    getattr(torch._C, "_set_print_stack_traces_on_fatal_signal", lambda on: None)(True)
    # a fresh process that has imported flashkd (and the test module): the layer above the core is not loaded
    assert "flashkd.distributed" not in sys.modules, "importing flashkd imported flashkd.distributed"
    backend = os.environ.get("FLASHKD_DIST_BACKEND", "gloo")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # a file store, not TCP: no port to pick and lose between probing and binding, and no store server
    # thread in rank 0
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))
    log.write("initialized\n")
    try:
        worker(rank, world, seed, *args)
        log.write("worker returned\n")
        # every rank's queued collectives (FSDP2's gradient reduce-scatters run asynchronously) complete before
        # the process group is torn down
        dist.barrier()
        log.write("barrier passed\n")
    except BaseException:
        raise AssertionError(f"rank {rank}, seed {seed}:\n{traceback.format_exc()}") from None
    finally:
        dist.destroy_process_group()
        log.write("group destroyed\n")
    # The checks are done. torch leaves gloo's run-loop and transport threads running after
    # destroy_process_group, to be torn down with the interpreter; rank 0 (then also the TCP store's server)
    # has twice aborted ("terminate called without an active exception", SIGABRT: a joinable std::thread
    # destroyed, as at static destruction) after a passing FSDP2 run with no Python error on either rank.
    # What these tests check ends here, so a rank leaves without that teardown.
    log.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def rank_device():
    """NCCL: a GPU per rank; gloo: the CPU, or with FLASHKD_DIST_DEVICE=cuda the one GPU every rank shares."""
    if dist.get_backend() == "nccl" or os.environ.get("FLASHKD_DIST_DEVICE") == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_close(name, got, want, tol=TOL):
    """got within tol of want's largest magnitude (at least 1), NaN where want is NaN."""
    assert got.shape == want.shape, (name, got.shape, want.shape)
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    scale = max(want.double().abs().max().item() if want.numel() else 0.0, 1.0)
    assert err <= tol * scale or (torch.isnan(got).equal(torch.isnan(want)) and math.isnan(err)), (name, err, scale)


def sharded_inputs(gen, n, dtype, device, *, vt=V, bias=False, ignore=True):
    """(xs, ws, xt, wt, labels, bs, bt) from gen: the same on every rank; every 4th label ignored."""
    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype=dtype, device=device)

    xs, ws = rand(n, HS), rand(V, HS, scale=0.8)
    xt, wt = rand(n, HT), rand(vt, HT, scale=0.8)
    labels = torch.randint(0, V, (n,), generator=gen).to(device)
    if ignore:
        labels[:: 4] = -100
    bs = rand(V) if bias else None
    bt = rand(vt) if bias else None
    return xs, ws, xt, wt, labels, bs, bt


def param_grads(loss, leaves):
    """The gradients of loss w.r.t. leaves, None for a None leaf."""
    wanted = [x for x in leaves if x is not None]
    got = iter(torch.autograd.grad(loss, wanted))
    return [None if x is None else next(got) for x in leaves]


def leaf(x):
    return None if x is None else x.detach().clone().requires_grad_()


def compare_sharded(fn, case, full, shard, start, stop, **options):
    """fn(*inputs, **options) unsharded on `full` and vocab-parallel on `shard`; returns nothing, raises."""
    # the torch backend on GPUs too: its fp64 math is the tight reference (the sharded call uses it)
    want = fn(*full["args"], **full["kw"], backend="torch", **options)
    got = fn(*shard["args"], **shard["kw"], backend="torch", **options)
    want, got = flat_tensors(want), flat_tensors(got)
    assert len(got) == len(want), case
    for i, (g, w) in enumerate(zip(got, want)):
        check_close(f"{case}: output {i}", g, w)
    if not want[0].requires_grad:
        return
    leaves_full, leaves_shard = full["leaves"], shard["leaves"]
    for name, g, w, x in zip(("dX", "dW", "db"), param_grads(got[0], leaves_shard), param_grads(want[0], leaves_full),
                             leaves_full):
        if x is None:
            continue
        if name != "dX":
            w = w[start:stop]  # the rank's rows of the unsharded gradient
        check_close(f"{case}: {name}", g, w)


def flat_tensors(out):
    """The tensors of a result: the loss, (soft, hard), DistillStats' fields (None left out)."""
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for x in out if x is not None for t in flat_tensors(x)]
