"""The Triton row backend: per-row distillation losses and dL/ds in one kernel, one program per row.

Contract: `flashkd.backends` — `rows(s, t, labels, spec, scale, grad) -> (soft, hard)`, with the results
of `flashkd.backends.torch_rows.rows` (autograd of `flashkd.losses.row_losses`). The loss and gradient
formulas are the table in `flashkd.losses`; this kernel writes the analytic gradients of that table.

One program owns one row of s, t: (R, V) and walks it in BLOCK_V tiles:

    pass 1  read s (, t)    online max / sum-exp of s/τ and t/τ, per lane -> (m_s, l_s), (m_t, l_t)
                            ... of s at τ = 1 when the CE is computed     -> (m_s, l_c)
                            Σ s², Σ t², Σ s·t for cosine                  -> ‖s‖, ‖t‖, cos
                            a KL online, on the same rescalings: reverse_kl always, forward_kl
                            without grad -> soft (KL(q‖p) = E_q[(s − max s) − (t − max t)]/τ
                            + log(l_t / l_s), the gaps moved with both running maxima: `lane_kl`)
            (merged across lanes once, after the loop: no barrier inside it)
    pass 2  read s (, t)    backwards over the row (the tiles pass 1 read last are likeliest in L2):
                            per-element loss terms -> soft, and the row scalars the gradient needs
                            (K = Σ q log(q/M); for tvd the masses of q below, above and at p, which
                            give σ − Σ q σ with no cancellation; the skew losses' Σ p u, Σ q (1 − u)
                            below); dL/ds written over s here for forward_kl, reverse_kl, cosine and
                            CE-only
    pass 3  read s, t       dL/ds written over s for jsd, tvd, skew_kl, skew_reverse_kl and the divergences
                            below (grad only)

Rows whose label is `ignore_index` skip all three passes; with grad they get one pass writing zeros.

The skew losses are JSD's pieces, on its mixture (`_mixture`): skew KL = KL(p‖M) at β = α, skew reverse
KL = KL(q‖M) at β = 1 − α (M′), each its one term of the JSD's loss. Their gradients (the table in
`flashkd.losses`) share u = 2^−(w + max(z, 0)) in [0, 1], which is (1 − α) q/M for skew KL and α q/M′ for
skew reverse KL, both finite whatever side is 0:
    skew KL           dL/da = (q S − p u) / τ,                                         S = Σ p u
    skew reverse KL   dL/da = q (log(q/M′) − K + (1 − u) − Σ q (1 − u)) / τ,           K = Σ q log(q/M′)
(the table's g − Σ q g with Σ q = 1; 1 − u rather than u, so that at α = 1, where u = 1, it is 0 exactly).
Pass 2 sums S (or K and Σ q (1 − u)) beside the loss, pass 3 writes dL/ds: one exp2 an element more than
JSD's passes in each. α = 0 resolves to the KL each is there (`kernel_kind`); at α = 1 the formula's log2 0
is −2^100 (`_log2_1m`) and the loss and its gradient come out 0.

Jeffreys, the triangular discrimination, Amari's α-, Rényi's (renyi, renyi_reverse) and the αβ-divergence take
JSD's three passes: pass 2 sums the terms of `flashkd.losses.divergence` in its forms without cancellation
and one row scalar, pass 3 writes the formula table's dL/da. Every element's δ = log2 q − log2 p is taken from
the logits' difference, (a − b)·log2(e)/τ − row constant (`_log2_ratio`), exact where a ≈ b, rather than as
the difference of the two rounded logs; differences of probabilities as the larger side times −expm1(−|·|)
(`_gap`: q − p, q − e, h = q^c − p^α q^β, q − e/S); the power family's terms as `flashkd.losses.power_terms`,
the α-family's generator ψ in its Taylor form for |y| ≤ ⅛ and its exact forms beyond (`_psi`, its form per
power a constexpr, `_psi_mode`). Pass 2 sums, and pass 3 writes:
    jeffreys          Σ (q − p) δ ln 2,  K = Σ q δ          c ((q − p) + q ln 2 (δ − K))
    triangular        Σ (q − p)² / (q + p),  G = Σ q g      c q (g − G),  g = (q − p)(q + 3p) / (q + p)²
    alpha_divergence  A = Σ p ψ-terms (the loss)            c ((q − e) / (1 − α) − q α A),  e = p^(1−α) q^α
    ab_divergence     Σ terms,  H = Σ h                     c (h − q H) / α
    renyi(_reverse)   S = Σ p^r q^(1−r) (q^r p^(1−r)), A    c (q − e/S);  c r/(r − 1) (e/S − q)  (r = 1: c q ln 2 (δ − D))
    entropy_adaptive  KL(p‖q), K = KL(q‖p), −Σ p log2 p, n  c (w (q − p) + (1 − w) q (δ ln 2 − K))
with c = scale · soft_scale / τ; the entropy gate w = gate_min + (gate_max − gate_min) sigmoid((h − center) /
width), h = −Σ p log2 p / log2 n over the n ids with mass on either side, is the row's, between passes 2 and 3.
Rényi's loss is r A log1p(z)/z, z = r (r − 1) A, on rows with |log S| ≤ ¼, else log S / (r − 1) (`flashkd.losses.renyi`); its log S is the gradient's. r − 1 and 1 − γ are the host's 1 − r
and γ' (`_powers`), not rounded from r in fp32. Their rows are exact to fp32 where p ≈ q, but for the αβ of
α + β ≠ 1, which moves at first order with the normalisers' fp32 rounding; dL/ds carries that rounding times
q (or q^c), as every fp32 softmax gradient does.

Heads' transforms (`flashkd.losses.logit_transform`, z = c · tanh(σ s / c), or σ s): the kernel works on
z / fold, where fold > 0 is folded into the row's constants (log2(e)·fold/τ for each side's softmax,
log2(e)·fold for the CE's, fold in the CE value, the online KL's ratio fold_t/fold_s, the
cosine norms). Without a softcap and with σ > 0, fold is σ and nothing is made at load; the constexpr SCALED
brings the folded constants into the loops only when a fold is not 1, so the path without a transform
compiles to the same loops as before. A negative σ (whose max is s's min) makes z = σ s at every load
(fold 1), a softcap tanh(σ s / c) (fold c: the cap costs no multiply an element) (`head`: the
constexpr S_HEAD / T_HEAD, keyed on the sign and on None, never a float); σ = dz/ds is in the
gradient's weights, and a softcap multiplies dL/dz by 1 − tanh² where dL/ds is written. tanh is
±(1 − t)/(1 + t), t = e^(−2|y|) (`softcap_tanh`: odd, exactly ±1 when saturated, an absolute error of ~2^-23
at most), with 1 − tanh² = 4t/(1 + t)², so saturated logits (|s| ≫ c) keep finite,
accurate gradients. A softcap costs its tanh per element and pass on each capped side: an exp2 on the
SFU and a reciprocal, on the SFU or the FMA pipe by a constexpr mask (SOFTCAP_RCP_FMA: by the compiled
instruction counts the SFU binds the capped JSD passes); the first version, both on the SFU with the
cap and sign applied at each load, took 1.23× the floor at the JSD seed with softcap 30 on both heads,
against 1.18× without (BENCHMARKS.md).
With `stats` (constexpr STATS) pass 1 also sums the gaps below the running max under q (`lane_gap`),
for the entropy of q: no extra pass.

Bytes moved per element, b = bytes of the input dtype (2 for bf16), grad / no grad:

    forward_kl, reverse_kl,   2 reads of s, t + 1 write   5b / 2b (no grad: pass 1 only)
    cosine
    jsd, tvd, skew_kl,        3 reads of s, t + 1 write   7b / 4b
    skew_reverse_kl, jeffreys,
    triangular, the power
    divergences
    CE only (no soft term)    2 reads of s + 1 write      3b / 1b

The CE adds no traffic to a soft loss: it rides on the reads of s. Transcendentals per element (exp2
unless named; one more exp2 in the pass that writes dL/ds when the CE gradient is in it):

    pass 1   1 per softmax: 2 for a soft loss, +1 with the CE unless τ = 1 (then softmax(s) is q); cosine 0
    pass 2   forward_kl 2, reverse_kl 1 (grad only), jsd 3 + log2, tvd 2, cosine 0,
             skew_kl 4 + log2, skew_reverse_kl 3 + log2
    pass 3   jsd 2 + log2, tvd 1, skew_kl 3 + log2, skew_reverse_kl 3 + log2
    (log2 is the hardware lg2.approx on GPU)

Measured on an H200 (benchmarks/bench_rows.py, 8192 × 128256 bf16, BENCHMARKS.md): JSD with CE and grad
3.7 ms (its 7 bytes an element at copy speed: 3.46 ms), forward KL 2.5 ms, reverse KL 2.6 ms (3.5 in
three passes), without grad forward and reverse KL 1.4 ms (2.0 in two); first version (4096 × 16 tiles,
a block-wide reduction per tile in pass 1) 7.6 and 4.3 ms. Its passes are
bound by their bytes and their instruction issue about equally (JSD's passes: 25–30 sm_90 instructions
an element): fewer instructions, not fewer transcendentals, make it faster.

Numerics: every load is widened to fp32 and all math is fp32 whatever the input dtype (fp64 inputs
included: they are computed in fp32, the losses come back in fp32 and dL/ds is rounded to fp64; the
public functions send fp64 to the torch rows instead, `flashkd.core.backend.pick_backend`);
dL/ds is rounded once, to the input dtype, at the store. The softmaxes run on exp2/log2 in units of
log2: log2 q = (s − m_s)·log2(e)/τ − log2 l_s, one multiply by a constant prepared on the host, with
the row max subtracted first so that the large elements, which carry the losses, have small exponents
and small rounding errors. log q and log p are always taken this way, never as the log of a
probability, so a probability that underflows to 0 keeps a finite log; every w·log(...) product is
taken as 0 where w is 0 (0·log 0 = 0, which also makes columns at −inf in both s and t count as absent):
by a guard in the KLs and TVD, which keep an infinite divergence infinite, and in the JSD, which is
bounded, by logs that are finite wherever a probability is 0 (`_mixture`).
"""

from __future__ import annotations

import math
import types

import torch
import triton
import triton.language as tl

from ..losses import COSINE_EPS, LEARNING_LOSSES, LOSS_ID, LossSpec
from .triton_common import (FAST_LOG2, INTERPRET, LN2, LOG2E, M_START, head, head_grad, head_mode, lane_gap, lane_kl,
                            lane_sum, launching, log1p, order_key, rtne_bits, store_grad, times)

# Compiled tiles, measured on an H200 at V = 128256 bf16 (BENCHMARKS.md): 1024 columns over 8 warps
# (4 elements per thread per tensor, 32 registers, 8 programs an SM). At the chunk loop's 1024–4096
# rows a block is a few waves of programs, and the last, partial one runs with the GPU part idle:
# against 512 × 4 tiles (13 programs an SM: 2048 rows are 1.2 waves) JSD takes 5 % less at 2048 rows,
# 14 % less at 1024, the same at 8192; 4096 × 16 tiles took 6.9 ms against 4.0 at 8192 rows. A
# persistent grid bounding the rows in flight, for L2 reuse between passes, was slower at every size
# tried, and so were rows split across programs meeting at barriers. Loads are 16 bytes wide only
# when V is a multiple of 16 (rows then start aligned). Under TRITON_INTERPRET=1 every tile op is a
# numpy call on the CPU: small tiles keep the tests fast and make their small V span several tiles
# with a ragged last one.
BLOCK_V = 256 if INTERPRET else 1024
NUM_WARPS = 8
# Registers a thread may use: at 32, 8 programs of 8 warps fill an SM's 64 K registers; at the 36–37
# the compiler picks for TVD, and for forward KL and cosine with the CE, only 6 fit (those kernels took
# 4–6 % longer; TVD's 4 bytes of spill cost less than the 2 programs).
MAX_REGS = 32

_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


_LABEL_DTYPES = (torch.int32, torch.int64)
_SCALE_DTYPES = (torch.float32, torch.float64)  # read as fp32 either way
# their gradient needs a row scalar that pass 2 computes
_LATE_GRAD = ("jsd", "tvd", "skew_kl", "skew_reverse_kl", "jeffreys", "triangular", "alpha_divergence", "ab_divergence", "renyi",
              "renyi_reverse", "entropy_adaptive", "akl")
# the power family: their terms are the α-family's generator ψ (`_power_term`) of p and q at powers pow_p, pow_q
_POWER_LOSSES = ("alpha_divergence", "ab_divergence", "renyi", "renyi_reverse")

_FORWARD_KL: tl.constexpr = tl.constexpr(LOSS_ID["forward_kl"])
_REVERSE_KL: tl.constexpr = tl.constexpr(LOSS_ID["reverse_kl"])
_JSD: tl.constexpr = tl.constexpr(LOSS_ID["jsd"])
_TVD: tl.constexpr = tl.constexpr(LOSS_ID["tvd"])
_COSINE: tl.constexpr = tl.constexpr(LOSS_ID["cosine"])
_SKEW_KL: tl.constexpr = tl.constexpr(LOSS_ID["skew_kl"])
_SKEW_REVERSE_KL: tl.constexpr = tl.constexpr(LOSS_ID["skew_reverse_kl"])
_JEFFREYS: tl.constexpr = tl.constexpr(LOSS_ID["jeffreys"])
_TRIANGULAR: tl.constexpr = tl.constexpr(LOSS_ID["triangular"])
_ALPHA_DIV: tl.constexpr = tl.constexpr(LOSS_ID["alpha_divergence"])
_AB_DIV: tl.constexpr = tl.constexpr(LOSS_ID["ab_divergence"])
_RENYI: tl.constexpr = tl.constexpr(LOSS_ID["renyi"])
_RENYI_REVERSE: tl.constexpr = tl.constexpr(LOSS_ID["renyi_reverse"])
_ENTROPY_ADAPTIVE: tl.constexpr = tl.constexpr(LOSS_ID["entropy_adaptive"])
_DKD: tl.constexpr = tl.constexpr(LOSS_ID["dkd"])
_AKL: tl.constexpr = tl.constexpr(LOSS_ID["akl"])
_NORM_EPS: tl.constexpr = tl.constexpr(COSINE_EPS)
_LOG2_MIN: tl.constexpr = tl.constexpr(-(2.0**100))  # see _mixture
# A sharded row's part (PHASE 1): m_s, l_s, l_c, m_t, l_t, r_kl, Σs², Σt², Σst, r_ent over this rank's
# slice at its own maxima, the CE's logit z_y (0 where the label's column is another rank's) and a 1
# where it is this rank's
_PARTS: tl.constexpr = tl.constexpr(12)


# ---------------------------------------------------------------------------------------------- helpers


# The softcap's tanh (`softcap_tanh`) takes one exp2 and one reciprocal an element and pass: two MUFU (SFU)
# instructions by default, on a pipe with 1/8 of the FMA pipe's throughput on sm_90 (16 against 128
# results a clock and SM, so a MUFU instruction costs a warp scheduler 8 cycles to the others' 1).
# With a softcap on both heads the JSD kernel (CE and grad, bf16, compiled for sm_90) issues 153,
# 167, 192 instructions per 4 elements a thread in its three passes, 24, 32, 28 of them MUFU:
# 192 + 256 + 224 cycles of SFU against 512 of issue, where the kernel without a transform issues
# 93 + 107 + 116 with 8, 16, 12 MUFU. `softcap_tanh` can take its reciprocal (RCP_FMA) on the FMA pipe
# instead: +6 instructions for one MUFU fewer. Which loads do is a constexpr bit mask of `_rows_kernel`,
# bit 2·(pass − 1) + side (side 0: s, 1: t), set by the launcher per loss from this table (on the sides
# with a softcap; 0 where a loss is not in it). The entries balance issue against the SFU pass by pass on those counts, max(issued,
# 8 · MUFU): for JSD the teacher's reciprocal in pass 1 (178), both in pass 2 (216), the teacher's in
# pass 3 (220), 614 cycles against 672 with both on the SFU (and 679 for the tanh before this one,
# 337 without a transform; without grad 394 against 448); for TVD one side's in passes 1 and 2 (536
# against 552); the KLs, with fewer MUFU a pass, come out no faster (forward KL 397 against 384 with
# TVD's mask); an exp2 on the FMA pipe (a degree-5 polynomial, +10 instructions for 8 SFU cycles) paid
# nowhere. The variants were timed by a benchmark kept in the history, `git show ea784f5:benchmarks/bench_softcap.py`
# (BENCHMARKS.md, "The tanh's variants"); the tests hold every mask to the same results (test_softcap_tanh.py).
SOFTCAP_RCP_FMA = types.MappingProxyType({"jsd": 0b101110, "tvd": 0b000110})

@triton.jit
def _minus(x, y, ratio, SCALED: tl.constexpr):
    """x − y·ratio (one FMA), or x − y when no scale is folded."""
    if SCALED:
        return x - y * ratio
    return x - y


@triton.jit
def _log2_1p(x):
    """log2(1 + x) for x in [0, 1], accurate for small x too: log2 of u = 1 + x, corrected by the
    rounding error of u, which (u − 1) − x gives exactly."""
    u = 1.0 + x
    if FAST_LOG2:
        # lg2.approx's own error (~2^-22 absolute) exceeds the correction below: one instruction
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [u], dtype=tl.float32,
                                         is_pure=True, pack=1)
    return tl.log2(u) - ((u - 1.0) - x) / u * LOG2E


@triton.jit
def _mixture(lq, lp, log2_beta, log2_1mbeta):
    """(z, w) with which log2 q/M = −(log2(1 − β) + w) − max(z, 0) and log2 p/M = min(z, 0) − (log2 β + w),
    M = β p + (1 − β) q: a log-add-exp of the logs alone, z = log2(β p / ((1 − β) q)),
    w = log2(1 + 2^−|z|), so log2 M = log2((1 − β) q) + w + max(z, 0). No probability is formed, so
    nothing underflows, and log(q/M), which the JSD gradient compares with its mean K, carries one
    rounding where q is the larger side instead of one per exp, sum and log. log2 q and log2 p are
    raised to −2^100 first, where the probability is 0 anyway: z and w, and so both logs, are then
    finite wherever q or p is 0 (a column at −inf in s, t or both), so that the JSD's sums can take
    them times q and p with no guard for 0 · log 0."""
    z = (tl.maximum(lp, _LOG2_MIN) - tl.maximum(lq, _LOG2_MIN)) + (log2_beta - log2_1mbeta)
    return z, _log2_1p(tl.exp2(tl.abs(z) * -1.0))  # −|z| as a negated operand, not 0 − |z|


@triton.jit
def _expm1(x):
    """e^x − 1 for x ≤ 1 (−inf gives −1), to a few fp32 roundings of the result: its Taylor series to x^8
    where |x| < ½ (the first term left out, x^9/9!, is below 1e-8 of the sum there), else e^x − 1,
    which loses no more than 2 bits there."""
    small = tl.abs(x) < 0.5
    xs = tl.where(small, x, 0.0)
    poly = xs * (1.0 + xs * (0.5 + xs * (1.0 / 6.0 + xs * (1.0 / 24.0 + xs * (1.0 / 120.0 + xs * (
        1.0 / 720.0 + xs * (1.0 / 5040.0 + xs * (1.0 / 40320.0))))))))
    return tl.where(small, poly, tl.exp2(x * LOG2E) - 1.0)


