"""Talking-heads conversion as file-level surgery: every source tensor is kept (copied byte for byte), and each
self-attention layer gets `talking_heads.logits_mix` (h_k x h) and/or `talking_heads.weights_mix` (h x h_v).

The model is never instantiated: the plan comes from config.json and the safetensors headers. The output folder
carries its own modeling code (`configuration_talking_heads.py`, `modeling_talking_heads.py`, wired through
`auto_map`), so it loads with `trust_remote_code=True` where this toolkit is not installed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..checkpoint.writer import write_conversion
from ..errors import SurgeryError
from ..arch import attention_shape
from ..checkpoint.source import Source
from ..checkpoint.tensors import CheckpointReader, DTYPES, PlannedTensor
from .families import Family, family_for

if TYPE_CHECKING:
    from .options import TalkingHeadsOptions

CODE_FILES = ("configuration_talking_heads.py", "modeling_talking_heads.py")
INIT_NOTE = (
    "overlap init: P_l[j, i] = dims shared by query-key head j and source head i / size of head j; "
    "P_w[i, j] = dims shared by source head i and value head j / size of head j. Identity when h_k = h_v = h; "
    "exact (to float rounding) whenever h_k and h_v are multiples of h (sub-heads sum back to the source logit "
    "and copy its weights); fewer, wider heads get the mean of the source heads they span and are not exact."
)


@dataclass(frozen=True)
class TalkingHeadsShape:
    layers: int
    heads: int  # h, the source's query heads (= softmax heads)
    kv_heads: int
    head_dim: int
    heads_logits: int  # h_k
    heads_weights: int  # h_v
    logits_mixing: bool
    weights_mixing: bool

    @property
    def width(self) -> int:
        return self.heads * self.head_dim

    @property
    def exact(self) -> bool:
        return self.heads_logits % self.heads == 0 and self.heads_weights % self.heads == 0

    @property
    def params_per_layer(self) -> int:
        return self.logits_mixing * self.heads_logits * self.heads + self.weights_mixing * self.heads * self.heads_weights

    @property
    def mix_macs_per_query_key(self) -> int:
        """The paper's extra multiply-adds per (query, key) pair and layer: h_k*h + h*h_v."""
        return self.params_per_layer


def _head_count(option: str, value: int | None, mixing: bool, flag: str, heads: int, head_dim: int) -> int:
    width = heads * head_dim
    if value is None:
        return heads
    if not mixing and value != heads:
        raise SurgeryError(f"{option} {value} needs {flag}: without that mixing the count stays the source's h={heads}")
    if value < 1 or width % value:
        exact = ", ".join(str(m) for m in range(heads, width + 1, heads) if width % m == 0)
        raise SurgeryError(
            f"{option} {value} must divide the attention width h*d = {heads}*{head_dim} = {width} "
            f"(the heads are re-partitions of it); multiples of h that keep the model exact: {exact}"
        )
    return value


def talking_heads_shape(config: dict, logits_mixing: bool, weights_mixing: bool, heads_logits: int | None,
                        heads_weights: int | None) -> TalkingHeadsShape:
    try:
        a = attention_shape(config)
    except (KeyError, TypeError, ValueError) as e:
        raise SurgeryError(f"config.json lacks a usable head count ({e})") from None
    h, d = a["heads"], a["head_dim"]
    return TalkingHeadsShape(
        layers=a["layers"], heads=h, kv_heads=a["kv_heads"], head_dim=d,
        heads_logits=_head_count("--heads-logits", heads_logits, logits_mixing, "--logits-mixing", h, d),
        heads_weights=_head_count("--heads-weights", heads_weights, weights_mixing, "--weights-mixing", h, d),
        logits_mixing=logits_mixing, weights_mixing=weights_mixing,
    )


def attention_modules(reader: CheckpointReader, family: Family, shape: TalkingHeadsShape) -> dict[int, str]:
    """Layer index -> name of its self-attention module in the checkpoint (the new tensors' prefix)."""
    modules: dict[int, str] = {}
    for name in reader.names():
        hit = family.match(name)
        if hit is None:
            continue
        module, layer = hit
        rows = reader.tensors[name].shape
        spec = family.spec
        expected = shape.width + 2 * shape.kv_heads * shape.head_dim if spec.fused else shape.width
        size = rows[-1] if spec.conv1d else rows[0]  # a Conv1D stores (in, out)
        if size != expected:
            raise SurgeryError(f"tensor {name} of shape {list(rows)} does not match config.json "
                               f"({shape.heads} heads of {shape.head_dim})")
        modules[layer] = module
    if set(modules) != set(range(shape.layers)):
        missing = sorted(set(range(shape.layers)) - set(modules))
        raise SurgeryError(
            f"checkpoint does not match config.json: self-attention tensors missing for layer(s) {missing[:8]}"
            if missing else f"checkpoint has self-attention tensors for layers beyond config.json's {shape.layers}"
        )
    return modules


