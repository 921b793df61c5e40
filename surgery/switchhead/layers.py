"""The calibrated SwitchHead conversion, one decoder layer at a time.

The source streams through `surgery.calibration.stream` on the calibration windows. For each layer, on its input
hidden states (the source's own): calibration (head distances, router fits; `calibrate.py`), balanced head
clusters, the layer's new tensors (`build.py`), the output-expert refit on the same pass's captured attention
calls (`refit.py`); the tensors go to the layer store and the layer is freed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..calibration.stream import LayerProgress, LayerStream
from .build import layer_tensors
from .calibrate import LayerFit, attention_module, calibrate_layer
from .cluster import cluster_heads, medoid
from .refit import refit_layer

# windows per forward: one, as the in-memory path ran them. The router fit and the output refit solve
# ill-conditioned systems, which turn float32 summation-order differences from batching windows into ~1% changes
# of the routers; one window per forward keeps every product, and so the fits, identical.
CHUNK_WINDOWS = 1


@dataclass
class CalibratedLayers:
    fits: list[LayerFit]
    clusters: list[list[list[int]]]
    pivots: list[list[int]] | None
    refit: list[dict] | None


@torch.no_grad()
def calibrate_layers(stream: LayerStream, builder, windows: torch.Tensor, mode: str, qk_merge: str, refit: bool,
                     ridge: float, progress: bool = True, chunk_windows: int = CHUNK_WINDOWS) -> CalibratedLayers:
    """Calibrate and convert every layer `stream` serves; each layer's tensors go to `builder.tensors` (a store)."""
    shape = builder.shape
    settings = {"heads": shape.new_heads, "experts": shape.experts, "topk": shape.topk, "head_dim": shape.head_dim}
    stream.plan_offload(windows.numel(), streams=4)
    hidden, calls = stream.embed_chunks(list(windows.split(chunk_windows)))
    stream.release_embeddings()
    result = CalibratedLayers([], [], [] if qk_merge == "medoid" else None, [] if refit else None)
    with LayerProgress("calibrate switchhead", len(stream), progress) as bar:
        for index, _, layer in stream.layers():
            fit, captures, outputs = calibrate_layer(layer, hidden, [c[index] for c in calls], shape.heads,
                                                     shape.kv_heads, shape.head_dim, stream.fetch, keep_calls=refit)
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
                result.refit.append(refit_layer(attention_module(layer), stream.config, settings, tensors, captures,
                                                ridge))
            del captures
            builder.tensors.put(index, tensors)
            result.fits.append(dataclasses.replace(fit, router_o=None, router_v=None))
            result.clusters.append(clusters)
            if pivots is not None:
                result.pivots.append(pivots)
            bar.update()
    return result
