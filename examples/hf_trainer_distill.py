"""Distillation from a live teacher in a Hugging Face Trainer: flashkd's DistillationTrainer.

The loss takes both models' last hidden states (their LM heads run fused in flashkd: no full logits),
shifts the labels, masks padding and is exact under gradient accumulation. Tiny Llama-style models and
a word-level tokenizer, all in memory; seconds on CPU. Needs transformers and datasets."""

import tempfile

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (DataCollatorForLanguageModeling, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast,
                          TrainingArguments)

from flashkd.integrations.transformers import DistillationTrainer

words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(58)]
tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def llama(hidden, seed, **config):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(words), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, pad_token_id=0, eos_token_id=1, bos_token_id=None,
        tie_word_embeddings=False, **config))


# A Gemma-style softcap on the teacher's logits: read from its config, as TRL reads it.
student, teacher = llama(16, 0), llama(32, 1, initializer_range=1.0, final_logit_softcapping=30.0)
g = torch.Generator().manual_seed(0)
texts = []
for _ in range(128):  # runs of consecutive words, of random lengths
    start, length = int(torch.randint(0, 58, (), generator=g)), int(torch.randint(3, 12, (), generator=g))
    texts.append(" ".join(words[3 + (start + i) % 58] for i in range(length)) + " <eos>")
data = Dataset.from_dict({"input_ids": [tokenizer(t)["input_ids"] for t in texts]})

with tempfile.TemporaryDirectory() as out:  # the Trainer's output_dir: it saves nothing here, but makes it
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, max_steps=8, learning_rate=3e-2, logging_steps=1,
                             report_to=[], save_strategy="no", disable_tqdm=True, use_cpu=not torch.cuda.is_available())
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=args, train_dataset=data,
                                  data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
                                  loss="jsd", beta=0.5, temperature=1.0, weight_hard_loss=0.5, weight_soft_loss=0.5)
    trainer.train()
for h in trainer.state.log_history:
    if "loss" in h:
        print(f"step {h['step']}: loss {h['loss']:.4f}")
