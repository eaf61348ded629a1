"""The test oracle: the naive formula over the full logits in float64, written from the definitions.

Deliberately shares no code with flashkd: probabilities are formed explicitly, KL terms with
torch.xlogy, the CE with F.cross_entropy, cosine with F.cosine_similarity. A head's logit scale σ and
softcap c: logits · σ, then c · tanh(· / c). row_weight multiplies each row's terms; "mean" divides
by the count of rows that are not ignored.
"""

import math

import torch
import torch.nn.functional as F


def distill_loss(
    xs, ws, xt, wt, labels=None, *, loss="jsd", beta=None, temperature=1.0, weight_hard_loss=0.5,
    weight_soft_loss=0.5, ignore_index=-100, student_bias=None, teacher_bias=None, reduction="mean",
    temperature_squared=False, plain=False, teacher_logits=None, student_logit_scale=1.0, teacher_logit_scale=1.0,
    student_softcap=None, teacher_softcap=None, row_weight=None, student_logits=None, alpha=None, head_mass=0.5,
    gate_min=0.0, gate_max=1.0, gate_center=0.5, gate_width=0.1,
):
    """float64 loss, differentiable w.r.t. xs, ws and student_bias; also returns (soft, hard).

    plain=True is instead what a user would write in plain torch: GEMMs in the input dtype, the loss
    math in fp32 — the baseline whose error the fused op must match. teacher_logits (..., Vt), when
    given, replaces xt @ wt^T (xt, wt are then ignored); student_logits (..., V) likewise xs @ ws^T.
    """
    alpha, beta = _defaults(loss, alpha, beta)
    up = (lambda x: x) if plain else (lambda x: x.double())
    logits_s = up(xs) @ up(ws).T if student_logits is None else up(student_logits)
    v = logits_s.shape[-1]
    if teacher_logits is not None:
        logits_t = up(teacher_logits)[..., :v]
    else:
        logits_t = up(xt) @ up(wt)[:v].T
    if student_bias is not None:
        logits_s = logits_s + up(student_bias)
    if teacher_bias is not None:
        logits_t = logits_t + up(teacher_bias)[:v]
    if plain:
        logits_s, logits_t = logits_s.float(), logits_t.float()
    logits_s = head(logits_s.reshape(-1, v), student_logit_scale, student_softcap)
    logits_t = head(logits_t.reshape(-1, v), teacher_logit_scale, teacher_softcap)
    q = torch.softmax(logits_s / temperature, -1)
    p = torch.softmax(logits_t / temperature, -1)

    if loss == "cosine":
        soft = beta * (1 - F.cosine_similarity(logits_s, logits_t, dim=-1))
    else:
        logs = torch.log_softmax(logits_s / temperature, -1), torch.log_softmax(logits_t / temperature, -1)
        soft = _divergence(q, p, loss, beta, alpha, head_mass, logs=logs, gate=(gate_min, gate_max, gate_center, gate_width),
                           labels=None if labels is None else labels.reshape(-1))
    if temperature_squared:
        soft = soft * temperature**2

    return _reduce(soft, logits_s, labels, ignore_index, reduction, weight_hard_loss, weight_soft_loss, row_weight)


# The losses' parameters where a call leaves them out (None): each loss's own default
_DEFAULT_ALPHA = {"alpha_divergence": 0.5, "renyi": 0.5, "renyi_reverse": 0.5, "ab_divergence": 0.5, "dkd": 1.0}
_DEFAULT_BETA = {"ab_divergence": 0.5, "dkd": 8.0}


def _defaults(loss, alpha, beta):
    return (_DEFAULT_ALPHA.get(loss, 0.1) if alpha is None else alpha,
            _DEFAULT_BETA.get(loss, 0.5) if beta is None else beta)


def head(logits, scale=1.0, softcap=None):
    """A model head's own transform of its logits: times the scale, then softcapped; a −inf logit (a
    masked id) stays −inf."""
    z = logits * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return torch.where(logits == -math.inf, logits, z)


