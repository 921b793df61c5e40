"""The optimizer of an uptraining run: AdamW over the trainable parameters, its learning rate a function of the step
alone (linear warmup, then cosine decay)."""

from __future__ import annotations

import math

import torch

from .options import UptrainOptions


def lr_at(step: int, o: UptrainOptions) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then cosine down to lr * min_lr_ratio."""
    # Not transformers' cosine_with_min_lr schedule: its warmup starts at lr 0 (step / warmup, one step later than
    # here), which would make step 0 a no-op and move every saved run's schedule (tests/uptrain/test_lr_schedule.py).
    warmup, total = o.warmup, o.steps
    if step < warmup:
        return o.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def group_lr(group: dict, step: int, o: UptrainOptions) -> float:
    """A parameter group's learning rate at `step`: the schedule, scaled by the group's `lr_ratio` (--new-lr / --lr
    for the conversion's new parameters, 1 for the others)."""
    return lr_at(step, o) * group.get("lr_ratio", 1.0)


def make_optimizer(params: list, o: UptrainOptions, new: list = ()) -> torch.optim.Optimizer:
    """AdamW, fused where torch supports it (CPU and CUDA: one kernel over all tensors, several times faster
    than the per-tensor loop on a 135M model), else the plain implementation. With --new-lr, the trainable
    parameters among `new` (the conversion's own) form a second group whose rate is --new-lr on the same schedule."""
    kw = dict(lr=o.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=o.weight_decay)
    groups: list = params
    if o.new_lr is not None:
        ids = {id(p) for p in new}
        own = [p for p in params if id(p) in ids]
        rest = [p for p in params if id(p) not in ids]
        groups = ([{"params": rest}] if rest else []) + (
            [{"params": own, "lr": o.new_lr, "lr_ratio": o.new_lr / o.lr, "weight_decay": 0.0}] if own else [])
    try:
        return torch.optim.AdamW(groups, fused=True, **kw)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(groups, **kw)
