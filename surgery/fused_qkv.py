"""Splitting a fused q/k/v projection into its three parts and joining them back, in each layout surgery.arch
names (`QKVLayout`): what the conversions that read or write fused projections (the K/V-head merges, SwitchHead)
share.

Both take projection tensors whose first dimension is (heads * head_dim): weights of shape [heads * head_dim,
in_features] and biases of shape [heads * head_dim]. They work on meta tensors too.
"""

from __future__ import annotations

import torch

from .arch import QKVLayout


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
