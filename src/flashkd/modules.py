"""nn.Module holders of config over `fused_linear_distill`, including drop-ins for Liger-Kernel's losses.

    FusedLinearDistillLoss(loss="jsd", **options)   any keyword of fused_linear_distill, kept in .options
    FusedLinearJSDLoss(...)                         LigerFusedLinearJSDLoss's keywords, attributes, forward
    FusedLinearCosineSimilarityLoss(...)            LigerFusedLinearCosineSimilarityLoss's, idem
"""

from __future__ import annotations

import difflib
import inspect

import torch

from .core import keywords
from .core.checks import renamed
from .distill import KEYWORDS, check_options, fused_linear_distill

class FusedLinearDistillLoss(torch.nn.Module):
    """`fused_linear_distill` with its keyword options fixed at construction; each option (and `loss`) is
    also an attribute, read by every forward (`module.temperature = 1.5`: checked, then kept in `.options`)."""

    def __init__(self, loss: str = "jsd", **options):
        super().__init__()
        for name in options:  # a misspelt option fails here, not at the first forward
            if name in _PER_CALL:
                raise TypeError(f"{name}: expected as an argument of forward (per-call data), not as an option")
            if name not in _OPTIONS:
                raise TypeError(f"{name}: expected a keyword option of flashkd.fused_linear_distill "
                                f"({', '.join(sorted(_OPTIONS))}), got {name}={options[name]!r}")
        self.options = dict(loss=loss, **options)  # kept only once checked: __init__ raises otherwise
        check_options(self.options)

    def forward(
        self,
        student_input,  # (..., Hs)
        student_weight,  # (V, Hs)
        teacher_input,  # (..., Ht)
        teacher_weight,  # (Vt, Ht)
        labels=None,  # (...)
        student_bias=None,  # (V,)
        teacher_bias=None,  # (Vt,)
        row_weight=None,  # (...) like labels: per-call data, not an option
    ):
        """`fused_linear_distill(student_input, student_weight, teacher_input, teacher_weight, labels,
        student_bias=, teacher_bias=, **self.options)`: the scalar fp32 loss, or `(loss, soft, hard)`
        with `return_soft_hard_loss=True`. Leading dims are flattened; gradients flow to the student's
        input, weight and bias, whose grads are computed here, in the forward call."""
        return fused_linear_distill(
            student_input,
            student_weight,
            teacher_input,
            teacher_weight,
            labels,
            student_bias=student_bias,
            teacher_bias=teacher_bias,
            row_weight=row_weight,
            **self.options,
        )

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())

    # An option is an attribute too, as a torch loss module's are (`module.temperature = 1.5` changes the next
    # forward, as for Liger's modules): one not given reads as fused_linear_distill's default; a value set is
    # checked at once. Without this, setting one made a plain attribute that no forward reads.
    def __getattr__(self, name):
        options = self.__dict__.get("options")
        if options is not None and name in _ATTRIBUTES:
            return options.get(name, _DEFAULTS[name])
        return super().__getattr__(name)

    def __setattr__(self, name, value):
        if name in _ATTRIBUTES and "options" in self.__dict__:
            options = {**self.options, name: value}
            check_options(options)
            # a new dict, not the shared one changed in place: a copy.copy of the module shares `options`, and
            # setting an option on the copy changed the original's too (a plain attribute would not)
            self.__dict__["options"] = options
            return
        if "options" in self.__dict__ and name not in self.__dict__ and not hasattr(type(self), name):
            # a new attribute that no forward reads: forward's per-call data, or a misspelt option
            if name in _PER_CALL:
                raise TypeError(f"{name}: an argument of forward (per-call data), not an option to set on the module")
            near = difflib.get_close_matches(name, sorted(_ATTRIBUTES), n=1, cutoff=0.8)
            if near:
                raise TypeError(f"{name}: not an option of {type(self).__name__} (did you mean {near[0]!r}?)")
        super().__setattr__(name, value)


# forward's arguments: per-call data; and the keyword options of fused_linear_distill (the keyword table's)
# the constructor takes, its own parameters (the positional `loss`) aside
_PER_CALL = tuple(inspect.signature(FusedLinearDistillLoss.forward).parameters)[1:]
# the names readable and settable as attributes: those keywords with `loss`; their defaults, the function's
_ATTRIBUTES = frozenset(KEYWORDS["fused_linear_distill"]) - frozenset(_PER_CALL)
_OPTIONS = _ATTRIBUTES - frozenset(inspect.signature(FusedLinearDistillLoss.__init__).parameters)
_DEFAULTS = {name: p.default for name, p in inspect.signature(fused_linear_distill).parameters.items()}