@triton.jit
def _gap(lx, ly, d):
    """2^lx − 2^ly from the two logs (log2; −inf: 0) and their difference d = lx − ly, which the caller
    takes where it is accurate (from the logits, not from lx and ly rounded): the larger side times
    −expm1(−|d| ln 2), exact where the two are close (no difference of near numbers) and bounded where
    they are far apart. NaN where both are −inf (d NaN): callers mask those columns."""
    e = _expm1(tl.abs(d) * -LN2)  # ≤ 0
    big = tl.exp2(tl.where(d >= 0.0, lx, ly))  # one exp2 of the larger side, not both taken and one kept
    return tl.where(d >= 0.0, -big * e, big * e)


@triton.jit
def _row_gap(m_s, m_t, log2_l_s, log2_l_t, k):
    """The row's part of log2 q − log2 p that is not (a − b)·k (`_log2_ratio`)."""
    return (m_s - m_t) * k + (log2_l_s - log2_l_t)


@triton.jit
def _log2_ratio(a, b, lq, lp, row_gap, k, SCALED: tl.constexpr):
    """log2 q − log2 p of a tile: without a fold (one constant k = log2(e)/τ for both sides) as (a − b)·k −
    row_gap, row_gap = (m_s − m_t)·k + log2 l_s − log2 l_t (`_row_gap`), exact where a ≈ b (their difference
    is), rather than the difference of log2 q and log2 p, each rounded to a few ulp of its own size; with a
    fold, lq − lp. ±inf where one side is −inf, NaN where both are (as lq − lp)."""
    if SCALED:
        return lq - lp
    return (a - b) * k - row_gap


_PSI_TERMS: tl.constexpr = tl.constexpr(9)  # ψ's Taylor series to y^9 for −⅛ ≤ y ≤ 0 (below 1e-9 of it, |β| ≤ 2)


@triton.jit
def _psi(lb, y, beta, MODE: tl.constexpr):
    """b · ψ(β, y), b = 2^lb, y ≤ 0 (natural units, −inf allowed): the α-family's generator
    ψ(β, y) = (expm1(β y) − β expm1(y)) / (β (β − 1)) ≥ 0 of `flashkd.losses._PowerTerm`, in its forms:
    for −⅛ ≤ y the Taylor series Σ_(n ≥ 2) c_n y^n / n!, c_n = 1 + β c_(n−1), c_2 = 1; else, by MODE (β's
    range, a constexpr from the host: `_psi_mode`), 0: β = 0, expm1(y) − y; 1: β < 0 and 2: 0 < β < ½,
    (expm1(y) − expm1(β y)/β) / (1 − β) (for β < 0 the product b · expm1(β y), β y ≥ 0, taken as
    2^(lb + β y log2 e) − b where e^(β y) could overflow); 3: ½ < β < 1, 4: β = 1, 5: β > 1,
    (ψ' − expm1(y)) / β with b ψ' = b (e^(β y) − e^y)/(β − 1) a product of exact factors; 6: β = ½, 2 h²,
    h = expm1(y / 2) (expm1(y) = h (h + 2): the difference cancels in closed form, b ψ = 2 (√b − √b')², no
    series and one expm1 — Hellinger's and Bhattacharyya's order). 0 where b is."""
    b = tl.exp2(lb)
    if MODE == 6:
        h = _expm1(y * 0.5)
        return tl.where(lb == -float("inf"), 0.0, 2.0 * b * (h * h))
    small = y >= -0.125
    ys = tl.where(small, y, 0.0)
    term = ys * ys * 0.5
    series = term
    cn = 1.0
    for n in tl.static_range(3, _PSI_TERMS + 1):
        cn = 1.0 + beta * cn
        term = term * ys * (1.0 / n)
        series += cn * term
    yl = tl.where(small, -1.0, y)
    if MODE == 0:
        exact = b * _expm1(yl) - b * yl
    elif MODE == 1:
        z = beta * yl  # ≥ 0
        b_e = tl.where(z <= 1.0, b * _expm1(tl.minimum(z, 1.0)), tl.exp2(lb + z * LOG2E) - b)
        exact = (b * _expm1(yl) - b_e / beta) / (1.0 - beta)
    elif MODE == 2:
        exact = (b * _expm1(yl) - b * _expm1(beta * yl) / beta) / (1.0 - beta)
    else:
        if MODE == 3:
            slope = tl.exp2(lb + beta * yl * LOG2E) * _expm1((1.0 - beta) * yl) / (1.0 - beta)
        elif MODE == 4:
            yc = tl.maximum(yl, -2000.0)  # e^y · y: 0 below, where −inf would give 0 · inf
            slope = tl.exp2(lb + yc * LOG2E) * yc
        else:
            slope = tl.exp2(lb + yl * LOG2E) * _expm1((beta - 1.0) * yl) / (beta - 1.0)
        exact = (slope - b * _expm1(yl)) / beta
    return tl.where(lb == -float("inf"), 0.0, tl.where(small, b * series, exact))


@triton.jit
def _kl_pair(lp, lq, u):
    """(F, R, |q − p|, p) elementwise from log2 p, log2 q and u = log2 q − log2 p (`_log2_ratio`): KL(p‖q)'s and
    KL(q‖p)'s terms F = p log(p/q) − p + q and R = q log(q/p) − q + p ≥ 0 (`flashkd.losses._kl_terms`;
    `_power_term` at powers (1, 0) and (0, 1)), the gap and p, all from one e = 2^−|u| and one power B of the larger
    side. With y = −|u| ln 2, the larger side's term is B φ0(y), φ0(y) = e^y − 1 − y (ψ at β = 0), the smaller's
    B φ1(y), φ1(y) = y e^y − e^y + 1 (β = 1): F = B φ0, R = B φ1 where q ≤ p, swapped where q > p; |q − p| =
    −B expm1(y), expm1(y) = y + φ0(y). Where |y| < 1, where the closed forms cancel, φ0 and φ1 are their
    series (to y^12, y^13); beyond, the closed forms (within ~3 roundings of 1 there). +inf where the formula
    is (F where q = 0 < p), 0 where both sides are."""
    y = tl.abs(u) * -LN2
    small = y > -1.0
    ys = tl.where(small, y, 0.0)
    s0 = 1.0 / 2.0 + ys * (1.0 / 6.0 + ys * (1.0 / 24.0 + ys * (1.0 / 120.0 + ys * (1.0 / 720.0 + ys * (
        1.0 / 5040.0 + ys * (1.0 / 40320.0 + ys * (1.0 / 362880.0 + ys * (1.0 / 3628800.0 + ys * (
            1.0 / 39916800.0 + ys * (1.0 / 479001600.0))))))))))
    s1 = 1.0 / 2.0 + ys * (2.0 / 6.0 + ys * (3.0 / 24.0 + ys * (4.0 / 120.0 + ys * (5.0 / 720.0 + ys * (
        6.0 / 5040.0 + ys * (7.0 / 40320.0 + ys * (8.0 / 362880.0 + ys * (9.0 / 3628800.0 + ys * (
            10.0 / 39916800.0 + ys * (11.0 / 479001600.0 + ys * (12.0 / 6227020800.0)))))))))))
    e = tl.exp2(-tl.abs(u))  # e^y, its exponent exact; 0 at y = −inf
    phi0 = tl.where(small, ys * ys * s0, e - 1.0 - y)  # +inf at y = −inf
    phi1 = tl.where(small, ys * ys * s1, 1.0 + e * (tl.maximum(y, -2000.0) - 1.0))  # 1 there: no 0 · inf
    drop = tl.where(small, -(ys + ys * ys * s0), 1.0 - e)  # −expm1(y) ∈ [0, 1]
    low = u <= 0.0
    big = tl.exp2(tl.maximum(lp, lq))
    present = (lp > -float("inf")) | (lq > -float("inf"))
    return (tl.where(present, big * tl.where(low, phi0, phi1), 0.0),
            tl.where(present, big * tl.where(low, phi1, phi0), 0.0),
            tl.where(present, big * drop, 0.0),
            tl.where(low, big, big * e))


