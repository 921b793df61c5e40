"""A run stops at the first number that is not finite (loss, gradient norm, weights, held-out loss): the check, agreed
by every process, and what the refusal says survives."""

from __future__ import annotations

import torch

from .state import Checkpoints


def all_finite(acc, *values) -> bool:
    """True when every value (numbers, tensors) is finite on every process."""
    bad = 0.0
    for v in values:
        v = v.to_local() if hasattr(v, "to_local") else v  # FSDP2 parameters are DTensors: their local shards
        bad += 0.0 if v is None or bool(torch.isfinite(torch.as_tensor(v)).all()) else 1.0
    return acc.reduce(torch.tensor([bad], device=acc.device), reduction="sum").item() == 0


def last_good(ckpts: Checkpoints) -> str:
    latest = ckpts.latest()
    return f"the last good checkpoint, {latest}, is kept" if latest else "no checkpoint was written"
