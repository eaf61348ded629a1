"""The public functions: each parses its keywords once into a frozen call (`core.call.parse`,
`parse_teacher_topk`) and routes it (`_route`: its arguments as passed, sorted by the keyword table,
`flashkd.core.keywords`), to the core's one entry (`flashkd.core.run`) on this
process, or, with its sharding keywords (`flashkd.distributed.Sharding`), to `flashkd.distributed`
when the call passes `process_group=` or a head that is a DTensor (imported by the first such call, so
that a plain call pays nothing for it). Their keyword options and defaults: `KEYWORDS` (the table's).

    fused_linear_distill         teacher hidden states and LM head: T[c] = Xt[c] @ Wt[:V]^T (+ bt[:V])
    fused_linear_distill_logits  precomputed dense teacher logits:  T[c] = teacher_logits[c, :V]
    fused_linear_distill_topk    sparse teacher: (ids, logprobs)[c], K per row (losses.topk_row_losses)
    teacher_topk                 a teacher's top-k log-probs, the targets of the top-k form

The chunk loop, its plan and its memory bounds: `flashkd.core` (`loop`, `plan`).
"""

from __future__ import annotations

import torch

from . import core
from .core import call as calls
from .core import keywords
from .core.checks import any_dtensor
from .losses import shown


def fused_linear_distill(
    student_input: torch.Tensor,  # (..., Hs)
    student_weight: torch.Tensor,  # (V, Hs)
    teacher_input: torch.Tensor,  # (..., Ht), same leading dims
    teacher_weight: torch.Tensor,  # (Vt, Ht), Vt >= V
    labels: torch.Tensor | None = None,  # (...) integer, ignore_index marks rows to skip
    *,
    loss: str = "jsd",
    beta: float | None = None,
    alpha: float | None = None,
    head_mass: float | None = None,
    gate_min: float | None = None,
    gate_max: float | None = None,
    gate_center: float | None = None,
    gate_width: float | None = None,
    temperature: float = 1.0,
    weight_hard_loss: float = 0.5,
    weight_soft_loss: float = 0.5,
    ignore_index: int = -100,
    student_bias: torch.Tensor | None = None,  # (V,)
    teacher_bias: torch.Tensor | None = None,  # (Vt,)
    reduction: str = "mean",
    chunk_size: int | None = None,
    backend: str = "auto",
    return_soft_hard_loss: bool = False,
    temperature_squared: bool = False,
    grad_accum_dtype: torch.dtype | None = None,
    check_labels: bool | None = None,
    student_logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    student_softcap: float | None = None,
    teacher_softcap: float | None = None,
    row_weight: torch.Tensor | None = None,  # (...) like labels, constant
    return_stats: bool = False,
    process_group=None,
    vocab_start: int | None = None,
    check_shards: bool | None = None,
    check_replicas: bool = False,
    fsdp_gather: str = "auto",
    teacher_precision: str | None = None,
    vocab_size: int | None = None,
):
    """Distillation loss between a student and a teacher LM head, without materialising the logits.

    Shapes: student_input (..., Hs) and teacher_input (..., Ht) with the same leading dims (B, T or
    N; flattened to N rows, gradients come back in the input's shape), student_weight (V, Hs),
    teacher_weight (Vt, Ht) with Vt >= V, labels (...) int64 or int32 or None, biases (V,) and (Vt,). All
    float tensors share one dtype (fp16, bf16, fp32, fp64).
    loss=: "jsd" (β-weighted JSD, β = 0 forward KL, β = 1 reverse KL), "forward_kl" (KL(p‖q)),
    "reverse_kl" (KL(q‖p)), "tvd" (½ Σ|q − p|), "cosine" (β (1 − cos) of the logits), "skew_kl"
    (KL(p ‖ α p + (1 − α) q)), "skew_reverse_kl" (KL(q ‖ (1 − α) p + α q)), α = `alpha` in [0, 1], or
    "akl" (adaptive KL: forward and reverse KL weighted by the gaps |p − q| in the teacher's head, its
    likeliest ids holding mass `head_mass` μ in [0, 1], and tail; the weights are not differentiated);
    "jeffreys" (KL(p‖q) + KL(q‖p)), "alpha_divergence" (Amari's, (1 − Σ p^(1−α) q^α)/(α(1 − α)), α in
    (0, 1)), "renyi" / "renyi_reverse" (D_α(p‖q) / D_α(q‖p) = log Σ p^α q^(1−α) / (α − 1) of order α in
    (0, 2], α = 1 the KL), "ab_divergence" (the αβ-divergence, −Σ (p^α q^β − α/(α+β) p^(α+β) − β/(α+β)
    q^(α+β))/(αβ), α, β in [0.05, 2]), "triangular" (Σ (p − q)²/(p + q)), "entropy_adaptive" (w KL(p‖q) +
    (1 − w) KL(q‖p), w = gate_min + (gate_max − gate_min) · sigmoid((H(p)/log n − gate_center)/gate_width)
    from the teacher's normalised entropy, not differentiated), "dkd" (decoupled KD: α KL of the label's
    mass (p_y, 1 − p_y) ‖ (q_y, 1 − q_y) + β KL among the other ids, each side renormalised; needs
    labels); "mutual" and "co_jeffreys" (KL(p‖q) + KL(q‖p), with a teacher that learns too: below). q and
    p are the student's and teacher's softmax at temperature τ. AKL and the losses after it run on the
    torch rows on every backend for now. Formulas, sources and costs: docs/divergences.md.
    beta, alpha, head_mass, gate_min, gate_max, gate_center, gate_width: the losses' own parameters
    (`flashkd.losses.PARAMETERS`: the losses that read each, their defaults and ranges); None (the
    default) takes the loss's default (β 0.5 for jsd, cosine and ab_divergence, 8 for dkd; α 0.1 for the
    skew losses, 0.5 for alpha_divergence, renyi and ab_divergence, 1 for dkd; μ 0.5; the gate 0, 1,
    0.5, 0.1). A loss that does not read one refuses a value for it (ValueError naming the losses that
    do): `loss="forward_kl", beta=0.3` would change nothing.

    Returns the scalar loss  w_hard · CE + w_soft · soft  (see `flashkd.losses` for every formula),
    fp32 (fp64 for fp64 inputs, computed in fp64 on every backend), or `(loss, soft, hard)` with
    `return_soft_hard_loss` — `soft` and `hard` are the two terms before their weights, detached, for
    logging. With `return_stats` a `flashkd.DistillStats` comes last: `(loss, stats)`, or
    `(loss, soft, hard, stats)` with both. Gradients flow to `student_input`, `student_weight` and
    `student_bias`; the teacher is a constant (no graph through it, whatever it requires), but for
    loss="mutual" and "co_jeffreys", whose teacher learns: where `teacher_input`, `teacher_weight` or
    `teacher_bias` require grad (in grad mode) they get their gradients from the same pass (mutual: each
    side's gradient that of its KL toward the other's detached distribution, KL(p̄‖q) for the student and
    KL(q̄‖p) for the teacher; co_jeffreys: Jeffreys' own on both sides; both report Jeffreys' value). A
    head passed as both student_weight and teacher_weight (self-distillation) gets both sides' gradients
    summed where the teacher learns, the student's alone otherwise. docs/divergences.md. Rows whose
    label is `ignore_index` contribute nothing, NaN or inf in them included. The gradients are first
    order only: a backward with create_graph=True (double backward) raises RuntimeError. torch.autocast
    changes nothing: the GEMMs run in the inputs' dtype (cast them first for autocast's, as
    `flashkd.integrations` do).

    - student_logit_scale, student_softcap (teacher_...: the teacher's): each head's own transform of
      its logits, z = c · tanh(σ · logits / c) (z = σ · logits with softcap None), before everything
      else: the soft term takes z / τ, the CE the student's z, cosine the z's. σ: a finite non-zero
      float (a config's `logit_scale`, 1 / `logits_scaling`, `lm_head_multiplier`); c: a finite
      float > 0 (`final_logit_softcapping`) or None. Gradients go through both exactly.
    - row_weight: a constant float tensor (any float dtype, read in fp32; fp64 for fp64 inputs) of the
      labels' shape (student_input's leading dims), on the same device: each row's soft and hard
      terms, and their gradients, are multiplied by it. "mean" still divides by the number of rows
      whose label is not ignore_index, so weights of 1 change nothing. Any finite value is allowed
      (negative too); on CPU a non-finite weight is an error, on GPU it is not checked (a host sync)
      and gives a non-finite loss. To drop a row, set its label to ignore_index.

    - labels: int64 or int32 (then ignore_index in int32's range). labels=None: every row counts;
      `weight_hard_loss` must then be 0.
    - vocab_size: a teacher head of Vt > V rows is taken as the student's tokenizer padded (Qwen's 151936
      rows for 151665 tokens, say) only when the call says so, vocab_size=V: its ids >= V are dropped, and
      the teacher distribution is the softmax over the student's V ids. Without it Vt > V is an error (a
      teacher with another tokenizer would train on mismatched ids), as are Vt < V and vocab_size != V.
      With process_group, V is the whole vocab's size.
    - temperature_squared: multiply the soft term by τ² (Hinton).
    - grad_accum_dtype: dtype of the dWs accumulator; None means fp32 (fp64 for fp64 weights).
      Passing the weight's own dtype saves V·Hs·(4 − E) bytes, and rounds dWs once per chunk: its
      error grows with the number of chunks (bf16, 8 chunks: 1.8–4.6× that of fp32, BENCHMARKS.md).
    - check_labels: raise on labels outside [0, V) other than ignore_index. Default: on CPU tensors
      (no cost); off on GPU, where such a row gives a NaN loss instead (the check would be a host sync).
    - process_group, vocab_start, check_shards, check_replicas: vocab-parallel heads, each rank holding
      the rows [vocab_start, vocab_start + V_r) of each head; fsdp_gather: what to gather for a head
      that is an FSDP2 DTensor ("auto", "rows", "heads"). See `flashkd.distributed`.
    - teacher_precision: None (the teacher's logits from a GEMM in its dtype), or "fp8" (the same as
      "fp8-rowwise") or "fp8-1x128": from an e4m3 GEMM with one scale per row (per 128 hidden units)
      of teacher_input and teacher_weight, on GPUs with FP8 tensor cores (sm_89+; 1x128 on sm_90
      only). The head is quantised anew on every call (one read of teacher_weight, ~V·Ht bytes held
      for the call). Faster, and less exact: the teacher's probabilities move by
      what e4m3's 3-bit mantissa does to its logits (docs/api.md, "FP8 teacher"; BENCHMARKS.md). See `flashkd.fp8`.
    """
    return _route("fused_linear_distill", locals())


