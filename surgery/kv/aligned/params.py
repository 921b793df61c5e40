"""One layer's attention projections as plain per-head tensors, read from and written back into HF modules.

Every projection is kept in the Linear convention (out_features, in_features) and in float32. When the
projections carry biases, the bias is stored as one extra input column, so `W @ [x; 1]` is the projection:
the merge math then treats weights and biases alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...arch import ArchSpec, QKVLayout
from ...fused_qkv import join_qkv, split_qkv


@dataclass
class AttnParams:
    """q: [H*D, d(+1)], k/v: [KV*D, d(+1)], o: [d, H*D] (+ o_bias [d] or None)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    o_bias: torch.Tensor | None
    qkv_bias: bool  # q/k/v carry a bias column (the last input column)


def _aug(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    w = weight.detach().float()
    return torch.cat([w, bias.detach().float()[:, None]], dim=1) if bias is not None else w.clone()


class LayerAttention:
    """The attention projection modules of one decoder layer, found by the architecture spec's tensor names."""

    def __init__(self, layer: torch.nn.Module, layer_path: str, spec: ArchSpec, layout: QKVLayout,
                 heads: int, kv_heads: int, head_dim: int, conv1d: bool):
        self.layer, self.spec, self.layout = layer, spec, layout
        self.heads, self.kv_heads, self.head_dim, self.conv1d = heads, kv_heads, head_dim, conv1d
        self.modules: dict[str, torch.nn.Module] = {}
        self.paths: dict[str, str] = {}
        for name, _ in layer.named_parameters():
            hit = spec.match(f"{layer_path}.{name}")
            if hit and hit[2] == "weight":
                module_name = name.rsplit(".", 1)[0]
                self.modules[hit[1]] = layer.get_submodule(module_name)
                self.paths[hit[1]] = module_name
        fused = layout != QKVLayout.SEPARATE
        need = [spec.qkv, spec.o] if fused else [spec.q, spec.k, spec.v, spec.o]
        missing = [p for p in need if p not in self.modules]
        if missing:
            raise RuntimeError(f"layer {layer_path}: attention projections {missing} not found")
        self.attention = layer.get_submodule(self.paths[spec.o].rsplit(".", 1)[0]) if "." in self.paths[spec.o] else layer
        self.in_module = self.modules[spec.qkv if fused else spec.q]
        self.out_module = self.modules[spec.o]

    # --- raw weight access in the Linear convention ------------------------------------------------
    def _get(self, proj: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        m = self.modules[proj]
        w = m.weight.t() if self.conv1d else m.weight
        return w, getattr(m, "bias", None)

    def _set(self, proj: str, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        m = self.modules[proj]
        with torch.no_grad():
            m.weight.copy_(weight.t() if self.conv1d else weight)
            if bias is not None:
                m.bias.copy_(bias)

    def read(self) -> AttnParams:
        s = self.spec
        if self.layout == QKVLayout.SEPARATE:
            (qw, qb), (kw, kb), (vw, vb) = self._get(s.q), self._get(s.k), self._get(s.v)
            has_bias = qb is not None or kb is not None or vb is not None
            zeros = lambda w: torch.zeros(w.shape[0], device=w.device)  # noqa: E731
            if has_bias:
                qb, kb, vb = (b if b is not None else zeros(w) for w, b in ((qw, qb), (kw, kb), (vw, vb)))
            q, k, v = _aug(qw, qb), _aug(kw, kb), _aug(vw, vb)
        else:
            w, b = self._get(s.qkv)
            full = _aug(w, b)
            q, k, v = (t.clone() for t in split_qkv(full, self.layout, self.heads, self.kv_heads, self.head_dim))
            has_bias = b is not None
        ow, ob = self._get(s.o)
        return AttnParams(q, k, v, ow.detach().float().clone(), None if ob is None else ob.detach().float().clone(), has_bias)

    def write(self, p: AttnParams) -> None:
        """Write `p` (same head counts as this layer) into the modules."""
        s = self.spec

        def parts(t: torch.Tensor):
            return (t[:, :-1], t[:, -1]) if p.qkv_bias else (t, None)

        if self.layout == QKVLayout.SEPARATE:
            for proj, t in ((s.q, p.q), (s.k, p.k), (s.v, p.v)):
                w, b = parts(t)
                if b is not None and getattr(self.modules[proj], "bias", None) is None:
                    if b.abs().max() > 0:
                        raise RuntimeError(f"{proj}: a bias appeared where the architecture has none")
                    b = None
                self._set(proj, w, b)
        else:
            w, b = parts(join_qkv(p.q, p.k, p.v, self.layout, self.head_dim))
            self._set(s.qkv, w, b)
        self._set(s.o, p.o, p.o_bias)