def student_stats(xs, ws, labels=None, ids=None, *, temperature=1.0, student_bias=None, student_logit_scale=1.0,
                  student_softcap=None, ignore_index=-100):
    """float64 (entropy sum in nats, rows counted, mass on the used ids summed) of q = softmax(z/τ)."""
    v = ws.shape[0]
    logits = xs.double() @ ws.double().T
    if student_bias is not None:
        logits = logits + student_bias.double()
    q = torch.softmax(head(logits.reshape(-1, v), student_logit_scale, student_softcap) / temperature, -1)
    valid = torch.ones(q.shape[0], dtype=torch.bool) if labels is None else labels.reshape(-1) != ignore_index
    entropy = -torch.xlogy(q, q).sum(-1)
    mass = None
    if ids is not None:
        ids = ids.reshape(-1, ids.shape[-1])
        mass = sum(q[r, [i for i in row if i >= 0]].sum() for r, row in enumerate(ids.tolist()) if valid[r])
    return entropy[valid].sum(), int(valid.sum()), mass


def topk_loss(
    xs, ws, ids, logprobs, labels=None, *, loss="forward_kl", tail="bucket", beta=None, temperature=1.0,
    weight_hard_loss=0.0, weight_soft_loss=1.0, ignore_index=-100, student_bias=None, reduction="mean",
    temperature_squared=False, student_logit_scale=1.0, student_softcap=None, row_weight=None, student_logits=None,
    tail_clamp=None, teacher_entropy=False, alpha=None, head_mass=0.5, gate_min=0.0, gate_max=1.0, gate_center=0.5,
    gate_width=0.1,
):
    """float64 loss of a sparse teacher, row by row from the definition: the categories are the used
    ids (+ the rest of the vocab for tail="bucket"), probabilities summed explicitly. student_logits, when
    given, replaces xs @ ws^T and sets the precision (the fp32 pipeline's bar). tail_clamp ε: TRL's
    bucket, each side's rest 1 − min(Σ over the ids, e^−ε), nothing renormalised. teacher_entropy: also
    return each row's −Σ p log p over the categories (zero on ignored rows)."""
    alpha, beta = _defaults(loss, alpha, beta)
    logits_s = xs.double() @ ws.double().T if student_logits is None else student_logits
    v = logits_s.shape[-1]
    if student_bias is not None:
        logits_s = logits_s + student_bias.double()
    logits_s = head(logits_s.reshape(-1, v), student_logit_scale, student_softcap)
    q = torch.softmax(logits_s / temperature, -1)
    ids = ids.reshape(-1, ids.shape[-1])
    logprobs = logprobs.reshape(ids.shape).double()
    soft, entropy = [], []
    for r, row in enumerate(ids.tolist()):
        slots = [j for j, i in enumerate(row) if i >= 0]
        on = [row[j] for j in slots]
        q_ids = q[r, on]
        p_ids = logprobs[r, slots].exp()
        if tail == "bucket" and tail_clamp is not None:
            cap = math.exp(-tail_clamp)
            q_ids = torch.cat([q_ids, (1 - torch.clamp(q_ids.sum(), max=cap)).reshape(1)])
            p_ids = torch.cat([p_ids, (1 - torch.clamp(p_ids.sum(), max=cap)).reshape(1)])
        elif tail == "bucket":
            rest = torch.ones(v, dtype=torch.bool, device=q.device)
            rest[on] = False
            if rest.any():
                q_ids = torch.cat([q_ids, q[r, rest].sum().reshape(1)])
                p_ids = torch.cat([p_ids, (1 - p_ids.sum()).clamp_min(0).reshape(1)])
            p_ids = p_ids / p_ids.sum()
        elif not on:  # renormalize without teacher ids: no information, loss 0
            soft.append(q[r].sum() * 0)
            entropy.append(q.new_zeros(()))
            continue
        else:
            q_ids, p_ids = q_ids / q_ids.sum(), p_ids / p_ids.sum()
        soft.append(_divergence(q_ids, p_ids, loss, beta, alpha, head_mass, gate=(gate_min, gate_max, gate_center, gate_width)))
        entropy.append(-torch.xlogy(p_ids, p_ids).sum())
    soft = torch.stack(soft) if soft else q.new_zeros(0)
    if temperature_squared:
        soft = soft * temperature**2
    out = _reduce(soft, logits_s, labels, ignore_index, reduction, weight_hard_loss, weight_soft_loss, row_weight)
    if not teacher_entropy:
        return out
    entropy = torch.stack(entropy) if entropy else q.new_zeros(0)
    if labels is not None:
        entropy = torch.where(labels.reshape(-1) != ignore_index, entropy, 0.0)
    return out, entropy


