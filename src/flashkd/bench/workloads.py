"""What is measured: one Workload per bound case, the presets, and the seeded inputs of a workload.

Inputs follow Liger-Kernel's distillation benchmark, so our numbers sit beside its published rows:
Xs = rand(N, H//2), Xt = rand(N, H), LM heads with nn.Linear's default init, labels randint(0, V).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from ..losses import LossSpec

DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
    "float32": torch.float32, "fp32": torch.float32,
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

    @property
    def hs(self) -> int:
        return self.h // 2

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kernel_name(self) -> str:
        return f"distill_{self.loss}_loss"  # Liger's names: distill_jsd_loss, distill_cosine_loss

    def spec(self) -> LossSpec:
        """The LossSpec that `fused_linear_distill` builds for this call (labels given, terms not returned)."""
        return LossSpec(
            loss=self.loss, beta=self.beta, temperature=self.temperature, weight_hard=self.weight_hard,
            weight_soft=self.weight_soft, ignore_index=self.ignore_index,
            want_hard=self.weight_hard != 0.0, want_soft=self.weight_soft != 0.0 or self.weight_hard == 0.0,
        )

    def config(self) -> dict:
        """The workload part of `extra_benchmark_config_str`: Liger's keys first, in Liger's order."""
        return {
            "H": self.h, "V": self.v, "dtype": str(self.torch_dtype), "bias": False,
            "weight_hard_loss": self.weight_hard, "weight_soft_loss": self.weight_soft,
            "ignore_index": self.ignore_index, "beta": self.beta, "temperature": self.temperature,
            "student_H": self.hs, "seed": self.seed,
        }


class Inputs(NamedTuple):
    xs: torch.Tensor  # (N, Hs) student hidden, requires grad
    ws: torch.Tensor  # (V, Hs) student head, requires grad
    xt: torch.Tensor  # (N, Ht) teacher hidden
    wt: torch.Tensor  # (V, Ht) teacher head
    y: torch.Tensor  # (N,) int64 labels


_SEED_SHAPE = dict(h=4096, v=128256, dtype="bfloat16")
PRESETS: dict[str, tuple[Workload, ...]] = {
    # The design notes' seed workloads, both among Liger's published rows (distill_jsd_loss,
    # distill_cosine_loss), so every ratio there can be re-measured.
    "seed": (Workload("jsd", 8192, **_SEED_SHAPE), Workload("cosine", 4096, **_SEED_SHAPE)),
    # Liger's x axis, one step further: where the ratio to the floor moves with N.
    "sweep": tuple(Workload("jsd", n, **_SEED_SHAPE) for n in (1024, 2048, 4096, 8192, 16384)),
    # A laptop CPU: every provider, mode and plot in seconds. V = 4099 is prime, so no size is a
    # multiple of any block or chunk.
    "small": tuple(Workload(loss, n, h=256, v=4099, dtype="float32") for loss in ("jsd", "cosine") for n in (128, 256)),
}


def default_preset(device: torch.device) -> str:
    return "seed" if device.type == "cuda" else "small"


def expand(base: tuple[Workload, ...], n=None, loss=None, **fields) -> list[Workload]:
    """The preset's workloads with fields replaced; `n` and `loss` (lists) multiply each workload.

    Sorted by loss (in the order given) then N, duplicates dropped.
    """
    out = []
    for w in base:
        for one_loss in loss or [w.loss]:
            for one_n in n or [w.n]:
                out.append(dataclasses.replace(w, loss=one_loss, n=one_n, **fields))
    order = list(dict.fromkeys(w.loss for w in out))
    return sorted(dict.fromkeys(out), key=lambda w: (order.index(w.loss), w.n))


def make_inputs(w: Workload, device: torch.device) -> Inputs:
    """Seeded inputs: drawn in fp32 and rounded to the workload's dtype, so every dtype sees the same values."""
    torch.manual_seed(w.seed)
    dt = w.torch_dtype
    xs = torch.rand(w.n, w.hs, device=device).to(dt).requires_grad_()  # (N, Hs)
    xt = torch.rand(w.n, w.h, device=device).to(dt)  # (N, Ht)
    ws = torch.nn.Linear(w.hs, w.v, bias=False, device=device).weight.detach().to(dt).requires_grad_()  # (V, Hs)
    wt = torch.nn.Linear(w.h, w.v, bias=False, device=device).weight.detach().to(dt)  # (V, Ht)
    y = torch.randint(0, w.v, (w.n,), device=device)  # (N,)
    return Inputs(xs, ws, xt, wt, y)
