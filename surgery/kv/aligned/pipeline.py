"""Calibrate and merge, layer by layer, on the converted model's own residual stream.

Layer l is fit on the inputs it will really see: the calibration tokens run through layers 0..l-1 already
converted. Its targets are the source layer's attention on those same inputs (`targets="local"`, the
default; measured on SmolLM2-135M 3 -> 1, 8192 calibration tokens, first 4096 held-out tokens: perplexity
33.2 against 36.2 for `targets="source"`, the untouched source model's own activations, which also costs a
second full stream through the model).
Each layer: converted attention input -> second moments -> merge (assignment, key and value fits, folds)
-> q/k/v refits -> output refit -> the converted layer's pass. Only one layer's activations for the
calibration tokens are alive at a time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ...arch import ArchSpec, qkv_layout
from ...calibration.stream import LayerStream, run_layer
from ...runtime import threads
from . import capture
from .layer import LayerMerge, merge_layer
from .params import AttnParams, LayerAttention
from .keyrefit import KeyRefit, refit_keys
from .refit import QueryRefit, augment, refit_output, refit_queries
from .valuerefit import ValueRefit, refit_values
from .rotary import RotaryPairs, hf_cos_sin, rotary_pairs, rotate

QK_NORM_NAMES = ("q_norm", "k_norm", "q_layernorm", "k_layernorm")



@dataclass
class MergeOptions:
    groups: int
    chunk_windows: int = 8  # windows per forward chunk (bounds attention memory)
    assign: bool = True  # group K/V heads by similarity (else consecutively)
    fold: bool = True  # fit keys with RoPE-commuting maps folded into the queries
    refit_q: bool = True
    refit_k: bool = False  # refit the merged keys against the source's logits before each query refit
    refit_rounds: int = 1  # key/query refit alternations (with refit_k)
    refit_v: bool = False  # refit the merged values against the source heads' outputs before the output refit
    refit_o: bool = True
    o_ridge: float = 0.1
    targets: str = "local"  # "source": the source model's own activations; "local": the source layer on converted inputs
    query: QueryRefit = field(default_factory=QueryRefit)
    key: KeyRefit = field(default_factory=KeyRefit)
    value: ValueRefit = field(default_factory=ValueRefit)
    seed: int = 0


@dataclass
class LayerReport:
    groups: list[list[int]]
    key_loss: float
    value_loss: float
    folded: bool
    rotary_dims: int = 0


@dataclass
class MergeResult:
    layers: list[AttnParams]  # source-shaped merged params per layer
    reports: list[LayerReport]
    seconds: float
    stages: dict = field(default_factory=dict)  # seconds spent per stage (wall clock)


def _has_qk_norm(attention: torch.nn.Module) -> bool:
    return any(name.split(".")[-1] in QK_NORM_NAMES for name, _ in attention.named_modules())


def project_heads(x: torch.Tensor, rows: torch.Tensor, head_dim: int, cos, sin, pairs: RotaryPairs) -> torch.Tensor:
    """x [N, L, din] @ rows [n*D, din]^T -> rotated heads [N, n, L, D] (as the model computes them, without q/k norms)."""
    n_win, length, _ = x.shape
    heads = (x @ rows.T).reshape(n_win, length, -1, head_dim).transpose(1, 2)
    if cos is not None and pairs.frequencies:
        heads = rotate(heads, cos[:, None], sin[:, None], pairs)
    return heads


def _cat(chunks: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    return torch.cat(chunks, dim=dim)


@torch.no_grad()
def merge_model(stream: LayerStream, spec: ArchSpec, config: dict, heads: int, kv_heads: int, head_dim: int,
                windows: torch.Tensor, opts: MergeOptions, progress=None, keep=None) -> MergeResult:
    """Merge the layers `stream` serves (float32 on its device, attention instrumented by `capture.instrument`);
    windows [N, L] token ids. `keep(index, params, report)` receives each layer's merged params as soon as they
    are final (else they are collected in the result)."""
    start = time.time()
    merger = _ModelMerge(stream, spec, config, heads, kv_heads, head_dim, windows, opts)
    out_layers, reports = [], []
    for index, path, layer in stream.layers():
        merged, params, report = merger.merge_layer(index, path, layer)
        if keep is None:
            out_layers.append(params)
        else:
            keep(index, params, report)
        reports.append(report)
        if progress:
            progress(index, merged)
    stages = {k: round(v, 2) for k, v in merger.stages.items()}
    return MergeResult(out_layers, reports, time.time() - start, stages)


@dataclass
class _Layer:
    """One layer's work in progress (see the stages of `_ModelMerge.merge_layer`)."""

    index: int
    layer: torch.nn.Module
    la: LayerAttention
    source: AttnParams | None  # freed after the merge
    folded: bool  # key maps fold into the queries (no q/k norm in the way)
    grouped: bool  # some merged K/V head serves more than one source K/V head's queries
    refit_q: bool
    refit_v: bool
    source_o: torch.Tensor | None = None  # the source's output projection, kept past the merge for the value refit
    src_runs: list = field(default_factory=list)  # the source attention's runs (targets of the refits)
    acalls: list = field(default_factory=list)  # the attention's calls on the converted stream
    x: torch.Tensor | None = None  # [N, L, din] the converted attention input (augmented with 1 for q/k/v biases)
    pos: tuple | None = None  # the rotary (cos, sin) the layer receives
    pairs: RotaryPairs | None = None


