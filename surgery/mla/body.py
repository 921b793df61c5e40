"""A family's body rewritten as Llama's, exactly, for DeepSeek-V3's layer (the family spec's `folds`, `splits`,
`softmax_scale_key`, `no_rope_key`: surgery/arch.py): weights scaled or shifted by config values (Gemma's (1 + w)
RMSNorms and embedding multiplier, Granite's embedding / residual / logit multipliers), fused tensors split (Phi-3's
gate_up_proj), the source's softmax scale (Granite's attention_multiplier) and which layers rotate (SmolLM3); and
the residual stream rescaled so that DeepSeek-V3's one rms_norm_eps computes the source's norms.

Each output tensor is rewritten on its own when the writer asks for it (one tensor alive), in float64."""

from __future__ import annotations

import re

import torch

from ..checkpoint.tensors import PlannedTensor
from ..errors import SurgeryError


RESIDUAL_WRITES = r"(?:embed_tokens|self_attn\.o_proj|mlp\.down_proj)\.weight$"  # what writes the residual stream


class BodyRewrite:
    """The folds and splits of one family with one config."""

    def __init__(self, spec, config: dict, eps: float | None = None):
        self.spec, self.config = spec, config
        self.folds = [(re.compile(f.pattern), f.factor(config), f.shift) for f in spec.folds]
        source_eps = float(config.get("rms_norm_eps") or 1e-6)
        if eps is not None and source_eps != eps:
            # DeepSeek-V3's one rms_norm_eps (`eps`) for every RMSNorm: the residual stream scaled by c, c^2 = eps /
            # the source's, makes each norm compute the source's (RMSNorm(c x; c^2 e) = RMSNorm(x; e)); c enters
            # at the embedding and at every write to the stream (o_proj, down_proj), the norms' outputs unchanged
            c = (eps / source_eps) ** 0.5
            self.folds.append((re.compile(RESIDUAL_WRITES), c, 0.0))
        self.residual_scale = (eps / source_eps) ** 0.5 if eps is not None else 1.0
        self.splits = [(re.compile(s.pattern), s) for s in spec.splits]

    def source_scaling(self, head_dim: int) -> float:
        """The source's softmax scale (its config key, or head_dim^-0.5)."""
        key = self.spec.softmax_scale_key
        return float(self.spec.count(self.config, key)) if key else head_dim ** -0.5

    def rotates(self, layer: int) -> bool:
        """Whether the source's layer applies RoPE (SmolLM3's no_rope_layers: 0 = no RoPE)."""
        key = self.spec.no_rope_key
        flags = self.config.get(key) if key else None
        if not flags:
            return True
        if layer >= len(flags):
            raise SurgeryError(f"config.json's {key} has {len(flags)} entries for more layers")
        return bool(flags[layer])

    def split(self, name: str) -> list[tuple[str, int, int]] | None:
        """(output name, part, parts) of a fused tensor, None for any other."""
        for pattern, s in self.splits:
            if pattern.search(name):
                return [(name.replace(s.fused, part), i, len(s.parts)) for i, part in enumerate(s.parts)]
        return None

    def folded(self, planned: PlannedTensor) -> PlannedTensor:
        """The planned tensor with every fold matching its (output) name applied."""
        hits = [(scale, shift) for pattern, scale, shift in self.folds if pattern.search(planned.name)]
        if not hits:
            return planned
        produce = planned.produce
        if produce is None:  # a byte-for-byte copy: read it, then fold
            reader, name = planned.raw_source
            produce = lambda: reader.load(name)  # noqa: E731

        def fold(produce=produce, dtype=planned.dtype):
            w = produce().double()
            for scale, shift in hits:
                w = w * scale + shift
            return w.to(dtype).contiguous()

        return PlannedTensor(planned.name, planned.dtype, planned.shape, produce=fold)