def trl_jsd_loss(hidden, weight, bias, ids, logprobs, mask, *, beta, temperature, add_tail_bucket, logit_scale=1.0,
                 softcap=None, teacher_index=None, num_teachers=1, clamp=1e-7):
    """float64 TRL's `_chunked_jsd_loss`, from its definition: the student's log-softmax over the whole
    vocab, its probabilities and the teacher's at the masked-in candidates, a tail 1 − min(Σ, e^−ε) on
    each side (nothing renormalised) or both renormalised over the candidates, the generalized JSD
    (β 0: KL(p‖q), 1: KL(q‖p)) summed. Returns (loss, jsd sum, student entropy sum over the vocab,
    teacher entropy sum over the support, per-teacher (count, jsd, teacher entropy) flat)."""
    logits = hidden.double() @ weight.double().T
    if bias is not None:
        logits = logits + bias.double()
    z = head(logits, logit_scale, softcap) / temperature
    q = torch.softmax(z, -1)
    student_entropy = -torch.xlogy(q, q).sum(-1)
    rows, teacher_entropy = [], []
    for r in range(z.shape[0]):
        slots = mask[r].nonzero()[:, 0].tolist()
        q_c = q[r, ids[r, slots]]
        p_c = logprobs[r, slots].double().exp()
        if add_tail_bucket:
            cap = math.exp(-clamp)
            q_c = torch.cat([q_c, (1 - torch.clamp(q_c.sum(), max=cap)).reshape(1)])
            p_c = torch.cat([p_c, (1 - torch.clamp(p_c.sum(), max=cap)).reshape(1)])
        elif not slots:  # nothing to compare: 0, the teacher's entropy 0 too
            rows.append(q[r].sum() * 0)
            teacher_entropy.append(q.new_zeros(()))
            continue
        else:
            q_c, p_c = q_c / q_c.sum(), p_c / p_c.sum()
        rows.append(_divergence(q_c, p_c, "jsd", beta))
        teacher_entropy.append(-torch.xlogy(p_c, p_c).sum())
    jsd = torch.stack(rows)
    teacher_entropy = torch.stack(teacher_entropy)
    per_teacher = torch.zeros(3 * num_teachers, dtype=torch.float64)
    if teacher_index is not None:
        per_teacher = torch.stack([x for t in range(num_teachers) for x in (
            (teacher_index == t).sum().double(), jsd.detach()[teacher_index == t].sum(),
            teacher_entropy[teacher_index == t].sum())])
    return jsd.sum(), jsd.detach().sum(), student_entropy.detach().sum(), teacher_entropy.sum(), per_teacher


