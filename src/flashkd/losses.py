"""The distillation losses, as data, and their one pure-torch definition.

Each side's logits x are first transformed as its model's head does (`logit_transform`): with a
logit scale σ and a softcap c (None: no cap),

    z = c · tanh(σ x / c)        (z = σ x without a cap);   dz/dx = σ (1 − (z/c)²)   (σ without a cap)

(Cohere's `logit_scale`, Granite's 1 / `logits_scaling`, Falcon-H1's `lm_head_multiplier` are σ; Gemma's
`final_logit_softcapping` is c). Below, a and b are the transformed student and teacher logits; the
gradient w.r.t. the student's x is dL/da · da/dx, element by element.

Per row, with temperature τ, student logits a, teacher logits b, q = softmax(a/τ), p = softmax(b/τ):

    loss          value                                   dL/da
    forward_kl    KL(p‖q) = Σ p (log p − log q)           (q − p) / τ
    reverse_kl    KL(q‖p) = Σ q (log q − log p)           q ∘ (log q − log p − KL(q‖p)) / τ
    jsd (β)       β KL(p‖M) + (1−β) KL(q‖M),              (1−β) q ∘ (log(q/M) − K) / τ,   K = Σ q log(q/M)
                  M = β p + (1−β) q
    tvd           ½ Σ |q − p|                             ½ q ∘ (σ − Σ q σ) / τ,          σ = sign(q − p)
    cosine        β (1 − cos(a, b))                       −β (b / (‖a‖‖b‖) − cos · a / ‖a‖²)
    hard CE       logsumexp(a) − a_y   (untempered)       softmax(a) − onehot(y)

JSD endpoints follow the Liger / TRL convention: β = 0 is forward KL(p‖q), β = 1 is reverse KL(q‖p)
(not the limit of the formula, which is 0 at both ends). Cosine is invariant to τ.

The total is  w_hard · CE + w_soft · c · soft,  c = τ² when `temperature_squared` (Hinton) else 1,
each term summed over rows whose label is not `ignore_index`, times the row's weight when `row_weight`
is given, and divided by the number of such rows ("mean", at least 1; the weights do not change it)
or by 1 ("sum").

A top-k teacher gives p at K ids per row only. The divergences above (not cosine) are then taken
over categories: the K ids and one bucket for the rest of the vocab (tail "bucket": q_rest = Σ q off
the ids, p_rest = max(1 − Σ p, 0)), or the K ids with q and p renormalised over them ("renormalize").
q over the categories is softmax(z) of z = (a_ids/τ, logsumexp(a_rest/τ)), so dL/da follows from the
table through dz_rest/da_j = softmax(a_rest/τ)_j / τ.

`row_losses` and `topk_row_losses` below are the single torch definition of these formulas: the torch
backend differentiates them chunk by chunk with autograd, the benchmark's naive provider runs them over
the full logits, and the Triton kernels (`flashkd.backends.triton_rows`, `triton_topk`) implement the
analytic gradients.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch

LOSSES = ("jsd", "forward_kl", "reverse_kl", "tvd", "cosine")
DIVERGENCES = LOSSES[:4]  # the losses between distributions: the ones a top-k teacher allows
REDUCTIONS = ("mean", "sum")
TAILS = ("bucket", "renormalize")  # sparse teacher: what happens to the mass outside the K ids

# Loss ids shared with the Triton kernel's constexpr switch.
LOSS_ID = {name: i for i, name in enumerate(LOSSES)}


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """Everything the row math needs to know about one call; validated once, passed as one object."""

    loss: str = "jsd"
    beta: float = 0.5
    temperature: float = 1.0
    weight_hard: float = 0.5
    weight_soft: float = 0.5
    temperature_squared: bool = False
    ignore_index: int = -100
    reduction: str = "mean"
    want_hard: bool = True  # compute the CE at all (weighted in, or returned for logging)
    want_soft: bool = True  # compute the divergence at all (and the teacher's logits for it)
    tail: str | None = None  # sparse (top-k) teacher: one of TAILS; None for a dense teacher
    # each side's head transform (`logit_transform`); a top-k teacher's are always the defaults
    student_logit_scale: float = 1.0
    student_softcap: float | None = None
    teacher_logit_scale: float = 1.0
    teacher_softcap: float | None = None

    def __post_init__(self):
        allowed, teacher = (LOSSES, "") if self.tail is None else (DIVERGENCES, " for a top-k teacher")
        if self.loss not in allowed:
            raise ValueError(f"loss: expected one of {', '.join(map(repr, allowed))}{teacher}, got {self.loss!r}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction: expected 'mean' or 'sum', got {self.reduction!r}")
        for name in ("beta", "temperature", "weight_hard", "weight_soft"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TypeError(f"{name}: expected a finite Python float, got {value!r}")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta: expected a value in [0, 1], got {self.beta!r}")
        if self.temperature <= 0.0:
            raise ValueError(f"temperature: expected a value > 0, got {self.temperature!r}")
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise TypeError(f"ignore_index: expected an int, got {self.ignore_index!r}")
        if self.tail is not None and self.tail not in TAILS:
            raise ValueError(f"tail: expected 'bucket' or 'renormalize', got {self.tail!r}")
        check_logit_transform("student_logit_scale", self.student_logit_scale, "student_softcap", self.student_softcap)
        check_logit_transform("teacher_logit_scale", self.teacher_logit_scale, "teacher_softcap", self.teacher_softcap)

    @property
    def kind(self) -> str:
        """The divergence actually computed, with the JSD endpoints resolved."""
        if self.loss == "jsd" and self.beta == 0.0:
            return "forward_kl"
        if self.loss == "jsd" and self.beta == 1.0:
            return "reverse_kl"
        return self.loss

    @property
    def soft_scale(self) -> float:
        """Factor on the soft term inside the total: w_soft, times τ² when asked for."""
        return self.weight_soft * (self.temperature**2 if self.temperature_squared else 1.0)

    def total(self, soft: torch.Tensor, hard: torch.Tensor) -> torch.Tensor:
        """w_hard · hard + w_soft · c · soft, for (sums of) the per-row terms of `row_losses`."""
        return self.weight_hard * hard + self.soft_scale * soft

    def student(self, s: torch.Tensor) -> torch.Tensor:
        """The student's logits as its head transforms them (`logit_transform`)."""
        return logit_transform(s, self.student_logit_scale, self.student_softcap)

    def teacher(self, t: torch.Tensor) -> torch.Tensor:
        """The teacher's logits as its head transforms them."""
        return logit_transform(t, self.teacher_logit_scale, self.teacher_softcap)


