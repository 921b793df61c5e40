"""What the architecture modules share: the plan of one GGUF file (its architecture, metadata and tensors), the
checkpoint's tensors, read lazily, each one a plan uses named (a tensor no plan names is refused), and what they read
alike from a config (RoPE base, attention sizes, the SiLU-gated MLP's refusal, the body's metadata keys)."""

from __future__ import annotations

from dataclasses import dataclass
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
               shape: tuple[int, ...] | None = None, f32: bool = False) -> GGUFTensor:
        """GGUF tensor `gguf_name` from the checkpoint's `name` (through `transform`, which keeps the shape unless
        `shape` says otherwise; stored as f32 whatever the dtype where `f32`)."""
        source_shape = self.shape(name)
        self.used.add(name)
        load = (lambda: self.load(name)) if transform is None else (lambda: transform(self.load(name)))
        return GGUFTensor(gguf_name, tuple(shape or source_shape), load, f32=f32)

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


def attention_sizes(config: dict) -> tuple[int, int, int, int]:
    """(layers, query heads, K/V heads, head_dim) of a Llama-style attention config: K/V heads default to the query
    heads, head_dim to hidden_size / heads."""
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    return layers, heads, kv_heads, config.get("head_dim") or config["hidden_size"] // heads


def activation_refusal(config: dict, layer: str) -> str | None:
    """Why llama.cpp's SiLU-gated `layer` ("Llama layer", ...) would compute something else than this config's MLP
    (another hidden_act), or None."""
    act = config.get("hidden_act", "silu")
    return None if act == "silu" else f"hidden_act {act!r} (llama.cpp's {layer} is SiLU-gated)"


def body_keys(arch: str, config: dict, head_count_kv: int) -> dict:
    """The metadata every decoder-only arch written here shares: context, widths, layer and head counts."""
    return {
        f"{arch}.context_length": int(config.get("max_position_embeddings") or 4096),
        f"{arch}.embedding_length": config["hidden_size"],
        f"{arch}.block_count": config["num_hidden_layers"],
        f"{arch}.feed_forward_length": config["intermediate_size"],
        f"{arch}.attention.head_count": config["num_attention_heads"],
        f"{arch}.attention.head_count_kv": head_count_kv,
    }


def llama_attention_keys(arch: str, config: dict, head_count_kv: int, head_dim: int, eps_default: float) -> dict:
    """body_keys and the keys of Llama's attention layer (full-width RoPE, RMS norm), which the llama-bodied archs
    (llama, granite_swa, granitehybrid) share; `eps_default`: the model type's rms_norm_eps default."""
    return body_keys(arch, config, head_count_kv) | {
        f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.value_length": head_dim,
        f"{arch}.rope.dimension_count": head_dim,
        f"{arch}.rope.freq_base": rope_theta(config),
        f"{arch}.attention.layer_norm_rms_epsilon": float(config.get("rms_norm_eps", eps_default)),
        f"{arch}.vocab_size": config["vocab_size"],
    }
