"""TRL's on-policy distillation loss against flashkd's patch: `_chunked_jsd_loss` (TRL 1.16's
AsyncDistillationTrainer, a served teacher's top-k) vs `flashkd.integrations.trl.chunked_jsd_loss`,
and a whole optimizer step of the trainer with each, in one process on the same inputs.

Loss (`--parts loss`): N valid positions (default 8192) of a student with vocab 128256 and hidden 2048
(Llama-3.2-1B's widths), bf16 hidden states and head (a bf16 student; TRL projects them in fp32,
flashkd in bf16), the teacher's candidates as the trainer builds them: K = 2 is TRL's path for β ≠ 0
(the teacher's top-1 and the sampled token, `_narrow_top1_actual_support`, here β = 0.5), K = 20 and
100 its β = 0 path (the teacher's top-K plus the sampled token where it is not among them), the tail
bucket on (TRL's default). Teacher log-probs from random logits of std 3; student logits of std
about 2. Timed: forward + backward (the loss, then its gradient to the hidden states, the head's
weight), CUDA events, median and 20th / 80th percentiles over --reps after --warmup. Memory: peak
allocated during one forward + backward, minus what was allocated before it (inputs, their grads
from the previous call freed). Check: the two losses and statistics, side by side; the run fails when
a loss differs by more than --loss-rtol (1e-5: flashkd's logits are the bf16 GEMM's fp32 accumulator,
TRL's the fp32 product of the same values).

Trainer step (`--parts step`): AsyncDistillationTrainer without vLLM: a stand-in rollout worker
(TRL's RolloutWorkerProtocol) serves pre-drawn samples, each with random teacher candidates as a
served teacher gives them; no weight transfer. Student: a 2-layer Llama with the widths above, bf16
weights, sdpa attention (TRL's default FlashAttention-3 hub kernel is not needed to time the loss),
gradient checkpointing on (TRL's default), batch --step-batch sequences of prompt + completion
tokens. Timed per optimizer step between on_step_begin and on_step_end (device synchronized); loss
forward and backward inside the step by CUDA events.

Usage: python benchmarks/bench_trl_onpolicy.py [--out DIR]           (one GPU; a few minutes)
       python benchmarks/bench_trl_onpolicy.py --tiny [--out DIR]    (tiny shapes, fp32, CPU: checks only)
results.json and summary.md go into --out (default: a new bench-trl-onpolicy-YYYYmmdd-HHMMSS/).
Needs trl==1.16.0, transformers, accelerate; `datasets` or the stand-in in benchmarks/_datasets_stub.
"""

import contextlib
import functools
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks' shared helpers, however it is loaded
from _trl_common import Clock, NoWeightTransfer, ServedRollouts, arguments, import_datasets, parse, wrapped  # noqa: E402
from _trl_common import quantile as _quantile, seconds as _seconds, stamp as _stamp, sync as _sync  # noqa: E402

DATASETS = import_datasets()

import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from trl.experimental.async_distillation import async_distillation_trainer as trl_ad  # noqa: E402

import flashkd.integrations.trl as fk_trl  # noqa: E402

SPECIAL = 3  # ids 0, 1, 2: pad, eos, unk; never drawn


def parse_args(argv=None):
    p = arguments(__doc__, "bench-trl-onpolicy")
    p.add_argument("--parts", nargs="+", choices=["loss", "step"], default=["loss", "step"])
    p.add_argument("--positions", type=int, default=8192, help="valid positions in the loss")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--k", type=int, nargs="+", default=[2, 20, 100], help="candidates per position (2: β = 0.5)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--step-batch", type=int, default=4, help="sequences per optimizer step")
    p.add_argument("--step-k", type=int, default=20, help="the served teacher's top-k in the trainer step")
    p.add_argument("--step-beta", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=6, help="timed optimizer steps (after --warmup of them)")
    p.add_argument("--loss-rtol", type=float, default=1e-5,
                   help="largest relative difference of the losses (TRL's fp32 product against flashkd's fp32 "
                        "accumulator of the same bf16 values)")
    return parse(p, argv, dict(positions=40, vocab=301, hidden=16, k=[2, 5], warmup=1, reps=2, layers=1,
                               step_batch=3, prompt_len=4, completion_len=6, step_k=4, steps=2))


