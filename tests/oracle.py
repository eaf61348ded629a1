"""The test oracle: the naive formula over the full logits in float64, written from the definitions.

Deliberately shares no code with flashkd: probabilities are formed explicitly, KL terms with
torch.xlogy, the CE with F.cross_entropy, cosine with F.cosine_similarity.
"""

import torch
import torch.nn.functional as F


def distill_loss(
    xs, ws, xt, wt, labels=None, *, loss="jsd", beta=0.5, temperature=1.0, weight_hard_loss=0.5,
    weight_soft_loss=0.5, ignore_index=-100, student_bias=None, teacher_bias=None, reduction="mean",
    temperature_squared=False, plain=False,
):
    """float64 loss, differentiable w.r.t. xs, ws and student_bias; also returns (soft, hard).

    plain=True is instead what a user would write in plain torch: GEMMs in the input dtype, the loss
    math in fp32 — the baseline whose error the fused op must match.
    """
    v = ws.shape[0]
    up = (lambda x: x) if plain else (lambda x: x.double())
    logits_s = up(xs) @ up(ws).T
    logits_t = up(xt) @ up(wt)[:v].T
    if student_bias is not None:
        logits_s = logits_s + up(student_bias)
    if teacher_bias is not None:
        logits_t = logits_t + up(teacher_bias)[:v]
    if plain:
        logits_s, logits_t = logits_s.float(), logits_t.float()
    logits_s = logits_s.reshape(-1, v)
    logits_t = logits_t.reshape(-1, v)
    q = torch.softmax(logits_s / temperature, -1)
    p = torch.softmax(logits_t / temperature, -1)

    def kl(a, b):  # Σ a log(a / b)
        return (torch.xlogy(a, a) - torch.xlogy(a, b)).sum(-1)

    if loss == "forward_kl" or (loss == "jsd" and beta == 0):
        soft = kl(p, q)
    elif loss == "reverse_kl" or (loss == "jsd" and beta == 1):
        soft = kl(q, p)
    elif loss == "jsd":
        m = beta * p + (1 - beta) * q
        soft = beta * kl(p, m) + (1 - beta) * kl(q, m)
    elif loss == "tvd":
        soft = 0.5 * (q - p).abs().sum(-1)
    elif loss == "cosine":
        soft = beta * (1 - F.cosine_similarity(logits_s, logits_t, dim=-1))
    else:
        raise AssertionError(loss)
    if temperature_squared:
        soft = soft * temperature**2

    if labels is None:
        valid = torch.ones(soft.shape, dtype=torch.bool)
        hard = torch.zeros_like(soft)
    else:
        y = labels.reshape(-1)
        valid = y != ignore_index
        hard = F.cross_entropy(logits_s, y.long(), ignore_index=ignore_index, reduction="none")
    soft = torch.where(valid, soft, torch.zeros_like(soft))
    denom = max(int(valid.sum()), 1) if reduction == "mean" else 1
    soft_total = soft.sum() / denom
    hard_total = hard.sum() / denom
    return weight_hard_loss * hard_total + weight_soft_loss * soft_total, soft_total, hard_total
