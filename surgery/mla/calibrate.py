"""Calibration of the MLA conversion: two streamed passes over the model's layers (one layer's weights alive).

1. `frequency_scores_pass` (only when some rotary frequencies are dropped): on the source's own residual stream,
   every layer's per-frequency contribution to the logits (MHA2MLA's 2-norm score), so that the one frequency set
   the whole model shares (DeepSeek has one rope_theta) is chosen before any layer is converted.
2. `convert_pass`: on the converted model's own residual stream (layer l sees what layers 0..l-1, already
   converted, output, as the aligned merge's `targets="local"`): the layer's attention input x gives Sigma =
   E[x x^T] for the factorisation (surgery/mla/factor.py); q_proj is refit on the same x so that each head's
   logits against its MLA keys reproduce the source head's (the aligned merge's `QueryFit`, one head per group);
   the converted attention (`MLAGeometry.attend`, DeepSeek's computation) then runs on x, o_proj is refit by ridge
   regression onto the source layer's attention output on that x (the aligned merge's `OutputFit`), and the
   converted layer's output feeds the next layer.
   With retrieval examples among the windows (`retrieval`, surgery/mla/retrieval.py), the second moments' pass also
   scores the source heads on them and sums their needle and answer rows; the layer's `FitWeights` then reach the
   factorisation (`build`) and the query refit's head weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..calibration.chunks import MAX_WINDOWS
from ..calibration.stream import LayerProgress, run_layer
from ..calibration import capture
from ..fitting.refit import OutputFit, QueryFit, QueryRefit
from ..fitting.rotary import RotaryPairs
from ..fitting.shape import refit_shape
from ..runtime import threads
from .factor import MLAWeights, SourceAttention, frequency_scores
from .retrieval import RetrievalCalibration

O_RIDGE = 0.1  # the aligned merge's output-refit ridge (relative to the Gram's mean diagonal)


@dataclass(frozen=True)
class MLAGeometry:
    """The sizes DeepSeek-V3's attention needs beside its weights: heads, no-position / rope / value dims per head,
    rope_theta and kv_a_layernorm's epsilon."""

    heads: int
    nope: int
    rope: int
    v_dim: int
    theta: float
    eps: float

    @property
    def scale(self) -> float:
        return (self.nope + self.rope) ** -0.5

    def rotary(self, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [L, rope/2] of positions 0..L-1 (one angle per interleaved pair)."""
        inv_freq = 1.0 / self.theta ** (torch.arange(0, self.rope, 2, dtype=torch.float64, device=device) / self.rope)
        angle = torch.arange(length, dtype=torch.float64, device=device)[:, None] * inv_freq[None]
        return angle.cos(), angle.sin()

    def pairs(self) -> RotaryPairs:
        """The rotating pairs of one MLA head [no-position dims, rope dims]: (nope + 2i, nope + 2i + 1)."""
        a = torch.arange(self.nope, self.nope + self.rope, 2)
        return RotaryPairs(a, a + 1, torch.arange(self.nope))

    def project(self, x: torch.Tensor, w: MLAWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """DeepSeek-V3's queries and keys [N, heads, L, nope + rope] (rope dims rotated, interleaved) and values
        [N, heads, L, v_dim] on windows x [N, L, H] starting at position 0 (q_lora_rank null)."""
        n, length, _ = x.shape
        f, heads, nope, rope = x.dtype, self.heads, self.nope, self.rope
        q = (x @ w.q_proj.T.to(f)).view(n, length, heads, nope + rope).transpose(1, 2)
        ckv = x @ w.kv_a.T.to(f)
        latent, k_rope = ckv[..., :-rope], ckv[..., -rope:]
        latent = latent * torch.rsqrt(latent.pow(2).mean(-1, keepdim=True) + self.eps) * w.kv_a_norm.to(f)
        kv = (latent @ w.kv_b.T.to(f)).view(n, length, heads, nope + self.v_dim).transpose(1, 2)
        cos, sin = (t.to(f) for t in self.rotary(length, x.device))

        def rotate(t):  # pairs (2i, 2i+1) rotated by frequency i, as DeepSeek's rope_interleave
            a, b = t[..., 0::2], t[..., 1::2]
            return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)

        k_rope = rotate(k_rope)[:, None].expand(n, heads, length, rope)
        query = torch.cat([q[..., :nope], rotate(q[..., nope:])], dim=-1)
        key = torch.cat([kv[..., :nope], k_rope], dim=-1)
        return query, key, kv[..., nope:]

    def attend(self, x: torch.Tensor, w: MLAWeights) -> torch.Tensor:
        """DeepSeek-V3's attention, causal, on windows x [N, L, H]; returns o_proj's input [N, L, heads * v_dim]."""
        n, length, _ = x.shape
        query, key, value = self.project(x, w)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=self.scale)
        return out.transpose(1, 2).reshape(n, length, self.heads * self.v_dim)


def _modules(spec, layer):
    attention = layer.get_submodule(spec.attention)
    return attention, attention.get_submodule(spec.query_projection), attention.get_submodule(spec.o)


def _inputs(stream, spec, layer, index, hidden, calls):
    """Chunk by chunk, what the layer's attention receives (one chunk's attention input alive at a time: the layer's
    input norm runs again in each pass that needs it, instead of holding every token's input)."""
    attention, in_module, _ = _modules(spec, layer)
    for i in range(len(hidden)):
        yield capture.attention_input(layer, attention, in_module, stream.fetch(hidden[i]), calls[i][index])


def _second_moments(acalls, observer=None, chunk_seen: Callable | None = None) -> torch.Tensor:
    """E[x x^T] of the attention input; `observer` (None, or what has `add(rows)`) sees every chunk's rows too, and
    `chunk_seen(i, a)` (None: nothing) every chunk's attention call."""
    sigma, count = None, 0
    for i, a in enumerate(acalls):
        flat = a.x.reshape(-1, a.x.shape[-1]).double()
        sigma = flat.T @ flat if sigma is None else sigma + flat.T @ flat
        count += flat.shape[0]
        if observer is not None:
            observer.add(flat)
        if chunk_seen is not None:
            chunk_seen(i, a)
        del a, flat  # before the next chunk is computed: one chunk alive at a time
    return sigma / count  # on the stream's device: the factorisation runs there


@torch.no_grad()
def frequency_scores_pass(folder, reader, spec, windows: torch.Tensor, device: torch.device,
                          read_layer: Callable[[int], SourceAttention], pairs: str, chunk_windows: int = MAX_WINDOWS,
                          progress: bool = True, store=None) -> list[torch.Tensor]:
    """Every layer's per-frequency logit scores on the source's own residual stream."""
    scores = []
    with threads(torch.get_num_threads()):
        stream, hidden, calls = capture.open_recorded_stream(folder, reader, device, windows, chunk_windows, store)
        with LayerProgress("rope frequencies", len(stream), progress) as bar:
            for index, _, layer in stream.layers():
                sigma = _second_moments(_inputs(stream, spec, layer, index, hidden, calls))
                scores.append(frequency_scores(read_layer(index), sigma, pairs).cpu())
                for i in range(len(hidden)):
                    hidden[i] = stream.stash(run_layer(layer, stream.fetch(hidden[i]), calls[i][index]))
                bar.update()
    return scores


def _refit_q(stream, spec, layer, index, hidden, calls, weights: MLAWeights, geometry: MLAGeometry,
             opts: QueryRefit, generator: torch.Generator, head_weights: torch.Tensor | None = None) -> torch.Tensor:
    """q_proj refit as the aligned merge's (`QueryFit`): at sampled positions of every window, each head's query that
    best reproduces the source head's attention logits against the head's MLA keys (no-position keys through the
    latent, the shared rope key), weighted by the source's attention probabilities; q_proj regressed onto those
    queries (rope dims un-rotated), pulled toward the factorisation's. The MLA keys enter at the source's logit scale
    (DeepSeek's softmax scale over the source's), so the queries come out in MLA's own space. `head_weights` [H]
    (None: 1 each): each head's samples weigh that much against the pull (the retrieval heads')."""
    attention, _, out_module = _modules(spec, layer)
    heads, groups = geometry.heads, [[h] for h in range(geometry.heads)]
    fit = None
    with threads(1):
        for a in _inputs(stream, spec, layer, index, hidden, calls):
            record = capture.run_attention(attention, out_module, a).record
            q_src, k_src = record.queries[0], record.keys[0]
            k_src = k_src.repeat_interleave(heads // k_src.shape[1], dim=1)  # each query head against its K/V head
            query, key, _ = geometry.project(a.x, weights)
            key = key * (geometry.scale / record.scaling)
            n, length = a.x.shape[:2]
            cos, sin = (t.float().expand(n, length, -1) for t in geometry.rotary(length, a.x.device))
            if fit is None:
                fit = QueryFit(refit_shape(a.x, query, key, groups), length, groups, geometry.pairs(), record.scaling,
                               record.softcap, opts, generator, a.x.device, head_weights)
            fit.add(a.x, q_src, k_src, query, key, cos, sin)
            del a, record, q_src, k_src, query, key  # before the next chunk is computed
        q = fit.solve(weights.q_proj.to(stream.device, torch.float32))
    return q.double()


def _refit_o(stream, spec, layer, index, hidden, calls, weights: MLAWeights, geometry: MLAGeometry) -> torch.Tensor:
    """o_proj by ridge regression onto the source attention's output, its normal equations summed chunk by chunk
    (the source attention runs on each chunk here; memory is one chunk and the [H*v, H*v] Gram)."""
    attention, _, out_module = _modules(spec, layer)
    fit = OutputFit(weights.o_proj.to(stream.device, torch.float32), None)
    for a in _inputs(stream, spec, layer, index, hidden, calls):
        z = geometry.attend(a.x, weights)
        target = capture.run_attention(attention, out_module, a).output
        fit.add(z.reshape(-1, z.shape[-1]), target.reshape(-1, target.shape[-1]))
        del a, z, target  # before the next chunk is computed
    with threads(1):
        o, _ = fit.solve(O_RIDGE)
    return o.double()


@torch.no_grad()
def convert_pass(folder, reader, spec, windows: torch.Tensor, device: torch.device,
                 build: Callable[[int, torch.Tensor], MLAWeights], geometry: MLAGeometry, keep: Callable,
                 refit_q: QueryRefit | None = None, refit_o: bool = True, seed: int = 0,
                 chunk_windows: int = MAX_WINDOWS, progress: bool = True, store=None,
                 observer: Callable[[int], object] | None = None,
                 retrieval: RetrievalCalibration | None = None) -> None:
    """Convert every layer on the converted stream: `build(index, sigma)` gives the layer's MLA weights (with
    `retrieval`, the retrieval windows' scores and weights: `build(index, sigma, fit_weights)` when they change it),
    `keep(index, weights)` receives the final weights; `observer(index)` (None: nothing) is handed the layer's
    attention input rows while sigma is summed (surgery/mla/absorb.py's moments). Each step is a pass over the
    chunks (second moments, query refit, output refit, converted pass): past the residual stream, memory is one
    chunk."""
    generator = torch.Generator().manual_seed(seed)  # the query refit's sampled positions
    with threads(torch.get_num_threads()):
        stream, hidden, calls = capture.open_recorded_stream(folder, reader, device, windows, chunk_windows, store)
        with LayerProgress("calibrate + convert", len(stream), progress) as bar:
            for index, _, layer in stream.layers():
                attention = _modules(spec, layer)[0]
                # one layer's weights on the stream's device while its passes run (they multiply the device's
                # activations; the refits solve there too), handed to `keep` on the host
                seen = observer(index) if observer is not None else None
                chunk_seen = None if retrieval is None else _retrieval_pass(retrieval, spec, layer, index)
                sigma = _second_moments(_inputs(stream, spec, layer, index, hidden, calls), seen, chunk_seen)
                fit = None if retrieval is None else retrieval.weights(index, sigma)
                weights = build(index, sigma) if fit is None else build(index, sigma, fit)
                del sigma, fit
                weights = weights.to(stream.device)
                if refit_q is not None:
                    heads = None if retrieval is None else retrieval.head_weights(index, stream.device)
                    weights.q_proj = _refit_q(stream, spec, layer, index, hidden, calls, weights, geometry, refit_q,
                                              generator, heads)
                if refit_o:
                    weights.o_proj = _refit_o(stream, spec, layer, index, hidden, calls, weights, geometry)
                o_proj = weights.o_proj.to(stream.device, torch.float32)
                for i, a in enumerate(_inputs(stream, spec, layer, index, hidden, calls)):
                    out = geometry.attend(a.x, weights) @ o_proj.T
                    hidden[i] = stream.stash(capture.run_layer_with_attention_output(
                        layer, attention, stream.fetch(hidden[i]), calls[i][index], out))
                    del a, out  # before the next chunk is computed
                keep(index, weights.to("cpu"))
                bar.update()


def _retrieval_pass(retrieval: RetrievalCalibration, spec, layer, index: int) -> Callable:
    """The second moments' per-chunk hook: the chunk's rows and, on a chunk holding retrieval windows, the source
    attention's record for the heads' scores."""
    attention, _, out_module = _modules(spec, layer)

    def seen(i: int, a) -> None:
        retrieval.see(index, i, a.x, lambda: capture.run_attention(attention, out_module, a).record)

    return seen