def candidates(n, v, k, beta, device, g, teacher_std=3.0):
    """A served teacher's candidates as AsyncDistillationTrainer passes them to its loss: β = 0 the
    top-k plus the sampled token where it is not among them (k + 1 slots, -1 padded); β ≠ 0 TRL's own
    narrowing to the top-1 and the sampled token. Teacher logits drawn a block of rows at a time."""
    ids = torch.full((n, k + 1), -1, dtype=torch.long, device=device)
    lps = torch.full((n, k + 1), -math.inf, device=device)
    actual = torch.randint(SPECIAL, v, (n,), device=device, generator=g)
    for start in range(0, n, 1024):
        rows = slice(start, min(start + 1024, n))
        lp = torch.log_softmax(teacher_std * torch.randn(rows.stop - start, v, device=device, generator=g), -1)
        top = lp.topk(k, -1)
        ids[rows, :k], lps[rows, :k] = top.indices, top.values
        a = actual[rows]
        outside = ~(top.indices == a[:, None]).any(-1)
        ids[rows, k] = torch.where(outside, a, -1)
        lps[rows, k] = torch.where(outside, lp.gather(1, a[:, None])[:, 0], -math.inf)
    mask = ids != -1
    if beta != 0.0:
        return trl_ad._narrow_top1_actual_support(ids, lps, actual, mask, beta)
    return ids, lps, mask


def loss_case(helper, inputs, args, device):
    """(times of forward + backward, peak extra bytes, first results) of one helper on the inputs."""
    hidden, weight, rest = inputs

    def once():
        hidden.grad = weight.grad = None
        out = helper(hidden, weight, None, 1.0, None, *rest)
        out[0].backward()
        return out

    first = [x.detach().clone() for x in once()]
    for _ in range(args.warmup):
        once()
    times = []
    for _ in range(args.reps):
        hidden.grad = weight.grad = None
        _sync()
        a = _stamp()
        once()
        b = _stamp()
        _sync()
        times.append(_seconds(a, b))
    peak = 0
    if device.type == "cuda":
        hidden.grad = weight.grad = None
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        once()
        _sync()
        peak = torch.cuda.max_memory_allocated() - before
    return times, peak, first


def run_loss(args, device):
    g = torch.Generator(device).manual_seed(args.seed)
    n, v, h = args.positions, args.vocab, args.hidden
    hidden = torch.randn(n, h, device=device, generator=g).to(args.dtype).requires_grad_()
    weight = (2.0 / math.sqrt(h) * torch.randn(v, h, device=device, generator=g)).to(args.dtype).requires_grad_()
    rows = []
    for k in args.k:
        beta = 0.5 if k == 2 else 0.0
        ids, lps, mask = candidates(n, v, 20 if k == 2 else k, beta, device, g)
        rest = (ids, lps, mask, beta, 1.0, True, None, 1, trl_ad._CHUNKED_LM_HEAD_CHUNK_SIZE)
        result = {"k": k, "beta": beta, "slots": ids.shape[1]}
        for name, helper in (("trl", trl_ad._chunked_jsd_loss), ("flashkd", fk_trl.chunked_jsd_loss)):
            times, peak, first = loss_case(helper, (hidden, weight, rest), args, device)
            result[name] = {"times_s": times, "median_s": statistics.median(times), "p20_s": _quantile(times, 0.2),
                            "p80_s": _quantile(times, 0.8), "peak_bytes": peak,
                            "results": [x.float().tolist() for x in first[:4]]}
            gc.collect()
        a, b = result["trl"]["results"][0], result["flashkd"]["results"][0]
        result["relative_difference"] = abs(b - a) / max(abs(a), 1e-30)
        result["agree"] = result["relative_difference"] <= args.loss_rtol
        result["speedup"] = result["trl"]["median_s"] / result["flashkd"]["median_s"]
        rows.append(result)
        print(f"K {k} (beta {beta}, {ids.shape[1]} slots): TRL {result['trl']['median_s'] * 1e3:.2f} ms "
              f"{result['trl']['peak_bytes'] / 2**20:.0f} MiB, flashkd {result['flashkd']['median_s'] * 1e3:.2f} ms "
              f"{result['flashkd']['peak_bytes'] / 2**20:.0f} MiB: {result['speedup']:.2f}x; loss TRL {a:.8g} "
              f"flashkd {b:.8g} (relative difference {result['relative_difference']:.2e})", flush=True)
    return rows


