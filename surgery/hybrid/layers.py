"""Which layers keep their attention: `--attention-layers` (surgery/layer_choice.py: a count, a list of indices, or
`auto` / `auto:N`, the N layers whose replacement perturbs the residual stream most, scored by calibrate.py)."""

from __future__ import annotations

from ..layer_choice import LayerChoice, evenly_spaced, top_layers

__all__ = ["AttentionLayers", "parse_attention_layers", "evenly_spaced", "top_layers"]


class AttentionLayers(LayerChoice):
    FLAG = "--attention-layers"
    EMPTY = "give 0 to replace every layer"


parse_attention_layers = AttentionLayers.parse
