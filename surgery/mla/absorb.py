"""What a source layer computes beyond Llama's attention and DeepSeek-V3's layer cannot hold: q/k/v projection biases
(Qwen2) and per-head q/k RMSNorms with one weight shared by every head (Qwen3). Read here per layer; the
factorisation (surgery/mla/factor.py) sees their linear part, the query and output refits (surgery/mla/calibrate.py)
fit the source's own logits and attention outputs, which include them.

- A q/k norm divides each head's projection by its per-token RMS and scales by w: linearised at the calibration RMS,
  W_h -> diag(w) W_h / sqrt(E|W_h x|^2 / d + eps) (exact where the RMS does not vary over tokens).
- Biases have no linear part: the factorisation leaves them out. Under RoPE a key bias adds q_i . R(j - i) b_k to the
  logits, which varies with the key's position, so even it is not softmax-invariant (only a bias on no-position key
  dims would be); a value bias adds o_proj b_v to every output, a constant DeepSeek-V3 (no o_proj bias) cannot hold.
  The refits absorb what a linear map of the layer's input can.

`absorb=False` is the no-absorption baseline: the biases and norms dropped (the norm's weight and RMS not folded),
no refits."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import torch

from ..arch import Feature
from ..errors import SurgeryError
from .factor import SourceAttention


@dataclass
class Extras:
    """One layer's biases (by projection name) and q/k norm weights (None: none), float64."""

    biases: dict[str, torch.Tensor] = field(default_factory=dict)
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    eps: float = 1e-6


class ExtrasReader:
    """Names of every layer's biases and q/k norm weights in a checkpoint, refused in one line where the family has
    none of the features that allow them (or where they sit on o_proj)."""

    def __init__(self, reader, spec, config: dict):
        self.reader, self.spec = reader, spec
        self.eps = float(config.get("rms_norm_eps") or 1e-6)
        features = {t.feature for t in spec.features if t.on(config)}
        self.bias_names: dict[tuple[int, str], str] = {}
        self.norm_names: dict[tuple[int, str], str] = {}
        patterns = {w: re.compile(spec.norm_pattern(w)) for w in "qk"} if Feature.SHARED_QK_NORM in features else {}
        for name in reader.names():
            hit = spec.match(name)
            if hit is not None and hit[2] == "bias":
                layer, proj, _ = hit
                if Feature.QKV_BIAS not in features or proj == spec.o:
                    raise SurgeryError(f"mla cannot convert attention biases ({name}): DeepSeek-V3's projections "
                                       "have none")
                self.bias_names[(layer, proj)] = name
            for which, pattern in patterns.items():
                m = pattern.search(name)
                if m and m.group("param") == "weight":
                    self.norm_names[(int(m.group("layer")), which)] = name

    def skips(self, name: str) -> bool:
        """Whether a tensor is one of these (not copied into the output)."""
        return name in self.bias_names.values() or name in self.norm_names.values()

    @property
    def any(self) -> bool:
        return bool(self.bias_names or self.norm_names)

    def layer(self, i: int, device) -> Extras:
        load = lambda n: self.reader.load(n).to(device, torch.float64)  # noqa: E731
        biases = {proj: load(n) for (layer, proj), n in self.bias_names.items() if layer == i}
        norms = {which: load(n) for (layer, which), n in self.norm_names.items() if layer == i}
        return Extras(biases, norms.get("q"), norms.get("k"), self.eps)


def _normed(w: torch.Tensor, heads: int, d: int, weight: torch.Tensor, sigma: torch.Tensor | None,
            eps: float) -> torch.Tensor:
    """diag(weight) W_h / RMS_h per head (RMS_h at the calibration second moments; 1 without them)."""
    wh = w.reshape(heads, d, -1)
    if sigma is None:
        return w
    ms = torch.einsum("hdi,ij,hdj->h", wh, sigma, wh) / d
    return (weight[None, :, None] * wh / (ms + eps).sqrt()[:, None, None]).reshape(w.shape)


def linearise(src: SourceAttention, extras: Extras, sigma: torch.Tensor | None) -> SourceAttention:
    """The source layer's linear part: q/k norms folded at the calibration RMS (`sigma`, E[x x^T]; None: the norms
    dropped, the baseline), biases left out."""
    q, k = src.q, src.k
    if extras.q_norm is not None:
        q = _normed(q, src.heads, src.head_dim, extras.q_norm, sigma, extras.eps)
    if extras.k_norm is not None:
        k = _normed(k, src.kv_heads, src.head_dim, extras.k_norm, sigma, extras.eps)
    return replace(src, q=q, k=k)


def absorbed_record(extras: ExtrasReader, absorb: bool) -> dict | None:
    """surgery.json's `mla.approximated`: what was absorbed (or dropped, the baseline) and how."""
    if not extras.any:
        return None
    what = [w for w, names in (("q/k/v biases", extras.bias_names), ("q/k norms", extras.norm_names)) if names]
    how = ("absorbed: the factorisation on the linear part (q/k norms at their calibration RMS), the query and output "
           "refits fit the source's logits and attention outputs" if absorb else
           "dropped (no-absorption baseline): no norm folded, no refit")
    return {"terms": what, "method": how}
