"""Vocab-parallel losses over torch.distributed, and FSDP2 heads that are never gathered.

A layer above the core: the public functions (`flashkd.distill`) route a call here only when it
passes `process_group=` or a head that is a DTensor (`run`, `teacher_topk`). Transport is torch.distributed's
(NCCL on GPUs, gloo on CPU).

Vocab-parallel (`process_group=`, `vocab_start=`)
------------------------------------------------
Every rank of the group passes the same rows (hidden states, labels, top-k targets) and the rows
[vocab_start, vocab_start + V_r) of each head (a dense teacher's logits: those columns); the
slices tile [0, V), in any order and of any sizes ≥ 1. Labels and top-k ids are global. The loss
is the unsharded call's, on every rank; dX is the full gradient on every rank (all-reduced); dW
and db are the slice's.

On backend "triton" the dense forms run the fused row kernel in phases
(`flashkd.backends.triton_rows.sliced_rows` on the `ShardedVocab`'s slice): pass 1 over the slice writes each
row's statistics at the slice's own maxima (the max and sum-exp of s/τ, t/τ and s, the online KL's
and the entropy's gap sums, cosine's three sums, the label's logit and whether the slice holds it:
12 fp32); one all-gather of them (`ShardedVocab.exchange`, which the core's row function calls between the
kernel's phases) lets every rank merge the row's as a
program merges its lanes; pass 2 takes the loss terms and writes dL/ds over the slice where its
constants are known (forward and reverse KL, cosine, the CE alone); jsd, tvd and forward KL with
grad add their pass-2 sums over the ranks (`ShardedVocab.exchange`: an all-reduce, R·4 fp32: JSD's K, TVD's masses,
forward KL's value) before pass 3 writes dL/ds. A top-k teacher's stats kernel runs on the slice
(its ids and labels made local: another rank's are unused slots here), one all-gather of its outputs
(s at the ids, the off-ids max and sums, the gap, the label's logit: R·(K + 3..6) fp32) gives the
whole row's, the (R, K + 1) categories follow on every rank alike, and the expand kernel writes the
slice's dL/ds (`flashkd.backends.triton_topk.topk_rows`). The gradients are analytic: no collective
in backward. On backend "torch" the torch row definition
(`flashkd.losses`) merges its row statistics (`ShardedVocab.merge`: the logsumexps' maxima, then
their sums with every other sum over the vocab, stacked) and autograd differentiates the merges.
O(R) fp32 per collective, never R × V. Collectives per block:

    form / loss                 forward                                   backward (with grads)
    Triton rows, dense          all-gather (R·12 per rank); for jsd, tvd,  none
                                forward KL with grad + SUM (R·4)
    Triton rows, top-k          all-gather (R·(K + 3..6) per rank)        none
    dense divergence + CE       MAX (R·3), SUM (R·4: lse sums, label),    SUM (R·1), SUM (R·4)
                                SUM (R·1: the divergence)
    cosine + CE                 MAX (R·1), SUM (R·5: lse, s·t, s·s, t·t, label)   SUM (R·5)
    top-k teacher + CE          MAX (R·2), SUM (R·(K + 3): lse sums, s at the ids, label)   SUM (R·(K + 3))
    teacher_topk                one all-gather of (R, 2k + 2) fp64: the local top-k and (max, sum-exp)

(without the CE each loses its R·1 MAX and SUM columns; tail "renormalize" its rest's; return_stats
adds the entropy to the last SUM, for a top-k teacher one more MAX and two SUMs). Per chunk
dX[c] = dS_r · W_r is all-reduced (asynchronously, while the next chunk computes): R · Hs · E bytes,
summed in dX's dtype (in bf16: one rounding per rank's part, where the unsharded GEMM rounds once);
per call one all-gather of a small int64 row per rank (its checks' status, vocab_start, V_r, row
count, the least and largest of its labels and top-k ids where it checks them, and options, encoded;
8 + 80 int64: world · 704 bytes gathered).

Memory per rank, beyond the inputs: the core's formulas (docs/memory.md) with V_r for V
(logits R·V_r·E, dW V_r·Hs·A), the torch backend's fp32 temporaries ≈ 6·R·V_r·4 where it runs,
plus O(R·n) for the merges (the Triton rows: R·(12·w + 4) fp32).

Every rank must make the same call (shapes, options, requires_grad): the collectives are issued in
the same order on every rank. So that a call wrong on some ranks only leaves none waiting in a
collective, each rank runs its local checks first and, instead of raising, puts their status in
that one all-gather, read on the host (one host sync a call): then a rank whose check failed raises
its error on every rank (the others name its rank; a second collective carries the text, on the
failing path only), and a row count or an option that changes the loss or the collectives (loss,
β, τ, the weights, reduction, ignore_index, the heads' transforms, k, chunk_size, ...; 2 and 2.0
are the same) that differs between ranks is a ValueError on every rank naming it; then the slices
must tile [0, V) without gaps or overlaps; then the labels and top-k ids must lie in [0, V) where
check_labels and check_teacher check them (V is the group's: a rank sends the least and largest of
its own, and the rank they fall outside of raises its own error, the others naming it; the checks
that need no V run before the exchange). check_shards=False skips that read: no host sync (with
chunk_size set: V stays a device tensor), no check of the layout or the options, and a call wrong on
some ranks only leaves the others waiting in a later collective. check_replicas=True checks (one
small all-gather) that the replicated rows are the same on every rank.

FSDP2 (a head weight that is a DTensor sharded on dim 0 over a 1-D mesh): `flashkd.distributed.fsdp`.
"""

from __future__ import annotations

from .sharding import Sharding
from .vocab import ShardedVocab

__all__ = ["ShardedVocab", "Sharding", "fail", "run"]


def run(call, sharding: Sharding):
    """A call (`flashkd.core.call.Call`, a loss's or teacher_topk's) that is vocab-parallel or has
    a DTensor head."""
    from . import fsdp, parallel

    if fsdp.has_dtensor_head(call):
        return fsdp.run(call, sharding)
    return parallel.run(call, sharding)


def fail(error: Exception, process_group, vocab_start, rows):
    """Raise error, found on this rank where a call was made, on every rank of process_group: this rank
    joins the group's exchange with it (`agreement.layout`). rows: the call's rows tensor (its device)."""
    from . import parallel

    parallel.fail(error, process_group, vocab_start, rows)
