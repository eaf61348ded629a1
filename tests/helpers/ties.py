"""Comparisons across a jump: TVD's sign(q − p), a clamp (TRL's tail, verl's log-prob floor), AKL's head set.

Where the two sides of a comparison (a kernel in fp32, the float64 truth) sit within their own rounding
of a discontinuity, either branch is right, and they may take different ones. These helpers find such
ties and make a comparison tolerant there and nowhere else. Two ways, by what the comparison allows:

- elementwise (a row kernel's dL/ds against the torch rows'): `assert_close_except_at_ties`, with a
  slack per element that is 0 away from the ties (`tvd_slack`);
- through a GEMM (dX, dW, the loss): the rows that hold a tie leave the comparison, on both sides alike
  (`drop_tied_rows`: label −100; or `tied_rows`, and the test drops them in its own API: weight 0).

Either way the ties must be few (`assert_few`): inputs that tie everywhere would test nothing.
"""

import math

import torch

from oracle import head

F32_EPS = torch.finfo(torch.float32).eps
# How close to a jump fp32 may land on its other side. Logits read as given (the row kernels): a few
# roundings of each operand (seed 626848574 put a row's q and p 3.4 ulp apart in
# test_softcap_tanh.py); logits an fp32 GEMM made over tens of bf16 products: ~1e-6 of a logit of 30.
ROWS_RTOL = 16 * F32_EPS
GEMM_RTOL = 1e-5
MAX_TIED = 0.02  # of a row kernel's elements; of the rows, `tied_rows` allows 0.25


def near(a, b, rtol=ROWS_RTOL, atol=0.0):
    """Where a and b are too close for fp32 to order: |a − b| <= rtol · max(|a|, |b|) + atol, in float64."""
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return (a - b).abs() <= rtol * torch.maximum(a.abs(), b.abs()) + atol


def assert_few(tied, max_fraction=MAX_TIED, what="elements"):
    """tied, after checking that at most max_fraction of it, or one element, is True."""
    k, n = int(tied.sum()), tied.numel()
    assert k <= max(1.0, max_fraction * n), f"{k} of {n} {what} at a tie: inputs this degenerate test nothing"
    return tied


def tvd_slack(q, p, factor=1.0, rtol=ROWS_RTOL):
    """Per element of TVD's dL/dz (q, p: the rows' softmaxes along the last dim): how far it may move
    where g = sign(q − p) flips at a tie. dL/dz = ½ q ∘ (g − Σ q g) · factor, so a flip of g_j moves
    element j by up to q_j and every element i by q_i q_j (times factor): that much per element for
    the ties of its row, 0 in a row without one. A q of 0 moves nothing: no tie there."""
    q, p = q.double(), p.double()
    tie = assert_few(near(q, p, rtol) & (q > 0))
    return factor * (q * tie + q * (q * tie).sum(-1, keepdim=True))


def assert_close_except_at_ties(actual, expected, slack=None, *, rtol, atol, equal_nan=False, msg=""):
    """|actual − expected| <= rtol · |expected| + atol + slack, elementwise in float64. slack (from
    `tvd_slack`, broadcast) is how far an element may move at a tie, 0 elsewhere: every element away
    from a tie is held to rtol and atol. equal_nan: NaN matches NaN."""
    actual, expected = actual.double(), expected.double()
    bound = rtol * expected.abs() + atol + (0.0 if slack is None else slack)
    diff = (actual - expected).abs()
    bad = ~(diff <= bound)
    if equal_nan:
        bad &= ~(actual.isnan() & expected.isnan())
    assert not bad.any(), (f"{msg}{': ' if msg else ''}{int(bad.sum())} element(s) off; worst excess "
                           f"{(diff - bound).nan_to_num(posinf=1e30).max().item():.3g}")


# ------------------------------------------------------------------------------- rows that leave the comparison


def tied_rows(tie, max_fraction=0.25):
    """(rows,) bool: the rows of tie (..., C), its leading dims flattened, that hold a tie; few of them."""
    rows = tie.reshape(-1, tie.shape[-1]).any(-1) if tie.dim() > 1 else tie.reshape(-1)
    return assert_few(rows, max_fraction, "rows")


def ignore_rows(labels, rows, ignore_index=-100):
    """labels (any shape) with `rows` (flattened, from tied_rows) set to ignore_index: those rows then count
    on neither side (no CE, no soft term, zero dX), and the mean divides by the others alike."""
    labels = labels.clone()
    labels.view(-1)[rows.to(labels.device)] = ignore_index
    return labels


def logits64(x, w, b=None):
    """float64 x @ w^T (+ b), detached: a head's logits as the oracle forms them."""
    z = x.detach().double() @ w.detach().double().T
    return z if b is None else z + b.detach().double()


def probs(logits, temperature=1.0, scale=1.0, softcap=None):
    """float64 softmax(head(logits) / τ) over the last dim, rows flattened: the oracle's q or p."""
    z = logits.detach().double()
    return torch.softmax(head(z.reshape(-1, z.shape[-1]), scale, softcap) / temperature, -1)