def fused_linear_distill_logits(
    student_input: torch.Tensor,  # (..., Hs)
    student_weight: torch.Tensor,  # (V, Hs)
    teacher_logits: torch.Tensor,  # (..., Vt), same leading dims, Vt >= V
    labels: torch.Tensor | None = None,
    *,
    loss: str = "jsd",
    beta: float | None = None,
    alpha: float | None = None,
    head_mass: float | None = None,
    gate_min: float | None = None,
    gate_max: float | None = None,
    gate_center: float | None = None,
    gate_width: float | None = None,
    temperature: float = 1.0,
    weight_hard_loss: float = 0.5,
    weight_soft_loss: float = 0.5,
    ignore_index: int = -100,
    student_bias: torch.Tensor | None = None,
    reduction: str = "mean",
    chunk_size: int | None = None,
    backend: str = "auto",
    return_soft_hard_loss: bool = False,
    temperature_squared: bool = False,
    grad_accum_dtype: torch.dtype | None = None,
    check_labels: bool | None = None,
    student_logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    student_softcap: float | None = None,
    teacher_softcap: float | None = None,
    row_weight: torch.Tensor | None = None,
    return_stats: bool = False,
    process_group=None,
    vocab_start: int | None = None,
    check_shards: bool | None = None,
    check_replicas: bool = False,
    fsdp_gather: str = "auto",
    vocab_size: int | None = None,
):
    """`fused_linear_distill` with the teacher given as precomputed dense logits (no teacher GEMM).

    Same losses, options and results as `fused_linear_distill` with teacher logits
    Xt @ Wt^T (+ bt); `teacher_logits` has the student's dtype and is read in place, one chunk of rows
    at a time (its leading dims must flatten to rows without a copy, as a view: any row stride; a vocab
    stride other than 1 is copied per chunk; other layouts are refused, not copied whole). With more
    than V columns (a padded head) pass vocab_size=V, as for `fused_linear_distill`'s teacher_weight:
    its columns >= V are dropped. The teacher gets no gradient: loss="mutual" or "co_jeffreys" with
    teacher_logits that require grad (in grad mode) is refused (ValueError; their gradient would be
    N x V), pass the teacher's hidden states and head to `fused_linear_distill`. `teacher_logit_scale` and
    `teacher_softcap` transform `teacher_logits` as given: an HF model's `.logits` already include
    its own scale and softcap, so leave them at their defaults for those. With `process_group`,
    `teacher_logits` are the columns of this rank's vocab slice.
    """
    return _route("fused_linear_distill_logits", locals())


