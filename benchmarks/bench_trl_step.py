"""A whole training step of TRL's DistillationTrainer, with TRL's own loss and with flashkd's
(`flashkd.integrations.trl.patch()`), in one process, on the same models and data.

Models: a Llama-style student and teacher built from transformers configs (no downloads), random
weights, few layers so that, as in real distillation of large-vocabulary models, the LM heads and the
loss are a large part of the step. Defaults: vocab 128256, student hidden 2048 (Llama-3.2-1B's
widths), teacher hidden 4096 (Llama-3.1-8B's widths), 2 layers each, bf16 weights and bf16 autocast,
batch 16 x (prompt 512 + completion 1536 tokens) = 24576 completion tokens in the loss per step, TRL's
defaults otherwise (AdamW at lr 1e-6, here constant; gradient clipping at 1.0; gradient checkpointing
on), beta 0.5 (the JSD), temperature 1. The teacher's head is re-drawn with a larger std so that its distributions are
peaked (logit std about 3) and the loss is not near zero.

Data: random prompts of exactly --prompt-len tokens from a word-level tokenizer whose words are the
token ids, so TRL tokenizes them to the drawn ids.

DistillationTrainer is on-policy: each step the student samples the completions (transformers'
generate unless vLLM is used). With --generation fixed (the default) that sampling is replaced by
pre-drawn random completions of exactly --completion-len tokens, the same for both variants, and
everything else in the step is TRL's own code: tokenizing, batching, both forward passes, the loss,
the backward pass, clipping, the optimizer step. With --generation student, TRL samples them with
transformers' generate (whose time is then most of the step and is reported on its own too).

Timed: each optimizer step, from the trainer's on_step_begin to its on_step_end callback, between
torch.cuda.synchronize() calls; the first --warmup steps are left out; median and the 20th/80th
percentiles over --steps. Inside the step, the loss helper's forward (its call) and backward (from
the loss's gradient to the student hidden states'), by CUDA events. Memory:
torch.cuda.max_memory_allocated over the variant's whole run, and what was allocated before it (the
models). Check: each variant's first-step loss and gradient norm, printed side by side; the run fails
when the losses differ by more than --loss-rtol.

Needs trl==1.16.0, transformers, accelerate. Where `datasets` is not installed (TRL imports it), the
stand-in in benchmarks/_datasets_stub is used instead (its header says why that is enough here).

Usage: python benchmarks/bench_trl_step.py [--out DIR]           (one GPU)
       python benchmarks/bench_trl_step.py --tiny [--out DIR]    (tiny shapes, fp32, CPU: seconds)
results.json and summary.md go into --out (default: a new bench-trl-step-YYYYmmdd-HHMMSS/).
"""

import contextlib
import functools
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks' shared helpers, however it is loaded
from _trl_common import Clock, arguments, import_datasets, parse, wrapped  # noqa: E402
from _trl_common import quantile as _quantile, seconds as _seconds, stamp as _stamp, sync as _sync  # noqa: E402

DATASETS = import_datasets()

import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from trl.trainer import distillation_trainer as trl_dt  # noqa: E402

import flashkd.integrations.trl as fk_trl  # noqa: E402

SPECIAL = ["<pad>", "<eos>", "<unk>"]  # ids 0, 1, 2; the data never contains them


def parse_args(argv=None):
    p = arguments(__doc__, "bench-trl-step")
    p.add_argument("--student-hidden", type=int, default=2048)
    p.add_argument("--teacher-hidden", type=int, default=4096)
    p.add_argument("--batch", type=int, default=16, help="per-device batch (sequences per step)")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--beta", type=float, default=0.5)
    p.add_argument("--generation", choices=["fixed", "student"], default="fixed",
                   help="fixed: pre-drawn completions in place of the student's sampling; student: TRL samples them")
    p.add_argument("--variants", nargs="+", choices=["trl", "flashkd"], default=["trl", "flashkd"])
    p.add_argument("--no-gradient-checkpointing", action="store_true", help="TRL's default is on")
    p.add_argument("--loss-rtol", type=float, default=None,
                   help="largest relative difference of the first-step losses (default 5e-3 in bf16, 1e-4 in fp32)")
    args = parse(p, argv, dict(vocab=301, student_hidden=16, teacher_hidden=24, layers=1, batch=3, prompt_len=5,
                               completion_len=7, warmup=1, steps=2))
    if args.loss_rtol is None:
        args.loss_rtol = 1e-4 if args.dtype == torch.float32 else 5e-3
    return args


