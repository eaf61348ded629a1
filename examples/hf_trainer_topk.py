"""Distillation from top-k targets on disk in a Hugging Face Trainer: the teacher runs once, writing its
top-k log-probs with flashkd.data; the student then trains from them with flashkd's DistillationTrainer
(no teacher in memory). Tiny Llama-style models, in memory; seconds on CPU. Needs transformers, datasets
and the `data` extra (safetensors)."""

import tempfile

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (DataCollatorForLanguageModeling, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast,
                          TrainingArguments)

import flashkd
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


student, teacher = llama(16, 0), llama(32, 1, initializer_range=1.0)
g = torch.Generator().manual_seed(0)
texts = []
for _ in range(128):
    start, length = int(torch.randint(0, 58, (), generator=g)), int(torch.randint(3, 12, (), generator=g))
    texts.append(" ".join(words[3 + (start + i) % 58] for i in range(length)) + " <eos>")
data = Dataset.from_dict({"key": [f"ex-{i}" for i in range(len(texts))],
                          "input_ids": [tokenizer(t)["input_ids"] for t in texts]})


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
