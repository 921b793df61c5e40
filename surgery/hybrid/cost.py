"""The hybrid conversion's cost model for the dry run (surgery/estimate.py): per layer, the source layer once over
the calibration tokens; its captured activations (the normed input, the attention's output before and after o_proj,
the residual, the mixer's normed output) held for the layer; the initialised mixer once over them (its projections
and the chunked scan: within-chunk products over Bamba's 256-token chunks, the state passed between chunks), whose
normed output the norm weight's least-squares fit reads (and `auto` scores)."""

from __future__ import annotations

CHUNK = 256  # Bamba's mamba_chunk_size


def hybrid_cost():
    from ..estimate import CalibratedCost, Flops, attention_flops, mlp_flops

    def mixer_flops(s, tokens: int) -> float:
        inner = s.heads * s.head_dim
        proj = 2 * tokens * s.hidden * (3 * inner + 2 * inner + s.heads) + 2 * tokens * inner * s.hidden
        scan = 2 * tokens * CHUNK * s.heads * 2 * s.head_dim + 4 * tokens * s.heads * s.head_dim * s.head_dim
        return proj + scan

    def flops(s, tokens, window):
        return Flops(attention_flops(s, tokens, window) + mlp_flops(s, tokens) + mixer_flops(s, tokens))

    def captured(s, tokens, window, chunk):
        # the normed input, the attention's output before and after o_proj, the residual; the mixer's normed output
        return {"captured activations (float32)": 4 * tokens * (3 * s.hidden + 2 * s.heads * s.head_dim)}

    return CalibratedCost("hybrid", flops, lambda s, chunk: 0, extra_memory=captured)  # the dry run's "kind"
