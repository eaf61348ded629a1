"""Row backends: each exposes `rows` (dense teacher) and `topk_rows` (sparse teacher), both
`(s, t, labels, spec, scale, grad, stats=False) -> (soft, hard)`.

The chunk loop in `flashkd.core.loop` computes one block of logits with two GEMMs and hands it to a
backend's `rows`, which returns the per-row losses and, when `grad`, overwrites `s` with dL/ds:

    s:      (R, V) student logits of the block, contiguous; overwritten with dL/ds when `grad`
    t:      (R, V) teacher logits of the block, same dtype, unit stride over V (None when the soft term
            is not wanted); for a top-k teacher (spec.tail set, `topk_rows`) the pair (ids, logprobs),
            (R, K) each
    labels: (R,)   int labels or None
    spec:   flashkd.losses.LossSpec
    scale:  () or (R,) device tensor, fp32 (fp64 for fp64 inputs): the reduction's factor (1 / valid
            rows, or 1), times each row's weight when the call has a row_weight ((R,) then)
    grad:   bool   write dL/ds = scale · (w_hard · dCE/ds + soft_scale · dsoft/ds); 0 on ignored rows
    stats:  bool   also return the per-row statistics of `flashkd.losses.DistillStats` (spec.want_soft
            holds then)
    returns (soft, hard): (R,) fp32 each (torch: fp64 for fp64 inputs), unweighted and unscaled, 0 on
            ignored rows; without labels `hard` is 0. A label outside [0, V) that is not ignore_index
            gives a NaN `hard` on its row and no CE gradient there. With stats: (soft, hard, entropy)
            for `rows`, (soft, hard, entropy, mass, teacher_entropy) for `topk_rows`, each (R,), 0 on
            ignored rows.
    The logits are the heads' raw outputs: the spec's logit scales and softcaps are the backend's to
    apply (`flashkd.losses.logit_transform`), and dL/ds is w.r.t. the raw s.

Keywords beyond the contract: `vocab` (torch): the block's slice of a vocab sharded over a process group
(a `flashkd.losses.VocabSlice`), whose `merge` the torch row definitions reduce through; `ds` (Triton):
a buffer of s's shape that gets dL/ds instead of s, rounded once to its dtype (bf16 gradients of fp32
logits). A slice on the Triton rows is `sliced_rows` / `sliced_topk_rows` (start=, total=): a generator
that yields the row statistics its ranks must exchange and takes them back, so that no backend runs a
collective (`flashkd.core.backend.row_function` has the slice exchange them).
"""
