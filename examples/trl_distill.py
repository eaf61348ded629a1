"""TRL's DistillationTrainer (on-policy distillation) with flashkd's loss: one line, `patch()`.

Tiny Llama-style student and teacher built from configs and a word-level tokenizer, all in memory;
seconds on CPU. Needs the `trl` extra (pip install -e ".[trl]")."""

import tempfile
import warnings

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import DistillationConfig, DistillationTrainer

import flashkd.integrations.trl

flashkd.integrations.trl.patch()  # the one line: TRL's loss helper is now flashkd's

# Checkpointing off (TRL's default is on), by the name this transformers knows: recent releases (5.24)
# call it `activation_checkpointing` and warn at the old name, `gradient_checkpointing`
CHECKPOINTING = "activation_checkpointing" if hasattr(DistillationConfig, "activation_checkpointing") else \
    "gradient_checkpointing"
# TRL 1.16 itself reads the model's deprecated `is_gradient_checkpointing` before each generation: its
# warning, not this script's
warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)

words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(58)]
tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                    padding_side="left")


def llama(hidden, seed, init):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(words), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, pad_token_id=0, eos_token_id=1, bos_token_id=None,
        tie_word_embeddings=False, initializer_range=init))


student, teacher = llama(16, 0, 0.02), llama(32, 1, 1.0)
g = torch.Generator().manual_seed(0)
prompts = [" ".join(words[3 + int(i)] for i in torch.randint(0, 58, (4,), generator=g)) for _ in range(64)]
with tempfile.TemporaryDirectory() as out:  # the trainer's output_dir: it saves nothing here, but makes it
    args = DistillationConfig(
        output_dir=out, per_device_train_batch_size=8, max_completion_length=8, max_steps=8,
        learning_rate=3e-2, lr_scheduler_type="constant", beta=0.5, temperature=1.0, logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=not torch.cuda.is_available(), bf16=False, disable_tqdm=True,
        **{CHECKPOINTING: False},
    )
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=args, processing_class=tokenizer,
                                  train_dataset=Dataset.from_dict({"prompt": prompts}))
    trainer.train()
for h in trainer.state.log_history:
    if "loss" in h:
        print(f"step {h['step']}: loss {h['loss']:.4f}  student entropy {h['entropy']:.3f}")
