"""Rough sizes for `surgery run --dry-run`: bytes on disk, tokens processed and peak memory of each step.

Memory formulas (per process, bytes; P parameters, b bytes per weight, s sequence length, m micro-batch,
H hidden size, L layers, V vocabulary):
- convert, streamed (mean/first/random/talking-heads): about 3 x the largest tensor (read, pooled, written).
- convert with calibration (aligned, switchhead): layer streaming, one fp32 decoder layer at a time plus the
  embeddings, activations and fits (surgery/estimate.py, the same model `surgery convert --dry-run` prints; the
  source's config is needed, else the fp32 model 4P plus its activations).
- check: both models in the check dtype (2 P x 4 for fp32) plus two batches of logits (2 x 4 x m s V).
- uptrain (AdamW, fp32 master weights): 16 P (weights, gradients, two moments) divided by the processes under
  FSDP, plus a fp32 teacher 4 P when distilling, plus activations ~ m s H L x 34 x 2 bytes (fp32; Korthikanti
  et al. 2022 count 34 s b H bytes per layer in 16-bit), or m s H L x 4 with gradient checkpointing, plus
  logits 3 x 4 x m s V.
Good to within a factor of about two; the point is to see which step needs which machine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ..inspect import attention_shape


@dataclass
class ModelStats:
    params: int
    dtype_bytes: int
    largest_tensor_bytes: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    config: dict | None = None  # the source's config.json (for the calibrated conversions' streaming estimate)

    @property
    def bytes(self) -> int:
        return self.params * self.dtype_bytes


def _shape(config: dict) -> dict:
    shape = attention_shape(config)
    shape["vocab"] = int(config.get("vocab_size") or 0)
    return shape


def stats_from_folder(folder: Path, allow_pickle: bool = False) -> ModelStats:
    from ..source import load_config
    from ..tensors import CheckpointReader, dtype_size

    config = load_config(folder)
    with CheckpointReader(folder, allow_pickle=allow_pickle) as reader:
        infos = list(reader.tensors.values())
    floats = [t for t in infos if t.dtype.is_floating_point] or infos
    main = max(floats, key=lambda t: t.numel)
    largest = max(t.numel * dtype_size(t.dtype) for t in infos)
    shape = _shape(config)
    return ModelStats(sum(t.numel for t in infos), dtype_size(main.dtype), largest, shape["layers"], shape["hidden"],
                      shape["heads"], shape["kv_heads"], shape["head_dim"], shape["vocab"], config)


def stats_from_config(config: dict) -> ModelStats:
    """Parameters of a config's model, counted on the meta device (nothing allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_dict = dict(config)
    model_type = cfg_dict.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **cfg_dict)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    params = {id(p): p for p in model.parameters()}.values()  # tied weights once
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    size = {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 4)
    shape = _shape(config)
    return ModelStats(sum(p.numel() for p in params), size, max(p.numel() for p in params) * size, shape["layers"],
                      shape["hidden"], shape["heads"], shape["kv_heads"], shape["head_dim"], shape["vocab"], config)


def after_convert(stats: ModelStats, options) -> ModelStats:
    """The converted model's size: K/V projections shrink for mqa/gqa; other kinds stay close to the source."""
    to = options.to
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(getattr(options, "dtype", "auto"), stats.dtype_bytes)
    if to in ("mqa", "gqa"):
        groups = 1 if to == "mqa" else options.kv_heads
        removed = stats.layers * 2 * stats.hidden * stats.head_dim * max(stats.kv_heads - groups, 0)
        return replace(stats, params=stats.params - removed, kv_heads=groups, dtype_bytes=dtype_bytes, config=None)
    return replace(stats, dtype_bytes=dtype_bytes, config=None)


def convert_memory(stats: ModelStats, options) -> int:
    calibrated = options.to == "switchhead" or getattr(options, "merge", None) == "aligned"
    if calibrated and stats.config is not None:
        return streamed_calibration(stats, options).host_bytes
    if calibrated:
        tokens = min(getattr(options, "calib_tokens", 8192) or 8192, 2048)
        return stats.params * 4 + tokens * stats.hidden * stats.layers * 4 * 4
    return 3 * stats.largest_tensor_bytes


def streamed_calibration(stats: ModelStats, options, throughput=None):
    """The calibrated conversion's estimate (surgery/estimate.py) for a convert step's options."""
    from ..estimate import Throughput, estimate_calibrated

    kind = "switchhead" if options.to == "switchhead" else "aligned"
    dtype = {4: "float32", 2: "bfloat16"}.get(stats.dtype_bytes, "float32")
    device = getattr(options, "device", "cpu") or "cpu"
    device = "cpu" if device == "auto" else device
    return estimate_calibrated(stats.config, kind, options.calib_tokens, dtype=dtype, device=device,
                               kv_heads=1 if options.to == "mqa" else getattr(options, "kv_heads", None),
                               assign=getattr(options, "grouping", "similarity") != "consecutive",
                               heads=getattr(options, "heads", None), experts=getattr(options, "experts", None),
                               topk=getattr(options, "topk", None),
                               throughput=throughput or Throughput("unmeasured", 1.0, 1.0))


def check_memory(stats: ModelStats, options) -> int:
    bytes_ = {"float32": 4, "bfloat16": 2, "float16": 2}[options.dtype]
    logits = 2 * 4 * options.batch_size * options.seq_len * max(stats.vocab, stats.hidden)
    return 2 * stats.params * bytes_ + logits


def uptrain_memory(stats: ModelStats, options, teacher: ModelStats | None, processes: int) -> int:
    states = 16 * stats.params // max(processes, 1)
    tokens = options.micro_batch * options.seq_len
    per_token = stats.hidden * stats.layers * (4 if options.gradient_checkpointing else 34 * 2)
    logits = 3 * 4 * tokens * stats.vocab
    teacher_bytes = 4 * teacher.params // max(processes, 1) if teacher else 0
    return states + teacher_bytes + tokens * per_token + logits


def uptrain_tokens(options) -> int:
    steps = -(-options.tokens // options.batch_tokens)
    return steps * options.batch_tokens


def human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000:
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} PB"


def human_count(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("", "K", "M", "B"):
        if n < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}T"
