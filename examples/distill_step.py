"""One distillation step of a tiny student against a tiny teacher, on whatever device is there."""

import torch

import flashkd

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
torch.manual_seed(0)
n, vocab, h_student, h_teacher = 512, 32000, 256, 512

student_hidden = torch.randn(4, n // 4, h_student, device=device, dtype=dtype, requires_grad=True)
student_head = torch.nn.Linear(h_student, vocab, bias=False, device=device, dtype=dtype)
teacher_hidden = torch.randn(4, n // 4, h_teacher, device=device, dtype=dtype)
teacher_head = torch.nn.Linear(h_teacher, vocab, bias=False, device=device, dtype=dtype)
labels = torch.randint(0, vocab, (4, n // 4), device=device)
labels[:, :16] = -100  # e.g. prompt tokens: no loss

loss = flashkd.fused_linear_distill(
    student_hidden, student_head.weight, teacher_hidden, teacher_head.weight, labels,
    loss="jsd", beta=0.5, temperature=2.0, weight_hard_loss=0.5, weight_soft_loss=0.5,
)
loss.backward()
print(f"device={device} loss={loss.item():.4f} "
      f"|dX|={student_hidden.grad.float().norm():.4e} |dW|={student_head.weight.grad.float().norm():.4e}")
