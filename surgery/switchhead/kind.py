"""switchhead: SwitchHead attention (Csordás et al. 2023): H heads, each with E value and output experts of which k
are selected per token, fitted to the source's attention on calibration text. Ships its own modeling code."""

from __future__ import annotations

from pathlib import Path

from ..errors import SurgeryError
from ..model_types import CONVERTED_PREFIXES
from ..kinds.base import AttentionShape, Kind
from .options import SwitchHeadOptions
from .refusals import REFUSES


class SwitchHead(Kind):
    def calibrates(self, options: SwitchHeadOptions) -> bool:
        return options.experts > 1  # one expert per head is the source's attention: nothing to fit

    def convert(self, source, out: Path, options: SwitchHeadOptions) -> dict:
        from . import convert_to_switchhead

        return convert_to_switchhead(source, out, options)

    def calibration_estimate(self, config: dict, options: SwitchHeadOptions, *, dtype: str, device: str,
                             throughput=None):
        if not self.calibrates(options):
            return None
        from ..estimate import CalibratedCost, estimate_calibrated
        from .cost import output_expert_fit_bytes, switchhead_layer_flops

        cost = CalibratedCost(
            "switchhead",
            lambda s, tokens, window: switchhead_layer_flops(s, options.heads or s.heads, options.experts or 1,
                                                             options.topk or 1, tokens, window),
            lambda s, chunk: output_expert_fit_bytes(s), eager=True,
            extra_memory=lambda s, tokens, window, chunk: switchhead_memory(s, window, chunk, options.heads,
                                                                            options.experts))
        return estimate_calibrated(config, cost, options.calib_tokens, dtype=dtype, device=device,
                                   window=options.calib_window, throughput=throughput, chunk=options.calib_chunk)

    def attention_macs(self, shape: AttentionShape, config: dict, record: dict, context: int) -> dict:
        switchhead = config.get("switchhead") or {}
        experts, topk = (switchhead.get("experts"), switchhead.get("topk")) if isinstance(switchhead, dict) else (None, None)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (experts, topk)):
            raise SurgeryError(f"config.json: switchhead needs positive integer experts and topk, got {switchhead!r}")
        # q and k per head; k of E value and output experts per head; two routers of h*E scores
        L, h, d, H = shape.layers, shape.heads, shape.head_dim, shape.hidden
        return {"proj": L * (2 * H * h * d + 2 * topk * H * h * d + 2 * H * h * experts), "mixing": None}

    def experts(self, config: dict) -> tuple[int | None, int | None]:
        switchhead = config.get("switchhead") if isinstance(config.get("switchhead"), dict) else {}
        return switchhead.get("experts"), switchhead.get("topk")

    def added_parameters(self, record: dict) -> int | None:
        return record.get("added_parameters")


def switchhead_memory(s, window: int, chunk: int, heads: int | None, experts: int | None) -> dict[str, int]:
    """One calibrated layer's memory beyond the streaming model's (surgery/estimate.py's terms), at chunks of
    `chunk` tokens."""
    # eager attention: the scores, the probabilities and the heads' maps reshaped for their Gram are three
    # [chunk, heads, window, window] float32 tensors (the streaming model counts one)
    memory = {"attention maps": 2 * 4 * chunk * s.heads * window}
    # the source attention read again in float32, the new tensors and the SwitchHead module built from them
    h_new, e = heads or s.heads, experts or 1
    new = 2 * h_new * s.head_dim * s.hidden * (1 + e) + 2 * h_new * e * s.hidden
    memory["switchhead tensors"] = 4 * (s.hidden * s.head_dim * (2 * s.heads + 2 * s.kv_heads) + 2 * new)
    return memory



SWITCHHEAD = SwitchHead("switchhead", SwitchHeadOptions,
                        title="SwitchHead attention, σ-MoE V/O projections (Csordás et al. 2023)",
                        tags=["switchhead", "moe"], ships_code=True,
                        model_type_prefix=CONVERTED_PREFIXES["switchhead"], config_key="switchhead",
                        example_options={"heads": 8, "experts": 1, "topk": 1}, refuses=REFUSES)