def _divergence(q, p, loss, beta, alpha=0.1, head_mass=0.5, *, logs=None, gate=(0.0, 1.0, 0.5, 0.1), labels=None):
    """The soft term between distributions q (student) and p (teacher) over the last dim. logs: (log q,
    log p) where the caller has them (a probability 0 there is −inf exactly: the powers below are taken
    as exp of their logs, whose gradient at 0 is 0, not 0 · inf); labels: each row's class (dkd)."""
    if loss in ("jeffreys", "alpha_divergence", "renyi", "renyi_reverse", "ab_divergence", "triangular",
                "entropy_adaptive", "dkd", "mutual", "co_jeffreys"):
        lq, lp = logs if logs is not None else (torch.log(q), torch.log(p))
        return _power_divergence(q, p, lq, lp, loss, alpha, beta, gate, labels)

    def kl(a, b):  # Σ a log(a / b)
        return (torch.xlogy(a, a) - torch.xlogy(a, b)).sum(-1)

    def kl_masked(a, b):  # the same, with a gradient 0, not NaN (−inf · 0, 0 / 0), where a = 0 (a −inf logit)
        on = a > 0
        return (a * (torch.log(torch.where(on, a, 1.0)) - torch.log(torch.where(on, b, 1.0)))).sum(-1)

    if loss in ("skew_kl", "skew_reverse_kl", "akl"):
        kl = kl_masked
    if loss == "forward_kl" or (loss == "jsd" and beta == 0):
        return kl(p, q)
    if loss == "reverse_kl" or (loss == "jsd" and beta == 1):
        return kl(q, p)
    if loss == "jsd":
        m = beta * p + (1 - beta) * q
        return beta * kl(p, m) + (1 - beta) * kl(q, m)
    if loss == "tvd":
        return 0.5 * (q - p).abs().sum(-1)
    if loss == "skew_kl":  # DistiLLM: KL(p ‖ α p + (1 − α) q)
        return kl(p, alpha * p + (1 - alpha) * q)
    if loss == "skew_reverse_kl":  # DistiLLM: KL(q ‖ (1 − α) p + α q)
        return kl(q, (1 - alpha) * p + alpha * q)
    if loss == "akl":
        # Wu et al.: sort the teacher's probabilities descending (ties by id: a stable sort); the head is
        # where the cumulative sum is at most μ, and the first always; the gaps |p − q| of the detached
        # student weigh the two KLs
        sorted_p, order = p.sort(dim=-1, descending=True, stable=True)
        gap = (sorted_p - q.detach().gather(-1, order)).abs()
        tail = sorted_p.cumsum(-1) > head_mass
        tail[..., 0] = False
        g_head = gap.masked_fill(tail, 0.0).sum(-1)
        g_tail = gap.masked_fill(~tail, 0.0).sum(-1)
        return g_head / (g_head + g_tail) * kl(p, q) + g_tail / (g_head + g_tail) * kl(q, p)
    raise AssertionError(loss)


