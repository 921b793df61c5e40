"""Activation-aware, RoPE-compatible K/V-head merging (`surgery convert --to mqa|gqa --merge aligned`).

Modules: `fit` (key and value merges from second moments), `grams` (the heads' second moments), `assign` (grouping
heads by similarity), `params` (a layer's attention weights), `layer` (one layer's merge and export), `keyrefit` /
`valuerefit` (the optional key and value refits), `pipeline` (the layer loop, chunk by chunk), `convert` (the
checkpoint writer). What they share with the other calibrated conversions lives outside this package:
`surgery.calibration.capture` (what one layer's attention sees on the calibration tokens) and `surgery.fitting`
(RoPE pair layouts, the head layout of the refits, the least-squares refits of q_proj / o_proj).
`surgery compare-merges` is `surgery.commands.compare_merges`.
"""

from .convert import convert_aligned

__all__ = ["convert_aligned"]
