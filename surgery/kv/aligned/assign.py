"""Which source K/V heads share a merged head: by similarity (lowest merge loss), not just by position.

A group's cost is what merging it loses (see fit.merge_group). Small problems are solved exactly over all
balanced partitions; large ones greedily. Ties keep the consecutive grouping the plain converter uses.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable

MAX_GROUPS_SCORED = 400
MAX_PARTITIONS = 20000


def consecutive(kv_heads: int, groups: int) -> list[list[int]]:
    n = kv_heads // groups
    return [list(range(g * n, (g + 1) * n)) for g in range(groups)]


def partition_count(kv_heads: int, groups: int) -> int:
    n = kv_heads // groups
    return math.factorial(kv_heads) // (math.factorial(n) ** groups * math.factorial(groups))


def _partitions(heads: tuple[int, ...], n: int):
    """Balanced partitions of `heads` into groups of n (the first remaining head opens each group)."""
    if not heads:
        yield []
        return
    first, rest = heads[0], heads[1:]
    for others in itertools.combinations(rest, n - 1):
        group = (first, *others)
        remaining = tuple(h for h in rest if h not in others)
        for tail in _partitions(remaining, n):
            yield [group, *tail]


def exhaustive(kv_heads: int, groups: int) -> bool:
    """Whether the search scores every balanced partition (few enough heads), else grows the groups greedily."""
    n = kv_heads // groups
    return math.comb(kv_heads, n) <= MAX_GROUPS_SCORED and partition_count(kv_heads, groups) <= MAX_PARTITIONS


def searched(kv_heads: int, groups: int) -> bool:
    """Whether there is a choice to make (else the consecutive grouping is the only balanced one)."""
    return kv_heads // groups > 1 and groups > 1


def assign_groups(cost: Callable[[tuple[int, ...]], float], kv_heads: int, groups: int) -> list[list[int]]:
    """Partition heads 0..kv_heads-1 into `groups` groups of equal size minimising the summed `cost`."""
    n = kv_heads // groups
    if not searched(kv_heads, groups):
        return consecutive(kv_heads, groups)
    cache: dict[tuple[int, ...], float] = {}

    def c(group) -> float:
        key = tuple(sorted(group))
        if key not in cache:
            cache[key] = cost(key)
        return cache[key]

    heads = tuple(range(kv_heads))
    if exhaustive(kv_heads, groups):
        best, best_cost = None, math.inf
        for part in _partitions(heads, n):  # the consecutive partition comes first
            total = sum(c(g) for g in part)
            if total < best_cost - 1e-12:
                best, best_cost = part, total
        return [list(g) for g in best]
    # greedy: grow each group from the lowest free head, adding the head that keeps its cost lowest
    free = list(heads)
    out = []
    while free:
        group = [free.pop(0)]
        while len(group) < n:
            pick = min(free, key=lambda h: c(group + [h]))
            free.remove(pick)
            group.append(pick)
        out.append(sorted(group))
    return out
