"""Which layers keep global attention: `--global-layers` (surgery/layer_choice.py: a count, a list of indices, or
`auto` / `auto:N`, the N layers that lose most when windowed), and the per-layer types it writes."""

from __future__ import annotations

from ..layer_choice import LayerChoice, evenly_spaced, top_layers

SLIDING, FULL = "sliding_attention", "full_attention"

__all__ = ["GlobalLayers", "parse_global_layers", "evenly_spaced", "top_layers", "layer_types"]


class GlobalLayers(LayerChoice):
    FLAG = "--global-layers"
    EMPTY = "give 0 for no global layer"


parse_global_layers = GlobalLayers.parse


def layer_types(layers: int, global_indices: list[int]) -> list[str]:
    keep = set(global_indices)
    return [FULL if i in keep else SLIDING for i in range(layers)]
