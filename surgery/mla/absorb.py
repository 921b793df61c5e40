"""What DeepSeek-V3's attention cannot hold, absorbed into plain projections by calibration (pure tensor math).

Qwen2's q/k/v biases and Qwen3's per-head q/k RMSNorms make the source's pre-RoPE queries, keys and values t(x)
affine or nonlinear functions of the attention input x; DeepSeek-V3 (and vLLM's MLA, and llama.cpp's) computes
only W x. Each projection is replaced by its best linear fit in the calibration activations' metric,
    W' = E[t x^T] (E[x x^T])^-1,
which for a bias is W + b E[x]^T E[x x^T]^-1 (the part of the bias that a direction of x carries; the key bias is
dropped instead, see `SourceProjections.target`), and for a norm
the per-head scale the norm applies on average, direction by direction. The fit is ridge-regularised toward the
plain fold (W, or W scaled per head by the norm at its calibration RMS), so that directions calibration never
excites keep the stored weights. RoPE is orthogonal, so fitting the
pre-rotation keys in mean square fits the rotated ones too. The factorisation (surgery/mla/factor.py) then runs on
W', and the query and output refits (surgery/mla/calibrate.py) fit the source's own logits and attention outputs,
which carry the biases and norms. The relative residual of each fit, E|t - W'x|^2 / E|t|^2, is recorded beside the
one of dropping the term (W as stored): surgery.json's `mla.absorption`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# ridges relative to the mean diagonal of E[x x^T], pulling the fit toward the plain fold (`SourceProjections.fold`),
# and None (the plain fold itself): the one with the least residual on calibration rows the fit did not read wins
# (measured on a Qwen2 trained here, whose biases are small: fitting them at a fixed small ridge made held-out KL up
# to 10x that of dropping them); MEAN: the correction read from the mean direction of x alone
MEAN = "mean direction"
RIDGES = (1e-3, 1e-2, 1e-1, 1.0, MEAN, None)
PARTS = ("q", "k", "v")


@dataclass
class SourceProjections:
    """One layer's q/k/v projections as the source computes them (float64): weights [out, H], biases [out] or None,
    per-head RMSNorm weights [head_dim] (q and k) or None, the norm's epsilon."""

    weights: dict[str, torch.Tensor]
    biases: dict[str, torch.Tensor | None]
    norms: dict[str, torch.Tensor | None]
    eps: float
    head_dim: int

    def fold(self, part: str, sigma: torch.Tensor) -> torch.Tensor:
        """What the fit starts from (and is pulled toward where calibration says nothing): the stored weight, with a
        per-head norm folded at its calibration RMS (weight / sqrt(E[mean square] + eps) per head)."""
        w, norm = self.weights[part], self.norms.get(part)
        if norm is None:
            return w
        heads = w.view(-1, self.head_dim, w.shape[-1])
        mean_square = torch.einsum("hdi,ij,hdj->h", heads, sigma, heads) / self.head_dim
        scale = torch.rsqrt(mean_square + self.eps)[:, None, None] * norm[None, :, None]
        return (heads * scale).reshape(w.shape)

    def target(self, part: str, x: torch.Tensor) -> torch.Tensor:
        """What the fit of `part` ("q", "k" or "v") aims at on rows x [N, H] (float64): the source's pre-RoPE
        projection, except the key bias, which is dropped: its logit term q_s.R(t-s)b_k is constant over keys at
        the frequencies that barely turn over the context (softmax-invariant there), and a linear fit turns that
        constant into a token-dependent error (measured on a Qwen2 trained here: fitting it made held-out KL 1.1x to
        10x that of dropping every bias, by ridge; not fitting it, 0.54x; BENCHMARKS.md)."""
        t = x @ self.weights[part].T
        if self.biases.get(part) is not None and part != "k":
            t = t + self.biases[part]
        norm = self.norms.get(part)
        if norm is not None:
            h = t.view(t.shape[0], -1, self.head_dim)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * norm
            t = h.reshape(t.shape[0], -1)
        return t


