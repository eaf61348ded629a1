"""Distillation from top-k targets on disk in a Hugging Face Trainer: the teacher runs once, writing its
top-k log-probs with flashkd.data; the student then trains from them with flashkd's DistillationTrainer
(no teacher in memory). Tiny Llama-style models, in memory; seconds on CPU. Needs transformers, datasets
and the `data` extra (safetensors)."""

import tempfile

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models
from transformers import (DataCollatorForLanguageModeling, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast,
                          TrainingArguments)

import flashkd
from flashkd.integrations.transformers import DistillationTrainer

torch.manual_seed(0)
config = dict(vocab_size=64, num_hidden_layers=1, num_attention_heads=2, pad_token_id=0, eos_token_id=1,
              tie_word_embeddings=False)
student = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, **config))
teacher = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, initializer_range=1.0, **config))
# Sequences to learn, each with the key its targets are stored under: runs of consecutive ids (2 to 63,
# wrapping) of random lengths, then eos.
starts, lengths = torch.randint(0, 62, (128,)).tolist(), torch.randint(3, 12, (128,)).tolist()
data = Dataset.from_dict({"key": [f"ex-{i}" for i in range(128)],
                          "input_ids": [[2 + (s + i) % 62 for i in range(n)] + [1] for s, n in zip(starts, lengths)]})
# The data is token ids already: the collator needs a tokenizer only for its pad token.
tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0}, unk_token="<pad>")),
                                    pad_token="<pad>")


# 1. once: the teacher's top-k targets (its last hidden states, after its final norm, through its head)
def examples():
    with torch.no_grad():
        for row in data:
            yield row["key"], teacher.model(input_ids=torch.tensor([row["input_ids"]])).last_hidden_state[0]


workdir = tempfile.TemporaryDirectory()  # the targets and the Trainer's output_dir; removed at the end
out = f"{workdir.name}/targets"
flashkd.write_topk_targets(out, examples(), teacher.lm_head.weight, k=8, temperature=1.0)
del teacher

# 2. the student's training: the collator adds teacher_ids / teacher_logprobs, padded like the batch
collator = flashkd.TopKCollator(flashkd.TopKTargets(out), DataCollatorForLanguageModeling(tokenizer, mlm=False))
args = TrainingArguments(output_dir=f"{workdir.name}/trainer", per_device_train_batch_size=8, max_steps=16,
                         learning_rate=3e-2, logging_steps=2, report_to=[], save_strategy="no", disable_tqdm=True,
                         remove_unused_columns=False,  # keep "key": the collator looks the targets up by it
                         use_cpu=not torch.cuda.is_available())
trainer = DistillationTrainer(model=student, args=args, train_dataset=data, data_collator=collator,
                              loss="forward_kl", weight_hard_loss=0.5, weight_soft_loss=0.5,
                              distill_options={"tail": "bucket"})
trainer.train()
for h in trainer.state.log_history:
    if "loss" in h:
        print(f"step {h['step']}: loss {h['loss']:.4f}")
workdir.cleanup()
