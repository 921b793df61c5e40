"""The streamed calibrations against the same ones on the whole model in memory: the aligned merge's and
SwitchHead's layers, computed both ways from one checkpoint folder, must agree to TOL (relative)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers as tf

from surgery.arch import spec_for
from surgery.calibration.store import LayerStore
from surgery.calibration.stream import open_stream, resident_stream
from surgery.checkpoint.tensors import CheckpointReader
from surgery.calibration import capture
from surgery.kv.aligned.pipeline import MergeOptions, merge_model
from surgery.switchhead.cluster import kv_mapping
from surgery.switchhead.convert import LayerBuilder, switchhead_shape
from surgery.switchhead.families import attention_tensors, family_for
from surgery.switchhead.layers import calibrate_layers
from surgery.testing import tiny_models as tm

TOL = 1e-5


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def windows(n: int = 4, length: int = 32, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, tm.VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def resident(folder: Path, attn: str):
    return tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=attn).eval()


def merged_layers(stream, folder: Path, kv_to: int, ids: torch.Tensor | None = None):
    config = json.loads((folder / "config.json").read_text())
    spec = spec_for(config)
    capture.instrument(stream.model)
    heads, kv, dim = spec.heads(config), spec.kv_heads(config), spec.head_dim(config)
    opts = MergeOptions(groups=kv_to, chunk_windows=2)
    return merge_model(stream, spec, config, heads, kv, dim, windows() if ids is None else ids, opts)


def assert_same_merge(folder: Path, kv_to: int, ids: torch.Tensor | None = None) -> None:
    reader = CheckpointReader(folder)
    streamed = merged_layers(open_stream(folder, reader, "cpu", "sdpa"), folder, kv_to, ids)
    reference = merged_layers(resident_stream(capture.load_resident_model(folder)), folder, kv_to, ids)
    assert [r.groups for r in streamed.reports] == [r.groups for r in reference.reports]
    for a, b in zip(streamed.layers, reference.layers):
        for name in ("q", "k", "v", "o"):
            assert rel_diff(getattr(a, name), getattr(b, name)) <= TOL, name


def switchhead_layers(stream, folder: Path, heads: int, experts: int, topk: int, ids: torch.Tensor | None = None):
    config = json.loads((folder / "config.json").read_text())
    reader = CheckpointReader(folder)
    family = family_for(config)
    shape = switchhead_shape(config, heads, experts, topk)
    store = LayerStore(spill=False)
    builder = LayerBuilder(reader, family, attention_tensors(reader, family), shape, [], store, None)
    mode = kv_mapping(shape.heads, shape.kv_heads, shape.new_heads, True)
    result = calibrate_layers(stream, builder, windows() if ids is None else ids, mode, "medoid", True, 0.1,
                              progress=False, chunk_windows=2)
    return result, [store.get(i) for i in range(shape.layers)]


def assert_same_switchhead(folder: Path, heads: int, experts: int, topk: int, ids: torch.Tensor | None = None):
    streamed, tensors = switchhead_layers(open_stream(folder, CheckpointReader(folder), "cpu", "eager"), folder,
                                          heads, experts, topk, ids)
    reference, expected = switchhead_layers(resident_stream(resident(folder, "eager")), folder, heads, experts, topk,
                                            ids)
    assert streamed.clusters == reference.clusters and streamed.pivots == reference.pivots
    for a, b in zip(tensors, expected):
        assert a.keys() == b.keys()
        for key in a:
            assert rel_diff(a[key], b[key]) <= TOL, key
    assert streamed.refit == reference.refit
