"""mla: DeepSeek's multi-head latent attention (DeepSeek-V2/V3) from a Llama-like checkpoint, written as a plain
`deepseek_v3` checkpoint (transformers, vLLM and llama.cpp load it with no custom code). The conversion code is
surgery/mla/."""

from __future__ import annotations

from pathlib import Path

from ..kinds.base import AttentionShape, Kind
from .families import verdict_text
from .options import MLAOptions
from .refusals import REFUSES


class MLA(Kind):
    def calibrates(self, options: MLAOptions) -> bool:
        return True  # the latent, the shared rope key and the kept frequencies are weighted by the activations

    def convert(self, source, out: Path, options: MLAOptions) -> dict:
        from . import convert_to_mla

        return convert_to_mla(source, out, options)

    def calibration_estimate(self, config: dict, options: MLAOptions, *, dtype: str, device: str, throughput=None):
        from ..estimate import estimate_calibrated
        from .cost import mla_cost

        cost = mla_cost(config, options.kv_rank, options.rope_dim, options.query_samples)
        return estimate_calibrated(config, cost, options.calib_tokens, dtype=dtype, device=device,
                                   window=options.calib_window, throughput=throughput, chunk=options.calib_chunk)

    def summary(self, record: dict, options: MLAOptions) -> str:
        m = record["mla"]
        return (f"mla (latent rank {m['kv_lora_rank']} + rope key {m['qk_rope_head_dim']} per layer) "
                f"in {record['seconds']:.1f}s")

    def kv_cache_values(self, shape: AttentionShape, config: dict, context: int | None = None) -> dict[str, int]:
        """vLLM and llama.cpp cache the latent and the rope key; transformers' DeepseekV3Attention (5.x) caches them
        too (after kv_a_layernorm and the rotation, before kv_b_proj expands them)."""
        n = shape.layers * (int(config["kv_lora_rank"]) + int(config["qk_rope_head_dim"]))
        return {"transformers": n, "vllm": n, "llama.cpp": n}

    def attention_macs(self, shape: AttentionShape, config: dict, record: dict, context: int) -> dict:
        L, h, H = shape.layers, shape.heads, shape.hidden
        r, rope = int(config["kv_lora_rank"]), int(config["qk_rope_head_dim"])
        nope, v = int(config["qk_nope_head_dim"]), int(config["v_head_dim"])
        return {"proj": L * (H * h * (nope + rope) + H * (r + rope) + r * h * (nope + v) + h * v * H), "mixing": None}

    def check_checkpoint(self, config: dict, shapes: dict[str, tuple[int, ...]]) -> None:
        from .validate import check_mla

        check_mla(config, shapes)

    def training_form(self, model):
        """The latent rows at the rope rows' scale and kv_a_layernorm's epsilon divided to match: the same function,
        trainable (surgery/mla/training.py)."""
        from .training import LatentScale

        return LatentScale.apply(model)

    def card_lines(self, record: dict) -> list[str]:
        m = record.get("mla") or {}
        if not m:
            return []
        return [f"Latent rank {m['kv_lora_rank']} (of {m['full_rank']}), rope key {m['qk_rope_head_dim']} dims "
                f"(source frequencies {m['rope_frequencies']}).",
                "K-nope and V factored jointly through the latent, weighted by the calibration activations; one "
                "shared rope key per layer (the K/V heads' principal direction per frequency)."] + _family_lines(m)


def _family_lines(m: dict) -> list[str]:
    """The card's words for the family's verdict and, when approximate, what was absorbed and how well."""
    family = m.get("family") or {}
    lines = [f"Source family: {family['verdict']} ({family.get('reason', 'Llama-like layer')})."] if family else []
    absorption = m.get("absorption")
    if absorption:
        res = absorption["relative_residual"]
        drop = absorption["relative_residual_dropped"]
        lines.append(f"Absorbed {' and '.join(absorption['terms'])}: {absorption['method']}; relative residual of "
                     "the q/k/v projections " + ", ".join(f"{p} {res[p]:.2e} (dropped: {drop[p]:.2e})" for p in res)
                     + f". {absorption['runtimes']}; measure the rest with `surgery check`.")
    return lines


MLA_KIND = MLA("mla", MLAOptions, title="multi-head latent attention (DeepSeek-V3 MLA)", tags=["mla", "deepseek_v3"],
               config_key="kv_lora_rank", example_options={"kv_rank": 32, "calib_tokens": 512},
               refuses=REFUSES, verdict=verdict_text,
               help="mla writes a plain deepseek_v3 checkpoint (a low-rank latent K/V and one shared rope key, fitted "
                    "layer by layer on calibration text) that transformers, vLLM and llama.cpp load as they are.")
