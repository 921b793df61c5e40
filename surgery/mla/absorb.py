"""What DeepSeek-V3's attention cannot hold, absorbed into plain projections by calibration (pure tensor math).

Qwen2's q/k/v biases and Qwen3's per-head q/k RMSNorms make the source's pre-RoPE queries, keys and values t(x)
affine or nonlinear functions of the attention input x; DeepSeek-V3 (and vLLM's MLA, and llama.cpp's) computes
only W x. Each projection is replaced by its best linear fit in the calibration activations' metric,
    W' = E[t x^T] (E[x x^T])^-1,
which for a bias is W + b E[x]^T E[x x^T]^-1 (the part of the bias that a direction of x carries), and for a norm
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

# relative to the mean diagonal of E[x x^T], pulling the fit toward the plain fold (`SourceProjections.fold`): the
# directions calibration never excites keep the stored weights instead of being zeroed (measured on tiny Qwen2s
# with zero biases: a fit without it (1e-9) lost 1e-3 of KL on held-out text, this one nothing)
RIDGE = 1e-3
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
        """The source's pre-RoPE `part` ("q", "k" or "v") of rows x [N, H] (float64)."""
        t = x @ self.weights[part].T
        if self.biases.get(part) is not None:
            t = t + self.biases[part]
        norm = self.norms.get(part)
        if norm is not None:
            h = t.view(t.shape[0], -1, self.head_dim)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * norm
            t = h.reshape(t.shape[0], -1)
        return t


class AbsorptionMoments:
    """E[x x^T] and, per projection, E[t x^T] and E|t|^2, summed chunk by chunk (float64, on x's device)."""

    def __init__(self, source: SourceProjections):
        self.source = source
        self.sigma: torch.Tensor | None = None
        self.cross: dict[str, torch.Tensor] = {}
        self.energy: dict[str, float] = {}
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.double()
        self.sigma = x.T @ x if self.sigma is None else self.sigma + x.T @ x
        for part in PARTS:
            t = self.source.target(part, x)
            self.cross[part] = t.T @ x + self.cross.get(part, 0)
            self.energy[part] = float(t.pow(2).sum()) + self.energy.get(part, 0.0)
        self.count += x.shape[0]

    def fit(self) -> tuple[dict[str, torch.Tensor], dict[str, tuple[float, float]]]:
        """Per projection, W' and (relative residual of W', relative residual of the stored W)."""
        sigma = self.sigma / self.count
        ridge = RIDGE * float(sigma.diagonal().mean()) * torch.eye(sigma.shape[0], dtype=sigma.dtype,
                                                                      device=sigma.device)
        fitted, residuals = {}, {}
        for part in PARTS:
            cross, energy = self.cross[part] / self.count, self.energy[part] / self.count
            base = self.source.fold(part, sigma)
            w = base + torch.linalg.solve(sigma + ridge, (cross - base @ sigma).T).T
            fitted[part] = w
            residuals[part] = (_residual(w, cross, sigma, energy), _residual(self.source.weights[part], cross, sigma,
                                                                            energy))
        return fitted, residuals


def _residual(w: torch.Tensor, cross: torch.Tensor, sigma: torch.Tensor, energy: float) -> float:
    """E|t - W x|^2 / E|t|^2 from the moments: (E|t|^2 - 2 tr(W E[x t^T]) + tr(W E[xx^T] W^T)) / E|t|^2."""
    err = energy - 2 * float((w * cross).sum()) + float(torch.einsum("oi,ij,oj->", w, sigma, w))
    return max(err, 0.0) / max(energy, 1e-300)
