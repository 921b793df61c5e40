"""The calibrated SwitchHead conversion, one decoder layer at a time.

The source streams through `surgery.calibration.stream` on the calibration windows. For each layer, on its input
hidden states: calibration (head distances, router fits; `calibrate.py`), balanced head clusters, the layer's new
tensors (`build.py`), the output-expert refit on the same pass's captured attention calls (`refit.py`); the tensors
go to the layer store and the layer is freed.

The input hidden states (`inputs`): "converted" (the default) runs each layer again with its SwitchHead attention
in place of the source's, so that the next layer is calibrated, clustered and refit on the residual stream the
converted model really produces, its targets being the source attention on those same inputs (as the aligned
merge does, `surgery/kv/aligned/pipeline.py`); "source" calibrates every layer on the source's own hidden states.
Measured on SmolLM2-135M, H=3 E=3 k=2, 8,192 calibration tokens, `surgery check --tokens 16384` (pydoc[0:16384],
never calibrated on): perplexity 41.75 = 3.14x the source's 13.28 with "converted", 62.53 = 4.71x with "source".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..calibration.chunks import EAGER_WINDOWS
from ..calibration.stream import LayerProgress, LayerStream, run_layer
from .build import layer_tensors
from .calibrate import LayerFit, attention_module, attention_path, calibrate_layer, source_captures
from .cluster import cluster_heads, medoid
from .refit import refit_layer, switchhead_attention

# windows per forward: one (the chunk rule's EAGER_WINDOWS, surgery/calibration/chunks.py), as the in-memory path
# ran them. The router fit and the output refit solve ill-conditioned systems, which turn float32 summation-order
# differences from batching windows into ~1% changes of the routers; one window per forward keeps every product,
# and so the fits, identical (`--calib-chunk N` trades that for speed).
CHUNK_WINDOWS = EAGER_WINDOWS


@torch.no_grad()
def convert_hidden(layer: torch.nn.Module, config, settings: dict, tensors: dict[str, torch.Tensor], hidden,
                   calls: list, stream: LayerStream) -> None:
    """Replace every chunk of `hidden` (in place, one chunk at a time) by the decoder layer's output with its
    attention replaced by the SwitchHead attention holding `tensors`."""
    path = attention_path(layer)
    source = layer.get_submodule(path)
    layer.set_submodule(path, switchhead_attention(source, config, settings, tensors))
    try:
        for i, call in enumerate(calls):
            hidden[i] = stream.stash(run_layer(layer, stream.fetch(hidden[i]), call))
    finally:
        layer.set_submodule(path, source)


@dataclass
class CalibratedLayers:
    fits: list[LayerFit]
    clusters: list[list[list[int]]]
    pivots: list[list[int]] | None
    refit: list[dict] | None


@torch.no_grad()
def calibrate_layers(stream: LayerStream, builder, windows: torch.Tensor, mode: str, qk_merge: str, refit: bool,
                     ridge: float, progress: bool = True, chunk_windows: int = CHUNK_WINDOWS,
                     inputs: str = "converted") -> CalibratedLayers:
    """Calibrate and convert every layer `stream` serves; each layer's tensors go to `builder.tensors` (a store).
    `inputs`: each layer calibrates on the hidden states of the layers before it already converted ("converted")
    or on the source's own ("source")."""
    shape = builder.shape
    settings = {"heads": shape.new_heads, "experts": shape.experts, "topk": shape.topk, "head_dim": shape.head_dim}
    stream.plan_offload(windows.numel(), streams=4)
    hidden, calls = stream.embed_chunks(list(windows.split(chunk_windows)))
    stream.release_embeddings()
    result = CalibratedLayers([], [], [] if qk_merge == "medoid" else None, [] if refit else None)
    with LayerProgress("calibrate switchhead", len(stream), progress) as bar:
        for index, _, layer in stream.layers():
            layer_calls = [c[index] for c in calls]
            fit, captures, outputs = calibrate_layer(layer, hidden, layer_calls, shape.heads, shape.kv_heads,
                                                     shape.head_dim, stream.fetch, keep_calls=False,
                                                     keep_outputs=inputs == "source")
            source_hidden = hidden
            if inputs == "source":
                hidden = [stream.stash(h) for h in outputs]
            del outputs
            clusters = cluster_heads(fit.distance, shape.heads, shape.kv_heads, shape.new_heads, mode)
            pivots = [medoid(fit.distance, c) for c in clusters] if qk_merge == "medoid" else None
            source = builder.source_attention(index)
            source = dataclasses.replace(source, **{f.name: getattr(source, f.name).to(stream.device)
                                                    for f in dataclasses.fields(source)
                                                    if getattr(source, f.name) is not None})
            tensors = layer_tensors(source, clusters, shape, fit.router_o, fit.router_v, pivots)
            if refit:
                captures = source_captures(layer, source_hidden, layer_calls, stream.fetch)  # recomputed per chunk
                result.refit.append(refit_layer(attention_module(layer), stream.config, settings, tensors, captures,
                                                ridge))
            del source_hidden
            if inputs == "converted":  # the next layer calibrates on what this converted layer outputs
                convert_hidden(layer, stream.config, settings, tensors, hidden, layer_calls, stream)
            builder.tensors.put(index, tensors)
            result.fits.append(dataclasses.replace(fit, router_o=None, router_v=None))
            result.clusters.append(clusters)
            if pivots is not None:
                result.pivots.append(pivots)
            bar.update()
    return result
