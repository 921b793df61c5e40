"""MQA/GQA conversion as pure file-level tensor surgery: the model is never instantiated.

checkpoint folder -> ArchSpec -> a plan (one PlannedTensor per output tensor, shapes found on meta tensors)
-> shards streamed into an atomic output folder, with config.json, side files and surgery.json.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from ..checkpoint import validate
from ..arch import ArchSpec, QKNorm, QKVLayout, qkv_layout, spec_for
from ..errors import SurgeryError
from ..checkpoint.writer import write_conversion
from ..fused_qkv import join_qkv, split_qkv
from .pool import POOL_METHODS, kv_groups, pool_heads, repeat_heads
from ..checkpoint.source import Source
from ..checkpoint.tensors import CheckpointReader, DTYPES, PlannedTensor
from .refusals import PLAIN_LABEL, PLAIN_REFUSES

if TYPE_CHECKING:
    from .options import KVMergeOptions


@dataclass(frozen=True)
class HeadShape:
    heads: int
    kv_heads: int
    head_dim: int
    groups: int  # K/V heads after conversion

    @property
    def queries_per_group(self) -> int:
        return self.heads // self.groups


def head_shape(spec: ArchSpec, config: dict, groups: int) -> HeadShape:
    """The source's query / K/V heads and head_dim (by its family's spec) with the target's `groups` K/V heads,
    refused in one line when they do not fit."""
    if groups < 1:
        raise SurgeryError(f"--kv-heads must be at least 1, got {groups}")
    validate.check_config_counts(config)
    try:
        shape = HeadShape(spec.heads(config), spec.kv_heads(config), spec.head_dim(config), groups)
    except (KeyError, TypeError, ValueError) as e:
        raise SurgeryError(f"config.json lacks a usable head count ({e})") from None
    if min(shape.heads, shape.kv_heads, shape.head_dim) < 1 or shape.heads % shape.kv_heads:
        raise SurgeryError(f"config.json describes {shape.heads} heads, {shape.kv_heads} K/V heads of head_dim "
                           f"{shape.head_dim}: not a valid attention")
    if groups > shape.kv_heads or shape.kv_heads % groups:
        raise SurgeryError(
            f"--kv-heads {groups} must divide the source's {shape.kv_heads} K/V heads "
            f"(choose from {', '.join(str(d) for d in range(1, shape.kv_heads + 1) if shape.kv_heads % d == 0)})"
        )
    if _mqa_or_mha(spec, config) and groups not in (1, shape.heads):
        target = spec.target_model_type or spec.name
        raise SurgeryError(f"{spec.name} converts into {target}, which has only MQA or MHA: --kv-heads must be 1 or "
                           f"{shape.heads}")
    return shape


def _mqa_or_mha(spec: ArchSpec, config: dict) -> bool:
    """The target stores either one K/V head (its MQA flag set) or one per query head."""
    return spec.mqa_flag is not None and spec.qkv_layout(config) != QKVLayout.GROUPED


def target_config(spec: ArchSpec, config: dict, shape: HeadShape, dtype: str | None) -> dict:
    """The output config.json: the source's, with the K/V head count (and, for GPT-2, the architecture) changed."""
    new = dict(config)
    if spec.target_model_type:
        new = {k: config[k] for k in spec.target_keys if k in config}
        new.update(model_type=spec.target_model_type, architectures=list(spec.target_architectures))
    if _mqa_or_mha(spec, config):
        new[spec.mqa_flag] = shape.groups == 1
    elif spec.kv_heads_key:
        new[spec.kv_heads_key] = shape.groups
    if dtype:
        new["dtype"] = dtype
        new.pop("torch_dtype", None)
    return new


