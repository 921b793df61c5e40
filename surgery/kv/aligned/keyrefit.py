"""Least-squares refit of the merged keys against the source's attention logits (the key side of a joint q/k refit).

After the merge, every query head of a group attends to the group's one merged key. For a sample of key positions n,
the rotated key that best reproduces the source's logits from *all* the group's (converted) queries is solved for:

    kappa_n = argmin  sum_{h in group} sum_{m >= n} w_hmn (s * q_hm . kappa - (t_hmn - c_hm))^2 + ridge |kappa - kappa0|^2

where t is the source's logit (its own query against its own key head), s the softmax scaling, c_hm the per-query
offset softmax ignores (the source-probability-weighted mean of t - converted logit over row m), w the source's
attention probability plus a uniform share over the visible queries (so that logits the source gives little weight
keep in check too), times the query head's weight when the heads are weighted (`--retrieval-weight`: retrieval heads
count more), and kappa0 the current merged key. k_proj's rows are then regressed onto those keys (after
undoing the rotation at each key's position), regularised toward the current rows on all calibration tokens. On a
retrieval window (`--calib-retrieval-mix`) the needle's value positions join the window's sampled key positions, each
weighing `--retrieval-rows-weight` sampled rows.

The queries only enter as the converted model computes them, so alternating this with the query refit
(`refit.refit_queries`) descends the same logit objective from both sides. A group of one head is not refit (its key
is the source's, exactly).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...fitting.rotary import RotaryPairs, rotate
from ...fitting.shape import RefitShape, refit_shape


@dataclass
class KeyRefit:
    samples: int = 96  # key positions per window whose ideal keys are solved for
    uniform: float = 0.1  # total weight of the uniform share over a key's visible queries, per head
    ridge: float = 1e-2  # per-position pull toward the current key (relative to the query Gram's scale)
    prior: float = 0.1  # pull of k_proj toward the current rows on all tokens (relative to the sample count)
    weight_ridge: float = 1e-3  # plain ridge toward the current k_proj (relative to the input Gram's scale)


@torch.no_grad()
def ideal_keys(q_src: torch.Tensor, k_src: torch.Tensor, q_cv: torch.Tensor, k_cv: torch.Tensor, scaling: float,
               softcap: float | None, positions: torch.Tensor, opts: KeyRefit,
               head_weights: torch.Tensor | None = None) -> torch.Tensor:
    """One window. q_src [R, L, D] the group's source queries, k_src [R, L, D] the source key each of them used,
    q_cv [R, L, D] the converted queries, k_cv [L, D] the merged key; positions [M] key positions -> [M, D];
    head_weights [R] each query head's weight (None: 1 each)."""
    heads, length, head_dim = q_src.shape
    dev = q_src.device
    positions = positions.to(dev)
    causal = torch.ones(length, length, dtype=torch.bool, device=dev).tril()  # [m, n]: query m sees key n
    target = scaling * (q_src.float() @ k_src.float().transpose(-1, -2))  # [R, L, L]
    capped = softcap * torch.tanh(target / softcap) if softcap else target
    prob = torch.softmax(capped.masked_fill(~causal, float("-inf")), dim=-1)
    qs = scaling * q_cv.float()  # [R, L, D]
    current = qs @ k_cv.float().T  # [R, L, L]
    offset = (prob * (target - current)).sum(-1, keepdim=True)  # [R, L, 1]
    seen = causal[:, positions].float()  # [L(m), M]
    share = seen / seen.sum(0, keepdim=True).clamp_min(1)
    w = prob[:, :, positions] + opts.uniform * share  # [R, L, M]
    if head_weights is not None:
        w = w * head_weights.to(w)[:, None, None]
    resid = (target - offset)[:, :, positions]  # [R, L, M]
    gram = torch.einsum("hmd,hmn,hme->nde", qs, w, qs).double()  # [M, D, D]
    rhs = torch.einsum("hmd,hmn->nd", qs, w * resid).double()  # [M, D]
    lam = opts.ridge * torch.diagonal(gram, dim1=-2, dim2=-1).mean(-1).clamp_min(1e-12)  # [M]
    eye = torch.eye(head_dim, dtype=torch.float64, device=dev)
    k0 = k_cv[positions].double()
    out = torch.linalg.solve(gram + lam[:, None, None] * eye, (rhs + lam[:, None] * k0)[..., None])[..., 0]
    return out.float()


