"""Activation-aware, RoPE-compatible K/V-head merging (`surgery convert --to mqa|gqa --merge aligned`).

Modules: `capture` (what one layer's attention sees on the calibration tokens; the layers stream from
`surgery.calibration`), `rotary` (RoPE pair layouts), `fit` (key and value merges from second moments), `assign`
(grouping heads by similarity), `layer` (one layer's merge and export), `refit` (least-squares refits of q_proj /
o_proj, summed over chunks), `keyrefit` / `valuerefit` (the optional key and value refits), `shape` (the head
layout the refits share), `pipeline` (the layer loop, chunk by chunk), `convert` (the checkpoint writer).
`surgery compare-merges` is `surgery.commands.compare_merges`.
"""

from .convert import convert_aligned

__all__ = ["convert_aligned"]
