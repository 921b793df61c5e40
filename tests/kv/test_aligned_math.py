"""The merge math on synthetic tensors: RoPE commutation, exact recovery of mergeable heads, grouping."""

from __future__ import annotations

import math

import pytest
import torch

from surgery.kv.aligned.assign import assign_groups, partition_count
from surgery.kv.aligned.fit import merge_group, merge_linear
from surgery.fitting.rotary import rotary_pairs, rotate

D, DIN = 16, 24


def _angles(pairs, positions: torch.Tensor, theta: float = 100.0):
    f = pairs.frequencies
    inv = theta ** (-torch.arange(f, dtype=torch.float64) / max(f, 1))
    ang = positions[:, None].double() * inv[None, :]
    return ang.cos(), ang.sin()


def _rope(x: torch.Tensor, pairs, positions: torch.Tensor) -> torch.Tensor:
    """x [T, D] rotated at `positions` [T], written from the definition (pair (a, b) as a + ib times e^{i angle})."""
    cos, sin = _angles(pairs, positions)
    out = x.clone()
    z = torch.complex(x[:, pairs.a], x[:, pairs.b]) * torch.complex(cos, sin)
    out[:, pairs.a], out[:, pairs.b] = z.real, z.imag
    return out


def _sigma(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(400, DIN, generator=g, dtype=torch.float64) @ torch.randn(DIN, DIN, generator=g, dtype=torch.float64)
    return x, x.T @ x / x.shape[0]


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("rotary_dims", [D, D // 2, 0])
def test_rotate_matches_definition_and_inverts(layout, rotary_dims):
    pairs = rotary_pairs(D, rotary_dims, layout)
    assert sorted(torch.cat([pairs.a, pairs.b, pairs.rest]).tolist()) == list(range(D))
    x = torch.randn(7, D, dtype=torch.float64)
    pos = torch.arange(7)
    cos, sin = _angles(pairs, pos)
    assert torch.allclose(rotate(x, cos, sin, pairs), _rope(x, pairs, pos))
    assert torch.allclose(rotate(rotate(x, cos, sin, pairs), cos, sin, pairs, inverse=True), x)
    if rotary_dims:
        assert not torch.allclose(rotate(x, cos, sin, pairs)[1:], x[1:])


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("rotary_dims", [D, D // 2, 0])
def test_mergeable_keys_are_merged_exactly_under_rope(layout, rotary_dims):
    """Members whose keys are per-frequency complex multiples (and, off the rotary dims, linear maps) of one
    shared key merge without loss, and the folded queries give the source's logits at every position pair."""
    torch.manual_seed(0)
    pairs = rotary_pairs(D, rotary_dims, layout)
    x, sigma = _sigma()
    base = torch.randn(D, DIN, dtype=torch.float64)
    keys, n, r = [], 3, 2
    for j in range(n):
        k = torch.empty_like(base)
        alpha = torch.polar(torch.rand(pairs.frequencies, dtype=torch.float64) + 0.5,
                            torch.rand(pairs.frequencies, dtype=torch.float64) * 6.28)
        z = alpha[:, None] * torch.complex(base[pairs.a], base[pairs.b])
        k[pairs.a], k[pairs.b] = z.real, z.imag
        p = pairs.rest.numel()
        k[pairs.rest] = (torch.randn(p, p, dtype=torch.float64) + 2 * torch.eye(p)) @ base[pairs.rest]
        keys.append(k)
    keys = torch.stack(keys)
    queries = torch.randn(n, r, D, DIN, dtype=torch.float64)
    values = torch.randn(n, D, DIN, dtype=torch.float64)
    o_heads = torch.randn(n, r, 5, D, dtype=torch.float64)
    m = merge_group(keys, values, queries, o_heads, sigma, pairs)
    assert m.key_loss < 1e-9
    pos = torch.randint(0, 1000, (x.shape[0],))
    k_merged = _rope(x @ m.key.T, pairs, pos)
    for j in range(n):
        k_src = _rope(x @ keys[j].T, pairs, pos)
        for i in range(r):
            q_src = _rope(x @ queries[j, i].T, pairs, pos)
            q_new = _rope(x @ m.queries[j, i].T, pairs, pos)
            src, new = q_src @ k_src.T, q_new @ k_merged.T
            assert torch.allclose(src, new, atol=1e-8 * src.abs().max()), (j, i)


def test_rotary_fold_is_not_a_generic_linear_map():
    """A plain (non-complex) map on the rotary dims would not commute with RoPE: the fit must be per pair."""
    pairs = rotary_pairs(D, D, "half")
    x = torch.randn(9, D, dtype=torch.float64)
    pos = torch.arange(9) * 37
    generic = torch.randn(D, D, dtype=torch.float64)
    assert not torch.allclose(_rope(x @ generic.T, pairs, pos), _rope(x, pairs, pos) @ generic.T)
    alpha = torch.polar(torch.rand(pairs.frequencies, dtype=torch.float64) + 0.5, torch.rand(pairs.frequencies, dtype=torch.float64))
    z = torch.complex(x[:, pairs.a], x[:, pairs.b]) * alpha
    scaled = x.clone()
    scaled[:, pairs.a], scaled[:, pairs.b] = z.real, z.imag
    zr = torch.complex(_rope(x, pairs, pos)[:, pairs.a], _rope(x, pairs, pos)[:, pairs.b]) * alpha
    assert torch.allclose(_rope(scaled, pairs, pos)[:, pairs.a], zr.real)


def test_values_of_invertible_maps_merge_exactly():
    """Members whose values are invertible maps of one head lose nothing; o_proj absorbs the maps."""
    torch.manual_seed(1)
    x, sigma = _sigma(1)
    base = torch.randn(D, DIN, dtype=torch.float64)
    maps = torch.randn(3, D, D, dtype=torch.float64) + 3 * torch.eye(D, dtype=torch.float64)
    rows = maps @ base
    metric = torch.eye(D, dtype=torch.float64).expand(3, D, D)
    merged, fitted, lost = merge_linear(rows, metric, sigma)
    assert lost < 1e-9
    want = x @ rows.transpose(1, 2)
    assert torch.allclose(x @ (fitted @ merged).transpose(1, 2), want, atol=1e-7 * want.abs().max())


def test_value_merge_keeps_the_principal_subspace():
    """Unmergeable values: the merge keeps what o_proj uses most (the loss is the discarded energy)."""
    torch.manual_seed(2)
    x, sigma = _sigma(2)
    rows = torch.randn(2, D, DIN, dtype=torch.float64)
    heavy = torch.eye(D, dtype=torch.float64).expand(2, D, D).clone()
    heavy[1] *= 100.0  # o_proj reads member 1 far more strongly
    merged, maps, _ = merge_linear(rows, heavy, sigma)
    err = lambda j: ((x @ (maps[j] @ merged - rows[j]).T) ** 2).mean() / ((x @ rows[j].T) ** 2).mean()  # noqa: E731
    assert err(1) < 0.05 < err(0)


def test_assignment_finds_similar_heads():
    similar = {frozenset({0, 2}), frozenset({1, 3})}
    cost = lambda g: 0.0 if frozenset(g) in similar else 1.0  # noqa: E731
    assert assign_groups(cost, 4, 2) == [[0, 2], [1, 3]]
    assert assign_groups(lambda g: 1.0, 4, 2) == [[0, 1], [2, 3]]  # ties keep the consecutive grouping
    assert assign_groups(cost, 4, 1) == [[0, 1, 2, 3]]
    assert partition_count(8, 4) == 105 and partition_count(4, 2) == 3


def test_greedy_assignment_for_many_heads():
    """Too many partitions to enumerate: the greedy search still pairs heads by similarity."""
    n = 32
    partner = {i: (i + 16) % n for i in range(n)}
    cost = lambda g: 0.0 if all(partner[a] in g for a in g) else float(len(g))  # noqa: E731
    assert math.comb(n, 2) > 400
    groups = assign_groups(cost, n, 16)
    assert sorted(map(sorted, groups)) == sorted([sorted([i, i + 16]) for i in range(16)])