# ---- a whole trainer step --------------------------------------------------------------------------------


class Prompts(torch.utils.data.Dataset):
    """The trainer's train_dataset: only its length is read when a rollout worker is given."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"prompt": []}


def samples(args, count, device):
    """Pre-drawn rollouts: random prompt + completion ids, and per position a served teacher's candidates
    (drawn on the device, stored as the worker stores them: numpy arrays)."""
    import numpy as np
    from trl.experimental.async_distillation.async_rollout_worker import RolloutSample

    g = torch.Generator(device).manual_seed(args.seed)
    length = args.prompt_len + args.completion_len
    out = []
    for i in range(count):
        ids = torch.randint(SPECIAL, args.vocab, (length,), device=device, generator=g)
        cand, lps, _ = candidates(length, args.vocab, args.step_k, 0.0, device, g)
        cand[0], lps[0] = -1, -math.inf  # the first position has no teacher entry
        mask = np.zeros(length, dtype=np.int64)
        mask[args.prompt_len:] = 1
        out.append(RolloutSample(prompt=[], completion=[], input_ids=ids.cpu().numpy(), completion_mask=mask,
                                 teacher_topk_ids=cand.cpu().numpy(), teacher_topk_logprobs=lps.cpu().numpy(),
                                 model_version=0, metrics={}, teacher_id="default", prompt_id=i))
    return out


def timed_helper(helper, stamps):
    @functools.wraps(helper)
    def timed(hidden_valid, *a, **kw):
        marks = {"forward_start": _stamp()}
        cuda = hidden_valid.is_cuda
        if cuda:  # where the step's memory goes: the peak before the loss, inside its forward, and what it holds
            marks["allocated_before"] = torch.cuda.memory_allocated()
            marks["peak_before"] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        out = helper(hidden_valid, *a, **kw)
        marks["forward_end"] = _stamp()
        if cuda:
            marks["allocated_after_forward"] = torch.cuda.memory_allocated()
            marks["peak_forward"] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        if out[0].requires_grad:
            out[0].register_hook(lambda g: marks.__setitem__("backward_start", _stamp()))
            hidden_valid.register_hook(lambda g: marks.__setitem__("backward_end", _stamp()))
        stamps.append(marks)
        return out

    return timed


def run_step_variant(name, args, model_dir, device):
    from trl.experimental.async_distillation import AsyncDistillationConfig, AsyncDistillationTrainer

    steps = args.warmup + args.steps
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    config = AsyncDistillationConfig(
        output_dir=args.trainer_dir, per_device_train_batch_size=args.step_batch, max_steps=steps, beta=args.step_beta,
        teacher_top_k=args.step_k, token_budget=0, bf16=args.dtype == torch.bfloat16, use_cpu=device.type == "cpu",
        dtype="bfloat16" if args.dtype == torch.bfloat16 else "float32", report_to=[], save_strategy="no",
        disable_tqdm=True, logging_steps=1, seed=args.seed, lr_scheduler_type="constant",
        model_init_kwargs={"attn_implementation": "sdpa"},
    )
    clock, stamps = Clock(), []
    # No vLLM: the student's server client is built but never called (worker, weight transfer and token budget
    # are given); TRL's MFU metric asks CUDA for the device's name, which a CPU run has not.
    patches = {"VLLMClient": lambda *a, **kw: None}
    if device.type != "cuda":
        patches["get_peak_flops_per_device"] = lambda accelerator, dtype: None
    saved = {k: getattr(trl_ad, k) for k in patches}
    for k, f in patches.items():
        setattr(trl_ad, k, f)
    try:
        trainer = AsyncDistillationTrainer(
            model=str(model_dir), args=config, train_dataset=Prompts(steps * args.step_batch),
            rollout_worker=ServedRollouts(samples(args, (steps + 2) * args.step_batch, device)),
            weight_transfer=NoWeightTransfer(), callbacks=[clock],
        )
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
        resident = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        with (fk_trl.patch() if name == "flashkd" else contextlib.nullcontext(),
              wrapped(trl_ad, "_chunked_jsd_loss", lambda helper: timed_helper(helper, stamps))):
            trainer.train()
    finally:
        for k, f in saved.items():
            setattr(trl_ad, k, f)
    _sync()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    # the loss call resets the peak counter (timed_helper): the step's peak is the largest of the parts'
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    peak = max([peak] + [m[k] for m in stamps for k in ("peak_before", "peak_forward") if k in m])
    memory = {k: max(m[k] for m in stamps) for k in ("allocated_before", "allocated_after_forward", "peak_before",
                                                       "peak_forward") if stamps and k in stamps[0]}
    del trainer
    gc.collect()
    timed = clock.steps[args.warmup:]
    forward = [_seconds(m["forward_start"], m["forward_end"]) for m in stamps]
    backward = [_seconds(m["backward_start"], m["backward_end"]) for m in stamps if "backward_end" in m]
    return {
        "variant": name, "step_s": clock.steps, "median_s": statistics.median(timed), "p20_s": _quantile(timed, 0.2),
        "p80_s": _quantile(timed, 0.8), "loss_forward_s": forward, "loss_backward_s": backward,
        "median_loss_forward_s": statistics.median(forward[args.warmup:]),
        "median_loss_backward_s": statistics.median(backward[args.warmup:]),
        "losses": [h["loss"] for h in logs], "jsd": [h.get("jsd") for h in logs], "resident_bytes": resident,
        "peak_bytes": peak, "memory_bytes": memory,
    }


def run_step(args, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = Path(args.trainer_dir) / "student"
    heads = min(32, max(2, args.hidden // 64))
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                      max_position_embeddings=(args.prompt_len + args.completion_len) * args.step_batch,
                      pad_token_id=0, eos_token_id=1, bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(args.seed)
    LlamaForCausalLM(cfg).to(args.dtype).save_pretrained(model_dir)
    _tokenizer(args.vocab).save_pretrained(model_dir)
    results = []
    for name in ("trl", "flashkd"):
        r = run_step_variant(name, args, model_dir, device)
        results.append(r)
        print(f"step {name}: median {r['median_s'] * 1e3:.1f} ms (p20 {r['p20_s'] * 1e3:.1f}, p80 {r['p80_s'] * 1e3:.1f}), "
              f"loss forward {r['median_loss_forward_s'] * 1e3:.1f} + backward {r['median_loss_backward_s'] * 1e3:.1f} ms, "
              f"peak {r['peak_bytes'] / 2**30:.2f} GiB"
              + "".join(f", {k} {v / 2**30:.2f}" for k, v in r["memory_bytes"].items()) + f", losses {['%.6g' % x for x in r['losses']]}", flush=True)
    a, b = results[0]["losses"][0], results[1]["losses"][0]
    check = {"first_loss_trl": a, "first_loss_flashkd": b, "relative_difference": abs(b - a) / max(abs(a), 1e-30)}
    check["agree"] = check["relative_difference"] <= args.loss_rtol
    return results, check


def _tokenizer(vocab):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>"])}
    words.update({f"t{i}": i for i in range(SPECIAL, vocab)})
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def main(argv=None):
    args = parse_args(argv)
    args.out = args.out or Path(time.strftime("bench-trl-onpolicy-%Y%m%d-%H%M%S"))
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny shapes: one thread (two wait on each other on a loaded machine)
    try:
        # the student the trainers load and their output_dir (they save nothing)
        with tempfile.TemporaryDirectory(prefix="bench-trl-onpolicy-") as trainer_dir:
            args.trainer_dir = trainer_dir
            return _main(args, device)
    finally:
        torch.set_num_threads(threads)


def _main(args, device):
    env = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "cuda": torch.version.cuda, "transformers": transformers.__version__, "trl": trl.__version__,
           "datasets": DATASETS, "python": sys.version.split()[0]}
    shape = (f"{args.positions} positions, vocab {args.vocab}, hidden {args.hidden}, "
             f"{str(args.dtype).removeprefix('torch.')}, K {args.k}")
    print(shape + "; " + ", ".join(f"{k} {v}" for k, v in env.items()), flush=True)
    summary = {"shape": shape, "env": env, "args": {k: str(v) for k, v in vars(args).items()}}
    ok = True
    if "loss" in args.parts:
        summary["loss"] = run_loss(args, device)
        ok &= all(r["agree"] for r in summary["loss"])
    if "step" in args.parts:
        summary["step"], summary["step_check"] = run_step(args, device)
        ok &= summary["step_check"]["agree"]
    (args.out / "results.json").write_text(json.dumps(summary, indent=1))
    (args.out / "summary.md").write_text(markdown(summary, args))
    print((args.out / "summary.md").read_text())
    print(f"wrote {args.out / 'results.json'}, {args.out / 'summary.md'}")
    return 0 if ok else 1


def markdown(summary, args):
    env = summary["env"]
    lines = [f"TRL {env['trl']} on-policy distillation loss (`_chunked_jsd_loss`) vs flashkd's patch, {env['device']} "
             f"(torch {env['torch']}, transformers {env['transformers']}).", ""]
    if "loss" in summary:
        lines += [f"Loss alone: {summary['shape']}; forward + backward, median of {args.reps} (p20-p80).", "",
                  "| K | β | TRL ms | flashkd ms | speed-up | TRL peak MiB | flashkd peak MiB | loss rel. diff |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in summary["loss"]:
            t, f = r["trl"], r["flashkd"]
            lines.append(f"| {r['k']} | {r['beta']} | {t['median_s'] * 1e3:.2f} ({t['p20_s'] * 1e3:.2f}-{t['p80_s'] * 1e3:.2f}) | "
                         f"{f['median_s'] * 1e3:.2f} ({f['p20_s'] * 1e3:.2f}-{f['p80_s'] * 1e3:.2f}) | {r['speedup']:.2f}x | "
                         f"{t['peak_bytes'] / 2**20:.0f} | {f['peak_bytes'] / 2**20:.0f} | {r['relative_difference']:.1e} |")
        lines.append("")
    if "step" in summary:
        lines += [f"AsyncDistillationTrainer optimizer step (stand-in rollout worker, no vLLM): {args.layers}-layer "
                  f"Llama, vocab {args.vocab}, hidden {args.hidden}, {args.step_batch} x ({args.prompt_len} + "
                  f"{args.completion_len}) tokens, top-{args.step_k}, β {args.step_beta}.", "",
                  "| loss | step ms | p20 | p80 | loss forward ms | loss backward ms | peak GiB |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for r in summary["step"]:
            lines.append(f"| {'TRL (own)' if r['variant'] == 'trl' else 'flashkd (patched)'} | {r['median_s'] * 1e3:.1f} | "
                         f"{r['p20_s'] * 1e3:.1f} | {r['p80_s'] * 1e3:.1f} | {r['median_loss_forward_s'] * 1e3:.1f} | "
                         f"{r['median_loss_backward_s'] * 1e3:.1f} | {r['peak_bytes'] / 2**30:.2f} |")
        c = summary["step_check"]
        lines += ["", f"First-step loss: TRL {c['first_loss_trl']:.8g}, flashkd {c['first_loss_flashkd']:.8g} "
                      f"(relative difference {c['relative_difference']:.1e})."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