def _power_divergence(q, p, lq, lp, loss, alpha, beta, gate, labels):
    """The divergences of Jeffreys, Amari, Rényi, Cichocki (αβ), the triangular discrimination, the
    entropy-gated KL blend and DKD, written as their papers do."""

    def kl(a, b, la, lb):  # Σ a log(a / b), 0 where a = 0 (value and gradient)
        on = a > 0
        return (a * torch.where(on, la - torch.where(on, lb, 0.0), 0.0)).sum(-1)

    def power(x, y, lx, ly, a, b):  # Σ x^a y^b: 0^a = 0 for a > 0, inf for a < 0, and x^0 = 1
        zero = ((lx == -math.inf) & (a > 0)) | ((ly == -math.inf) & (b > 0))
        inf = ~zero & (((lx == -math.inf) & (a < 0)) | ((ly == -math.inf) & (b < 0)))
        t = torch.zeros_like(lx)
        for e, lz in ((a, lx), (b, ly)):
            if e != 0:
                t = t + e * torch.where(lz == -math.inf, 0.0, lz)
        return torch.exp(torch.where(zero, -math.inf, torch.where(inf, math.inf, t))).sum(-1)

    if loss in ("jeffreys", "co_jeffreys"):  # co_jeffreys: the same, differentiated on both sides
        return kl(p, q, lp, lq) + kl(q, p, lq, lp)
    if loss == "mutual":  # each side's KL toward the other's detached distribution (Jeffreys' value)
        return kl(p.detach(), q, lp.detach(), lq) + kl(q.detach(), p, lq.detach(), lp)
    if loss == "triangular":
        both = (p + q) > 0
        return torch.where(both, (p - q) ** 2 / torch.where(both, p + q, 1.0), 0.0).sum(-1)
    if loss == "alpha_divergence":  # Amari: (1 − Σ p^(1−α) q^α) / (α (1 − α))
        return (1 - power(p, q, lp, lq, 1 - alpha, alpha)) / (alpha * (1 - alpha))
    if loss in ("renyi", "renyi_reverse"):  # D_α(p‖q), D_α(q‖p)
        a, b, la, lb = (p, q, lp, lq) if loss == "renyi" else (q, p, lq, lp)
        if alpha == 1:
            return kl(a, b, la, lb)
        return torch.log(power(a, b, la, lb, alpha, 1 - alpha)) / (alpha - 1)
    if loss == "ab_divergence":  # Cichocki, Cruces & Amari 2011, the teacher's power α, the student's β
        c = alpha + beta
        return -(power(p, q, lp, lq, alpha, beta) - alpha / c * power(p, q, lp, lq, c, 0)
                 - beta / c * power(p, q, lp, lq, 0, c)) / (alpha * beta)
    if loss == "entropy_adaptive":
        w_min, w_max, center, width = gate
        entropy = -torch.xlogy(p, p).sum(-1)
        n = ((p > 0) | (q > 0)).sum(-1).double()
        h = torch.where(n > 1, entropy / torch.log(torch.clamp(n, min=2)), 0.0)
        w = w_min + (w_max - w_min) * torch.sigmoid((h - center) / width)
        return w * kl(p, q, lp, lq) + (1 - w) * kl(q, p, lq, lp)
    if loss == "dkd":  # Zhao et al.: α TCKD + β NCKD, y the label
        y = torch.where(labels >= 0, labels, 0).long()[:, None]
        # in log space, from the log-softmax: log(1 − p_y) the logsumexp of log p off y
        others = torch.ones_like(p, dtype=torch.bool).scatter(-1, y, False)
        lp_off, lq_off = torch.where(others, lp, -math.inf), torch.where(others, lq, -math.inf)
        rest_p, rest_q = torch.logsumexp(lp_off, -1), torch.logsumexp(lq_off, -1)
        two_lp = torch.stack([lp.gather(-1, y)[:, 0], rest_p], -1)
        two_lq = torch.stack([lq.gather(-1, y)[:, 0], rest_q], -1)
        tckd = kl(two_lp.exp(), two_lq.exp(), two_lp, two_lq)
        lp_hat, lq_hat = lp_off - rest_p[:, None], lq_off - rest_q[:, None]
        nckd = kl(lp_hat.exp(), lq_hat.exp(), lp_hat, lq_hat)
        return alpha * tckd + beta * nckd
    raise AssertionError(loss)


def _reduce(soft, logits_s, labels, ignore_index, reduction, weight_hard_loss, weight_soft_loss, row_weight=None):
    if labels is None:
        valid = torch.ones(soft.shape, dtype=torch.bool)
        hard = torch.zeros_like(soft)
    else:
        y = labels.reshape(-1)
        valid = y != ignore_index
        hard = F.cross_entropy(logits_s, y.long(), ignore_index=ignore_index, reduction="none")
    soft = torch.where(valid, soft, torch.zeros_like(soft))
    if row_weight is not None:
        w = row_weight.reshape(-1).double()
        soft, hard = soft * w, hard * w
    denom = max(int(valid.sum()), 1) if reduction == "mean" else 1
    soft_total = soft.sum() / denom
    hard_total = hard.sum() / denom
    return weight_hard_loss * hard_total + weight_soft_loss * soft_total, soft_total, hard_total
