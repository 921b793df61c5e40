"""Balanced clustering of attention heads, and how a GQA source's K/V groups constrain it.

The source's h query heads go into H clusters of E heads each (H * E = h); every cluster becomes one SwitchHead
head whose E experts are its members. Heads are grouped by a distance between what they do (computed on
calibration text, see `calibrate.py`); the objective is the sum of within-cluster pairwise distances, minimised
by a greedy start and pairwise swaps between clusters (sizes never change, so clusters stay balanced).

K/V groups of a GQA source (kv K/V heads, each shared by h/kv query heads):

- `within-groups` (H a multiple of kv): every cluster lies inside one K/V group; each group's query heads are
  clustered into H/kv clusters. The cluster's key projection is then the group's own K head (exact) and all its
  value experts start from the group's V head.
- `whole-groups` (kv a multiple of H): every cluster is kv/H whole K/V groups; groups are clustered by the mean
  distance between their query heads. The cluster's key is the mean of its groups' K heads.
- `free` (neither, or asked for): heads are clustered one by one; a cluster's key is the mean of its members'
  K heads (a K head counted once per member that uses it).
"""

from __future__ import annotations

import torch

from ..errors import SurgeryError

MODES = ("within-groups", "whole-groups", "free")


def kv_mapping(heads: int, kv_heads: int, new_heads: int, respect_kv_groups: bool = True) -> str:
    if not respect_kv_groups:
        return "free"
    if new_heads % kv_heads == 0:
        return "within-groups"
    if kv_heads % new_heads == 0:
        return "whole-groups"
    return "free"


def _cost(dist: torch.Tensor, cluster: list[int]) -> float:
    idx = torch.tensor(cluster)
    return float(dist[idx][:, idx].sum()) / 2


def balanced_clusters(dist: torch.Tensor, size: int) -> list[list[int]]:
    """Split the n items of the (n, n) distance matrix `dist` into n/size clusters of `size` items."""
    n = dist.shape[0]
    if n % size:
        raise ValueError(f"{n} items do not split into clusters of {size}")
    if size == 1:
        return [[i] for i in range(n)]
    if size == n:
        return [list(range(n))]
    dist = dist.double()
    dist = (dist + dist.T) / 2
    left = set(range(n))
    clusters: list[list[int]] = []
    while left:  # greedy: the closest free pair, then the free item closest on average to the cluster
        free = sorted(left)
        sub = dist[free][:, free].clone().fill_diagonal_(float("inf"))
        i, j = divmod(int(torch.argmin(sub)), len(free))
        cluster = [free[i], free[j]]
        while len(cluster) < size:
            rest = [x for x in free if x not in cluster]
            mean = dist[rest][:, cluster].mean(1)
            cluster.append(rest[int(torch.argmin(mean))])
        clusters.append(cluster)
        left -= set(cluster)
    improved = True
    while improved:  # best pairwise swap between two clusters, until none lowers the cost
        improved = False
        best, best_gain = None, 1e-12
        for p in range(len(clusters)):
            for q in range(p + 1, len(clusters)):
                for a in range(size):
                    for b in range(size):
                        x, y = clusters[p][a], clusters[q][b]
                        rest_p = [m for m in clusters[p] if m != x]
                        rest_q = [m for m in clusters[q] if m != y]
                        gain = (float(dist[x, rest_p].sum() + dist[y, rest_q].sum())
                                - float(dist[y, rest_p].sum() + dist[x, rest_q].sum()))
                        if gain > best_gain:
                            best, best_gain = (p, a, q, b), gain
        if best is not None:
            p, a, q, b = best
            clusters[p][a], clusters[q][b] = clusters[q][b], clusters[p][a]
            improved = True
    return sorted(sorted(c) for c in clusters)


def cluster_heads(dist: torch.Tensor | None, heads: int, kv_heads: int, new_heads: int, mode: str) -> list[list[int]]:
    """The source heads of each of the `new_heads` clusters (sorted), for one layer."""
    size = heads // new_heads
    per_group = heads // kv_heads
    if dist is None:  # nothing to compare (one head per cluster, or one cluster): consecutive heads
        if size not in (1, heads):
            raise SurgeryError("clustering heads needs calibration distances")
        return [list(range(c * size, (c + 1) * size)) for c in range(new_heads)]
    if mode == "within-groups":
        clusters = []
        for g in range(kv_heads):
            members = list(range(g * per_group, (g + 1) * per_group))
            sub = dist[members][:, members]
            clusters += [[members[i] for i in c] for c in balanced_clusters(sub, size)]
        return sorted(clusters)
    if mode == "whole-groups":
        groups = torch.arange(heads).view(kv_heads, per_group)
        gdist = torch.stack([torch.stack([dist[groups[a]][:, groups[b]].mean() for b in range(kv_heads)])
                             for a in range(kv_heads)])
        return sorted(sorted(int(m) for g in c for m in groups[g]) for c in balanced_clusters(gdist, kv_heads // new_heads))
    if mode == "free":
        return balanced_clusters(dist, size)
    raise ValueError(f"unknown mode {mode!r}")


def within_cost(dist: torch.Tensor, clusters: list[list[int]]) -> float:
    """Mean distance between two heads of the same cluster."""
    pairs = sum(len(c) * (len(c) - 1) / 2 for c in clusters)
    return sum(_cost(dist.double(), c) for c in clusters) / pairs if pairs else 0.0


def medoid(dist: torch.Tensor, cluster: list[int]) -> int:
    """The member with the smallest total distance to the others (the first one on ties)."""
    sub = dist[cluster][:, cluster].double().sum(1)
    return cluster[int(torch.argmin(sub))]