class _ModelMerge:
    """The two residual streams (source targets when `targets="source"`, converted) and the per-stage clock; each
    layer goes through the stages of `merge_layer` in order."""

    def __init__(self, stream: LayerStream, spec: ArchSpec, config: dict, heads: int, kv_heads: int, head_dim: int,
                 windows: torch.Tensor, opts: MergeOptions):
        self.stream, self.spec, self.opts = stream, spec, opts
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.layout = qkv_layout(spec, config)
        self.conv1d = spec.conv1d_pattern is not None
        self.chunks = list(windows.split(opts.chunk_windows))
        self.rotary_model = any(name.endswith("rotary_emb") for name, _ in stream.model.named_modules())
        self.gen = torch.Generator().manual_seed(opts.seed)
        self.stages: dict[str, float] = {}
        self._clock = time.time()
        stream.plan_offload(windows.numel(), streams=4 if opts.targets == "local" else 5)
        self.src_h, self.calls = stream.embed_chunks(self.chunks)
        stream.release_embeddings()
        self.cv_h = list(self.src_h)
        self._tick("embed")

    def _tick(self, stage: str) -> None:
        now = time.time()
        self.stages[stage] = self.stages.get(stage, 0.0) + now - self._clock
        self._clock = now

    def merge_layer(self, index: int, path: str, layer: torch.nn.Module) -> tuple[LayerMerge, AttnParams, LayerReport]:
        """One layer: targets, converted input, merge, q/k/v refits, output refit, converted pass. Returns the
        merge, the final source-shaped params (on the host) and the layer's report."""
        la = LayerAttention(layer, path, self.spec, self.layout, self.heads, self.kv_heads, self.head_dim, self.conv1d)
        folded = self.opts.fold and not _has_qk_norm(la.attention)
        grouped = self.kv_heads // self.opts.groups > 1
        w = _Layer(index, layer, la, la.read(), folded, grouped, self.opts.refit_q and folded and grouped,
                   self.opts.refit_v and folded and grouped)
        self._source_pass(w)
        self._tick("source pass")
        self._converted_input(w)
        self._tick("converted input")
        merged = self._merge(w)
        params = merged.params
        self._tick("merge")
        self._refit_qkv(w, merged)
        la.write(params)
        self._tick("q/k/v refit")
        runs = self._refit_output(w, params)
        self._tick("output refit")
        self._converted_pass(w, runs)
        del runs
        self._tick("converted pass")
        report = LayerReport(merged.groups, merged.key_loss, merged.value_loss, folded, 2 * w.pairs.frequencies)
        params = AttnParams(*(t.cpu() if isinstance(t, torch.Tensor) else t for t in
                              (params.q, params.k, params.v, params.o, params.o_bias, params.qkv_bias)))
        return merged, params, report

    def _source_pass(self, w: _Layer) -> None:
        """1. With `targets="source"`: the source stream through the untouched layer, recording the targets."""
        if self.opts.targets != "source":
            return
        fetch, stash = self.stream.fetch, self.stream.stash
        for i in range(len(self.chunks)):
            h, run = capture.run_layer_recorded(w.layer, w.la.attention, w.la.out_module, fetch(self.src_h[i]),
                                                self.calls[i][w.index])
            self.src_h[i] = stash(h)
            w.src_runs.append(run)

    def _converted_input(self, w: _Layer) -> None:
        """2. What the converted stream feeds this layer's attention (with `targets="local"`, the source layer's
        runs on it are the targets), and the rotary pairs the layer rotates."""
        la, fetch = w.la, self.stream.fetch
        w.acalls = [capture.attention_input(w.layer, la.attention, la.in_module, fetch(self.cv_h[i]),
                                            self.calls[i][w.index]) for i in range(len(self.chunks))]
        if self.opts.targets == "local" and (w.refit_q or w.refit_v or (self.opts.refit_o and w.grouped)):
            w.src_runs = [capture.run_attention(la.attention, la.out_module, a) for a in w.acalls]  # the source layer
        w.x = augment(_cat([a.x for a in w.acalls]), w.source.qkv_bias)
        w.pos = w.acalls[0].kwargs.get("position_embeddings")
        if w.pos is None and self.rotary_model:
            raise RuntimeError(f"{type(w.layer).__name__} passes its rotary embedding in a way the merge cannot see")
        w.pairs = rotary_pairs(self.head_dim, w.pos[0].shape[-1] if w.pos is not None else 0,
                              self.spec.rotary_pairs)
        if w.folded and w.pairs.frequencies and not self._rotates(w):
            w.pairs = rotary_pairs(self.head_dim, 0)  # a layer without RoPE: keys merge by any linear map

    def _rotates(self, w: _Layer) -> bool:
        """Whether the layer rotates its keys: some families receive the rotary table in every layer and skip it in
        some (SmolLM3's no_rope_layers, Cohere2's global layers). Read off the source layer's
        recorded keys on the first chunk against the plain projection (no q/k norm here: the merge folds)."""
        local = w.src_runs and self.opts.targets == "local"  # the source layer's run on these same inputs
        run = w.src_runs[0] if local else capture.run_attention(w.la.attention, w.la.out_module, w.acalls[0])
        recorded = run.record.keys[0].float()  # [b, KV, L, D]
        x0 = augment(w.acalls[0].x, w.source.qkv_bias)
        plain = project_heads(x0, w.source.k, self.head_dim, None, None, w.pairs)
        if recorded.shape != plain.shape:
            return True
        return not torch.allclose(recorded, plain, rtol=1e-4, atol=1e-5 * float(plain.abs().max()) + 1e-12)

    def _merge(self, w: _Layer) -> LayerMerge:
        """3. Assignment, key and value fits, maps folded into q and o (float64, from the input's second moments)."""
        flat = w.x.reshape(-1, w.x.shape[-1])
        sigma = (flat.T @ flat).double() / flat.shape[0]
        with threads(1):  # float64 one group at a time, inside
            merged = merge_layer(w.source, sigma, self.kv_heads, self.head_dim, self.opts.groups, w.pairs, w.folded,
                                 self.opts.assign)
        w.source_o = w.source.o if w.refit_v else None
        w.source = None  # the refits do not need the source's attention: one layer's attention held, not two
        return merged

    def _refit_qkv(self, w: _Layer, merged: LayerMerge) -> None:
        """4. Keys (optionally) and queries against the source's attention logits, then values (optionally)
        against the source heads' outputs (folded merges of grouped heads only)."""
        if not (w.refit_q or w.refit_v):
            return
        params, pairs, head_dim, opts = merged.params, w.pairs, self.head_dim, self.opts
        cos = sin = None
        if w.pos is not None and pairs.frequencies:
            cs = [hf_cos_sin(a.kwargs["position_embeddings"], pairs) for a in w.acalls]
            cos = _cat([c[0].expand(a.x.shape[0], -1, -1) for c, a in zip(cs, w.acalls)])
            sin = _cat([c[1].expand(a.x.shape[0], -1, -1) for c, a in zip(cs, w.acalls)])
        record = w.src_runs[0].record
        scaling = record.scaling if record.scaling is not None else head_dim**-0.5
        x = w.x
        if w.refit_q:
            q_src = _cat([q for r in w.src_runs for q in r.record.queries])
            k_src = _cat([k for r in w.src_runs for k in r.record.keys])
            with threads(1):
                for _ in range(opts.refit_rounds if opts.refit_k else 1):
                    if opts.refit_k:
                        params.k = refit_keys(
                            x, q_src, k_src,
                            project_heads(x, params.q, head_dim, cos, sin, pairs),
                            project_heads(x, params.k, head_dim, cos, sin, pairs),
                            merged.groups, cos, sin, pairs, scaling, record.softcap, params.k, opts.key, self.gen)
                    params.q = refit_queries(
                        x, q_src, k_src,
                        project_heads(x, params.q, head_dim, cos, sin, pairs),
                        project_heads(x, params.k, head_dim, cos, sin, pairs),
                        merged.groups, cos, sin, pairs, scaling, record.softcap, params.q, opts.query, self.gen)
            del q_src, k_src
        if w.refit_v:
            with threads(1):
                params.v = refit_values(
                    x, project_heads(x, params.q, head_dim, cos, sin, pairs),
                    project_heads(x, params.k, head_dim, cos, sin, pairs),
                    _cat([r.heads for r in w.src_runs]), merged.groups, scaling, record.softcap, params.v, params.o,
                    w.source_o, opts.value, self.gen)
            w.source_o = None

    def _refit_output(self, w: _Layer, params: AttnParams) -> list | None:
        """5. The output projection against the source's attention output; returns the converted attention's runs
        (None when o was not refit)."""
        if not (self.opts.refit_o and w.grouped):
            return None
        runs = [capture.run_attention(w.la.attention, w.la.out_module, a) for a in w.acalls]
        z = _cat([r.heads for r in runs]).reshape(-1, params.o.shape[1])
        target = _cat([r.output for r in w.src_runs])
        with threads(1):
            params.o, params.o_bias = refit_output(z, target.reshape(-1, target.shape[-1]), params.o, params.o_bias,
                                                   self.opts.o_ridge)
        w.la.write(params)
        return runs

    def _converted_pass(self, w: _Layer, runs: list | None) -> None:
        """6. The converted stream through the converted layer (its attention output is known when o was refit)."""
        fetch, stash = self.stream.fetch, self.stream.stash
        for i in range(len(self.chunks)):
            call = self.calls[i][w.index]
            if runs is None:
                self.cv_h[i] = stash(run_layer(w.layer, fetch(self.cv_h[i]), call))
            else:
                out = w.la.out_module(runs[i].heads)
                self.cv_h[i] = stash(capture.run_layer_with_attention_output(w.layer, w.la.attention,
                                                                             fetch(self.cv_h[i]), call, out))
        w.acalls, w.src_runs, w.x = [], [], None  # one layer's activations alive at a time
