"""Calibrate and merge, layer by layer, on the converted model's own residual stream.

Layer l is fit on the inputs it will really see: the calibration tokens run through layers 0..l-1 already
converted. Its targets are the source layer's attention on those same inputs (`targets="local"`, the
default; measured on SmolLM2-135M 3 -> 1, 8192 calibration tokens, first 4096 held-out tokens: perplexity
33.2 against 36.2 for `targets="source"`, the untouched source model's own activations, which also costs a
second full stream through the model).
Each layer: converted attention input -> second moments -> merge (assignment, key and value fits, folds)
-> q/k/v refits -> output refit -> the converted layer's pass. Past the residual streams, memory is one chunk of
windows (`chunk_windows`) and float64 sums the size of the model's projections: see `_ModelMerge`.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from ...arch import ArchSpec, qkv_layout
from ...calibration.chunks import chunk_windows
from ...calibration.stream import LayerStream, run_layer
from ...runtime import threads
from ...calibration import capture
from ...calibration.retrieval import HeadScores, RetrievalWindow, chunk_probes, head_weights
from .layer import LayerMerge, merge_layer
from .params import AttnParams, LayerAttention
from .keyrefit import KeyFit, KeyRefit
from ...fitting.refit import OutputFit, QueryFit, QueryRefit, augment
from ...fitting.shape import RefitShape
from .valuerefit import ValueFit, ValueRefit
from ...fitting.rotary import RotaryPairs, hf_cos_sin, rotary_pairs, rotate

QK_NORM_NAMES = ("q_norm", "k_norm", "q_layernorm", "k_layernorm")



@dataclass
class MergeOptions:
    groups: int
    # windows per chunk: every per-layer stage holds one chunk (bounds the memory); None: the rule of
    # surgery/calibration/chunks.py (the most windows, up to 8, that fit its budget on this model)
    chunk_windows: int | None = None
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
    # each query head weighs 1 + retrieval_weight * score in the merge and the key and query refits, its score the
    # attention it puts on the needle on the retrieval windows (surgery/calibration/retrieval.py); 0: alike
    retrieval_weight: float = 0.0
    # on the retrieval windows, the answer positions join the query refit's rows and the needle positions the key
    # refit's, each weighing this many sampled rows (0: only the random samples, as on plain text)
    retrieval_rows_weight: float = 1.0


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
    head_scores: list[list[float]] | None = None  # per layer, per query head: the retrieval score (retrieval windows)


def _has_qk_norm(attention: torch.nn.Module) -> bool:
    return any(name.split(".")[-1] in QK_NORM_NAMES for name, _ in attention.named_modules())


def project_heads(x: torch.Tensor, rows: torch.Tensor, head_dim: int, cos, sin, pairs: RotaryPairs) -> torch.Tensor:
    """x [N, L, din] @ rows [n*D, din]^T -> rotated heads [N, n, L, D] (as the model computes them, without q/k norms)."""
    n_win, length, _ = x.shape
    heads = (x @ rows.T).reshape(n_win, length, -1, head_dim).transpose(1, 2)
    if cos is not None and pairs.frequencies:
        heads = rotate(heads, cos[:, None], sin[:, None], pairs)
    return heads


@torch.no_grad()
def merge_model(stream: LayerStream, spec: ArchSpec, config: dict, heads: int, kv_heads: int, head_dim: int,
                windows: torch.Tensor, opts: MergeOptions, progress=None, keep=None,
                retrieval: list[RetrievalWindow] | None = None) -> MergeResult:
    """Merge the layers `stream` serves (float32 on its device, attention instrumented by `capture.instrument`);
    windows [N, L] token ids. `keep(index, params, report)` receives each layer's merged params as soon as they
    are final (else they are collected in the result). `retrieval`: the windows holding retrieval examples, on
    which each layer's heads are scored (and weighted, with `opts.retrieval_weight`)."""
    start = time.time()
    merger = _ModelMerge(stream, spec, config, heads, kv_heads, head_dim, windows, opts, retrieval)
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
        del merged, params  # not alive through the next layer's merge
    stages = {k: round(v, 2) for k, v in merger.stages.items()}
    scores = merger.scores.record() if merger.probes else None
    return MergeResult(out_layers, reports, time.time() - start, stages, scores)


