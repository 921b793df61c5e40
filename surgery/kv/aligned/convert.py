"""`surgery convert --to mqa|gqa --merge aligned`: calibrate, merge, and write a standard checkpoint.

The merged attention tensors come from the calibrated model; every other tensor is streamed from the
source exactly as the plain converter does (same planner, same writer, same surgery.json fields).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ...arch import QKVLayout, spec_for
from ...checkpoint.atomic import check_output_path
from ...calibration.chunks import chunk_windows
from ...calibration.store import LayerStore
from ...calibration.stream import LayerProgress, open_stream
from ...calibration.text import CalibrationText, calibration_text, context_of
from ..convert import KVPlanner, head_shape, target_config, write_converted
from ...fitting.refit import QueryRefit
from ...fused_qkv import join_qkv
from ..pool import repeat_heads
from ...checkpoint.source import Source
from ...precision import calibrating, resolve_precision
from ...runtime import compute_threads, load_tokenizer, pick_device, threads
from ...checkpoint.tensors import CheckpointReader
from ...calibration import capture
from .layer import export_heads, query_order
from .params import AttnParams
from .pipeline import MergeOptions, merge_model
from ..refusals import ALIGNED_LABEL, ALIGNED_REFUSES

if TYPE_CHECKING:
    from ..options import KVMergeOptions


class AlignedPlanner(KVPlanner):
    """The plain converter's plan, with every attention projection taken from the merged layers."""

    def __init__(self, reader, spec, config, shape, options, layers: LayerStore | None,
                 groupings: list[list[list[int]]] | None):
        super().__init__(reader, spec, config, shape, options, "mean")  # the non-merged tensors: as the mean merge
        self.layers, self.groupings = layers, groupings

    def _params(self, layer: int) -> AttnParams:
        t = self.layers.get(layer)
        o_bias = t.get("o_bias")
        return AttnParams(t["q"], t["k"], t["v"], t["o"], o_bias, t["q"].shape[1] != t["o"].shape[0])

    def _tensor(self, layer: int, proj: str, param: str) -> torch.Tensor:
        p, s, spec = self._params(layer), self.shape, self.spec
        if proj == spec.o:
            return p.o if param == "weight" else p.o_bias
        if proj == spec.qkv:
            k, v = p.k, p.v
            if self.out_layout == QKVLayout.INTERLEAVED:
                k, v = (repeat_heads(t, s.head_dim, s.queries_per_group) for t in (k, v))
            full = join_qkv(p.q, k, v, self.out_layout, s.head_dim)
        else:
            full = {spec.q: p.q, spec.k: p.k, spec.v: p.v}[proj]
        if p.qkv_bias:
            return full[:, :-1] if param == "weight" else full[:, -1]
        return full

    def transform_for(self, name: str):
        hit = self.spec.match(name)
        if hit is None or self.layers is None:
            return super().transform_for(name)
        plain = super().transform_for(name)

        def produce(t: torch.Tensor) -> torch.Tensor:
            expected = plain(t) if plain is not None else t  # the plain converter's output has the same shape
            if t.is_meta:  # planning: the shape only
                return expected
            merged = self._tensor(*hit).contiguous()
            if merged.shape != expected.shape:
                raise RuntimeError(f"{name}: merged shape {list(merged.shape)} != planned {list(expected.shape)}")
            return merged

        return produce

    def group_record(self) -> list[dict]:
        if self.groupings is None:
            return super().group_record()
        s = self.shape
        r_out = s.heads // s.groups
        r_src = s.heads // s.kv_heads
        same = all(g == self.groupings[0] for g in self.groupings)
        out = []
        for g in range(s.groups):
            entry = {"kv_head": g, "query_heads": list(range(g * r_out, (g + 1) * r_out))}
            if same:
                members = self.groupings[0][g]
                entry["source_kv_heads"] = members
                entry["source_query_heads"] = query_order([members], r_src)
            out.append(entry)
        return out


def merge_options(options: "KVMergeOptions") -> MergeOptions:
    """The merge pipeline's settings that the kind's options choose (the rest at MergeOptions' defaults)."""
    return MergeOptions(groups=options.groups, assign=options.grouping == "similarity", refit_v=options.refit_values,
                        refit_k=options.refit_keys, query=QueryRefit(samples=options.query_samples),
                        chunk_windows=options.calib_chunk, retrieval_weight=options.retrieval_weight,
                        retrieval_rows_weight=options.retrieval_rows_weight)


