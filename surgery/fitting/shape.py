"""The head layout the key and value refits share: how many query heads per K/V slot, the input width, and which
groups are refit (a group of one head keeps its source head exactly)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RefitShape:
    heads: int  # source query heads H
    kv: int  # source K/V slots (source-shaped: every slot of a group holds the group's merged head)
    head_dim: int
    din: int  # the projection's input width (with the bias column when there is one)
    fit: list[list[int]]  # the groups of more than one K/V head: the only ones a refit changes

    @property
    def per_kv(self) -> int:
        return self.heads // self.kv


def refit_shape(x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, groups: list[list[int]]) -> RefitShape:
    """From x [N, L, d_in], queries [N, H, L, D] and keys [N, KV, L, D] (any of the layer's windows)."""
    return RefitShape(q.shape[1], k.shape[1], q.shape[-1], x.shape[-1], [m for m in groups if len(m) > 1])
