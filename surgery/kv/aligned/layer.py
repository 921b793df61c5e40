"""Merge one layer's K/V heads: assign heads to groups, merge each group, fold the maps into q and o.

The merged layer is kept in the *source's* shape while calibrating: every source K/V slot of a group holds
the group's merged head (so the source architecture computes exactly what the grouped model will).
`export_heads` then reorders query heads so each group's are consecutive and keeps one K/V head per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .assign import assign_groups, consecutive, searched
from .fit import merge_group
from .grams import group_loss, head_grams
from .params import AttnParams
from ...fitting.rotary import RotaryPairs


@dataclass
class LayerMerge:
    params: AttnParams  # source-shaped, K/V slots repeated within each group
    groups: list[list[int]]  # source K/V heads per merged head
    key_loss: float
    value_loss: float


def group_blocks(p: AttnParams, kv: int, head_dim: int):
    """q, k, v, o of one layer cut into one block per K/V group: [KV, r, D, din], [KV, D, din] twice, [KV, r, d, D]."""
    din = p.q.shape[1]
    q = p.q.reshape(kv, -1, head_dim, din)  # [KV, r, D, din]
    k = p.k.reshape(kv, head_dim, din)
    v = p.v.reshape(kv, head_dim, din)
    d = p.o.shape[0]
    o = p.o.reshape(d, kv, -1, head_dim).permute(1, 2, 0, 3)  # [KV, r, d, D]
    return q, k, v, o


def merge_layer(p: AttnParams, sigma: torch.Tensor, kv_heads: int, head_dim: int, groups: int,
                pairs: RotaryPairs, fold_queries: bool = True, assign: bool = True,
                head_weights: torch.Tensor | None = None) -> LayerMerge:
    """p (float32 or float64), sigma in float64 -> merged params (float32), source-shaped. `head_weights` [H]: each
    query head's weight in the keys' fit and the grouping's score (its queries' energy scaled by it; None: 1 each).

    The fits run in float64 on one group's heads at a time (converted on the way in: exact), and each merged head is
    written straight into the float32 result: the layer's attention is never held in float64 whole."""
    q, k, v, o = group_blocks(p, kv_heads, head_dim)
    weights = None if head_weights is None else head_weights.double().reshape(kv_heads, -1).to(q.device)  # [KV, r]

    def merged(members):
        idx = list(members)
        return merge_group(k[idx].double(), v[idx].double(), q[idx].double(), o[idx].double(), sigma, pairs,
                           fold_queries, None if weights is None else weights[idx])

    if assign and searched(kv_heads, groups):  # candidates scored from per-head products computed once (grams.py)
        grams = head_grams(q, k, v, o, sigma, pairs, fold_queries, weights)
        grouping = assign_groups(lambda members: group_loss(grams, members), kv_heads, groups)
        del grams
    else:
        grouping = consecutive(kv_heads, groups)
    f32 = dict(dtype=torch.float32, device=q.device)
    new_q, new_k, new_v, new_o = (torch.empty(t.shape, **f32) for t in (q, k, v, o))  # every head is in a group
    key_losses, value_losses = [], []
    for members in grouping:
        m = merged(members)
        for i, j in enumerate(members):
            new_k[j], new_v[j], new_q[j] = m.key, m.value, m.queries[i]
            new_o[j] = o[j].double() @ m.value_maps[i]
        key_losses.append(m.key_loss)
        value_losses.append(m.value_loss)
        del m
    d = p.o.shape[0]
    out = AttnParams(
        q=new_q.reshape(-1, p.q.shape[1]),
        k=new_k.reshape(-1, p.k.shape[1]),
        v=new_v.reshape(-1, p.v.shape[1]),
        o=new_o.permute(2, 0, 1, 3).reshape(d, -1),
        o_bias=p.o_bias.float() if p.o_bias is not None else None,
        qkv_bias=p.qkv_bias,
    )
    return LayerMerge(out, grouping, sum(key_losses) / len(key_losses), sum(value_losses) / len(value_losses))


def merge_loss(p: AttnParams, sigma: torch.Tensor, kv_heads: int, head_dim: int, pairs: RotaryPairs,
               fold_queries: bool = True, head_weights: torch.Tensor | None = None):
    """The grouping search's score measured by merging each candidate group (fit.merge_group, d_in x d_in products
    every time): the reference `grams.group_loss` is tested and benchmarked against."""
    q, k, v, o = group_blocks(p, kv_heads, head_dim)
    weights = None if head_weights is None else head_weights.double().reshape(kv_heads, -1)

    def cost(members) -> float:
        idx = list(members)
        m = merge_group(k[idx].double(), v[idx].double(), q[idx].double(), o[idx].double(), sigma, pairs, fold_queries,
                        None if weights is None else weights[idx])
        key = 0.0 if m.key_loss != m.key_loss else m.key_loss  # NaN when keys are not fitted
        return key + m.value_loss

    return cost


def query_order(grouping: list[list[int]], queries_per_kv: int) -> list[int]:
    """Source query heads in output order: each group's members' query heads, consecutively."""
    return [j * queries_per_kv + i for members in grouping for j in members for i in range(queries_per_kv)]


def export_heads(p: AttnParams, grouping: list[list[int]], kv_heads: int, head_dim: int) -> AttnParams:
    """Source-shaped merged params -> grouped params: queries (and o_proj columns) permuted, one K/V head per group."""
    din = p.q.shape[1]
    r = p.q.shape[0] // head_dim // kv_heads
    order = torch.tensor(query_order(grouping, r))
    q = p.q.reshape(-1, head_dim, din)[order].reshape(-1, din)
    d = p.o.shape[0]
    o = p.o.reshape(d, -1, head_dim)[:, order].reshape(d, -1)
    firsts = torch.tensor([members[0] for members in grouping])
    k = p.k.reshape(kv_heads, head_dim, din)[firsts].reshape(-1, din)
    v = p.v.reshape(kv_heads, head_dim, din)[firsts].reshape(-1, din)
    return AttnParams(q, k, v, o, p.o_bias, p.qkv_bias)
