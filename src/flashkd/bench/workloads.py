"""What is measured: one Workload per bound case, the presets, and the seeded inputs of a workload.

Inputs follow Liger-Kernel's distillation benchmark, so our numbers sit beside its published rows:
Xs = rand(N, H//2), Xt = rand(N, H), LM heads with nn.Linear's default init, labels randint(0, V).

A workload's `form` says how the teacher reaches the loss, and so which flashkd function is timed:

    heads          teacher hidden states and LM head (Xt, Wt)        fused_linear_distill
    logits         dense teacher logits Xt @ Wt^T, (N, V)              fused_linear_distill_logits
    topk           the teacher's top-k ids and log-probs, (N, K) each  fused_linear_distill_topk
    teacher_topk   not a loss: the op that makes those top-k targets   teacher_topk (no gradient)

Every form draws the same seeded Xs, Xt, Ws, Wt, labels; the logits and top-k targets are made from
them before anything is timed, so all forms of one seed distill the very same teacher.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

import flashkd
from .. import fp8
from ..losses import LOSSES, TAILS, LossSpec

DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
    "float32": torch.float32, "fp32": torch.float32,
}
FORMS = ("heads", "logits", "topk", "teacher_topk")
# "bench": Liger's inputs, whose logits are a few tenths; "trained": logits of std TRAINED_STD with every
# TRAINED_EVERY-th row one logit at TRAINED_PEAK, as a trained LM head gives them (bf16's ulp is 1/8 on
# [16, 32): where a stored logit's rounding shows)
INPUTS = ("bench", "trained")
TRAINED_STD, TRAINED_PEAK, TRAINED_EVERY = 4.0, 32.0, 4


# The fields each form does not read (Workload.canonical sets them to their defaults): an option that
# sets one for a run of such forms alone is refused by the command line, not dropped.
UNREAD = {
    "heads": ("k", "tail"), "logits": ("k", "tail", "teacher_precision"), "topk": ("teacher_precision",),
    "teacher_topk": ("loss", "beta", "weight_hard", "weight_soft", "ignore_index", "tail"),
}


@dataclasses.dataclass(frozen=True)
class Workload:
    loss: str = "jsd"
    n: int = 8192  # rows (B·T), Liger's x axis "BT"
    h: int = 4096  # teacher hidden size; the student's is h // 2, as in Liger's benchmark
    v: int = 128256  # vocab (Llama 3)
    dtype: str = "bfloat16"  # a torch dtype name, see DTYPES
    beta: float = 0.5
    weight_hard: float = 0.5
    weight_soft: float = 0.5
    temperature: float = 1.0
    ignore_index: int = -100
    seed: int = 0
    form: str = "heads"  # one of FORMS, see the module docstring
    k: int = 64  # teacher ids per row (forms topk and teacher_topk)
    tail: str = "bucket"  # the mass outside the K ids (form topk): one of losses.TAILS
    softcap: float | None = None  # both heads' logit softcap c (a top-k teacher's: in its targets)
    teacher_precision: str | None = None  # flashkd's teacher GEMM (forms heads, teacher_topk): None or "fp8..."
    inputs: str = "bench"  # one of INPUTS: Liger's benchmark inputs, or a trained head's logit magnitudes
    student_h: int | None = None  # the student's hidden size; None: h // 2, as in Liger's benchmark

    def __post_init__(self):
        if self.student_h is not None and (isinstance(self.student_h, bool) or not isinstance(self.student_h, int)
                                           or self.student_h < 1):
            raise ValueError(f"student_h: expected None or a positive int, got {self.student_h!r}")
        if self.form not in FORMS:
            raise ValueError(f"form: expected one of {', '.join(FORMS)}, got {self.form!r}")
        if self.inputs not in INPUTS:
            raise ValueError(f"inputs: expected one of {', '.join(INPUTS)}, got {self.inputs!r}")
        if self.tail not in TAILS:
            raise ValueError(f"tail: expected one of {', '.join(TAILS)}, got {self.tail!r}")
        if self.form in ("topk", "teacher_topk") and not 1 <= self.k <= self.v:
            raise ValueError(f"k: expected 1 <= k <= V = {self.v}, got {self.k}")
        fp8.check_precision(self.teacher_precision)
        if self.teacher_precision is not None and self.form not in ("heads", "teacher_topk"):
            raise ValueError(f"teacher_precision: only forms heads and teacher_topk have a teacher GEMM, got form {self.form!r}")

    @property
    def hs(self) -> int:
        return self.h // 2 if self.student_h is None else self.student_h

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def has_grad(self) -> bool:
        """False for teacher_topk: it returns targets, not a loss, and is only ever run without autograd."""
        return self.form != "teacher_topk"

    @property
    def kernel_name(self) -> str:
        # The heads form keeps Liger's names (distill_jsd_loss, distill_cosine_loss), so its rows sit
        # beside Liger's published ones; the other forms are other operations and say so.
        if self.form == "teacher_topk":
            return "teacher_topk"
        return f"distill_{'' if self.form == 'heads' else self.form + '_'}{self.loss}_loss"

    @property
    def tag(self) -> str:
        """A short name for tables, progress and file names: the loss alone for the heads form."""
        return {"heads": self.loss, "teacher_topk": "teacher_topk"}.get(self.form, f"{self.form}_{self.loss}")

    def describe(self) -> str:
        """The shape part of a table or plot title."""
        if self.form == "teacher_topk":
            return f"H={self.h} V={self.v} K={self.k} {self.dtype}"
        topk = f" K={self.k} tail={self.tail}" if self.form == "topk" else ""
        trained = "" if self.inputs == "bench" else " trained-head logits"
        return f"H={self.h} (student {self.hs}) V={self.v}{topk} {self.dtype}{trained}"

    def canonical(self) -> Workload:
        """The same case with the fields its form does not read at their defaults: equal cases compare equal."""
        base = Workload()
        # a student of hidden h // 2 given by size is the same case as one given by default
        same = {"student_h": None} if self.student_h == self.h // 2 else {}
        return dataclasses.replace(self, **{name: getattr(base, name) for name in UNREAD[self.form]}, **same)

    def spec(self) -> LossSpec:
        """The LossSpec that flashkd builds for this call (labels given, terms not returned)."""
        return LossSpec(
            loss=self.loss, beta=self.beta, temperature=self.temperature, weight_hard=self.weight_hard,
            weight_soft=self.weight_soft, ignore_index=self.ignore_index,
            want_hard=self.weight_hard != 0.0, want_soft=self.weight_soft != 0.0 or self.weight_hard == 0.0,
            tail=self.tail if self.form == "topk" else None,
            student_softcap=self.softcap, teacher_softcap=None if self.form == "topk" else self.softcap,
        )

    def config(self) -> dict:
        """The workload part of `extra_benchmark_config_str`: Liger's keys first, in Liger's order.

        The heads form writes exactly the keys it always has (its rows stay comparable with Liger's
        and with earlier runs); the other forms add theirs at the end.
        """
        softcap = {} if self.softcap is None else {"softcap": self.softcap}  # absent: earlier rows' keys
        if self.teacher_precision is not None:
            softcap["teacher_precision"] = self.teacher_precision
        if self.inputs != "bench":  # absent: earlier rows' keys
            softcap["inputs"] = self.inputs
        if self.form == "teacher_topk":
            return {"H": self.h, "V": self.v, "dtype": str(self.torch_dtype), "bias": False,
                    "temperature": self.temperature, "seed": self.seed, "form": self.form, "k": self.k, **softcap}
        config = {
            "H": self.h, "V": self.v, "dtype": str(self.torch_dtype), "bias": False,
            "weight_hard_loss": self.weight_hard, "weight_soft_loss": self.weight_soft,
            "ignore_index": self.ignore_index, "beta": self.beta, "temperature": self.temperature,
            "student_H": self.hs, "seed": self.seed, "loss": self.loss,
        }
        if self.form == "logits":
            config["form"] = self.form
        elif self.form == "topk":
            config.update(form=self.form, k=self.k, tail=self.tail)
        return {**config, **softcap}


class Inputs(NamedTuple):
    xs: torch.Tensor | None  # (N, Hs) student hidden, requires grad; None for teacher_topk
    ws: torch.Tensor | None  # (V, Hs) student head, requires grad; None for teacher_topk
    xt: torch.Tensor | None  # (N, Ht) teacher hidden; None where the teacher comes precomputed
    wt: torch.Tensor | None  # (V, Ht) teacher head; idem
    y: torch.Tensor | None  # (N,) int64 labels; None for teacher_topk
    tl: torch.Tensor | None = None  # (N, V) teacher logits in the workload's dtype (form logits)
    ids: torch.Tensor | None = None  # (N, K) int64 teacher top-k ids (form topk)
    lp: torch.Tensor | None = None  # (N, K) fp32 their log-probs at the workload's temperature (form topk)


# Student <- teacher LM heads of the model families' published configs: (pair, student hidden Hs, teacher
# hidden Ht, vocab V). A pair shares its family's tokenizer, so one V. The vocab is the head's rows as the
# checkpoints ship them (Llama 3's 128256, Qwen3's 151936 padded from 151669, Mistral's Tekken 131072).
MODEL_HEADS: tuple[tuple[str, int, int, int], ...] = (
    ("Llama-3.2 1B <- Llama-3.2 3B", 2048, 3072, 128256),
    ("Llama-3.2 1B <- Llama-3.1 8B", 2048, 4096, 128256),
    ("Llama-3.1 8B <- Llama-3.1 70B", 4096, 8192, 128256),
    ("Qwen3 0.6B <- Qwen3 8B", 1024, 4096, 151936),
    ("Qwen3 1.7B <- Qwen3 32B", 2048, 5120, 151936),
    ("Qwen3 4B <- Qwen3 14B", 2560, 5120, 151936),
    ("Gemma-3 4B <- Gemma-3 12B", 2560, 3840, 262144),
    ("Gemma-3 12B <- Gemma-3 27B", 3840, 5376, 262144),
    ("Phi-4-mini (o200k head) <- a 5120-wide teacher", 3072, 5120, 200064),
    ("Phi-3-mini <- Phi-3-medium", 3072, 5120, 32064),
    ("Ministral 8B <- Mistral Small 24B", 4096, 5120, 131072),
)
_SEED_SHAPE = dict(h=4096, v=128256, dtype="bfloat16")
_SMALL_SHAPE = dict(h=256, v=4099, dtype="float32")
PRESETS: dict[str, tuple[Workload, ...]] = {
    # The design notes' seed workloads, both among Liger's published rows (distill_jsd_loss,
    # distill_cosine_loss), so every ratio there can be re-measured.
    "seed": (Workload("jsd", 8192, **_SEED_SHAPE), Workload("cosine", 4096, **_SEED_SHAPE)),
    # Liger's x axis, one step further: where the ratio to the floor moves with N.
    "sweep": tuple(Workload("jsd", n, **_SEED_SHAPE) for n in (1024, 2048, 4096, 8192, 16384)),
    # The teacher forms' targets: a sparse top-k teacher (soft forward KL alone, as offline top-k
    # distillation is usually run), dense precomputed teacher logits, and making the top-k targets.
    "topk": (Workload("forward_kl", 8192, weight_hard=0.0, weight_soft=1.0, form="topk", k=64, **_SEED_SHAPE),),
    "logits": (Workload("jsd", 8192, form="logits", **_SEED_SHAPE),),
    "teacher-topk": (Workload(n=8192, form="teacher_topk", k=64, **_SEED_SHAPE),),
    # Exactness where it shows: the seed JSD and the JSD soft term alone (TRL's configuration) on a trained
    # head's logit magnitudes, and with a softcap of 30 on both heads (Gemma's)
    "trained": (
        Workload("jsd", 8192, inputs="trained", **_SEED_SHAPE),
        Workload("jsd", 4096, weight_hard=0.0, weight_soft=1.0, inputs="trained", **_SEED_SHAPE),
        Workload("jsd", 8192, softcap=30.0, inputs="trained", **_SEED_SHAPE),
    ),
    # The LM heads that people distill between (MODEL_HEADS), every loss, N 8192 and 16384, trained-head inputs:
    # where the ratio to the floor moves with the head's shape, not only with N
    "models": tuple(
        Workload(loss, n, h=ht, student_h=hs, v=v, dtype="bfloat16", inputs="trained")
        for _, hs, ht, v in MODEL_HEADS for n in (8192, 16384) for loss in LOSSES
    ),
    # A laptop CPU: every provider, mode and plot in seconds. V = 4099 and K = 61 are prime, so no
    # size is a multiple of any block or chunk.
    "small": (
        *(Workload(loss, n, **_SMALL_SHAPE) for loss in ("jsd", "cosine") for n in (128, 256)),
        Workload("forward_kl", 256, weight_hard=0.0, weight_soft=1.0, form="topk", k=61, **_SMALL_SHAPE),
        Workload("jsd", 256, form="logits", **_SMALL_SHAPE),
    ),
}


def default_preset(device: torch.device) -> str:
    return "seed" if device.type == "cuda" else "small"


def expand(base: tuple[Workload, ...], n=None, loss=None, **fields) -> list[Workload]:
    """The preset's workloads with fields replaced; `n` and `loss` (lists) multiply each workload
    (`loss` not teacher_topk, which has none).

    Sorted by tag (loss and form, in the order given) then N, duplicates dropped. A preset's K is
    cut to a smaller V given (a K given too must fit).
    """
    out = []
    for w in base:
        cap = {"k": min(w.k, fields["v"])} if "k" not in fields and "v" in fields else {}
        w = dataclasses.replace(w, **fields, **cap)
        for one_loss in [w.loss] if w.form == "teacher_topk" else loss or [w.loss]:
            for one_n in n or [w.n]:
                out.append(dataclasses.replace(w, loss=one_loss, n=one_n).canonical())
    order = list(dict.fromkeys(w.tag for w in out))
    return sorted(dict.fromkeys(out), key=lambda w: (order.index(w.tag), w.n))


def make_inputs(w: Workload, device: torch.device) -> Inputs:
    """Seeded inputs: drawn in fp32 and rounded to the workload's dtype, so every dtype sees the same
    values; then the form's teacher targets from them (not timed)."""
    torch.manual_seed(w.seed)
    dt = w.torch_dtype
    if w.inputs == "trained":
        xs, ws = _trained_head(w.n, w.hs, w.v, device)
        xt, wt = _trained_head(w.n, w.h, w.v, device)
        xs, xt, ws, wt = xs.to(dt).requires_grad_(), xt.to(dt), ws.to(dt).requires_grad_(), wt.to(dt)
    else:
        xs = torch.rand(w.n, w.hs, device=device).to(dt).requires_grad_()  # (N, Hs)
        xt = torch.rand(w.n, w.h, device=device).to(dt)  # (N, Ht)
        ws = torch.nn.Linear(w.hs, w.v, bias=False, device=device).weight.detach().to(dt).requires_grad_()  # (V, Hs)
        wt = torch.nn.Linear(w.h, w.v, bias=False, device=device).weight.detach().to(dt)  # (V, Ht)
    y = torch.randint(0, w.v, (w.n,), device=device)  # (N,)
    if w.form == "heads":
        return Inputs(xs, ws, xt, wt, y)
    if w.form == "teacher_topk":
        return Inputs(None, None, xt, wt, None)
    # The teacher head is no input of these forms: dropped, so it counts in no provider's memory.
    with torch.no_grad():
        if w.form == "logits":
            return Inputs(xs, ws, None, None, y, tl=xt @ wt.t())  # (N, V), the workload's dtype
        ids, lp = flashkd.teacher_topk(xt, wt, w.k, temperature=w.temperature, teacher_softcap=w.softcap)  # (N, K) each
    return Inputs(xs, ws, None, None, y, ids=ids, lp=lp)


def _trained_head(n: int, h: int, v: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (x (n, h), w (v, h)) whose logits x @ w^T have std TRAINED_STD, and every TRAINED_EVERY-th row
    one logit (a random id) moved to TRAINED_PEAK along that id's weight row: a confident token."""
    x = torch.randn(n, h, device=device)
    w = torch.randn(v, h, device=device) * (TRAINED_STD / h**0.5)
    rows = torch.arange(0, n, TRAINED_EVERY, device=device)
    wj = w[torch.randint(0, v, (rows.numel(),), device=device)]  # (n / every, h)
    gap = TRAINED_PEAK - (x[rows] * wj).sum(-1)
    x[rows] += (gap / (wj * wj).sum(-1))[:, None] * wj
    return x, w