class KeyFit:
    """refit_keys's normal equations, accumulated window by window (positions drawn per window, in order): memory is
    one batch's tensors whatever the number of windows."""

    def __init__(self, shape: RefitShape, length: int, pairs: RotaryPairs, scaling: float, softcap: float | None,
                 opts: KeyRefit, generator: torch.Generator, device: torch.device,
                 head_weights: torch.Tensor | None = None, rows_weight: float = 0.0):
        self.shape, self.length, self.pairs = shape, length, pairs
        self.head_weights = head_weights  # [H] each query head's weight (None: 1 each)
        self.rows_weight = rows_weight  # each of `add`'s extra rows against one sampled row (0: none are added)
        self.scaling, self.softcap, self.opts, self.generator = scaling, softcap, opts, generator
        din = shape.din
        f64 = dict(dtype=torch.float64, device=device)
        self.xtx_all = torch.zeros(din, din, **f64)
        self.xtx = torch.zeros(din, din, **f64)
        self.xty = torch.zeros(len(shape.fit), din, shape.head_dim, **f64)
        self.samples = self.windows = 0

    def add(self, x: torch.Tensor, q_src: torch.Tensor, k_src: torch.Tensor, q_cv: torch.Tensor, k_cv: torch.Tensor,
            cos: torch.Tensor | None, sin: torch.Tensor | None,
            rows: list[tuple[int, list[int]]] | None = None) -> None:
        """The next windows (refit_keys's arguments for them). `rows`: (window index among these windows, key
        positions) whose ideal keys are fitted too, beside the window's random sample, each weighing `rows_weight`
        times a sampled one (a retrieval window's needle positions: the keys the answer must find); they leave the
        random draws, and the prior's scale (the sample count), as they are."""
        if not self.shape.fit:
            return
        m = min(self.opts.samples, self.length)
        extra = {i: positions for i, positions in rows or () if positions} if self.rows_weight else {}
        for i in range(x.shape[0]):
            xa = x[i].float()
            self.xtx_all += (xa.T @ xa).double()
            positions = torch.randperm(self.length, generator=self.generator)[:m].sort().values.to(x.device)
            xs = xa[positions]
            self.xtx += (xs.T @ xs).double()
            self.samples += m
            self._window(i, xs, positions, q_src, k_src, q_cv, k_cv, cos, sin)
            if i in extra:
                positions = torch.tensor(sorted(set(extra[i])), device=x.device)
                xs = xa[positions]
                self.xtx += self.rows_weight * (xs.T @ xs).double()
                self._window(i, xs, positions, q_src, k_src, q_cv, k_cv, cos, sin, self.rows_weight)
        self.windows += x.shape[0]

    def _window(self, i, xs, positions, q_src, k_src, q_cv, k_cv, cos, sin, weight: float | None = None) -> None:
        """Window i's ideal keys at `positions` (inputs xs) into each group's right-hand side (`weight`: extra rows)."""
        r = self.shape.per_kv
        for g, members in enumerate(self.shape.fit):
            hs = torch.tensor([j * r + h for j in members for h in range(r)], device=xs.device)
            weights = None if self.head_weights is None else self.head_weights[hs.cpu()]
            target = ideal_keys(q_src[i, hs], k_src[i, hs // r], q_cv[i, hs], k_cv[i, members[0]], self.scaling,
                                self.softcap, positions, self.opts, weights)  # [M, D]
            if cos is not None and self.pairs.frequencies:
                target = rotate(target, cos[i, positions], sin[i, positions], self.pairs, inverse=True)
            products = (xs.T @ target).double()
            self.xty[g] += products if weight is None else weight * products

    def solve(self, k_rows: torch.Tensor) -> torch.Tensor:
        """New k_proj rows [KV*D, d_in] (every slot of a group holds the group's refit key)."""
        s = self.shape
        if not s.fit:
            return k_rows
        rows = k_rows.double().reshape(s.kv, s.head_dim, s.din).clone()
        prior = self.xtx_all * (self.opts.prior * self.samples / (self.windows * self.length))
        scale = torch.diagonal(self.xtx).mean().clamp_min(1e-12)
        prior = prior + torch.eye(s.din, dtype=torch.float64, device=prior.device) * (self.opts.weight_ridge * scale)
        for g, members in enumerate(s.fit):
            old = rows[members[0]]  # [D, din]
            new = torch.linalg.solve(self.xtx + prior, self.xty[g] + prior @ old.T).T
            for j in members:
                rows[j] = new
        return rows.reshape(s.kv * s.head_dim, s.din).float()


@torch.no_grad()
def refit_keys(x: torch.Tensor, q_src: torch.Tensor, k_src: torch.Tensor, q_cv: torch.Tensor, k_cv: torch.Tensor,
               groups: list[list[int]], cos: torch.Tensor | None, sin: torch.Tensor | None, pairs: RotaryPairs,
               scaling: float, softcap: float | None, k_rows: torch.Tensor, opts: KeyRefit,
               generator: torch.Generator) -> torch.Tensor:
    """New k_proj rows [KV*D, d_in] (source-shaped: every slot of a group holds the group's refit key; `KeyFit` over
    all the windows at once).

    x [N, L, d_in] converted attention input (augmented when k has a bias); q_src/k_src [N, H|KV, L, D] the source's
    rotated queries/keys; q_cv/k_cv the converted layer's on x (source-shaped); groups: the source K/V heads of each
    merged head; cos/sin [N, L, F] (None: no rotary).
    """
    fit = KeyFit(refit_shape(x, q_src, k_cv, groups), q_src.shape[2], pairs, scaling, softcap, opts, generator,
                 x.device)
    fit.add(x, q_src, k_src, q_cv, k_cv, cos, sin)
    return fit.solve(k_rows)
