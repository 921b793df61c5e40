"""hybrid: the kind, its rules and cost model (registered in surgery/kinds/__init__.py); its options model is
surgery/hybrid/options.py. The conversion code is the rest of this package."""

from __future__ import annotations

from pathlib import Path

from ..arch import Feature
from ..kinds.base import AttentionShape, Kind
from .family import verdict_text
from .options import HybridOptions

ENCODERS = "encoders are not decoders: a Mamba-2 mixer is causal"


class Hybrid(Kind):
    def calibrates(self, options: HybridOptions) -> bool:
        return True  # the mixers' statistics (and `auto`'s scores) come from calibration text

    def convert(self, source, out: Path, options: HybridOptions) -> dict:
        from .convert import convert_to_hybrid

        return convert_to_hybrid(source, out, options)

    def calibration_estimate(self, config: dict, options: HybridOptions, *, dtype: str, device: str, throughput=None):
        from ..estimate import estimate_calibrated
        from .cost import hybrid_cost

        return estimate_calibrated(config, hybrid_cost(), options.calib_tokens,
                                   dtype=dtype, device=device, window=options.calib_window, throughput=throughput,
                                   chunk=options.calib_chunk)

    def summary(self, record: dict, options: HybridOptions) -> str:
        h = record["hybrid"]
        return (f"hybrid (bamba: {len(h['attention_layers'])} of {h['layers']} layers keep attention: "
                f"{','.join(map(str, h['attention_layers'])) or 'none'}; the others Mamba-2 mixers) in "
                f"{record['seconds']:.1f}s")

    def kv_cache_values(self, shape: AttentionShape, config: dict, context: int | None = None) -> dict[str, int]:
        """K/V per token of the attention layers only; the mixers' state does not grow with the context (see
        state_values)."""
        kept = len(config.get("attn_layer_indices") or [])
        n = 2 * kept * shape.kv_heads * shape.head_dim
        return {"transformers": n, "vllm": n, "llama.cpp": n}

    def attention_layers(self, shape: AttentionShape, config: dict) -> int:
        return len(config.get("attn_layer_indices") or [])

    def state_values(self, config: dict) -> int:
        return state_values(config)

    def attention_macs(self, shape: AttentionShape, config: dict, record: dict, context: int) -> dict:
        """Per token: the kept layers' q/k/v/o and the mixers' in/out projections ("proj"); the mixers' state update
        and readout and their convolution ("mixing")."""
        H, h, kv, d = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim
        kept = self.attention_layers(shape, config)
        mixers = shape.layers - kept
        heads, d_head, d_state = (int(config.get(k) or 0) for k in ("mamba_n_heads", "mamba_d_head", "mamba_d_state"))
        groups, conv = int(config.get("mamba_n_groups") or 1), int(config.get("mamba_d_conv") or 4)
        inner, conv_dim = heads * d_head, heads * d_head + 2 * groups * d_state
        mixer_proj = H * (inner + conv_dim + heads) + inner * H
        return {"proj": kept * (H * h * d + 2 * H * kv * d + h * d * H) + mixers * mixer_proj,
                "mixing": mixers * (2 * heads * d_head * d_state + conv_dim * conv)}

    def card_lines(self, record: dict) -> list[str]:
        h = record.get("hybrid") or {}
        if not h:
            return []
        how = "chosen by how far replacing each moves the residual stream on calibration text" \
            if "scores" in h else f"as asked ({h.get('asked')})"
        return [f"Layers {h['attention_layers']} keep attention, {how}; the other {len(h['mixer_layers'])} are "
                "Mamba-2 mixers initialised from their attention (Q->C, K->B, V->x, O->out_proj), written as a "
                "standard Bamba checkpoint. Untrained mixers: uptrain before use."]


def state_values(config: dict) -> int:
    """Values each mixer layer keeps whatever the context (SSM state + convolution window), all mixers together."""
    layers = int(config.get("num_hidden_layers") or 0)
    mixers = layers - len(config.get("attn_layer_indices") or [])
    heads, d_head, d_state = (int(config.get(k) or 0) for k in ("mamba_n_heads", "mamba_d_head", "mamba_d_state"))
    groups, conv = int(config.get("mamba_n_groups") or 1), int(config.get("mamba_d_conv") or 4)
    conv_dim = heads * d_head + 2 * groups * d_state
    return mixers * (heads * d_head * d_state + conv_dim * (conv - 1))


HYBRID_KIND = Hybrid("hybrid", HybridOptions, title="hybrid attention / Mamba-2 (Bamba)", tags=["mamba2", "hybrid"],
                     refuses={Feature.ENCODER: ENCODERS, Feature.BODY: "{detail}: Bamba's layer is Llama's"},
                     example_options={"attention_layers": "1"}, verdict=verdict_text,
                     help="hybrid keeps attention on some layers and replaces the others by Mamba-2 mixers "
                          "initialised from it, written as a standard Bamba checkpoint.")
