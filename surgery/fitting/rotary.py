"""Rotary position embedding (RoPE) structure: which head dimensions form a rotating pair.

RoPE rotates each pair (a, b) of a query or key head by a position-dependent angle: seen as one complex
number a + ib, the pair is multiplied by e^{i theta pos}. Multiplying the pair by a complex scalar
(a 2x2 rotation-and-scale) commutes with that rotation, which is what lets a key merge fold per-pair
complex scalars into the queries. Two layouts exist:
- half-split (HF Llama, Mistral, Qwen, Gemma, Phi-3, GPT-NeoX): pair i is (i, i + rot/2);
- interleaved (GPT-J, Meta's original Llama, Cohere, GLM): pair i is (2i, 2i + 1).
With partial rotary (GPT-NeoX rotary_pct, Phi partial_rotary_factor) only the first `rotary_dims` dims
rotate; the rest are position-free and may be mixed by any linear map.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = ("half", "interleaved")


@dataclass(frozen=True)
class RotaryPairs:
    a: torch.Tensor  # [F] first index of each rotating pair (the real part)
    b: torch.Tensor  # [F] second index (the imaginary part)
    rest: torch.Tensor  # [p] dimensions that do not rotate

    @property
    def frequencies(self) -> int:
        return int(self.a.numel())


def rotary_pairs(head_dim: int, rotary_dims: int, layout: str = "half") -> RotaryPairs:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown rotary layout {layout!r}")
    if rotary_dims % 2 or not 0 <= rotary_dims <= head_dim:
        raise ValueError(f"rotary dims {rotary_dims} must be even and at most head_dim {head_dim}")
    half = rotary_dims // 2
    if layout == "half":
        a = torch.arange(half)
        b = a + half
    else:
        a = torch.arange(0, rotary_dims, 2)
        b = a + 1
    return RotaryPairs(a, b, torch.arange(rotary_dims, head_dim))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: RotaryPairs, inverse: bool = False) -> torch.Tensor:
    """Apply (or undo) the rotation to x[..., head_dim]; cos/sin [..., F] broadcast against x[..., F].

    cos and sin may carry a common scale (YaRN-style attention scaling); the inverse divides it out.
    """
    xa, xb = x[..., pairs.a], x[..., pairs.b]
    out = x.clone()
    if inverse:
        norm = cos * cos + sin * sin
        out[..., pairs.a] = (xa * cos + xb * sin) / norm
        out[..., pairs.b] = (xb * cos - xa * sin) / norm
    else:
        out[..., pairs.a] = xa * cos - xb * sin
        out[..., pairs.b] = xb * cos + xa * sin
    return out


def hf_cos_sin(position_embeddings, pairs: RotaryPairs) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's (cos, sin) of shape [B, L, rot] -> [B, L, F] each, one angle per rotating pair (`pairs` says which dims
    pair up; the table does not). HF writes each frequency twice, in one of two orders: as two halves
    (cat(freqs, freqs): Llama's table, and GLM's, which GLM interleaves itself when it rotates) or pair by pair
    (repeat_interleave: Cohere). The order is read off the table: the halves of a pair-by-pair table differ (their
    frequencies do) and its even and odd columns are equal."""
    cos, sin = position_embeddings
    f = pairs.frequencies
    if cos.shape[-1] == 2 * f and _pair_by_pair(cos, f):
        return cos[..., 0::2].float(), sin[..., 0::2].float()
    return cos[..., :f].float(), sin[..., :f].float()


def _pair_by_pair(cos: torch.Tensor, f: int) -> bool:
    return f > 1 and torch.equal(cos[..., 0::2], cos[..., 1::2]) and not torch.equal(cos[..., :f], cos[..., f:])
