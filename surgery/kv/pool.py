"""Pooling K/V heads into fewer heads (splitting and joining the fused projection layouts around it is
surgery.fused_qkv's).

All functions take projection tensors whose first dimension is (heads * head_dim): weights of shape
[heads * head_dim, in_features] and biases of shape [heads * head_dim]. They work on meta tensors too,
which is how the converter learns output shapes without reading any data.
"""

from __future__ import annotations

import torch

POOL_METHODS = ("mean", "first", "random")


def kv_groups(kv_heads: int, groups: int) -> list[list[int]]:
    """Consecutive source K/V heads merged into each of `groups` new heads."""
    n = kv_heads // groups
    return [list(range(g * n, (g + 1) * n)) for g in range(groups)]


def pool_heads(t: torch.Tensor, head_dim: int, groups: int, method: str, generator: torch.Generator | None = None) -> torch.Tensor:
    """[kv * head_dim, ...] -> [groups * head_dim, ...], pooling consecutive heads.

    mean: average of the group's heads (Ainslie et al. 2023). first: the group's first head.
    random: fresh random init with the source tensor's standard deviation (biases start at zero),
    the "random" ablation of the GQA paper.
    """
    kv = t.shape[0] // head_dim
    rest = t.shape[1:]
    heads = t.reshape(groups, kv // groups, head_dim, *rest)
    if method == "mean":
        # A running fp32 sum over the group's heads: several times faster than .float().mean(1) on CPU.
        acc = heads[:, 0].float()
        for i in range(1, heads.shape[1]):
            acc += heads[:, i]
        out = (acc / heads.shape[1]).to(t.dtype)
    elif method == "first":
        out = heads[:, 0]
    elif method == "random":
        shape = (groups, head_dim, *rest)
        if t.is_meta:
            out = torch.empty(shape, dtype=t.dtype, device="meta")
        elif t.dim() == 1:
            out = torch.zeros(shape, dtype=t.dtype)
        else:
            out = (torch.randn(shape, generator=generator) * t.float().std()).to(t.dtype)
    else:
        raise ValueError(f"unknown pooling method {method!r}")
    return out.reshape(groups * head_dim, *rest)


def repeat_heads(t: torch.Tensor, head_dim: int, times: int) -> torch.Tensor:
    """[g * head_dim, ...] -> [g * times * head_dim, ...]: each head repeated `times` times in a row."""
    g = t.shape[0] // head_dim
    heads = t.reshape(g, 1, head_dim, *t.shape[1:]).expand(g, times, head_dim, *t.shape[1:])
    return heads.reshape(g * times * head_dim, *t.shape[1:])
