"""Sanity checks on checkpoints from strangers, run before anything is read in bulk or written.

Each check raises `SurgeryError` with one line naming the file (or config key) at fault:
- files: only regular files are opened (a FIFO named model.safetensors would block forever), and the names an
  index lists stay inside the checkpoint folder (judged by name, so the hub cache's symlinked blobs still work);
- config.json: a JSON object whose head, layer and width counts are positive integers of plausible size, with
  K/V heads dividing query heads;
- safetensors headers: an object of well-formed entries whose byte ranges lie inside the file and do not overlap;
- attention tensors: their head axes hold exactly the heads config.json describes.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath
from typing import Iterable

from ..errors import SurgeryError

# Anything larger is not a real checkpoint (and would make per-head loops or messages run for ever).
MAX_COUNT = 1 << 20

# config keys holding counts, per meaning (first present wins, as transformers' configs name them)
HEADS_KEYS = ("num_attention_heads", "n_head")
KV_HEADS_KEYS = ("num_key_value_heads",)
HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")
LAYERS_KEYS = ("num_hidden_layers", "n_layer")
HEAD_DIM_KEYS = ("head_dim",)


def regular_file(path: Path, what: str = "file") -> Path:
    """`path` if it is a regular file (following symlinks); refuses FIFOs, devices, sockets and folders."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise SurgeryError(f"cannot read {what} {path}: {e.strerror}") from None
    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
        raise SurgeryError(f"{what} {path} is {kind}; expected a regular file")
    return Path(path)


def name_inside(folder: Path, name: object, listed_in: str) -> Path:
    """folder/name for a relative file name that stays inside `folder` (no absolute path, no `..`)."""
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name:
        raise SurgeryError(f"{listed_in} names a bad file {name!r}")
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts:
        raise SurgeryError(f"{listed_in} names {name!r}, outside the checkpoint folder; refused")
    return Path(folder) / name


def weight_map(index: object, path: Path) -> dict[str, str]:
    """The `weight_map` of a parsed shard index, checked to be {tensor name: file name}."""
    if not isinstance(index, dict):
        raise SurgeryError(f"corrupt index {path}: not a JSON object")
    wm = index.get("weight_map")
    if not isinstance(wm, dict) or not wm:
        raise SurgeryError(f"corrupt index {path}: weight_map must be a non-empty object of tensor -> file")
    for tensor, file in wm.items():
        name_inside(path.parent, file, f"index {path}")
    return wm


# --- config.json ---------------------------------------------------------------------------------------------


def config_object(value: object, path: Path) -> dict:
    if not isinstance(value, dict):
        raise SurgeryError(f"corrupt {path}: not a JSON object")
    return value


def _count(config: dict, keys: tuple[str, ...], required: bool) -> int | None:
    for key in keys:
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise SurgeryError(f"config.json: {key} must be a positive integer, got {value!r}")
        if value < 1:
            raise SurgeryError(f"config.json: {key} must be a positive integer, got {value}")
        if value > MAX_COUNT:
            raise SurgeryError(f"config.json: {key} = {value} is implausibly large (more than {MAX_COUNT})")
        return value
    if required:
        raise SurgeryError(f"config.json has no {keys[0]}" + (f" (or {', '.join(keys[1:])})" if keys[1:] else ""))
    return None


def check_config_counts(config: dict, heads_required: bool = True) -> None:
    """Head, K/V head, hidden and layer counts in config.json: positive integers, K/V heads dividing heads.

    Only the keys present are checked (a missing one is the architecture's business), except the query heads
    when `heads_required`."""
    heads = _count(config, HEADS_KEYS, heads_required)
    kv = _count(config, KV_HEADS_KEYS, False)
    hidden = _count(config, HIDDEN_KEYS, False)
    _count(config, LAYERS_KEYS, False)
    head_dim = _count(config, HEAD_DIM_KEYS, False)
    if heads and kv and (kv > heads or heads % kv):
        raise SurgeryError(f"config.json: num_key_value_heads {kv} does not divide num_attention_heads {heads}")
    if heads and hidden and head_dim is None and hidden < heads:
        raise SurgeryError(f"config.json: {heads} attention heads do not fit in hidden size {hidden} (head_dim 0)")


# --- safetensors headers -------------------------------------------------------------------------------------


