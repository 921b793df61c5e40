"""The divergences distillation minimises between the teacher's and the student's next-token distributions, on
log-probabilities [positions, V] (float32, already divided by the temperature).

- forward: KL(p_t ‖ p_s), mass-covering (the student spreads over every candidate of the teacher): today's KD.
- reverse: KL(p_s ‖ p_t), mode-seeking (the student concentrates on the teacher's likeliest tokens; MiniLLM).
- jsd: GKD's generalized Jensen-Shannon divergence (Agarwal et al. 2024, "On-Policy Distillation of Language
  Models"), with the convention of TRL's `GKDTrainer.generalized_jsd_loss`:
      m = β p_t + (1 - β) p_s,   JSD(β) = β KL(p_t ‖ m) + (1 - β) KL(p_s ‖ m),
  β = 0.5 is the symmetric Jensen-Shannon divergence (bounded by log 2). The expression itself goes to 0 at
  either end (JSD(β) / β -> forward KL as β -> 0, JSD(β) / (1 - β) -> reverse KL as β -> 1); like TRL, β = 0 is
  taken to be forward KL(p_t ‖ p_s) and β = 1 reverse KL(p_s ‖ p_t), exactly.

`divergence_sum` sums over positions and the vocabulary (the KD loss's chunks); `divergence_per_position` keeps one
value per position (masked losses: on-policy distillation's generated positions).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .options import DIVERGENCES  # declared with the options (--kd-divergence)


def _pointwise(log_s: torch.Tensor, log_t: torch.Tensor, divergence: str, beta: float) -> torch.Tensor:
    """The divergence's terms [positions, V] (their sum over V is the divergence at each position)."""
    if divergence == "forward" or (divergence == "jsd" and beta == 0):
        return F.kl_div(log_s, log_t, log_target=True, reduction="none")
    if divergence == "reverse" or (divergence == "jsd" and beta == 1):
        return F.kl_div(log_t, log_s, log_target=True, reduction="none")
    log_m = torch.logaddexp(log_t + math.log(beta), log_s + math.log1p(-beta))
    return (beta * F.kl_div(log_m, log_t, log_target=True, reduction="none")
            + (1 - beta) * F.kl_div(log_m, log_s, log_target=True, reduction="none"))


def divergence_sum(log_s: torch.Tensor, log_t: torch.Tensor, divergence: str = "forward", beta: float = 0.5
                   ) -> torch.Tensor:
    """The divergence summed over positions. Forward and reverse KL are the very kernels KD used before β existed
    (`F.kl_div(..., reduction="sum")`), so their results did not change by a bit."""
    check(divergence, beta)
    if divergence == "forward" or (divergence == "jsd" and beta == 0):
        return F.kl_div(log_s, log_t, log_target=True, reduction="sum")
    if divergence == "reverse" or (divergence == "jsd" and beta == 1):
        return F.kl_div(log_t, log_s, log_target=True, reduction="sum")
    return _pointwise(log_s, log_t, divergence, beta).sum()


def divergence_per_position(log_s: torch.Tensor, log_t: torch.Tensor, divergence: str = "forward",
                            beta: float = 0.5) -> torch.Tensor:
    """The divergence at every position: [positions]."""
    check(divergence, beta)
    return _pointwise(log_s, log_t, divergence, beta).sum(-1)


def check(divergence: str, beta: float) -> None:
    if divergence not in DIVERGENCES:
        raise ValueError(f"unknown divergence {divergence!r}")
    if not 0 <= beta <= 1:
        raise ValueError(f"the generalized JSD's beta must lie in [0, 1], got {beta}")