@triton.jit
def _power_term(lp, lq, u, pow_p, pow_q, PSI: tl.constexpr):
    """`flashkd.losses.power_terms` of p and q at powers pow_p, pow_q, elementwise from log2 p and log2 q:
    −(p^a q^b − (a/c) p^c − (b/c) q^c) / (a b) ≥ 0, c = a + b, taken relative to the larger side,
    p^c ψ(γ, c δ) / c² where q ≤ p, q^c ψ(1 − γ, −c δ) / c² where q > p, δ = log(q/p), γ = b / c (PSI:
    ψ's MODE for γ + 8 × its MODE for 1 − γ), u = log2 q − log2 p (`_log2_ratio`). 0 where both sides are 0."""
    c = pow_p + pow_q
    y = tl.abs(u) * (-LN2 * c)
    if PSI % 8 == PSI // 8:  # γ and 1 − γ take the same form (Amari's α = ½, Rényi's r = ½): ψ once, its side's
        lower = u <= 0.0
        term = _psi(tl.where(lower, lp, lq) * c, y, tl.where(lower, pow_q, pow_p) / c, PSI % 8)
    else:
        lo = _psi(lp * c, y, pow_q / c, PSI % 8)
        hi = _psi(lq * c, y, pow_p / c, PSI // 8)  # 1 − γ, not rounded from γ (Rényi near r = 1: 1 − r is small)
        term = tl.where(u <= 0.0, lo, hi)
    present = (lp > -float("inf")) | (lq > -float("inf"))
    return tl.where(present, term, 0.0) / (c * c)


@triton.jit
def _softmax(a, m_s, log2_l_c, k_c, q, CE_IS_Q: tl.constexpr):
    """softmax(s) of a tile for the CE gradient: q itself when τ = 1, else from the CE's statistics."""
    if CE_IS_Q:
        return q
    return tl.exp2((a - m_s) * k_c - log2_l_c)


@triton.jit
def _store_dlds(g_row, offs, mask, g, a, da, q, label, m_s, log2_l_c, log2e_ce, c_ce,
                GRAD_SOFT: tl.constexpr, GRAD_CE: tl.constexpr, CE_IS_Q: tl.constexpr, S_HEAD: tl.constexpr,
                RTNE_BITS: tl.constexpr, IN_PLACE: tl.constexpr):
    """A tile's dL/ds out, by the pass that writes it (2 or 3): the soft part g plus the CE's,
    c_ce · (softmax(s) − onehot(label)), whose softmax(s) term is already in g where it is q (`fold_q`: its
    factor is in the pass's), then through the head's transform (a softcap's 1 − tanh², `head_grad`)."""
    fold_q = GRAD_SOFT and GRAD_CE and CE_IS_Q
    if fold_q:
        g -= tl.where(offs == label, c_ce, 0.0)
    elif GRAD_CE:
        g += c_ce * (_softmax(a, m_s, log2_l_c, log2e_ce, q, CE_IS_Q) - tl.where(offs == label, 1.0, 0.0))
    g = head_grad(g, da, S_HEAD)
    if IN_PLACE:  # `grad_view`: no store before every warp has loaded this tile (`grad_view`'s doc)
        tl.debug_barrier()
    store_grad(g_row + offs, g, mask, RTNE_BITS)


@triton.jit
def _learning_factors(f0, c_q, c_st, t_ratio, soft, k_jsd, PULL: tl.constexpr):
    """mutual's and co_jeffreys' factors (run as Jeffreys): the student's f0 (mutual: forward KL's pull toward p̄,
    c (q − p), and the CE's q part), and a learning teacher's (ft1, ft_lo, ft0): c_t = c_st σ_t / σ_s, and
    co_jeffreys' KL(p‖q) = J − KL(q‖p) from pass 2's J (soft, nats) and K (log2 units)."""
    if PULL:
        f0 = c_q
    ft1 = c_st * t_ratio
    return f0, ft1, ft1 * LN2, -ft1 * (soft - LN2 * k_jsd)


@triton.jit
def _teacher_tile(t_row, tb_ptr, offs, mask, T_BIAS: tl.constexpr):
    """A tile of the teacher's logits in fp32, its head's bias added where T_BIAS (the GEMM's z = x·w + b, made
    here at load rather than in a pass of its own over the logits; −inf for an id the head rules out)."""
    b = tl.load(t_row + offs, mask=mask, other=-float("inf")).to(tl.float32)
    if T_BIAS:
        b += tl.load(tb_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return b


@triton.jit
def _fill_zeros(ptr, V, BLOCK_V: tl.constexpr):
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        tl.store(ptr + offs, tl.zeros([BLOCK_V], tl.float32).to(ptr.dtype.element_ty), mask=offs < V)


# ----------------------------------------------------------------------------------------------- kernel


@triton.jit
def _stats_pass(
    s_row, t_row, tb_ptr, V, cols, label,  # the row: its logits (t read when SOFT; its bias at tb_ptr), a tile's columns
    log2e_tau, log2e_tau_t, log2e_ce, kl_ratio, s_mul, t_mul,  # the row's constants (`_rows_kernel`)
    LOSS: tl.constexpr, SOFT: tl.constexpr, CE: tl.constexpr, CE_IS_Q: tl.constexpr, ONLINE_KL: tl.constexpr,
    S_HEAD: tl.constexpr, T_HEAD: tl.constexpr, SCALED: tl.constexpr, STATS: tl.constexpr, RCP_FMA: tl.constexpr,
    T_BIAS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Pass 1: the row statistics, kept per lane (no cross-lane reduction, hence no barrier, inside the
    loop: the warps stream the row independently) and merged once after it. DKD leaves its label's column
    out (the sums off y, `_dkd_label` adds it back after).
    Returns the row's (m_s, l_s, l_c, m_t, l_t, r_kl, ss, tt, st, r_ent)."""
    m_s = tl.full([BLOCK_V], M_START, tl.float32)  # running max of s, per lane
    l_s = tl.zeros([BLOCK_V], tl.float32)  # Σ 2^((s − m_s)·log2(e)/τ), per lane
    l_c = tl.zeros([BLOCK_V], tl.float32)  # Σ 2^((s − m_s)·log2(e)), for the untempered CE
    m_t = tl.full([BLOCK_V], M_START, tl.float32)  # running max of t
    l_t = tl.zeros([BLOCK_V], tl.float32)  # Σ 2^((t − m_t)·log2(e)/τ)
    # ONLINE_KL: Σ 2^((s − m_s)·log2(e)/τ)·((s − m_s) − (t − m_t)) (reverse; forward: s and t swapped),
    # `lane_kl`: E_q[(s − max s) − (t − max t)] times l_s
    r_kl = tl.zeros([BLOCK_V], tl.float32)
    ss = tl.zeros([BLOCK_V], tl.float32)  # cosine: Σ s², Σ t², Σ s·t, per lane
    tt = tl.zeros([BLOCK_V], tl.float32)
    st = tl.zeros([BLOCK_V], tl.float32)
    r_ent = tl.zeros([BLOCK_V], tl.float32)  # STATS: Σ 2^((s − m_s)·log2(e)/τ)·(s − m_s) (`lane_gap`)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        mask = offs < V
        if LOSS == _DKD:
            mask = mask & (offs != label)
        a = head(tl.load(s_row + offs, mask=mask, other=-float("inf")).to(tl.float32), s_mul, S_HEAD,
                 RCP_FMA & 1)[0]
        if STATS:
            r_ent = lane_gap(r_ent, l_s, m_s, a, log2e_tau)
        if SOFT and LOSS != _AKL:  # AKL's teacher max and sum come from its head's kernel (`_akl_keys`)
            b = head(_teacher_tile(t_row, tb_ptr, offs, mask, T_BIAS), t_mul, T_HEAD, (RCP_FMA >> 1) & 1)[0]
            if LOSS == _COSINE:
                a0 = tl.where(mask, a, 0.0)
                b0 = tl.where(mask, b, 0.0)
                ss += a0 * a0
                tt += b0 * b0
                st += a0 * b0
                if STATS:  # cosine has no softmax of its own
                    l_s = lane_sum(l_s, m_s, a, log2e_tau)
            else:
                # the KLs' gaps (z_s − max z_s) − (z_t − max z_t) (reverse; forward: swapped) over the
                # weighting side's fold, moved with both maxima (`lane_kl`); m_s moves at the loop's end
                if ONLINE_KL and LOSS == _REVERSE_KL:
                    l_s, r_kl = lane_kl(l_s, r_kl, m_s, m_t, a, b, kl_ratio, log2e_tau, SCALED)
                else:
                    l_s = lane_sum(l_s, m_s, a, log2e_tau)
                if ONLINE_KL and LOSS == _FORWARD_KL:
                    l_t, r_kl = lane_kl(l_t, r_kl, m_t, m_s, b, a, kl_ratio, log2e_tau_t, SCALED)
                else:
                    l_t = lane_sum(l_t, m_t, b, log2e_tau_t)
                m_t = tl.maximum(m_t, b)
        elif SOFT:  # AKL: the student's sum alone
            l_s = lane_sum(l_s, m_s, a, log2e_tau)
        if CE and not CE_IS_Q:
            l_c = lane_sum(l_c, m_s, a, log2e_ce)
        m_s = tl.maximum(m_s, a)
    return _merge(m_s, l_s, l_c, m_t, l_t, r_kl, ss, tt, st, r_ent, log2e_tau, log2e_tau_t, log2e_ce, kl_ratio,
                  LOSS, ONLINE_KL, SCALED, STATS)


@triton.jit
def _loss_pass(
    s_row, g_row, t_row, tb_ptr, V, n_tiles, cols, label,  # the row, its tiles, its label (-1 without)
    m_s, m_t, log2_l_s, log2_l_t, log2_l_c,  # pass 1's statistics, merged
    log2e_tau, log2e_tau_t, log2e_ce, s_mul, t_mul, log2_beta, log2_1mbeta,  # the row's constants
    pow_p, pow_q,  # the power family's powers of p and q
    f_q, f_p, f1, f0, f_a, f_b, c_ce, c_q,  # the gradient's factors (scale, weights, 1/τ and units folded in)
    part_ptr, row,  # PHASE 0 of AKL: its head's keys (`_akl_keys`)
    LOSS: tl.constexpr, SOFT: tl.constexpr, GRAD_SOFT: tl.constexpr, GRAD_CE: tl.constexpr,
    GRAD_PASS: tl.constexpr, CE_IS_Q: tl.constexpr, ONLINE_KL: tl.constexpr, S_HEAD: tl.constexpr,
    T_HEAD: tl.constexpr, RTNE_BITS: tl.constexpr, RCP_FMA: tl.constexpr, IN_PLACE: tl.constexpr,
    PSI: tl.constexpr, SCALED: tl.constexpr, T_BIAS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Pass 2, backwards over the row: the per-element loss terms, summed per lane and then over the row
    (acc, acc2, acc3, acc4: see `_divergence`), and dL/ds written over s when GRAD_PASS is 2."""
    akl_k, akl_v, akl_cut = _akl_keys(part_ptr, row, LOSS)
    row_gap = _row_gap(m_s, m_t, log2_l_s, log2_l_t, log2e_tau)
    acc = tl.zeros([BLOCK_V], tl.float32)
    acc2 = tl.zeros([BLOCK_V], tl.float32)
    acc3 = tl.zeros([BLOCK_V], tl.float32)
    if LOSS == _RENYI or LOSS == _RENYI_REVERSE:
        acc3 = tl.full([BLOCK_V], M_START, tl.float32)  # the lanes' running max of S's log2 terms
    acc4 = tl.zeros([BLOCK_V], tl.float32)
    if (SOFT and LOSS != _COSINE and not ONLINE_KL) or GRAD_PASS == 2:
        for i in range(0, n_tiles):
            offs = (n_tiles - 1 - i) * BLOCK_V + cols
            mask = offs < V
            a, da = head(tl.load(s_row + offs, mask=mask, other=-float("inf")).to(tl.float32), s_mul, S_HEAD,
                         (RCP_FMA >> 2) & 1)
            g = tl.zeros([BLOCK_V], tl.float32)  # dL/ds when GRAD_PASS == 2
            q = a  # q = softmax(s/τ) of the tile where a softmax loss computes it below
            if SOFT:
                b = head(_teacher_tile(t_row, tb_ptr, offs, mask, T_BIAS), t_mul, T_HEAD, (RCP_FMA >> 3) & 1)[0]
                if LOSS == _COSINE:
                    if GRAD_SOFT:
                        g = a * f_a + b * f_b
                else:
                    lq = (a - m_s) * log2e_tau - log2_l_s  # log2 q
                    lp = (b - m_t) * log2e_tau_t - log2_l_t  # log2 p
                    q = tl.exp2(lq)
                    if LOSS == _FORWARD_KL:
                        p = tl.exp2(lp)
                        acc += times(p, lp - lq)
                        if GRAD_SOFT:
                            g = q * f_q + p * f_p
                    elif LOSS == _REVERSE_KL:
                        if GRAD_SOFT:
                            g = times(q, f1 * (lq - lp) + f0)
                    elif LOSS == _JSD:
                        p = tl.exp2(lp)
                        z, w = _mixture(lq, lp, log2_beta, log2_1mbeta)
                        # p log2(p/M) and q log2(q/M) without their constant parts −p log2 β and
                        # −q log2(1 − β), added once a row, as Σ p = Σ q = 1 times them. Finite logs:
                        # no 0·log 0 guard. (This pass is bound by its instruction count.)
                        acc += p * (tl.minimum(z, 0.0) - w)
                        acc2 -= q * (w + tl.maximum(z, 0.0))
                    elif LOSS == _SKEW_KL:  # JSD's p side at β = α, and S = Σ p u (module doc)
                        p = tl.exp2(lp)
                        z, w = _mixture(lq, lp, log2_beta, log2_1mbeta)
                        acc += p * (tl.minimum(z, 0.0) - w)
                        acc2 += tl.exp2(lp - (w + tl.maximum(z, 0.0)))
                    elif LOSS == _SKEW_REVERSE_KL:  # JSD's q side at β = 1 − α, and Σ q (1 − u)
                        z, w = _mixture(lq, lp, log2_beta, log2_1mbeta)
                        x = w + tl.maximum(z, 0.0)
                        acc2 -= q * x
                        acc3 += q * (1.0 - tl.exp2(-x))
                    elif LOSS == _JEFFREYS:  # Σ (q − p)(log2 q − log2 p), each term ≥ 0, and K = Σ q log2(q/p)
                        d = _log2_ratio(a, b, lq, lp, row_gap, log2e_tau, SCALED)
                        present = (lq > -float("inf")) | (lp > -float("inf"))
                        gap = tl.where(present, _gap(lq, lp, d), 0.0)
                        acc += tl.where(present, gap * d, 0.0)
                        acc2 += times(q, d)
                    elif LOSS == _TRIANGULAR:  # Σ (q − p)² / (q + p), and Σ q g (module doc)
                        p = tl.exp2(lp)
                        both = q + p
                        d = _log2_ratio(a, b, lq, lp, row_gap, log2e_tau, SCALED)
                        gap = tl.where(both > 0.0, _gap(lq, lp, d), 0.0)
                        r = tl.where(both > 0.0, gap / both, 0.0)  # in [−1, 1]
                        acc += gap * r
                        acc2 += q * r * tl.where(both > 0.0, (q + 3.0 * p) / both, 0.0)
                    elif LOSS == _RENYI or LOSS == _RENYI_REVERSE:  # S = Σ p^pow_p q^pow_q, and A
                        # S's terms reach 2^((r − 1)·|log2 q|): past fp32 at r > 1 where q ≪ p (a sharp row),
                        # so each lane sums them under its running max (acc3), as pass 1 sums exp; an
                        # infinite term (q = 0 < p at r > 1) is counted apart (acc4): S is then inf
                        first = lq  # the side at the order r > 0: its term is 0 where that side is
                        if LOSS == _RENYI:
                            first = lp
                        x = tl.where(first == -float("inf"), -float("inf"), lp * pow_p + lq * pow_q)
                        acc4 += tl.where(x == float("inf"), 1.0, 0.0)
                        x = tl.where(x == float("inf"), -float("inf"), x)
                        acc = lane_sum(acc, acc3, x, 1.0)
                        acc3 = tl.maximum(acc3, x)
                        acc2 += _power_term(lp, lq, _log2_ratio(a, b, lq, lp, row_gap, log2e_tau, SCALED), pow_p,
                                            pow_q, PSI)
                    elif LOSS == _ALPHA_DIV:
                        acc += _power_term(lp, lq, _log2_ratio(a, b, lq, lp, row_gap, log2e_tau, SCALED), pow_p,
                                           pow_q, PSI)
                    elif LOSS == _AB_DIV:  # the terms, and Σ h, h = q^c − p^α q^β
                        d = _log2_ratio(a, b, lq, lp, row_gap, log2e_tau, SCALED)
                        acc += _power_term(lp, lq, d, pow_p, pow_q, PSI)
                        h = _gap(lq * (pow_p + pow_q), lp * pow_p + lq * pow_q, d * pow_p)
                        acc2 += tl.where(lq == -float("inf"), 0.0, h)
                    elif LOSS == _ENTROPY_ADAPTIVE or LOSS == _AKL:  # KL(p‖q), KL(q‖p) in terms ≥ 0; then
                        # the blend: −Σ p log2 p, n present; AKL: Σ |p − q| on the head (order keys at or over κ,
                        # or κ_v's up to the id cut), on the tail
                        d = _log2_ratio(a, b, lq, lp, row_gap, log2e_tau, SCALED)
                        fkl, rkl, gap, p = _kl_pair(lp, lq, d)
                        acc += fkl
                        acc2 += rkl
                        if LOSS == _AKL:
                            key = _akl_key(tl.load(t_row + offs, mask=mask, other=-float("inf")).to(tl.float32),
                                           T_HEAD)
                            in_head = (key >= akl_k) | ((key == akl_v) & (offs <= akl_cut))
                            acc3 += tl.where(in_head, gap, 0.0)
                            acc4 += tl.where(in_head, 0.0, gap)
                        else:
                            acc3 -= times(p, lp)
                            acc4 += tl.where((lq > -float("inf")) | (lp > -float("inf")), 1.0, 0.0)
                    elif LOSS == _DKD:  # NCKD's terms ≥ 0 off y, of p̂ = p / P, q̂ = q / Q (log2 P and log2(P/Q) in
                        # log2_beta, log2_1mbeta); dL/ds = q̂ f_q + p̂ f_p + q c_q off y, q c_q + f0 at y
                        # (`_dkd_factors`)
                        off = offs != label
                        d = _log2_ratio(a, b, lq, lp, row_gap, log2e_tau, SCALED) + log2_1mbeta  # log2(q̂/p̂)
                        lp_hat = lp - log2_beta
                        lq_hat = lq - (log2_beta - log2_1mbeta)
                        acc += tl.where(off, _kl_pair(lp_hat, lq_hat, d)[0], 0.0)
                        if GRAD_SOFT:
                            p_part = tl.where(f_p != 0.0, times(tl.exp2(lp_hat), f_p), 0.0)  # P = 0: no p̂ (inf · 0)
                            g = tl.where(off, times(tl.exp2(lq_hat), f_q) + p_part + q * c_q, q * c_q + f0)
                    else:  # _TVD: acc2, acc3, acc4 = the mass of q where q < p, q > p, q = p
                        p = tl.exp2(lp)
                        acc += tl.abs(q - p)
                        acc2 += tl.where(lq < lp, q, 0.0)
                        acc3 += tl.where(lq > lp, q, 0.0)
                        acc4 += tl.where(lq == lp, q, 0.0)
            if GRAD_PASS == 2:
                _store_dlds(g_row, offs, mask, g, a, da, q, label, m_s, log2_l_c, log2e_ce, c_ce,
                            GRAD_SOFT, GRAD_CE, CE_IS_Q, S_HEAD, RTNE_BITS, IN_PLACE)
    if LOSS == _RENYI or LOSS == _RENYI_REVERSE:  # S as (Σ 2^(x − m), m): the lanes' sums moved to the row's max
        m = tl.max(acc3, 0)
        return tl.sum(acc * tl.exp2(acc3 - m), 0), tl.sum(acc2, 0), m, tl.sum(acc4, 0)
    return tl.sum(acc, 0), tl.sum(acc2, 0), tl.sum(acc3, 0), tl.sum(acc4, 0)


@triton.jit
def _grad_pass(
    s_row, g_row, t_row, gt_row, tb_ptr, V, cols, label,  # the row (gt_row: a learning teacher's dL/dt), a tile's
    # columns, its label (-1 without)
    m_s, m_t, log2_l_s, log2_l_t, log2_l_c,  # pass 1's statistics, merged
    log2e_tau, log2e_tau_t, log2e_ce, s_mul, t_mul, log2_beta, log2_1mbeta,  # the row's constants
    pow_p, pow_q,  # the power family's powers of p and q
    f1, f0, f_lo, f_hi, f_eq, c_ce,  # the gradient's factors (JSD, skew: f1, f0; TVD: f_lo, f_hi, f_eq)
    ft1, ft_lo, ft0,  # T_GRAD: the teacher's (`_learning_factors`)
    LOSS: tl.constexpr, GRAD_SOFT: tl.constexpr, GRAD_CE: tl.constexpr, CE_IS_Q: tl.constexpr,
    S_HEAD: tl.constexpr, T_HEAD: tl.constexpr, RTNE_BITS: tl.constexpr, RCP_FMA: tl.constexpr,
    IN_PLACE: tl.constexpr, PSI: tl.constexpr, SCALED: tl.constexpr, PULL: tl.constexpr, T_GRAD: tl.constexpr,
    T_IN_PLACE: tl.constexpr, T_RTNE_BITS: tl.constexpr, T_BIAS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Pass 3, for jsd, tvd and the skew losses: dL/ds = q · (f1 · x + f0) written over s, x the element's
    log-ratio (or TVD's sign; skew KL: q · f0 + f1 · p u; skew reverse KL: q · (f1 · x + f0 + f_lo (1 − u)); module doc)."""
    row_gap = _row_gap(m_s, m_t, log2_l_s, log2_l_t, log2e_tau)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        mask = offs < V
        a, da = head(tl.load(s_row + offs, mask=mask, other=-float("inf")).to(tl.float32), s_mul, S_HEAD,
                     (RCP_FMA >> 4) & 1)
        b, db = head(_teacher_tile(t_row, tb_ptr, offs, mask, T_BIAS), t_mul, T_HEAD, (RCP_FMA >> 5) & 1)
        lq = (a - m_s) * log2e_tau - log2_l_s
        lp = (b - m_t) * log2e_tau_t - log2_l_t
        q = tl.exp2(lq)
        d = lq  # log2 q − log2 p for the losses from Jeffreys on (ids above the older losses')
        if LOSS >= _JEFFREYS or LOSS == _AKL:
            d = _log2_ratio(a, b, lq, lp, row_gap, log2e_tau, SCALED)
        if LOSS == _JSD:
            z, w = _mixture(lq, lp, log2_beta, log2_1mbeta)
            g = q * (f1 * (w + tl.maximum(z, 0.0)) + f0)
        elif LOSS == _SKEW_KL:
            z, w = _mixture(lq, lp, log2_beta, log2_1mbeta)
            g = q * f0 + f1 * tl.exp2(lp - (w + tl.maximum(z, 0.0)))
        elif LOSS == _SKEW_REVERSE_KL:
            z, w = _mixture(lq, lp, log2_beta, log2_1mbeta)
            x = w + tl.maximum(z, 0.0)
            g = q * (f1 * x + f0 + f_lo * (1.0 - tl.exp2(-x)))
        elif LOSS == _JEFFREYS:  # c_st ((q − p) + q (log(q/p) − K)): f1 (q − p) + q (f_lo log2(q/p) + f0)
            present = (lq > -float("inf")) | (lp > -float("inf"))
            if PULL:  # mutual: forward KL's c (q − p), and the CE's q part; no log-ratio (infinite where p = 0 < q)
                g = tl.where(present, f1 * _gap(lq, lp, d), 0.0) + q * f0
            else:
                g = tl.where(present, f1 * _gap(lq, lp, d), 0.0) + times(q, f_lo * d + f0)
            if T_GRAD:  # the learning teacher's dL/dt, stored after dL/ds below
                # mutual: c_t (p − q); co_jeffreys: c_t ((p − q) + p (log(p/q) − KL(p‖q))), the student's mirror
                gt = tl.where(present, -ft1 * _gap(lq, lp, d), 0.0)
                if not PULL:
                    gt += times(tl.exp2(lp), ft0 - ft_lo * d)
                gt = head_grad(gt, db, T_HEAD)
        elif LOSS == _ENTROPY_ADAPTIVE or LOSS == _AKL:  # Jeffreys' form with the weights; at w = 1 no reverse KL (d may be inf)
            present = (lq > -float("inf")) | (lp > -float("inf"))
            g = tl.where(present, f1 * _gap(lq, lp, d), 0.0) + times(q, tl.where(f_lo != 0.0, f_lo * d, 0.0) + f0)
        elif LOSS == _TRIANGULAR:  # c_st q (g − Σ q g), g = (q − p)(q + 3p) / (q + p)²
            p = tl.exp2(lp)
            both = q + p
            gap = tl.where(both > 0.0, _gap(lq, lp, d), 0.0)
            r = tl.where(both > 0.0, gap / both, 0.0)
            g = q * (f1 * r * tl.where(both > 0.0, (q + 3.0 * p) / both, 0.0) + f0)
        elif LOSS == _ALPHA_DIV:  # c_st (q S − e) / (1 − α) = f1 (q − e) + q f0, e = p^(1−α) q^α
            g = f1 * _gap(lq, lp * pow_p + lq * pow_q, d * pow_p) + q * f0
        elif LOSS == _AB_DIV:  # c_st (h − q Σ h) / α = f1 h + q f0, h = q^c − p^α q^β
            g = f1 * _gap(lq * (pow_p + pow_q), lp * pow_p + lq * pow_q, d * pow_p) + q * f0
        elif LOSS == _RENYI:  # c_st (q − e / S), e = p^r q^(1−r), f_lo = log2 S
            g = f1 * _gap(lq, lp * pow_p + lq * pow_q - f_lo, d * pow_p + f_lo) + q * f0
        elif LOSS == _RENYI_REVERSE and PSI == 4:  # r = 1 (γ = 1, 1 − γ = 0): the limit, KL(q‖p)'s
            g = times(q, f1 * d + f0)  # f0 = c_q − c_st KL(q‖p)
        elif LOSS == _RENYI_REVERSE:  # c_st r / (r − 1) (e / S − q), e = q^r p^(1−r), f_lo = log2 S
            g = f1 * _gap(lp * pow_p + lq * pow_q - f_lo, lq, -d * pow_p - f_lo) + q * f0
        else:  # σ = sign(q − p) taken on the logs, as in pass 2
            g = q * tl.where(lq > lp, f_hi, tl.where(lq < lp, f_lo, f_eq))
        if LOSS == _TRIANGULAR or LOSS == _ALPHA_DIV or LOSS == _AB_DIV or LOSS == _RENYI or LOSS == _RENYI_REVERSE:
            g = tl.where(a == -float("inf"), 0.0, g)  # q = 0: dL/ds is 0 (no 0 · inf from the powers)
        _store_dlds(g_row, offs, mask, g, a, da, q, label, m_s, log2_l_c, log2e_ce, c_ce,
                    GRAD_SOFT, GRAD_CE, CE_IS_Q, S_HEAD, RTNE_BITS, IN_PLACE)
        if T_GRAD:  # into t's own bytes (its fp32, or `grad_view(t, ...)`): after the barrier where IN_PLACE put one
            if T_IN_PLACE and not IN_PLACE:  # the view's stores land on columns every warp must have loaded
                tl.debug_barrier()
            store_grad(gt_row + offs, gt, mask, T_RTNE_BITS)


@triton.jit
def _merge(m_s, l_s, l_c, m_t, l_t, r_kl, ss, tt, st, r_ent, log2e_tau, log2e_tau_t, log2e_ce, kl_ratio,
           LOSS: tl.constexpr, ONLINE_KL: tl.constexpr, SCALED: tl.constexpr, STATS: tl.constexpr):
    """Pass 1's statistics of several parts of a row (a program's lanes, or the ranks' vocab slices)
    merged into the row's: the sums moved to the row's maxima and added. Parts with nothing in them
    (m at M_START, sums 0) add nothing."""
    m_row = tl.max(m_s, 0)
    mt_row = tl.max(m_t, 0)
    f = tl.exp2((m_s - m_row) * log2e_tau)
    if STATS:  # the parts' gaps, moved to the row's max
        r_ent = tl.sum(times(f, r_ent + l_s * (m_s - m_row)), 0)
    else:
        r_ent = 0.0
    if ONLINE_KL and LOSS == _REVERSE_KL:  # the parts' KL gaps, moved to the row's maxima
        r_kl = tl.sum(times(f, r_kl - times(l_s, _minus(m_row - m_s, mt_row - m_t, kl_ratio, SCALED))), 0)
    l_s = tl.sum(l_s * f, 0)
    l_c = tl.sum(l_c * tl.exp2((m_s - m_row) * log2e_ce), 0)
    f = tl.exp2((m_t - mt_row) * log2e_tau_t)
    if ONLINE_KL and LOSS == _FORWARD_KL:
        r_kl = tl.sum(times(f, r_kl - times(l_t, _minus(mt_row - m_t, m_row - m_s, kl_ratio, SCALED))), 0)
    if not ONLINE_KL:
        r_kl = 0.0
    l_t = tl.sum(l_t * f, 0)
    return m_row, l_s, l_c, mt_row, l_t, r_kl, tl.sum(ss, 0), tl.sum(tt, 0), tl.sum(st, 0), r_ent


@triton.jit
def _row_label(labels_ptr, ignore_index, label_lo, LABELS: tl.constexpr):
    """Whether the row counts (its label is not ignore_index), and its label's column (-1 without labels)."""
    valid = True
    label = -1
    if LABELS:
        label = tl.load(labels_ptr).to(tl.int64)
        valid = label != ignore_index
        label = label - label_lo  # the label's column in this slice of the vocab
    return valid, label


@triton.jit
def _label_logit(s_row, label, V, s_mul, CE: tl.constexpr, S_HEAD: tl.constexpr, RCP_FMA: tl.constexpr):
    """The CE's logit z_y (DKD's: CE is then True here), read before s is overwritten (0 where the label's
    column is not in s), and whether the label is a column of s. Without CE: 0 and False, unused."""
    s_y = 0.0
    in_range = False
    if CE:
        in_range = (label >= 0) & (label < V)
        s_y = tl.load(s_row + tl.where(in_range, label, 0)).to(tl.float32)
        s_y = tl.where(in_range, head(s_y, s_mul, S_HEAD, RCP_FMA & 1)[0], 0.0)
    return s_y, in_range


@triton.jit
def _store_parts(part_row, m_s, l_s, l_c, m_t, l_t, r_kl, ss, tt, st, r_ent, s_y, in_range, CE: tl.constexpr):
    """PHASE 1: this rank's part of the row, pass 1's statistics (`_PARTS`) (DKD: its sums off y, and the
    teacher's z_y in st)."""
    tl.store(part_row, m_s)
    tl.store(part_row + 1, l_s)
    tl.store(part_row + 2, l_c)
    tl.store(part_row + 3, m_t)
    tl.store(part_row + 4, l_t)
    tl.store(part_row + 5, r_kl)
    tl.store(part_row + 6, ss)
    tl.store(part_row + 7, tt)
    tl.store(part_row + 8, st)
    tl.store(part_row + 9, r_ent)
    if CE:
        tl.store(part_row + 10, s_y)
        tl.store(part_row + 11, tl.where(in_range, 1.0, 0.0))


@triton.jit
def _merged_parts(
    part_row, world, stride_part,  # the row's part on rank 0, the ranks, from one rank's parts to the next
    log2e_tau, log2e_tau_t, log2e_ce, kl_ratio,  # the row's constants (`_rows_kernel`)
    LOSS: tl.constexpr, CE: tl.constexpr, ONLINE_KL: tl.constexpr, SCALED: tl.constexpr, STATS: tl.constexpr,
    WORLD_BLOCK: tl.constexpr,
):
    """PHASE 2, 3: the ranks' statistics of the row (their `_PARTS`), merged as a program's lanes are,
    and `_label_logit`'s pair from the one rank whose slice holds the label (it gave its logit and a 1).
    Returns (m_s, l_s, l_c, m_t, l_t, r_kl, ss, tt, st, r_ent, s_y, in_range)."""
    at = part_row + tl.arange(0, WORLD_BLOCK) * stride_part
    here = tl.arange(0, WORLD_BLOCK) < world
    m_s, l_s, l_c, m_t, l_t, r_kl, ss, tt, st, r_ent = _merge(
        tl.load(at, mask=here, other=M_START), tl.load(at + 1, mask=here, other=0.0),
        tl.load(at + 2, mask=here, other=0.0), tl.load(at + 3, mask=here, other=M_START),
        tl.load(at + 4, mask=here, other=0.0), tl.load(at + 5, mask=here, other=0.0),
        tl.load(at + 6, mask=here, other=0.0), tl.load(at + 7, mask=here, other=0.0),
        tl.load(at + 8, mask=here, other=0.0), tl.load(at + 9, mask=here, other=0.0),
        log2e_tau, log2e_tau_t, log2e_ce, kl_ratio, LOSS, ONLINE_KL, SCALED, STATS)
    s_y = 0.0
    in_range = False
    if CE:
        s_y = tl.sum(tl.load(at + 10, mask=here, other=0.0), 0)
        in_range = tl.sum(tl.load(at + 11, mask=here, other=0.0), 0) > 0.5
    return m_s, l_s, l_c, m_t, l_t, r_kl, ss, tt, st, r_ent, s_y, in_range


@triton.jit
def _tile_stats(
    tile_row, n_tiles, stride_plane,  # the row's statistics of its first vocab tile, the tiles, plane to plane
    log2e_tau, log2e_tau_t, log2e_ce, kl_ratio,  # the row's constants (`_rows_kernel`)
    LOSS: tl.constexpr, SOFT: tl.constexpr, CE: tl.constexpr, CE_IS_Q: tl.constexpr, SCALED: tl.constexpr,
    TILE_BLOCK: tl.constexpr,
):
    """PHASE 4: pass 1's statistics from the ones the logits GEMMs' epilogue made for each vocab tile of
    the row (`rows(..., tiles=...)`: planes m_s, l_s, l_c, m_t, l_t), merged as a program's lanes are.
    Returns (m_s, l_s, l_c, m_t, l_t, r_kl, ss, tt, st, r_ent)."""
    at = tile_row + tl.arange(0, TILE_BLOCK)
    here = tl.arange(0, TILE_BLOCK) < n_tiles
    zero = tl.zeros([TILE_BLOCK], tl.float32)
    lowest = tl.full([TILE_BLOCK], M_START, tl.float32)
    m_s = tl.load(at, mask=here, other=M_START)
    l_s = zero
    l_c = zero
    m_t = lowest
    l_t = zero
    if SOFT:
        l_s = tl.load(at + stride_plane, mask=here, other=0.0)
        m_t = tl.load(at + 3 * stride_plane, mask=here, other=M_START)
        l_t = tl.load(at + 4 * stride_plane, mask=here, other=0.0)
    if CE and not CE_IS_Q:
        l_c = tl.load(at + 2 * stride_plane, mask=here, other=0.0)
    return _merge(m_s, l_s, l_c, m_t, l_t, zero, zero, zero, zero, zero, log2e_tau, log2e_tau_t, log2e_ce, kl_ratio,
                  LOSS, False, SCALED, False)


@triton.jit
def _row_stats(
    s_row, t_row, tb_ptr, part_ptr, part_row, row, V, cols, label,  # the row (`_rows_kernel`), its label's column
    world, stride_part, stride_tile, stat_tiles,  # the ranks' parts (PHASE 2, 3) or the vocab tiles' (4)
    log2e_tau, log2e_tau_t, log2e_ce, kl_ratio, s_mul, t_mul,  # the row's constants (`_rows_kernel`)
    LOSS: tl.constexpr, SOFT: tl.constexpr, CE: tl.constexpr, CE_IS_Q: tl.constexpr, ONLINE_KL: tl.constexpr,
    S_HEAD: tl.constexpr, T_HEAD: tl.constexpr, SCALED: tl.constexpr, STATS: tl.constexpr, RCP_FMA: tl.constexpr,
    T_BIAS: tl.constexpr, PHASE: tl.constexpr, WORLD_BLOCK: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Pass 1's statistics of the row, merged, and the CE's logit (`_label_logit`): from a pass over the row
    (PHASE 0, 1: `_stats_pass`), from the logits GEMMs' per vocab tile (4: `_tile_stats`), or the ranks'
    parts merged (2, 3: `_merged_parts`). Returns (m_s, l_s, l_c, m_t, l_t, r_kl, ss, tt, st, r_ent, s_y,
    in_range)."""
    if PHASE <= 1:
        s_y, in_range = _label_logit(s_row, label, V, s_mul, CE or LOSS == _DKD, S_HEAD, RCP_FMA)
        m_s, l_s, l_c, m_t, l_t, r_kl, ss, tt, st, r_ent = _stats_pass(
            s_row, t_row, tb_ptr, V, cols, label,
            log2e_tau, log2e_tau_t, log2e_ce, kl_ratio, s_mul, t_mul,
            LOSS, SOFT, CE, CE_IS_Q, ONLINE_KL, S_HEAD, T_HEAD, SCALED, STATS, RCP_FMA, T_BIAS, BLOCK_V,
        )
        if LOSS == _DKD:  # the teacher's z_y, in the slot cosine's Σ s·t has (unused here)
            st = _label_logit(t_row, label, V, t_mul, True, T_HEAD, (RCP_FMA >> 1) & 1)[0]
        if LOSS == _AKL and SOFT:  # the teacher's max and sum from its head's kernel: one read of t fewer
            m_t, l_t = _akl_teacher_stats(part_ptr, row)
    elif PHASE == 4:
        s_y, in_range = _label_logit(s_row, label, V, s_mul, CE, S_HEAD, RCP_FMA)
        m_s, l_s, l_c, m_t, l_t, r_kl, ss, tt, st, r_ent = _tile_stats(
            part_ptr + row.to(tl.int64) * stride_tile, stat_tiles, stride_part,
            log2e_tau, log2e_tau_t, log2e_ce, kl_ratio, LOSS, SOFT, CE, CE_IS_Q, SCALED, WORLD_BLOCK)
    else:
        m_s, l_s, l_c, m_t, l_t, r_kl, ss, tt, st, r_ent, s_y, in_range = _merged_parts(
            part_row, world, stride_part, log2e_tau, log2e_tau_t, log2e_ce, kl_ratio,
            LOSS, CE or LOSS == _DKD, ONLINE_KL, SCALED, STATS, WORLD_BLOCK)
    return m_s, l_s, l_c, m_t, l_t, r_kl, ss, tt, st, r_ent, s_y, in_range


@triton.jit
def _row_logs(m_s, l_s, l_c, l_t, r_ent, s_y, in_range, fold_s, inv_tau,
              CE: tl.constexpr, CE_IS_Q: tl.constexpr, STATS: tl.constexpr):
    """The softmaxes' log2 sums, from pass 1's statistics merged, and the CE and entropy they give.
    Returns (log2_l_s, log2_l_t, log2_l_c, hard, entropy)."""
    # log2 q = (s − m_s)·log2(e)/τ − log2 l_s, log2 p likewise,
    # log2 softmax(s) = (s − m_s)·log2(e) − log2 l_c
    log2_l_s = tl.log2(l_s)
    log2_l_t = tl.log2(l_t)
    if CE_IS_Q:
        log2_l_c = log2_l_s
    else:
        log2_l_c = tl.log2(l_c)
    hard = 0.0
    entropy = 0.0
    if CE:  # logsumexp(z) − z_y
        hard = tl.where(in_range, (m_s - s_y) * fold_s + LN2 * log2_l_c, float("nan"))
    if STATS:  # H(q) = logsumexp(z/τ) − E_q[z]/τ = log l_s − E_q[z − max z]/τ
        entropy = LN2 * log2_l_s - r_ent / l_s * (fold_s * inv_tau)
    return log2_l_s, log2_l_t, log2_l_c, hard, entropy


@triton.jit
def _pass2_factors(
    scale_ptr, w_soft, w_hard, in_range,  # the row's factor, the weights, whether the label is in the vocab
    l_s, l_t, log2_l_s, log2_l_t, r_kl, ss, tt, st,  # pass 1's statistics, merged, and `_row_logs`'
    fold_s, fold_t, inv_tau, beta,  # the row's constants (`_rows_kernel`)
    LOSS: tl.constexpr, SOFT: tl.constexpr, CE: tl.constexpr, GRAD_SOFT: tl.constexpr, GRAD_CE: tl.constexpr,
    CE_IS_Q: tl.constexpr, ONLINE_KL: tl.constexpr,
):
    """The losses pass 1 takes whole (an online KL, cosine: 0 for the others) and pass 2's gradient
    factors, its soft part with the row's factors folded in (and the CE's softmax(s) term, when that is q:
    `fold_q`). Returns (soft, c_ce, c_q, c_st, f_q, f_p, f1, f0, f_a, f_b)."""
    scale = tl.load(scale_ptr).to(tl.float32)
    c_soft = scale * w_soft
    c_ce = 0.0
    if CE:
        c_ce = tl.where(in_range, scale * w_hard, 0.0)  # out-of-range label: NaN loss, no CE gradient

    soft = 0.0
    inv_nn = 0.0
    cos_aa = 0.0
    kl_qp = 0.0
    if SOFT:
        # KL(q‖p) = E_q[(z_s − max z_s) − (z_t − max z_t)]/τ + log(l_t / l_s), and KL(p‖q) with s
        # and t swapped (r_kl is over the fold of its own side)
        if ONLINE_KL and LOSS == _REVERSE_KL:
            kl_qp = r_kl / l_s * fold_s * inv_tau + LN2 * (log2_l_t - log2_l_s)
            soft = kl_qp
        elif ONLINE_KL:
            soft = r_kl / l_t * fold_t * inv_tau + LN2 * (log2_l_s - log2_l_t)
        if LOSS == _COSINE:
            # soft = β (1 − cos), cos = Σst / (max(‖s‖, ε) max(‖t‖, ε));
            # dsoft/ds = −β (t / (max(‖s‖, ε) max(‖t‖, ε)) − cos · s / (max(‖s‖, ε) ‖s‖)),
            # without the second term when ‖s‖ < ε (the clamp is then constant)
            n_s = tl.sqrt_rn(ss) * fold_s  # of z = fold · s (fold > 0)
            n_t = tl.sqrt_rn(tt) * fold_t
            inv_nn = 1.0 / (tl.maximum(n_s, _NORM_EPS) * tl.maximum(n_t, _NORM_EPS))
            cos = st * (fold_s * fold_t) * inv_nn
            cos_aa = tl.where(n_s >= _NORM_EPS, cos / (tl.maximum(n_s, _NORM_EPS) * n_s), 0.0)
            soft = beta * (1.0 - cos)

    fold_q = GRAD_SOFT and GRAD_CE and CE_IS_Q
    c_q = 0.0  # the CE gradient's softmax(s) term when it is q (GRAD_SOFT holds then)
    if fold_q:
        c_q = c_ce
    c_st = c_soft * inv_tau
    f_q = c_st + c_q  # forward_kl: c_soft (q − p) / τ
    f_p = -c_st
    f1 = c_st * LN2  # reverse_kl: c_soft q (log(q/p) − KL(q‖p)) / τ, log(q/p) = ln 2 · (lq − lp)
    f0 = c_q - c_st * kl_qp
    f_a = c_soft * beta * cos_aa * fold_s  # cosine: c_soft · dsoft/dz above, z = fold · the loaded value
    f_b = -c_soft * beta * inv_nn * fold_t
    return soft, c_ce, c_q, c_st, f_q, f_p, f1, f0, f_a, f_b


@triton.jit
def _divergence(acc, acc2, acc3, acc4, soft, beta, log2_beta, log2_1mbeta, pow_p, pow_q,
                LOSS: tl.constexpr, SOFT: tl.constexpr, ONLINE_KL: tl.constexpr):
    """The divergences' row scalars (natural log units) from pass 2's sums: the loss where pass 2 takes it
    (soft passes through otherwise), JSD's K and TVD's σ − Σ q σ for pass 3 (skew KL: S = Σ p u in k_jsd;
    skew reverse KL: K in k_jsd, Σ q (1 − u) in tvd_zero; module doc).
    Returns (soft, k_jsd, tvd_pos, tvd_neg, tvd_zero)."""
    k_jsd = 0.0
    tvd_pos = 0.0
    tvd_neg = 0.0
    tvd_zero = 0.0
    if SOFT:
        if LOSS == _FORWARD_KL and not ONLINE_KL:
            soft = LN2 * acc
        elif LOSS == _JSD:
            k_jsd = LN2 * (acc2 - log2_1mbeta)  # K = Σ q log(q/M)
            soft = beta * LN2 * (acc - log2_beta) + (1.0 - beta) * k_jsd
        elif LOSS == _SKEW_KL:  # KL(p‖M) = Σ p log(p/M), M at β = α
            soft = LN2 * (acc - log2_beta)
            k_jsd = acc2
        elif LOSS == _SKEW_REVERSE_KL:  # KL(q‖M′) = K, M′ = M at β = 1 − α
            k_jsd = LN2 * (acc2 - log2_1mbeta)
            soft = k_jsd
            tvd_zero = acc3
        elif LOSS == _JEFFREYS:  # K = KL(q‖p) in k_jsd, in log2 units as the d it is subtracted from
            soft = LN2 * acc
            k_jsd = acc2
        elif LOSS == _TRIANGULAR:  # Σ q g in k_jsd
            soft = acc
            k_jsd = acc2
        elif LOSS == _ALPHA_DIV:  # the loss A = (1 − S) / (α (1 − α)) in k_jsd too
            soft = acc
            k_jsd = acc
        elif LOSS == _AB_DIV:  # Σ h in k_jsd
            soft = acc
            k_jsd = acc2
        elif LOSS == _RENYI or LOSS == _RENYI_REVERSE:  # log2 S in tvd_zero (`flashkd.losses.renyi`)
            r = pow_p  # the order, and r − 1 as the host gave 1 − r (not rounded from r: small near r = 1)
            r_1 = -pow_q
            if LOSS == _RENYI_REVERSE:
                r = pow_q
                r_1 = -pow_p
            # S = Σ p^r q^(1−r) = 2^acc3 · acc (acc4 > 0: a term is infinite): the rows far from p = q
            log2_s = tl.where(acc4 > 0.0, float("inf"), acc3 + tl.log2(acc))
            log_s = log2_s * LN2
            near = tl.abs(log_s) <= 0.25
            z = r * r_1 * acc2  # S − 1 from the non-negative terms A = acc2
            small = tl.abs(z) < 1e-3
            zs = tl.where(small, 1.0, z)
            ratio = tl.where(small, 1.0 - z * (0.5 - z * (1.0 / 3.0 - z * (0.25 - z * 0.2))), log1p(zs) / zs)
            far = log_s / tl.where(r_1 == 0.0, 1.0, r_1)
            soft = tl.where(near, r * acc2 * ratio, far)
            tvd_zero = tl.where(near, z * ratio * LOG2E, log2_s)
        elif LOSS == _ENTROPY_ADAPTIVE or LOSS == _AKL:  # w KL(p‖q) + (1 − w) KL(q‖p): w in tvd_zero, K = KL(q‖p)
            if LOSS == _AKL:  # w = g_head / (g_head + g_tail), ½ where both are 0
                g_all = acc3 + acc4
                some = g_all > 0.0
                w = tl.where(some, acc3 / tl.where(some, g_all, 1.0), 0.5)
            else:  # w = gate_min + (gate_max − gate_min) sigmoid((h − center) / width), h = H(p) / log n (0 for
                # n ≤ 1): gate_min, its span, center and width in pow_p, pow_q, log2_beta, log2_1mbeta (`_powers`)
                many = acc4 > 1.0
                h = tl.where(many, acc3 / (LOG2E * tl.log(tl.where(many, acc4, 2.0))), 0.0)
                w = pow_p + pow_q * tl.sigmoid((h - log2_beta) / log2_1mbeta)
            # a KL whose weight is 0 adds nothing, also where it is infinite
            soft = tl.where(w > 0.0, w * acc, 0.0) + tl.where(w < 1.0, (1.0 - w) * acc2, 0.0)
            k_jsd = acc2
            tvd_zero = w
        elif LOSS == _TVD:
            soft = 0.5 * acc
            # σ − Σ q σ, for σ = +1, −1, 0, from the masses below / above / at p, which sum to 1:
            # sums of non-negative terms, accurate even when Σ q σ is close to ±1
            mass_lo = acc2
            mass_hi = acc3
            mass_eq = acc4
            tvd_pos = 2.0 * mass_lo + mass_eq
            tvd_neg = -(2.0 * mass_hi + mass_eq)
            tvd_zero = mass_lo - mass_hi
    return soft, k_jsd, tvd_pos, tvd_neg, tvd_zero


@triton.jit
def _pass3_factors(c_q, c_st, beta, log2_1mbeta, pow_p, pow_q, soft, k_jsd, tvd_pos, tvd_neg, tvd_zero,
                   LOSS: tl.constexpr, PSI: tl.constexpr):
    """Pass 3's factors, dL/ds = q · (f1 · x + f0) (JSD) or q · f_lo, f_hi, f_eq by TVD's sign, with the
    row's factors (scale, weight, 1/τ, units, its scalar, and the CE's when softmax(s) is q) folded in
    here: the pass is bound by its instruction count. Returns (f1, f0, f_lo, f_hi, f_eq)."""
    f1 = 0.0
    f0 = 0.0
    f_lo = 0.0
    f_hi = 0.0
    f_eq = 0.0
    if LOSS == _JSD:  # c_st (1 − β) q (log(q/M) − K), log2(q/M) = −(w + max(z, 0)) − log2(1 − β)
        f1 = -c_st * (1.0 - beta) * LN2
        f0 = c_q + f1 * log2_1mbeta - c_st * (1.0 - beta) * k_jsd
    elif LOSS == _SKEW_KL:  # c_st (q S − p u)
        f1 = -c_st
        f0 = c_q + c_st * k_jsd
    elif LOSS == _SKEW_REVERSE_KL:  # c_st q (log(q/M′) − K + (1 − u) − Σ q (1 − u)), as for JSD at β = 1 − α
        f1 = -c_st * LN2
        f0 = c_q + f1 * log2_1mbeta - c_st * (k_jsd + tvd_zero)
        f_lo = c_st
    elif LOSS == _JEFFREYS:  # c_st ((q − p) + q ln 2 (log2(q/p) − K))
        f1 = c_st
        f_lo = c_st * LN2
        f0 = c_q - c_st * LN2 * k_jsd
    elif LOSS == _ENTROPY_ADAPTIVE or LOSS == _AKL:  # c_st (w (q − p) + (1 − w) q ln 2 (log2(q/p) − K)), w in tvd_zero
        f1 = c_st * tvd_zero
        f_lo = c_st * (1.0 - tvd_zero) * LN2
        f0 = c_q - tl.where(tvd_zero < 1.0, c_st * (1.0 - tvd_zero) * k_jsd, 0.0)
    elif LOSS == _TRIANGULAR:  # c_st q (g − Σ q g)
        f1 = c_st
        f0 = c_q - c_st * k_jsd
    elif LOSS == _ALPHA_DIV:  # c_st (q S − e) / (1 − α), S = 1 − α (1 − α) A: f1 (q − e) − q c_st α A
        f1 = c_st / pow_p
        f0 = c_q - c_st * pow_q * k_jsd
    elif LOSS == _AB_DIV:  # c_st (h − q Σ h) / α
        f1 = c_st / pow_p
        f0 = c_q - c_st * k_jsd / pow_p
    elif LOSS == _RENYI:  # c_st (q − e / S)
        f1 = c_st
        f0 = c_q
        f_lo = tvd_zero
    elif LOSS == _RENYI_REVERSE and PSI == 4:  # r = 1: c_st q (log(q/p) − KL(q‖p)), the KL the loss
        f1 = c_st * LN2
        f0 = c_q - c_st * soft
    elif LOSS == _RENYI_REVERSE:  # c_st r / (r − 1) (e / S − q)
        f1 = -c_st * pow_q / pow_p
        f0 = c_q
        f_lo = tvd_zero
    else:  # _TVD: c_st q (σ − Σ q σ) / 2
        f_lo = c_q + 0.5 * c_st * tvd_neg
        f_hi = c_q + 0.5 * c_st * tvd_pos
        f_eq = c_q + 0.5 * c_st * tvd_zero
    return f1, f0, f_lo, f_hi, f_eq


@triton.jit
def _with_label(m_s, l_s, l_c, m_t, l_t, r_ent, s_y, t_y, in_range, mix_a, mix_b, log2e_tau, log2e_tau_t, log2e_ce,
                kl_ratio, LOSS: tl.constexpr, SCALED: tl.constexpr, STATS: tl.constexpr):
    """DKD: pass 1's sums off y (merged) and the label's column merged as a part of its own (z_y, a sum of 1;
    nothing where the label is not in the vocab), and the masses off y, log2 P = log2 Σ_(j ≠ y) p_j and log2 Q
    likewise, each a sum of its own terms: exact where p_y ≈ 1. Returns (m_s, l_s, l_c, m_t, l_t, r_ent,
    log2 P, log2 Q) of the whole row; the other losses' statistics and (mix_a, mix_b) as they came."""
    if LOSS == _DKD:
        first = tl.arange(0, 2) == 0
        one = tl.where(in_range, 1.0, 0.0)
        zero = tl.zeros([2], tl.float32)
        m_s2, l_s2, l_c2, m_t2, l_t2, _, _, _, _, r_ent = _merge(
            tl.where(first, m_s, tl.where(in_range, s_y, M_START)), tl.where(first, l_s, one),
            tl.where(first, l_c, one), tl.where(first, m_t, tl.where(in_range, t_y, M_START)),
            tl.where(first, l_t, one), zero, zero, zero, zero, tl.where(first, r_ent, 0.0),
            log2e_tau, log2e_tau_t, log2e_ce, kl_ratio, LOSS, False, SCALED, STATS)
        mix_b = tl.log2(l_s) + (m_s - m_s2) * log2e_tau - tl.log2(l_s2)  # log2 Q
        mix_a = tl.log2(l_t) + (m_t - m_t2) * log2e_tau_t - tl.log2(l_t2)  # log2 P
        m_s, l_s, l_c, m_t, l_t = m_s2, l_s2, l_c2, m_t2, l_t2
    return m_s, l_s, l_c, m_t, l_t, r_ent, mix_a, mix_b


@triton.jit
def _dkd_factors(m_s, m_t, log2_l_s, log2_l_t, s_y, t_y, log2_p, log2_q, c_q, c_st, log2e_tau, log2e_tau_t,
                 alpha, beta, SCALED: tl.constexpr, PSI: tl.constexpr):
    """DKD's gradient factors and TCKD, from the row's statistics and the label's logits:
        dL/dz_j = c (β (q̂_j − p̂_j) − α (q_y − p_y) q_j / Q)  (j ≠ y),   c α (q_y − p_y)  (j = y)
    (q_y − p_y exact from the logits' difference), TCKD = KL((p_y, P) ‖ (q_y, Q)) in its terms ≥ 0; the β
    part left out where P = 0 (NCKD is 0 there). log(P/Q) = log1p((q_y − p_y) / Q) where P ≈ Q (P − Q is
    q_y − p_y), not the difference of the two rounded logs. Returns (f_q, f_p, f_y, TCKD, log2(P/Q)): f_q and
    f_p the factors of q̂ = 2^(log2 q − log2 Q) and p̂ = 2^(log2 p − log2 P), each formed from its logs (q · f_q / Q
    was 0 · inf where the label's mass leaves Q below fp32's range, e.g. q_y ≈ 1 − 2^−170: the NCKD part lost)."""
    lq_y = (s_y - m_s) * log2e_tau - log2_l_s
    lp_y = (t_y - m_t) * log2e_tau_t - log2_l_t
    d_y = _log2_ratio(s_y, t_y, lq_y, lp_y, _row_gap(m_s, m_t, log2_l_s, log2_l_t, log2e_tau), log2e_tau, SCALED)
    gap_y = tl.where((lq_y > -float("inf")) | (lp_y > -float("inf")), _gap(lq_y, lp_y, d_y), 0.0)
    some = log2_p > -float("inf")
    nc = tl.where(some, beta, 0.0)
    q_off = tl.exp2(log2_q)  # Q
    f_q = c_st * (nc - alpha * gap_y)
    f_p = tl.where(some, -c_st * beta, 0.0)
    f_y = c_st * alpha * gap_y
    x = gap_y / q_off
    near = tl.abs(x) <= 0.5
    shift = tl.where(near, log1p(tl.where(near, x, 0.0)) * LOG2E, log2_p - log2_q)  # log2(P/Q)
    tckd = _power_term(lp_y, lq_y, d_y, 1.0, 0.0, PSI) + _power_term(log2_p, log2_q, -shift, 1.0, 0.0, PSI)
    return f_q, f_p, f_y, tckd, shift


@triton.jit
def _akl_keys(part_ptr, row, LOSS: tl.constexpr):
    """AKL's head for pass 2, (κ, κ_v, cut) of `_akl_head_kernel` in part_ptr (PHASE 0), int32; zeros for the
    other losses (pass 2 takes them as arguments: the GPU compiler keeps a name's type across a branch)."""
    zero = row * 0
    if LOSS == _AKL:  # each within int32: the keys between the floor and the ceiling, cut in [−1, V]
        akl_row = part_ptr + row * _AKL_OUT
        return tl.load(akl_row).to(tl.int32), tl.load(akl_row + 1).to(tl.int32), tl.load(akl_row + 2).to(tl.int32)
    return zero, zero, zero


@triton.jit
def _akl_teacher_stats(part_ptr, row):
    """The teacher's (max, sum) at τ over the row as `_akl_top_kernel` wrote them (fp32 bits in int64): pass 1's
    m_t and l_t, merged (the row kernel's, and the head's later kernels')."""
    akl_row = part_ptr + row * _AKL_OUT
    return (tl.load(akl_row + 4).to(tl.int32).to(tl.float32, bitcast=True),
            tl.load(akl_row + 5).to(tl.int32).to(tl.float32, bitcast=True))


@triton.jit
def _dkd_value(nckd, tckd, log2_p, in_range, alpha, beta):
    """α TCKD + β NCKD (a term of weight 0 left out, also where it is infinite); NCKD 0 where P = 0 (p̂ is
    undefined: KD weighs it by P); NaN for a label outside the vocab."""
    nckd = tl.where(log2_p > -float("inf"), nckd, 0.0)
    soft = tl.where(alpha != 0.0, alpha * tckd, 0.0) + tl.where(beta != 0.0, beta * nckd, 0.0)
    return tl.where(in_range, soft, float("nan"))


@triton.jit
def _rows_kernel(
    s_ptr,  # (R, V) student logits
    g_ptr,  # (R, V) dL/ds out, rows stride_g apart, when GRAD_PASS != 0: s itself, or a narrower buffer
    t_ptr,  # (R, V) teacher logits, any float dtype, rows stride_t apart (not read unless SOFT)
    gt_ptr,  # (R, V) a learning teacher's dL/dt out, rows stride_gt apart, when T_GRAD: t itself, or a view of it
    tb_ptr,  # (V,) the teacher head's bias, added to t at load (read when T_BIAS)
    labels_ptr,  # (R,) int32 / int64 (not read unless LABELS)
    soft_ptr,  # (R,) fp32 out: unweighted divergence, 0 on ignored rows
    hard_ptr,  # (R,) fp32 out: untempered CE, 0 on ignored rows, NaN for a label outside [0, V)
    ent_ptr,  # (R,) fp32 out: entropy of q, 0 on ignored rows (written when STATS)
    scale_ptr,  # () or (R,) fp32 (or fp64): the reduction's factor (per row: times the row's weight)
    part_ptr,  # PHASE 1: (R, _PARTS) fp32 out, this rank's; 2, 3: (world, R, _PARTS), every rank's;
    # 4: the (5, R, n_tiles) vocab tiles' statistics (`_tile_stats`), rows stride_tile apart
    acc_ptr,  # PHASE 2: (R, 4) fp32 out, pass 2's sums over this rank's slice; 3: their sums over the ranks
    V,
    stride_scale,  # 0 for one factor, 1 for one a row
    stride_t, stride_g, stride_gt, ignore_index,
    label_lo,  # the global id of column 0 (a label's column is label − label_lo)
    world,  # the ranks whose parts PHASE 2, 3 merge
    stride_part,  # R · _PARTS: from one rank's parts to the next; PHASE 4: from one plane of tiles to the next
    stride_tile,  # PHASE 4: from one row's tiles to the next
    stat_tiles,  # PHASE 4: the vocab tiles a row's statistics come in
    # runtime floats: a new value never recompiles. fold_s, fold_t: a head's scale σ where the kernel
    # does not transform at load (S_HEAD / T_HEAD 0: z = σ·s, σ > 0), else 1 (the loaded value is z)
    log2e_tau,  # log2(e)·fold_s / τ: (s − max)·log2e_tau is log2 of softmax(z/τ)'s numerator
    log2e_tau_t,  # log2(e)·fold_t / τ, for t
    log2e_ce,  # log2(e)·fold_s, for softmax(z) of the CE
    inv_tau,  # 1 / τ
    fold_s, fold_t,
    kl_ratio,  # ONLINE_KL: fold_t / fold_s (reverse), fold_s / fold_t (forward)
    s_mul, t_mul,  # S_HEAD (T_HEAD) 1: σ; 2, 3: −2 log2(e)·|σ|/c (`head_mode`)
    beta,  # JSD mixture weight; cosine's factor
    log2_beta,  # log2 β        of the mixture (JSD; skew KL: β = α, skew reverse KL: β = 1 − α)
    log2_1mbeta,  # log2 (1 − β)  of the mixture
    pow_p, pow_q,  # the power family's powers of p and q in its cross term p^pow_p q^pow_q (`_power_term`)
    w_hard,  # weight of dCE/ds in dL/ds, times σ_s (dz/ds, but for a softcap's 1 − (z/c)²)
    w_soft,  # weight of dsoft/ds in dL/ds (spec.soft_scale), times σ_s
    t_ratio,  # T_GRAD: σ_t / σ_s, the teacher's dz/dt in its dL/dt where w_soft carries σ_s
    # compile-time switches
    LOSS: tl.constexpr,  # losses.LOSS_ID of spec.kind (JSD endpoints resolved)
    SOFT: tl.constexpr,  # compute the divergence (t is read)
    CE: tl.constexpr,  # compute the hard CE (labels given and wanted)
    LABELS: tl.constexpr,  # labels given: rows equal to ignore_index are skipped
    GRAD_SOFT: tl.constexpr,  # dsoft/ds enters dL/ds (grad, SOFT, w_soft != 0)
    GRAD_CE: tl.constexpr,  # dCE/ds enters dL/ds (grad, CE, w_hard != 0)
    GRAD_PASS: tl.constexpr,  # pass that writes dL/ds: 2, 3, or 0 for no grad
    CE_IS_Q: tl.constexpr,  # τ = 1 and a softmax loss: softmax(s) is q, so the CE reuses q's statistics
    ONLINE_KL: tl.constexpr,  # a KL whose loss pass 1 takes online (reverse_kl; forward_kl without grad)
    S_HEAD: tl.constexpr, T_HEAD: tl.constexpr,  # each side's transform at load (`head`): 0 none (σ folded), 1 σ < 0, 2 cap
    SCALED: tl.constexpr,  # a fold is not 1: the loops read log2e_tau_t, log2e_ce, kl_ratio
    STATS: tl.constexpr,  # write the entropy of q
    RTNE_BITS: tl.constexpr,  # `triton_common.store_grad`: under the interpreter, with a bf16 dL/ds
    RCP_FMA: tl.constexpr,  # softcap loads' reciprocal on the FMA pipe: bit 2·(pass − 1) + (0: s, 1: t), SOFTCAP_RCP_FMA
    IN_PLACE: tl.constexpr,  # dL/ds goes into s's own bytes (`grad_view`)
    PULL: tl.constexpr,  # mutual (LOSS jeffreys, its value): the student's dL/ds forward KL's, c (q − p)
    T_GRAD: tl.constexpr,  # a learning teacher (mutual, co_jeffreys; PHASE 0): dL/dt written into gt
    T_IN_PLACE: tl.constexpr, T_RTNE_BITS: tl.constexpr,  # gt is t's `grad_view` (bf16 in fp32's bytes); gt's RTNE_BITS
    T_BIAS: tl.constexpr,  # tb_ptr holds the teacher head's bias: t + bias is its logits
    PSI: tl.constexpr,  # the power family: ψ's forms for its two powers (`_power_term`, `_psi_mode`)
    PHASE: tl.constexpr,  # 0: the whole row; a row sharded over ranks' vocab slices: 1, 2, 3 (`rows`);
    # 4: the whole row, pass 1's statistics given per vocab tile
    WORLD_BLOCK: tl.constexpr,  # a power of 2 >= world (PHASE 4: >= stat_tiles)
    BLOCK_V: tl.constexpr,
):
    """The three passes over one row (PHASE 0), or a sharded row's phase of them (`rows`). One program per
    row. Pass 2 walks the row backwards, so it starts on the tiles pass 1 read last (the likeliest to be in
    L2), and pass 3 forwards again."""
    row = tl.program_id(0)  # the pointers advanced to the row
    s_row = s_ptr + row.to(tl.int64) * V  # int64: R × V may exceed 2^31
    g_row = g_ptr + row.to(tl.int64) * stride_g
    t_row = t_ptr + row.to(tl.int64) * stride_t
    gt_row = gt_ptr + row.to(tl.int64) * stride_gt
    labels_ptr, soft_ptr, hard_ptr, ent_ptr = labels_ptr + row, soft_ptr + row, hard_ptr + row, ent_ptr + row
    scale_ptr += row * stride_scale
    part_row = part_ptr + row * _PARTS
    acc_row = acc_ptr + row * 4
    n_tiles = tl.cdiv(V, BLOCK_V)
    cols = tl.arange(0, BLOCK_V)
    if not SCALED:  # no fold: the loops run on the constants they had before heads had transforms
        log2e_tau_t = log2e_tau
        log2e_ce = LOG2E

    valid, label = _row_label(labels_ptr, ignore_index, label_lo, LABELS)
    soft, hard, entropy = 0.0, 0.0, 0.0
    if valid:
        # -------- pass 1: row statistics per lane, merged once after it (or given: PHASE 2, 3, 4)
        m_s, l_s, l_c, m_t, l_t, r_kl, ss, tt, st, r_ent, s_y, in_range = _row_stats(
            s_row, t_row, tb_ptr, part_ptr, part_row, row, V, cols, label, world, stride_part, stride_tile, stat_tiles,
            log2e_tau, log2e_tau_t, log2e_ce, kl_ratio, s_mul, t_mul,
            LOSS, SOFT, CE, CE_IS_Q, ONLINE_KL, S_HEAD, T_HEAD, SCALED, STATS, RCP_FMA, T_BIAS, PHASE, WORLD_BLOCK,
            BLOCK_V)
        if PHASE == 1:
            _store_parts(part_row, m_s, l_s, l_c, m_t, l_t, r_kl, ss, tt, st, r_ent, s_y, in_range, CE or LOSS == _DKD)
        else:
            m_s, l_s, l_c, m_t, l_t, r_ent, mix_a, mix_b = _with_label(  # the mixture's logs; DKD's log2 P and Q
                m_s, l_s, l_c, m_t, l_t, r_ent, s_y, st, in_range, log2_beta, log2_1mbeta, log2e_tau, log2e_tau_t,
                log2e_ce, kl_ratio, LOSS, SCALED, STATS)
            log2_l_s, log2_l_t, log2_l_c, hard, entropy = _row_logs(
                m_s, l_s, l_c, l_t, r_ent, s_y, in_range, fold_s, inv_tau, CE, CE_IS_Q, STATS)
            soft, c_ce, c_q, c_st, f_q, f_p, f1, f0, f_a, f_b = _pass2_factors(
                scale_ptr, w_soft, w_hard, in_range, l_s, l_t, log2_l_s, log2_l_t, r_kl, ss, tt, st,
                fold_s, fold_t, inv_tau, beta, LOSS, SOFT, CE, GRAD_SOFT, GRAD_CE, CE_IS_Q, ONLINE_KL)
            if LOSS == _DKD:
                f_q, f_p, f0, tckd, mix_b = _dkd_factors(m_s, m_t, log2_l_s, log2_l_t, s_y, st, mix_a, mix_b, c_q,
                                                         c_st, log2e_tau, log2e_tau_t, pow_p, pow_q, SCALED, PSI)
            # -------- pass 2: loss terms; dL/ds for forward_kl, reverse_kl, cosine, CE-only
            if PHASE == 3:  # the ranks' sums of pass 2's terms
                acc, acc2, acc3, acc4 = tl.load(acc_row), tl.load(acc_row + 1), tl.load(acc_row + 2), tl.load(acc_row + 3)
            else:
                acc, acc2, acc3, acc4 = _loss_pass(
                    s_row, g_row, t_row, tb_ptr, V, n_tiles, cols, label,
                    m_s, m_t, log2_l_s, log2_l_t, log2_l_c,
                    log2e_tau, log2e_tau_t, log2e_ce, s_mul, t_mul, mix_a, mix_b, pow_p, pow_q,
                    f_q, f_p, f1, f0, f_a, f_b, c_ce, c_q, part_ptr, row,
                    LOSS, SOFT, GRAD_SOFT, GRAD_CE, GRAD_PASS, CE_IS_Q, ONLINE_KL, S_HEAD, T_HEAD, RTNE_BITS,
                    RCP_FMA, IN_PLACE, PSI, SCALED, T_BIAS, BLOCK_V,
                )
            if PHASE == 2:  # this rank's sums, added over the ranks before phase 3
                tl.store(acc_row, acc)
                tl.store(acc_row + 1, acc2)
                tl.store(acc_row + 2, acc3)
                tl.store(acc_row + 3, acc4)
            soft, k_jsd, tvd_pos, tvd_neg, tvd_zero = _divergence(
                acc, acc2, acc3, acc4, soft, beta, log2_beta, log2_1mbeta, pow_p, pow_q, LOSS, SOFT, ONLINE_KL)
            if LOSS == _DKD:
                soft = _dkd_value(acc, tckd, mix_a, in_range, pow_p, pow_q)

            # -------- pass 3: dL/ds for jsd, tvd, as q · (f1 · x + f0) with x the element's log-ratio (or
            # TVD's sign)
            if GRAD_PASS == 3 and PHASE != 2:
                f1, f0, f_lo, f_hi, f_eq = _pass3_factors(c_q, c_st, beta, log2_1mbeta, pow_p, pow_q, soft, k_jsd,
                                                          tvd_pos, tvd_neg, tvd_zero, LOSS, PSI)
                f0, ft1, ft_lo, ft0 = _learning_factors(f0, c_q, c_st, t_ratio, soft, k_jsd, PULL)
                _grad_pass(
                    s_row, g_row, t_row, gt_row, tb_ptr, V, cols, label,
                    m_s, m_t, log2_l_s, log2_l_t, log2_l_c,
                    log2e_tau, log2e_tau_t, log2e_ce, s_mul, t_mul, log2_beta, log2_1mbeta, pow_p, pow_q,
                    f1, f0, f_lo, f_hi, f_eq, c_ce, ft1, ft_lo, ft0,
                    LOSS, GRAD_SOFT, GRAD_CE, CE_IS_Q, S_HEAD, T_HEAD, RTNE_BITS, RCP_FMA, IN_PLACE, PSI, SCALED,
                    PULL, T_GRAD, T_IN_PLACE, T_RTNE_BITS, T_BIAS, BLOCK_V,
                )
    elif GRAD_PASS != 0 and (PHASE == 0 or PHASE == 2 or PHASE == 4):
        _fill_zeros(g_row, V, BLOCK_V)
        if T_GRAD:
            _fill_zeros(gt_row, V, BLOCK_V)
    if PHASE != 1:
        tl.store(soft_ptr, soft)
        tl.store(hard_ptr, hard)
        if STATS:
            tl.store(ent_ptr, entropy)


# --------------------------------------------------------------------------------------------- launcher


# AKL's head (`flashkd.losses.akl_head`): the teacher's ids in the order of p descending, ties by id ascending;
# the longest prefix whose p sums to at most μ, and the first id always. The kernels below find it without a
# sort of the row, in the order of the teacher's logits (p's own order, before p is rounded: where two logits
# round to one p, the larger logit comes first), as three numbers a row that pass 2 compares each column with:
#   κ       an order key: every column at or above it is in the head
#   κ_v     the key of the group of ids, one logit, that the head ends in
#   cut     the largest id of that group in the head (−1: none)
# First a pass for the teacher's max and sum and each lane's four largest keys (`_akl_top_kernel`): it settles a
# row whose top id alone holds more than μ. Then, from those keys alone, a row whose head lies within them: the
# candidates sorted, their p summed, where the one after the head lies above every lane's fourth key
# (`_akl_candidates_kernel`: a trained teacher's row, its head a few to a few hundred ids). The rows left (a
# flat teacher's, its head thousands of ids) take the bins (`_akl_head_kernel`): the exponent
# z = log2 of p's numerator (≤ 0, the same for equal keys, never decreasing as the key grows) is binned, BINS
# bins a pass over a range of z, starting below the lanes' maxima whose p passes μ (none of the head lies
# lower); each bin's mass lies between its count times p at its ends, which brackets where the prefix's mass
# crosses μ to a few bins, and the next pass bins those (about CAP columns are left after two). One more pass
# keeps the ids in the bracket (a row's scratch of CAP) and sums p above it exactly; those ids sorted by
# (key, id) and their p summed on top give the prefix exactly. 3 to 4 reads of the row, a few operations an
# element (a bin index, a histogram). Where the bracket holds more than CAP ids after LEVELS passes (a tied
# group of thousands: a flat row) or rounding put the crossing outside it, a search settles κ: over the keys'
# 2^32 values, 16 parts a pass (15 masses of p summed against 15 thresholds), at most about 9 passes, bracketed
# by the lanes' maxima; then one pass for κ_v and p_v and one for the cut (the group's first
# ⌊(μ − F(κ)) / p_v⌋ ids by id, at least one where no column is at or above κ, as the torch definition counts).
_AKL_PARTS = 16
_AKL_BINS = 256
_AKL_CAP = 256
_AKL_LEVELS = 3
_AKL_OUT: tl.constexpr = tl.constexpr(6)  # a row's (κ, κ_v, cut, searched, m_t bits, l_t bits), int64


_KEY_FLOOR: tl.constexpr = tl.constexpr(-2139095042)  # below every order key: the key of −inf, less one
_KEY_CEIL: tl.constexpr = tl.constexpr(2139095041)  # above every order key: the key of +inf, plus one


@triton.jit
def _akl_key(t, T_HEAD: tl.constexpr):
    """int32 keys that order the loaded teacher logits t as their probabilities (z = σ t, so −t for σ < 0:
    T_HEAD 1 and 3), −0.0 as +0.0, a −inf (absent) column below every other (a NaN outside the floor and
    ceiling)."""
    x = t
    if T_HEAD == 1 or T_HEAD == 3:
        x = tl.where(t == -float("inf"), t, -t)
    return order_key(x)


@triton.jit
def _akl_logit(key, T_HEAD: tl.constexpr):
    """The loaded teacher logit of an order key (`_akl_key` undone: `order_key` is its own inverse)."""
    x = (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    if T_HEAD == 1 or T_HEAD == 3:
        x = tl.where(x == -float("inf"), x, -x)
    return x


@triton.jit
def _akl_tile(t_row, offs, V, m_t, log2_l, log2e_tau_t, t_mul, T_HEAD: tl.constexpr):
    """A tile's p (as pass 2 makes it), order keys (the floor past V) and exponents z (p = 2^(z − log2 l), −inf
    past V); a caller's unused ones cost nothing (the compiler drops them)."""
    raw = tl.load(t_row + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
    z = (head(raw, t_mul, T_HEAD)[0] - m_t) * log2e_tau_t
    return tl.exp2(z - log2_l), tl.where(offs < V, _akl_key(raw, T_HEAD), _KEY_FLOOR), z


@triton.jit
def _akl_bracket(t_row, keep, k_lane, m_t, log2_l, V, mu, log2e_tau_t, t_mul, search, T_HEAD: tl.constexpr,
                 PARTS: tl.constexpr, BLOCK_V: tl.constexpr, SCAN: tl.constexpr, BINS: tl.constexpr,
                 CAP: tl.constexpr, LEVELS: tl.constexpr):
    """A row's (κ, κ_v, cut, searched) from its lanes' largest keys k_lane and the teacher's m_t, log2 l: the
    bins' bracket, the kept ids sorted, and where those miss the prefix's end, the search."""
    cols = tl.arange(0, SCAN)
    # the lanes' largest keys, distinct columns, bound F(key) = Σ_{keys >= key} p from below: where those at or
    # over a key pass μ, the head ends above it (a teacher whose top id holds more than μ: at the top)
    k_top = tl.sort(k_lane, descending=True)
    z_top = tl.where(k_top > _KEY_FLOOR, (head(_akl_logit(k_top, T_HEAD), t_mul, T_HEAD)[0] - m_t) * log2e_tau_t,
                     -float("inf"))
    over = tl.cumsum(tl.exp2(z_top - log2_l), 0) > mu
    k_lo = tl.max(tl.where(over, k_top, _KEY_FLOOR), 0)
    # the fast path: [zl, zh) narrowed by histograms until about CAP columns are in it
    zl = tl.maximum(tl.max(tl.where(over & (k_top == k_lo), z_top, -float("inf")), 0), -64.0)  # p below 2^-64 l
    zh = zl * 0.0 + 1.0  # above every z (z <= 0)
    bins = tl.arange(0, BINS)
    n_in = V + 1
    level = V * 0
    while (n_in > CAP) & (level < LEVELS) & (search == 0):
        inv = BINS / (zh - zl)
        count = tl.zeros([BINS], tl.int32)
        up_lane = tl.zeros([SCAN], tl.float32)
        below_lane = tl.zeros([SCAN], tl.int32)
        for start in range(0, V, SCAN):
            p, _k, z = _akl_tile(t_row, start + cols, V, m_t, log2_l, log2e_tau_t, t_mul, T_HEAD)
            at = tl.minimum(tl.maximum((z - zl) * inv, 0.0), BINS - 1.0).to(tl.int32)
            count += tl.histogram(at, BINS, mask=(z >= zl) & (z < zh))
            up_lane += tl.where(z >= zh, p, 0.0)
            below_lane += ((z < zl) & (z > -float("inf"))).to(tl.int32)
        up = tl.sum(up_lane, 0)
        below = tl.sum(below_lane, 0)
        # each bin's mass between its count times p at its lower and upper edges: the mass at or over a bin
        # bounded both ways, from below also as 1 less the bound from above of all under it (a flat row's
        # bins each undercount by up to the factor across a bin); the head ends in a bin whose bound from
        # below (at or over it) passes μ while the bound from above (over it) does not
        edge = zl + bins.to(tl.float32) / inv
        low = count.to(tl.float32) * tl.exp2(edge - log2_l)
        high = count.to(tl.float32) * tl.exp2(edge + 1.0 / inv - log2_l)
        under_high = below.to(tl.float32) * tl.exp2(zl - log2_l) + tl.cumsum(high, 0) - high
        at_or_over_low = tl.maximum(up + tl.sum(low, 0) - tl.cumsum(low, 0) + low, 1.0 - under_high)
        over_high = up + tl.sum(high, 0) - tl.cumsum(high, 0)
        b_hi = tl.min(tl.where(over_high <= mu, bins, BINS - 1), 0)
        b_lo = tl.max(tl.where(at_or_over_low > mu, bins, 0), 0)
        n_in = tl.sum(tl.where((bins >= b_lo) & (bins <= b_hi), count, 0), 0)
        zh_new = tl.where(b_hi == BINS - 1, zh, zl + (b_hi + 1).to(tl.float32) / inv)
        zl = tl.where(b_lo == 0, zl, zl + b_lo.to(tl.float32) / inv)
        zh = zh_new
        level += 1
    # keep the ids in [zl, zh) (their first CAP), sum p over zh exactly
    n = V * 0
    n_up_lane = tl.zeros([SCAN], tl.int32)
    up_lane = tl.zeros([SCAN], tl.float32)
    for start in range(0, V, SCAN):
        offs = start + cols
        p, _k, z = _akl_tile(t_row, offs, V, m_t, log2_l, log2e_tau_t, t_mul, T_HEAD)
        inside = (z >= zl) & (z < zh)
        slot = n + tl.cumsum(inside.to(tl.int32), 0) - 1
        tl.store(keep + slot, offs, mask=inside & (slot < CAP))
        n += tl.sum(inside.to(tl.int32), 0)
        n_up_lane += (z >= zh).to(tl.int32)
        up_lane += tl.where(z >= zh, p, 0.0)
    n_up = tl.sum(n_up_lane, 0)
    up = tl.sum(up_lane, 0)
    tl.debug_barrier()  # the row's threads read the ids that other threads stored
    slots = tl.arange(0, CAP)
    kept = slots < n
    ids = tl.load(keep + slots, mask=kept, other=0)
    key = tl.where(kept, _akl_tile(t_row, ids, V, m_t, log2_l, log2e_tau_t, t_mul, T_HEAD)[1], _KEY_FLOOR)
    # (key, id) in one int64, sorted descending: keys descending, ids ascending within a key
    order = tl.sort((key.to(tl.int64) << 32) | (4294967295 - ids.to(tl.int64)), descending=True)
    key_s = (order >> 32).to(tl.int32)
    id_s = (4294967295 - (order & 4294967295)).to(tl.int32)
    p_s = tl.where(kept, _akl_tile(t_row, id_s, V, m_t, log2_l, log2e_tau_t, t_mul, T_HEAD)[0], 0.0)
    fits = tl.sum(((up + tl.cumsum(p_s, 0) <= mu) & kept).to(tl.int32), 0)  # the prefix's kept ids
    last = tl.where((fits == 0) & (n_up == 0), 0, fits - 1)  # the row's first id always; −1: none kept
    kappa = tl.max(tl.where(slots == tl.maximum(last, 0), key_s, _KEY_FLOOR), 0) + 1
    k_v = kappa - 1
    cut = tl.where(last >= 0, tl.max(tl.where(slots == last, id_s, -1), 0), -1)
    searched = (search != 0) | (n > CAP) | (up > mu) | (fits >= n)
    if searched:
        kappa, k_v, cut = _akl_search(t_row, k_lo, tl.max(k_top, 0) + 1, m_t, log2_l, V, mu, log2e_tau_t, t_mul,
                                      T_HEAD, PARTS, BLOCK_V)
    return kappa, k_v, cut, searched


@triton.jit
def _akl_search(t_row, k_lo, k_hi, m_t, log2_l, V, mu, log2e_tau_t, t_mul, T_HEAD: tl.constexpr,
                PARTS: tl.constexpr, BLOCK_V: tl.constexpr):
    """A row's (κ, κ_v, cut) by the search over the keys in [k_lo, k_hi), where the bins' bracket missed."""
    parts = tl.arange(0, PARTS)
    lanes = tl.arange(0, BLOCK_V)
    lo = tl.zeros([PARTS], tl.int64) + k_lo
    hi = tl.zeros([PARTS], tl.int64) + k_hi
    f_hi = tl.zeros([PARTS], tl.float32)
    while tl.max(hi - lo, 0) > 1:
        th = (lo + ((hi - lo) * (parts + 1)) // PARTS).to(tl.int32)  # th[PARTS − 1] = hi; keys are int32
        mass = tl.zeros([PARTS], tl.float32)
        for start in range(0, V, BLOCK_V):
            p2, key2, _z2 = _akl_tile(t_row, start + lanes, V, m_t, log2_l, log2e_tau_t, t_mul, T_HEAD)
            mass += tl.sum(tl.where(key2[None, :] >= th[:, None], p2[None, :], 0.0), 1)
        fit = (mass <= mu) | (parts == PARTS - 1)
        new_hi = tl.min(tl.where(fit, th, _KEY_CEIL), 0).to(tl.int64)
        f_hi = tl.zeros([PARTS], tl.float32) + tl.max(tl.where(fit & (th == new_hi), mass, -1.0), 0)
        lo = tl.zeros([PARTS], tl.int64) + tl.max(tl.where(fit, lo, th.to(tl.int64)), 0)
        hi = tl.zeros([PARTS], tl.int64) + new_hi
    kappa = tl.max(hi, 0).to(tl.int32)
    f_k = tl.max(f_hi, 0)
    # κ_v: the largest key below κ, and its p
    k_below = tl.full([BLOCK_V], _KEY_FLOOR, tl.int32)
    p_below = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, V, BLOCK_V):
        p2, key2, _z2 = _akl_tile(t_row, start + lanes, V, m_t, log2_l, log2e_tau_t, t_mul, T_HEAD)
        higher = (key2 < kappa) & (key2 > k_below)
        p_below = tl.where(higher, p2, p_below)
        k_below = tl.where(higher, key2, k_below)
    k_v = tl.max(k_below, 0)
    p_v = tl.max(tl.where(k_below == k_v, p_below, 0.0), 0)
    need = tl.floor((mu - f_k) / tl.where(p_v > 0.0, p_v, 1.0))
    need = tl.maximum(need, tl.where(f_k == 0.0, 1.0, 0.0))
    need = tl.minimum(need, V + 1.0).to(tl.int32)  # the group's first `need` ids by id
    cut = tl.where(need > 0, V, -1)  # V: the group's ids all (fewer than need)
    seen = need * 0
    for start in range(0, V, BLOCK_V):
        offs2 = start + lanes
        group = (offs2 < V) & (_akl_tile(t_row, offs2, V, m_t, log2_l, log2e_tau_t, t_mul, T_HEAD)[1] == k_v)
        rank = seen + tl.cumsum(group.to(tl.int32), 0)
        cut = tl.minimum(cut, tl.min(tl.where(group & (rank == need), offs2, V), 0))
        seen += tl.sum(group.to(tl.int32), 0)
    return kappa, k_v, cut


@triton.jit
def _akl_store_head(out, kappa, k_v, cut, searched):
    """A row's (κ, κ_v, cut, searched) into its int64 slots of AKL's head (`akl_head_keys`)."""
    tl.store(out, kappa.to(tl.int64))
    tl.store(out + 1, k_v.to(tl.int64))
    tl.store(out + 2, cut.to(tl.int64))
    tl.store(out + 3, searched.to(tl.int64))


@triton.jit
def _akl_candidates(k1, k2, k3, k4, i1, i2, i3, i4, m_t, log2_l, mu, log2e_tau_t, t_mul, T_HEAD: tl.constexpr,
                    SCAN: tl.constexpr):
    """The head from the lanes' four largest keys (k1 ≥ k2 ≥ k3 ≥ k4 a lane, their columns i1..i4): the candidates
    sorted by (key, id), their p summed in that order; the head is the first max(fits, 1) of them, where the
    one after it lies above every lane's fourth key (every column outside the candidates is at or below that
    bound, so the candidates hold every column at or over the one after the head: the order is the row's).
    A trained teacher's row (a head of tens of ids) nearly always. Returns (key, id of the head's last, ok)."""
    keys = tl.reshape(tl.join(tl.join(k1, k2), tl.join(k3, k4)), [4 * SCAN])
    ids = tl.reshape(tl.join(tl.join(i1, i2), tl.join(i3, i4)), [4 * SCAN])
    order = tl.sort((keys.to(tl.int64) << 32) | (4294967295 - ids.to(tl.int64)), descending=True)
    key_s = (order >> 32).to(tl.int32)
    id_s = (4294967295 - (order & 4294967295)).to(tl.int32)
    valid = key_s > _KEY_FLOOR
    z = tl.where(valid, (head(_akl_logit(key_s, T_HEAD), t_mul, T_HEAD)[0] - m_t) * log2e_tau_t, -float("inf"))
    fits = tl.sum(((tl.cumsum(tl.exp2(z - log2_l), 0) <= mu) & valid).to(tl.int32), 0)
    slots = tl.arange(0, 4 * SCAN)
    last = tl.maximum(fits - 1, 0)
    key_last = tl.max(tl.where(slots == last, key_s, _KEY_FLOOR), 0)
    id_last = tl.max(tl.where(slots == last, id_s, -1), 0)
    key_next = tl.max(tl.where(slots == tl.maximum(fits, 1), key_s, _KEY_FLOOR), 0)
    return key_last, id_last, key_next > tl.max(k4, 0)


@triton.jit(do_not_specialize=["search"])
def _akl_top_kernel(t_ptr, out_ptr, lanes_ptr, V, stride_t, mu, log2e_tau_t, t_mul, search, T_HEAD: tl.constexpr,
                    SCAN: tl.constexpr):
    """The first read of a row of AKL's head (above): the teacher's (m_t, l_t) at τ as fp32 bits into out_ptr
    (R, _AKL_OUT) columns 4, 5, and the row's (κ, κ_v, cut, 0) where that read settles it (μ >= 1: the whole row,
    κ and κ_v the floor, cut −1; the top id alone over μ); else searched −1 and each lane's four largest keys
    and their columns into lanes_ptr (R, 8, SCAN) for `_akl_candidates_kernel` and `_akl_head_kernel`. The walk
    SCAN columns a step, the sums kept per lane and reduced once after it (a reduction a step is a barrier a
    step); a small kernel, many rows an SM at once."""
    row = tl.program_id(0)
    t_row = t_ptr + row.to(tl.int64) * stride_t
    cols = tl.arange(0, SCAN)
    m = tl.full([SCAN], M_START, tl.float32)
    l = tl.zeros([SCAN], tl.float32)
    # each lane's four largest keys, descending, and their columns (a key equal to one kept goes below it: its
    # column is later, and ties go by id)
    k1 = tl.full([SCAN], _KEY_FLOOR, tl.int32)
    k2, k3, k4 = k1, k1, k1
    i1 = tl.zeros([SCAN], tl.int32) + V
    i2, i3, i4 = i1, i1, i1
    for start in range(0, V, SCAN):
        offs = start + cols
        raw = tl.load(t_row + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
        b = head(raw, t_mul, T_HEAD)[0]
        l = lane_sum(l, m, b, log2e_tau_t)
        m = tl.maximum(m, b)
        key = tl.where(offs < V, _akl_key(raw, T_HEAD), _KEY_FLOOR)
        c1, c2, c3, c4 = key > k1, key > k2, key > k3, key > k4
        k4, i4 = tl.where(c3, k3, tl.where(c4, key, k4)), tl.where(c3, i3, tl.where(c4, offs, i4))
        k3, i3 = tl.where(c2, k2, tl.where(c3, key, k3)), tl.where(c2, i2, tl.where(c3, offs, i3))
        k2, i2 = tl.where(c1, k1, tl.where(c2, key, k2)), tl.where(c1, i1, tl.where(c2, offs, i2))
        k1, i1 = tl.where(c1, key, k1), tl.where(c1, offs, i1)
    m_t = tl.max(m, 0)
    l_t = tl.sum(l * tl.exp2((m - m_t) * log2e_tau_t), 0)
    log2_l = tl.log2(l_t)
    # a teacher whose top id alone holds more than μ (most rows of a trained one): the head is that id, the first
    # of the top key's (p = 2^(0 − log2 l), as `_akl_bracket` makes it: the same outputs)
    k_max = tl.max(k1, 0)
    kappa = k_max + 1
    k_v = k_max
    cut = tl.min(tl.where(k1 == k_max, i1, V), 0)
    settled = k_max * 0
    if mu >= 1.0:  # every prefix sums to at most 1: the whole row (κ below every key), where rounding may not say so
        kappa = k_max * 0 + _KEY_FLOOR
        k_v = kappa
        cut = k_max * 0 - 1
    elif (tl.exp2(-log2_l) <= mu) | (search != 0):  # left to the kernels after it, with the lanes' keys
        settled = settled - 1
        lanes = lanes_ptr + row.to(tl.int64) * (8 * SCAN) + cols
        tl.store(lanes, k1)
        tl.store(lanes + SCAN, k2)
        tl.store(lanes + 2 * SCAN, k3)
        tl.store(lanes + 3 * SCAN, k4)
        tl.store(lanes + 4 * SCAN, i1)
        tl.store(lanes + 5 * SCAN, i2)
        tl.store(lanes + 6 * SCAN, i3)
        tl.store(lanes + 7 * SCAN, i4)
    out = out_ptr + row.to(tl.int64) * _AKL_OUT
    _akl_store_head(out, kappa, k_v, cut, settled)
    tl.store(out + 4, m_t.to(tl.int32, bitcast=True).to(tl.int64))  # the row kernel's pass 1 reads only s then
    tl.store(out + 5, l_t.to(tl.int32, bitcast=True).to(tl.int64))


@triton.jit
def _akl_candidates_kernel(out_ptr, lanes_ptr, mu, log2e_tau_t, t_mul, T_HEAD: tl.constexpr, SCAN: tl.constexpr):
    """The rows `_akl_top_kernel` left (searched −1) whose head lies within the lanes' four largest keys
    (`_akl_candidates`): their (κ, κ_v, cut, 0) into out_ptr, from lanes_ptr alone (no read of the row); the
    others stay −1 for `_akl_head_kernel`."""
    row = tl.program_id(0)
    out = out_ptr + row.to(tl.int64) * _AKL_OUT
    if tl.load(out + 3) < 0:
        m_t, l_t = _akl_teacher_stats(out_ptr, row)
        log2_l = tl.log2(l_t)
        lanes = lanes_ptr + row.to(tl.int64) * (8 * SCAN) + tl.arange(0, SCAN)
        key_last, id_last, ok = _akl_candidates(
            tl.load(lanes), tl.load(lanes + SCAN), tl.load(lanes + 2 * SCAN), tl.load(lanes + 3 * SCAN),
            tl.load(lanes + 4 * SCAN), tl.load(lanes + 5 * SCAN), tl.load(lanes + 6 * SCAN), tl.load(lanes + 7 * SCAN),
            m_t, log2_l, mu, log2e_tau_t, t_mul, T_HEAD, SCAN)
        if ok:
            _akl_store_head(out, key_last + 1, key_last, id_last, key_last * 0)


@triton.jit(do_not_specialize=["search"])  # one compiled kernel for both (a search of 1 made a constant fails to build)
def _akl_head_kernel(t_ptr, out_ptr, keep_ptr, lanes_ptr, V, stride_t, mu, log2e_tau_t, t_mul, search,
                     T_HEAD: tl.constexpr, PARTS: tl.constexpr, BLOCK_V: tl.constexpr, SCAN: tl.constexpr,
                     BINS: tl.constexpr = 256, CAP: tl.constexpr = 256, LEVELS: tl.constexpr = 3):
    """The rows the kernels before it left (searched −1): their (κ, κ_v, cut, searched) of AKL's head (above)
    into out_ptr (R, _AKL_OUT), from its (m_t, l_t) there and the lanes' largest keys in lanes_ptr;
    searched 1 where the search settled it (always where search is 1, the bins' passes skipped: a runtime flag,
    so that both run the one compiled kernel); p as the row kernel's pass 2 makes it; keep_ptr: the row's CAP
    int32 of scratch. The bins' scans walk the row SCAN columns a step, the search's (PARTS, BLOCK_V) tiles are
    narrower. A settled row's program reads one number and ends."""
    row = tl.program_id(0)
    out = out_ptr + row.to(tl.int64) * _AKL_OUT
    if tl.load(out + 3) < 0:
        t_row = t_ptr + row.to(tl.int64) * stride_t
        m_t, l_t = _akl_teacher_stats(out_ptr, row)
        log2_l = tl.log2(l_t)
        k_lane = tl.load(lanes_ptr + row.to(tl.int64) * (8 * SCAN) + tl.arange(0, SCAN))  # the lanes' largest
        kappa, k_v, cut, searched = _akl_bracket(t_row, keep_ptr + row.to(tl.int64) * CAP, k_lane, m_t, log2_l, V,
                                                 mu, log2e_tau_t, t_mul, search, T_HEAD, PARTS, BLOCK_V, SCAN, BINS,
                                                 CAP, LEVELS)
        _akl_store_head(out, kappa, k_v, cut, searched)


def akl_head_keys(t: torch.Tensor, spec: LossSpec, search: bool = False) -> torch.Tensor:
    """(R, 6) int64 (κ, κ_v, cut, searched, m_t, l_t) of each row of the teacher logits t (R, V), unit vocab
    stride (above), m_t and l_t the teacher's max and sum at τ as fp32 bits (the row kernel's pass 1 takes
    them); μ >= 1: every column (κ below every key). search: the search alone (the fast path skipped)."""
    R, V = t.shape
    out = torch.empty(R, _AKL_OUT.value, dtype=torch.int64, device=t.device)
    t_head, fold_t, t_mul = head_mode(spec.teacher_logit_scale, spec.teacher_softcap)
    if R:
        with launching():
            scan = min(BLOCK_V, max(16, triton.next_power_of_2(V)))
            lanes = torch.empty(R, 8, scan, dtype=torch.int32, device=t.device)  # the lanes' four largest keys, ids
            args = (V, t.stride(0), float(spec.head_mass), math.log2(math.e) * fold_t / spec.temperature, t_mul,
                    int(search))
            _akl_top_kernel[(R,)](t, out, lanes, *args, T_HEAD=t_head, SCAN=scan, num_warps=8)
            if spec.head_mass < 1.0 and not search:  # the search alone: every row to `_akl_head_kernel`
                _akl_candidates_kernel[(R,)](out, lanes, *args[2:5], T_HEAD=t_head, SCAN=scan, num_warps=8)
            if spec.head_mass < 1.0:  # else every row is settled
                keep = torch.empty(R, _AKL_CAP, dtype=torch.int32, device=t.device)
                _akl_head_kernel[(R,)](t, out, keep, lanes, *args, T_HEAD=t_head, PARTS=_AKL_PARTS,
                                       BLOCK_V=min(256, max(16, triton.next_power_of_2(V))), SCAN=scan,
                                       BINS=_AKL_BINS, CAP=_AKL_CAP, LEVELS=_AKL_LEVELS, num_warps=4)
    return out


def rows(s, t, labels, spec: LossSpec, scale: torch.Tensor, grad: bool, stats: bool = False, *, ds=None, tiles=None,
         teacher_grad: bool | torch.Tensor = False, t_bias=None):
    """`sliced_rows` of whole rows: per-row (soft, hard) losses of one block, with nothing to exchange.
    teacher_grad (a learning teacher, `losses.LEARNING_LOSSES`): dL/dt too, written over t (fp32 or fp64, its
    rows contiguous) as `flashkd.backends.torch_rows.rows` writes it where True; where a tensor, into it: a
    buffer of its own or `grad_view(t, dtype, ...)`, dL/dt rounded once to bf16 in t's own bytes (t then spent),
    as dL/ds is for the student's gradient GEMMs; whole rows only."""
    return unexchanged(sliced_rows(s, t, labels, spec, scale, grad, stats, ds=ds, tiles=tiles,
                                   teacher_grad=teacher_grad, t_bias=t_bias))


def sliced_rows(s, t, labels, spec: LossSpec, scale: torch.Tensor, grad: bool, stats: bool = False, *, ds=None,
                tiles=None, start=None, teacher_grad: bool | torch.Tensor = False, t_bias=None):
    """Per-row (soft, hard) losses of one block, (R,) fp32 each; with `grad`, ds (default: s, overwritten)
    gets dL/ds = scale · (w_hard · dCE/ds + soft_scale · dsoft/ds). See `flashkd.backends` for the contract.

    s:      (R, V) student logits, contiguous, bf16 / fp16 / fp32 / fp64
    t:      (R, V) teacher logits, any of those dtypes, any row stride (copied if the vocab stride is not 1);
            None allowed when not spec.want_soft
    labels: (R,) int32 / int64, or None (every row valid, no CE)
    scale:  () or (R,) fp32 tensor on s's device, read by the kernel (no host sync); fp64 is accepted too
    ds:     (R, V) of those dtypes, unit vocab stride, sharing no memory with s or t, or None (s): the fp32
            logits of bf16 inputs write their gradient once, rounded to bf16, for the gradient GEMMs;
            or `grad_view(s, dtype, spec, grad)`, a view of s's own bytes (s is then spent)
    start:  None (s holds whole rows: a generator that yields nothing, `rows`), or the global id of the
            first column of a rank's slice of a vocab sharded over a process group: s, t hold the columns
            [start, start + V) of every row, labels are global ids, and the losses and dL/ds come out as
            those of the whole rows. The statistics the ranks exchange are the generator's: it yields
            ("gather", parts) and takes every rank's parts (world, R, n) in rank order, then (where the
            loss needs them) ("sum", accs) and takes their sums over the ranks; the exchanges are the
            caller's (`flashkd.core.backend.row_function`), no collective runs here
    tiles:  None, or pass 1's statistics of s and t given per vocab tile, as the CuTe logits GEMMs make them
            (`flashkd.backends.cute_gemm`): a (5, R, n) fp32 tensor, unit last stride, planes m_s, l_s, l_c,
            m_t, l_t of n vocab tiles (module doc of cute_gemm; l_c read only when the CE is wanted and
            softmax(s) is not q). The kernel then reads the row twice, not three times. Only where pass 1
            takes nothing else (`tiles_fit`); the whole vocab (start None)
    """
    t, gt, t_in_place = _check_teacher_grad(teacher_grad, s, t, spec, grad, start, tiles)
    t, ds, in_place = _check(s, t, labels, spec, scale, grad, stats, ds, start, tiles)
    # a learning teacher's dL/dt comes from the pass that writes the soft gradient (write_t); with none (a soft
    # weight of 0) it is 0, set after the kernel has read t
    write_t = gt is not None and _writing_pass(spec, grad) == 3
    t_bias = _check_t_bias(t_bias, s, spec, tiles)
    # allocate: every program writes its row's soft and hard (and entropy)
    R = s.shape[0]
    soft = torch.empty(R, dtype=torch.float32, device=s.device)
    hard = torch.empty(R, dtype=torch.float32, device=s.device)
    entropy = torch.empty(R if stats else 0, dtype=torch.float32, device=s.device)
    out = (soft, hard, entropy) if stats else (soft, hard)
    if R == 0:
        return out
    if labels is not None:
        labels = labels.contiguous()  # R integers: a strided view costs a negligible copy
    launch = _Launch(s, t, ds, labels, spec, scale, grad, stats, in_place, soft, hard, entropy, start,
                     gt if write_t else None, t_in_place, t_bias)
    if tiles is not None:
        launch(4, parts=tiles, world=tiles.shape[2], stride_part=tiles.stride(0), stride_tile=tiles.stride(1))
        return out
    if start is None:
        launch(0, parts=akl_head_keys(t, spec) if spec.want_soft and kernel_kind(spec) == "akl" else None)
        if gt is not None and not write_t:
            gt.zero_()
        return out
    # A row sharded over the ranks' vocab slices: pass 1 on each slice; its statistics (R · _PARTS fp32 a
    # rank) gathered from every rank, merged in phase 2 as a program's lanes are; pass 2; where the loss (or
    # its gradient) needs pass 2's sums over the whole row (forward KL's value, JSD's K, TVD's masses), their
    # sums over the ranks (4 fp32 a row) and phase 3 (pass 3). Nothing O(R · V) leaves the rank.
    parts = torch.empty(R, _PARTS.value, dtype=torch.float32, device=s.device)
    launch(1, parts=parts)
    parts = yield "gather", parts
    accs = torch.empty(R, 4, dtype=torch.float32, device=s.device)
    launch(2, parts=parts, accs=accs, world=parts.shape[0])
    if launch.needs_phase_3:
        if kernel_kind(spec) in ("renyi", "renyi_reverse"):  # S as (sum, max): merged, not added
            accs = _merge_power_sums((yield "gather", accs))
        else:
            accs = yield "sum", accs
        launch(3, parts=parts, accs=accs, world=parts.shape[0])
    return out


def _merge_power_sums(every):
    """Rényi's pass-2 sums of every rank (world, R, 4): its S as (Σ 2^(x − m), m) moved to the ranks' largest m
    and added, A and the count of infinite terms added (each rank the same order: the same bits)."""
    m = every[..., 2].amax(0)
    s = (every[..., 0] * torch.exp2(every[..., 2] - m)).sum(0)
    return torch.stack([s, every[..., 1].sum(0), m, every[..., 3].sum(0)], -1).contiguous()


def unexchanged(steps):
    """The value of a row function's steps (`sliced_rows`) that ask for no exchange: those of whole rows."""
    try:
        next(steps)
    except StopIteration as done:
        return done.value
    raise AssertionError("a row function of whole rows asked for an exchange over ranks")


BIAS_LOSSES_APART = ("akl", "dkd")  # read t outside the three passes (AKL's head kernel, DKD's label logit)


def _check_t_bias(t_bias, s, spec: LossSpec, tiles):
    """t_bias: None, or the teacher head's bias over t's columns, (V,) float on s's device, unit stride, added to t
    at every load (not for the losses of BIAS_LOSSES_APART, nor with tiles: their statistics came without it)."""
    if t_bias is None or not spec.want_soft:
        return None
    V = s.shape[1]
    if not isinstance(t_bias, torch.Tensor) or t_bias.shape != (V,) or t_bias.dtype not in _DTYPES \
            or t_bias.device != s.device or (t_bias.stride(0) != 1 and V > 1):
        raise ValueError(f"t_bias: expected None or a ({V},) float tensor with unit stride on {s.device}, got "
                         f"{_describe(t_bias)}")
    if kernel_kind(spec) in BIAS_LOSSES_APART or tiles is not None:
        raise ValueError(f"t_bias: expected None for loss {spec.loss!r}{' with tiles' if tiles is not None else ''} "
                         "(add the bias to t)")
    return t_bias


def _check_teacher_grad(teacher_grad, s, t, spec: LossSpec, grad: bool, start, tiles):
    """(t, gt, in place) checked for teacher_grad, where the kernel writes a learning teacher's dL/dt: the loss one
    of LEARNING_LOSSES, whole rows, t an fp32 / fp64 contiguous tensor of its own (never a copy made here). gt:
    t itself (teacher_grad True), or the tensor teacher_grad, a buffer of its own or `grad_view(t, ...)` (in
    place: bf16 dL/dt in t's bytes); None without dL/dt."""
    if not isinstance(teacher_grad, (bool, torch.Tensor)):
        raise TypeError(f"teacher_grad: expected a bool or a tensor for dL/dt, got {_describe(teacher_grad)}")
    if teacher_grad is False:
        return t, None, False
    if spec.kind not in LEARNING_LOSSES:
        raise ValueError(f"teacher_grad: the teacher learns from {', '.join(map(repr, LEARNING_LOSSES))} only, got "
                         f"loss {spec.loss!r}")
    if start is not None or tiles is not None:
        raise ValueError("teacher_grad: a learning teacher's rows run whole here (no vocab slice, no tile statistics)")
    if not (grad and spec.want_soft):
        return t, None, False
    if (not isinstance(t, torch.Tensor) or t.dtype not in (torch.float32, torch.float64) or not t.is_contiguous()
            or t.data_ptr() == s.data_ptr()):
        raise ValueError(f"t: expected an fp32 / fp64 contiguous tensor of its own for the teacher's gradient, got "
                         f"{_describe(t)}")
    if teacher_grad is True:
        return t, t, False
    gt = teacher_grad
    R, V = t.shape
    if gt.shape != t.shape or gt.dtype not in _DTYPES or gt.device != t.device or (gt.stride(1) != 1 and V > 1):
        raise ValueError(f"teacher_grad: expected an ({R}, {V}) float tensor with unit vocab stride on {t.device} "
                         f"for dL/dt, got {_describe(gt)}")
    storage = gt.untyped_storage().data_ptr()
    if R * V and storage == s.untyped_storage().data_ptr():
        raise ValueError("teacher_grad: expected a buffer of its own or `grad_view(t, ...)`, got a view of s")
    return t, gt, _own_view(gt, t, "teacher_grad", "t", spec, grad)


def _own_view(view, base, name, base_name, spec: LossSpec, grad: bool) -> bool:
    """Whether a gradient buffer `view` lies in `base`'s own bytes; only base's `grad_view` may (its stores land on
    columns the row has read): any other view of base's storage is an error naming it."""
    if base.numel() == 0 or view.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
        return False
    want = grad_view(base, view.dtype, spec, grad)
    if view.data_ptr() != want.data_ptr() or view.stride() != want.stride():
        raise ValueError(f"{name}: expected a buffer of its own or `grad_view({base_name}, ...)` (a view at byte offset "
                         f"{want.data_ptr() - base.data_ptr()} of {base_name} with strides {want.stride()}), got a view of "
                         f"{base_name}'s storage at byte offset {view.data_ptr() - base.data_ptr()} with strides "
                         f"{view.stride()}")
    return True


def _check(s, t, labels, spec: LossSpec, scale, grad: bool, stats: bool, ds, start, tiles):
    """`rows`' arguments checked; returns (t with unit vocab stride, ds (s where None), whether ds is s's own
    `grad_view`)."""
    if stats and not spec.want_soft:
        raise ValueError("stats: the statistics ride on the soft term's passes; spec.want_soft must be True")
    if spec.want_soft and kernel_kind(spec) not in KERNEL_LOSSES:
        raise ValueError(f"spec: expected a loss of {', '.join(map(repr, KERNEL_LOSSES))} (the others run on the "
                         f"torch rows), got {spec.loss!r}")
    if spec.want_soft and kernel_kind(spec) == "akl" and (start is not None or tiles is not None):
        raise ValueError("spec: loss='akl' runs here on whole rows (its head is found over the row); a vocab slice "
                         "takes the torch rows")
    if spec.want_soft and kernel_kind(spec) == "dkd" and labels is None:
        raise ValueError("labels: loss='dkd' reads the target class of each row; got labels=None")
    if not isinstance(s, torch.Tensor) or s.dim() != 2:
        raise ValueError(f"s: expected a 2-D (R, V) tensor, got {_describe(s)}")
    if s.dtype not in _DTYPES:
        raise TypeError(f"s: expected bfloat16, float16, float32 or float64, got {s.dtype}")
    if not s.is_contiguous():
        raise ValueError(f"s: expected a contiguous tensor, got strides {tuple(s.stride())}")
    R, V = s.shape
    if not 1 <= V < 2**31:
        raise ValueError(f"s: expected 1 <= V < 2**31 columns, got V = {V}")
    if spec.want_soft:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"t: expected the teacher logits (spec.want_soft is True), got {_describe(t)}")
        if t.shape != s.shape:
            raise ValueError(f"t: expected shape {tuple(s.shape)} like s, got {tuple(t.shape)}")
        if t.dtype not in _DTYPES:  # read in fp32 like s: fp32 s with bf16 t for dense teacher logits as passed
            raise TypeError(f"t: expected bfloat16, float16, float32 or float64, got {t.dtype}")
        if t.device != s.device:
            raise ValueError(f"t: expected device {s.device} like s, got {t.device}")
        if t.stride(1) != 1 and V > 1:
            t = t.contiguous()  # the kernel steps through a row with unit stride; rows may be apart
    if labels is not None:
        if not isinstance(labels, torch.Tensor) or labels.shape != (R,):
            raise ValueError(f"labels: expected shape ({R},), got {_describe(labels)}")
        if labels.dtype not in _LABEL_DTYPES:
            raise TypeError(f"labels: expected int32 or int64, got {labels.dtype}")
        if labels.device != s.device:
            raise ValueError(f"labels: expected device {s.device} like s, got {labels.device}")
    if not isinstance(scale, torch.Tensor) or scale.shape not in ((), (R,)) or scale.dtype not in _SCALE_DTYPES:
        raise TypeError(f"scale: expected a 0-d or ({R},) float32 (or float64) tensor, got {_describe(scale)}")
    if scale.device != s.device:
        raise ValueError(f"scale: expected device {s.device} like s, got {scale.device}")

    if tiles is not None:
        if start is not None or not tiles_fit(spec, grad, stats, labels is not None):
            raise ValueError("tiles: statistics per vocab tile are taken only for whole rows of a softmax loss "
                             "without transforms at load, an online KL or stats (`tiles_fit`)")
        if (not isinstance(tiles, torch.Tensor) or tiles.dim() != 3 or tiles.shape[:2] != (5, R)
                or tiles.dtype != torch.float32 or tiles.device != s.device or tiles.stride(2) != 1
                or not 1 <= tiles.shape[2] <= MAX_TILES):
            raise ValueError(f"tiles: expected a (5, {R}, n) float32 tensor with unit last stride on {s.device}, "
                             f"1 <= n <= {MAX_TILES}, got {_describe(tiles)}")
    if ds is None:
        ds = s
    elif not isinstance(ds, torch.Tensor) or ds.shape != s.shape or ds.dtype not in _DTYPES or ds.device != s.device \
            or (ds.stride(1) != 1 and V > 1):
        raise ValueError(f"ds: expected an ({R}, {V}) float tensor with unit vocab stride on {s.device}, got {_describe(ds)}")
    return t, ds, grad and ds is not s and _own_view(ds, s, "ds", "s", spec, grad)


class _Launch:
    """`_rows_kernel`'s launches for one `rows` call: the call's constants, worked out once (the loss's
    switches and the row's runtime floats), and a launch of a phase with its parts and sums."""

    def __init__(self, s, t, ds, labels, spec: LossSpec, scale, grad: bool, stats: bool, in_place: bool, soft, hard,
                 entropy, start, gt=None, t_in_place: bool = False, t_bias=None):
        R, V = s.shape
        kind = kernel_kind(spec)
        use_soft = spec.want_soft
        use_ce = spec.want_hard and labels is not None
        grad_pass = _writing_pass(spec, grad)
        # the mixture's (log2 β, log2(1 − β)) (`_mixture`): JSD's β in (0, 1) (its endpoints resolve to the KLs);
        # skew KL's M at β = α, skew reverse KL's M′ at β = 1 − α, α in (0, 1] (α = 0 resolves to the KLs)
        log2_mix = (0.0, 0.0)
        if use_soft and kind == "jsd":
            log2_mix = (math.log2(spec.beta), _log2_1m(spec.beta))
        elif use_soft and kind == "skew_kl":
            log2_mix = (math.log2(spec.alpha), _log2_1m(spec.alpha))
        elif use_soft and kind == "skew_reverse_kl":
            log2_mix = (_log2_1m(spec.alpha), math.log2(spec.alpha))
        elif use_soft and kind == "entropy_adaptive":  # its gate's center and width ride in these two floats
            log2_mix = (float(spec.gate_center), float(spec.gate_width))
        # pass 1 takes a KL online when that spares a pass: forward KL's gradient pass computes its loss anyway
        online_kl = use_soft and (kind == "reverse_kl" or (kind == "forward_kl" and grad_pass != 2))
        pow_p, pow_q = _powers(spec, kind) if use_soft else (1.0, 0.0)
        # rows narrower than a tile (a top-k teacher's K + 1 categories) get a tile of their width, with
        # as many warps as keep 4 elements a thread
        block = max(128, min(BLOCK_V, triton.next_power_of_2(V)))
        s_head, fold_s, s_mul = head_mode(spec.student_logit_scale, spec.student_softcap)
        t_head, fold_t, t_mul = head_mode(spec.teacher_logit_scale, spec.teacher_softcap)
        t_head = t_head if use_soft else 0
        sigma_s = float(spec.student_logit_scale)  # dz/ds, but for a softcap's 1 − (z/c)² (in the kernel)
        log2e = math.log2(math.e)
        self.R = R
        self.needs_phase_3 = use_soft and (kind in _LATE_GRAD or kind == "dkd" or (kind == "forward_kl" and not online_kl))
        self.tensors = (
            s,
            ds,
            t if use_soft else s,  # never read when not SOFT
            s if gt is None else gt,  # never written when not T_GRAD
            s if t_bias is None else t_bias,  # never read when not T_BIAS
            labels if labels is not None else s,  # never read when not LABELS
            soft,
            hard,
            entropy,
            scale,
        )
        self.sizes = (
            V,
            scale.stride(0) if scale.dim() else 0,
            t.stride(0) if use_soft else V,
            ds.stride(0),
            V if gt is None else gt.stride(0),
            spec.ignore_index,
            0 if start is None else start,
        )
        self.floats = (
            # float(): an int weight would be specialised (and recompiled) by value
            log2e * fold_s / spec.temperature,
            log2e * fold_t / spec.temperature,
            log2e * fold_s,
            1.0 / spec.temperature,
            fold_s,
            fold_t,
            fold_s / fold_t if kind == "forward_kl" else fold_t / fold_s,
            s_mul,
            t_mul,
            float(spec.beta),
            *log2_mix,
            pow_p,
            pow_q,
            float(spec.weight_hard) * sigma_s,
            float(spec.soft_scale) * sigma_s,
            float(spec.teacher_logit_scale) / sigma_s,
        )
        self.constexprs = dict(
            LOSS=LOSS_ID[kind],
            SOFT=use_soft,
            CE=use_ce,
            LABELS=labels is not None,
            GRAD_SOFT=grad and use_soft and spec.soft_scale != 0.0,
            GRAD_CE=grad and use_ce and spec.weight_hard != 0.0,
            GRAD_PASS=grad_pass,
            CE_IS_Q=use_ce and use_soft and kind != "cosine" and spec.temperature == 1.0,
            ONLINE_KL=online_kl,
            S_HEAD=s_head,
            T_HEAD=t_head,
            SCALED=fold_s != 1.0 or (use_soft and fold_t != 1.0),
            STATS=stats,
            RTNE_BITS=rtne_bits(ds),
            IN_PLACE=in_place,
            PULL=use_soft and spec.kind == "mutual",
            T_GRAD=gt is not None,
            T_IN_PLACE=t_in_place,
            T_RTNE_BITS=gt is not None and rtne_bits(gt),
            T_BIAS=t_bias is not None,
            # the entropy blend's KL terms are the power family's at powers (1, 0): ψ's modes for γ = 0 and 1 − γ = 1
            PSI=_psi_mode(pow_q / (pow_p + pow_q)) + 8 * _psi_mode(pow_p / (pow_p + pow_q)) if kind in _POWER_LOSSES
            else _psi_mode(0.0) + 8 * _psi_mode(1.0) if kind in ("entropy_adaptive", "dkd", "akl") else 0,
            # only where a side has a softcap: other kernels keep one specialisation whatever the masks
            RCP_FMA=_cap_bits(SOFTCAP_RCP_FMA.get(kind, 0), s_head, t_head),
            BLOCK_V=block,
            num_warps=max(1, min(NUM_WARPS, block // 128)),
            maxnreg=MAX_REGS,
        )

    def __call__(self, phase, parts=None, accs=None, world=1, stride_part=None, stride_tile=0):
        """One launch of PHASE `phase` (`_rows_kernel`), one program a row; parts, accs: the phase's buffers
        (none for PHASE 0)."""
        s = self.tensors[0]
        with launching():
            _rows_kernel[(self.R,)](
                *self.tensors,
                s if parts is None else parts,
                s if accs is None else accs,
                *self.sizes,
                world,
                self.R * _PARTS.value if stride_part is None else stride_part,
                stride_tile,
                world,
                *self.floats,
                **self.constexprs,
                PHASE=phase,
                WORLD_BLOCK=max(2, triton.next_power_of_2(world)),
            )


def _writing_pass(spec: LossSpec, grad: bool) -> int:
    """The pass that writes dL/ds (`_rows_kernel`'s GRAD_PASS): 3 (forwards over the row) for jsd, tvd and
    the skew losses, whose gradient needs pass 2's sums, else 2 (backwards); 0 without grad."""
    if not grad:
        return 0
    return 3 if spec.want_soft and spec.soft_scale != 0.0 and kernel_kind(spec) in _LATE_GRAD else 2


# The dense losses this kernel computes (AKL on whole rows: its head is found over the row, `_akl_head_kernel`;
# a vocab slice's AKL runs on the torch rows, `flashkd.core.backend.row_function`).
KERNEL_LOSSES = ("jsd", "forward_kl", "reverse_kl", "tvd", "cosine", "skew_kl", "skew_reverse_kl", "jeffreys",
                 "triangular", "alpha_divergence", "renyi", "renyi_reverse", "ab_divergence", "entropy_adaptive", "dkd",
                 "akl", "mutual", "co_jeffreys")
# the kernel's losses whose pass 1 is more than each side's softmax statistics, so that the statistics per vocab
# tile (`tiles_fit`) cannot stand in for it: DKD's sums leave the label's column out (taking it off a tile's sum
# would cancel where the label holds nearly all the mass), AKL's teacher statistics come with its head
_NO_TILES = ("dkd", "akl")


def kernel_kind(spec: LossSpec) -> str:
    """The loss the kernel computes for spec: spec.kind (JSD's endpoints resolved), and the skew losses at
    α = 0 as the KL each is there (M = q: forward KL; M′ = p: reverse KL), the same formula, whose
    log2 α the mixture cannot take (`_mixture`). At α = 1 the mixture's formula gives 0 and dL/ds 0 as it is.
    mutual and co_jeffreys are Jeffreys' value (mutual's gradient by PULL, a learning teacher's by T_GRAD)."""
    kind = spec.kind
    if kind in LEARNING_LOSSES:
        return "jeffreys"
    if kind in ("skew_kl", "skew_reverse_kl") and spec.alpha == 0.0:
        return "forward_kl" if kind == "skew_kl" else "reverse_kl"
    return kind


def _powers(spec: LossSpec, kind: str) -> tuple[float, float]:
    """(pow_p, pow_q) of the power family's cross term p^pow_p q^pow_q (`_power_term`): Amari's
    p^(1−α) q^α, the αβ-divergence's p^α q^β, Rényi's p^r q^(1−r) (renyi) and q^r p^(1−r) (renyi_reverse);
    the entropy gate's (gate_min, gate_max − gate_min) (its center and width ride in the mixture's two floats,
    `_Launch`); (1, 0), unused, for the other losses."""
    if kind == "alpha_divergence":
        return 1.0 - float(spec.alpha), float(spec.alpha)
    if kind == "ab_divergence":
        return float(spec.alpha), float(spec.beta)
    if kind == "renyi":
        return float(spec.alpha), 1.0 - float(spec.alpha)
    if kind == "renyi_reverse":
        return 1.0 - float(spec.alpha), float(spec.alpha)
    if kind == "entropy_adaptive":
        return float(spec.gate_min), float(spec.gate_max) - float(spec.gate_min)
    if kind == "dkd":  # its weights α (TCKD) and β (NCKD)
        return float(spec.alpha), float(spec.beta)
    return 1.0, 0.0


def _psi_mode(beta: float) -> int:
    """`_psi`'s MODE for β: the form its value takes away from y = 0."""
    if beta == 0.0:
        return 0
    if beta < 0.0:
        return 1
    if beta == 0.5:
        return 6
    if beta < 0.5:
        return 2
    if beta < 1.0:
        return 3
    return 4 if beta == 1.0 else 5


def _log2_1m(x: float) -> float:
    """log2(1 − x) on the host for x in [0, 1], and at x = 1 (the skew losses' α = 1) −2^100 for log2 0:
    the mixture's z is then ±2^100, whose 2^−|z| is 0 in fp32, with no inf − inf (`_mixture`)."""
    return math.log1p(-x) / math.log(2.0) if x < 1.0 else -(2.0**100)


def grad_view(s: torch.Tensor, dtype: torch.dtype, spec: LossSpec, grad: bool) -> torch.Tensor:
    """A (R, V) `dtype` view of s's own bytes that `rows(s, ..., ds=)` can write dL/ds into, where dtype is
    half s's width (a bf16 gradient of fp32 logits): no R·V·E-byte buffer beside s. The pass that writes
    dL/ds reads s's row too, so the view is the half of each row's bytes holding columns that pass has
    read before it stores there: the first half where it walks the row forwards (jsd, tvd: pass 3), the
    second where it walks backwards (pass 2). The tile k steps into the walk stores over the columns of the
    tile about k/2 steps in (its own for k ≤ 1), which another of the program's warps, running ahead or
    behind without a barrier, may not have loaded yet: so each tile's stores wait at a barrier until every
    warp has loaded that tile (IN_PLACE), and the warps walk the row in step. s is then spent."""
    if not isinstance(s, torch.Tensor) or s.dim() != 2 or not s.is_contiguous():
        raise ValueError(f"s: expected a contiguous 2-D (R, V) tensor, got {_describe(s)}")
    if not isinstance(dtype, torch.dtype) or dtype.itemsize * 2 != s.element_size():
        raise TypeError(f"dtype: expected a dtype half as wide as s's {s.dtype}, got {dtype}")
    v = s.shape[1]
    wide = s.view(dtype)  # (R, 2V): each row's bytes, as 2V narrow elements
    return wide[:, v:] if _writing_pass(spec, grad) == 2 else wide[:, :v]


MAX_TILES = 4096  # vocab tiles a row's statistics may come in (`rows(..., tiles=...)`): one vector load each


def tiles_fit(spec: LossSpec, grad: bool, stats: bool, labels: bool) -> bool:
    """Whether pass 1 of this call takes nothing but each side's softmax statistics, so that the ones the
    logits GEMMs make per vocab tile can stand in for it (`rows(..., tiles=...)`): a softmax divergence
    whose loss pass 1 does not take online, no transform at load (softcap, negative scale), no stats."""
    kind = kernel_kind(spec)
    if stats or not spec.want_soft or kind in ("cosine", "reverse_kl") or kind in _NO_TILES:
        return False
    if spec.kind in LEARNING_LOSSES:  # a learning teacher's dL/dt is written on whole rows only
        return False
    if kind == "forward_kl" and not grad:  # its loss is then taken online in pass 1
        return False
    s_head = head_mode(spec.student_logit_scale, spec.student_softcap)[0]
    t_head = head_mode(spec.teacher_logit_scale, spec.teacher_softcap)[0]
    return s_head == 0 and t_head == 0


def tile_constants(spec: LossSpec, labels: bool) -> tuple[float, float | None, float]:
    """The log2 factors of the per-tile sums `rows(..., tiles=...)` reads: (k_s, k_ce, k_t) for
    2^((z − m)·k) over s (softmax(s/τ)), over s untempered for the CE (None where that is q, or no CE is
    taken), over t; the same constants the kernel folds a head's scale into (`launch`)."""
    fold_s = head_mode(spec.student_logit_scale, spec.student_softcap)[1]
    fold_t = head_mode(spec.teacher_logit_scale, spec.teacher_softcap)[1]
    log2e = math.log2(math.e)
    ce = spec.want_hard and labels
    ce_is_q = ce and spec.temperature == 1.0  # tiles_fit excludes cosine
    return (log2e * fold_s / spec.temperature, log2e * fold_s if ce and not ce_is_q else None,
            log2e * fold_t / spec.temperature)


def _cap_bits(mask: int, s_head: int, t_head: int) -> int:
    """The bits of a (pass, side) mask (SOFTCAP_RCP_FMA) on the sides that have a softcap (HEAD 2, 3)."""
    side = (1 if s_head >= 2 else 0) | (2 if t_head >= 2 else 0)
    return mask & (side * 0b010101)


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return repr(x)


# ------------------------------------------------------------------------------------ backward's scaling


@triton.jit
def _scale_kernel(x_ptr, g_ptr, n, RTNE_BITS: tl.constexpr, BLOCK: tl.constexpr):
    g = tl.load(g_ptr).to(tl.float32)
    if g != 1.0:  # loss.backward() passes 1: then nothing is read or written, and no host sync told us
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
        store_grad(x_ptr + offs, x * g, mask, RTNE_BITS)


def scale_(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """x *= g in place for a contiguous x and a 0-d device tensor g, multiplied in fp32; when g is 1
    the launch returns at once (at V = 128256, Hs = 2048 bf16 the multiply would move 1 GB)."""
    n = x.numel()
    if n:
        block = 4096
        with launching():
            _scale_kernel[(triton.cdiv(n, block),)](x, g, n, RTNE_BITS=rtne_bits(x), BLOCK=block, num_warps=NUM_WARPS)
    return x
