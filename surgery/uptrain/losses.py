"""Training losses: next-token cross-entropy, distillation (KL to a teacher's logits), and their mix.

All are means over token positions, so a step's loss does not depend on how its batch is split into
micro-batches or processes (every packed window has the same number of positions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits [B, T, V] for ids [B, T] (T-1 targets per sequence).

    The targets are shifted (the last position ignored) rather than the logits sliced, which would copy them."""
    targets = F.pad(ids[:, 1:], (0, 1), value=-100)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean over positions of T² · KL(softmax(teacher/T) ‖ softmax(student/T)) (Hinton et al.'s scaling)."""
    t = temperature
    log_s = F.log_softmax(student_logits.flatten(0, 1).float() / t, dim=-1)
    log_t = F.log_softmax(teacher_logits.flatten(0, 1).float() / t, dim=-1)
    return F.kl_div(log_s, log_t, log_target=True, reduction="batchmean") * (t * t)


@dataclass(frozen=True)
class Objective:
    kind: str  # lm | kd | mix
    temperature: float = 1.0
    kd_weight: float = 0.5  # mix: kd_weight * kd + (1 - kd_weight) * lm

    @property
    def needs_teacher(self) -> bool:
        return self.kind in ("kd", "mix")

    def __call__(self, logits: torch.Tensor, ids: torch.Tensor, teacher_logits: torch.Tensor | None = None):
        """(loss, parts): the loss to minimise and its terms, detached, for logging."""
        parts: dict[str, torch.Tensor] = {}
        if self.kind in ("lm", "mix"):
            parts["lm"] = lm_loss(logits, ids)
        if self.kind in ("kd", "mix"):
            parts["kd"] = kd_loss(logits, teacher_logits, self.temperature)
        if self.kind == "mix":
            loss = self.kd_weight * parts["kd"] + (1 - self.kd_weight) * parts["lm"]
        else:
            loss = parts[self.kind]
        return loss, {k: v.detach() for k, v in parts.items()}
