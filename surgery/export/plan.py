"""What `surgery export` writes for a checkpoint: its GGUF architecture, metadata and tensors (each loaded when it is
written), chosen by model_type; and the one-line refusals of whatever no GGUF architecture llama.cpp runs would
compute exactly (custom code, a family or a feature the exporter does not map)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import SurgeryError
from .gguf_file import GGUFTensor


@dataclass
class ExportPlan:
    arch: str
    keys: dict[str, Any]
    tensors: list[GGUFTensor]
    what: str  # one phrase for the command's line: the architecture and what carries the kind


class Weights:
    """The checkpoint's tensors by name, read lazily (one at a time, as float32 numpy arrays): the plans name each
    tensor they use, and a tensor no plan used is refused (a bias, an extra norm: a file without it would compute
    something else)."""

    def __init__(self, reader):
        self.reader = reader
        self.used: set[str] = set()

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.reader:
            raise SurgeryError(f"the checkpoint has no tensor {name}: not the layout its config.json describes")
        return tuple(self.reader.tensors[name].shape)

    def load(self, name: str) -> np.ndarray:
        return self.reader.load(name).float().numpy()

    def tensor(self, gguf_name: str, name: str, transform: Callable[[np.ndarray], np.ndarray] | None = None,
               shape: tuple[int, ...] | None = None) -> GGUFTensor:
        """GGUF tensor `gguf_name` from the checkpoint's `name` (through `transform`, which keeps the shape unless
        `shape` says otherwise)."""
        source_shape = self.shape(name)
        self.used.add(name)
        load = (lambda: self.load(name)) if transform is None else (lambda: transform(self.load(name)))
        return GGUFTensor(gguf_name, tuple(shape or source_shape), load)

    def skip(self, name: str) -> None:
        """A tensor the file does not need (a tied lm_head.weight)."""
        self.used.add(name)

    def check_all_used(self, family: str) -> None:
        left = sorted(set(self.reader.names()) - self.used)
        if left:
            more = f" and {len(left) - 1} more" if len(left) > 1 else ""
            raise SurgeryError(f"cannot export this {family} checkpoint: it holds {left[0]}{more}, which the "
                               f"exporter does not map (a file without it would compute something else)")


def rope_theta(config: dict) -> float:
    """The RoPE base of a config with plain RoPE; refuses scaled RoPE (llama3, yarn, ...), which is not mapped."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind != "default":
        raise SurgeryError(f"cannot export a checkpoint with {kind!r} RoPE scaling: the exporter writes plain RoPE only")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise SurgeryError("cannot export a checkpoint with partial rotary embeddings")
    return float(params.get("rope_theta") or config.get("rope_theta") or 10000.0)


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
