"""Pooling K/V heads into fewer heads, and splitting/joining the fused projection layouts around it.

All functions take projection tensors whose first dimension is (heads * head_dim): weights of shape
[heads * head_dim, in_features] and biases of shape [heads * head_dim]. They work on meta tensors too,
which is how the converter learns output shapes without reading any data.
"""

from __future__ import annotations

import torch

from ..arch import QKVLayout

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


def split_qkv(t: torch.Tensor, layout: QKVLayout, heads: int, kv_heads: int, head_dim: int):
    """A fused projection -> (q, k, v), each [n * head_dim, ...]."""
    if layout == QKVLayout.FUSED:
        return t.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=0)
    if layout == QKVLayout.INTERLEAVED:
        assert kv_heads == heads, "an interleaved layout stores one K/V head per query head"
        per_head = t.reshape(heads, 3, head_dim, *t.shape[1:])
        return tuple(per_head[:, i].reshape(heads * head_dim, *t.shape[1:]) for i in range(3))
    if layout == QKVLayout.GROUPED:
        per_group = t.reshape(kv_heads, heads // kv_heads + 2, head_dim, *t.shape[1:])
        return tuple(x.reshape(-1, *t.shape[1:]) for x in (per_group[:, :-2], per_group[:, -2], per_group[:, -1]))
    raise ValueError(f"{layout} is not a fused layout")


def join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: QKVLayout, head_dim: int) -> torch.Tensor:
    """(q, k, v) -> one fused projection in `layout` (INTERLEAVED needs as many K/V heads as query heads; GROUPED
    takes the K/V head count from k)."""
    if layout == QKVLayout.FUSED:
        return torch.cat([q, k, v], dim=0)
    if layout == QKVLayout.GROUPED:
        groups = k.shape[0] // head_dim
        rest = q.shape[1:]
        parts = [q.reshape(groups, -1, head_dim, *rest), k.reshape(groups, 1, head_dim, *rest),
                 v.reshape(groups, 1, head_dim, *rest)]
        return torch.cat(parts, dim=1).reshape(-1, *rest)
    heads = q.shape[0] // head_dim
    parts = [x.reshape(heads, 1, head_dim, *x.shape[1:]) for x in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(3 * heads * head_dim, *q.shape[1:])