def topk_categories(q, ids, logprobs, tail, tail_clamp=None, rtol=GEMM_RTOL):
    """(q_c, p_c) (rows, K + 1), float64: the student's and the teacher's probabilities over a top-k row's
    categories as `oracle.topk_loss` forms them (the used ids, then the bucket, or renormalized over the
    ids), 0 in unused slots on both sides; and the clamp's ties, (rows,) bool: where Σ over the ids of
    either side is within rtol of the cap e^−ε (bucket with tail_clamp). Where the clamp flips, the
    gradient moves by about ε: for ε <= 1e-5 (TRL's 1e-7) less than any tolerance here, so no tie."""
    ids = ids.reshape(-1, ids.shape[-1])
    used = ids >= 0
    q_ids = torch.where(used, q.gather(-1, ids.clamp_min(0)), 0.0)
    p_ids = torch.where(used, logprobs.reshape(ids.shape).double().exp(), 0.0)
    sq, sp = q_ids.sum(-1, keepdim=True), p_ids.sum(-1, keepdim=True)
    clamp_ties = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    if tail == "renormalize":
        q_c = torch.cat([q_ids / sq.clamp_min(1e-300), torch.zeros_like(sq)], -1)
        p_c = torch.cat([p_ids / sp.clamp_min(1e-300), torch.zeros_like(sp)], -1)
    elif tail_clamp is not None:
        cap = math.exp(-tail_clamp)
        q_c = torch.cat([q_ids, 1 - sq.clamp(max=cap)], -1)
        p_c = torch.cat([p_ids, 1 - sp.clamp(max=cap)], -1)
        if tail_clamp > 1e-5:
            clamp_ties = (near(sq, cap, rtol) | near(sp, cap, rtol)).reshape(-1)
    else:
        q_c = torch.cat([q_ids, (1 - sq).clamp_min(0)], -1)
        p_c = torch.cat([p_ids, (1 - sp).clamp_min(0)], -1)
        p_c = p_c / p_c.sum(-1, keepdim=True)
    return q_c, p_c, clamp_ties


def divergence_ties(loss, q, p, rtol=GEMM_RTOL, head_mass=0.5):
    """(rows, C) bool: where the soft term's gradient jumps within fp32's reach of q and p (rows' distributions
    over their categories): TVD's sign(q − p) (where q > 0: elsewhere it moves nothing); AKL's head set
    (`akl_head_ties`); nowhere for the smooth losses."""
    if loss == "tvd":
        return near(q, p, rtol) & (q > 0)
    if loss == "akl":
        return akl_head_ties(p, head_mass, rtol)
    return torch.zeros(q.shape, dtype=torch.bool, device=q.device)


def akl_head_ties(p, head_mass, rtol=GEMM_RTOL):
    """(rows, C) bool, in the sorted order: where AKL's head set (p sorted descending, the head where the
    cumulative sum is at most μ, the first always) may differ in fp32, as its boundary sum is within
    rtol of μ, or two probabilities that straddle the boundary are within rtol of each other (fp32 may
    order them the other way; equal ones are ordered by id on both sides)."""
    sorted_p, _ = p.double().sort(dim=-1, descending=True, stable=True)
    cum = sorted_p.cumsum(-1)
    tie = near(cum, torch.full_like(cum, head_mass), rtol)
    tie[..., 0] = False  # the first is in the head whatever its mass
    boundary = (cum > head_mass)
    boundary[..., 0] = False
    last_head = (~boundary).sum(-1, keepdim=True) - 1  # the head's last position
    nxt = (last_head + 1).clamp(max=p.shape[-1] - 1)
    a, b = sorted_p.gather(-1, last_head), sorted_p.gather(-1, nxt)
    straddle = near(a, b, rtol) & (a != b) & (nxt != last_head)
    return tie | (straddle & torch.zeros_like(tie).scatter(-1, nxt, True))


def drop_tied_rows(labels, student_logits, teacher_logits=None, *, loss=None, ids=None, logprobs=None, rtol=GEMM_RTOL,
                   temperature=1.0, student_logit_scale=1.0, student_softcap=None, teacher_logit_scale=1.0,
                   teacher_softcap=None, tail="bucket", tail_clamp=None, head_mass=0.5, ignore_index=-100, **_):
    """labels with the rows ignored where the soft term of `loss` jumps within fp32's reach (an fp32 GEMM's
    rtol): against the dense teacher's teacher_logits, or a top-k teacher's (ids, logprobs). The logits
    are the heads' own, float64 products of the same inputs (bias added); the other options are the
    call's (those the oracle takes; the rest are not looked at). A padded teacher head's columns past
    the student's vocab are dropped, as the oracle drops them."""
    if loss not in ("tvd", "akl") and tail_clamp is None:
        return labels
    q = probs(student_logits, temperature, student_logit_scale, student_softcap)
    if ids is None:
        p = probs(teacher_logits[..., : q.shape[-1]], temperature, teacher_logit_scale, teacher_softcap)
        ties = divergence_ties(loss, q, p, rtol, head_mass)
    else:
        q, p, clamp = topk_categories(q, ids, logprobs, tail, tail_clamp if tail == "bucket" else None, rtol)
        ties = divergence_ties(loss, q, p, rtol, head_mass) | clamp[:, None]
    return ignore_rows(labels, tied_rows(ties), ignore_index)