def safetensors_entry(path: Path, name: str, entry: object, dtypes: dict,
                      subbyte: dict | None = None) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype code, shape, begin, end) of one header entry, with every field of the right type; a dtype of the
    format that torch cannot hold per element (`subbyte`: code -> width) is its own line."""
    bad = SurgeryError(f"corrupt safetensors file {path}: bad entry for {name}")
    if not isinstance(entry, dict):
        raise bad
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if isinstance(dtype, str) and dtype in (subbyte or {}):
        raise SurgeryError(f"{path}: tensor {name} has dtype {dtype} ({subbyte[dtype]} values), which torch cannot "
                           "hold one value per element; surgery reads 8-bit and wider tensors")
    if not isinstance(dtype, str) or dtype not in dtypes:
        raise SurgeryError(f"corrupt safetensors file {path}: tensor {name} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
        raise bad
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) and o >= 0 for o in offsets):
        raise bad
    begin, end = offsets
    if begin > end:
        raise bad
    return dtype, tuple(shape), begin, end


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_byte_ranges(path: Path, ranges: Iterable[tuple[str, int, int]], data_size: int) -> None:
    """Tensors' (name, begin, end) ranges, relative to the data section, must tile it exactly as the safetensors
    format (and its reference reader) requires: inside it, no overlap, no gap, nothing after the last tensor."""
    position, previous = 0, None
    for name, begin, end in sorted(ranges, key=lambda r: (r[1], r[2])):
        if end > data_size:
            raise SurgeryError(f"truncated or corrupt safetensors file {path}: tensor {name} is incomplete")
        if begin < position:
            raise SurgeryError(f"corrupt safetensors file {path}: tensors {previous} and {name} overlap")
        if begin > position:
            raise SurgeryError(f"corrupt safetensors file {path}: bytes {position}-{begin} before tensor {name} "
                               "belong to no tensor")
        position, previous = end, name
    if position != data_size:
        raise SurgeryError(f"corrupt safetensors file {path}: {data_size - position} bytes after the last tensor "
                           "belong to no tensor")


# --- attention tensors against config.json -------------------------------------------------------------------


def check_axis(name: str, shape: tuple[int, ...], axis: int, expected: int, what: str) -> None:
    """Tensor `name`'s `axis` must hold `expected` values (`what` says which, for the message)."""
    needed = axis + 1 if axis >= 0 else -axis
    if len(shape) < needed or shape[axis] != expected:
        raise SurgeryError(f"tensor {name} of shape {list(shape)} does not match config.json: expected {expected} "
                           f"on axis {axis if axis >= 0 else len(shape) + axis} ({what})")


def check_attention_tensors(shapes: dict[str, tuple[int, ...]], spec, fused_layout: str, heads: int, kv_heads: int,
                            head_dim: int, hidden: int | None) -> None:
    """Every attention projection of an MQA/GQA spec (surgery.arch.ArchSpec) against config.json's counts.

    `fused_layout` is the layout's value ("separate", "fused" or "interleaved"). The head axis of q/k/v (rows,
    or columns of GPT-2's Conv1D) must hold heads*head_dim, K/V heads*head_dim or the fused sum; o_proj's input
    axis heads*head_dim; the other axis of 2-D weights the hidden size (when config.json gives it)."""
    import re

    for name, shape in shapes.items():
        hit = spec.match(name)
        if hit is None:
            continue
        _, proj, param = hit
        conv1d = bool(spec.conv1d_pattern and re.search(spec.conv1d_pattern, name))
        if proj == spec.o:
            if param != "weight":
                continue
            axis, expected, what = (0 if conv1d else 1), heads * head_dim, f"{heads} heads x head_dim {head_dim}"
        elif proj == spec.qkv:
            axis = -1 if conv1d else 0
            if fused_layout == "interleaved":
                expected, what = 3 * heads * head_dim, f"q, k, v of {heads} heads x head_dim {head_dim}"
            else:
                expected = (heads + 2 * kv_heads) * head_dim
                what = f"{heads} query + 2 x {kv_heads} K/V heads x head_dim {head_dim}"
        elif proj == spec.q:
            axis, expected, what = 0, heads * head_dim, f"{heads} heads x head_dim {head_dim}"
        elif proj in (spec.k, spec.v):
            axis, expected, what = 0, kv_heads * head_dim, f"{kv_heads} K/V heads x head_dim {head_dim}"
        else:
            continue
        check_axis(name, shape, axis, expected, what)
        if param == "weight":
            if len(shape) != 2:
                raise SurgeryError(f"tensor {name} of shape {list(shape)} does not match config.json: expected a matrix")
            if hidden is not None:
                other = 1 - (axis % 2)
                check_axis(name, shape, other, hidden, "hidden size")
        elif len(shape) != 1:
            raise SurgeryError(f"tensor {name} of shape {list(shape)} does not match config.json: expected a vector")