@dataclass
class _Moments:
    """Sums of x x^T, t x^T and |t|^2 over `count` rows."""

    sigma: torch.Tensor | None = None
    cross: dict | None = None
    energy: dict | None = None
    count: int = 0
    total: torch.Tensor | None = None  # sum of x

    def add(self, source: SourceProjections, x: torch.Tensor) -> None:
        self.sigma = x.T @ x if self.sigma is None else self.sigma + x.T @ x
        self.total = x.sum(0) if self.total is None else self.total + x.sum(0)
        self.cross, self.energy = self.cross or {}, self.energy or {}
        for part in PARTS:
            t = source.target(part, x)
            self.cross[part] = t.T @ x + self.cross.get(part, 0)
            self.energy[part] = float(t.pow(2).sum()) + self.energy.get(part, 0.0)
        self.count += x.shape[0]

    def merged(self, other: "_Moments") -> "_Moments":
        return _Moments(self.sigma + other.sigma, {p: self.cross[p] + other.cross[p] for p in PARTS},
                        {p: self.energy[p] + other.energy[p] for p in PARTS}, self.count + other.count,
                        self.total + other.total)

    def mean(self, part: str) -> tuple[torch.Tensor, torch.Tensor, float]:
        return self.sigma / self.count, self.cross[part] / self.count, self.energy[part] / self.count


class AbsorptionMoments:
    """E[x x^T] and, per projection, E[t x^T] and E|t|^2, summed chunk by chunk (float64, on x's device), in two
    halves (the first and second half of each chunk's rows) so that the ridge is chosen on rows the fit did not
    read: each half's fit is scored on the other half, for every ridge in RIDGES and the plain fold (no fit); the
    best is then fitted on both."""

    def __init__(self, source: SourceProjections):
        self.source = source
        self.halves = (_Moments(), _Moments())

    def add(self, x: torch.Tensor) -> None:
        x = x.double()
        half = x.shape[0] // 2
        for part, rows in zip(self.halves, (x[:half], x[half:])):
            if rows.shape[0]:
                part.add(self.source, rows)

    def _solve(self, moments: _Moments, part: str, ridge: float | None) -> torch.Tensor:
        sigma, cross, _ = moments.mean(part)
        base = self.source.fold(part, sigma)
        if ridge is None:
            return base
        if ridge == MEAN:  # the correction read from the mean direction alone: what every input carries
            mu = moments.total / moments.count
            return base + ((cross - base @ sigma) @ mu)[:, None] * mu[None, :] / max(float(mu @ sigma @ mu), 1e-300)
        eye = torch.eye(sigma.shape[0], dtype=sigma.dtype, device=sigma.device)
        reg = ridge * float(sigma.diagonal().mean()) * eye
        return base + torch.linalg.solve(sigma + reg, (cross - base @ sigma).T).T

    def fit(self) -> tuple[dict[str, torch.Tensor], dict[str, tuple[float, float]], dict[str, float | None]]:
        """Per projection, W', (relative residual of W', of the stored W) on all rows, and the ridge chosen (None:
        the plain fold won on held-out rows)."""
        a, b = self.halves
        usable = a.count and b.count
        total = a.merged(b) if usable else (a if a.count else b)
        fitted, residuals, chosen = {}, {}, {}
        for part in PARTS:
            def held_out(ridge: float | None) -> float:
                err = 0.0
                for fit, score in ((a, b), (b, a)):
                    sigma, cross, energy = score.mean(part)
                    err += _residual(self._solve(fit, part, ridge), cross, energy, sigma=sigma)
                return err

            ridge = min(RIDGES, key=held_out) if usable else RIDGES[0]
            w = self._solve(total, part, ridge)
            sigma, cross, energy = total.mean(part)
            fitted[part], chosen[part] = w, ridge
            residuals[part] = (_residual(w, cross, energy, sigma=sigma),
                               _residual(self.source.weights[part], cross, energy, sigma=sigma))
        return fitted, residuals, chosen


def _residual(w: torch.Tensor, cross: torch.Tensor, energy: float, *, sigma: torch.Tensor) -> float:
    """E|t - W x|^2 / E|t|^2 from the moments: (E|t|^2 - 2 tr(W E[x t^T]) + tr(W E[xx^T] W^T)) / E|t|^2."""
    err = energy - 2 * float((w * cross).sum()) + float(torch.einsum("oi,ij,oj->", w, sigma, w))
    return max(err, 0.0) / max(energy, 1e-300)