class _LigerDropIn(FusedLinearDistillLoss):
    """Liger-Kernel's constructor keywords, and its attributes: `.beta`, `.temperature`,
    `.weight_hard_loss`, `.weight_soft_loss`, `.ignore_index`, `.chunk_size` and
    `.return_soft_hard_loss` are views of `.options` (reading one reads the option, setting one
    sets it for the next forward), as every option is (`.vocab_size` too); `.compiled` is kept as given and changes nothing (nothing here
    is compiled)."""

    _loss = ""

    def __init__(
        self,
        weight_hard_loss: float = 0.5,
        weight_soft_loss: float = 0.5,
        beta: float = 0.5,
        ignore_index: int = -100,
        temperature: float = 1.0,
        compiled: bool = True,
        chunk_size: int | None = None,
        return_soft_hard_loss: bool = False,
        *,
        vocab_size: int | None = None,  # flashkd's: declares a teacher head past V rows padding (not Liger's)
    ):
        # Liger's keywords are fused_linear_distill's, by the same names: its options, in the signature's order
        super().__init__(self._loss, **{name: value for name, value in locals().items() if name in _OPTIONS})
        self.compiled = compiled

    def __setattr__(self, name, value):
        if name == "compiled" and not isinstance(value, bool):  # Liger's flag: a "no" would be kept as if True
            raise TypeError(f"compiled: expected a bool, got {value!r}")
        super().__setattr__(name, value)

    def forward(
        self,
        student_input,  # (..., Hs)
        student_weight,  # (V, Hs)
        teacher_input,  # (..., Ht)
        teacher_weight,  # (Vt, Ht), Vt >= V
        true_labels,  # (...) integer, ignore_index marks rows without loss
        student_bias=None,  # (V,)
        teacher_bias=None,  # (Vt,)
    ):
        """Liger's forward signature (`true_labels` positional, as Liger names it): the loss of
        `fused_linear_distill` with this module's options; `(loss, soft, hard)` with
        `return_soft_hard_loss`."""
        try:
            return super().forward(
                student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias, teacher_bias
            )
        except (TypeError, ValueError) as e:  # errors name the argument as Liger's signature calls it
            raise renamed(e, {"labels": "true_labels"}) from None


class FusedLinearJSDLoss(_LigerDropIn):
    """Drop-in for `liger_kernel.chunked_loss.LigerFusedLinearJSDLoss`."""

    _loss = "jsd"


class FusedLinearCosineSimilarityLoss(_LigerDropIn):
    """Drop-in for `liger_kernel.chunked_loss.LigerFusedLinearCosineSimilarityLoss`: soft term β (1 − cos)."""

    _loss = "cosine"


class FusedLinearJSD(torch.nn.Module):
    """Drop-in for `liger_kernel.transformers.LigerFusedLinearJSD` (its constructor is positional:
    `(jsd_beta, ignore_index, temperature, accum_dtype)`, as NVIDIA ModelOpt calls it): the generalized
    JSD alone (no CE), averaged over the rows whose `shift_labels` is not `ignore_index` (all rows
    without labels). `accum_dtype` is flashkd's `grad_accum_dtype` (None: fp32). Same forward
    `(student_input, student_weight, teacher_input, teacher_weight, shift_labels=None)`."""

    _LIGER = {"beta": "jsd_beta", "grad_accum_dtype": "accum_dtype"}  # flashkd's keywords, as Liger names them

    def __init__(self, jsd_beta: float = 0.5, ignore_index: int = -100, temperature: float = 1.0,
                 accum_dtype: torch.dtype | None = None, *, vocab_size: int | None = None):
        super().__init__()
        self.jsd_beta, self.ignore_index, self.temperature, self.accum_dtype = jsd_beta, ignore_index, temperature, accum_dtype
        self.vocab_size = vocab_size  # flashkd's (not Liger's): declares a teacher head past V rows padding
        self._check()
        self.__dict__["_constructed"] = True

    _OWN = ("jsd_beta", "ignore_index", "temperature", "accum_dtype", "vocab_size")  # the attributes forward reads

    def _check(self):
        try:  # checked here, as the forward's call will check them
            check_options(self._keywords())
        except (TypeError, ValueError) as e:
            raise renamed(e, self._LIGER) from None

    def __setattr__(self, name, value):
        # Once built, an attribute the forward reads is checked when set (a bad one is not kept), and a new one
        # that only looks like an option is refused: `.beta = 0.9` (flashkd's name for jsd_beta) or a misspelt
        # `.temprature` made an attribute no forward reads, the loss unchanged.
        if self.__dict__.get("_constructed"):
            if name in self._OWN:
                before = self.__dict__[name]
                self.__dict__[name] = value
                try:
                    self._check()
                except (TypeError, ValueError):
                    self.__dict__[name] = before
                    raise
                return
            if name not in self.__dict__ and not hasattr(type(self), name):
                near = self._LIGER.get(name) or next(
                    iter(difflib.get_close_matches(name, self._OWN, n=1, cutoff=0.8)), None)
                if near is not None or name in _ATTRIBUTES:
                    hint = f" (did you mean {near!r}?)" if near else ""
                    raise TypeError(f"{name}: not an option of {type(self).__name__}{hint}; its options: "
                                    f"{', '.join(self._OWN)}")
        super().__setattr__(name, value)

    def _keywords(self) -> dict:
        """fused_linear_distill's keywords of this module's Liger constructor (Liger's names mapped to flashkd's)."""
        return dict(loss="jsd", beta=self.jsd_beta, temperature=self.temperature, ignore_index=self.ignore_index,
                    weight_hard_loss=0.0, weight_soft_loss=1.0, grad_accum_dtype=self.accum_dtype,
                    vocab_size=self.vocab_size)

    def forward(self, student_input, student_weight, teacher_input, teacher_weight, shift_labels=None):
        try:
            return fused_linear_distill(student_input, student_weight, teacher_input, teacher_weight, shift_labels,
                                        **self._keywords())
        except (TypeError, ValueError) as e:  # errors name the argument as Liger's signature calls it
            raise renamed(e, {**self._LIGER, "labels": "shift_labels"}) from None

    def extra_repr(self) -> str:
        return (f"jsd_beta={self.jsd_beta!r}, ignore_index={self.ignore_index!r}, temperature={self.temperature!r}, "
                f"accum_dtype={self.accum_dtype!r}")
