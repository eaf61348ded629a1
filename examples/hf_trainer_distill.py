"""Distillation from a live teacher in a Hugging Face Trainer: flashkd's DistillationTrainer.

The loss takes both models' last hidden states (their LM heads run fused in flashkd: no full logits),
shifts the labels, masks padding and is exact under gradient accumulation. Tiny Llama-style models and
made-up token ids, all in memory; seconds on CPU. Needs transformers and datasets."""

import tempfile

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models
from transformers import (DataCollatorForLanguageModeling, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast,
                          TrainingArguments)

from flashkd.integrations.transformers import DistillationTrainer

torch.manual_seed(0)
config = dict(vocab_size=64, num_hidden_layers=1, num_attention_heads=2, pad_token_id=0, eos_token_id=1,
              tie_word_embeddings=False)
student = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, **config))
# A Gemma-style softcap on the teacher's logits: read from its config, as TRL reads it.
teacher = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, initializer_range=1.0,
                                       final_logit_softcapping=30.0, **config))
# Sequences to learn: runs of consecutive ids (2 to 63, wrapping) of random lengths, then eos.
starts, lengths = torch.randint(0, 62, (128,)).tolist(), torch.randint(3, 12, (128,)).tolist()
data = Dataset.from_dict({"input_ids": [[2 + (s + i) % 62 for i in range(n)] + [1] for s, n in zip(starts, lengths)]})
# The data is token ids already: the collator needs a tokenizer only for its pad token.
tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0}, unk_token="<pad>")),
                                    pad_token="<pad>")

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
