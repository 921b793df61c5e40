"""Merging several K/V heads into one, from second moments of the layer's input.

Every projection is linear in the layer input x (with a constant 1 appended when there are biases), so all
statistics the merge needs come from one matrix, sigma = E[x x^T]. Each function merges one group:
`rows` holds the members' projection rows [n, D, d_in]; the merged head's rows come back with the map that
carries the merged head to each member (member_j ~ maps_j @ merged), which the caller folds into the
queries (keys) or into o_proj (values).

- `merge_linear`: members whitened by how much the consumer uses each direction (query second moments
  for keys, o_proj's Gram for values), stacked, and the top principal subspace kept.
- `merge_rotary`: per rotary frequency, a rank-1 complex fit of the members' complex key components,
  weighted by the attached queries' energy at that frequency; the per-member complex scalars commute
  with RoPE and go into the queries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...fitting.rotary import RotaryPairs

EPS = 1e-8


def sym_sqrt(m: torch.Tensor) -> torch.Tensor:
    """Square root of symmetric PSD matrices [..., p, p] (negative eigenvalues clipped)."""
    evals, evecs = torch.linalg.eigh(m)
    floor = evals.amax(-1, keepdim=True).clamp_min(0) * 1e-6 + EPS
    root = evals.clamp_min(0).add(floor).sqrt()
    return (evecs * root.unsqueeze(-2)) @ evecs.transpose(-1, -2)


def quad(rows_a: torch.Tensor, sigma: torch.Tensor, rows_b: torch.Tensor) -> torch.Tensor:
    """rows_a @ sigma @ rows_b^T over the last two dims."""
    return rows_a @ sigma @ rows_b.transpose(-1, -2)


def _top_subspace(cov: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    evals, evecs = torch.linalg.eigh(cov)
    return evecs[:, -k:], evals


def merge_linear(rows: torch.Tensor, metric: torch.Tensor, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """rows [n, p, d_in], metric [n, p, p] (PSD) -> merged [p, d_in], maps [n, p, p], lost energy fraction."""
    n, p, _ = rows.shape
    if p == 0:
        return rows[0], torch.zeros(n, 0, 0, dtype=rows.dtype, device=rows.device), 0.0
    root = sym_sqrt(metric)
    z = (root @ rows).reshape(n * p, -1)  # whitened members, stacked
    cov = quad(z, sigma, z)
    basis, evals = _top_subspace(cov, p)
    merged = basis.T @ z
    member_energy = torch.diagonal(quad(rows, sigma, rows), dim1=-2, dim2=-1).mean()
    merged_energy = torch.diagonal(quad(merged, sigma, merged)).mean()
    merged = merged * (member_energy / merged_energy.clamp_min(EPS)).sqrt()
    maps = least_squares_maps(rows, merged, sigma)
    total = evals.clamp_min(0).sum()
    lost = float((total - evals[-p:].clamp_min(0).sum()) / total.clamp_min(EPS))
    return merged, maps, lost


def least_squares_maps(rows: torch.Tensor, merged: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """A_j minimising E|rows_j x - A_j merged x|^2: (rows_j sigma merged^T)(merged sigma merged^T)^-1."""
    gram = quad(merged, sigma, merged)
    ridge = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device) * (gram.diagonal().mean() * 1e-9 + EPS)
    cross = quad(rows, sigma, merged.unsqueeze(0))  # [n, p, p]
    return torch.linalg.solve(gram + ridge, cross.transpose(-1, -2)).transpose(-1, -2)


@dataclass
class ComplexStats:
    """Per-frequency complex covariance of the members' key components and the queries' use of them."""

    cov: torch.Tensor  # [F, n, n] complex, cov[f, j, k] = E[k_j conj(k_k)]
    weight: torch.Tensor  # [n, F] query energy at each frequency


def complex_stats(keys: torch.Tensor, queries: torch.Tensor, sigma: torch.Tensor, pairs: RotaryPairs) -> ComplexStats:
    """keys [n, D, d_in]; queries [n, r, D, d_in] (the query heads attached to each member)."""
    a, b = pairs.a, pairs.b
    ka, kb = keys[:, a], keys[:, b]  # [n, F, d_in]
    sa, sb = ka @ sigma, kb @ sigma
    real = torch.einsum("jfx,kfx->fjk", sa, ka) + torch.einsum("jfx,kfx->fjk", sb, kb)
    imag = torch.einsum("jfx,kfx->fjk", sb, ka) - torch.einsum("jfx,kfx->fjk", sa, kb)
    qa, qb = queries[:, :, a], queries[:, :, b]  # [n, r, F, d_in]
    weight = (torch.einsum("jrfx,xy,jrfy->jf", qa, sigma, qa) + torch.einsum("jrfx,xy,jrfy->jf", qb, sigma, qb))
    return ComplexStats(torch.complex(real, imag), weight)


def merge_rotary(keys: torch.Tensor, stats: ComplexStats, pairs: RotaryPairs) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Rank-1 complex fit per frequency -> merged rotary rows [2F, d_in] (a rows then b rows), alpha [n, F] complex.

    member_j's complex component ~ alpha[j, f] * merged component f.
    """
    cov, weight = stats.cov, stats.weight
    w = weight.T.clamp_min(0) + weight.T.amax(-1, keepdim=True).clamp_min(EPS) * 1e-6  # [F, n]
    sw = w.sqrt().to(cov.dtype)
    m = sw.unsqueeze(-1) * cov * sw.unsqueeze(-2)  # [F, n, n] Hermitian
    evals, evecs = torch.linalg.eigh(m)
    v = evecs[..., -1]  # [F, n]
    gamma = v.conj() * sw  # merged = sum_j gamma_j k_j
    total = gamma.sum(-1)
    phase = torch.where(total.abs() > EPS, total / total.abs().clamp_min(EPS), torch.ones_like(total))
    gamma = gamma * phase.conj().unsqueeze(-1)
    cg = torch.einsum("fjk,fk->fj", cov, gamma.conj())  # E[k_j conj(merged)]
    energy = (gamma * cg).sum(-1).real.clamp_min(EPS)
    target = (w * torch.diagonal(cov, dim1=-2, dim2=-1).real).sum(-1) / w.sum(-1)
    scale = (target.clamp_min(EPS) / energy).sqrt()
    gamma = gamma * scale.unsqueeze(-1)
    cg, energy = cg * scale.unsqueeze(-1), energy * scale**2
    alpha = (cg / energy.unsqueeze(-1)).T  # [n, F]
    ka, kb = keys[:, pairs.a], keys[:, pairs.b]  # [n, F, d_in]
    gr, gi = gamma.real.T.unsqueeze(-1).to(keys.dtype), gamma.imag.T.unsqueeze(-1).to(keys.dtype)  # [n, F, 1]
    merged_a = (gr * ka - gi * kb).sum(0)
    merged_b = (gr * kb + gi * ka).sum(0)
    total_energy = evals.real.clamp_min(0).sum()
    lost = float((total_energy - evals[..., -1].real.clamp_min(0).sum()) / total_energy.clamp_min(EPS))
    return torch.cat([merged_a, merged_b]), alpha, lost


