"""swa: sliding-window attention on most layers, global attention on the others, written as a standard checkpoint
(per-layer `layer_types` and `sliding_window`: ministral for Llama/Mistral bodies, the source's own type for Qwen2,
Qwen3, SmolLM3 and Gemma 2) that transformers and vLLM load with no custom code. The conversion code is
surgery/swa/."""

from __future__ import annotations

from pathlib import Path

from ..kinds.base import Kind
from .options import SWAOptions
from .refusals import REFUSES


class SWA(Kind):
    def calibrates(self, options: SWAOptions) -> bool:
        return options.parsed_global_layers.auto

    def convert(self, source, out: Path, options: SWAOptions) -> dict:
        from . import convert_to_swa

        return convert_to_swa(source, out, options)

    def calibration_estimate(self, config: dict, options: SWAOptions, *, dtype: str, device: str, throughput=None):
        from ..estimate import estimate_calibrated
        from .convert import AUTO_WINDOWS
        from .cost import swa_cost

        spec = options.parsed_global_layers
        count = spec.resolve_count(int(config["num_hidden_layers"]))
        window = min(AUTO_WINDOWS * options.window, int(config.get("max_position_embeddings") or 1 << 30))
        return estimate_calibrated(config, swa_cost(config, options.layer_score, count), options.calib_tokens,
                                   dtype=dtype, device=device, window=window, throughput=throughput,
                                   chunk=options.calib_chunk)

    def summary(self, record: dict, options: SWAOptions) -> str:
        s = record["swa"]
        return (f"swa (window {s['window']}, {len(s['global_layers'])} of {s['layers']} layers global: "
                f"{','.join(map(str, s['global_layers'])) or 'none'}{', sinks' if s.get('sinks') else ''}) in "
                f"{record['seconds']:.1f}s"
                f"{'' if s.get('target_model_type') in ('ministral', 'granite_swa') else '; ' + llama_cpp_note(s)}")

    def card_lines(self, record: dict) -> list[str]:
        s = record.get("swa") or {}
        if not s:
            return []
        if "scores" not in s:
            how = f"as asked ({s.get('asked')})"
        elif s.get("layer_score") == "cost":
            how = ("chosen by what windowing each costs on retrieval examples built from calibration text (the "
                   "answers' log-probability and the text's likelihood beyond the window)")
        else:
            how = "chosen by their attention mass beyond the window on calibration text"
        lines = [f"Sliding-window attention of {s['window']} tokens on every layer but {s['global_layers']}, {how}."]
        if s.get("sinks"):
            lines.append(f"Every head has a learnable attention sink (granite_swa), written at {s['sinks']['init']} "
                         "(no weight: the source's function until uptraining moves it).")
        return lines + [llama_cpp_note(s)[0].upper() + llama_cpp_note(s)[1:] + "."]


def llama_cpp_note(s: dict) -> str:
    """What llama.cpp does with an swa output of this model type (surgery/runs_in.py's table, issue 54)."""
    from ..runs_in import swa_llama_cpp_note

    return swa_llama_cpp_note(s.get("target_model_type"))


SWA_KIND = SWA("swa", SWAOptions, title="sliding-window / global hybrid attention", tags=["sliding-window-attention"],
               refuses=REFUSES, example_options={"window": 4, "global_layers": "1"},
               help="swa copies the weights unchanged and writes per-layer attention types: a standard checkpoint "
                    "(ministral for Llama/Mistral bodies, the source's own type for Qwen2/Qwen3/SmolLM3/Gemma 2).")