class DistillStats(NamedTuple):
    """Per-call sums for logging, returned with `return_stats=True`; 0-d tensors, detached, on the
    inputs' device (no host sync). Sums, not means, so that they add across micro-batches and ranks.

    soft_sum       Σ row_weight · soft over the rows that count: the divergence itself (before
                   w_soft and τ²; cosine's β (1 − cos) included)
    hard_sum       Σ row_weight · CE over the rows that count (0 without labels)
    rows           number of rows that count: label not ignore_index (all rows without labels);
                   int64. The "mean" loss is (w_hard · hard_sum + w_soft · c · soft_sum) / max(rows, 1)
    entropy_sum    Σ H(q) over the rows that count, unweighted, in nats: q = softmax(a/τ) of the
                   transformed student logits (the per-token entropy TRL logs is entropy_sum / rows)
    topk_mass_sum  top-k teacher only (else None): Σ over the rows that count of the student's
                   probability mass q on the teacher's used ids, unweighted
    """

    soft_sum: torch.Tensor
    hard_sum: torch.Tensor
    rows: torch.Tensor
    entropy_sum: torch.Tensor
    topk_mass_sum: torch.Tensor | None


def check_logit_transform(scale_name: str, scale, cap_name: str, cap) -> None:
    """A logit scale must be a finite non-zero Python float, a softcap None or a finite float > 0."""
    for name, value in ((scale_name, scale), (cap_name, cap)):
        if value is None and name == cap_name:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name}: expected a Python float{' or None' if name == cap_name else ''}, got {value!r}")
    if not math.isfinite(scale) or scale == 0.0:
        raise ValueError(f"{scale_name}: expected a finite non-zero float, got {scale!r}")
    if cap is not None and not (math.isfinite(cap) and cap > 0.0):
        raise ValueError(f"{cap_name}: expected a finite float > 0 (or None for no cap), got {cap!r}")


