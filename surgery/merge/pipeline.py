"""Calibrate and merge, layer by layer, on the converted model's own residual stream.

Layer l is fit on the inputs it will really see: the calibration tokens run through layers 0..l-1 already
converted. Its targets are the source layer's attention on those same inputs (`targets="local"`, the
default; measured on SmolLM2-135M 3 -> 1, 8192 calibration tokens, first 4096 held-out tokens: perplexity
33.2 against 36.2 for `targets="source"`, the untouched source model's own activations, which also costs a
second full stream through the model).
Each layer: converted attention input -> second moments -> merge (assignment, key and value fits, folds)
-> query refit -> output refit -> the converted layer's pass. Only one layer's activations for the
calibration tokens are alive at a time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..arch import ArchSpec, qkv_layout
from ..calibration.stream import LayerStream, run_layer
from ..threads import threads
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
    layout = qkv_layout(spec, config)
    conv1d = spec.conv1d_pattern is not None
    chunks = list(windows.split(opts.chunk_windows))
    rotary_model = any(name.endswith("rotary_emb") for name, _ in stream.model.named_modules())
    gen = torch.Generator().manual_seed(opts.seed)
    stream.plan_offload(windows.numel(), streams=4 if opts.targets == "local" else 5)
    src_h, calls = stream.embed_chunks(chunks)
    stream.release_embeddings()
    cv_h = list(src_h)
    fetch, stash = stream.fetch, stream.stash
    out_layers, reports = [], []
    stages: dict[str, float] = {}
    clock = [time.time()]

    def tick(stage: str) -> None:
        now = time.time()
        stages[stage] = stages.get(stage, 0.0) + now - clock[0]
        clock[0] = now

    tick("embed")
    for index, path, layer in stream.layers():
        la = LayerAttention(layer, path, spec, layout, heads, kv_heads, head_dim, conv1d)
        source = la.read()
        folded = opts.fold and not _has_qk_norm(la.attention)
        # 1. the source stream through the untouched layer: targets
        src_runs = []
        if opts.targets == "source":
            for i, c in enumerate(chunks):
                h, run = capture.run_layer_recorded(layer, la.attention, la.out_module, fetch(src_h[i]), calls[i][index])
                src_h[i] = stash(h)
                src_runs.append(run)
        tick("source pass")
        # 2. what the converted stream feeds this layer's attention
        acalls = [capture.attention_input(layer, la.attention, la.in_module, fetch(cv_h[i]), calls[i][index])
                  for i in range(len(chunks))]
        grouped = kv_heads // opts.groups > 1
        refit_q = opts.refit_q and folded and grouped
        refit_v = opts.refit_v and folded and grouped
        if opts.targets == "local" and (refit_q or refit_v or (opts.refit_o and grouped)):
            src_runs = [capture.run_attention(la.attention, la.out_module, a) for a in acalls]  # the source layer
        x = augment(_cat([a.x for a in acalls]), source.qkv_bias)  # [N, L, din]
        flat = x.reshape(-1, x.shape[-1])
        sigma = (flat.T @ flat).double() / flat.shape[0]
        pos = acalls[0].kwargs.get("position_embeddings")
        if pos is None and rotary_model:
            raise RuntimeError(f"{type(layer).__name__} passes its rotary embedding in a way the merge cannot see")
        pairs = rotary_pairs(head_dim, pos[0].shape[-1] if pos is not None else 0, "half")
        tick("converted input")
        # 3. merge
        double = AttnParams(source.q.double(), source.k.double(), source.v.double(), source.o.double(),
                            source.o_bias, source.qkv_bias)
        with threads(1):
            merged: LayerMerge = merge_layer(double, sigma, kv_heads, head_dim, opts.groups, pairs, folded, opts.assign)
        del double, sigma  # the float64 copies are not needed by the refits (memory: one layer's attention, twice)
        params = merged.params
        tick("merge")
        # 4. keys and queries against the source's logits, then values against the source heads' outputs
        cos = sin = None
        if (refit_q or refit_v) and pos is not None and pairs.frequencies:
            cs = [hf_cos_sin(a.kwargs["position_embeddings"], pairs) for a in acalls]
            cos = _cat([c[0].expand(a.x.shape[0], -1, -1) for c, a in zip(cs, acalls)])
            sin = _cat([c[1].expand(a.x.shape[0], -1, -1) for c, a in zip(cs, acalls)])
        if refit_q or refit_v:
            record = src_runs[0].record
            scaling = record.scaling if record.scaling is not None else head_dim**-0.5
        if refit_q:
            q_src = _cat([q for r in src_runs for q in r.record.queries])
            k_src = _cat([k for r in src_runs for k in r.record.keys])
            with threads(1):
                for _ in range(opts.refit_rounds if opts.refit_k else 1):
                    if opts.refit_k:
                        params.k = refit_keys(
                            x, q_src, k_src,
                            project_heads(x, params.q, head_dim, cos, sin, pairs),
                            project_heads(x, params.k, head_dim, cos, sin, pairs),
                            merged.groups, cos, sin, pairs, scaling, record.softcap, params.k, opts.key, gen)
                    params.q = refit_queries(
                        x, q_src, k_src,
                        project_heads(x, params.q, head_dim, cos, sin, pairs),
                        project_heads(x, params.k, head_dim, cos, sin, pairs),
                        merged.groups, cos, sin, pairs, scaling, record.softcap, params.q, opts.query, gen)
            del q_src, k_src
        if refit_v:
            with threads(1):
                params.v = refit_values(
                    x, project_heads(x, params.q, head_dim, cos, sin, pairs),
                    project_heads(x, params.k, head_dim, cos, sin, pairs),
                    _cat([r.heads for r in src_runs]), merged.groups, scaling, record.softcap, params.v, params.o,
                    source.o, opts.value, gen)
        la.write(params)
        tick("query refit")
        # 5. output projection against the source's attention output
        runs = None
        if opts.refit_o and grouped:
            runs = [capture.run_attention(la.attention, la.out_module, a) for a in acalls]
            z = _cat([r.heads for r in runs]).reshape(-1, params.o.shape[1])
            target = _cat([r.output for r in src_runs])
            with threads(1):
                params.o, params.o_bias = refit_output(z, target.reshape(-1, target.shape[-1]), params.o,
                                                       params.o_bias, opts.o_ridge)
            la.write(params)
        tick("output refit")
        # 6. the converted stream through the converted layer (its attention output is known when o was refit)
        for i in range(len(chunks)):
            if runs is None:
                cv_h[i] = stash(run_layer(layer, fetch(cv_h[i]), calls[i][index]))
            else:
                out = la.out_module(runs[i].heads)
                cv_h[i] = stash(capture.run_layer_with_attention_output(layer, la.attention, fetch(cv_h[i]),
                                                                        calls[i][index], out))
        del acalls, src_runs, runs, x, flat
        tick("converted pass")
        report = LayerReport(merged.groups, merged.key_loss, merged.value_loss, folded, 2 * pairs.frequencies)
        params = AttnParams(*(t.cpu() if isinstance(t, torch.Tensor) else t for t in
                              (params.q, params.k, params.v, params.o, params.o_bias, params.qkv_bias)))
        if keep is None:
            out_layers.append(params)
        else:
            keep(index, params, report)
        reports.append(report)
        if progress:
            progress(index, merged)
    return MergeResult(out_layers, reports, time.time() - start, {k: round(v, 2) for k, v in stages.items()})