@dataclass
class _Layer:
    """One layer's work in progress (see the stages of `_ModelMerge.merge_layer`). Nothing here grows with the
    calibration budget: the per-token tensors are recomputed chunk by chunk in each pass (`_ModelMerge._chunks`)."""

    index: int
    layer: torch.nn.Module
    la: LayerAttention
    source: AttnParams | None  # freed after the merge (kept for its o_proj when values are refit)
    folded: bool  # key maps fold into the queries (no q/k norm in the way)
    grouped: bool  # some merged K/V head serves more than one source K/V head's queries
    refit_q: bool
    refit_v: bool
    qkv_bias: bool  # q/k/v carry a bias column
    source_o: torch.Tensor | None = None  # the source's output projection, kept past the merge for the value refit
    src_attention: torch.nn.Module | None = None  # a copy of the source attention: the refits' targets
    src_out: torch.nn.Module | None = None  # its output projection (o_proj's input is recorded there)
    first: capture.AttentionCall | None = None  # the first chunk's attention call (its rotary table, the RoPE check)
    pos: tuple | None = None  # the rotary (cos, sin) the layer receives
    pairs: RotaryPairs | None = None
    scaling: float | None = None
    softcap: float | None = None
    head_weights: torch.Tensor | None = None  # [H] float64, each query head's weight in the fits (None: all 1)


@dataclass
class _Chunk:
    """One chunk's converted attention input and what the refits read off it."""

    index: int  # the chunk's index (its retrieval windows: `_ModelMerge.probes`)
    call: capture.AttentionCall
    x: torch.Tensor  # [n, L, din] augmented with 1 for q/k/v biases
    source: capture.AttentionRun | None  # the source attention's run (the targets), when asked for
    cos: torch.Tensor | None = None  # [n, L, F] the rotary table per window, when the layer rotates
    sin: torch.Tensor | None = None