class KVPlanner:
    """Builds the output tensor plan for one checkpoint: K/V heads pooled by `method` (one of POOL_METHODS), written
    as `options` (the kind's options model, surgery/kv/options.py) asks."""

    def __init__(self, reader: CheckpointReader, spec: ArchSpec, config: dict, shape: HeadShape,
                 options: "KVMergeOptions", method: str):
        self.reader, self.spec, self.config, self.shape, self.options = reader, spec, config, shape, options
        self.method = method
        self.dtype = options.write_kwargs()["dtype"]  # None keeps each tensor's dtype
        self.in_layout = qkv_layout(spec, config)
        self.out_layout = self._out_layout()
        self.out_dtype = DTYPES.get(self.dtype) if self.dtype else None
        self._shapes: dict[tuple, tuple[int, ...]] = {}
        # K norms with a weight per K/V head lose heads with them (one weight per head_dim is shared: kept)
        per_head = spec.has_qk_norm(config) and spec.qk_norm in (QKNorm.WHOLE, QKNorm.PER_HEAD)
        self.k_norm_pattern = spec.norm_pattern("k") if per_head and shape.groups != shape.kv_heads else None

    def _out_layout(self) -> QKVLayout:
        if _mqa_or_mha(self.spec, self.config):
            return QKVLayout.FUSED if self.shape.groups == 1 else QKVLayout.INTERLEAVED
        return self.in_layout

    # --- per-tensor transforms (they run on meta tensors for planning, on real ones for writing) -----
    def _generator(self, layer: int, role: str) -> torch.Generator:
        return torch.Generator().manual_seed(self.options.seed * 1_000_003 + layer * 4 + "qkv".index(role))

    def _pool(self, t: torch.Tensor, layer: int, role: str) -> torch.Tensor:
        gen = None if t.is_meta else self._generator(layer, role)
        return pool_heads(t, self.shape.head_dim, self.shape.groups, self.method, gen)

    def _pool_norm(self, t: torch.Tensor) -> torch.Tensor:
        """A K norm with a weight per K/V head (over the whole projection or per head): pooled like the heads."""
        method = "mean" if self.method == "random" else self.method
        return pool_heads(t.reshape(-1), self.shape.head_dim, self.shape.groups, method).reshape(-1, *t.shape[1:])

    def _pool_fused(self, t: torch.Tensor, layer: int) -> torch.Tensor:
        s = self.shape
        q, k, v = split_qkv(t, self.in_layout, s.heads, s.kv_heads, s.head_dim)
        k, v = self._pool(k, layer, "k"), self._pool(v, layer, "v")
        if self.out_layout == QKVLayout.INTERLEAVED:
            k, v = (repeat_heads(x, s.head_dim, s.queries_per_group) for x in (k, v))
        return join_qkv(q, k, v, self.out_layout, s.head_dim)

    def transform_for(self, name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The function that makes this tensor's output from its input, or None for a plain copy."""
        spec = self.spec
        steps: list[Callable[[torch.Tensor], torch.Tensor]] = []
        if spec.conv1d_pattern and re.search(spec.conv1d_pattern, name):
            steps.append(lambda t: t.t())
        if self.k_norm_pattern and re.search(self.k_norm_pattern, name):
            steps.append(self._pool_norm)
        hit = spec.match(name)
        if hit:
            layer, proj, _ = hit
            if proj in (spec.k, spec.v) and self.in_layout == QKVLayout.SEPARATE:
                role = "k" if proj == spec.k else "v"
                steps.append(lambda t: self._pool(t, layer, role))
            elif proj == spec.qkv:
                steps.append(lambda t: self._pool_fused(t, layer))
        if not steps:
            return None

        def run(t: torch.Tensor) -> torch.Tensor:
            for step in steps:
                t = step(t)
            return t.contiguous()

        return run

    def out_name(self, name: str) -> str:
        return self.spec.out_name(name)

    def plan(self) -> list[PlannedTensor]:
        self._validate_layers()
        planned = []
        for name in self.reader.names():
            if self.spec.drop_pattern and re.search(self.spec.drop_pattern, name):
                continue
            info = self.reader.tensors[name]
            dtype = self.out_dtype if (self.out_dtype and info.dtype.is_floating_point) else info.dtype
            fn = self.transform_for(name)
            if fn is None and dtype == info.dtype and not self.reader.is_pickle:
                planned.append(PlannedTensor(self.out_name(name), dtype, info.shape, raw_source=(self.reader, name)))
                continue
            shape = self._out_shape(name, fn, info.shape, info.dtype)
            planned.append(PlannedTensor(self.out_name(name), dtype, shape, produce=self._producer(name, fn, dtype)))
        return planned

    def _out_shape(self, name: str, fn, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, ...]:
        """Run the transform on a meta tensor; every layer has the same shapes, so cache by role and shape."""
        if fn is None:
            return shape
        hit = self.spec.match(name)
        key = (hit[1:] if hit else re.sub(r"\d+", "#", name), shape, dtype)
        if key not in self._shapes:
            try:
                self._shapes[key] = tuple(fn(torch.empty(shape, dtype=dtype, device="meta")).shape)
            except RuntimeError as e:
                raise SurgeryError(f"tensor {name} of shape {list(shape)} does not match config.json ({e})") from None
        return self._shapes[key]

    def _producer(self, name: str, fn, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
        def produce() -> torch.Tensor:
            t = self.reader.load(name)
            if fn is not None:
                t = fn(t)
            return t.to(dtype).contiguous()

        return produce

    def _validate_layers(self) -> None:
        """Attention tensors for exactly config.json's layers, each of the shape its head counts imply."""
        s = self.shape
        hidden = self.config.get(self.spec.hidden_key)
        validate.check_attention_tensors({n: t.shape for n, t in self.reader.tensors.items()}, self.spec,
                                       self.in_layout.value, s.heads, s.kv_heads, s.head_dim,
                                       hidden if isinstance(hidden, int) else None)
        layers = {hit[0] for n in self.reader.names() if (hit := self.spec.match(n))}
        expected = set(range(self.spec.layers(self.config)))
        if layers != expected:
            missing = sorted(expected - layers)
            raise SurgeryError(
                f"checkpoint does not match config.json: attention tensors missing for layer(s) {missing[:8]}"
                if missing else f"checkpoint has attention tensors for layers beyond config.json's {len(expected)}"
            )

    def group_record(self) -> list[dict]:
        s = self.shape
        return [
            {
                "kv_head": g,
                "source_kv_heads": members,
                "query_heads": list(range(g * s.queries_per_group, (g + 1) * s.queries_per_group)),
            }
            for g, members in enumerate(kv_groups(s.kv_heads, s.groups))
        ]


def convert_to_kv_heads(source: Source, out: Path, options: "KVMergeOptions", progress: bool = True) -> dict:
    """Convert `source` to `options.groups` K/V heads by the plain merge `options.merge` (mean, first or random),
    writing a standard checkpoint to `out`. `options` is the kind's options model (surgery/kv/options.py), validated
    where it was built: this checks only what needs the source's config."""
    if options.merge not in POOL_METHODS:
        raise SurgeryError(f"unknown pooling method {options.merge!r}; choose from {', '.join(POOL_METHODS)} (the "
                           "aligned merge is surgery.kv.aligned.convert_aligned)")
    config = source.config
    spec = spec_for(config, PLAIN_LABEL, PLAIN_REFUSES)
    shape = head_shape(spec, config, options.groups)
    reader = CheckpointReader(source.folder, allow_pickle=options.allow_pickle)
    planner = KVPlanner(reader, spec, config, shape, options, options.merge)
    return write_converted(source, out, planner, progress=progress)


def write_converted(source: Source, out: Path, planner: KVPlanner, progress: bool = True, method: str | None = None,
                    extra: dict | None = None, start: float | None = None) -> dict:
    """Write `planner`'s checkpoint, config.json, side files and surgery.json atomically to `out`.

    Other merge methods reuse this writer: `method` names them in the record, `extra` is merged into the
    record, `start` is when their work began (for the record's `seconds`)."""
    reader, spec, config, shape, options = planner.reader, planner.spec, planner.config, planner.shape, planner.options
    method = method or planner.method
    written = options.write_kwargs()
    new_config = target_config(spec, config, shape, written["dtype"])
    planned = planner.plan()

    start = time.time() if start is None else start

    fields = {
        "method": method,
        "seed": options.seed if method == "random" else None,
        "architecture": {"spec": spec.name, "target_model_type": new_config.get("model_type")},
        "heads": shape.heads,
        "head_dim": shape.head_dim,
        "kv_heads": {"before": shape.kv_heads, "after": shape.groups},
        "stored_kv_heads": shape.heads if planner.out_layout == QKVLayout.INTERLEAVED else shape.groups,
        "groups": planner.group_record(),
    }
    if planner.out_layout == QKVLayout.INTERLEAVED and shape.groups != shape.heads:
        fields["note"] = spec.notes
    return write_conversion(source, reader, out, planned, new_config, "mqa" if shape.groups == 1 else "gqa",
                            fields | (extra or {}), dtype=written["dtype"], start=start, force=written["force"],
                            progress=progress, max_shard_bytes=written["max_shard_bytes"])
