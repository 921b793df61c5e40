"""What `surgery export` writes for a checkpoint: its GGUF architecture, metadata and tensors (each loaded when it is
written), chosen by model_type; and the one-line refusals of whatever no GGUF architecture llama.cpp runs would
compute exactly (custom code, a family or a feature the exporter does not map)."""

from __future__ import annotations

from pathlib import Path

from ..errors import SurgeryError
from .weights import ExportPlan, Weights


SUPPORTED = (
    "llama, mistral, qwen2, qwen3, ministral (swa outputs), deepseek_v3 (MLA outputs) and bamba (hybrid outputs)")


def module_for(model_type: str | None):
    """The architecture module that maps `model_type`, or None."""
    from . import deepseek2, granitehybrid, llama, qwen

    return next((m for m in (llama, qwen, deepseek2, granitehybrid) if model_type in m.MODEL_TYPES), None)


def refuse_before_loading(config: dict) -> None:
    """The refusals that need the config alone: custom code, a model_type no module maps, and, for a module that has
    `refuse_before_loading` (qwen), what it refuses from the config (the others refuse what their GGUF architecture
    would compute otherwise when they plan, before any tensor is read)."""
    if config.get("auto_map"):
        raise SurgeryError("cannot export a checkpoint with custom code (auto_map in config.json: talking-heads, "
                           "SwitchHead): llama.cpp has no architecture that computes it")
    model_type = config.get("model_type")
    module = module_for(model_type)
    if module is not None:
        if hasattr(module, "refuse_before_loading"):
            module.refuse_before_loading(config)
        return
    if config.get("layer_types") and any(t == "sliding_attention" for t in config["layer_types"]):
        raise SurgeryError(f"cannot export a {model_type} checkpoint with sliding-window layers: no GGUF "
                           f"architecture the exporter writes carries {model_type}'s layer and a per-layer window "
                           f"(llama.cpp's own converter would silently drop the window); exportable: {SUPPORTED}")
    raise SurgeryError(f"cannot export model_type {model_type!r}; exportable: {SUPPORTED}")


def make_plan(folder: Path, config: dict, reader) -> ExportPlan:
    refuse_before_loading(config)
    return module_for(config["model_type"]).plan(config, Weights(reader))
