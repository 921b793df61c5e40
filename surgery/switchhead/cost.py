"""What SwitchHead's calibration (surgery/switchhead/layers.py, calibrate.py, refit.py) costs, counted from the
shapes: its work per decoder layer and the output-expert refit's float64 matrices, for `surgery.estimate`'s
`estimate_calibrated`. The counts:
the source attention over the calibration tokens (eager; statistics; the layer's forward stops after it), the
attention-map Gram, the router fits' normal equations, then the SwitchHead attention on the source attention's calls
(recomputed: the source attention once more) and the output refit's normal equations, then the converted layer's pass
(the next layer's inputs).
"""

from __future__ import annotations

from ..estimate import DEFAULT_WINDOW, Flops, LayerShape, attention_flops, mlp_flops


def switchhead_layer_flops(s: LayerShape, heads: int, experts: int, topk: int, tokens: int,
                           window: int = DEFAULT_WINDOW) -> Flops:
    """Work of one layer of the SwitchHead calibration (statistics pass, router fits, output-expert refit)."""
    f = Flops()
    d, h = s.hidden, s.heads
    # statistics: the source attention (the layer's forward stops after it), values, per-head output energies,
    # attention-map Gram, input moments
    f.float32 += attention_flops(s, tokens, window) + 2 * tokens * d * s.kv_heads * s.head_dim + 4 * tokens * h * s.head_dim**2
    f.float32 += 2 * h * h * tokens * window + 2 * tokens * d * d + 4 * tokens * d * h
    f.float64 += 2 / 3 * d**3 + 4 * d * d * h
    if experts > 1:
        feats = heads * experts * s.head_dim
        # refit on the source attention's calls, recomputed chunk by chunk (the source attention again), the
        # SwitchHead attention, the features' Gram and the solve
        f.float32 += attention_flops(s, tokens, window)
        attention = (2 * tokens * d * heads * s.head_dim * (2 + topk) + 4 * tokens * d * heads * experts
                     + 4 * tokens * window * heads * s.head_dim)
        f.float32 += attention + 2 * tokens * feats * feats + 2 * tokens * d * feats
        f.float64 += 2 / 3 * feats**3 + 2 * feats * feats * d
        # the converted layer's pass that gives the next layer its inputs: the SwitchHead attention again
        f.float32 += attention
    f.float32 += mlp_flops(s, tokens)  # the MLP, once: in that converted pass
    return f


def output_expert_fit_bytes(s: LayerShape) -> int:
    """float64 matrices of an output-expert refit alive at once (not counted by the streaming model): the features'
    Gram and its LU (a copy), the targets' cross products, W; W0 in float32."""
    f, d = s.heads * s.head_dim, s.hidden
    return 8 * (2 * f * f + 2 * d * f) + 4 * d * f