def tokenizer(vocab):
    """Word-level: the word f"t{i}" is token id i, so a prompt of n words is n tokens, as drawn."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {w: i for i, w in enumerate(SPECIAL)}
    words.update({f"t{i}": i for i in range(len(SPECIAL), vocab)})
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   padding_side="left")


def llama(args, hidden, ffn, seed, device, head_logit_std=None):
    """Llama-3's layout: up to 32 query heads, a quarter as many key/value heads, untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = min(32, max(2, hidden // 64))
    cfg = LlamaConfig(
        vocab_size=args.vocab, hidden_size=hidden, intermediate_size=ffn,
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
        max_position_embeddings=args.prompt_len + args.completion_len, pad_token_id=0, eos_token_id=1,
        bos_token_id=None, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    if head_logit_std is not None:  # hidden states leave the final RMSNorm with unit scale
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, head_logit_std / hidden**0.5)
    return model.to(args.dtype)


class Prompts(torch.utils.data.Dataset):
    """Map-style dataset of {"prompt": text}: DistillationTrainer takes any, not only a datasets.Dataset."""

    def __init__(self, texts):
        self.texts = texts

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        return {"prompt": self.texts[i]}


def install_generation(trainer, completions, seconds):
    """Time the trainer's sampling step; with `completions` (prompt ids -> completion ids), replace it."""
    sample = trainer._generate_single_turn

    def generate(prompt_ids, images, multimodal_fields, has_tool_images=False):
        _sync()
        t0 = time.perf_counter()
        if completions is None:
            out = sample(prompt_ids, images, multimodal_fields, has_tool_images)
        else:  # as TRL's own path returns them: lists of ids, one per prompt
            out = [list(completions[tuple(ids)]) for ids in prompt_ids]
        _sync()
        seconds.append(time.perf_counter() - t0)
        return out

    trainer._generate_single_turn = generate


def timed_loss(helper, stamps):
    """TRL's loss helper (its own or the patch's) with its forward and its backward stamped: the backward from
    the loss's gradient to the student hidden states' (the heads' gradients come in the same pass)."""

    @functools.wraps(helper)
    def timed(student_hidden_states, *args, **kwargs):
        marks = {"forward_start": _stamp()}
        loss, entropy, count = helper(student_hidden_states, *args, **kwargs)
        marks["forward_end"] = _stamp()
        if loss.requires_grad:
            loss.register_hook(lambda g: marks.__setitem__("backward_start", _stamp()))
            student_hidden_states.register_hook(lambda g: marks.__setitem__("backward_end", _stamp()))
        stamps.append(marks)
        return loss, entropy, count

    return timed


