"""What a candidate group of K/V heads would lose if merged, from per-head products computed once per layer.

The grouping search (`assign.assign_groups`) scores up to C(K, K/G) candidate groups. Every statistic a group's
merge loss needs (fit.merge_group: the whitened values' covariance, the keys' per-frequency complex covariance and
the attached queries' energies, the non-rotary keys' covariance in the queries' metric) is a block of
rows_a @ sigma @ rows_b^T for the layer's K, V and Q rows, or a per-head matrix that does not depend on the group.
`head_grams` computes them once (one product of the K/V/Q rows with sigma); `group_loss` then scores a candidate
from small [n D, n D] matrices: the same numbers as merging it (equal to float64 rounding; tests/kv/test_aligned_math.py),
without the d_in x d_in products each merge repeats.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fit import EPS, sym_sqrt
from ...fitting.rotary import RotaryPairs


@dataclass
class HeadGrams:
    keys: torch.Tensor  # [KV*D, KV*D] K sigma K^T
    values: torch.Tensor  # [KV*D, KV*D] V sigma V^T
    value_roots: torch.Tensor  # [KV, D, D] sqrt of each head's o_proj Gram (the values' metric)
    query_energy: torch.Tensor | None  # [KV, F] the attached queries' energy per rotary frequency
    rest_roots: torch.Tensor | None  # [KV, p, p] sqrt of each head's query metric on the non-rotary dims
    head_dim: int
    pairs: RotaryPairs
    fold: bool


def _rows_gram(rows: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    return rows @ sigma @ rows.T


def head_grams(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, sigma: torch.Tensor,
               pairs: RotaryPairs, fold: bool = True, query_weights: torch.Tensor | None = None) -> HeadGrams:
    """q [KV, r, D, d_in], k/v [KV, D, d_in], o [KV, r, d, D] (layer.merge_layer's split, any float dtype: the
    products are float64), sigma [d_in, d_in] float64; query_weights [KV, r] each query head's weight (as
    fit.merge_group's)."""
    kv, r, head_dim, din = q.shape
    values = _rows_gram(v.reshape(-1, din).double(), sigma)
    value_roots = sym_sqrt(torch.stack([torch.einsum("rdi,rdk->ik", o[j].double(), o[j].double()) for j in range(kv)]))
    keys = energy = rest_roots = None
    if fold:
        keys = _rows_gram(k.reshape(-1, din).double(), sigma)
        energy_rows = []
        metrics = []
        for j in range(kv):  # one head's queries at a time (float64): [r D, d_in] products with sigma
            qj = q[j].double()
            if query_weights is not None:
                qj = qj * query_weights[j].sqrt().to(qj)[:, None, None]
            qj = qj.reshape(-1, din)
            qs = qj @ sigma
            e = (qs * qj).sum(-1).reshape(r, head_dim)  # diag(Q sigma Q^T)
            energy_rows.append((e[:, pairs.a] + e[:, pairs.b]).sum(0))
            if pairs.rest.numel():
                rest = pairs.rest
                qs_rest = qs.reshape(r, head_dim, din)[:, rest]
                metrics.append(torch.einsum("rpx,rqx->pq", qs_rest, qj.reshape(r, head_dim, din)[:, rest]))
        energy = torch.stack(energy_rows)
        rest_roots = sym_sqrt(torch.stack(metrics)) if metrics else None
    return HeadGrams(keys if keys is not None else values.new_zeros(0, 0), values, value_roots, energy, rest_roots,
                     head_dim, pairs, fold)


def _block(gram: torch.Tensor, members: list[int], dims: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The [n p, n p] block of `gram` for the members' rows `dims` (member-major, as fit.merge_linear stacks them)."""
    idx = torch.cat([j * head_dim + dims for j in members])
    return gram[idx][:, idx]


def _linear_loss(gram: torch.Tensor, roots: torch.Tensor, p: int) -> float:
    """fit.merge_linear's lost energy, from the members' Gram block and their metric roots."""
    if p == 0:
        return 0.0
    whiten = torch.block_diag(*roots)
    cov = whiten @ gram @ whiten.T
    evals = torch.linalg.eigvalsh(cov)
    total = evals.clamp_min(0).sum()
    return float((total - evals[-p:].clamp_min(0).sum()) / total.clamp_min(EPS))


def _rotary_loss(g: HeadGrams, members: list[int]) -> float:
    """fit.merge_rotary's lost energy, from the keys' Gram and the queries' energies."""
    a, b, d = g.pairs.a, g.pairs.b, g.head_dim
    idx = torch.tensor(members)
    ra, rb = idx[:, None] * d + a[None, :], idx[:, None] * d + b[None, :]  # [n, F] rows of each member's pairs
    gaa = g.keys[ra.T[:, :, None], ra.T[:, None, :]]  # [F, n, n]
    gbb = g.keys[rb.T[:, :, None], rb.T[:, None, :]]
    gba = g.keys[rb.T[:, :, None], ra.T[:, None, :]]
    gab = g.keys[ra.T[:, :, None], rb.T[:, None, :]]
    cov = torch.complex(gaa + gbb, gba - gab)
    weight = g.query_energy[idx]  # [n, F]
    w = weight.T.clamp_min(0) + weight.T.amax(-1, keepdim=True).clamp_min(EPS) * 1e-6  # [F, n]
    sw = w.sqrt().to(cov.dtype)
    evals = torch.linalg.eigvalsh(sw.unsqueeze(-1) * cov * sw.unsqueeze(-2))
    total = evals.clamp_min(0).sum()
    return float((total - evals[..., -1].clamp_min(0).sum()) / total.clamp_min(EPS))


def group_loss(g: HeadGrams, members: list[int] | tuple[int, ...]) -> float:
    """Key loss (0 when keys are not fitted) + value loss of merging `members`: what merge_layer's search minimises."""
    members = list(members)
    if len(members) == 1:
        return 0.0
    d = g.head_dim
    value = _linear_loss(_block(g.values, members, torch.arange(d), d), g.value_roots[members], d)
    if not g.fold:
        return value
    losses = []
    if g.pairs.frequencies:
        losses.append(_rotary_loss(g, members))
    rest = g.pairs.rest
    if rest.numel():
        losses.append(_linear_loss(_block(g.keys, members, rest, d), g.rest_roots[members], rest.numel()))
    return float(sum(losses) / len(losses)) + value
