"""The attention inputs' second moments, layer by layer, for the MLA factorisation (one streamed pass).

Each layer's attention input x (the normalised hidden states entering q/k/v) on the source model's own residual
stream gives Sigma = E[x x^T], accumulated in float64 on the device; only one layer's weights and the chunks'
hidden states are alive at a time. Sigma goes to a LayerStore (spilled to disk beside the output) and the layer's
per-frequency logit scores (`frequency_scores`) are kept, so that the one RoPE frequency set the whole model shares
can be chosen before any layer is written.
"""

from __future__ import annotations

import torch

from ..calibration.stream import LayerProgress, open_stream, run_layer
from ..calibration.store import LayerStore
from ..merge import capture
from ..threads import threads
from .factor import frequency_scores


@torch.no_grad()
def second_moments(folder, reader, spec, windows: torch.Tensor, device: torch.device, store: LayerStore,
                   read_layer, pairs: str, chunk_windows: int = 8, progress: bool = True) -> list[torch.Tensor]:
    """Store every layer's Sigma [H, H] (float32) in `store`; return every layer's frequency scores."""
    scores = []
    with threads(torch.get_num_threads()):
        stream = open_stream(folder, reader, device, attn_implementation="sdpa")
        chunks = list(windows.split(chunk_windows))
        stream.plan_offload(windows.numel(), streams=2)
        hidden, calls = stream.embed_chunks(chunks)
        stream.release_embeddings()
        with LayerProgress("calibrate", len(stream), progress) as bar:
            for index, path, layer in stream.layers():
                attention = layer.get_submodule(spec.attention)
                in_module = attention.get_submodule(spec.q)
                sigma, count = None, 0
                for i in range(len(chunks)):
                    h = stream.fetch(hidden[i])
                    x = capture.attention_input(layer, attention, in_module, h, calls[i][index]).x
                    flat = x.reshape(-1, x.shape[-1]).double()
                    part = flat.T @ flat
                    sigma = part if sigma is None else sigma + part
                    count += flat.shape[0]
                    hidden[i] = stream.stash(run_layer(layer, h, calls[i][index]))
                sigma = (sigma / count).cpu()
                scores.append(frequency_scores(read_layer(index), sigma, pairs))
                store.put(index, {"sigma": sigma.float()})
                bar.update()
    return scores

