"""What `surgery export` writes for a checkpoint: its GGUF architecture, metadata and tensors (each loaded when it is
written), chosen by model_type; and the one-line refusals of whatever no GGUF architecture llama.cpp runs would
compute exactly (custom code, a family or a feature the exporter does not map)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Callable

from ..errors import SurgeryError
from .weights import ExportPlan, Weights


SUPPORTED = (
    "llama, mistral, qwen2, qwen3, ministral (swa outputs), deepseek_v3 (MLA outputs) and bamba (hybrid outputs)")


def _architectures() -> tuple[tuple[ModuleType, Callable[[dict], None] | None], ...]:
    """The architecture modules, in the order they are asked for a model_type, each beside the refusal it makes from
    the config alone, before the checkpoint is opened (qwen: a sliding window that bites, scaled RoPE, another
    activation, Qwen3's attention_bias), or None where the module refuses what its GGUF architecture would compute
    otherwise when it plans, before any tensor is read."""
    from . import deepseek2, granitehybrid, llama, qwen

    return ((llama, None), (qwen, qwen.refuse_before_loading), (deepseek2, None), (granitehybrid, None))


def _architecture_for(model_type: str | None) -> tuple[ModuleType | None, Callable[[dict], None] | None]:
    """(the module that maps `model_type`, its refusal before loading), or (None, None)."""
    return next(((m, refuse) for m, refuse in _architectures() if model_type in m.MODEL_TYPES), (None, None))


def module_for(model_type: str | None) -> ModuleType | None:
    """The architecture module that maps `model_type`, or None."""
    return _architecture_for(model_type)[0]


def refuse_before_loading(config: dict) -> None:
    """The refusals that need the config alone: custom code, a model_type no module maps, and what the module's
    refusal before loading (_architectures) refuses."""
    if config.get("auto_map"):
        raise SurgeryError("cannot export a checkpoint with custom code (auto_map in config.json: talking-heads, "
                           "SwitchHead): llama.cpp has no architecture that computes it")
    model_type = config.get("model_type")
    module, refuse = _architecture_for(model_type)
    if module is not None:
        if refuse is not None:
            refuse(config)
        return
    if config.get("layer_types") and any(t == "sliding_attention" for t in config["layer_types"]):
        raise SurgeryError(f"cannot export a {model_type} checkpoint with sliding-window layers: no GGUF "
                           f"architecture the exporter writes carries {model_type}'s layer and a per-layer window "
                           f"(llama.cpp's own converter would silently drop the window); exportable: {SUPPORTED}")
    raise SurgeryError(f"cannot export model_type {model_type!r}; exportable: {SUPPORTED}")


def make_plan(folder: Path, config: dict, reader) -> ExportPlan:
    refuse_before_loading(config)
    return module_for(config["model_type"]).plan(config, Weights(reader))
