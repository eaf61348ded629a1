"""Distilling from an offline teacher: its top-k log-probs written to disk once, then read back in
batches for the student's steps. Tiny sizes, any device; needs the `data` extra (safetensors)."""

import tempfile

import torch
from torch.utils.data import DataLoader

import flashkd

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
vocab, h_teacher, h_student, k = 5003, 256, 128, 16
teacher_embed = torch.nn.Embedding(vocab, h_teacher, device=device)  # stands in for a teacher model
teacher_head = torch.nn.Linear(h_teacher, vocab, bias=False, device=device)
student_embed = torch.nn.Embedding(vocab, h_student, device=device)
student_head = torch.nn.Linear(h_student, vocab, bias=False, device=device)
corpus = {f"doc-{i}": torch.randint(0, vocab, (int(torch.randint(20, 60, ())),)) for i in range(32)}

# 1. once: the teacher's targets, streamed to disk one sequence at a time
workdir = tempfile.TemporaryDirectory()  # removed at the end
with torch.no_grad():
    examples = ((key, teacher_embed(ids.to(device))) for key, ids in corpus.items())  # (key, (L, H))
    targets = flashkd.write_topk_targets(f"{workdir.name}/targets", examples, teacher_head.weight, k)


# 2. every epoch: batches of token ids with their targets, padded alike
def pad(features):
    ids = torch.nn.utils.rnn.pad_sequence([f["input_ids"] for f in features], batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(f["input_ids"]) for f in features], batch_first=True)
    return {"input_ids": ids, "attention_mask": mask}


dataset = [{"key": key, "input_ids": ids} for key, ids in corpus.items()]
loader = DataLoader(dataset, batch_size=8, collate_fn=flashkd.TopKCollator(targets, pad))
opt = torch.optim.AdamW([*student_embed.parameters(), *student_head.parameters()], lr=1e-3)
for step, batch in enumerate(loader):
    hidden = student_embed(batch["input_ids"].to(device))  # (B, T, H)
    # row t of the targets is the teacher's distribution over token t + 1: labels shift, targets do not
    labels = batch["input_ids"][:, 1:].masked_fill(batch["attention_mask"][:, 1:] == 0, -100).to(device)
    loss = flashkd.fused_linear_distill_topk(
        hidden[:, :-1], student_head.weight, batch["teacher_ids"][:, :-1].to(device),
        batch["teacher_logprobs"][:, :-1].to(device), labels, loss="forward_kl", tail="bucket",
        weight_hard_loss=0.5, weight_soft_loss=0.5,
    )
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step}: loss {loss.item():.4f}")
workdir.cleanup()
