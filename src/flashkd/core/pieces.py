"""The row pass beside the dX GEMM: a block's rows on a second CUDA stream in pieces, each piece's dX GEMM on the
call's stream beside the next piece's rows (`flashkd.core.loop`).

The row kernel is memory-bound, the GEMMs compute-bound, and a GEMM leaves SMs idle in its last wave and in
split-K's reduction; the rows of the next piece can take them. Per block of rows b (its logits made):

    side stream:   rows(p0) rows(p1) rows(p2) ...
    call's stream:   wait p0 | dX(p0) wait p1 | dX(p1) wait p2 | ... dX(plast); dW of the chunk after

A learning teacher's dXt of each piece goes with its dX (its dWt and db_t after the block). No more memory:
the pieces are rows of the block's logits, and the call's stream waits for the last piece before they are let
go. Pieces are not cut for a vocab slice (its rows exchange statistics), the CuTe tiles, a top-k teacher (its
own kernels) or dL/ds cast after the rows; nor off CUDA.
"""

from __future__ import annotations

import torch

from .gemms import gemm_rows


# Pieces a block's rows are cut in; 1: off, the default until measured on a GPU (`bash scripts/gpu_check.sh
# overlap` times 1, 2, 4 and 8 pieces at the seed against the four-GEMM floor).
OVERLAP_PIECES = 1
LEAST = 256  # rows a piece at least: a thinner dX GEMM loses more than the rows hide
ALIGN = 64  # a piece's rows a multiple of this (but the last): whole tiles of the dX GEMM
_SIDE_STREAMS = {}


class SideStream:
    """A device's second stream for the rows (high priority: they are on the critical path). `with` it: work
    queued there; `begin`: before a block's pieces, it waits for the call's stream (s, t made); `hand_over`: the
    call's stream waits for what is queued there. The call's stream waits after a block's last piece, before its
    logits are let go: the memory they free is then reused by work queued after the rows (no `record_stream`,
    whose held blocks would add a block of logits to the peak while the host runs ahead)."""

    def __init__(self, device):
        self.device = device
        self.stream = torch.cuda.Stream(device, priority=-1)
        self._context = None

    def begin(self):
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def hand_over(self):
        torch.cuda.current_stream(self.device).wait_event(self.stream.record_event())

    def after(self, done, p, dx):
        """Piece p's rows queued here: the piece before it (`done`, whose rows the call's stream has waited for)
        has its dX GEMMs `dx(done)` queued on the call's stream, beside p's rows, then the call's stream waits for
        p's rows. Returns p, the next call's `done`."""
        if done is not None:
            dx(done)
        self.hand_over()
        return p

    def __enter__(self):
        self._context = torch.cuda.stream(self.stream)
        return self._context.__enter__()

    def __exit__(self, *exc):
        return self._context.__exit__(*exc)


def side_stream(plan, device, want_dx, tiles, cast_after):
    """The rows' `SideStream`, or None where the pieces do not apply: no CUDA, no dX, a vocab slice (its rows
    exchange statistics), the CuTe tiles, a top-k teacher (its own kernels), or dL/ds cast after the rows."""
    if (OVERLAP_PIECES < 2 or not want_dx or plan.backend != "triton" or plan.vocab is not None
            or tiles is not None or cast_after or plan.form == "topk"):
        return None
    return device_side(device)


def device_side(device):
    """The device's `SideStream` (made once), None off CUDA."""
    if device.type != "cuda":
        return None
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = SideStream(torch.device("cuda", key))
    return _SIDE_STREAMS[key]


def cut(b: slice, parts: int) -> list[slice]:
    """b cut into up to `parts` pieces of at least LEAST rows, multiples of ALIGN but the last."""
    n = b.stop - b.start
    k = max(1, min(parts, n // LEAST))
    step = -(-(-(-n // k)) // ALIGN) * ALIGN
    return [slice(i, min(i + step, b.stop)) for i in range(b.start, b.stop, step)]


def dx(grads, ws, dxs, c: slice, p: slice, teacher=None) -> None:
    """dX of rows p of chunk c (its dL/ds rows in grads); a learning teacher's dXt of them too, teacher = (dL/dt of
    block b, wt, dxt, b)."""
    torch.mm(gemm_rows(grads[p.start - c.start:p.stop - c.start]), ws, out=dxs[p])
    if teacher is not None:
        dt, wt, dxt, b = teacher
        torch.mm(gemm_rows(dt[p.start - b.start:p.stop - b.start].to(wt.dtype)), wt, out=dxt[p])
