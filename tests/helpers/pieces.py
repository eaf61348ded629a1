"""The chunk loop's pieces (`flashkd.core.pieces`) run in line on the CPU: a side stream that queues nothing
apart, so that what the pieces compute is checked where no CUDA stream is."""

import contextlib

from flashkd.core import pieces


class InLine(contextlib.nullcontext):
    """A side stream whose work runs where it is queued."""

    def begin(self):
        pass

    def hand_over(self):
        pass

    def after(self, done, p, dx):
        if done is not None:
            dx(done)
        return p


def in_pieces(monkeypatch, parts=2, least=1, align=1):
    """The loop's blocks cut in up to `parts` pieces of `least` rows or more (multiples of `align`), run in line;
    returns the list each piece's dX call appends its (grads, ws, dxs, c, p, teacher) to."""
    used = []
    dx = pieces.dx
    monkeypatch.setattr(pieces, "dx", lambda *a, **k: (used.append((*a, k.get("teacher"))), dx(*a, **k))[1])
    monkeypatch.setattr(pieces, "device_side", lambda device: InLine())
    monkeypatch.setattr(pieces, "LEAST", least)
    monkeypatch.setattr(pieces, "ALIGN", align)
    monkeypatch.setattr(pieces, "OVERLAP_PIECES", parts)
    return used
