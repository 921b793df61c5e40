"""The hybrid conversion: choose the layers that keep attention, calibrate the mixers' statistics (and, for `auto`,
score the layers), then stream the output tensor by tensor: the body and the kept attention copied (byte for byte
where the dtype stays), each replaced layer's Mamba-2 mixer built from its attention (init.py) when its turn comes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import time
from pathlib import Path

from ..calibration.chunks import chunk_windows
from ..calibration.text import calibration_text, context_of
from ..checkpoint.atomic import check_output_path
from ..checkpoint.source import Source
from ..checkpoint.tensors import DTYPES, CheckpointReader, PlannedTensor
from ..checkpoint.writer import write_conversion
from ..precision import calibrating, resolve_precision
from ..runtime import load_tokenizer, pick_device
from . import init
from .family import KIND, check_family, output_name, target_config
from .layers import AttentionLayers, evenly_spaced, top_layers

if TYPE_CHECKING:
    from .options import HybridOptions

CALIB_WINDOW = 512  # calibration windows' length (capped by the context)
SCORE = ("how far replacing the layer's attention by its initialised mixer moves the residual stream: the squared "
         "distance between the two outputs on the source's own layer input, over the squared norm of that input, "
         "on calibration text")


def check_request(config: dict, attention_layers: AttentionLayers, conv_kernel: int) -> dict:
    """The family, the layer choice and the mixer sizes checked against config.json before any work; the sizes."""
    sizes = check_family(config, conv_kernel)
    attention_layers.check(sizes["layers"])
    return sizes


class _MixerTensors:
    """One replaced layer's mixer tensors at a time: built when the first of them is written, dropped after."""

    def __init__(self, reader: CheckpointReader, sizes: dict, conv_kernel: int, context: int, stats: dict):
        self.reader, self.sizes, self.conv_kernel, self.context, self.stats = reader, sizes, conv_kernel, context, stats
        self.layer, self.tensors = None, {}

    def get(self, layer: int, name: str, dtype):
        if self.layer != layer:
            p = f"model.layers.{layer}.self_attn."
            q, k, v, o = (self.reader.load(p + f"{n}_proj.weight") for n in "qkvo")
            s = self.stats[layer]
            self.tensors = init.mixer_tensors(q, k, v, o, self.sizes, self.conv_kernel, self.context,
                                              s.mean_input, s.norm_weight)
            self.layer = layer
        return self.tensors[name].to(dtype).contiguous()


def plan(reader: CheckpointReader, sizes: dict, attention: list[int], conv_kernel: int, context: int, stats: dict,
         dtype: str | None) -> list[PlannedTensor]:
    out = DTYPES.get(dtype) if dtype else None
    keep = set(attention)
    mixers = _MixerTensors(reader, sizes, conv_kernel, context, stats)
    shapes = init.mixer_shapes(sizes, conv_kernel)
    planned: list[PlannedTensor] = []
    floats = None
    for name in reader.names():
        new, layer = output_name(name, keep)
        info = reader.tensors[name]
        if info.dtype.is_floating_point and floats is None:
            floats = out or info.dtype
        if new is None:
            continue
        if (out is None or not info.dtype.is_floating_point or out == info.dtype) and not reader.is_pickle:
            planned.append(PlannedTensor(new, info.dtype, info.shape, raw_source=(reader, name)))
        else:
            to = out if (out is not None and info.dtype.is_floating_point) else info.dtype
            planned.append(PlannedTensor(new, to, info.shape,
                                         produce=lambda n=name, to=to: reader.load(n).to(to).contiguous()))
    for layer in range(sizes["layers"]):
        if layer in keep:
            continue
        for rel, shape in shapes.items():
            planned.append(PlannedTensor(f"model.layers.{layer}.mamba.{rel}", floats, shape,
                                         produce=lambda i=layer, r=rel: mixers.get(i, r, floats)))
    return planned