def plan_tensors(reader: CheckpointReader, modules: dict[int, str], shape: TalkingHeadsShape,
                 out_dtype: torch.dtype | None) -> list[PlannedTensor]:
    # The initial values come from the modeling code itself (imported here: it loads every model class).
    from .modeling_talking_heads import initial_logits_mix, initial_weights_mix

    planned = []
    for name in reader.names():
        info = reader.tensors[name]
        dtype = out_dtype if (out_dtype and info.dtype.is_floating_point) else info.dtype
        if dtype == info.dtype and not reader.is_pickle:
            planned.append(PlannedTensor(name, dtype, info.shape, raw_source=(reader, name)))
        else:
            planned.append(PlannedTensor(name, dtype, info.shape, produce=_loader(reader, name, dtype)))
    h, d = shape.heads, shape.head_dim
    for layer, module in sorted(modules.items()):
        # The mixing matrices take the dtype of the layer's projections (the model's dtype once converted).
        dtype = out_dtype or _query_dtype(reader, module)
        if shape.logits_mixing:
            value = initial_logits_mix(h, shape.heads_logits, d).to(dtype)
            planned.append(PlannedTensor(f"{module}.talking_heads.logits_mix", dtype, tuple(value.shape),
                                         produce=lambda v=value: v))
        if shape.weights_mixing:
            value = initial_weights_mix(h, shape.heads_weights, d).to(dtype)
            planned.append(PlannedTensor(f"{module}.talking_heads.weights_mix", dtype, tuple(value.shape),
                                         produce=lambda v=value: v))
    return planned


def _query_dtype(reader: CheckpointReader, module: str) -> torch.dtype:
    for name in reader.names():
        if name.startswith(module + ".") and reader.tensors[name].dtype.is_floating_point:
            return reader.tensors[name].dtype
    return torch.float32


def _loader(reader: CheckpointReader, name: str, dtype: torch.dtype):
    return lambda: reader.load(name).to(dtype).contiguous()


def target_config(config: dict, family: Family, shape: TalkingHeadsShape, chunk_size: int, dtype: str | None) -> tuple[dict, list[str]]:
    """The output config.json, and the source architectures that map to no provided head class."""
    new = {k: v for k, v in config.items() if not k.startswith("_attn_implementation")}
    base = family.model_class("AutoModel")
    mapped, dropped = [], []
    for arch in config.get("architectures") or []:
        ours = family.architecture(arch)
        mapped.append(ours or base)
        if ours is None:
            dropped.append(arch)
    new["architectures"] = list(dict.fromkeys(mapped or [base]))
    new["model_type"] = f"talking_heads_{family.model_type}"
    new["auto_map"] = family.auto_map()
    new["talking_heads"] = {
        "heads": shape.heads,
        "head_dim": shape.head_dim,
        "logits_mixing": shape.logits_mixing,
        "weights_mixing": shape.weights_mixing,
        "heads_logits": shape.heads_logits,
        "heads_weights": shape.heads_weights,
        "pair_rotary_dims": family.rotary,
        "chunk_size": chunk_size,
    }
    if dtype:
        new["dtype"] = dtype
        new.pop("torch_dtype", None)
    return new, dropped


def convert_to_talking_heads(src: Source, out: Path, options: "TalkingHeadsOptions", progress: bool = True) -> dict:
    """Rewrite every self-attention layer of `src` into talking-heads attention; write the checkpoint to `out`.
    `options` is the kind's options model (surgery/talking_heads/options.py), validated where it was built: this checks
    only what needs the source's config, and the chunk size.

    The mixing matrices are initialized deterministically (`seed` is not used), so that the converted model
    computes the source function; see INIT_NOTE for what other head counts do. Returns the surgery.json record.
    """
    o = options
    writing = o.write_kwargs()
    dtype, chunk_size = writing["dtype"], o.chunk_size
    if chunk_size < 0:
        raise SurgeryError(f"--chunk-size must be 0 (no chunking) or positive, got {chunk_size}")
    config = src.config
    family = family_for(config)
    shape = talking_heads_shape(config, o.logits_mixing, o.weights_mixing, o.heads_logits, o.heads_weights)
    reader = CheckpointReader(src.folder, allow_pickle=o.allow_pickle)
    modules = attention_modules(reader, family, shape)
    planned = plan_tensors(reader, modules, shape, DTYPES.get(dtype) if dtype else None)
    new_config, dropped_heads = target_config(config, family, shape, chunk_size, dtype)

    start = time.time()

    fields = {
        "architecture": {"source_model_type": config.get("model_type"), "target_model_type": new_config["model_type"],
                         "architectures": new_config["architectures"], "dropped_heads": dropped_heads},
        "heads": shape.heads,
        "kv_heads": {"before": shape.kv_heads, "after": shape.kv_heads},
        "head_dim": shape.head_dim,
        "layers": shape.layers,
        "logits_mixing": shape.logits_mixing,
        "weights_mixing": shape.weights_mixing,
        "heads_logits": shape.heads_logits,
        "heads_weights": shape.heads_weights,
        "init": INIT_NOTE,
        "exact_at_init": shape.exact,
        "seed": None,
        "chunk_size": chunk_size,
        "new_parameters": [f"{modules[0]}.talking_heads.{n}".replace(".0.", ".{layer}.", 1)
                           for n, on in (("logits_mix", shape.logits_mixing), ("weights_mix", shape.weights_mixing)) if on],
        "added_parameters": shape.layers * shape.params_per_layer,
        "mix_macs_per_query_key_per_layer": shape.mix_macs_per_query_key,
    }
    return write_conversion(src, reader, out, planned, new_config, "talking-heads", fields, dtype=dtype, start=start,
                            force=writing["force"], progress=progress, max_shard_bytes=writing["max_shard_bytes"],
                            code_dir=Path(__file__).parent, code_files=CODE_FILES)