def fold_alpha(queries: torch.Tensor, alpha: torch.Tensor, pairs: RotaryPairs) -> torch.Tensor:
    """queries [r, D, d_in] of one member, alpha [F] complex -> queries multiplied by conj(alpha) per pair."""
    out = queries.clone()
    qa, qb = queries[:, pairs.a], queries[:, pairs.b]
    ar, ai = alpha.real.to(queries.dtype)[:, None], alpha.imag.to(queries.dtype)[:, None]
    out[:, pairs.a] = ar * qa + ai * qb
    out[:, pairs.b] = ar * qb - ai * qa
    return out


@dataclass
class GroupMerge:
    key: torch.Tensor  # [D, d_in]
    value: torch.Tensor  # [D, d_in]
    queries: torch.Tensor  # [n, r, D, d_in] the members' query heads, with the key maps folded in
    value_maps: torch.Tensor  # [n, D, D]: member_j's value ~ value_maps[j] @ merged value
    key_loss: float
    value_loss: float


def weighted_queries(queries: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """queries [n, r, D, d_in] scaled by sqrt(weights [n, r]): their energies, the keys' fit's weights, scaled by the
    weights (the queries themselves when there are none)."""
    return queries if weights is None else queries * weights.sqrt().to(queries.dtype)[:, :, None, None]


def merge_group(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, o_heads: torch.Tensor,
                sigma: torch.Tensor, pairs: RotaryPairs, fold_queries: bool = True,
                query_weights: torch.Tensor | None = None) -> GroupMerge:
    """Merge one group. keys/values [n, D, d_in]; queries [n, r, D, d_in]; o_heads [n, r, d, D] (o_proj slices);
    query_weights [n, r]: each query head's weight in the keys' fit (None: 1 each).

    fold_queries=False (architectures with per-head q/k norms, where nothing can be folded through the
    norm): the merged key is the members' mean and the queries stay as they are.
    """
    n, head_dim, _ = keys.shape
    if n == 1:
        eye = torch.eye(head_dim, dtype=keys.dtype, device=keys.device).unsqueeze(0)
        return GroupMerge(keys[0], values[0], queries, eye, 0.0, 0.0)
    # values: the principal subspace of the members' values, measured in o_proj's output metric
    o_gram = torch.einsum("jrdi,jrdk->jik", o_heads, o_heads)
    value, value_maps, value_loss = merge_linear(values, o_gram, sigma)
    if not fold_queries:
        return GroupMerge(keys.mean(0), value, queries, value_maps, float("nan"), value_loss)
    new_q = queries.clone()
    key = torch.empty_like(keys[0])
    losses = []
    if pairs.frequencies:
        stats = complex_stats(keys, weighted_queries(queries, query_weights), sigma, pairs)
        rot, alpha, rot_loss = merge_rotary(keys, stats, pairs)
        f = pairs.frequencies
        key[pairs.a], key[pairs.b] = rot[:f], rot[f:]
        for j in range(n):
            new_q[j] = fold_alpha(queries[j], alpha[j], pairs)
        losses.append(rot_loss)
    if pairs.rest.numel():
        rest = pairs.rest
        q_rest = queries[:, :, rest]  # [n, r, p, d_in]
        q_metric = weighted_queries(queries, query_weights)[:, :, rest]
        metric = torch.einsum("jrpx,xy,jrqy->jpq", q_metric, sigma, q_metric)
        merged, maps, rest_loss = merge_linear(keys[:, rest], metric, sigma)
        key[rest] = merged
        for j in range(n):
            new_q[j][:, rest] = torch.einsum("pq,rpx->rqx", maps[j], q_rest[j])
        losses.append(rest_loss)
    return GroupMerge(key, value, new_q, value_maps, float(sum(losses) / len(losses)), value_loss)
