"""Held-out loss and perplexity, the windows sharded over the processes."""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, acc, micro_batch: int) -> dict:
    """Held-out next-token loss and perplexity over `windows`; windows sharded over processes, sums reduced.
    Every process runs as many forward passes as the largest shard needs (FSDP gathers parameters and DDP
    broadcasts buffers in collectives inside forward): one that has run out repeats a window, not counted."""
    from .losses import lm_loss

    was_training = model.training
    model.eval()
    shard = windows[acc.process_index :: acc.num_processes].long()
    largest = -(-windows.shape[0] // acc.num_processes)
    total = torch.zeros(2, dtype=torch.float64, device=acc.device)  # [nll sum, targets]
    for i in range(0, largest, micro_batch):
        ids = shard[i : i + micro_batch].to(acc.device)
        counted = ids.shape[0]
        if counted == 0:
            ids = windows[:1].long().to(acc.device)
        with acc.autocast():
            logits = model(input_ids=ids, use_cache=False).logits
        n = counted * (ids.shape[1] - 1)
        total += torch.tensor([lm_loss(logits, ids).double().item() * n, n], dtype=torch.float64, device=acc.device)
    total = acc.reduce(total, reduction="sum")
    model.train(was_training)
    loss = (total[0] / total[1]).item()
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700))}


def evaluate_held_out(model, data, acc, micro_batch: int) -> dict:
    """`evaluate` on the training text's held-out split and, with --eval-data, on the other text's windows
    (its results prefixed `other_`)."""
    result = evaluate(model, data.eval, acc, micro_batch)
    if data.other is not None:
        result |= {f"other_{k}": v for k, v in evaluate(model, data.other, acc, micro_batch).items()}
    return result