def run_variant(name, args, student, initial_state, teacher, tok, data, completions, device):
    student.load_state_dict(initial_state)  # every variant starts from the same student
    gc.collect()  # the previous variant's trainer (its optimizer state) goes here
    gc.freeze()  # and what is left stays out of the collector's later passes: no long pause inside a timed step
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    config = trl.DistillationConfig(
        output_dir=args.trainer_dir, per_device_train_batch_size=args.batch, gradient_accumulation_steps=1,
        max_steps=args.warmup + args.steps, max_completion_length=args.completion_len, beta=args.beta,
        temperature=1.0, bf16=args.dtype == torch.bfloat16, use_cpu=device.type == "cpu",
        gradient_checkpointing=not args.no_gradient_checkpointing, logging_steps=1, report_to=[], save_strategy="no",
        disable_tqdm=True, seed=args.seed, shuffle_dataset=False, lr_scheduler_type="constant",
    )
    clock, generation, losses, loss_stamps = Clock(), [], [], []
    trainer = trl.DistillationTrainer(model=student, teacher_model=teacher, args=config, train_dataset=data,
                                      processing_class=tok, callbacks=[clock])
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # its per-step dicts: in results.json
    install_generation(trainer, completions, generation)
    compute_loss = trainer.compute_loss

    def recorded(*a, **kw):  # the loss as the trainer got it; .item() only after the run (no extra sync)
        loss = compute_loss(*a, **kw)
        losses.append((loss[0] if isinstance(loss, tuple) else loss).detach())
        return loss

    trainer.compute_loss = recorded
    try:
        with (fk_trl.patch() if name == "flashkd" else contextlib.nullcontext(),
              wrapped(trl_dt, "_chunked_divergence_loss", lambda helper: timed_loss(helper, loss_stamps)) as helper):
            assert (helper is fk_trl.chunked_divergence_loss) == (name == "flashkd"), helper
            trainer.train()
    finally:
        # accelerate wrapped each model's forward in autocast for this trainer: unwrap, so that the next variant's
        # trainer wraps the same plain models (not a second layer around the first)
        for model in (student, teacher):
            model.__dict__.pop("forward", None)
            model.__dict__.pop("_original_forward", None)
    assert not fk_trl.is_patched()
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    logs = trainer.state.log_history
    grad_norms = [h["grad_norm"] for h in logs if "grad_norm" in h]
    tokens = [h["completions/mean_length"] * args.batch for h in logs if "completions/mean_length" in h]
    del trainer, compute_loss, recorded
    gc.collect()
    _sync()
    loss_forward = [_seconds(m["forward_start"], m["forward_end"]) for m in loss_stamps]
    loss_backward = [_seconds(m["backward_start"], m["backward_end"]) for m in loss_stamps if "backward_end" in m]
    timed = clock.steps[args.warmup:]
    timed_gen = generation[args.warmup:] if len(generation) == len(clock.steps) else []
    return {
        "variant": name,
        "step_s": clock.steps,
        "generation_s": generation,
        "timed_steps": len(timed),
        "median_s": statistics.median(timed),
        "p20_s": _quantile(timed, 0.2),
        "p80_s": _quantile(timed, 0.8),
        "median_generation_s": statistics.median(timed_gen) if timed_gen else None,
        "median_without_generation_s": statistics.median([s - g for s, g in zip(timed, timed_gen)]) if timed_gen else None,
        "loss_forward_s": loss_forward,
        "loss_backward_s": loss_backward,
        "median_loss_forward_s": statistics.median(loss_forward[args.warmup:]),
        "median_loss_backward_s": statistics.median(loss_backward[args.warmup:]),
        "losses": [float(x) for x in losses],
        "grad_norms": [float(x) for x in grad_norms],
        "completion_tokens_per_step": tokens,
        "resident_bytes": resident,
        "peak_bytes": peak,
    }


def main(argv=None):
    args = parse_args(argv)
    args.out = args.out or Path(time.strftime("bench-trl-step-%Y%m%d-%H%M%S"))
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-trl-step-") as trainer_dir:  # the trainers' output_dir: they save nothing
        args.trainer_dir = trainer_dir
        return _main(args)