class _ModelMerge:
    """The two residual streams (source targets when `targets="source"`, converted) and the per-stage clock; each
    layer goes through the stages of `merge_layer` in order.

    Memory. Only the residual streams ([tokens, hidden] float32 each: the converted one, and the source one with
    `targets="source"`) span the calibration budget. Everything else is one chunk (`chunk_windows` windows) at a
    time: each stage is a pass over the chunks that recomputes the layer's attention input (the layer's input norm)
    and, where a stage needs targets, the source attention on it, and adds the chunk to float64 sums (second
    moments, the refits' normal equations) whose size depends on the model only. The cost: the source attention
    runs once per refit pass (1 + refit rounds + value refit + output refit passes instead of once), and the
    converted layer's attention runs again in the converted pass instead of reusing the output refit's run."""

    def __init__(self, stream: LayerStream, spec: ArchSpec, config: dict, heads: int, kv_heads: int, head_dim: int,
                 windows: torch.Tensor, opts: MergeOptions, retrieval: list[RetrievalWindow] | None = None):
        self.stream, self.spec, self.opts = stream, spec, opts
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.layout = qkv_layout(spec, config)
        self.conv1d = spec.conv1d_pattern is not None
        per_chunk = chunk_windows(config, int(windows.shape[-1]), requested=opts.chunk_windows)
        self.chunks = list(windows.split(per_chunk))
        self.probes = chunk_probes(retrieval or [], per_chunk)  # chunk -> its retrieval windows
        self.scores = HeadScores()
        self.rotary_model = any(name.endswith("rotary_emb") for name, _ in stream.model.named_modules())
        self.gen = torch.Generator().manual_seed(opts.seed)
        self.stages: dict[str, float] = {}
        self._clock = time.time()
        stream.plan_offload(windows.numel(), streams=1 if opts.targets == "local" else 2)
        self.src_h, self.calls = stream.embed_chunks(self.chunks)
        stream.release_embeddings()
        self.cv_h = self.src_h.copy() if opts.targets == "source" else self.src_h
        self._tick("embed")

    def _tick(self, stage: str) -> None:
        now = time.time()
        self.stages[stage] = self.stages.get(stage, 0.0) + now - self._clock
        self._clock = now

    def merge_layer(self, index: int, path: str, layer: torch.nn.Module) -> tuple[LayerMerge, AttnParams, LayerReport]:
        """One layer: second moments, merge, q/k/v refits, output refit, converted pass (and the source stream's
        pass with `targets="source"`). Returns the merge, the final source-shaped params (on the host) and the
        layer's report."""
        la = LayerAttention(layer, path, self.spec, self.layout, self.heads, self.kv_heads, self.head_dim, self.conv1d)
        folded = self.opts.fold and not _has_qk_norm(la.attention)
        grouped = self.kv_heads // self.opts.groups > 1
        source = la.read()
        w = _Layer(index, layer, la, source, folded, grouped, self.opts.refit_q and folded and grouped,
                   self.opts.refit_v and folded and grouped, source.qkv_bias)
        del source  # w.source is the one reference, which the merge drops (see _merge)
        w.src_attention = copy.deepcopy(la.attention)
        w.src_out = w.src_attention.get_submodule(_relative(la.attention, la.out_module))
        sigma = self._moments(w)
        self._tick("converted input")
        merged = self._merge(w, sigma)
        del sigma  # the refits sum their own moments: the merge's d_in x d_in float64 need not outlive it
        params = merged.params
        la.write(params)
        self._tick("merge")
        self._refit_qkv(w, merged)
        la.write(params)
        self._tick("q/k/v refit")
        self._refit_output(w, params)
        self._tick("output refit")
        self._converted_pass(w)
        self._tick("converted pass")
        report = LayerReport(merged.groups, merged.key_loss, merged.value_loss, folded, 2 * w.pairs.frequencies)
        params = AttnParams(*(t.cpu() if isinstance(t, torch.Tensor) else t for t in
                              (params.q, params.k, params.v, params.o, params.o_bias, params.qkv_bias)))
        return merged, params, report

    def _chunks(self, w: _Layer, source: bool = False, rotary: bool = False):
        """Chunk by chunk: what the converted stream feeds this layer's attention, and (`source`) the source
        attention's run on it (`targets="local"`) or on the source stream's input (`targets="source"`), and
        (`rotary`) the rotary table per window. One chunk's tensors are alive at a time."""
        la, fetch = w.la, self.stream.fetch
        for i in range(len(self.chunks)):
            call = self.calls[i][w.index]
            a = capture.attention_input(w.layer, la.attention, la.in_module, fetch(self.cv_h[i]), call)
            run = None
            if source:
                src = a if self.opts.targets == "local" else capture.attention_input(
                    w.layer, la.attention, la.in_module, fetch(self.src_h[i]), call)
                run = capture.run_attention(w.src_attention, w.src_out, src)
            chunk = _Chunk(i, a, augment(a.x, w.qkv_bias), run)
            if rotary and w.pos is not None and w.pairs.frequencies:
                cos, sin = hf_cos_sin(a.kwargs["position_embeddings"], w.pairs)
                chunk.cos, chunk.sin = cos.expand(a.x.shape[0], -1, -1), sin.expand(a.x.shape[0], -1, -1)
            yield chunk

    def _moments(self, w: _Layer) -> torch.Tensor:
        """1. The converted attention input's second moments (float64 sums over the chunks), the rotary pairs the
        layer rotates, and the source's softmax scaling and softcap."""
        sigma, count = None, 0
        for i, chunk in enumerate(self._chunks(w)):
            if w.first is None:
                w.first = chunk.call
            if i in self.probes:
                self._score_heads(w, i, chunk.call)
            flat = chunk.x.reshape(-1, chunk.x.shape[-1])
            part = (flat.T @ flat).double()
            sigma = part if sigma is None else sigma.add_(part)
            count += flat.shape[0]
            del chunk, flat  # before the next chunk is computed: one chunk alive at a time
        w.pos = w.first.kwargs.get("position_embeddings")
        if w.pos is None and self.rotary_model:
            raise RuntimeError(f"{type(w.layer).__name__} passes its rotary embedding in a way the merge cannot see")
        w.pairs = rotary_pairs(self.head_dim, w.pos[0].shape[-1] if w.pos is not None else 0,
                              self.spec.rotary_pairs)
        run = capture.run_attention(w.src_attention, w.src_out, self._first_source_call(w))
        w.scaling = run.record.scaling if run.record.scaling is not None else self.head_dim**-0.5
        w.softcap = run.record.softcap
        if w.folded and w.pairs.frequencies and not self._rotates(w, run):
            w.pairs = rotary_pairs(self.head_dim, 0)  # a layer without RoPE: keys merge by any linear map
        w.head_weights = head_weights(self.scores.layer(w.index), self.opts.retrieval_weight)
        return sigma / count

    def _score_heads(self, w: _Layer, i: int, call: capture.AttentionCall) -> None:
        """The source attention's retrieval scores on chunk i's retrieval windows (on the input the refits' targets
        come from: the converted stream's with `targets="local"`, the source stream's with "source")."""
        la = w.la
        if self.opts.targets != "local":
            call = capture.attention_input(w.layer, la.attention, la.in_module, self.stream.fetch(self.src_h[i]),
                                           self.calls[i][w.index])
        rec = capture.run_attention(w.src_attention, w.src_out, call).record
        scaling = rec.scaling if rec.scaling is not None else self.head_dim ** -0.5
        self.scores.add(w.index, rec.queries[0], rec.keys[0], scaling, rec.softcap, self.probes[i])

    def _first_source_call(self, w: _Layer) -> capture.AttentionCall:
        if self.opts.targets == "local":
            return w.first
        la = w.la
        return capture.attention_input(w.layer, la.attention, la.in_module, self.stream.fetch(self.src_h[0]),
                                       self.calls[0][w.index])

    def _rotates(self, w: _Layer, run: capture.AttentionRun) -> bool:
        """Whether the layer rotates its keys: some families receive the rotary table in every layer and skip it in
        some (SmolLM3's no_rope_layers, Cohere2's global layers). Read off the source layer's recorded keys on the
        first chunk against the plain projection (no q/k norm here: the merge folds)."""
        if self.opts.targets != "local":  # the source layer's run on the converted stream's first chunk
            run = capture.run_attention(w.src_attention, w.src_out, w.first)
        recorded = run.record.keys[0].float()  # [b, KV, L, D]
        x0 = augment(w.first.x, w.source.qkv_bias)
        plain = project_heads(x0, w.source.k, self.head_dim, None, None, w.pairs)
        if recorded.shape != plain.shape:
            return True
        return not torch.allclose(recorded, plain, rtol=1e-4, atol=1e-5 * float(plain.abs().max()) + 1e-12)

    def _merge(self, w: _Layer, sigma: torch.Tensor) -> LayerMerge:
        """2. Assignment, key and value fits, maps folded into q and o (float64, from the input's second moments)."""
        with threads(1):  # float64 one group at a time, inside
            merged = merge_layer(w.source, sigma, self.kv_heads, self.head_dim, self.opts.groups, w.pairs, w.folded,
                                 self.opts.assign, head_weights=w.head_weights)
        w.source_o = w.source.o if w.refit_v else None
        w.source = None  # the refits read the source attention's copy: one layer's attention params, not two
        return merged

    def _refit_qkv(self, w: _Layer, merged: LayerMerge) -> None:
        """3. Keys (optionally) and queries against the source's attention logits, then values (optionally)
        against the source heads' outputs (folded merges of grouped heads only): one pass over the chunks per
        refit, each adding to the refit's normal equations."""
        if not (w.refit_q or w.refit_v):
            return
        params, pairs, head_dim, opts = merged.params, w.pairs, self.head_dim, self.opts
        length = self.chunks[0].shape[1]

        def projected(c: _Chunk):
            return (project_heads(c.x, params.q, head_dim, c.cos, c.sin, pairs),
                    project_heads(c.x, params.k, head_dim, c.cos, c.sin, pairs))

        def shape(c: _Chunk) -> RefitShape:
            return RefitShape(self.heads, self.kv_heads, head_dim, c.x.shape[-1],
                              [m for m in merged.groups if len(m) > 1])

        def fit_pass(make, add):
            fit = None
            with threads(1):
                for c in self._chunks(w, source=True, rotary=True):
                    fit = fit or make(shape(c), c.x.device)
                    add(fit, c)
                    del c  # before the next chunk is computed
            return fit

        def qk_args(c: _Chunk):
            q_src, k_src = c.source.record.queries[0], c.source.record.keys[0]
            return (c.x, q_src, k_src, *projected(c), c.cos, c.sin)

        def answers(c: _Chunk):  # the query refit's extra rows: the chunk's retrieval windows' answer positions
            return [(i, p.answers) for i, p in self.probes.get(c.index, [])]

        def needles(c: _Chunk):  # the key refit's: their needle positions
            return [(i, p.needle) for i, p in self.probes.get(c.index, [])]

        rows = opts.retrieval_rows_weight
        if w.refit_q:
            for _ in range(opts.refit_rounds if opts.refit_k else 1):
                if opts.refit_k:
                    fit = fit_pass(lambda s, dev: KeyFit(s, length, pairs, w.scaling, w.softcap, opts.key, self.gen,
                                                         dev, w.head_weights, rows),
                                   lambda f, c: f.add(*qk_args(c), rows=needles(c)))
                    params.k = fit.solve(params.k)
                fit = fit_pass(lambda s, dev: QueryFit(s, length, merged.groups, pairs, w.scaling, w.softcap,
                                                       opts.query, self.gen, dev, w.head_weights, rows),
                               lambda f, c: f.add(*qk_args(c), rows=answers(c)))
                params.q = fit.solve(params.q)
        if w.refit_v:
            fit = fit_pass(lambda s, dev: ValueFit(s, length, w.scaling, w.softcap, opts.value, self.gen, dev),
                           lambda f, c: f.add(c.x, *projected(c), c.source.heads))
            params.v = fit.solve(params.v, params.o, w.source_o)
            w.source_o = None

    def _refit_output(self, w: _Layer, params: AttnParams) -> None:
        """4. The output projection against the source's attention output: the converted attention's o_proj inputs
        and the source attention's outputs, chunk by chunk, into the ridge regression's normal equations."""
        if not (self.opts.refit_o and w.grouped):
            return
        fit = OutputFit(params.o, params.o_bias)
        with threads(1):
            for c in self._chunks(w, source=True):
                heads = capture.run_attention(w.la.attention, w.la.out_module, c.call).heads
                fit.add(heads.reshape(-1, params.o.shape[1]), c.source.output.reshape(-1, params.o.shape[0]))
                del c, heads  # before the next chunk is computed
            params.o, params.o_bias = fit.solve(self.opts.o_ridge)
        w.la.write(params)

    def _converted_pass(self, w: _Layer) -> None:
        """5. The converted stream through the converted layer (and, with `targets="source"`, the source stream
        through the source layer: the layer with the source attention's copy answering for its attention)."""
        fetch, stash, la = self.stream.fetch, self.stream.stash, w.la
        for i in range(len(self.chunks)):
            call = self.calls[i][w.index]
            if self.opts.targets == "source":
                h = fetch(self.src_h[i])
                a = capture.attention_input(w.layer, la.attention, la.in_module, h, call)
                out = capture.run_attention(w.src_attention, w.src_out, a).output
                self.src_h[i] = stash(capture.run_layer_with_attention_output(w.layer, la.attention, h, call, out))
            self.cv_h[i] = stash(run_layer(w.layer, fetch(self.cv_h[i]), call))
        w.src_attention = w.src_out = w.first = None


def _relative(parent: torch.nn.Module, child: torch.nn.Module) -> str:
    """The name of `child` inside `parent` ("" when it is `parent`)."""
    return next(name for name, m in parent.named_modules() if m is child)
