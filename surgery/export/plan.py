"""What `surgery export` writes for a checkpoint: its GGUF architecture, metadata and tensors (each loaded when it is
written), chosen by model_type; and the one-line refusals of whatever no GGUF architecture llama.cpp runs would
compute exactly (custom code, a family or a feature the exporter does not map)."""

from __future__ import annotations

from pathlib import Path

from ..errors import SurgeryError
from .weights import ExportPlan, Weights


SUPPORTED = "llama, mistral, ministral (swa outputs) and deepseek_v3 (MLA outputs)"


def refuse_before_loading(config: dict) -> None:
    """The refusals that need the config alone: custom code, a model_type no module maps."""
    if config.get("auto_map"):
        raise SurgeryError("cannot export a checkpoint with custom code (auto_map in config.json: talking-heads, "
                           "SwitchHead): llama.cpp has no architecture that computes it")
    model_type = config.get("model_type")
    from . import deepseek2, llama

    if model_type in llama.MODEL_TYPES or model_type in deepseek2.MODEL_TYPES:
        return
    if config.get("layer_types") and any(t == "sliding_attention" for t in config["layer_types"]):
        raise SurgeryError(f"cannot export a {model_type} checkpoint with sliding-window layers: no GGUF "
                           f"architecture the exporter writes carries {model_type}'s layer and a per-layer window "
                           f"(llama.cpp's own converter would silently drop the window); exportable: {SUPPORTED}")
    raise SurgeryError(f"cannot export model_type {model_type!r}; exportable: {SUPPORTED}")


def make_plan(folder: Path, config: dict, reader) -> ExportPlan:
    from . import deepseek2, llama

    refuse_before_loading(config)
    module = llama if config["model_type"] in llama.MODEL_TYPES else deepseek2
    return module.plan(config, Weights(reader))