def _main(args):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n_rows = args.batch * (args.warmup + args.steps)
    g = torch.Generator().manual_seed(args.seed)
    low = len(SPECIAL)
    prompt_ids = torch.randint(low, args.vocab, (n_rows, args.prompt_len), generator=g)
    texts = [" ".join(f"t{i}" for i in row) for row in prompt_ids.tolist()]
    completions = None
    if args.generation == "fixed":
        drawn = torch.randint(low, args.vocab, (n_rows, args.completion_len), generator=g).tolist()
        completions = {tuple(p): c for p, c in zip(prompt_ids.tolist(), drawn)}
        if len(completions) != n_rows:
            raise RuntimeError("two prompts were drawn equal; change --seed")
    tok = tokenizer(args.vocab)
    assert tok(text=texts[:1])["input_ids"][0] == prompt_ids[0].tolist(), "the tokenizer does not give the drawn ids"

    # MLP widths as in Llama-3.2-1B (4 x 2048) and Llama-3.1-8B (3.5 x 4096)
    student = llama(args, args.student_hidden, 4 * args.student_hidden, args.seed + 1, device)
    teacher = llama(args, args.teacher_hidden, 7 * args.teacher_hidden // 2, args.seed + 2, device, head_logit_std=3.0)
    initial_state = {k: v.detach().clone() for k, v in student.state_dict().items()}
    shape = (f"vocab {args.vocab}, student hidden {args.student_hidden} / teacher hidden {args.teacher_hidden}, "
             f"{args.layers} layers each, batch {args.batch} x (prompt {args.prompt_len} + completion "
             f"{args.completion_len}), {str(args.dtype).removeprefix('torch.')}, beta {args.beta}, generation "
             f"{args.generation}, gradient checkpointing {'off' if args.no_gradient_checkpointing else 'on'}")
    env = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
        "trl": trl.__version__, "datasets": DATASETS, "python": sys.version.split()[0],
        "student_params": sum(p.numel() for p in student.parameters()),
        "teacher_params": sum(p.numel() for p in teacher.parameters()),
    }
    print(shape)
    print(", ".join(f"{k} {v}" for k, v in env.items()), flush=True)

    results = []
    for name in args.variants:
        print(f"--- {name}: {args.warmup} warm-up + {args.steps} timed steps", flush=True)
        r = run_variant(name, args, student, initial_state, teacher, tok, Prompts(texts), completions, device)
        results.append(r)
        print(f"{name}: median {r['median_s'] * 1e3:.1f} ms (p20 {r['p20_s'] * 1e3:.1f}, p80 {r['p80_s'] * 1e3:.1f}), "
              f"loss forward {r['median_loss_forward_s'] * 1e3:.1f} + backward {r['median_loss_backward_s'] * 1e3:.1f} ms, "
              f"peak {r['peak_bytes'] / 2**30:.2f} GiB (resident before {r['resident_bytes'] / 2**30:.2f} GiB), "
              f"first loss {r['losses'][0]:.6g}, first grad norm {r['grad_norms'][0]:.6g}", flush=True)

    resident = {r["resident_bytes"] for r in results}
    if max(resident) - min(resident) > 64 * 2**20:
        print("warning: the variants started with different memory allocated (a trainer's leftovers?); compare "
              "peaks minus resident, or run each variant alone (--variants)")
    check = None
    by = {r["variant"]: r for r in results}
    if {"trl", "flashkd"} <= by.keys():
        a, b = by["trl"]["losses"][0], by["flashkd"]["losses"][0]
        rel = abs(b - a) / max(abs(a), 1e-30)
        ga, gb = by["trl"]["grad_norms"][0], by["flashkd"]["grad_norms"][0]
        check = {"first_loss_trl": a, "first_loss_flashkd": b, "relative_difference": rel, "rtol": args.loss_rtol,
                 "first_grad_norm_trl": ga, "first_grad_norm_flashkd": gb, "agree": rel <= args.loss_rtol}
        print(f"first-step loss: TRL {a:.8g}  flashkd {b:.8g}  (relative difference {rel:.2e}, "
              f"{'within' if check['agree'] else 'OVER'} {args.loss_rtol:g}); grad norm: TRL {ga:.6g}  flashkd {gb:.6g}")

    summary = {"shape": shape, "args": {k: str(v) for k, v in vars(args).items()}, "env": env, "results": results,
               "first_step_check": check}
    (args.out / "results.json").write_text(json.dumps(summary, indent=1))
    (args.out / "summary.md").write_text(markdown(shape, env, results, check))
    print((args.out / "summary.md").read_text())
    print(f"wrote {args.out / 'results.json'}, {args.out / 'summary.md'}")
    return 0 if check is None or check["agree"] else 1


def markdown(shape, env, results, check):
    lines = [f"TRL {env['trl']} DistillationTrainer, one optimizer step, {env['device']} (torch {env['torch']}, "
             f"transformers {env['transformers']}, {env['datasets']}).", "", shape + ".", "",
             "| loss | step median ms | p20 | p80 | without sampling | loss forward | loss backward | peak GiB "
             "| resident GiB | first loss |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        wo = r["median_without_generation_s"]
        lines.append(f"| {'TRL (own)' if r['variant'] == 'trl' else 'flashkd (patched)'} | {r['median_s'] * 1e3:.1f} | "
                     f"{r['p20_s'] * 1e3:.1f} | {r['p80_s'] * 1e3:.1f} | {'' if wo is None else f'{wo * 1e3:.1f}'} | "
                     f"{r['median_loss_forward_s'] * 1e3:.1f} | {r['median_loss_backward_s'] * 1e3:.1f} | "
                     f"{r['peak_bytes'] / 2**30:.2f} | {r['resident_bytes'] / 2**30:.2f} | {r['losses'][0]:.6g} |")
    by = {r["variant"]: r for r in results}
    if {"trl", "flashkd"} <= by.keys():
        lines += ["", f"Step time TRL / flashkd: {by['trl']['median_s'] / by['flashkd']['median_s']:.2f}x; "
                      f"peak memory flashkd - TRL: {(by['flashkd']['peak_bytes'] - by['trl']['peak_bytes']) / 2**30:+.2f} GiB."]
    lines += ["", "Medians in ms over the timed steps. Without sampling: the step minus the student's sampling (or the "
              "look-up of the pre-drawn completions). Loss forward / backward: the loss helper's call, and the "
              "backward from the loss's gradient to the student hidden states' (CUDA events)."]
    if check is not None:
        lines += [f"First-step loss relative difference {check['relative_difference']:.2e} "
                  f"({'agree' if check['agree'] else 'DISAGREE'} at rtol {check['rtol']:g})."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
