"""Attention statistics of a checkpoint, from config.json, surgery.json and safetensors headers only."""

from __future__ import annotations

from pathlib import Path

from .arch import attention_shape
from .errors import SurgeryError
from .kinds.base import cached_fraction
from .kinds import AttentionShape, check_checkpoint, find_kind, kv_cache_values, plain_attention_macs
from .checkpoint.record import read_record
from .checkpoint.source import load_config
from .checkpoint.tensors import CheckpointReader, dtype_size
from .units import si_number


def inspect_checkpoint(folder: Path, context: int = 4096, label: str | None = None, allow_pickle: bool = False) -> dict:
    """Pickle (.bin) weights are read only with `allow_pickle` (then with torch.load(weights_only=True)), as convert."""
    if context < 1:
        raise SurgeryError(f"--context must be at least 1, got {context}")
    config = load_config(folder)
    shape = attention_shape(config)
    record = read_record(folder)  # typed: a mistyped field is one line naming the file
    with CheckpointReader(folder, allow_pickle=allow_pickle) as reader:
        tensors = list(reader.tensors.values())
    check_checkpoint(folder, config, record, {t.name: t.shape for t in tensors})  # config.json against the tensors
    params = sum(t.numel for t in tensors)
    floats = [t for t in tensors if t.dtype.is_floating_point]
    # The KV cache is kept in the weights' dtype: the dtype holding most parameters.
    cache_dtype = max(floats, key=lambda t: t.numel).dtype if floats else None
    bytes_per_value = dtype_size(cache_dtype) if cache_dtype is not None else 2

    L, h, kv, d = shape["layers"], shape["heads"], shape["kv_heads"], shape["head_dim"]
    # QKᵀ and AV for one query over `context` keys (sliding-window layers: over their window)
    # the kind that wrote the checkpoint knows its attention's work and cache (surgery/kinds); a plain checkpoint:
    # MHA/GQA
    kind = find_kind(record, config)
    ashape = AttentionShape(L, h, kv, d, shape["hidden"])
    attending = kind.attention_layers(ashape, config) if kind else L
    core_macs = round(attending * 2 * h * d * context * cached_fraction(config, context))
    kv_bytes = kv_cache_values(ashape, config, record, context)["transformers"] * bytes_per_value
    state_bytes = (kind.state_values(config) if kind else 0) * bytes_per_value  # recurrent mixers: fixed size
    macs = kind.attention_macs(ashape, config, record, context) if kind else plain_attention_macs(ashape)
    proj_macs, mix_macs = macs["proj"], macs["mixing"]
    experts, topk = kind.experts(config) if kind else (None, None)
    return {
        "checkpoint": label or str(folder),
        "model_type": config.get("model_type"),
        "surgery": record.get("kind"),
        **shape,
        "distinct_kv_heads": (record.get("kv_heads") or {}).get("after", kv),
        "experts": experts,
        "topk": topk,
        "parameters": params,
        "dtype_bytes": bytes_per_value,
        "kv_cache_dtype": str(cache_dtype).removeprefix("torch.") if cache_dtype is not None else "unknown (2 bytes assumed)",
        "kv_cache_bytes_per_token": kv_bytes,
        "kv_cache_bytes_per_context": kv_bytes * context,
        "context": context,
        "state_bytes": state_bytes or None,
        "cache_and_state_bytes_per_context": kv_bytes * context + state_bytes,
        "attention_proj_macs_per_token": proj_macs,
        "attention_core_macs_per_token": core_macs,
        "head_mixing_macs_per_token": mix_macs,
        "added_parameters": kind.added_parameters(record) if kind else None,
        "attention_macs_per_token": proj_macs + core_macs + (mix_macs or 0),
    }


def print_inspection(stats: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    base = stats[0]
    table = Table(show_header=True)
    table.add_column("")
    for s in stats:
        table.add_column(s["checkpoint"], justify="right")
    ctx = base["context"]
    rows = [
        ("model_type", "model_type", None),
        ("surgery", "surgery", None),
        ("layers", "layers", None),
        ("heads", "heads", None),
        ("K/V heads (stored)", "kv_heads", None),
        ("K/V heads (distinct)", "distinct_kv_heads", None),
        ("head_dim", "head_dim", None),
        ("experts / head (top-k)", "experts", None),
        ("parameters", "parameters", ""),
        ("parameters added by surgery", "added_parameters", ""),
        ("KV cache dtype (the weights')", "kv_cache_dtype", None),
        ("KV cache / token", "kv_cache_bytes_per_token", "B"),
        (f"KV cache / {ctx} ctx", "kv_cache_bytes_per_context", "B"),
        ("recurrent state (any ctx)", "state_bytes", "B"),
        (f"KV cache + state / {ctx} ctx", "cache_and_state_bytes_per_context", "B"),
        ("attn MACs / token (proj)", "attention_proj_macs_per_token", ""),
        (f"attn MACs / token (core @{ctx})", "attention_core_macs_per_token", ""),
        (f"attn MACs / token (head mixing @{ctx})", "head_mixing_macs_per_token", ""),
        ("attn MACs / token (total)", "attention_macs_per_token", ""),
    ]
    for title, key, unit in rows:
        cells = []
        for s in stats:
            value = s.get(key)
            if key == "experts" and value is not None:
                cells.append(f"{value} (top-{s['topk']})")
                continue
            if unit is None:
                cells.append(str(value if value is not None else "-"))
                continue
            text = si_number(value, unit)
            if s is not base and value is not None and base.get(key):
                text += f" ({value / base[key]:.2f}x)"
            cells.append(text)
        table.add_row(title, *cells)
    Console().print(table)
