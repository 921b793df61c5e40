"""SwitchHead conversion: source checkpoint -> calibration (head distances, router fits) -> balanced head clusters
per layer -> new attention tensors -> a complete checkpoint with its own modeling code (`auto_map`).

Every tensor outside the attention projections is copied byte for byte. The output loads with
`AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)` where this toolkit is not installed.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..checkpoint.atomic import check_output_path
from ..calibration.store import LayerStore
from ..calibration.stream import open_stream
from ..calibration.chunks import chunk_windows
from ..calibration.text import calibration_text, context_of
from ..checkpoint.writer import write_conversion
from ..errors import SurgeryError
from ..arch import attention_shape
from ..precision import calibrating, resolve_precision
from ..runtime import load_tokenizer, pick_device
from ..checkpoint.source import Source
from ..checkpoint.tensors import CheckpointReader, DTYPES, PlannedTensor
from .build import SwitchHeadShape, layer_tensors
from .layers import calibrate_layers
from .cluster import cluster_heads, kv_mapping, within_cost
from .families import Family, attention_tensors, biases, check_attention_shapes, family_for, read_attention
from .refit import RIDGE

if TYPE_CHECKING:
    from .options import SwitchHeadOptions

QK_MERGES = ("medoid", "mean")
LAYER_INPUTS = {
    "converted": "each layer is calibrated on the hidden states of the layers before it already converted; its "
                 "targets are the source attention's outputs on those inputs",
    "source": "each layer is calibrated on the source model's own hidden states",
}
CODE_FILES = ("configuration_switchhead.py", "modeling_switchhead.py")
KV_NOTES = {
    "within-groups": "every cluster lies inside one K/V group of the source: its key projection is the group's K "
                     "head (exact) and its value experts start from the group's V head",
    "whole-groups": "every cluster is made of whole K/V groups of the source: its key projection is the mean of "
                    "their K heads, its value experts are the members' V heads",
    "free": "heads are clustered one by one: a cluster's key projection is the mean of its members' K heads, its "
            "value experts are the members' V heads",
}
INIT_NOTE = ("q_proj and k_proj of a head: the members' mean query and K head (qk_merge=medoid: those of the "
             "member whose attention is closest to the others'); value expert e: V head of member e times "
             "2/k; output expert e: O slice of member e times 2 (gates start near sigmoid(0) = 1/2: the output side "
             "sums the selected experts, the value side averages them), then refit by ridge regression to the "
             "source's attention output on calibration text (output_refit); routers: zero when E = 1 (exact), else "
             "ridge fits of each member's per-token importance, scaled to rms 0.1 (top-k ranks by them, gates stay "
             "near 1/2)")


def switchhead_shape(config: dict, heads: int, experts: int, topk: int) -> SwitchHeadShape:
    try:
        a = attention_shape(config)
    except (KeyError, TypeError, ValueError) as e:
        raise SurgeryError(f"config.json lacks a usable head count ({e})") from None
    h = a["heads"]
    if heads < 1 or experts < 1:
        raise SurgeryError(f"--heads and --experts must be at least 1, got {heads} and {experts}")
    if heads * experts != h:
        pairs = ", ".join(f"--heads {n} --experts {h // n}" for n in range(1, h + 1) if h % n == 0)
        raise SurgeryError(f"--heads {heads} x --experts {experts} must equal the source's {h} heads (each head's "
                           f"experts are the source heads of one cluster); choose from {pairs}")
    if not 1 <= topk <= experts:
        raise SurgeryError(f"--topk must lie between 1 and --experts {experts}, got {topk}")
    if h % a["kv_heads"]:
        raise SurgeryError(f"the source's {a['kv_heads']} K/V heads do not divide its {h} query heads")
    return SwitchHeadShape(layers=a["layers"], hidden=a["hidden"], heads=h, kv_heads=a["kv_heads"],
                           head_dim=a["head_dim"], new_heads=heads, experts=experts, topk=topk)


def target_config(config: dict, family: Family, shape: SwitchHeadShape, dtype: str | None,
                  bias: dict[str, bool] | None = None) -> dict:
    new = {k: v for k, v in config.items() if not k.startswith("_attn_implementation")}
    spec = family.spec
    new["model_type"] = f"switchhead_{family.model_type}"
    new["architectures"] = [family.architecture]
    new["auto_map"] = family.auto_map()
    new[spec.heads_key] = shape.new_heads
    if spec.kv_heads_key:
        new[spec.kv_heads_key] = shape.new_heads
    new["head_dim"] = shape.head_dim
    new["switchhead"] = {"heads": shape.new_heads, "experts": shape.experts, "topk": shape.topk,
                         "head_dim": shape.head_dim, "source_heads": shape.heads, "source_kv_heads": shape.kv_heads}
    if bias is not None:
        new["switchhead"]["bias"] = bias
    if dtype:
        new["dtype"] = dtype
        new.pop("torch_dtype", None)
    return new


class LayerBuilder:
    """Serves every layer's new tensors: precomputed (calibrated conversions), or built from the source on demand
    (one expert per head: each layer computed once, as the writer asks for its tensors in order)."""

    def __init__(self, reader: CheckpointReader, family: Family, names: dict[int, dict[str, str]],
                 shape: SwitchHeadShape, clusters: list[list[list[int]]],
                 tensors: LayerStore | None, dtype: torch.dtype | None):
        self.reader, self.family, self.names, self.shape = reader, family, names, shape
        self.clusters, self.tensors, self.dtype = clusters, tensors, dtype
        self._layer, self._tensors = -1, {}

    def source_attention(self, layer: int):
        s = self.shape
        return read_attention(self.reader, self.family, self.names[layer], s.heads, s.kv_heads, s.head_dim)

    def biases(self) -> dict[str, bool]:
        return biases(self.family, self.names[0])

    def source_dtype(self, layer: int) -> torch.dtype:
        n = self.names[layer]
        return self.reader.tensors[n["qkv.weight" if self.family.fused else "q.weight"]].dtype

    def get(self, layer: int, key: str) -> torch.Tensor:
        if self.tensors is not None:
            return self.tensors.get(layer)[key].to(self.dtype or self.source_dtype(layer))
        if layer != self._layer:
            self._tensors = layer_tensors(self.source_attention(layer), self.clusters[layer], self.shape, None, None)
            self._layer = layer
        return self._tensors[key].to(self.dtype or self.source_dtype(layer))

    def plan(self, out_dtype: torch.dtype | None) -> list[PlannedTensor]:
        reader, family = self.reader, self.family
        replaced = {t for entry in self.names.values() for key, t in entry.items() if key != "module"}
        planned = []
        for name in reader.names():
            if name in replaced or (family.spec.drop_pattern and re.search(family.spec.drop_pattern, name)):
                continue
            info = reader.tensors[name]
            dtype = out_dtype if (out_dtype and info.dtype.is_floating_point) else info.dtype
            if dtype == info.dtype and not reader.is_pickle:
                planned.append(PlannedTensor(family.out_name(name), dtype, info.shape, raw_source=(reader, name)))
            else:
                planned.append(PlannedTensor(family.out_name(name), dtype, info.shape,
                                             produce=lambda n=name, dt=dtype: reader.load(n).to(dt).contiguous()))
        shapes = self.shape.tensor_shapes(self.biases())
        for layer in sorted(self.names):
            module = family.out_name(self.names[layer]["module"])
            dtype = out_dtype or self.source_dtype(layer)
            for key, tshape in shapes.items():
                planned.append(PlannedTensor(f"{module}.{key}", dtype, tshape,
                                             produce=lambda layer=layer, key=key: self.get(layer, key)))
        return planned


def layer_pattern(family: Family, module: str) -> str:
    """The in-memory name pattern of every layer's attention module, from layer 0's checkpoint name."""
    return re.sub(r"(?<=\.)0(?=\.|$)", "*", family.out_name(module), count=1)


def convert_to_switchhead(src: Source, out: Path, options: "SwitchHeadOptions", progress: bool = True, *,
                          respect_kv_groups: bool = True, qk_merge: str = "mean", refit: bool = True,
                          ridge: float = RIDGE, calib_inputs: str = "converted") -> dict:
    """Convert every self-attention layer of `src` into SwitchHead attention with H=`options.heads` heads of
    E=`options.experts` experts, k=`options.topk` selected per token; write the checkpoint to `out`. Returns the
    surgery.json record. `options` is the kind's options model (surgery/switchhead/options.py), validated where it was
    built: this checks only what needs the source's config.

    `seed` is recorded but nothing is random: calibration, clustering and initialisation are deterministic.
    Ablations: `respect_kv_groups=False` clusters a GQA source's heads freely (see cluster.py); `qk_merge="medoid"`
    takes the medoid member's query and key instead of the members' mean; `refit=False` keeps the members' own
    output projections (see refit.py; `ridge` is its pull toward them); `calib_inputs="source"` calibrates every
    layer on the source's own hidden states instead of the converted layers' (see layers.py). The calibration's
    forward passes compute in `options.precision` (surgery/precision.py), its statistics in float32/64."""
    _check_ablations(qk_merge, calib_inputs)
    o = options
    writing = o.write_kwargs()
    dtype, force, max_shard_bytes = writing["dtype"], writing["force"], writing["max_shard_bytes"]
    check_output_path(out, force, source=src.folder)
    config = src.config
    family = family_for(config)
    shape = switchhead_shape(config, o.heads, o.experts, o.topk)
    reader = CheckpointReader(src.folder, allow_pickle=o.allow_pickle)
    names = attention_tensors(reader, family)
    check_attention_shapes(reader, family, names, shape.layers, shape.heads, shape.kv_heads, shape.head_dim, shape.hidden)
    mode = kv_mapping(shape.heads, shape.kv_heads, shape.new_heads, respect_kv_groups)
    out_dtype = DTYPES.get(dtype) if dtype else None
    pick_device(o.device)  # a bad --device fails before any work
    start = time.time()

    if o.experts == 1:  # one source head per head: no choice to make, nothing to calibrate; exact
        clusters = [cluster_heads(None, shape.heads, shape.kv_heads, shape.new_heads, mode)] * shape.layers
        builder = LayerBuilder(reader, family, names, shape, clusters, None, out_dtype)
        calibrated = Calibrated(clusters)
    else:
        builder = LayerBuilder(reader, family, names, shape, [], None, out_dtype)
        calibrated = _calibrate(src, reader, out, builder, mode, o, qk_merge, refit, ridge, progress, start,
                                calib_inputs)
    planned = builder.plan(out_dtype)
    new_config = target_config(config, family, shape, dtype, builder.biases())
    settings = {"mode": mode, "qk_merge": qk_merge, "ridge": ridge, "seed": o.seed,
                "pattern": layer_pattern(family, names[0]["module"])}
    fields = _record_fields(config, new_config, shape, calibrated, settings)
    record = write_conversion(src, reader, out, planned, new_config, "switchhead", fields, dtype=dtype, start=start,
                              force=force, progress=progress, max_shard_bytes=max_shard_bytes,
                              code_dir=Path(__file__).parent, code_files=CODE_FILES)
    if builder.tensors is not None:
        builder.tensors.close()
    return record


def _check_ablations(qk_merge: str, calib_inputs: str) -> None:
    """The ablations' arguments (the kind's options are checked by their model)."""
    if qk_merge not in QK_MERGES:
        raise SurgeryError(f"unknown query/key merge {qk_merge!r}; choose from {', '.join(QK_MERGES)}")
    if calib_inputs not in LAYER_INPUTS:
        raise SurgeryError(f"unknown calibration inputs {calib_inputs!r}; choose from {', '.join(LAYER_INPUTS)}")


@dataclass
class Calibrated:
    """What calibration decided (E > 1), or the fixed clusters of one expert per head (E = 1: nothing calibrated)."""

    clusters: list[list[list[int]]]
    fits: list | None = None
    pivots: list | None = None
    refit_report: list | None = None
    calibration: dict | None = None


def _calibrate(src: Source, reader: CheckpointReader, out: Path, builder: LayerBuilder, mode: str,
               o: "SwitchHeadOptions", qk_merge: str, refit: bool, ridge: float, progress: bool, start: float,
               inputs: str) -> Calibrated:
    """Stream the source layer by layer over the calibration text (as the options `o` ask): head distances and
    clusters, router fits and the output refit per layer; the new tensors go into a layer store the builder
    serves."""
    dev = pick_device(o.device)
    resolved = resolve_precision(o.precision, dev)
    text = calibration_text(o.calib, load_tokenizer(src), o.calib_tokens, context_of(src.config),
                            window=o.calib_window, chat_template=o.chat_template)
    builder.tensors = LayerStore(out)  # removes itself when closed, dropped on an error, or at exit
    stream = open_stream(src.folder, reader, dev, attn_implementation="eager")
    stream.spill_into(builder.tensors.scratch("residual"), out)
    chunk = chunk_windows(src.config, int(text.windows.shape[1]), requested=o.calib_chunk, eager=True)
    with calibrating(resolved, dev):
        layers = calibrate_layers(stream, builder, text.windows, mode, qk_merge, refit, ridge, progress,
                                  chunk_windows=chunk, inputs=inputs)
    builder.clusters = layers.clusters
    calibration = text.record() | {
        "device": str(dev),
        "precision": resolved,
        "streaming": "layer by layer from the checkpoint (float32 on the device, eager attention)",
        "layer_inputs": LAYER_INPUTS[inputs],
        "chunk_windows": chunk,
        "distance": "mean over query rows of the squared L2 distance between two heads' attention probabilities",
        "seconds": round(time.time() - start, 3)}
    return Calibrated(layers.clusters, layers.fits, layers.pivots, layers.refit, calibration)


def _record_fields(config: dict, new_config: dict, shape: SwitchHeadShape, c: Calibrated, settings: dict) -> dict:
    """surgery.json's fields of a SwitchHead conversion (after the envelope every record has)."""
    fits, clusters, pattern = c.fits, c.clusters, settings["pattern"]
    return {
        "architecture": {"source_model_type": config.get("model_type"), "target_model_type": new_config["model_type"],
                         "architectures": new_config["architectures"]},
        "layers": shape.layers,
        "head_dim": shape.head_dim,
        "heads": {"before": shape.heads, "after": shape.new_heads},
        "kv_heads": {"before": shape.kv_heads, "after": shape.new_heads},
        "experts": shape.experts,
        "topk": shape.topk,
        "kv_mapping": {"mode": settings["mode"], "note": KV_NOTES[settings["mode"]]},
        "clusters": clusters,
        "clusters_note": "clusters[layer][head] = the source query heads that became that head's experts, in "
                         "expert order",
        "cluster_distance": [round(within_cost(f.distance, c), 6) for f, c in zip(fits, clusters)] if fits else None,
        "qk_merge": settings["qk_merge"] if shape.experts > 1 else None,
        "qk_pivots": c.pivots,
        "output_refit": ({"ridge": settings["ridge"], "relative_error": c.refit_report} if c.refit_report else None),
        "router_fit_explained": ({"output": [round(f.r2_o, 4) for f in fits], "value": [round(f.r2_v, 4) for f in fits]}
                                 if fits else None),
        "calibration": c.calibration,
        "init": INIT_NOTE,
        "exact_at_init": shape.experts == 1,
        "new_parameters": [f"{pattern}.v_router.weight", f"{pattern}.o_router.weight"],
        "added_parameters": 2 * shape.layers * shape.new_heads * shape.experts * shape.hidden,
        "seed": settings["seed"],
    }
