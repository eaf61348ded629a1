"""The divergence family's rows at 40 digits (mpmath): the papers' formulas and their gradients through
the softmax, where float64 forms would cancel (tests/test_divergence_family.py,
tests/test_triton_divergences.py)."""

import mpmath
import torch


def mp_rows(a, b, loss, params, labels):
    """(loss per row, dL/da per row) at 40 digits of student logits a and teacher logits b (R, V) float64:
    the papers' formulas, and their gradients through q = softmax(a) by the chain rule."""
    mpmath.mp.dps = 40
    values, grads = [], []
    for r in range(a.shape[0]):
        za = [mpmath.mpf(float(x)) for x in a[r]]
        zb = [mpmath.mpf(float(x)) for x in b[r]]
        sa, sb = sum(mpmath.exp(x) for x in za), sum(mpmath.exp(x) for x in zb)
        q, p = [mpmath.exp(x) / sa for x in za], [mpmath.exp(x) / sb for x in zb]
        g = _mp_loss_and_dq(q, p, loss, params, int(labels[r]))
        value, dq = g
        mean = sum(qj * dj for qj, dj in zip(q, dq))  # through the softmax: q ∘ (dL/dq − Σ q dL/dq)
        values.append(float(value))
        grads.append([float(qj * (dj - mean)) for qj, dj in zip(q, dq)])
    return torch.tensor(values, dtype=torch.float64), torch.tensor(grads, dtype=torch.float64)


def _mp_loss_and_dq(q, p, loss, params, y):
    log = mpmath.log
    alpha, beta = mpmath.mpf(params.get("alpha", 0.5)), mpmath.mpf(params.get("beta", 0.5))
    if loss == "jeffreys":
        return (sum((qj - pj) * log(qj / pj) for qj, pj in zip(q, p)),
                [log(qj / pj) + 1 - pj / qj for qj, pj in zip(q, p)])
    if loss == "triangular":
        return (sum((pj - qj) ** 2 / (pj + qj) for qj, pj in zip(q, p)),
                [(qj - pj) * (qj + 3 * pj) / (qj + pj) ** 2 for qj, pj in zip(q, p)])
    if loss == "alpha_divergence":
        s = sum(pj ** (1 - alpha) * qj ** alpha for qj, pj in zip(q, p))
        return (1 - s) / (alpha * (1 - alpha)), [-(pj / qj) ** (1 - alpha) / (1 - alpha) for qj, pj in zip(q, p)]
    if loss == "renyi":
        s = sum(pj ** alpha * qj ** (1 - alpha) for qj, pj in zip(q, p))
        return log(s) / (alpha - 1), [-(pj / qj) ** alpha / s for qj, pj in zip(q, p)]
    if loss == "renyi_reverse":
        s = sum(qj ** alpha * pj ** (1 - alpha) for qj, pj in zip(q, p))
        return log(s) / (alpha - 1), [alpha * (qj / pj) ** (alpha - 1) / ((alpha - 1) * s) for qj, pj in zip(q, p)]
    if loss == "ab_divergence":
        c = alpha + beta
        value = -sum(pj ** alpha * qj ** beta - alpha / c * pj ** c - beta / c * qj ** c for qj, pj in zip(q, p))
        return value / (alpha * beta), [(qj ** (c - 1) - pj ** alpha * qj ** (beta - 1)) / alpha for qj, pj in zip(q, p)]
    if loss == "entropy_adaptive":  # orda-kernel's blend: w KL(p‖q) + (1 − w) KL(q‖p), w the teacher's (a constant)
        lo, hi = mpmath.mpf(params.get("gate_min", 0.0)), mpmath.mpf(params.get("gate_max", 1.0))
        center, width = mpmath.mpf(params.get("gate_center", 0.5)), mpmath.mpf(params.get("gate_width", 0.1))
        def kl(a, b):  # 0 log 0 = 0; +inf where b = 0 < a
            return sum(0 if aj == 0 else mpmath.inf if bj == 0 else aj * log(aj / bj) for aj, bj in zip(a, b))

        h = -sum(pj * log(pj) for pj in p if pj > 0) / log(len(p)) if len(p) > 1 else 0
        w = lo + (hi - lo) / (1 + mpmath.exp(-(h - center) / width))
        value = (w * kl(p, q) if w > 0 else 0) + ((1 - w) * kl(q, p) if w < 1 else 0)
        return value, [-w * pj / qj + (1 - w) * (log(qj / pj) + 1 if pj > 0 else mpmath.inf) for qj, pj in zip(q, p)]
    if loss == "dkd":
        py, qy = p[y], q[y]
        tckd = (py * log(py / qy) if py > 0 else 0) + (1 - py) * log((1 - py) / (1 - qy))  # 0 log 0 = 0
        nckd = sum(pj / (1 - py) * log((pj / (1 - py)) / (qj / (1 - qy))) for j, (qj, pj) in enumerate(zip(q, p))
                   if j != y and pj > 0)
        # d/dq_j of α TCKD + β NCKD, as a function of q whose components are free (the softmax's chain adds the rest)
        dq = [alpha * (-py / qy + (1 - py) / (1 - qy)) if j == y else beta * (-pj / (1 - py) / qj)
              for j, (qj, pj) in enumerate(zip(q, p))]
        # NCKD's q̂ = q / (1 − q_y): its term Σ p̂ log(1 − q_y) = log(1 − q_y), whose derivative in q_y is −1 / (1 − q_y)
        dq[y] -= beta / (1 - qy)
        return alpha * tckd + beta * nckd, dq
    raise AssertionError(loss)
