"""verl's on-policy top-k distillation with flashkd's loss: `patch()` computes verl's per-token top-k
loss and diagnostics from the student's last hidden states and LM head, with no (tokens × V) logits.

verl 0.9.1 (`verl/trainer/distillation/`, loss mode "forward_kl_topk") takes the student's logits
(1, total_nnz, V) from its FSDP engine (`prepare_model_outputs`, scaled by the temperature) and hands
them to `fsdp/losses.py`'s `compute_forward_kl_topk`, which returns per token, with z = logits / τ and
log q = log_softmax(z) over the whole vocab, c = `log_prob_min_clamp` (None: no clamp):

    distillation_losses      Σ_k p_k (log p_k − log q_k)   with log q_k ← max(log q_k, c), log p_k ← max(log p_k, c)
    student_mass             Σ_k q_k  (unclamped)           teacher_mass   Σ_k p_k  (unclamped)
    overlap_count            |teacher ids ∩ student's own top-K ids|
    overlap_token_advantage  mean over the shared ids of −p_k (log p_k − log q_k) (clamped; 0 with none)

over the teacher's K ids. verl then clamps the losses at 0 (`compute_forward_kl_topk` in
`losses.py`: the top-k terms do not sum to a divergence) and aggregates them (`agg_loss`, its
`loss_agg_mode`), or takes them as a reward (`use_policy_gradient`, detached).

`topk_outputs` below computes the same five tensors from hidden states (N, H) and the head (V, H):

- the values and the diagnostics in one no-grad pass over row chunks (the GEMM at fp32 accuracy,
  then verl's formulas on the chunk; its top-K for the overlap): R·V·4 bytes a chunk, never N·V;
- the gradient of the losses with respect to the hidden states and the head from
  `flashkd.fused_linear_distill_topk`, run in the backward with `row_weight` = the losses'
  grad_output: exact for whatever verl does with them downstream (the clamp at 0, each
  `loss_agg_mode` and its global-batch normalisers, `loss_max_clamp`, the coefficient), with
  nothing of verl's aggregation restated here; a detached use (policy-gradient mode) never runs it.

  verl's loss is Σ p (log p − log q) over the ids with q over the whole vocab: its gradient in z is
  P q − p (P = Σ p over the ids that the clamp leaves to the student), which is P times the gradient of
  flashkd's forward KL with tail="bucket" against the teacher renormalised over those ids (its bucket
  then holds no teacher mass): the backward passes those targets, ids whose student log-prob the clamp
  cut at −1 (no gradient, as in verl), and row_weight = grad_output · P.

- options verl does not have: loss="reverse_kl" or "jsd" (β) over the same K ids plus a tail
  bucket for the rest of the vocab (flashkd's top-k form, `flashkd.losses.topk_row_losses`, whose
  values are then the per-token losses), as verl's users ask for.

Costs: the forward pass is one GEMM of the head (no grad) and a top-K per row; the backward one
flashkd top-k call (its GEMM and the two gradient GEMMs). Four GEMMs of N·V·H, where verl's own path
does three, with N·V·(2 + 4 + 4) bytes of logits, log-softmax and its gradient alive at once.

`patch()` installs it in verl's FSDP engine (`FSDPEngineWithLMHead`) for runs with
`actor.use_fused_kernels=True` (the path where the model returns no logits): it asks the model for its
hidden states, takes the last (the LM head's input) and the LM head's weight (gathered once when it
is an FSDP2 DTensor), and puts the five tensors into the model output where verl's fused path puts
its own. It refuses a verl version other than `TESTED_VERL_VERSIONS`. verl builds the engine in its
Ray workers: `VERL_USE_EXTERNAL_MODULES=flashkd.integrations.verl` in their environment makes each
import this module with verl, and the import installs the patch (with its default options).
"""

from __future__ import annotations

import importlib.metadata
import math
import os

import torch