def logit_transform(x: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """z = x · scale, then softcap · tanh(z / softcap) when a softcap is set; x itself when neither."""
    if scale != 1.0:
        x = x * scale
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    return x


def row_losses(s: torch.Tensor, t: torch.Tensor, labels: torch.Tensor | None, spec: LossSpec, *, stats=False):
    """Per-row soft and hard losses of one block of logits, in fp32; differentiable w.r.t. `s`.

    s:      (R, V) student logits, any float dtype, before the head's transform (`LossSpec.student`)
    t:      (R, V) teacher logits, same V, before its transform (unused, may be None, when
            `spec.want_soft` is False)
    labels: (R,) integer labels or None
    Returns (soft, hard), each (R,) in fp32 (fp64 for fp64 inputs), zero on rows whose label is `ignore_index`. `soft` is the
    unweighted divergence; `hard` the untempered CE (zeros when `spec.want_hard` is False). A label
    outside [0, V) that is not `ignore_index` gives a NaN hard loss on its row. With `stats`, also the
    entropy of q = softmax(a/τ) per row (R,), zero on ignored rows: (soft, hard, entropy).
    """
    work = torch.promote_types(s.dtype, torch.float32)
    s = spec.student(s.to(work))
    log_q = None
    if not spec.want_soft:
        soft = s.new_zeros(s.shape[0])
    elif spec.kind == "cosine":
        t = spec.teacher(t.to(work))
        dot = (s * t).sum(-1)
        norm = s.norm(dim=-1).clamp_min(COSINE_EPS) * t.norm(dim=-1).clamp_min(COSINE_EPS)
        soft = spec.beta * (1.0 - dot / norm)
    else:
        log_q = torch.log_softmax(s / spec.temperature, dim=-1)
        log_p = torch.log_softmax(spec.teacher(t.to(work)) / spec.temperature, dim=-1)
        soft = _divergence(log_q, log_p, spec)
    soft, hard = _with_hard(s, soft, labels, spec)
    if not stats:
        return soft, hard
    if log_q is None:
        log_q = torch.log_softmax(s / spec.temperature, dim=-1)
    return soft, hard, _valid_only(_entropy(log_q.detach()), labels, spec)


def topk_row_losses(s: torch.Tensor, t, labels: torch.Tensor | None, spec: LossSpec, *, stats=False):
    """`row_losses` for a sparse teacher: p is given at K ids per row (`spec.tail` says how).

    t = (ids, logprobs), or None when `spec.want_soft` is False:
      ids:      (R, K) integer vocab ids, −1 for an unused slot (no duplicates among the used ones)
      logprobs: (R, K) teacher log-probs at those ids (ignored in unused slots)
    The divergence is the dense one of the table above over categories: with tail "bucket" the K ids
    plus one category for the rest of the vocab (q_rest = Σ q off the ids, p_rest = max(1 − Σ p, 0),
    and p_rest = 0 when the ids cover the vocab); with "renormalize" the K ids, q and p each
    renormalised over them. p is renormalised over its categories either way, which changes nothing
    unless the given probabilities sum past 1 (rounding). A row without used slots has loss 0 under
    "renormalize" (no teacher information); under "bucket" it is one category on both sides: 0 too.
    An id outside [0, V) gives a NaN soft loss on its row. The student's logits are transformed
    (`LossSpec.student`); the teacher's log-probs are used as given. With `stats` (and `spec.want_soft`),
    also per row (R,) the entropy of q = softmax(a/τ) over the whole vocab and q's mass on the used
    ids, both zero on ignored rows: (soft, hard, entropy, mass).
    """
    work = torch.promote_types(s.dtype, torch.float32)
    s = spec.student(s.to(work))
    if spec.want_soft:
        ids, logprobs = t
        log_q, log_p = topk_categories(s / spec.temperature, ids, logprobs.to(work), spec.tail)
        soft = _divergence(log_q, log_p, spec)
        bad = ((ids >= s.shape[-1]) | (ids < -1)).any(-1)
        soft = torch.where(bad, torch.nan, soft)
    else:
        soft = s.new_zeros(s.shape[0])
    soft, hard = _with_hard(s, soft, labels, spec)
    if not stats:
        return soft, hard
    ids = t[0]
    log_q = torch.log_softmax(s.detach() / spec.temperature, dim=-1)
    used = (ids >= 0) & (ids < s.shape[-1])
    mass = torch.where(used, log_q.gather(-1, torch.where(used, ids, 0).long()).exp(), 0.0).sum(-1)
    return soft, hard, _valid_only(_entropy(log_q), labels, spec), _valid_only(mass, labels, spec)


def _entropy(log_q: torch.Tensor) -> torch.Tensor:
    """−Σ q log q per row, with 0 · log 0 = 0."""
    return -_plogr(log_q.exp(), log_q)


def _valid_only(x, labels, spec: LossSpec):
    return x if labels is None else torch.where(labels != spec.ignore_index, x, 0.0)


def topk_categories(z: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor, tail: str):
    """(log q, log p) over the categories of `topk_row_losses`, (R, K + 1) for "bucket" (the rest
    last) or (R, K) for "renormalize", from the tempered student logits z = s/τ. Unused slots are
    −inf on both sides: absent categories. Differentiable w.r.t. z with finite gradients."""
    used = (ids >= 0) & (ids < z.shape[-1])
    idx = torch.where(used, ids, 0).long()
    z_k = torch.where(used, z.gather(-1, idx), -torch.inf)
    z_rest = rest_empty = None
    if tail == "bucket":
        # counts, not a scattered bool: unused slots point at column 0 too
        on_ids = torch.zeros_like(z).scatter_add_(-1, idx, used.to(z.dtype)) > 0
        rest_empty = on_ids.all(-1, keepdim=True)
        # keep the logsumexp of an empty rest finite: its backward would be 0 · NaN
        z_rest = torch.logsumexp(torch.where(on_ids & ~rest_empty, -torch.inf, z), -1, keepdim=True)
    return category_logprobs(z_k, z_rest, logprobs, used, rest_empty, tail)


def category_logprobs(z_k, z_rest, logprobs, used, rest_empty, tail: str):
    """The categories of `topk_categories` from their parts: z_k (R, K) the tempered student logits
    at the ids (−inf where unused), z_rest (R, 1) the logsumexp of z off the ids and rest_empty (R, 1)
    whether the ids cover the vocab (both None for "renormalize"), used (R, K)."""
    lp_k = torch.where(used, logprobs, -torch.inf)
    if tail == "bucket":
        p_rest = (1.0 - lp_k.exp().sum(-1, keepdim=True)).clamp_min(0.0)
        a = torch.cat([z_k, torch.where(rest_empty, -torch.inf, z_rest)], -1)
        b = torch.cat([lp_k, torch.where(rest_empty, -torch.inf, p_rest.log())], -1)
    else:
        # no used slot: uniform against uniform, loss and gradient 0
        none = ~used.any(-1, keepdim=True)
        a = torch.where(none, 0.0, z_k)
        b = torch.where(none, 0.0, lp_k)
    return torch.log_softmax(a, -1), torch.log_softmax(b, -1)


def _with_hard(s, soft, labels, spec: LossSpec):
    """(soft, hard) with the untempered CE of s, both zeroed on rows whose label is ignore_index."""
    hard = torch.zeros_like(soft)
    if labels is None:
        return soft, hard
    valid = labels != spec.ignore_index
    if spec.want_hard:
        in_range = (labels >= 0) & (labels < s.shape[-1])
        index = torch.where(in_range, labels, 0).long().unsqueeze(-1)
        ce = torch.logsumexp(s, dim=-1) - s.gather(-1, index).squeeze(-1)
        hard = torch.where(in_range | ~valid, ce, torch.nan)
    return torch.where(valid, soft, 0.0), torch.where(valid, hard, 0.0)


# Guards the cosine norms of all-zero rows; the loss of such a row is β (cos taken as 0).
COSINE_EPS = 1e-12


def _divergence(log_q: torch.Tensor, log_p: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    q, p = log_q.exp(), log_p.exp()
    kind = spec.kind
    if kind == "forward_kl":
        return _plogr(p, log_p - log_q)
    if kind == "reverse_kl":
        return _plogr(q, log_q - log_p)
    if kind == "tvd":
        return 0.5 * (q - p).abs().sum(-1)
    beta = spec.beta
    # A category at −inf on both sides is absent; logaddexp(−inf, −inf) would backpropagate NaN.
    absent = (log_p == -torch.inf) & (log_q == -torch.inf)
    log_m = torch.logaddexp(
        torch.where(absent, 0.0, log_p) + math.log(beta), torch.where(absent, 0.0, log_q) + math.log1p(-beta)
    )
    log_m = torch.where(absent, -torch.inf, log_m)
    return beta * _plogr(p, log_p - log_m) + (1.0 - beta) * _plogr(q, log_q - log_m)


def _plogr(w: torch.Tensor, log_ratio: torch.Tensor) -> torch.Tensor:
    """Σ w · log_ratio with 0 · log 0 = 0: a column at −inf (probability 0) adds nothing, not NaN."""
    # the ratio is masked before the product too: its NaN (−inf − −inf) would reach w's gradient
    return (w * torch.where(w > 0, log_ratio, 0.0)).sum(-1)
