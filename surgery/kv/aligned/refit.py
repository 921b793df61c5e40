"""Layer-wise least-squares refits of the query and output projections, against the source's activations.

After the merge, the layer's attention is run on the converted model's own inputs (its predecessors are
already converted). Two refits then make the attention *output*, not the weights, match the source:

- queries: for a sample of query positions, the (rotated) query that best reproduces the source's attention
  logits against the merged keys is solved for, weighting each key by the source's attention probability
  (a second-order approximation of the KL between the two attention distributions, with a free per-row
  offset since softmax ignores one); q_proj's rows are then regressed onto those queries (after undoing
  the rotation), regularised toward the folded queries on all calibration tokens;
- output: o_proj is refit by ridge regression from the converted per-head outputs to the source attention
  output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...solve import lu_in_place
from .rotary import RotaryPairs, rotate


def augment(x: torch.Tensor, bias: bool) -> torch.Tensor:
    return torch.cat([x, torch.ones(*x.shape[:-1], 1, dtype=x.dtype, device=x.device)], dim=-1) if bias else x


def refit_output(heads: torch.Tensor, target: torch.Tensor, o: torch.Tensor, o_bias: torch.Tensor | None,
                 ridge: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor | None]:
    """heads [T, H*D] (o_proj's input), target [T, d] -> o [d, H*D], bias, by ridge regression toward the current o."""
    z = augment(heads.float(), o_bias is not None)
    w0 = torch.cat([o, o_bias[:, None]], dim=1) if o_bias is not None else o
    gram = (z.T @ z).double()
    rhs = (z.T @ target.float()).double()
    del z
    reg = float(ridge * torch.diagonal(gram).mean().clamp_min(1e-12))  # times I, added in place
    rhs.add_(w0.T, alpha=reg)
    gram.diagonal().add_(reg)
    lu, pivots = lu_in_place(gram)
    w = torch.linalg.lu_solve(lu, pivots, rhs).T.float()
    return (w[:, :-1].contiguous(), w[:, -1].contiguous()) if o_bias is not None else (w.contiguous(), None)


@dataclass
class QueryRefit:
    samples: int = 128  # query positions per window whose ideal queries are solved for
    top_k: int = 32  # keys per query position weighted by the source's attention probability
    uniform: float = 0.1  # weight of the window's average key statistics, beside the attention probability
    ridge: float = 1e-2  # per-position pull toward the folded query (relative to the key Gram's scale)
    prior: float = 0.1  # pull of q_proj toward the folded one on all tokens (relative to the sample count)
    weight_ridge: float = 1e-3  # plain ridge toward the folded q_proj (relative to the input Gram's scale)
    chunk: int = 4  # windows per step (bounds memory)


@torch.no_grad()
def ideal_queries(q_src: torch.Tensor, k_src: torch.Tensor, q_cv: torch.Tensor, k_cv: torch.Tensor, scaling: float,
                  softcap: float | None, positions: torch.Tensor, opts: QueryRefit) -> torch.Tensor:
    """At each of `positions` [M], the rotated query that best reproduces the source's logits against the merged key.

    q_src, k_src [N, R, L, D]: R source query heads and, for each, its source key head; q_cv [N, R, L, D] the
    converted (folded) queries; k_cv [N, L, D] the merged key they all share now.
    Per query position m, with phi_n = [k_n, 1] and theta = [q, c] (c: a free logit offset, which softmax
    ignores), minimises
        sum_{n in top-k} p_mn (theta . phi_n - s_mn)^2 + uniform * E_n[(theta . phi_n - s_mn)^2] + ridge |theta - theta0|^2
    where p is the source's attention probability, the expectation runs over the window's keys (a regulariser
    that keeps every other logit in check) and theta0 is the folded query. The shared part A = uniform * E[phi phi^T]
    + ridge * I is inverted once per window; the top-k part is a rank-k update, solved with the Woodbury identity
    as one k x k system per position. Returns [N, R, M, D].
    """
    n_win, heads, length, head_dim = q_src.shape
    e = head_dim + 1
    m = positions.numel()
    dev = q_src.device
    positions = positions.to(dev)
    visible = torch.arange(length, device=dev)[None, :] <= positions[:, None]  # [M, L]
    phi = torch.cat([scaling * k_cv.float(), torch.ones(n_win, length, 1, device=dev)], dim=-1)  # [N, L, e]
    mean_gram = (phi.transpose(1, 2) @ phi).double() / length  # [N, e, e]
    ridge = opts.ridge * torch.diagonal(mean_gram, dim1=-2, dim2=-1).mean(-1)[:, None, None] + 1e-12  # [N, 1, 1]
    a_inv = torch.linalg.inv(opts.uniform * mean_gram + ridge * torch.eye(e, dtype=torch.float64, device=dev)).float()
    ridge = ridge.float()
    psi = phi @ a_inv  # [N, L, e]
    kmat = (psi @ phi.transpose(1, 2)).reshape(n_win, -1)  # [N, L*L]: phi_a A^-1 phi_b
    k = min(opts.top_k, length)
    eye = torch.eye(k, device=dev)
    out = torch.empty(n_win, heads, m, head_dim, device=dev)
    for h in range(heads):
        q_h = q_src[:, h, positions].float()  # [N, M, D]
        ks = scaling * k_src[:, h].float()  # [N, L, D]
        raw = q_h @ ks.transpose(-1, -2)  # [N, M, L]
        capped = softcap * torch.tanh(raw / softcap) if softcap else raw
        prob = torch.softmax(capped.masked_fill(~visible, float("-inf")), dim=-1)
        p_top, idx = prob.topk(k, dim=-1)  # [N, M, k]
        s_top = raw.gather(-1, idx)
        pair = (idx[..., :, None] * length + idx[..., None, :]).reshape(n_win, -1)
        m_kk = kmat.gather(1, pair).reshape(n_win, m, k, k)  # phi_a A^-1 phi_b on the top keys
        q0 = q_cv[:, h, positions].float()
        phi_q0 = (q0 @ phi[..., :head_dim].transpose(1, 2)).gather(-1, idx)  # [N, M, k]
        c0 = (p_top * (s_top - phi_q0)).sum(-1) / p_top.sum(-1).clamp_min(1e-12)
        theta0 = torch.cat([q0, c0[..., None]], dim=-1)  # [N, M, e]
        mean_cross = phi.transpose(1, 2) @ ks / length  # [N, e, D]
        c = opts.uniform * (q_h @ mean_cross.transpose(1, 2)) + ridge * theta0
        y = c @ a_inv  # [N, M, e]  (A symmetric)
        ps = p_top * s_top
        t = (m_kk @ ps[..., None])[..., 0] + (y @ phi.transpose(1, 2)).gather(-1, idx)
        sp = p_top.sqrt()
        inner = eye + sp[..., :, None] * m_kk * sp[..., None, :]
        w = torch.cholesky_solve((sp * t)[..., None], torch.linalg.cholesky(inner))[..., 0]
        dense = torch.zeros(n_win, m, length, device=dev).scatter_(-1, idx, ps - sp * w)
        theta = y + dense @ psi
        out[:, h] = theta[..., :head_dim]
    return out


@torch.no_grad()
def refit_queries(x: torch.Tensor, q_src: torch.Tensor, k_src: torch.Tensor, q_cv: torch.Tensor, k_cv: torch.Tensor,
                  groups: list[list[int]], cos: torch.Tensor | None, sin: torch.Tensor | None, pairs: RotaryPairs,
                  scaling: float, softcap: float | None, q_rows: torch.Tensor, opts: QueryRefit,
                  generator: torch.Generator) -> torch.Tensor:
    """New q_proj rows [H*D, d_in]: each head regressed onto its ideal (un-rotated) queries at sampled positions.

    x [N, L, d_in] converted attention input (augmented when q has a bias); q_src/k_src [N, H|KV, L, D] the
    source's rotated queries/keys; q_cv/k_cv the converted layer's on x (source-shaped: the K/V slots of a group
    hold its merged head); groups: the source K/V heads of each merged head; cos/sin [N, L, F] (None: no rotary).
    """
    n_win, heads, length, head_dim = q_src.shape
    kv = k_cv.shape[1]
    r = heads // kv
    din = x.shape[-1]
    dev = x.device
    xtx_all = torch.zeros(din, din, dtype=torch.float64, device=dev)
    xtx = torch.zeros(din, din, dtype=torch.float64, device=dev)
    xty = torch.zeros(heads, din, head_dim, dtype=torch.float64, device=dev)
    samples = 0
    for lo in range(0, n_win, opts.chunk):
        sl = slice(lo, lo + opts.chunk)
        xa = x[sl].reshape(-1, din).float()
        xtx_all += (xa.T @ xa).double()
        m = min(opts.samples, length)
        positions = torch.randperm(length, generator=generator)[:m].sort().values.to(dev)
        xs = x[sl][:, positions].reshape(-1, din).float()
        xtx += (xs.T @ xs).double()
        samples += xs.shape[0]
        for members in groups:
            hs = torch.tensor([j * r + i for j in members for i in range(r)], device=dev)
            target = ideal_queries(q_src[sl][:, hs], k_src[sl][:, hs // r], q_cv[sl][:, hs], k_cv[sl, members[0]],
                                   scaling, softcap, positions, opts)
            if cos is not None and pairs.frequencies:
                target = rotate(target, cos[sl][:, None, positions], sin[sl][:, None, positions], pairs, inverse=True)
            xty[hs] += torch.einsum("tx,htd->hxd", xs, target.transpose(0, 1).reshape(len(hs), -1, head_dim)).double()
    # (xtx + prior) W_h = xty_h + prior rows_h^T for every head h, prior = c xtx_all + ridge I (directions the
    # calibration barely saw keep the folded weights). Built in place and solved head by head from one LU
    # factorisation: the float64 matrices alive at once are three d_in x d_in / H x d_in x D ones, not ten.
    c = opts.prior * samples / (n_win * length)
    ridge = opts.weight_ridge * torch.diagonal(xtx).mean().clamp_min(1e-12)
    rows = q_rows.reshape(heads, head_dim, din)
    for h in range(heads):
        rows_h = rows[h].T.double()
        xty[h] += c * (xtx_all @ rows_h) + ridge * rows_h
    xtx += c * xtx_all
    del xtx_all
    xtx.diagonal().add_(ridge)
    lu, pivots = lu_in_place(xtx)
    fitted = torch.empty(heads, head_dim, din, dtype=torch.float32, device=dev)
    for h in range(heads):
        fitted[h] = torch.linalg.lu_solve(lu, pivots, xty[h]).T.float()
    return fitted.reshape(heads * head_dim, din)