from ..distill import KEYWORDS, fused_linear_distill_topk
from ..distill import check_options as distill_check_options
from ..losses import LossSpec, loss_parameters, topk_row_losses
from . import announce, full_head

TESTED_VERL_VERSIONS = ("0.9.1",)
LOSSES = ("forward_kl", "reverse_kl", "jsd")
FIELDS = ("distillation_losses", "student_mass", "teacher_mass", "overlap_count", "overlap_token_advantage")

# Added to the renormalised teacher log-probs of the backward's targets: their sum then passes 1 by
# ~2.4e-4, past any rounding of K log-probs, so that flashkd renormalises them and its tail bucket
# holds no teacher mass at all (rather than a rounding's worth); the renormalisation removes it. A row
# whose largest log-prob is within that of 0 is shifted by less, to put it at 0 exactly (p = 1, the
# others adding to it): a log-prob may not pass 0, and capping one would change the ratios.
_ABOVE_ONE = 2.0**-12

_original = None  # (prepare_model_inputs, prepare_model_outputs) of verl's engine while patched
_options: dict = {}


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x @ w^T (+ b) at fp32 accuracy for narrow inputs (the GEMM's fp32 accumulator, as flashkd's
    loss reads it): a trained head's logits reach 20-40, where bf16's ulp is 1/8."""
    if x.dtype in (torch.bfloat16, torch.float16):
        z = torch.mm(x, w.t(), out_dtype=torch.float32) if x.is_cuda else x.float() @ w.float().t()
    else:
        z = x @ w.t()
    return z if b is None else z + b.to(z.dtype)


def _chunk_rows(n: int, v: int, chunk_size: int | None) -> int:
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size: expected None or an int >= 1, got {chunk_size!r}")
        return chunk_size
    # ~512 MiB of fp32 logits a chunk (and as much for the log-softmax): 8192 rows at V = 16k, 864 at 152k
    return max(1, min(n, (512 << 20) // (8 * max(v, 1))))


@torch.no_grad()
def _values(x, w, b, ids, lp, spec: LossSpec, clamp, chunk_size):
    """The per-token outputs (N,) each, and what the backward needs: (outputs, bwd_ids, bwd_lp, bwd_w)."""
    n, v = x.shape[0], w.shape[0]
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    k = ids.shape[-1]
    out = {name: torch.empty(n, dtype=torch.int64 if name == "overlap_count" else wide, device=x.device)
           for name in FIELDS}
    verl_kl = spec.loss == "forward_kl" and spec.tail is None
    bwd_ids = torch.empty_like(ids) if verl_kl else ids
    bwd_lp = torch.empty(n, k, dtype=wide, device=x.device) if verl_kl else lp
    bwd_w = torch.empty(n, dtype=wide, device=x.device) if verl_kl else None
    rows = _chunk_rows(n, v, chunk_size)
    for s in range(0, n, rows):
        e = min(s + rows, n)
        z = _linear(x[s:e], w, b)  # one (R, V) fp32 block, worked on in place
        i, t = ids[s:e], lp[s:e].to(wide)
        if not verl_kl:  # flashkd's top-k form on the untempered logits (it applies τ)
            out["distillation_losses"][s:e] = topk_row_losses(z, (i, t), None, spec)[0]
        if spec.temperature != 1.0:
            z.div_(spec.temperature)
        own = torch.topk(z, k, dim=-1).indices  # the student's top-K (log_softmax keeps the order)
        # log q relative to the row's largest logit, as log_softmax takes it: z_k − logsumexp(z) would
        # round both at the logits' magnitude (fp32's ulp is 4e-6 at 40) before they cancel
        z.sub_(z.max(-1, keepdim=True).values)
        log_q = z.gather(-1, i) - torch.logsumexp(z, -1, keepdim=True)
        del z
        out["student_mass"][s:e] = log_q.exp().sum(-1)
        out["teacher_mass"][s:e] = t.exp().sum(-1)
        lq, lpc = (log_q, t) if clamp is None else (log_q.clamp_min(clamp), t.clamp_min(clamp))
        token_kl = lpc.exp() * (lpc - lq)
        overlap = (i.unsqueeze(-1) == own.unsqueeze(-2)).any(-1)
        count = overlap.sum(-1)
        out["overlap_count"][s:e] = count
        adv = (-token_kl * overlap).sum(-1) / count.clamp_min(1)
        out["overlap_token_advantage"][s:e] = torch.where(count > 0, adv, 0.0)
        if verl_kl:
            out["distillation_losses"][s:e] = token_kl.sum(-1)
            # the gradient's targets: the ids whose student log-prob the clamp leaves alone, the
            # teacher renormalised over them, and their mass as the row's weight
            live = torch.ones_like(i, dtype=torch.bool) if clamp is None else log_q >= clamp
            lp_live = torch.where(live, lpc, -torch.inf)
            mass = torch.logsumexp(lp_live, -1, keepdim=True)
            bwd_ids[s:e] = torch.where(live, i, -1)
            target = lp_live - torch.where(live.any(-1, keepdim=True), mass, 0.0)
            shift = (-target.max(-1, keepdim=True).values).clamp_max(_ABOVE_ONE)
            bwd_lp[s:e] = torch.where(live, target + shift, 0.0)
            bwd_w[s:e] = torch.where(live.any(-1), mass[:, 0].exp(), 0.0)
    return out, bwd_ids, bwd_lp, bwd_w


class _TopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, ids, lp, spec, clamp, chunk_size, keywords):
        out, bwd_ids, bwd_lp, bwd_w = _values(x, w, b, ids, lp, spec, clamp, chunk_size)
        ctx.save_for_backward(x, w, b, bwd_ids, bwd_lp, bwd_w)
        ctx.spec, ctx.chunk_size, ctx.keywords = spec, chunk_size, keywords
        ctx.mark_non_differentiable(*(out[name] for name in FIELDS[1:]))
        return tuple(out[name] for name in FIELDS)

    @staticmethod
    def backward(ctx, g, *_):
        x, w, b, ids, lp, row = ctx.saved_tensors
        spec = ctx.spec
        weight = g if row is None else g * row
        with torch.enable_grad():
            xs = x.detach().requires_grad_(ctx.needs_input_grad[0])
            ws = w.detach().requires_grad_(ctx.needs_input_grad[1])
            bs = None if b is None else b.detach().requires_grad_(ctx.needs_input_grad[2])
            loss = fused_linear_distill_topk(
                xs, ws, ids, lp, None, loss=spec.loss if spec.tail else "forward_kl",
                tail=spec.tail or "bucket", beta=spec.beta if spec.loss == "jsd" else None, temperature=spec.temperature,
                student_bias=bs, reduction="sum", row_weight=weight.detach(), chunk_size=ctx.chunk_size,
                **ctx.keywords,
            )
            wanted = [t for t in (xs, ws, bs) if t is not None and t.requires_grad]
            grads = iter(torch.autograd.grad(loss, wanted)) if wanted else iter(())
        dx, dw, db = (next(grads) if t is not None and t.requires_grad else None for t in (xs, ws, bs))
        return dx, dw, db, None, None, None, None, None, None


def topk_outputs(
    hidden_states: torch.Tensor,  # (..., H) the student's last hidden states (the LM head's input)
    lm_head_weight: torch.Tensor,  # (V, H)
    teacher_ids: torch.Tensor,  # (..., K) integer
    teacher_logprobs: torch.Tensor,  # (..., K)
    *,
    temperature: float = 1.0,
    log_prob_min_clamp: float | None = None,
    loss: str = "forward_kl",
    beta: float | None = None,
    lm_head_bias: torch.Tensor | None = None,
    chunk_size: int | None = None,
    **keywords,
) -> dict[str, torch.Tensor]:
    """verl's `compute_forward_kl_topk` outputs from hidden states: a dict of FIELDS, each (...) like
    teacher_ids without K. `distillation_losses` carries the gradient to hidden_states, lm_head_weight
    and lm_head_bias; the diagnostics are detached (overlap_count int64, the rest fp32; fp64 for fp64
    inputs).

    loss="forward_kl" is verl's (the module docstring), with `log_prob_min_clamp` as verl applies it;
    "reverse_kl" and "jsd" (β in flashkd's convention: 0 forward, 1 reverse) are flashkd's top-k form
    over the teacher's ids and a tail bucket (`flashkd.losses.topk_row_losses`), without a clamp; β is
    read by "jsd" only (None: 0.5).
    `keywords` go to `flashkd.fused_linear_distill_topk` (backend, grad_accum_dtype, check_teacher, ...).
    """
    spec = check_options(loss=loss, beta=beta, temperature=temperature, log_prob_min_clamp=log_prob_min_clamp,
                         chunk_size=chunk_size, **keywords)
    for name, t in (("hidden_states", hidden_states), ("lm_head_weight", lm_head_weight),
                    ("teacher_ids", teacher_ids), ("teacher_logprobs", teacher_logprobs)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if teacher_ids.shape != teacher_logprobs.shape or teacher_ids.shape[:-1] != hidden_states.shape[:-1]:
        raise ValueError(f"teacher_ids, teacher_logprobs: expected shape (..., K) with leading dims "
                         f"{tuple(hidden_states.shape[:-1])} (hidden_states'), got {tuple(teacher_ids.shape)} and "
                         f"{tuple(teacher_logprobs.shape)}")
    if teacher_ids.dtype.is_floating_point or teacher_ids.dtype == torch.bool:
        raise TypeError(f"teacher_ids: expected an integer dtype, got {teacher_ids.dtype}")
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden_states.shape[-1]:
        raise ValueError(f"lm_head_weight: expected shape (V, {hidden_states.shape[-1]}), got "
                         f"{tuple(lm_head_weight.shape)}")
    lead = teacher_ids.shape[:-1]
    k = teacher_ids.shape[-1]
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    ids = teacher_ids.reshape(-1, k).long()
    if x.device.type == "cpu" and ids.numel() and (ids.min() < 0 or ids.max() >= lm_head_weight.shape[0]):
        raise ValueError(f"teacher_ids: expected ids in [0, {lm_head_weight.shape[0]}) (the LM head's rows), got "
                         f"values in [{int(ids.min())}, {int(ids.max())}]")
    if k > lm_head_weight.shape[0]:
        raise ValueError(f"teacher_ids: expected K <= V = {lm_head_weight.shape[0]}, got K = {k}")
    outs = _TopK.apply(x, lm_head_weight, lm_head_bias, ids, teacher_logprobs.reshape(-1, k), spec,
                       log_prob_min_clamp, chunk_size, keywords)
    return {name: o.reshape(lead) for name, o in zip(FIELDS, outs)}


# the keywords topk_outputs passes to fused_linear_distill_topk itself
_SET_HERE = frozenset({"loss", "beta", "temperature", "chunk_size", "student_bias", "tail", "weight_hard_loss",
                       "weight_soft_loss", "row_weight", "reduction"})


def check_options(*, loss="forward_kl", beta=None, temperature=1.0, log_prob_min_clamp=None, chunk_size=None,
                  **keywords) -> LossSpec:
    """`topk_outputs`'s options (no tensors), checked: its LossSpec. `patch` checks its options here, so
    that a wrong one fails where it is given, not in verl's first training step."""
    if loss not in LOSSES:
        raise ValueError(f"loss: expected one of {', '.join(map(repr, LOSSES))}, got {loss!r}")
    if log_prob_min_clamp is not None:
        if isinstance(log_prob_min_clamp, bool) or not isinstance(log_prob_min_clamp, (int, float)):
            raise TypeError(f"log_prob_min_clamp: expected a float or None, got {log_prob_min_clamp!r}")
        if not math.isfinite(log_prob_min_clamp):
            raise ValueError(f"log_prob_min_clamp: expected a finite float, got {log_prob_min_clamp!r}")
        if loss != "forward_kl":
            raise ValueError(f"log_prob_min_clamp: verl clamps its forward KL only; expected None with "
                             f"loss={loss!r}, got {log_prob_min_clamp!r}")
    wrong = sorted(set(keywords) & _SET_HERE | set(keywords) - set(KEYWORDS["fused_linear_distill_topk"]))
    if wrong:
        raise TypeError(f"{wrong[0]}: expected a keyword option of topk_outputs or flashkd.fused_linear_distill_topk "
                        f"that topk_outputs does not set itself, got {wrong[0]}={keywords[wrong[0]]!r}")
    distill_check_options({"loss": loss, "beta": beta, "temperature": temperature,
                           "chunk_size": chunk_size, **keywords}, "fused_linear_distill_topk")
    return LossSpec(loss=loss, **loss_parameters(loss, dict(beta=beta)), temperature=temperature, weight_hard=0.0,
                    weight_soft=1.0, want_hard=False, tail=None if loss == "forward_kl" else "bucket")


# --- verl's FSDP engine -----------------------------------------------------------------------------

_ENGINE = "verl.workers.engine.fsdp.transformer_impl"


def _check_version():
    try:
        version = importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError('flashkd.integrations.verl.patch(): verl is not installed (pip install "flashkd[verl]")')
    if version not in TESTED_VERL_VERSIONS:
        raise RuntimeError(f"flashkd.integrations.verl.patch(): verl {version} is installed; this patch is tested "
                           f"with verl {', '.join(TESTED_VERL_VERSIONS)} only (its engine's model outputs and "
                           f"distillation loss may differ): install one of those, or leave it unpatched")
    return version


def _last_hidden(output):
    hidden = getattr(output, "hidden_states", None)
    if not hidden:
        raise RuntimeError("flashkd.integrations.verl: the model returned no hidden_states with "
                           "output_hidden_states=True; its forward must pass them through")
    return hidden[-1]


def _lm_head(module):
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    if head is None:
        raise RuntimeError(f"flashkd.integrations.verl: {type(module).__name__} has no output embeddings (LM head)")
    return head


def patch(**options) -> None:
    """Install flashkd's top-k path in verl's FSDP engine (`FSDPEngineWithLMHead`): for a micro-batch
    with top-k distillation and `use_fused_kernels`, the model's last hidden states and LM head give
    verl's five per-token outputs (`topk_outputs`). `options` go to `topk_outputs` (loss="reverse_kl"
    or "jsd", beta, chunk_size, backend, ...); the temperature and `log_prob_min_clamp` come from verl's
    own config. Idempotent; `unpatch()` restores verl's methods."""
    global _original
    _check_version()
    from verl.utils import tensordict_utils as tu
    from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size, slice_input_tensor
    import importlib

    engine = importlib.import_module(_ENGINE).FSDPEngineWithLMHead
    if _original is None:
        _original = (engine.prepare_model_inputs, engine.prepare_model_outputs)
    inputs_fn, outputs_fn = _original
    for name in ("temperature", "log_prob_min_clamp"):
        if name in options:
            raise TypeError(f"{name}: expected from verl's own config (the micro-batch, distillation_loss), not as "
                            f"an option of patch(), got {name}={options[name]!r}")
    check_options(**options)  # a wrong option fails here, not in verl's first training step
    _options.clear()
    _options.update(options)

    def ours(micro_batch):
        return (tu.get_non_tensor_data(data=micro_batch, key="distillation_use_topk", default=False)
                and tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels", default=False))

    def prepare_model_inputs(self, micro_batch):
        model_inputs, output_args = inputs_fn(self, micro_batch)
        if ours(micro_batch):
            model_inputs["output_hidden_states"] = True
        return model_inputs, output_args

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        model_output = outputs_fn(self, output, output_args, micro_batch, logits_processor_func)
        if not ours(micro_batch) or logits_processor_func is None:
            return model_output
        # verl's worker passes partial(distillation_ppo_loss, config=..., distillation_config=...): the
        # loss's config (its log_prob_min_clamp) is read from there, as its logits path reads it
        cfg = (getattr(logits_processor_func, "keywords", None) or {}).get("distillation_config")
        loss_cfg = getattr(cfg, "distillation_loss", None)
        if loss_cfg is None:
            raise RuntimeError("flashkd.integrations.verl: expected the engine's loss function to be verl's "
                               "partial(distillation_ppo_loss, ..., distillation_config=...), got "
                               f"{logits_processor_func!r}: its distillation config is not known here")
        if getattr(loss_cfg, "loss_mode", "forward_kl_topk") != "forward_kl_topk":
            raise RuntimeError(f"flashkd.integrations.verl: expected distillation loss_mode 'forward_kl_topk' for "
                               f"a top-k run, got {loss_cfg.loss_mode!r}")
        hidden = _last_hidden(output).squeeze(0)  # (total_nnz / sp + pad, H)
        head = _lm_head(self.module)
        weight, bias = full_head(head.weight, getattr(head, "bias", None), hidden.dtype)
        ids = micro_batch["teacher_ids"].values().unsqueeze(0)
        lp = micro_batch["teacher_logprobs"].values().unsqueeze(0)
        if get_ulysses_sequence_parallel_world_size() > 1:  # as verl's compute_forward_kl_topk slices them
            ids, lp = slice_input_tensor(ids, dim=1), slice_input_tensor(lp, dim=1)
        ids, lp = ids.squeeze(0), lp.squeeze(0)
        if ids.shape[0] != hidden.shape[0]:
            raise RuntimeError(f"flashkd.integrations.verl: {ids.shape[0]} teacher rows for {hidden.shape[0]} "
                               f"hidden-state rows on this rank")
        temperature = micro_batch["temperature"]
        if isinstance(temperature, torch.Tensor):
            temperature = temperature.flatten()[0].item()  # verl's fused path takes one temperature
        outs = topk_outputs(hidden, weight.to(hidden.dtype), ids, lp, temperature=float(temperature),
                            log_prob_min_clamp=getattr(loss_cfg, "log_prob_min_clamp", None),
                            lm_head_bias=None if bias is None else bias.to(hidden.dtype), **_options)
        cu_seqlens = micro_batch["input_ids"].offsets()
        for name, v in outs.items():
            v = self._gather_and_unpad_packed(v, output_args["pad_size"])
            model_output[name] = torch.nested.nested_tensor_from_jagged(v, cu_seqlens)
        return model_output

    engine.prepare_model_inputs = prepare_model_inputs
    engine.prepare_model_outputs = prepare_model_outputs
    announce("verl's FSDP engine computes top-k distillation (use_fused_kernels) with flashkd "
             "(flashkd.integrations.verl.patch; unpatch() undoes it)")


def unpatch() -> None:
    """verl's own engine methods again (nothing when not patched)."""
    global _original
    if _original is None:
        return
    import importlib

    engine = importlib.import_module(_ENGINE).FSDPEngineWithLMHead
    engine.prepare_model_inputs, engine.prepare_model_outputs = _original
    _original = None
    _options.clear()


def is_patched() -> bool:
    return _original is not None


# verl imports the modules named in VERL_USE_EXTERNAL_MODULES in every process that imports verl (its
# Ray workers too, where the engine is built): naming this module there installs the patch in each.
if __name__ in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(","):
    patch()