def convert_to_hybrid(src: Source, out: Path, options: "HybridOptions", progress: bool = True) -> dict:
    """Write `src` as a Bamba hybrid to `out`: `options.attention_layers` keep their attention, the others become
    Mamba-2 mixers initialised from it. `options` is the kind's options model (surgery/hybrid/options.py), validated
    where it was built; this checks only what needs the source's config. The mixers' statistics (and `auto`'s
    scores) come from `calib_tokens` calibration tokens in windows of `calib_window` (when given; else 512, capped
    by the context)."""
    o = options
    attention_layers, conv_kernel = o.parsed_attention_layers, o.conv_kernel
    calib_window = o.calib_window if "calib_window" in o.model_fields_set else None
    written = o.write_kwargs()
    dtype, force, max_shard_bytes = written["dtype"], written["force"], written["max_shard_bytes"]
    start = time.time()
    config = src.config
    sizes = check_request(config, attention_layers, conv_kernel)
    layers, context = sizes["layers"], context_of(config) or 4096
    count = attention_layers.resolve_count(layers)
    check_output_path(out, force, source=src.folder)
    reader = CheckpointReader(src.folder, allow_pickle=written["allow_pickle"])
    if attention_layers.auto or attention_layers.indices is None:
        fixed = None if attention_layers.auto else evenly_spaced(count, layers)
    else:
        fixed = list(attention_layers.indices)
    stats, calibration, scores = {}, None, None
    needs = list(range(layers)) if fixed is None else [i for i in range(layers) if i not in fixed]
    if needs:
        dev = pick_device(o.device)
        resolved = resolve_precision(o.precision, dev)
        tokenizer = load_tokenizer(src)
        length = min(calib_window or CALIB_WINDOW, context)
        text = calibration_text(o.calib, tokenizer, o.calib_tokens, context, window=length,
                                chat_template=o.chat_template)
        chunk = chunk_windows(config, int(text.windows.shape[1]), requested=o.calib_chunk)
        target = target_config(config, sizes, [], conv_kernel, None)
        calib_start = time.time()
        with calibrating(resolved, dev):
            from .calibrate import calibrate

            result = calibrate(src.folder, reader, text.windows, dev, chunk, sizes, target, conv_kernel, context,
                               needs, score=fixed is None, progress=progress)
        stats = result.layers
        calibration = text.record() | {"device": str(dev), "precision": resolved, "chunk_windows": chunk,
                                       "seconds": round(time.time() - calib_start, 3)}
        if fixed is None:
            scores = [stats[i].score for i in range(layers)]
            calibration["score"] = SCORE
    chosen = fixed if fixed is not None else top_layers(scores, count)
    new_config = target_config(config, sizes, chosen, conv_kernel, dtype)
    replaced = [i for i in range(layers) if i not in chosen]

    hybrid = {"attention_layers": chosen, "mixer_layers": replaced, "asked": attention_layers.describe(),
              "layers": layers, "target_model_type": new_config["model_type"],
              "mixer": {"n_heads": sizes["heads"], "n_groups": sizes["heads"], "d_head": sizes["head_dim"],
                        "d_state": sizes["head_dim"], "d_conv": conv_kernel},
              "init": {"map": "C<-q_proj, B<-k_proj (K/V heads repeated per query head), x<-v_proj, "
                              "out_proj<-o_proj", "conv1d": "identity (last tap 1)", "dt": init.DT,
                       "A": -1.0 / context, "D": 0.0, "x_scale": init.X_SCALE,
                       "gate": f"every z row {init.GATE_SCALE} x the mean direction of the layer's normed input",
                       "norm_weight": "least squares per channel: the normed mixer output onto the source attention's "
                                      "output before o_proj"},
              "gate_open": {str(i): round(stats[i].gate_open, 4) for i in replaced if i in stats}}
    if scores is not None:
        hybrid["scores"] = [round(s, 6) for s in scores]
    fields = {"architecture": {"spec": config["model_type"], "target_model_type": new_config["model_type"]},
              "hybrid": hybrid}
    if replaced:
        fields["new_parameters"] = ["model.layers.{layer}.mamba.*"]
    if calibration:
        fields["calibration"] = calibration

    return write_conversion(src, reader, out, plan(reader, sizes, chosen, conv_kernel, context, stats, dtype),
                            new_config, KIND, fields, dtype=dtype, start=start, force=force, progress=progress,
                            max_shard_bytes=max_shard_bytes)