def convert_aligned(src: Source, out: Path, options: "KVMergeOptions", progress: bool = True,
                    merge: MergeOptions | None = None) -> dict:
    """Merge `src`'s K/V heads into `options.groups` with calibration, writing a standard checkpoint to `out`;
    `options` is the kind's options model (surgery/kv/options.py), validated where it was built: this checks only what
    needs the source's config. The calibration's forward passes compute in `options.precision`
    (surgery/precision.py), its statistics in float32/64. A fraction `options.calib_retrieval_mix` of the
    calibration windows are retrieval examples (from `options.seed`), on which every layer's query heads are scored
    (and weighted, with `retrieval_weight`). `merge` (ablations and measurements): the merge pipeline's own settings
    instead of those `options` chooses (merge_options)."""
    start = time.time()
    config = src.config
    kv_heads, written = options.groups, options.write_kwargs()
    spec = spec_for(config, ALIGNED_LABEL, ALIGNED_REFUSES)
    shape = head_shape(spec, config, kv_heads)
    target_config(spec, config, shape, written["dtype"])  # refuses what has no target before any work
    check_output_path(out, options.force, source=src.folder)
    reader = CheckpointReader(src.folder, allow_pickle=options.allow_pickle)
    KVPlanner(reader, spec, config, shape, options, "mean")._validate_layers()
    pick_device(options.device)  # a bad --device fails before any work
    if shape.groups == shape.kv_heads:  # nothing to merge: the output is the source, exactly
        planner = AlignedPlanner(reader, spec, config, shape, options, None, None)
        extra = {"calibration": None, "merge": {"note": "no K/V heads to merge; the output equals the source"}}
        return write_converted(src, out, planner, progress=progress, method="aligned", extra=extra, start=start)

    opts = replace(merge or merge_options(options), groups=kv_heads, seed=options.seed)
    dev = pick_device(options.device)
    resolved = resolve_precision(options.precision, dev)
    text = calibration_text(options.calib, load_tokenizer(src), options.calib_tokens, context_of(config),
                            window=options.calib_window, chat_template=options.chat_template,
                            retrieval_mix=options.calib_retrieval_mix, seed=options.seed)
    opts = replace(opts, chunk_windows=chunk_windows(config, int(text.windows.shape[1]), requested=opts.chunk_windows))
    calib_start = time.time()
    with LayerStore(out) as store:
        with calibrating(resolved, dev):
            result = _calibrate_and_merge(src, reader, spec, config, shape, text.windows, opts, dev, store, progress,
                                          text.retrieval)
        extra = _merge_record(text, result, opts, shape, options.seed, time.time() - calib_start, dev)
        extra["calibration"]["precision"] = resolved
        groupings = [r.groups for r in result.reports]
        planner = AlignedPlanner(reader, spec, config, shape, options, store, groupings)
        return write_converted(src, out, planner, progress=progress, method="aligned", extra=extra, start=start)


def _calibrate_and_merge(src: Source, reader: CheckpointReader, spec, config: dict, shape, windows: torch.Tensor,
                         opts: MergeOptions, device: torch.device, store: LayerStore, progress: bool,
                         retrieval=None):
    """Stream the source layer by layer on `device`, merge each layer, and keep its exported tensors in `store`."""
    with threads(compute_threads() if device.type == "cpu" else torch.get_num_threads()):
        stream = open_stream(src.folder, reader, device, attn_implementation="sdpa")
        capture.instrument(stream.model)
        stream.spill_into(store.scratch("residual"), store.beside)

        def keep(index: int, params: AttnParams, report) -> None:
            out = export_heads(params, report.groups, shape.kv_heads, shape.head_dim)
            store.put(index, {"q": out.q, "k": out.k, "v": out.v, "o": out.o, "o_bias": out.o_bias})

        with LayerProgress("calibrate + merge", len(stream), progress) as bar:
            return merge_model(stream, spec, config, shape.heads, shape.kv_heads, shape.head_dim, windows, opts,
                               progress=lambda i, m: bar.update(), keep=keep, retrieval=retrieval)


def _merge_record(text: CalibrationText, result, opts: MergeOptions, shape, seed: int, seconds: float,
                  device: torch.device) -> dict:
    """surgery.json fields describing the calibration and the merge (beside the plain converter's fields)."""
    groupings = [r.groups for r in result.reports]
    r_src = shape.heads // shape.kv_heads
    permutations = {str(i): query_order(g, r_src) for i, g in enumerate(groupings)
                    if query_order(g, r_src) != list(range(shape.heads))}
    folded = all(r.folded for r in result.reports)
    rot = max(r.rotary_dims for r in result.reports)
    keys = ("per-frequency complex rank-1 fit (rotary dims), principal subspace (other dims), folded into the queries"
            if 0 < rot < shape.head_dim else
            "per-frequency complex rank-1 fit, folded into the queries" if rot else
            "principal subspace in the queries' metric, folded into the queries (no rotary)")
    extra = {
        "calibration": text.record() | {
            "device": str(device),
            "streaming": "layer by layer from the checkpoint (float32 on the device)",
            "chunk_windows": opts.chunk_windows,
            "seconds": round(seconds, 3),
            "stages_seconds": result.stages,
        },
        "merge": {
            "assignment": "by similarity (lowest merge loss)" if opts.assign else "consecutive",
            "keys": keys if folded else "mean of the members (per-head q/k norms: nothing can be folded)",
            "values": "principal subspace in o_proj's metric, member maps folded into o_proj",
            "query_refit": opts.refit_q and folded,
            "query_samples": opts.query.samples,
            "key_refit": ({"rounds": opts.refit_rounds} if opts.refit_q and opts.refit_k and folded else False),
            "value_refit": opts.refit_v and folded,
            "output_refit": opts.refit_o,
            "targets": opts.targets,
            "rotary_dims": rot,
            "key_loss": _mean(r.key_loss for r in result.reports),
            "value_loss": _mean(r.value_loss for r in result.reports),
        },
        "seed": seed,
    }
    if result.head_scores is not None:  # --calib-retrieval-mix: each layer's query heads scored on its examples
        extra["merge"]["retrieval_heads"] = {
            "score": "attention mass from the answer-predicting positions on the needle's value tokens, mean over the "
                     "retrieval windows, per layer and source query head",
            "weight": opts.retrieval_weight, "head_weight": "1 + weight x score",
            # the answer (query refit) and needle (key refit) positions' rows, each weighing this many sampled rows
            "rows_weight": opts.retrieval_rows_weight, "scores": result.head_scores}
    layer_rot = [r.rotary_dims for r in result.reports]
    if any(r != rot for r in layer_rot):  # some layers without RoPE (their keys merge by any linear map)
        extra["merge"]["layer_rotary_dims"] = layer_rot
    if any(g != groupings[0] for g in groupings) or permutations:
        extra["layer_groups"] = groupings
    if permutations:
        extra["query_permutation"] = permutations
    return extra


def _mean(values) -> float | None:
    vals = [v for v in values if v == v]
    return round(sum(vals) / len(vals), 5) if vals else None


