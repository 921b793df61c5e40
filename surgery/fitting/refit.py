"""Layer-wise least-squares refits of the query and output projections, against the source's activations.

After the merge, the layer's attention is run on the converted model's own inputs (its predecessors are
already converted). Two refits then make the attention *output*, not the weights, match the source:

- queries: for a sample of query positions, the (rotated) query that best reproduces the source's attention
  logits against the merged keys is solved for, weighting each key by the source's attention probability
  (a second-order approximation of the KL between the two attention distributions, with a free per-row
  offset since softmax ignores one); q_proj's rows are then regressed onto those queries (after undoing
  the rotation), regularised toward the folded queries on all calibration tokens (each head's data weighed against
  that pull by its weight, when the heads are weighted: `--retrieval-weight`'s retrieval heads fit more closely);
  on a retrieval window (`--calib-retrieval-mix`) the answer positions' rows join the sampled ones, each weighing
  `--retrieval-rows-weight` sampled rows (an answer position the random sample also drew counts in both);
- output: o_proj is refit by ridge regression from the converted per-head outputs to the source attention
  output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..solve import lu_in_place
from .rotary import RotaryPairs, rotate
from .shape import RefitShape, refit_shape


def augment(x: torch.Tensor, bias: bool) -> torch.Tensor:
    return torch.cat([x, torch.ones(*x.shape[:-1], 1, dtype=x.dtype, device=x.device)], dim=-1) if bias else x


class OutputFit:
    """refit_output's normal equations z^T z and z^T target (float64), accumulated over chunks of tokens: the memory
    is the [H*D(+1)]^2 Gram whatever the number of calibration tokens."""

    def __init__(self, o: torch.Tensor, o_bias: torch.Tensor | None):
        width = o.shape[1] + (o_bias is not None)
        self.o, self.o_bias = o, o_bias
        self.gram = torch.zeros(width, width, dtype=torch.float64, device=o.device)
        self.rhs = torch.zeros(width, o.shape[0], dtype=torch.float64, device=o.device)

    def add(self, heads: torch.Tensor, target: torch.Tensor) -> None:
        """heads [T, H*D] (o_proj's input), target [T, d] (the source attention's output) for T tokens."""
        z = augment(heads.float(), self.o_bias is not None)
        self.gram += (z.T @ z).double()
        self.rhs += (z.T @ target.float()).double()

    def solve(self, ridge: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor | None]:
        """o [d, H*D] and its bias, by ridge regression toward the current o (the accumulated sums are consumed)."""
        o, o_bias, gram, rhs = self.o, self.o_bias, self.gram, self.rhs
        self.gram = self.rhs = None
        w0 = torch.cat([o, o_bias[:, None]], dim=1) if o_bias is not None else o
        reg = float(ridge * torch.diagonal(gram).mean().clamp_min(1e-12))  # times I, added in place
        rhs.add_(w0.T, alpha=reg)
        gram.diagonal().add_(reg)
        lu, pivots = lu_in_place(gram)
        w = torch.linalg.lu_solve(lu, pivots, rhs).T.float()
        return (w[:, :-1].contiguous(), w[:, -1].contiguous()) if o_bias is not None else (w.contiguous(), None)


def refit_output(heads: torch.Tensor, target: torch.Tensor, o: torch.Tensor, o_bias: torch.Tensor | None,
                 ridge: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor | None]:
    """heads [T, H*D] (o_proj's input), target [T, d] -> o [d, H*D], bias, by ridge regression toward the current o
    (`OutputFit` over one chunk)."""
    fit = OutputFit(o, o_bias)
    fit.add(heads, target)
    return fit.solve(ridge)


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

    q_src, k_src [N, R, L, D]: R source query heads and, for each, its source key head; q_cv [N, R, L, D'] the
    converted (folded) queries; k_cv [N, L, D'] the merged key they all share now (D' = D for a K/V merge; MLA's
    heads are wider: no-position and rope dims).
    Per query position m, with phi_n = [k_n, 1] and theta = [q, c] (c: a free logit offset, which softmax
    ignores), minimises
        sum_{n in top-k} p_mn (theta . phi_n - s_mn)^2 + uniform * E_n[(theta . phi_n - s_mn)^2] + ridge |theta - theta0|^2
    where p is the source's attention probability, the expectation runs over the window's keys (a regulariser
    that keeps every other logit in check) and theta0 is the folded query. The shared part A = uniform * E[phi phi^T]
    + ridge * I is inverted once per window; the top-k part is a rank-k update, solved with the Woodbury identity
    as one k x k system per position. Returns [N, R, M, D].
    """
    n_win, heads, length, _ = q_src.shape
    head_dim = k_cv.shape[-1]  # the converted head's (MLA: no-position + rope dims), the source's may differ
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


class QueryFit:
    """refit_queries's normal equations, accumulated over batches of windows (in order). The positions are drawn
    once per `opts.chunk` windows counted from the first window, so any split of the windows into batches draws the
    same samples and sums the same products: memory is one batch's tensors whatever the number of windows."""

    def __init__(self, shape: RefitShape, length: int, groups: list[list[int]], pairs: RotaryPairs, scaling: float,
                 softcap: float | None, opts: QueryRefit, generator: torch.Generator, device: torch.device,
                 head_weights: torch.Tensor | None = None, rows_weight: float = 0.0):
        self.shape, self.length, self.groups, self.pairs = shape, length, groups, pairs
        self.head_weights = head_weights  # [H] each query head's weight on its samples (None: 1 each)
        self.rows_weight = rows_weight  # each of `add`'s extra rows against one sampled row (0: none are added)
        self.scaling, self.softcap, self.opts, self.generator = scaling, softcap, opts, generator
        din = shape.din
        f64 = dict(dtype=torch.float64, device=device)
        self.xtx_all = torch.zeros(din, din, **f64)
        self.xtx = torch.zeros(din, din, **f64)
        self.xty = torch.zeros(shape.heads, din, shape.head_dim, **f64)
        self.samples = self.windows = 0
        self.positions: torch.Tensor | None = None

    def add(self, x: torch.Tensor, q_src: torch.Tensor, k_src: torch.Tensor, q_cv: torch.Tensor, k_cv: torch.Tensor,
            cos: torch.Tensor | None, sin: torch.Tensor | None,
            rows: list[tuple[int, list[int]]] | None = None) -> None:
        """The next windows (refit_queries's arguments for them). `rows`: (window index among these windows, query
        positions) whose ideal queries are fitted too, beside the shared random sample, each row weighing
        `rows_weight` times a sampled one (a retrieval window's answer positions: the rows that must find the
        needle); they leave the random draws, and the prior's scale (the sample count), as they are."""
        n_win, lo = x.shape[0], 0
        while lo < n_win:
            offset = self.windows % self.opts.chunk
            if offset == 0:
                m = min(self.opts.samples, self.length)
                self.positions = torch.randperm(self.length, generator=self.generator)[:m].sort().values.to(x.device)
            hi = min(n_win, lo + self.opts.chunk - offset)
            sl = slice(lo, hi)
            self._add(x[sl], q_src[sl], k_src[sl], q_cv[sl], k_cv[sl], None if cos is None else cos[sl],
                      None if sin is None else sin[sl], self.positions)
            self.windows += hi - lo
            lo = hi
        if not self.rows_weight:
            return
        for i, positions in rows or ():
            if not positions:
                continue
            sl = slice(i, i + 1)
            self._add(x[sl], q_src[sl], k_src[sl], q_cv[sl], k_cv[sl], None if cos is None else cos[sl],
                      None if sin is None else sin[sl], torch.tensor(sorted(set(positions)), device=x.device),
                      self.rows_weight)

    def _add(self, x, q_src, k_src, q_cv, k_cv, cos, sin, positions, weight: float | None = None) -> None:
        """The products of `positions` in every one of these windows; `weight` (None: the sampled rows, counted)
        scales extra rows' products."""
        s, din = self.shape, self.shape.din
        r, head_dim = s.per_kv, s.head_dim
        if weight is None:
            xa = x.reshape(-1, din).float()
            self.xtx_all += (xa.T @ xa).double()
        xs = x[:, positions].reshape(-1, din).float()
        if weight is None:
            self.xtx += (xs.T @ xs).double()
            self.samples += xs.shape[0]
        else:
            self.xtx += weight * (xs.T @ xs).double()
        for members in self.groups:
            hs = torch.tensor([j * r + i for j in members for i in range(r)], device=x.device)
            target = ideal_queries(q_src[:, hs], k_src[:, hs // r], q_cv[:, hs], k_cv[:, members[0]],
                                   self.scaling, self.softcap, positions, self.opts)
            if cos is not None and self.pairs.frequencies:
                target = rotate(target, cos[:, None, positions], sin[:, None, positions], self.pairs, inverse=True)
            # index_add_, not xty[hs] += ...: the same float64 sums without a gathered copy of xty and a sum the
            # size of it (hs is every head of an MQA merge: 2 x 134 MB on Llama-3-8B)
            products = torch.einsum("tx,htd->hxd", xs, target.transpose(0, 1).reshape(len(hs), -1, head_dim)).double()
            self.xty.index_add_(0, hs, products if weight is None else weight * products)

    def solve(self, q_rows: torch.Tensor) -> torch.Tensor:
        """New q_proj rows [H*D, d_in] (the accumulated sums are consumed)."""
        # (xtx + prior) W_h = xty_h + prior rows_h^T for every head h, prior = c xtx_all + ridge I (directions the
        # calibration barely saw keep the folded weights). Built in place and solved head by head from one LU
        # factorisation: the float64 matrices alive at once are three d_in x d_in / H x d_in x D ones, not ten.
        heads, head_dim, din = self.shape.heads, self.shape.head_dim, self.shape.din
        xtx, xtx_all, xty = self.xtx, self.xtx_all, self.xty
        self.xtx = self.xtx_all = self.xty = None
        c = self.opts.prior * self.samples / (self.windows * self.length)
        ridge = self.opts.weight_ridge * torch.diagonal(xtx).mean().clamp_min(1e-12)
        rows = q_rows.reshape(heads, head_dim, din)
        if self.head_weights is not None:
            return self._solve_weighted(xtx, xtx_all, xty, c, ridge, rows)
        for h in range(heads):
            rows_h = rows[h].T.double()
            xty[h] += c * (xtx_all @ rows_h) + ridge * rows_h
        xtx += c * xtx_all
        del xtx_all
        xtx.diagonal().add_(ridge)
        lu, pivots = lu_in_place(xtx)
        fitted = torch.empty(heads, head_dim, din, dtype=torch.float32, device=xtx.device)
        for h in range(heads):
            fitted[h] = torch.linalg.lu_solve(lu, pivots, xty[h]).T.float()
        return fitted.reshape(heads * head_dim, din)

    def _solve_weighted(self, xtx, xtx_all, xty, c, ridge, rows) -> torch.Tensor:
        """Head h's samples weigh a_h against the same pull: (a_h xtx + prior) W_h = a_h xty_h + prior rows_h^T, one
        factorisation per head."""
        heads, head_dim, din = self.shape.heads, self.shape.head_dim, self.shape.din
        prior = c * xtx_all
        prior.diagonal().add_(ridge)
        fitted = torch.empty(heads, head_dim, din, dtype=torch.float32, device=xtx.device)
        for h in range(heads):
            a = float(self.head_weights[h])
            rows_h = rows[h].T.double()
            fitted[h] = torch.linalg.solve(a * xtx + prior, a * xty[h] + prior @ rows_h).T.float()
        return fitted.reshape(heads * head_dim, din)


@torch.no_grad()
def refit_queries(x: torch.Tensor, q_src: torch.Tensor, k_src: torch.Tensor, q_cv: torch.Tensor, k_cv: torch.Tensor,
                  groups: list[list[int]], cos: torch.Tensor | None, sin: torch.Tensor | None, pairs: RotaryPairs,
                  scaling: float, softcap: float | None, q_rows: torch.Tensor, opts: QueryRefit,
                  generator: torch.Generator) -> torch.Tensor:
    """New q_proj rows [H*D, d_in]: each head regressed onto its ideal (un-rotated) queries at sampled positions
    (`QueryFit` over all the windows at once).

    x [N, L, d_in] converted attention input (augmented when q has a bias); q_src/k_src [N, H|KV, L, D] the
    source's rotated queries/keys; q_cv/k_cv the converted layer's on x (source-shaped: the K/V slots of a group
    hold its merged head); groups: the source K/V heads of each merged head; cos/sin [N, L, F] (None: no rotary).
    """
    fit = QueryFit(refit_shape(x, q_src, k_cv, groups), q_src.shape[2], groups, pairs, scaling, softcap, opts,
                   generator, x.device)
    fit.add(x, q_src, k_src, q_cv, k_cv, cos, sin)
    return fit.solve(q_rows)
