"""The distillation losses, as data, and their one pure-torch definition.

Each side's logits x are first transformed as its model's head does (`logit_transform`): with a
logit scale σ and a softcap c (None: no cap),

    z = c · tanh(σ x / c)        (z = σ x without a cap);   dz/dx = σ (1 − (z/c)²)   (σ without a cap)

and x = −inf (a masked id) stays −inf, under any σ and c.

(Cohere's `logit_scale`, Granite's 1 / `logits_scaling`, Falcon-H1's `lm_head_multiplier` are σ; Gemma's
`final_logit_softcapping` is c). Below, a and b are the transformed student and teacher logits; the
gradient w.r.t. the student's x is dL/da · da/dx, element by element.

Per row, with temperature τ, student logits a, teacher logits b, q = softmax(a/τ), p = softmax(b/τ):

    loss          value                                   dL/da
    forward_kl    KL(p‖q) = Σ p (log p − log q)           (q − p) / τ
    reverse_kl    KL(q‖p) = Σ q (log q − log p)           q ∘ (log q − log p − KL(q‖p)) / τ
    jsd (β)       β KL(p‖M) + (1−β) KL(q‖M),              (1−β) q ∘ (log(q/M) − K) / τ,   K = Σ q log(q/M)
                  M = β p + (1−β) q
    tvd           ½ Σ |q − p|                             ½ q ∘ (g − Σ q g) / τ,          g = sign(q − p)
    cosine        β (1 − cos(a, b))                       −β (b / (‖a‖‖b‖) − cos · a / ‖a‖²)
    hard CE       logsumexp(a) − a_y   (untempered)       softmax(a) − onehot(y)
    skew_kl (α)   KL(p‖M) = Σ p log(p/M),                 −(1−α) (p ∘ r − q Σ p ∘ r) / τ,  r = q/M ≤ 1/(1−α)
                  M = α p + (1−α) q
    skew_reverse  KL(q‖M′) = Σ q log(q/M′),               q ∘ (g − Σ q g) / τ,   g = log(q/M′) + 1 − α q/M′
      _kl (α)     M′ = (1−α) p + α q
    akl (μ)       w_h KL(p‖q) + w_t KL(q‖p),              w_h (q − p) / τ + w_t q ∘ (log q − log p − KL(q‖p)) / τ
                  w_h = g_h/(g_h+g_t), w_t = g_t/(g_h+g_t), g_h = Σ_head |p − q|, g_t = Σ_tail |p − q|,
                  the weights constants (q in them detached)
    jeffreys      KL(p‖q) + KL(q‖p) = Σ (q − p)(log q − log p)  forward_kl's + reverse_kl's
    alpha_        (1 − S) / (α (1 − α)),                  (q S − e) / ((1 − α) τ)
      divergence  S = Σ e, e = p^(1−α) q^α (Amari, α ∈ (0, 1); α → 0 forward KL, α → 1 reverse KL)
    renyi (α)     D_α(p‖q) = log S / (α − 1),             (q − e / S) / τ
                  S = Σ e, e = p^α q^(1−α), α ∈ (0, 2]; α = 1: KL(p‖q)
    renyi_        D_α(q‖p) = log S / (α − 1),             α / (α − 1) · (e / S − q) / τ   (α = 1: reverse_kl's)
      reverse (α) S = Σ e, e = q^α p^(1−α)
    ab_divergence −Σ (p^α q^β − α/c p^c − β/c q^c) / (α β),  (h − q Σ h) / (α τ),  h = q^c − p^α q^β
      (α, β)      c = α + β, α, β ∈ [0.05, 2] (Cichocki et al.; α = 1, β → 0 forward KL)
    triangular    Σ (p − q)² / (p + q)                    q ∘ (g − Σ q g) / τ,  g = (q − p)(q + 3p) / (q + p)²
    entropy_      w KL(p‖q) + (1 − w) KL(q‖p),            w (q − p) / τ + (1 − w) q ∘ (log q − log p − KL(q‖p)) / τ
      adaptive    w = w_min + (w_max − w_min) σ((H(p)/log n − c) / s), the teacher's alone (a constant)
    dkd (α, β)    α KL((p_y, 1−p_y) ‖ (q_y, 1−q_y))       α (q_y − p_y)/(1 − q_y) · (e_y − q) / τ
                  + β KL(p̂ ‖ q̂), p̂ = p off y / (1 − p_y)    + β (q̂ − p̂) / τ   (0 at y; y the label)
    mutual        KL(p‖q) + KL(q‖p)  (Jeffreys' value)    (q − p) / τ: forward_kl's;   the teacher's dL/db = (p − q) / τ
    co_jeffreys   KL(p‖q) + KL(q‖p)                       jeffreys';   the teacher's dL/db: Jeffreys' own w.r.t. b

Skew KL is JSD(β = α)'s first piece and skew reverse KL JSD(β = 1 − α)'s second, each alone (DistiLLM,
α = 0.1 there); their gradients are the chain rule through q = softmax(a/τ) of dL/dq = g. At α = 0 they
are forward and reverse KL exactly (M = q, M′ = p), at α = 1 zero (M = p, M′ = q); the formula is kept at
the ends, not resolved to another loss. AKL (Wu et al., COLING 2025) follows the authors' code: with the
ids in the order of p descending (ties by id, lowest first: a stable sort's order), the head is the
longest prefix whose p sums to at most μ, and the first id always; the weights use p and q at the
temperature, and are ½ each where g_h + g_t = 0 (p = q: both KLs and their gradients are 0). `akl_head`
finds the head without a sort.

The divergences after AKL are computed where p ≈ q without the cancellation of their textbook forms:
Jeffreys and the triangular discrimination from q − p taken as p · expm1(log q − log p) (`_gap`),
every term ≥ 0; Amari's α- and the αβ-divergence as sums of non-negative terms of the α-family's
generator (`power_terms`, `_PowerTerm`: a Taylor series near p = q, forms without cancellation
elsewhere); Rényi's log S as log1p(S − 1) with S − 1 from those same terms where S is near 1, else a
logsumexp (`renyi`); the KLs of the entropy blend and of DKD as sums of the terms p log(p/q) − p + q
≥ 0 (`_kl_terms`). An id where one side is 0 gives these their limits (finite for Amari's, the
αβ and the triangular; +inf where the formula is infinite: Jeffreys, Rényi of order ≥ 1 where q = 0).
Orda's "skew JS" of β, (1 − β) KL(p‖M) + β KL(q‖M) with M = (1 − β) p + β q, is jsd with beta = 1 − β.

The teacher learns from two losses (LEARNING_LOSSES), co-training's (orda-kernel's "mutual" and
"cojeffreys"): differentiated w.r.t. the teacher's logits b too, where its tensors require grad
(`flashkd.core.loop`; every other loss's teacher is a constant). Both report Jeffreys' value J = KL(p‖q) +
KL(q‖p). "mutual" is deep mutual learning (Zhang et al. 2018): each side is pulled toward the other's
distribution taken as a constant, the student by KL(p̄‖q), the teacher by KL(q̄‖p) (a bar: detached), so
the gradient is forward KL's on each side, dL/da = (q − p)/τ and dL/db = (p − q)/τ; it is not J's
gradient. "co_jeffreys" differentiates J itself on both sides: the student's gradient is jeffreys', the
teacher's J's w.r.t. b. Their values are jeffreys' form (`_gap`, no cancellation where p ≈ q); mutual's
gradients come from a term of value 0 (`_Pull`).

JSD endpoints follow the Liger / TRL convention: β = 0 is forward KL(p‖q), β = 1 is reverse KL(q‖p)
(not the limit of the formula, which is 0 at both ends). Cosine is invariant to τ.

The total is  w_hard · CE + w_soft · c · soft,  c = τ² when `temperature_squared` (Hinton) else 1,
each term summed over rows whose label is not `ignore_index`, times the row's weight when `row_weight`
is given, and divided by the number of such rows ("mean", at least 1; the weights do not change it)
or by 1 ("sum").

A top-k teacher gives p at K ids per row only. The divergences above (not cosine, not dkd: p at the
label is not known where the label is not among the ids) are then taken
over categories: the K ids and one bucket for the rest of the vocab (tail "bucket": q_rest = Σ q off
the ids, p_rest = max(1 − Σ p, 0)), or the K ids with q and p renormalised over them ("renormalize").
q over the categories is softmax(z) of z = (a_ids/τ, logsumexp(a_rest/τ)), so dL/da follows from the
table through dz_rest/da_j = softmax(a_rest/τ)_j / τ. With a tail clamp ε (TRL's bucket) each side's
rest is max(1 − Σ_ids, 1 − e^−ε) and nothing is renormalised; the divergence is the table's formula on
those (not quite normalised) vectors, and dL/dz still reaches a through z = (a_ids/τ, z_rest).

With `stats`, the row functions also give each row's entropy H(q) = −Σ q log q (and, for a top-k
teacher, q's mass on the ids and the teacher's entropy over the categories): the terms of `DistillStats`.

`row_losses` and `topk_row_losses` below are the single torch definition of these formulas: the torch
backend differentiates them chunk by chunk with autograd, the benchmark's naive provider runs them over
the full logits, and the Triton kernels (`flashkd.backends.triton_rows`, `triton_topk`) implement the
analytic gradients.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Protocol

import torch

LOSSES = ("jsd", "forward_kl", "reverse_kl", "tvd", "cosine", "skew_kl", "skew_reverse_kl", "akl",
          "jeffreys", "alpha_divergence", "renyi", "renyi_reverse", "ab_divergence", "triangular",
          "entropy_adaptive", "dkd", "mutual", "co_jeffreys")
# the losses between distributions (all but cosine)
DIVERGENCES = tuple(name for name in LOSSES if name != "cosine")
# the losses that read the labels: the target class (`decoupled_kl`); a top-k teacher does not give p there
LABEL_LOSSES = ("dkd",)
# the losses whose teacher learns too: differentiated w.r.t. the teacher's logits where its tensors require grad
LEARNING_LOSSES = ("mutual", "co_jeffreys")
# the losses a top-k teacher allows: over its categories (a learning teacher needs its head)
TOPK_LOSSES = tuple(name for name in DIVERGENCES if name not in LABEL_LOSSES + LEARNING_LOSSES)
# The losses whose top-k category math the Triton backend takes from the torch definition
# (`flashkd.backends.triton_topk`); their dense rows are the Triton kernel's (`triton_rows.KERNEL_LOSSES`)
TORCH_ONLY_LOSSES = ("skew_kl", "skew_reverse_kl", "akl", "jeffreys", "alpha_divergence", "renyi", "renyi_reverse",
                     "ab_divergence", "triangular", "entropy_adaptive")
# The losses whose row is whole: their value merges its sums over the vocab inside `divergence` (a vocab
# slice's `Vocab.merge`), rather than being a sum over the vocab that the caller merges
ROW_WHOLE_LOSSES = ("akl", "renyi", "renyi_reverse", "entropy_adaptive", "dkd")
REDUCTIONS = ("mean", "sum")
TAILS = ("bucket", "renormalize")  # sparse teacher: what happens to the mass outside the K ids

# Loss ids shared with the Triton kernel's constexpr switch.
LOSS_ID = {name: i for i, name in enumerate(LOSSES)}


@dataclasses.dataclass(frozen=True)
class Parameter:
    """A loss's own parameter, for the losses that read it: its public keyword's default there, and its
    range, [low, high] with an end left out where it is open."""

    default: float
    losses: tuple[str, ...]  # every loss that no Parameter of the keyword lists refuses the keyword
    low: float = 0.0
    high: float = 1.0
    low_open: bool = False
    high_open: bool = False

    def holds(self, value: float) -> bool:
        return ((self.low < value if self.low_open else self.low <= value)
                and (value < self.high if self.high_open else value <= self.high))

    @property
    def interval(self) -> str:
        return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"


# The losses' parameters, by public keyword (a LossSpec field of the same name), each keyword with one
# Parameter per group of losses that read it (the literature's name, with each loss's default and range).
# The public functions take them as None (the loss's default); a value given to a loss that does not
# read it is an error.
PARAMETERS = {
    "beta": (Parameter(0.5, ("jsd", "cosine")),
             Parameter(0.5, ("ab_divergence",), 0.05, 2.0),  # the student's power
             Parameter(8.0, ("dkd",), 0.0, math.inf, high_open=True)),  # the non-target term's weight
    "alpha": (Parameter(0.1, ("skew_kl", "skew_reverse_kl")),
              Parameter(0.5, ("alpha_divergence",), low_open=True, high_open=True),
              Parameter(0.5, ("renyi", "renyi_reverse"), 0.0, 2.0, low_open=True),  # the order
              Parameter(0.5, ("ab_divergence",), 0.05, 2.0),  # the teacher's power
              Parameter(1.0, ("dkd",), 0.0, math.inf, high_open=True)),  # the target term's weight
    "head_mass": (Parameter(0.5, ("akl",)),),
    # entropy_adaptive's gate: w = gate_min + (gate_max − gate_min) · sigmoid((H/log n − gate_center) / gate_width)
    "gate_min": (Parameter(0.0, ("entropy_adaptive",)),),
    "gate_max": (Parameter(1.0, ("entropy_adaptive",)),),
    "gate_center": (Parameter(0.5, ("entropy_adaptive",)),),
    "gate_width": (Parameter(0.1, ("entropy_adaptive",), 0.0, math.inf, low_open=True, high_open=True),),
}


def parameter(name: str, loss: str) -> Parameter | None:
    """The Parameter of keyword `name` that `loss` reads, or None where it reads none."""
    return next((param for param in PARAMETERS[name] if loss in param.losses), None)


def loss_parameters(loss: str, given: dict) -> dict:
    """{keyword: value} of every parameter in PARAMETERS for `loss`: `given`'s value where it is not None,
    else None (LossSpec takes the loss's default). A value given for a loss that does not read it raises
    ValueError naming the losses that do; `loss` itself is checked by LossSpec."""
    out = {}
    for name, params in PARAMETERS.items():
        value = given.get(name)
        if value is not None and loss in LOSSES and parameter(name, loss) is None:
            readers = ", ".join(f"loss={r!r}" for param in params for r in param.losses)
            raise ValueError(f"{name}: loss={loss!r} does not read it (it is read by {readers}); "
                             f"got {name}={shown(value)}, leave it out")
        out[name] = value
    return out


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """Everything the row math needs to know about one call; validated once, passed as one object."""

    loss: str = "jsd"
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
    # tail "bucket" only: None, or ε > 0 for each side's rest taken as 1 − exp(min(log Σ_ids, −ε)), nothing
    # renormalised (TRL's `_add_tail_bucket`, ε = 1e-7): `category_logprobs`
    tail_clamp: float | None = None
    # The losses' own parameters (PARAMETERS): None takes the loss's default (for a loss that does not read
    # one, the first group's, a value nothing reads)
    beta: float | None = None
    alpha: float | None = None  # skew KL / skew reverse KL: the student's (teacher's) share α of the mixture
    head_mass: float | None = None  # AKL: μ, the teacher's mass that bounds the head
    gate_min: float | None = None  # entropy_adaptive: the gate's range and its sigmoid's center and width
    gate_max: float | None = None
    gate_center: float | None = None
    gate_width: float | None = None

    def __post_init__(self):
        allowed, teacher = (LOSSES, "") if self.tail is None else (TOPK_LOSSES, " for a top-k teacher")
        if self.loss not in allowed:
            why = (" (it reads the teacher's probability at the label, which a top-k teacher does not give)"
                   if self.loss in LABEL_LOSSES else
                   " (its teacher learns: the gradient of its logits needs the teacher's hidden states and head, "
                   "which a top-k teacher does not have; use flashkd.fused_linear_distill)"
                   if self.loss in LEARNING_LOSSES and self.tail is not None else "")
            raise ValueError(f"loss: expected one of {', '.join(map(repr, allowed))}{teacher}, got {self.loss!r}{why}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction: expected 'mean' or 'sum', got {self.reduction!r}")
        for name, params in PARAMETERS.items():
            param = parameter(name, self.loss) or params[0]
            if getattr(self, name) is None:
                object.__setattr__(self, name, param.default)
        for name in ("temperature", "weight_hard", "weight_soft", *PARAMETERS):
            check_finite_float(name, getattr(self, name))
        for name, params in PARAMETERS.items():
            param = parameter(name, self.loss) or params[0]
            if not param.holds(getattr(self, name)):
                readers = "" if param is params[0] else f" for loss={self.loss!r}"
                raise ValueError(f"{name}: expected a value in {param.interval}{readers}, got {getattr(self, name)!r}")
        if self.gate_min > self.gate_max:
            raise ValueError(f"gate_min: expected a value at most gate_max ({self.gate_max!r}), got {self.gate_min!r}")
        if self.temperature <= 0.0:
            raise ValueError(f"temperature: expected a value > 0, got {self.temperature!r}")
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise TypeError(f"ignore_index: expected an int, got {self.ignore_index!r}")
        if not -(2**63) <= self.ignore_index < 2**63:  # compared with int64 labels
            raise ValueError(f"ignore_index: expected an int64 value, got {shown(self.ignore_index)}")
        if self.tail is not None and self.tail not in TAILS:
            raise ValueError(f"tail: expected 'bucket' or 'renormalize', got {self.tail!r}")
        if self.tail_clamp is not None:
            clamp = self.tail_clamp
            if isinstance(clamp, bool) or not isinstance(clamp, (int, float)):
                raise TypeError(f"tail_clamp: expected a Python float or None, got {clamp!r}")
            if not (is_finite(clamp) and clamp > 0.0):
                raise ValueError(f"tail_clamp: expected a finite float > 0 (or None), got {shown(clamp)}")
            if self.tail != "bucket":
                raise ValueError(f"tail_clamp: expected None with tail={self.tail!r} (it clamps the tail bucket, "
                                 f"tail='bucket'), got {clamp!r}")
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
    """Per-call sums for logging, returned with `return_stats=True`; 0-d tensors (but per_teacher),
    detached, on the inputs' device (no host sync), in the loss's dtype (fp32; fp64 for fp64 inputs;
    rows int64). Sums, not means, so that they add across micro-batches and ranks.

    soft_sum       Σ row_weight · soft over the rows that count: the divergence itself (before
                   w_soft and τ²; cosine's β (1 − cos) included)
    hard_sum       Σ row_weight · CE over the rows that count (0 without labels)
    rows           number of rows that count: label not ignore_index (all rows without labels);
                   int64. The "mean" loss is (w_hard · hard_sum + w_soft · c · soft_sum) / max(rows, 1)
    entropy_sum    Σ H(q) over the rows that count, unweighted, in nats: q = softmax(a/τ) of the
                   transformed student logits (the per-token entropy TRL logs is entropy_sum / rows)
    topk_mass_sum  top-k teacher only (else None): Σ over the rows that count of the student's
                   probability mass q on the teacher's used ids, unweighted
    teacher_entropy_sum  top-k teacher only (else None): Σ over the rows that count of the teacher's
                   entropy −Σ p log p over the categories the divergence is taken on (the used ids, and
                   the tail bucket with tail="bucket"; p as the loss sees it: renormalised, or clamped
                   and not renormalised with tail_clamp), unweighted, in nats
    per_teacher    top-k teacher with `teacher_index` only (else None): (num_teachers, 3), row i
                   the sums over the rows that count whose teacher_index is i: (rows, soft_sum,
                   teacher_entropy_sum), weighted as the totals above (the row counts as floats).
                   `per_teacher.reshape(-1)` is the layout of TRL's per-teacher statistics
    """

    soft_sum: torch.Tensor
    hard_sum: torch.Tensor
    rows: torch.Tensor
    entropy_sum: torch.Tensor
    topk_mass_sum: torch.Tensor | None
    teacher_entropy_sum: torch.Tensor | None = None
    per_teacher: torch.Tensor | None = None


def is_finite(value) -> bool:
    """math.isfinite of a Python float or int; False for an int too large for a float, where
    math.isfinite raises OverflowError (an error no caller names the argument of)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def shown(value) -> str:
    """repr(value) for a message, an int too large for a float as its magnitude: its repr runs to
    hundreds of digits, and past 4300 repr itself raises ValueError."""
    if isinstance(value, int) and not isinstance(value, bool) and not is_finite(value):
        return f"~{'-' if value < 0 else ''}10**{int(math.log10(abs(value)))} (an int too large for a float)"
    return repr(value)


def check_finite_float(name: str, value) -> None:
    """A finite Python float (an int is one too; a bool is not), as LossSpec's floats must be."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not is_finite(value):
        raise TypeError(f"{name}: expected a finite Python float, got {shown(value)}")


def check_logit_transform(scale_name: str, scale, cap_name: str, cap) -> None:
    """A logit scale must be a finite non-zero Python float, a softcap None or a finite float > 0."""
    for name, value in ((scale_name, scale), (cap_name, cap)):
        if value is None and name == cap_name:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name}: expected a Python float{' or None' if name == cap_name else ''}, got {value!r}")
    if not is_finite(scale) or scale == 0.0:
        raise ValueError(f"{scale_name}: expected a finite non-zero float, got {shown(scale)}")
    if cap is not None and not (is_finite(cap) and cap > 0.0):
        raise ValueError(f"{cap_name}: expected a finite float > 0 (or None for no cap), got {shown(cap)}")


def logit_transform(x: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """z = x · scale, then softcap · tanh(z / softcap) when a softcap is set; x itself when neither.
    A −inf logit (a masked id) stays −inf under any transform, as in the Triton kernels: the cap
    would make it −c, an id with mass, and a negative scale +inf."""
    z = x
    if scale != 1.0:
        z = z * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if softcap is None and scale > 0:
        return z  # −inf · σ is −inf already
    return torch.where(x == -torch.inf, x, z)


def row_losses(s: torch.Tensor, t: torch.Tensor, labels: torch.Tensor | None, spec: LossSpec, vocab=None, *, stats=False):
    """Per-row soft and hard losses of one block of logits, in fp32; differentiable w.r.t. `s`.

    s:      (R, V) student logits, any float dtype, before the head's transform (`LossSpec.student`)
    t:      (R, V) teacher logits, same V, before its transform (unused, may be None, when
            `spec.want_soft` is False)
    labels: (R,) integer labels or None (int32 with an ignore_index past int32: ValueError, `check_ignore_index`)
    vocab:  the block's place in the vocab and its reductions over it (`Vocab`); None: the block
            holds the whole vocab. With a slice of the vocab (`flashkd.distributed`) every rank
            gets the rows of the whole vocab.
    Returns (soft, hard), each (R,) in fp32 (fp64 for fp64 inputs), zero on rows whose label is `ignore_index`. `soft` is the
    unweighted divergence; `hard` the untempered CE (zeros when `spec.want_hard` is False). A label
    outside [0, V) that is not `ignore_index` gives a NaN hard loss on its row. With `stats`, also the
    entropy of q = softmax(a/τ) per row (R,), zero on ignored rows: (soft, hard, entropy).
    """
    check_ignore_index(labels, spec.ignore_index)
    vocab = vocab or WHOLE_VOCAB
    work = torch.promote_types(s.dtype, torch.float32)
    s, t = _drop_ignored(s, labels, spec), _drop_ignored(t, labels, spec)
    s = spec.student(s.to(work))
    kind = spec.kind if spec.want_soft else None
    ce = spec.want_hard and labels is not None
    # Two merges over the vocab: every logsumexp and every sum that needs none of them, then the
    # sums that need the normalisers (the divergence's, the entropy's).
    tau = spec.temperature
    z = (s if tau == 1.0 else s / tau,)  # no copy at τ = 1: the blocks are the torch backend's memory
    if kind in DIVERGENCES:
        b = spec.teacher(t.to(work))
        z += (b if tau == 1.0 else b / tau,)
        del b
    sums = ()
    if kind == "cosine":
        t = spec.teacher(t.to(work))
        sums = ((s * t).sum(-1), (s * s).sum(-1), (t * t).sum(-1))
    if kind not in DIVERGENCES and not stats:
        z = ()  # no softmax at τ wanted
    logp, lse, sums = vocab.merge(log_softmax=z, lse=(s,) if ce else (),
                                  sums=sums + ((vocab.pick(s, labels),) if ce else ()))
    del z  # the tempered logits: only their log-probs stay (the torch backend's peak memory)
    log_q = logp[0] if logp else None
    after = ()
    if kind in DIVERGENCES and kind not in ROW_WHOLE_LOSSES:
        after += (divergence(log_q, logp[1], spec),)
    if stats:
        after += (row_entropy(log_q.detach()),)
    after = vocab.merge(sums=after)[2] if after else ()
    if kind is None:
        soft = s.new_zeros(s.shape[0])
    elif kind == "cosine":
        dot, ss, tt = sums[:3]
        norm = ss.clamp_min(COSINE_EPS**2).sqrt() * tt.clamp_min(COSINE_EPS**2).sqrt()
        soft = spec.beta * (1.0 - dot / norm)
    elif kind in ROW_WHOLE_LOSSES:  # a whole row's value: its sums merge inside (`adaptive_kl`, `renyi`, ...)
        soft = divergence(log_q, logp[1], spec, vocab, labels)
    else:
        soft = after[0]
    soft, hard = _with_hard(soft, lse[0] - sums[-1] if ce else None, labels, spec, vocab.size(s))
    if not stats:
        return soft, hard
    return soft, hard, _valid_only(after[-1], labels, spec)


def topk_row_losses(s: torch.Tensor, t, labels: torch.Tensor | None, spec: LossSpec, vocab=None, *, stats=False):
    """`row_losses` for a sparse teacher: p is given at K ids per row (`spec.tail` says how).

    t = (ids, logprobs), or None when `spec.want_soft` is False:
      ids:      (R, K) integer vocab ids, −1 for an unused slot (no duplicates among the used ones)
      logprobs: (R, K) teacher log-probs at those ids (ignored in unused slots)
    vocab: as in `row_losses`; ids are ids of the whole vocab.
    The divergence is the dense one of the table above over categories: with tail "bucket" the K ids
    plus one category for the rest of the vocab (q_rest = Σ q off the ids, p_rest = max(1 − Σ p, 0),
    and p_rest = 0 when the ids cover the vocab); with "renormalize" the K ids, q and p each
    renormalised over them. p is renormalised over its categories either way, which changes nothing
    unless the given probabilities sum past 1 (rounding). A row without used slots has loss 0 under
    "renormalize" (no teacher information); under "bucket" it is one category on both sides: 0 too.
    An id outside [0, V) gives a NaN soft loss on its row. The student's logits are transformed
    (`LossSpec.student`); the teacher's log-probs are used as given. With `stats` (and `spec.want_soft`),
    also per row (R,) the entropy of q = softmax(a/τ) over the whole vocab and q's mass on the used
    ids, both zero on ignored rows, and the teacher's entropy over the categories (`DistillStats`):
    (soft, hard, entropy, mass, teacher_entropy).
    With `spec.tail_clamp` ε the bucket is TRL's (`category_logprobs`): on each side the rest is
    1 − Σ over the ids with the log of that sum clamped at −ε, and nothing is renormalised.
    """
    check_ignore_index(labels, spec.ignore_index)
    vocab = vocab or WHOLE_VOCAB
    work = torch.promote_types(s.dtype, torch.float32)
    s = spec.student(_drop_ignored(s, labels, spec).to(work))
    v = vocab.size(s)
    ce = spec.want_hard and labels is not None
    lse, sums = (), ()
    if spec.want_soft:
        ids, logprobs = t
        z = s / spec.temperature
        used = (ids >= 0) & (ids < v)
        lse, sums = topk_parts(z, ids, used, spec.tail, vocab)
    _, lse, sums = vocab.merge(lse=lse + ((s,) if ce else ()), sums=sums + ((vocab.pick(s, labels),) if ce else ()))
    if spec.want_soft:
        z_k = torch.where(used, sums[0], -torch.inf)
        z_rest = lse[0][:, None] if spec.tail == "bucket" else None
        rest_empty = None if z_rest is None else z_rest == -torch.inf  # the ids cover the vocab
        log_q, log_p = category_logprobs(z_k, z_rest, _drop_ignored(logprobs, labels, spec).to(work), used, rest_empty,
                                         spec.tail, spec.tail_clamp)
        soft = divergence(log_q, log_p, spec)
        bad = ((ids >= v) | (ids < -1)).any(-1)
        soft = torch.where(bad, torch.nan, soft)
    else:
        soft = s.new_zeros(s.shape[0])
    soft, hard = _with_hard(soft, lse[-1] - sums[-1] if ce else None, labels, spec, v)
    if not stats:
        return soft, hard
    teacher_entropy = _valid_only(category_entropy(log_p, used), labels, spec)
    # q over the whole vocab at τ: its entropy, and its mass on the used ids (z at them is merged above)
    z = s.detach() / spec.temperature
    (log_q,), _, _ = vocab.merge(log_softmax=(z,))
    (entropy,) = vocab.merge(sums=(row_entropy(log_q),))[2]
    lse_z = (z - log_q)[:, :1]  # z − log q is the row's logsumexp in every column
    mass = torch.where(used, (sums[0].detach() - lse_z).exp(), 0.0).sum(-1)
    return soft, hard, _valid_only(entropy, labels, spec), _valid_only(mass, labels, spec), teacher_entropy


def category_entropy(log_p: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """The teacher's entropy over a top-k row's categories (`category_logprobs`' log p), per row; 0 on
    a row without a used slot (its bucket alone, or under "renormalize" a stand-in uniform)."""
    return torch.where(used.any(-1), row_entropy(log_p), 0.0)


def row_entropy(log_q: torch.Tensor) -> torch.Tensor:
    """−Σ q log q per row, with 0 · log 0 = 0 (this block's part of the sum over the vocab)."""
    return -_plogr(log_q.exp(), log_q)


def check_ignore_index(labels, ignore_index: int) -> None:
    """int32 labels are compared with ignore_index in int32 (torch and the kernels alike), where a value
    past int32 wraps onto a real label (2**32 + 5 onto 5): refused rather than widened, since no int32
    label can equal it."""
    if isinstance(labels, torch.Tensor) and labels.dtype == torch.int32 and not -(2**31) <= ignore_index < 2**31:
        raise ValueError(f"ignore_index: expected a value in [-2**31, 2**31) with torch.int32 labels (no int32 label "
                         f"can equal a larger one; pass int64 labels to use it), got {ignore_index!r}")


def _valid_only(x, labels, spec: LossSpec):
    return x if labels is None else torch.where(labels != spec.ignore_index, x, 0.0)


def topk_parts(z: torch.Tensor, ids: torch.Tensor, used: torch.Tensor, tail: str, vocab):
    """What `topk_row_losses` merges over the vocab, from the tempered student logits z = s/τ: the
    logsumexp of z off the ids (tail "bucket"; −inf when the ids cover the vocab) and z at the ids
    (this block's part: 0 at ids it does not hold), as `Vocab.merge`'s (lse, sums)."""
    idx, here = vocab.local(ids, z)
    z_k = vocab.pick(z, ids)
    if tail != "bucket":
        return (), (z_k,)
    # counts, not a scattered bool: unused slots point at column 0 too
    on_ids = torch.zeros_like(z).scatter_add_(-1, idx, (here & used).to(z.dtype)) > 0
    return (torch.where(on_ids, -torch.inf, z),), (z_k,)


def category_logprobs(z_k, z_rest, logprobs, used, rest_empty, tail: str, clamp: float | None = None):
    """The categories of `topk_row_losses` from their parts: z_k (R, K) the tempered student logits
    at the ids (−inf where unused), z_rest (R, 1) the logsumexp of z off the ids and rest_empty (R, 1)
    whether the ids cover the vocab (both None for "renormalize"), used (R, K). Returns (log q, log p),
    (R, K + 1) with the bucket, else (R, K); −inf at unused slots.

    clamp ε (tail "bucket" only): TRL's `_add_tail_bucket` on each side, log rest = log(1 − exp(min(log
    Σ_ids, −ε))), and nothing renormalised: the categories may sum past 1 by up to ~ε (the student's)
    or by the teacher's excess. The student's rest is the same thing taken from the rest's own
    logsumexp, max(log q_rest, log(1 − e^−ε)): exact where 1 − Σ q_ids would cancel. The student's log q
    are a log-softmax of (z_k, z_rest) (`_CategoryLogSoftmax`: relative to the row's largest, forward and
    backward exact where one category holds nearly all the mass, as clamped rows do)."""
    lp_k = torch.where(used, logprobs, -torch.inf)
    if tail == "bucket" and clamp is not None:
        log_q = _CategoryLogSoftmax.apply(torch.cat([z_k, z_rest], -1))
        floor = math.log(-math.expm1(-clamp))
        log_q_rest = log_q[:, -1:]
        log_q_rest = torch.where(log_q_rest > floor, log_q_rest, floor)
        # The teacher's Σ p over the ids in float64 (R numbers): in fp32 its rounding, ~6e-8, is all of a
        # rest near the clamp, whose log a reverse KL weighs with q_rest
        wide = lp_k.double() if lp_k.device.type != "mps" else lp_k
        log_p_rest = torch.log(-torch.expm1(torch.logsumexp(wide, -1, keepdim=True).clamp_max(-clamp))).to(lp_k.dtype)
        return torch.cat([log_q[:, :-1], log_q_rest], -1), torch.cat([lp_k, log_p_rest], -1)
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


def _drop_ignored(x, labels, spec: LossSpec):
    """x (R, ·) with the rows whose label is ignore_index zeroed, before any math on them: a NaN or inf
    there (padding) would otherwise reach the gradient of s as 0 · NaN through autograd. Costs one
    select over x and a copy of it in x's dtype: the torch backend (fp32 s) holds R·V·4 more bytes
    for its backward, about 1/6 of its autograd temporaries; no host sync."""
    if labels is None or x is None:
        return x
    return torch.where((labels != spec.ignore_index)[:, None], x, 0.0)


def _with_hard(soft, ce, labels, spec: LossSpec, v):
    """(soft, hard) with the CE ce = logsumexp(s) − s_y (None when not wanted), both zeroed on rows
    whose label is ignore_index; NaN CE on a label outside [0, v) that is not ignore_index."""
    hard = torch.zeros_like(soft)
    if labels is None:
        return soft, hard
    valid = labels != spec.ignore_index
    if ce is not None:
        in_range = (labels >= 0) & (labels < v)
        hard = torch.where(in_range | ~valid, ce, torch.nan)
    return torch.where(valid, soft, 0.0), torch.where(valid, hard, 0.0)


class Vocab:
    """Where a block of logits sits in the vocab, and the reductions over the vocab that the row
    definitions make. This one: the block holds the whole vocab (every call without a process
    group). `flashkd.distributed` subclasses it for a block holding one rank's slice of the vocab:
    its `merge` merges over the ranks, so that these same definitions give every rank the rows of
    the whole vocab."""

    # How many ranks compute the same loss from their slices: autograd seeds each with 1/copies.
    copies = 1

    def size(self, x: torch.Tensor):
        """The vocab's size (an int; a 0-d tensor where only the device knows it)."""
        return x.shape[-1]

    def local(self, ids: torch.Tensor, x: torch.Tensor):
        """(columns of the block x at the vocab ids `ids`, 0 where not held; whether the block holds them)."""
        here = (ids >= 0) & (ids < x.shape[-1])
        return torch.where(here, ids, 0).long(), here

    def pick(self, x: torch.Tensor, ids: torch.Tensor | None):
        """This block's part of x at the vocab ids (R,) or (R, K): x there, 0 at ids it does not hold."""
        if ids is None:
            return x.new_zeros(x.shape[0])
        col, here = self.local(ids if ids.dim() == 2 else ids[:, None], x)
        picked = torch.where(here, x.gather(-1, col), 0.0)
        return picked if ids.dim() == 2 else picked[:, 0]

    def amax(self, x: torch.Tensor) -> torch.Tensor:
        """The max over the vocab of each row of x (R,), not differentiated."""
        return x.detach().amax(-1)

    def before(self, count: torch.Tensor) -> torch.Tensor:
        """count (R,), this block's, summed over the blocks before it in the vocab: 0 for the whole vocab."""
        return torch.zeros_like(count)

    def merge(self, log_softmax=(), lse=(), sums=()):
        """([log_softmax over the vocab of each (R, V) block in log_softmax], [logsumexp of each in lse],
        [each of sums summed over the vocab]): `sums` are this block's parts of row quantities, (R,) or
        (R, K). A sliced vocab merges them all in one max and one sum over the ranks. The logsumexp of
        a row that is −inf throughout is −inf with a zero gradient (no NaN)."""
        lse = [_LogSumExp.apply(x) for x in lse]  # first: its temporaries meet fewer live blocks
        return [torch.log_softmax(x, -1) for x in log_softmax], lse, list(sums)


class _CategoryLogSoftmax(torch.autograd.Function):
    """The log-softmax over the last dim of a top-k row's categories (R, K + 1), exact where one
    category holds nearly all the mass, forward and backward. Forward: z − max − log1p(Σ_(j ≠ top)
    e^(z_j − max)), where torch.log_softmax takes the log of a sum near 1 (~6e-8 off in fp32, all of a
    log q_top near 0). Backward: log_softmax's dz = g − q Σ g subtracts two numbers near g_top where
    q_top ≈ 1 (a reverse KL of an open student against a clamped teacher rest: g_rest ≈ q_rest
    log(q_rest / 1e-7) ≈ 16 against dz_rest ~1e-2); for the top category it is taken as g_top (1 − q_top)
    − q_top Σ_(j ≠ top) g_j, with 1 − q_top = −expm1(log q_top): TRL's tail, 1 − Σ over the ids,
    differentiates this way."""

    @staticmethod
    def forward(ctx, z):
        m, top = z.max(-1, keepdim=True)
        m = torch.where(m.isfinite(), m, 0.0)
        is_top = torch.arange(z.shape[-1], device=z.device) == top
        others = torch.where(is_top, 0.0, torch.exp(z - m)).sum(-1, keepdim=True)
        out = z - m - torch.log1p(others)
        ctx.save_for_backward(out, top)
        return out

    @staticmethod
    def backward(ctx, g):
        out, top = ctx.saved_tensors
        is_top = torch.arange(out.shape[-1], device=out.device) == top
        others = torch.where(is_top, 0.0, g).sum(-1, keepdim=True)  # Σ g off the top, not Σ g − g_top
        log_top = out.gather(-1, top)
        dz_top = g.gather(-1, top) * -torch.expm1(log_top) - log_top.exp() * others
        return (g - out.exp() * g.sum(-1, keepdim=True)).scatter(-1, top, dz_top)


class _LogSumExp(torch.autograd.Function):
    """torch.logsumexp over the last dim (the same saved tensors), whose gradient is 0, not NaN, on
    rows that are −inf throughout (a top-k teacher's rest when its ids cover the vocab)."""

    @staticmethod
    def forward(ctx, x):
        out = torch.logsumexp(x, -1)
        ctx.save_for_backward(x, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, out = ctx.saved_tensors
        finite = torch.isfinite(out)[:, None]
        return torch.where(finite, grad[:, None] * torch.exp(x - torch.where(finite, out[:, None], 0.0)), 0.0)


WHOLE_VOCAB = Vocab()


class VocabSlice(Protocol):
    """A rank's slice [start, start + V_r) of the vocab, as the chunk loop, the row backends and
    teacher_topk's loop use it: a `Vocab` (its reductions merged over the ranks) and the exchanges
    around it (the backends run none: the core calls these between their phases). `flashkd.distributed.ShardedVocab` implements it; a call on one process has none."""

    start: int  # the global id of the slice's first row
    total: int | torch.Tensor  # the vocab's size V (a 0-d device tensor where it was not read on the host)
    plan_size: int  # the group's largest slice: every rank plans the same chunks for it
    copies: int  # the ranks that compute the same loss from their slices

    # --- Vocab's reductions over the group (`row_losses`, `topk_row_losses`) ---
    def size(self, x: torch.Tensor) -> int | torch.Tensor: ...
    def local(self, ids: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
    def pick(self, x: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor: ...
    def amax(self, x: torch.Tensor) -> torch.Tensor: ...
    def before(self, count: torch.Tensor) -> torch.Tensor: ...
    def merge(self, log_softmax=(), lse=(), sums=()) -> tuple[list, list, list]: ...

    # --- the core's entry (`flashkd.core.run`) ---
    def agree(self, call, rows, backend: str | None, ranged: dict, failed: Exception | None) -> bool:
        """The ranks' one exchange before the loop, once each has checked its call (failed: the error its
        checks raised, then rows and backend are None): raises on every rank where any rank's call fails or
        differs; sets start, total and plan_size; True where it checked `ranged`'s values against V."""

    # --- the chunk loop (`flashkd.core.loop`, `flashkd.core.backend.row_function`): its one hook per step ---
    def exchange(self, kind: str, x):
        """What the loop hands the group between its steps, and what comes back: "gather", a statistic the
        Triton rows ask for between their phases, every rank's (R, n) x as (world, R, n) in rank order; "sum",
        x summed over the group; "rows", a block's row function's result (soft, hard, ...), returned as it
        came (kept where asked); "dx", a chunk's dX over the slice's rows, summed over the group (it may be
        asynchronous: `finish` waits)."""

    def finish(self, dxs, dws, dbs) -> tuple:
        """(dxs, dws, dbs) once the last chunk is done: pending sums waited for, dW and db scaled."""

    # --- teacher_topk's loop (`flashkd.core.topk`) ---
    def topk(self, logits: torch.Tensor, k: int, temperature: float, scale: float, softcap: float | None,
             backend: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, log-probs) of the global top-k of rows whose slice here is `logits`."""


# Guards the cosine norms of all-zero rows; the loss of such a row is β (cos taken as 0).
COSINE_EPS = 1e-12


def divergence(log_q: torch.Tensor, log_p: torch.Tensor, spec: LossSpec, vocab=None, labels=None) -> torch.Tensor:
    """The table's divergence per row of log q and log p over the last dim (−inf: probability 0);
    the formula as written, also on vectors that do not quite sum to 1 (a clamped tail bucket; the
    power and Rényi losses take the forms of `power_terms` and `renyi` there, equal to the textbook
    formulas on distributions). This block's part of the row's sum over the vocab, but for the
    ROW_WHOLE_LOSSES, whose row is whole: they merge their sums over the vocab here (`vocab`, None: the
    block holds the whole row). labels (R,): the target class, for DKD only."""
    kind = spec.kind
    vocab = vocab or WHOLE_VOCAB
    if kind == "akl":
        return adaptive_kl(log_q, log_p, spec.head_mass, vocab)
    if kind == "renyi":  # D_r(p‖q)
        return renyi(log_p, log_q, spec.alpha, vocab)
    if kind == "renyi_reverse":  # D_r(q‖p)
        return renyi(log_q, log_p, spec.alpha, vocab)
    if kind == "entropy_adaptive":
        return entropy_adaptive(log_q, log_p, spec, vocab)
    if kind == "dkd":
        return decoupled_kl(log_q, log_p, labels, spec.alpha, spec.beta, vocab)
    if kind in ("jeffreys", "co_jeffreys", "mutual", "triangular"):
        if kind == "triangular":  # (p − q)²/(p + q) = e^m expm1(−|u|)² / (1 + e^−|u|), m = max(log p, log q),
            # u = log q − log p: no 0/0 where both sides round to 0 at finite log-probs
            present = (log_p > -torch.inf) | (log_q > -torch.inf)
            lp, lq = torch.where(present, log_p, 0.0), torch.where(present, log_q, 0.0)
            d = -(lq - lp).abs()
            term = torch.maximum(lp, lq).exp() * torch.expm1(d).square() / (1.0 + d.exp())
            return torch.where(present, term, 0.0).sum(-1)
        lq, lp = (log_q.detach(), log_p.detach()) if kind == "mutual" else (log_q, log_p)
        gap, log_ratio, present = _gap(lq, lp)
        value = (gap * log_ratio).sum(-1)  # Σ (q − p)(log q − log p): every term ≥ 0, none cancels where p ≈ q
        if kind == "mutual":  # Jeffreys' value; each side's gradient that of its KL toward the other, detached
            value = value + _Pull.apply(log_q, lp.exp()) + _Pull.apply(log_p, lq.exp())
        return value
    if kind == "alpha_divergence":  # Amari: (1 − Σ p^(1−α) q^α) / (α (1 − α)), the teacher p
        return power_terms(log_p, log_q, 1.0 - spec.alpha, spec.alpha).sum(-1)
    if kind == "ab_divergence":  # Cichocki et al.: −Σ (p^α q^β − α/(α+β) p^(α+β) − β/(α+β) q^(α+β)) / (α β)
        return power_terms(log_p, log_q, spec.alpha, spec.beta).sum(-1)
    q, p = log_q.exp(), log_p.exp()
    if kind == "forward_kl":
        return _plogr(p, log_p - log_q)
    if kind == "reverse_kl":
        return _plogr(q, log_q - log_p)
    if kind == "tvd":
        return 0.5 * (q - p).abs().sum(-1)
    if kind == "skew_kl":  # KL(p ‖ α p + (1 − α) q): JSD's first piece at β = α
        return _plogr(p, log_p - _log_mixture(log_p, log_q, spec.alpha))
    if kind == "skew_reverse_kl":  # KL(q ‖ (1 − α) p + α q): JSD's second piece at β = 1 − α
        return _plogr(q, log_q - _log_mixture(log_p, log_q, 1.0 - spec.alpha))
    beta = spec.beta
    log_m = _log_mixture(log_p, log_q, beta)
    return beta * _plogr(p, log_p - log_m) + (1.0 - beta) * _plogr(q, log_q - log_m)


class _Pull(torch.autograd.Function):
    """0 per row, whose gradient w.r.t. log_x (R, V) is −w: that of KL(w‖x) = Σ w (log w − log x) for a
    constant target w, without its value (mutual learning's, whose value is Jeffreys'). An x − x.detach()
    would be NaN where log x is −inf; this is 0 there, and its gradient still −w."""

    @staticmethod
    def forward(ctx, log_x, w):
        ctx.save_for_backward(w)
        return log_x.new_zeros(log_x.shape[:-1])

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        return -grad[..., None] * w, None


def _gap(log_q: torch.Tensor, log_p: torch.Tensor):
    """(q − p, log q − log p, present) elementwise, present where either side has mass; q − p taken as
    p · expm1(log q − log p) where q ≤ p and −q · expm1(log p − log q) where q > p: exact where p ≈ q,
    bounded where they are far apart (no e^big times a tiny p). Absent on both sides: 0 and 0, with
    zero gradients (no −inf − −inf)."""
    present = (log_p > -torch.inf) | (log_q > -torch.inf)
    lp, lq = torch.where(present, log_p, 0.0), torch.where(present, log_q, 0.0)
    u = lq - lp
    gap = lp.exp() * torch.expm1(u.clamp_max(0.0)) - lq.exp() * torch.expm1((-u).clamp_max(0.0))
    return torch.where(present, gap, 0.0), torch.where(present, u, 0.0), present


def power_terms(log_p: torch.Tensor, log_q: torch.Tensor, a: float, b: float) -> torch.Tensor:
    """The αβ-divergence's terms (Cichocki, Cruces & Amari 2011) of p (power a) and q (power b), a, b > 0,
    c = a + b, elementwise:
        −(p^a q^b − (a/c) p^c − (b/c) q^c) / (a b)  ≥ 0,
    which sum to AB(a, b); at c = 1 they are Amari's α-divergence of order b, (1 − Σ p^a q^b)/(a b) on
    distributions (on positive measures, its terms (a p + b q − p^a q^b)/(a b)). Taken relative to
    the larger side, with δ = log q − log p, γ = b/c:
        q ≤ p:  p^c · ψ(γ, c δ) / c²          q > p:  q^c · ψ(1 − γ, −c δ) / c²
    ψ(β, y) = (β expm1(y) − expm1(β y)) / (β (1 − β)), y ≤ 0 (`_PowerTerm`): exact where p ≈ q (its
    Taylor series), bounded where they are far apart; 0 · anything = 0 where a side is absent, and a
    side at 0 gives the finite limit (q^c/(a c) where p = 0, p^c/(b c) where q = 0)."""
    c = a + b
    present = (log_p > -torch.inf) | (log_q > -torch.inf)
    lp, lq = torch.where(present, log_p, 0.0), torch.where(present, log_q, 0.0)
    u = lq - lp  # ±inf where one side is absent; never NaN
    gamma = b / c
    return (_PowerTerm.apply(c * lp, c * u.clamp_max(0.0), gamma)
            + _PowerTerm.apply(c * lq, c * (-u).clamp_max(0.0), 1.0 - gamma)) / (c * c)


def _kl_terms(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a‖b)'s terms a log(a/b) − a + b ≥ 0 elementwise (their sum is KL(a‖b) where a and b sum alike):
    the αβ terms at powers (1, 0), exact where a ≈ b, b where a = 0, +inf where b = 0 < a."""
    return power_terms(log_a, log_b, 1.0, 0.0)


def renyi(log_a: torch.Tensor, log_b: torch.Tensor, order: float, vocab) -> torch.Tensor:
    """Rényi's divergence of order r > 0 per row, D_r(a‖b) = log(Σ a^r b^(1−r)) / (r − 1), and at r = 1
    its limit KL(a‖b); a whole row (its sums merged over `vocab`). Rows whose S = Σ a^r b^(1−r) is
    within e^±¼ of 1 (a ≈ b) take log S = log1p(r (r − 1) A), A = Σ of the positive terms
    (a^r b^(1−r) − r a − (1 − r) b) / (r (r − 1)) (`power_terms`' ψ, exact where a ≈ b, and r = 1's limit
    A = KL(a‖b)), so D = r A log1p(z)/z, z = r (r − 1) A; the other rows log S = logsumexp(r log a + (1 − r)
    log b). Infinite where the formula is: r ≥ 1 where b = 0 and a > 0, any r where a and b share no id."""
    r = float(order)
    present = (log_a > -torch.inf) | (log_b > -torch.inf)
    near = None
    if r != 1.0:
        terms = torch.where(log_a == -torch.inf, -torch.inf, r * log_a + (1.0 - r) * log_b)  # a^r b^(1−r), 0 where a is
        (lse,) = vocab.merge(lse=(terms,))[1]
        near = lse.detach().abs() <= 0.25
    keep = present if near is None else present & near[:, None]  # the far rows: A over nothing, 0
    la, lb = torch.where(keep, log_a, 0.0), torch.where(keep, log_b, 0.0)
    u = la - lb  # log(a/b): ±inf where one side is absent
    part = (_PowerTerm.apply(lb, u.clamp_max(0.0), r) + _PowerTerm.apply(la, (-u).clamp_max(0.0), 1.0 - r)).sum(-1)
    (a_sum,) = vocab.merge(sums=(part,))[2]
    z = r * (r - 1.0) * a_sum
    small = z.abs() < 1e-3
    zs = torch.where(small, 1.0, z)
    log1p_ratio = torch.where(small, 1.0 - z * (0.5 - z * (1.0 / 3.0 - z * (0.25 - z * 0.2))), torch.log1p(zs) / zs)
    value = r * a_sum * log1p_ratio
    if near is None:
        return value
    return torch.where(near, value, lse / (r - 1.0))


def entropy_adaptive(log_q: torch.Tensor, log_p: torch.Tensor, spec: LossSpec, vocab) -> torch.Tensor:
    """w KL(p‖q) + (1 − w) KL(q‖p) per row, w = gate_min + (gate_max − gate_min) · sigmoid((H(p)/log n −
    gate_center) / gate_width): the teacher's entropy H(p) = −Σ p log p normalised by that of a uniform
    distribution over the row's n ids (those with mass on either side; 0 where n ≤ 1). w is the
    teacher's alone (no gradient); a KL whose weight is 0 adds nothing, also where it is infinite.
    A whole row: its sums merge over `vocab`."""
    p = log_p.exp()
    present = ((log_p > -torch.inf) | (log_q > -torch.inf)).to(log_p.dtype)
    forward, reverse, entropy, n = vocab.merge(sums=(
        _kl_terms(log_p, log_q).sum(-1), _kl_terms(log_q, log_p).sum(-1), -_plogr(p.detach(), log_p.detach()),
        present.sum(-1)))[2]
    many = n > 1
    h = torch.where(many, entropy / torch.log(torch.where(many, n, 2.0)), 0.0)
    w = spec.gate_min + (spec.gate_max - spec.gate_min) * torch.sigmoid((h - spec.gate_center) / spec.gate_width)
    w = w.detach()
    return torch.where(w > 0, w * forward, 0.0) + torch.where(w < 1, (1.0 - w) * reverse, 0.0)


def decoupled_kl(log_q: torch.Tensor, log_p: torch.Tensor, labels, alpha: float, beta: float, vocab) -> torch.Tensor:
    """DKD (Zhao et al., CVPR 2022) per row: α TCKD + β NCKD, with y the row's label,
        TCKD = KL((p_y, 1 − p_y) ‖ (q_y, 1 − q_y))     NCKD = KL(p̂ ‖ q̂),  p̂_j = p_j / (1 − p_y), j ≠ y
    (q̂ likewise). log(1 − p_y) is the logsumexp of log p off y: exact where p_y ≈ 1. NCKD is 0 on a row
    whose teacher puts all its mass on y (p̂ is then undefined; KD weighs it by 1 − p_y = 0); NaN on a
    row whose label is outside [0, V). A whole row: its logsumexps and sums merge over `vocab`."""
    if labels is None:
        raise ValueError("labels: loss='dkd' reads the target class of each row; got labels=None")
    col, here = vocab.local(labels[:, None], log_q)
    at = torch.zeros_like(log_q, dtype=torch.bool).scatter_(-1, col, here)
    off_p, off_q = torch.where(at, -torch.inf, log_p), torch.where(at, -torch.inf, log_q)
    _, (rest_p, rest_q), (lp_y, lq_y) = vocab.merge(lse=(off_p, off_q), sums=(vocab.pick(log_p, labels),
                                                                             vocab.pick(log_q, labels)))
    two_p, two_q = torch.stack([lp_y, rest_p], -1), torch.stack([lq_y, rest_q], -1)
    target = _kl_terms(two_p, two_q).sum(-1)
    has_p, has_q = (rest_p > -torch.inf)[:, None], (rest_q > -torch.inf)[:, None]
    lp_hat = torch.where(has_p, off_p - torch.where(has_p, rest_p[:, None], 0.0), -torch.inf)
    lq_hat = torch.where(has_q, off_q - torch.where(has_q, rest_q[:, None], 0.0), -torch.inf)
    (other,) = vocab.merge(sums=(torch.where(has_p[:, 0], _kl_terms(lp_hat, lq_hat).sum(-1), 0.0),))[2]
    value = (alpha * target if alpha != 0.0 else 0.0) + (beta * other if beta != 0.0 else 0.0)
    value = value + torch.zeros_like(lp_y)
    if alpha == 0.0 and beta == 0.0:  # 0 with a (zero) gradient: the rows' autograd needs a graph to log q
        value = value + _Pull.apply(log_q, torch.zeros_like(log_q))
    v = vocab.size(log_q)
    return torch.where((labels >= 0) & (labels < v), value, torch.nan)


class _PowerTerm(torch.autograd.Function):
    """b · ψ(β, y) elementwise, b = exp(log_b), y ≤ 0 (−inf allowed), β any real:
        ψ(β, y) = (expm1(β y) − β expm1(y)) / (β (β − 1))  ≥ 0,
    the α-family's generator f(t) = (t^β − β t + β − 1)/(β (β − 1)) at t = e^y; at β = 0 and 1 its limits
    expm1(y) − y and y e^y − expm1(y). For −⅛ ≤ y its Taylor series Σ_(n ≥ 2) c_n y^n / n!, c_n = Σ_(k < n−1) β^k
    (to n = 13: below 1e-16 of the sum for |β| ≤ 2); else the form without cancellation for β:
        β ≤ ½:  (expm1(y) − expm1(β y)/β) / (1 − β)      β > ½:  (e^y expm1((β − 1) y)/(β − 1) − expm1(y)) / β
    the products with b taken in the log domain where a factor could overflow. Its derivatives:
    d/dlog_b = b ψ, d/dy = b ψ'(β, y) = b (e^(β y) − e^y)/(β − 1), each product exact (no difference of
    near numbers). A zero gradient from above gives zero, also where the value is infinite."""

    @staticmethod
    def forward(ctx, log_b, y, beta):
        ctx.save_for_backward(log_b, y)
        ctx.beta = beta
        return _power_value(log_b, y, beta)

    @staticmethod
    def backward(ctx, grad):
        log_b, y = ctx.saved_tensors
        beta = ctx.beta
        d_log_b = d_y = None
        if ctx.needs_input_grad[0]:
            d_log_b = torch.where(grad == 0, 0.0, grad * _power_value(log_b, y, beta))
        if ctx.needs_input_grad[1]:
            d_y = torch.where(grad == 0, 0.0, grad * _power_slope(log_b, y, beta))
        return d_log_b, d_y, None


_TAYLOR_TERMS = 13  # ψ's series to y^13 for −⅛ ≤ y ≤ 0


def _power_value(log_b, y, beta: float):
    b = log_b.exp()
    small = y >= -0.125
    ys = torch.where(small, y, 0.0)
    coef, c_n, fact = [], 1.0, 2.0
    for n in range(2, _TAYLOR_TERMS + 1):
        coef.append(c_n / fact)
        c_n, fact = 1.0 + beta * c_n, fact * (n + 1)
    poly = torch.full_like(ys, coef[-1])
    for k in coef[-2::-1]:
        poly = poly * ys + k
    taylor = b * ys * ys * poly
    yl = torch.where(small, -1.0, y)
    if beta == 0.0:
        exact = b * torch.expm1(yl) - b * yl
    elif beta <= 0.5:
        z = beta * yl
        if beta > 0.0:
            b_e = b * torch.expm1(z) / beta
        else:  # z ≥ 0: b · expm1(z) = e^(log b + z) − b where expm1(z) alone could overflow
            b_e = torch.where(z <= 1.0, b * torch.expm1(z.clamp_max(1.0)), torch.exp(log_b + z) - b) / beta
        exact = (b * torch.expm1(yl) - b_e) / (1.0 - beta)
    else:  # ψ = (ψ' − expm1(y)) / β
        exact = (_power_slope(log_b, yl, beta) - b * torch.expm1(yl)) / beta
    value = torch.where(small, taylor, exact)
    return torch.where(log_b == -torch.inf, 0.0, value)


def _power_slope(log_b, y, beta: float):
    """b ψ'(β, y) = b (e^(β y) − e^y)/(β − 1) for y ≤ 0, as a product of exact factors."""
    if beta == 0.0:
        out = log_b.exp() * torch.expm1(y)
    elif beta < 1.0:
        out = torch.exp(log_b + beta * y) * torch.expm1((1.0 - beta) * y) / (1.0 - beta)
    elif beta == 1.0:
        yc = y.clamp_min(-2000.0)  # e^y · y: 0 below, where −inf would give 0 · inf
        out = torch.exp(log_b + yc) * yc
    else:
        out = torch.exp(log_b + y) * torch.expm1((beta - 1.0) * y) / (beta - 1.0)
    return torch.where(log_b == -torch.inf, 0.0, out)


def _log_mixture(log_p: torch.Tensor, log_q: torch.Tensor, beta: float) -> torch.Tensor:
    """log M, M = β p + (1 − β) q, for β in [0, 1] (an end drops its side: log(0) is −inf, not
    math.log's error). A category at −inf on both sides is absent (−inf); logaddexp(−inf, −inf)
    would backpropagate NaN."""
    if beta >= 1.0 or beta <= 0.0:  # M = p (q): logaddexp with a side at −inf backpropagates NaN where p (q) is 0;
        keep, drop = (log_p, log_q) if beta >= 1.0 else (log_q, log_p)  # the dropped side kept in the graph, weight 0
        return keep + 0.0 * torch.where(drop > -torch.inf, drop, 0.0)
    absent = (log_p == -torch.inf) & (log_q == -torch.inf)
    log_b = math.log(beta) if beta > 0.0 else -math.inf
    log_1mb = math.log1p(-beta) if beta < 1.0 else -math.inf
    log_m = torch.logaddexp(torch.where(absent, 0.0, log_p) + log_b, torch.where(absent, 0.0, log_q) + log_1mb)
    return torch.where(absent, -torch.inf, log_m)


def adaptive_kl(log_q: torch.Tensor, log_p: torch.Tensor, head_mass: float, vocab) -> torch.Tensor:
    """AKL per row (Wu et al., COLING 2025), as the authors' code computes it: w_head · KL(p‖q) +
    w_tail · KL(q‖p), w_head = g_head / (g_head + g_tail), w_tail = g_tail / (g_head + g_tail), with
    g_S = Σ_S |p − q| over the teacher's head S = H and tail S = the rest. The weights are constants:
    q in them is detached (the gradient is w_head · forward KL's + w_tail · reverse KL's). The head: the authors sort p
    descending, take the ids where the cumulative sum is at most μ, and keep the first always; ties in p
    are ordered here by id, lowest first, as a stable sort orders them (`akl_head`).
    g_head + g_tail = 0 (p = q) takes both weights as ½: both KLs and their gradients are 0 there.
    `vocab` merges the sums of a vocab slice (the block is the whole row under `WHOLE_VOCAB`)."""
    p = log_p.exp()
    head = akl_head(p, head_mass, vocab)
    gap = (p - log_q.detach().exp()).abs()
    forward, reverse, g_head, g_tail = vocab.merge(sums=(
        _plogr(p, log_p - log_q), _plogr(log_q.exp(), log_q - log_p),
        torch.where(head, gap, 0.0).sum(-1), torch.where(head, 0.0, gap).sum(-1)))[2]
    g_all = g_head + g_tail
    some = g_all > 0
    w_head = torch.where(some, g_head / torch.where(some, g_all, 1.0), 0.5)
    w_tail = torch.where(some, g_tail / torch.where(some, g_all, 1.0), 0.5)
    if head_mass >= 1.0:  # the head is the whole row: g_tail = 0, the forward KL (0 · an infinite KL(q‖p) is no NaN)
        return forward
    return w_head * forward + w_tail * reverse


def akl_head(p: torch.Tensor, head_mass: float, vocab) -> torch.Tensor:
    """AKL's head (R, V) bool of the teacher's probabilities p (`adaptive_kl`): the longest prefix of the ids
    in the order of p descending, ties by id ascending (a stable sort's), whose p sums to at most μ, and
    the first id of that order always. Found without a sort, exactly, with no host sync:
      θ  the least p value with F(θ) = Σ_(p_j ≥ θ) p_j ≤ μ, by bisection over the bit patterns of p's
         dtype (a float ≥ 0 orders as its bits; F falls as θ rises): one masked sum over the row per
         bit, 31 for fp32, 63 for fp64. Every id with p ≥ θ is in the head.
      v  the largest p below θ (the tied group the prefix ends in), and c = ⌊(μ − F(θ)) / v⌋ of its ids,
         those of least id, are in the head too (at least one where the group holds the largest p).
    Each step is a sum or max over the vocab of (R,) numbers (`Vocab.merge`, `Vocab.amax`) and one count
    of the group's ids on the slices before this one (`Vocab.before`): a vocab slice merges them over
    the ranks, about 40 all-reduces of R numbers a block (a sort would gather the slices' p)."""
    p = p.detach()
    if head_mass >= 1.0:  # every prefix sums to at most 1: the whole row, where rounding may not say so
        return torch.ones_like(p, dtype=torch.bool)
    ints = {torch.float32: torch.int32, torch.float64: torch.int64}[p.dtype]
    one = torch.tensor(1.0, dtype=p.dtype).view(ints).item()
    # the least bits with F ≤ μ lies in (lo, hi]: F(bits of 1.0 + 1) = 0 (no p above 1)
    lo = torch.full((p.shape[0], 1), -1, dtype=ints, device=p.device)
    hi = torch.full((p.shape[0], 1), one + 1, dtype=ints, device=p.device)
    for _ in range((one + 2).bit_length()):
        mid = lo + (hi - lo) // 2  # = lo once a row has converged (hi = lo + 1): then it stays
        (mass,) = vocab.merge(sums=(torch.where(p >= mid.clamp_min(0).view(p.dtype), p, 0.0).sum(-1),))[2]
        fits = (mass <= head_mass)[:, None]
        done = hi - lo <= 1
        hi, lo = torch.where(fits & ~done, mid, hi), torch.where(fits | done, lo, mid)
    theta = hi.clamp_max(one).view(p.dtype)  # bits one + 1 is no float here: only p ≥ 1 would reach it
    above = p >= theta
    below = torch.where(above, -1.0, p)
    v = vocab.amax(below)[:, None]  # the group the prefix ends in (−1: every id is in the head already)
    (mass,) = vocab.merge(sums=(torch.where(above, p, 0.0).sum(-1),))[2]
    fit = torch.floor((head_mass - mass[:, None]) / torch.where(v > 0, v, 1.0)).clamp_min(0.0)
    # no id above θ anywhere (its mass is 0): v is the largest p, and the first of its ids is in the head
    fit = torch.where(mass[:, None] == 0, fit.clamp_min(1.0), fit)
    group = (p == v) & (v >= 0)
    rank = torch.cumsum(group.to(torch.int64), -1) - 1 + vocab.before(group.sum(-1))[:, None]
    return above | (group & (rank < fit))


def _plogr(w: torch.Tensor, log_ratio: torch.Tensor) -> torch.Tensor:
    """Σ w · log_ratio with 0 · log 0 = 0: a column at −inf (probability 0) adds nothing, not NaN."""
    # the ratio is masked before the product too: its NaN (−inf − −inf) would reach w's gradient
    return (w * torch.where(w > 0, log_ratio, 0.0)).sum(-1)
