"""The names `flashkd.integrations` (verl.py, transformers.py) import from the core, where they lived
before it became the `flashkd.core` package; the integrations' next change imports them from there,
and this module goes."""

from .core.backend import pick_backend
from .core.checks import FLOATS, NARROW, check_teacher_vocab, check_vocab_size
from .core.loop import accumulate_mm, linear
from .core.plan import LOGITS_BUDGET

__all__ = ["FLOATS", "LOGITS_BUDGET", "NARROW", "accumulate_mm", "check_teacher_vocab", "check_vocab_size", "linear",
           "pick_backend"]
