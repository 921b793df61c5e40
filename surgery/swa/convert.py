"""The swa conversion: choose the global layers, write the source's tensors unchanged (streamed, byte for byte where
the dtype stays) with a config that marks the other layers sliding.

Targets (surgery.arch.SLIDING_WINDOW_TARGETS): Llama and Mistral bodies become `ministral` (Llama's layer without
biases, with per-layer types); Qwen2, Qwen3, SmolLM3 and Gemma 2 keep their own type (Qwen2/3 and SmolLM3 with
`use_sliding_window`). With `sinks`, Llama and Mistral bodies become `granite_swa` instead (transformers 5.24:
Granite's layer with per-layer windows and a learnable attention sink per head, a logit that joins every softmax
and takes weight from the keys; identity multipliers make it Llama's layer), the sinks written at SINK_INIT.

A sliding layer's query at position q sees keys q-W+1..q: W keys, itself included (transformers'
sliding_window_overlay, vLLM's and llama.cpp's windows alike), so contexts of at most W tokens compute exactly what
the source computes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import time
from pathlib import Path

import torch

from ..arch import SLIDING_WINDOW_SWITCHED, SLIDING_WINDOW_TARGETS, spec_for
from ..calibration.chunks import chunk_windows
from ..calibration.text import calibration_text, context_of
from ..checkpoint.atomic import check_output_path
from ..checkpoint.source import Source
from ..checkpoint.tensors import DTYPES, CheckpointReader, PlannedTensor
from ..checkpoint.writer import write_conversion
from ..errors import SurgeryError
from ..precision import calibrating, resolve_precision
from ..runtime import load_tokenizer, pick_device
from .layers import GlobalLayers, evenly_spaced, layer_types, top_layers
from .refusals import KIND, REFUSES

if TYPE_CHECKING:
    from .options import SWAOptions

ARCHITECTURES = {"ministral": "MinistralForCausalLM", "granite_swa": "GraniteSWAForCausalLM"}
SINKS_TARGET = "granite_swa"  # the standard type that carries per-head sinks beside per-layer windows
# The sinks' first value. A sink s scales a head's output by sigmoid(lse - s) (lse: the log-sum-exp of its
# logits), so at s = -12 the output moves by a factor exp(s - lse) < 6e-6 wherever lse >= 0 (a query's own key
# alone gives lse = q.k/sqrt(d)): float32 noise at contexts <= W, while Adam, which steps by the sign of a gradient
# however small, can still move it (a sink at -1e30 would have no gradient at all).
SINK_INIT = -12.0
LLAMA_ONLY = ("attention_bias", "mlp_bias", "pretraining_tp")  # Llama settings Ministral's layer has no place for
AUTO_WINDOWS = 4  # `auto` calibrates on windows of this many times W (capped by the context) unless told
SCORES = {"cost": "what windowing the layer alone costs (answers' log-prob drop on retrieval examples built from the "
                  "calibration text + NLL rise beyond the window), by successive halving",
          "mass": "attention mass beyond the window (mean over heads and queries)"}


def _cost_scores(src, reader, tokenizer, windows, device, window: int, chunk: int, layers: int, count: int,
                 progress: bool):
    """`--layer-score cost`: (each layer's cost in the first round, every round, the chosen layers)."""
    from .cost import Probe, choose_by_cost, probe_examples, windowing_costs

    probe = Probe.of(probe_examples(tokenizer, windows))

    def score_round(kept, candidates):
        return windowing_costs(src.folder, reader, probe, device, window, chunk, kept, candidates, progress,
                               desc=f"score layers (windowing cost, {len(kept)} global)")

    chosen, rounds = choose_by_cost(score_round, layers, count)
    first = rounds[0]["costs"] if rounds else {}
    return [first[str(i)]["cost"] if str(i) in first else 0.0 for i in range(layers)], rounds, chosen


def target_type(config: dict, sinks: bool) -> str:
    """The model type the output is written as (refuses sinks where no standard type carries them)."""
    target = SLIDING_WINDOW_TARGETS[config["model_type"]]
    if sinks:
        if target != "ministral":
            raise SurgeryError(f"--sinks: no standard {config['model_type']} type carries attention sinks beside "
                               f"sliding windows (swa writes sinks as {SINKS_TARGET}, for Llama and Mistral bodies)")
        return SINKS_TARGET
    return target


def check_request(config: dict, window: int, global_layers: GlobalLayers, sinks: bool = False) -> tuple[int, int]:
    """The family, the window, the global-layer choice and the sinks checked against the source's config before
    any work (what needs no config, e.g. a window of at least 1, the options model checked); returns (layers,
    context)."""
    spec_for(config, KIND, REFUSES)
    if target_type(config, sinks) == "ministral" and config.get("model_type") in ("llama",):
        for key in LLAMA_ONLY:
            if config.get(key) not in (None, False, 1):
                raise SurgeryError(f"swa writes Llama as ministral, whose layer has no {key} (the source sets "
                                   f"{key}={config[key]!r})")
    layers, context = spec_for(config).layers(config), context_of(config)
    if context and window >= context:
        raise SurgeryError(f"--window {window} must be shorter than the model's context ({context} tokens): a window "
                           "that covers the whole context changes nothing")
    global_layers.check(layers)
    return layers, context


def target_config(config: dict, window: int, types: list[str], dtype: str | None, sinks: bool = False) -> dict:
    """The output config.json: the source's, with per-layer types and the window (and, from Llama or Mistral, the
    ministral model type, or granite_swa with identity multipliers where sinks are asked)."""
    target = target_type(config, sinks)
    new = dict(config)
    if target == SINKS_TARGET:
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        new.pop("pretraining_tp", None)
        new.update(model_type=target, architectures=[ARCHITECTURES[target]], embedding_multiplier=1.0,
                   residual_multiplier=1.0, logits_scaling=1.0, attention_multiplier=head_dim ** -0.5)
    elif target != config["model_type"]:
        new = {k: v for k, v in new.items() if k not in LLAMA_ONLY}
        new.update(model_type=target, architectures=[ARCHITECTURES[target]])
    new.update(sliding_window=window, layer_types=types)
    if target in SLIDING_WINDOW_SWITCHED:  # Qwen2/3, SmolLM3 (no MoE type is a target)
        new["use_sliding_window"] = True
        new.pop("max_window_layers", None)  # layer_types decides; this would only mislead a reader
    if dtype:
        new["dtype"] = dtype
        new.pop("torch_dtype", None)
    return new


SINK_NAMES = "model.layers.{layer}.self_attn.sinks"  # surgery.json's new_parameters pattern, and each layer's name


def sink_tensors(config: dict, reader: CheckpointReader, dtype: str | None) -> list[PlannedTensor]:
    """One sink per query head and layer, at SINK_INIT, in the dtype of the layer's query projection (or --dtype)."""
    heads, layers = config["num_attention_heads"], spec_for(config).layers(config)
    like = reader.tensors.get("model.layers.0.self_attn.q_proj.weight")
    to = DTYPES[dtype] if dtype else (like.dtype if like is not None else DTYPES["float32"])
    return [PlannedTensor(SINK_NAMES.format(layer=i), to, (heads,),
                          produce=lambda to=to: torch.full((heads,), SINK_INIT, dtype=to)) for i in range(layers)]


def plan(reader: CheckpointReader, dtype: str | None) -> list[PlannedTensor]:
    """Every tensor unchanged: a raw byte copy, or cast when --dtype asks for another float type."""
    out = DTYPES.get(dtype) if dtype else None
    planned = []
    for name in reader.names():
        info = reader.tensors[name]
        if out is None or not info.dtype.is_floating_point or out == info.dtype:
            if not reader.is_pickle:
                planned.append(PlannedTensor(name, info.dtype, info.shape, raw_source=(reader, name)))
                continue
        to = out if (out is not None and info.dtype.is_floating_point) else info.dtype
        planned.append(PlannedTensor(name, to, info.shape,
                                     produce=lambda n=name, to=to: reader.load(n).to(to).contiguous()))
    return planned


def convert_to_swa(src: Source, out: Path, options: "SWAOptions", progress: bool = True) -> dict:
    """Write `src` with sliding-window attention of `options.window` tokens on every layer but the global ones to
    `out`; `options` is the kind's options model (surgery/swa/options.py), validated once where it was built: this reads
    it and checks only what needs the source's config. `auto` scores the layers on `calib_tokens` calibration tokens
    in windows of `calib_window` (when given; else 4 W, capped by the context), by `layer_score`: "cost" (what
    windowing each layer costs, surgery/swa/cost.py) or "mass" (attention mass beyond the window,
    surgery/swa/score.py). `sinks` writes granite_swa with a learnable sink per head (SINK_INIT: exact until
    trained), listed as the conversion's new parameters for uptraining."""
    o = options
    window, global_layers, sinks, layer_score = o.window, o.parsed_global_layers, o.sinks, o.layer_score
    # the calibration windows: 4 W unless --calib-window is given (its default's value too, given explicitly)
    calib_window = o.calib_window if "calib_window" in o.model_fields_set else None
    written = o.write_kwargs()
    dtype, force, max_shard_bytes = written["dtype"], written["force"], written["max_shard_bytes"]
    allow_pickle = written["allow_pickle"]
    start = time.time()
    config = src.config
    layers, context = check_request(config, window, global_layers, sinks)
    count = global_layers.resolve_count(layers)
    check_output_path(out, force, source=src.folder)
    reader = CheckpointReader(src.folder, allow_pickle=allow_pickle)
    scores, calibration = None, None
    if global_layers.auto:
        length = calib_window or min(AUTO_WINDOWS * window, context or AUTO_WINDOWS * window)
        if length <= window:
            raise SurgeryError(f"--global-layers auto scores what each layer attends beyond the window: calibration "
                               f"windows of {length} tokens must be longer than --window {window}")
        dev = pick_device(o.device)
        resolved = resolve_precision(o.precision, dev)
        tokenizer = load_tokenizer(src)
        text = calibration_text(o.calib, tokenizer, o.calib_tokens, context, window=length,
                                chat_template=o.chat_template)
        if text.windows.shape[1] <= window:
            raise SurgeryError(f"the calibration text gave windows of {text.windows.shape[1]} tokens, not longer than "
                               f"--window {window}: give more --calib-tokens or a longer text")
        chunk = chunk_windows(config, int(text.windows.shape[1]), requested=o.calib_chunk)
        calib_start = time.time()
        with calibrating(resolved, dev):
            if layer_score == "cost":
                scores, rounds, chosen = _cost_scores(src, reader, tokenizer, text.windows, dev, window, chunk,
                                                      layers, count, progress)
            else:
                from .score import layer_scores

                scores, rounds = layer_scores(src.folder, reader, text.windows, dev, window, chunk, progress), None
                chosen = top_layers(scores, count)
        calibration = text.record() | {"device": str(dev), "precision": resolved, "chunk_windows": chunk,
                                       "seconds": round(time.time() - calib_start, 3), "score": SCORES[layer_score]}
        if rounds:
            calibration["rounds"] = rounds
    else:
        chosen = list(global_layers.indices) if global_layers.indices is not None else evenly_spaced(count, layers)
    types = layer_types(layers, chosen)
    new_config = target_config(config, window, types, dtype, sinks)

    swa = {"window": window, "global_layers": chosen, "asked": global_layers.describe(), "layers": layers,
           "target_model_type": new_config["model_type"]}
    if global_layers.auto:
        swa["layer_score"] = layer_score
    if scores is not None:
        swa["scores"] = [round(s, 6) for s in scores]
    fields = {"architecture": {"spec": config["model_type"], "target_model_type": new_config["model_type"]},
              "swa": swa}
    if sinks:
        swa["sinks"] = {"init": SINK_INIT, "per": "query head and layer"}
        fields["new_parameters"] = [SINK_NAMES]
    if calibration:
        fields["calibration"] = calibration

    planned = plan(reader, dtype) + (sink_tensors(config, reader, dtype) if sinks else [])
    return write_conversion(src, reader, out, planned, new_config, KIND, fields, dtype=dtype, start=start,
                            force=force, progress=progress, max_shard_bytes=max_shard_bytes)