def fused_linear_distill_topk(
    student_input: torch.Tensor,  # (..., Hs)
    student_weight: torch.Tensor,  # (V, Hs)
    teacher_ids: torch.Tensor,  # (..., K) integer vocab ids, -1 marks an unused slot
    teacher_logprobs: torch.Tensor,  # (..., K) teacher log-probs at those ids
    labels: torch.Tensor | None = None,
    *,
    loss: str = "forward_kl",
    tail: str = "bucket",
    tail_clamp: float | None = None,
    beta: float | None = None,
    alpha: float | None = None,
    head_mass: float | None = None,
    gate_min: float | None = None,
    gate_max: float | None = None,
    gate_center: float | None = None,
    gate_width: float | None = None,
    temperature: float = 1.0,
    weight_hard_loss: float = 0.0,
    weight_soft_loss: float = 1.0,
    ignore_index: int = -100,
    student_bias: torch.Tensor | None = None,
    reduction: str = "mean",
    chunk_size: int | None = None,
    backend: str = "auto",
    return_soft_hard_loss: bool = False,
    temperature_squared: bool = False,
    grad_accum_dtype: torch.dtype | None = None,
    check_labels: bool | None = None,
    check_teacher: bool | None = None,
    student_logit_scale: float = 1.0,
    student_softcap: float | None = None,
    row_weight: torch.Tensor | None = None,
    return_stats: bool = False,
    teacher_index: torch.Tensor | None = None,  # (...) like labels, integer
    num_teachers: int | None = None,
    process_group=None,
    vocab_start: int | None = None,
    check_shards: bool | None = None,
    check_replicas: bool = False,
    fsdp_gather: str = "auto",
):
    """Distillation from a sparse teacher: its top-k log-probs (from disk, or an inference server).

    The student distribution is q = softmax(student logits / τ) over the whole vocab; the teacher's
    p is known at K ids per row. tail="bucket": both become distributions over K + 1 categories, the
    K ids and one bucket for the rest of the vocab (p_rest = max(1 − Σ p, 0), q_rest = 1 − Σ q);
    tail="renormalize": both are renormalised over the K ids. The loss (any of `fused_linear_distill`'s
    but "cosine", which needs the teacher's logits, "dkd", which needs the teacher's probability at
    the label, and "mutual" / "co_jeffreys", whose teacher learns through its head: all refused) is the dense one over those categories; CE mixing, ignore_index, reduction
    and the gradients are those of `fused_linear_distill`. Exact formulas: `flashkd.losses.topk_row_losses`.

    Temperature: `temperature` divides the student's logits only; `teacher_logprobs` are taken as the
    teacher's distribution at that temperature, as `flashkd.teacher_topk(..., temperature=τ)` makes
    them. Log-probs stored at τ0 can be used at τ with tail="renormalize" by passing
    logprobs · τ0 / τ (exact: renormalising over the K ids is all that differs); with tail="bucket"
    the rest mass at τ is not known from them — store them at the τ you distill at.

    - teacher_logprobs: any float dtype, read in fp32 (fp64 for an fp64 student); unused slots are
      ignored (−inf is fine there). They are the teacher's final distribution: only the student has a
      logit scale and softcap here (`student_logit_scale`, `student_softcap`, as in
      `fused_linear_distill`); `teacher_topk` takes the teacher's.
    - tail_clamp: None, or ε > 0 with tail="bucket" for TRL's tail bucket (its `_add_tail_bucket`,
      ε = 1e-7): on each side the rest is 1 − exp(min(log Σ over the ids, −ε)), at least 1 − e^−ε ≈ ε, and
      nothing is renormalised (a teacher whose probabilities sum past 1 keeps them, with a rest of
      ≈ ε; the sum is then not checked). The divergence is the same formula on those categories.
    - row_weight, return_stats: as in `fused_linear_distill`; the stats' `topk_mass_sum` is the
      student's probability mass on the teacher's ids, and `teacher_entropy_sum` the teacher's entropy
      over the categories (as the loss sees them), each summed over the rows that count.
    - teacher_index, num_teachers: with return_stats, per-teacher sums in `DistillStats.per_teacher`
      (num_teachers, 3): rows, soft sum, teacher entropy sum of the rows of each teacher (several
      teachers scoring different rows, as TRL's multi-teacher on-policy distillation does).
      teacher_index: an int64 or int32 constant of the labels' shape, on the device, each row's teacher
      in [0, num_teachers), or −1 for a row in no teacher's sums (it still counts in the totals).
      Checked with check_teacher; unchecked on GPU, another value is in no teacher's sums. The loss
      and gradients do not depend on it.
    - reverse_kl with tail="bucket" is infinite on a row whose teacher puts no mass outside the K ids
      (p_rest = 0) while the student does: use "jsd" or "renormalize" for such targets.
    - check_teacher: raise on ids outside [-1, V), duplicate ids in a row, log-probs > 0 or NaN at
      used slots, teacher_index values outside [-1, num_teachers), and with tail="bucket" (no
      tail_clamp) probabilities summing past 1 over the used slots (beyond
      K^u + u, the rounding of log-probs stored in fp16, u = 2^-11, or bf16, u = 2^-8 for any other
      dtype), in rows whose label is not ignore_index. Default: on CPU tensors; off on GPU (a host
      sync), where an out-of-range id or a NaN log-prob gives a NaN loss on its row, duplicates give
      wrong values and a mass past 1 is renormalised (the bucket gets p_rest = 0).
    - With `process_group`, `teacher_ids` are ids of the whole vocab, the same on every rank.
    """
    return _route("fused_linear_distill_topk", locals())


