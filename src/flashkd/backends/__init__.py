"""Row backends: each exposes `rows(s, t, labels, spec, scale, grad) -> (soft, hard)`.

The chunk loop in `flashkd.distill` computes one block of logits with two GEMMs and hands it to a
backend's `rows`, which returns the per-row losses and, when `grad`, overwrites `s` with dL/ds:

    s:      (R, V) student logits of the block, contiguous; overwritten with dL/ds when `grad`
    t:      (R, V) teacher logits of the block, same dtype (None when the soft term is not wanted)
    labels: (R,)   int labels or None
    spec:   flashkd.losses.LossSpec
    scale:  ()     fp32 device tensor, the reduction's factor (1 / valid rows for "mean", 1 for "sum")
    grad:   bool   write dL/ds = scale · (w_hard · dCE/ds + soft_scale · dsoft/ds); 0 on ignored rows
    returns (soft, hard): (R,) fp32 each, unweighted and unscaled, 0 on ignored rows
"""