@torch.no_grad()
def teacher_topk(
    teacher_input: torch.Tensor,  # (..., H)
    teacher_weight: torch.Tensor,  # (Vt, H)
    k: int,
    *,
    temperature: float = 1.0,
    teacher_bias: torch.Tensor | None = None,  # (Vt,)
    vocab_size: int | None = None,
    chunk_size: int | None = None,
    backend: str = "auto",
    teacher_logit_scale: float = 1.0,
    teacher_softcap: float | None = None,
    process_group=None,
    vocab_start: int | None = None,
    check_shards: bool | None = None,
    fsdp_gather: str = "auto",
    teacher_precision: str | None = None,
):
    """The teacher's k most likely ids per row and their log-probs at `temperature`.

    Returns (ids, logprobs): (..., k) int64 and (..., k) float32 (float64 for float64
    inputs, computed in float64), sorted by decreasing log-prob,
    log p = z/τ − logsumexp(z/τ) over the whole vocab, z the logits as the teacher's head transforms
    them (z = c · tanh(σ · logits / c) with σ = `teacher_logit_scale`, c = `teacher_softcap`; z = σ ·
    logits without a cap; as in `fused_linear_distill`), the ids those of the k largest z (a negative σ
    reverses the order) — the targets of `fused_linear_distill_topk(..., temperature=τ)`. Never holds more than one chunk of logits
    (R·Vt·E bytes, R rows per chunk, plus fp32 temporaries of the same size on the torch backend).

    vocab_size: the student's vocab V when the teacher head is padded (Vt > V): ids >= V are
    dropped before the softmax, as in `fused_linear_distill`.

    temperature: a finite float > 0 (LossSpec's rule). A row with a NaN or +inf logit (NaN or inf in
    the hidden states, weight or bias; −inf logits, a masked id, are fine) raises ValueError naming
    the row of teacher_input: no NaN targets come back. torch.autocast changes nothing: the logits come
    from a GEMM in the inputs' dtype.

    On the Triton backend each chunk costs the GEMM, two reads of its logits and one host sync (rows
    whose top-k candidates overflowed, normally none, are redone with torch.topk; the same sync finds
    non-finite rows); on the torch backend one host sync a chunk, for the non-finite rows.

    process_group, vocab_start: a vocab-parallel teacher head, this rank holding its rows
    [vocab_start, vocab_start + V_r); every rank passes the same teacher_input and gets the same
    global top-k (vocab_size is then the whole vocab's). A DTensor head (FSDP2): `fsdp_gather`. See
    `flashkd.distributed`.

    teacher_precision: None, or "fp8" / "fp8-rowwise" / "fp8-1x128", the logits from an e4m3 GEMM
    (as in `fused_linear_distill`; `flashkd.fp8`): the top-k targets are then those of the
    FP8 teacher.
    """
    return _route("teacher_topk", locals())


FSDP_GATHER = ("auto", "rows", "heads")
# each function's teacher form (`core.call`); teacher_topk's has no student
_FORMS = {keywords.FUNCTION_OF_FORM[form.form]: form for form in (calls.Heads, calls.Logits, calls.TopK,
                                                                  calls.TeacherTopK)}
# The keyword options of the public functions, with their defaults: what the modules and the
# integrations accept (the one table, `flashkd.core.keywords`; tests/test_layers.py holds it and the
# signatures above alike).
KEYWORDS = keywords.KEYWORDS


def _route(function: str, given: dict):
    """The call of `function` with its arguments `given` ({name: value}, all of them, as passed), parsed
    and run on this process, or on `flashkd.distributed` with the sharding keywords when it passes
    process_group or a head that is a DTensor. The arguments go where the keyword table says: the
    tensors to the call's Student and teacher form (their fields are the public names), the loss's and
    the options' keywords to the parse, the sharding keywords to a `Sharding`. With a process group an
    error of the parse is raised on every rank of it (`distributed.fail`): raised on one rank only, it
    would leave the others waiting in the call's first collective."""
    form = _FORMS[function]
    student = None if form is calls.TeacherTopK else keywords.group(calls.Student, given)
    teacher = keywords.group(form, given)
    sharding = keywords.group(keywords.Sharding, given)
    groups = (student, teacher)
    heads = [x for part in (calls.HEAD, calls.TEACHER_HEAD) for x in calls.group_tensors(groups, part).values()]
    rows = next(iter(calls.group_tensors(groups, calls.ROWS).values()))  # the first rows tensor: the exchange's device
    sharded = sharding.process_group is not None or any_dtensor(*heads)
    try:
        # the sharding flags' types first, on every call: a str would pass for True where they are read (a
        # DTensor head's exchange, or check_keywords' process group) and for nothing where they are not
        keywords.run_checks(keywords.sort(given, (keywords.SHARDING,)), late=False)
        parsed = keywords.sort(given, keywords.PARSED)
        call = (calls.parse_teacher_topk(teacher, parsed) if student is None
                else calls.parse(student, teacher, parsed))
        if sharding.fsdp_gather not in FSDP_GATHER:
            raise ValueError(f"fsdp_gather: expected 'auto', 'rows' or 'heads', got {sharding.fsdp_gather!r}")
        if not sharded and sharding.vocab_start is not None:
            raise ValueError(f"vocab_start: expected None without process_group, got {sharding.vocab_start!r}")
        if sharded:
            from .distributed.sharding import check_keywords

            check_keywords(sharding)
    except (TypeError, ValueError) as e:
        if sharding.process_group is None:
            raise
        from . import distributed

        distributed.fail(e, sharding.process_group, sharding.vocab_start, rows)
    if not sharded:
        return core.run(call)
    from . import distributed

    return distributed.run(call, sharding)


def check_options(options: dict, function: str = "fused_linear_distill") -> None:
    """Options of a public loss function (KEYWORDS[function]'s names), checked as a forward with labels
    would check them, by the call's own parse: a module's or trainer's options fail where it is made, not
    at its first forward. What depends on the tensors (triton on a CPU tensor, grad_accum_dtype against
    the weight's, vocab_size against the heads) and the sharding keywords are checked by the call."""
    # a name the parse does not take (misspelt, or another function's) is refused, not sorted out unread
    unknown = [name for name in options if name not in KEYWORDS[function]]
    if unknown:
        raise TypeError(f"{unknown[0]}: expected a keyword option of flashkd.{function}, got "
                        f"{unknown[0]}={shown(options[unknown[0]])}")
    calls.parse(None, None, keywords.sort({**KEYWORDS[function], **options}, keywords.PARSED))
