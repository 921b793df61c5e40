"""The aligned merge on calibration windows holding retrieval examples (`--calib-retrieval-mix`) and with retrieval
heads weighted (`--retrieval-weight`): the weights reduce to today's fit at 1, change it otherwise, and the scores and
options land in surgery.json; on random layers and on the tiny pydoc Llama (its tokenizer's examples need windows of
1,024)."""

from __future__ import annotations

import json

import pytest
import torch

from surgery.checkpoint.source import resolve_source
from surgery.fitting.refit import QueryFit, QueryRefit
from surgery.fitting.rotary import rotary_pairs
from surgery.fitting.shape import refit_shape
from surgery.kv.aligned import convert_aligned
from surgery.kv.options import MQAOptions
from surgery.kv.aligned.grams import group_loss, head_grams
from surgery.kv.aligned.keyrefit import KeyFit, KeyRefit
from surgery.kv.aligned.layer import group_blocks, merge_layer, merge_loss
from surgery.kv.aligned.params import AttnParams
from surgery.kv.aligned.pipeline import MergeOptions, project_heads
from surgery.testing.pydoc_llama import make_model

KV, R, D, DIN, N, L = 3, 2, 8, 24, 2, 20  # K/V heads, queries per K/V head, head_dim, input width, windows, length
H = KV * R


def _layer(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    x = rnd(N, L, DIN)
    sigma = (x.reshape(-1, DIN).T @ x.reshape(-1, DIN)).double() / (N * L)
    return AttnParams(rnd(H * D, DIN), rnd(KV * D, DIN), rnd(KV * D, DIN), rnd(DIN, H * D), None, False), sigma, x


WEIGHTS = torch.tensor([1.0, 9.0, 1.0, 1.0, 0.2, 3.0], dtype=torch.float64)  # a retrieval head (1), a weak one (4)


def test_head_weights_of_one_are_today_s_merge_and_others_move_the_keys():
    p, sigma, _ = _layer()
    pairs = rotary_pairs(D, D)
    plain = merge_layer(p, sigma, KV, D, 1, pairs)
    ones = merge_layer(p, sigma, KV, D, 1, pairs, head_weights=torch.ones(H, dtype=torch.float64))
    weighted = merge_layer(p, sigma, KV, D, 1, pairs, head_weights=WEIGHTS)
    assert all(torch.equal(a, b) for a, b in zip((plain.params.q, plain.params.k), (ones.params.q, ones.params.k)))
    assert not torch.allclose(weighted.params.k, plain.params.k, atol=1e-3)
    assert all(torch.isfinite(t).all() for t in (weighted.params.q, weighted.params.k, weighted.params.v))
    # the grouping's score from per-head products equals merging each group, weighted alike (GQA 3 -> 1 is one group:
    # scored on pairs)
    grams = head_grams(*group_blocks(p, KV, D), sigma, pairs, True, WEIGHTS.reshape(KV, R))
    reference = merge_loss(p, sigma, KV, D, pairs, True, WEIGHTS)
    for members in ([0, 1], [0, 2], [1, 2], [0, 1, 2]):
        a, b = reference(members), group_loss(grams, members)
        assert abs(a - b) <= 1e-9 * max(abs(a), 1e-12), (members, a, b)
    assert reference([0, 1]) != merge_loss(p, sigma, KV, D, pairs, True)([0, 1])


def _refit_inputs(p: AttnParams, x: torch.Tensor):
    pairs = rotary_pairs(D, D)
    angle = torch.arange(L)[:, None].float() * 100.0 ** (-torch.arange(pairs.frequencies) / pairs.frequencies)
    cos, sin = angle.cos().expand(N, -1, -1), angle.sin().expand(N, -1, -1)
    merged = p.k.reshape(KV, D, DIN).mean(0, keepdim=True).expand(KV, -1, -1).reshape(KV * D, DIN)
    q_src, k_src = project_heads(x, p.q, D, cos, sin, pairs), project_heads(x, p.k, D, cos, sin, pairs)
    args = (x, q_src, k_src, q_src, project_heads(x, merged, D, cos, sin, pairs), cos, sin)
    return pairs, merged, args


@pytest.mark.parametrize("fit", ["key", "query"])
def test_the_refits_weigh_heads_the_same_at_one_and_differently_otherwise(fit):
    p, _, x = _layer(1)
    pairs, merged, args = _refit_inputs(p, x)
    groups = [[0, 1, 2]]

    def solve(weights):
        g = torch.Generator().manual_seed(0)
        shape = refit_shape(x, args[1], args[4], groups)
        if fit == "key":
            f = KeyFit(shape, L, pairs, D ** -0.5, None, KeyRefit(samples=L), g, x.device, weights)
            f.add(*args)
            return f.solve(merged)
        f = QueryFit(shape, L, groups, pairs, D ** -0.5, None, QueryRefit(samples=L, top_k=8), g, x.device, weights)
        f.add(*args)
        return f.solve(p.q)

    plain, ones, weighted = solve(None), solve(torch.ones(H, dtype=torch.float64)), solve(WEIGHTS)
    assert torch.allclose(ones, plain, rtol=1e-4, atol=1e-5), (ones - plain).abs().max()
    assert torch.isfinite(weighted).all() and not torch.allclose(weighted, plain, rtol=1e-3, atol=1e-3)
    if fit == "query":  # each head fits alone: a weight of 1 is its plain fit, and a heavier head moves more
        rows, plain_rows = weighted.reshape(H, D, DIN), plain.reshape(H, D, DIN)
        assert torch.allclose(rows[[0, 2, 3]], plain_rows[[0, 2, 3]], rtol=1e-4, atol=1e-5)
        source = p.q.reshape(H, D, DIN)
        assert (rows[1] - source[1]).norm() > (plain_rows[1] - source[1]).norm()


WINDOW = 1024


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory, tokenizer):
    """The tiny pydoc Llama (4 query heads, 2 K/V heads) with a context of 1,024: room for the retrieval examples."""
    return make_model(tmp_path_factory.mktemp("long-tiny") / "src", tokenizer, positions=WINDOW)


def _convert(src, out, weight: float, mix: float = 0.5) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    record = convert_aligned(resolve_source(str(src)), out,
                             MQAOptions(merge="aligned", calib=["pydoc"], calib_tokens=2 * WINDOW, calib_window=WINDOW,
                                        calib_retrieval_mix=mix, seed=1),
                             progress=False, merge=MergeOptions(groups=1, refit_k=True, retrieval_weight=weight))
    return record, load_file(out / "model.safetensors")


def test_a_mixed_calibration_scores_the_heads_and_the_weight_changes_the_merge(long_tiny, tmp_path, cli):
    from safetensors.torch import load_file

    record, plain = _convert(long_tiny, tmp_path / "b0", 0.0)
    weighted_record, weighted = _convert(long_tiny, tmp_path / "b4", 4.0)
    mix = record["calibration"]["retrieval_mix"]
    assert mix["fraction"] == 0.5 and mix["windows"] == 1 and mix["of"] == 2 and len(mix["window_indices"]) == 1
    heads = record["merge"]["retrieval_heads"]
    assert heads["weight"] == 0.0 and weighted_record["merge"]["retrieval_heads"]["weight"] == 4.0
    scores = heads["scores"]
    assert len(scores) == 2 and all(len(layer) == 4 and all(0 <= s <= 1 for s in layer) for layer in scores)
    assert scores == weighted_record["merge"]["retrieval_heads"]["scores"]  # measured before any weight is used
    assert json.loads((tmp_path / "b4" / "surgery.json").read_text())["merge"]["retrieval_heads"]["weight"] == 4.0
    attention = [n for n in plain if ".self_attn." in n and n.endswith(("q_proj.weight", "k_proj.weight"))]
    assert attention and any(not torch.equal(plain[n], weighted[n]) for n in attention)
    assert all(torch.isfinite(t).all() for t in weighted.values())
    others = [n for n in plain if ".self_attn." not in n]
    assert all(torch.equal(plain[n], weighted[n]) for n in others)
    # the answer / needle rows (default W = 1) reach the refits: W = 0 (from the command line, with --refit-keys)
    # converts otherwise
    assert heads["rows_weight"] == 1.0 and record["merge"]["key_refit"] == {"rounds": 1}
    code, _, err = cli("convert", long_tiny, "--to", "mqa", "--merge", "aligned", "--calib", "pydoc", "--calib-tokens",
                       2 * WINDOW, "--calib-window", WINDOW, "--calib-retrieval-mix", "0.5", "--seed", "1",
                       "--refit-keys", "--retrieval-rows-weight", "0", "--out", tmp_path / "w0")
    assert code == 0, err
    no_rows = json.loads((tmp_path / "w0" / "surgery.json").read_text())["merge"]
    assert no_rows["key_refit"] == {"rounds": 1} and no_rows["retrieval_heads"]["rows_weight"] == 0.0
    assert no_rows["retrieval_heads"]["scores"] == scores
    no_rows_tensors = load_file(tmp_path / "w0" / "model.safetensors")
    assert any(not torch.equal(plain[n], no_rows_tensors[n]) for n in attention)


def test_without_retrieval_windows_the_rows_weight_changes_nothing(tmp_path):
    """P = 0: no answer or needle rows, so any W converts byte for byte as today (key refit on)."""
    from surgery.testing.tiny_models import tiny

    src = tiny("llama", tmp_path / "src")
    outs = []
    for w in (1.0, 50.0):
        out = tmp_path / f"w{w:g}"
        convert_aligned(resolve_source(str(src)), out, MQAOptions(merge="aligned", calib=["pydoc"], calib_tokens=256),
                        progress=False, merge=MergeOptions(groups=1, refit_k=True, retrieval_rows_weight=w))
        outs.append((out / "model.safetensors").read_bytes())
    assert outs[0] == outs[1]


@pytest.mark.parametrize("flags,message", [
    (["--calib-retrieval-mix", "2"], r"--calib-retrieval-mix must lie in [0, 1], got 2"),
    (["--calib-retrieval-mix", "0.5", "--calib-window", "128"], "--calib-retrieval-mix: --calib-window 128 is too "
                                                                "short for"),
    (["--retrieval-weight", "1"], "--retrieval-weight weighs heads by their retrieval scores, measured on retrieval "
                                  "examples: give --calib-retrieval-mix P > 0 too"),
    (["--calib-retrieval-mix", "0.5", "--retrieval-weight", "-1"], "--retrieval-weight must be a finite number >= 0"),
    (["--merge", "mean", "--calib-retrieval-mix", "0.5"], "--calib-retrieval-mix does nothing for the mean merge"),
    (["--merge", "mean", "--retrieval-weight", "1"], "--retrieval-weight weighs the aligned merge's heads: it does "
                                                     "nothing for the mean merge"),
    (["--calib-retrieval-mix", "0.5", "--retrieval-rows-weight", "-1"], "--retrieval-rows-weight must be a finite "
                                                                        "number >= 0, got -1"),
    (["--retrieval-rows-weight", "5"], "--retrieval-rows-weight weighs the retrieval examples' answer and needle "
                                       "rows: give --calib-retrieval-mix P > 0 too"),
    (["--merge", "mean", "--retrieval-rows-weight", "5"], "--retrieval-rows-weight weighs the aligned merge's refit "
                                                          "rows: it does nothing for the mean merge"),
    (["--merge", "mean", "--refit-keys"], "--refit-keys refits the aligned merge's keys: it does nothing for the "
                                          "mean merge"),
])
def test_bad_retrieval_options_are_refused_in_one_line(flags, message, long_tiny, tmp_path, cli):
    args = ["--merge", "aligned", "--calib", "pydoc", *flags] if flags[0] != "--merge" else flags
    code, _, err = cli("convert", long_tiny, "--to", "mqa", "--out", tmp_path / "o", *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()



ANSWER, NEEDLE = L - 1, [3, 4]  # window 1's answer row and needle positions (the probes' `answers` / `needle`)


def _rows_fit(fit: str, weight: float, rows, p: AttnParams, x: torch.Tensor, pairs, merged, args):
    """The key or query refit with 4 random samples a window and `rows` extra ones weighing `weight`."""
    g = torch.Generator().manual_seed(0)
    groups = [[0, 1, 2]]
    shape = refit_shape(x, args[1], args[4], groups)
    if fit == "key":
        f = KeyFit(shape, L, pairs, D ** -0.5, None, KeyRefit(samples=4), g, x.device, None, weight)
        f.add(*args, rows=rows)
        return f.solve(merged)
    f = QueryFit(shape, L, groups, pairs, D ** -0.5, None, QueryRefit(samples=4, top_k=8), g, x.device, None, weight)
    f.add(*args, rows=rows)
    return f.solve(p.q)


@pytest.mark.parametrize("fit", ["key", "query"])
def test_retrieval_rows_enter_the_refit_and_without_them_it_is_unchanged(fit):
    """The answer row (query refit) / the needle's rows (key refit) of a retrieval window: with W > 0 the fit moves
    toward reproducing the source there; with no rows, or W = 0, the same tensors as without the option."""
    from surgery.fitting.refit import ideal_queries
    from surgery.kv.aligned.keyrefit import ideal_keys

    p, _, x = _layer(2)
    pairs, merged, args = _refit_inputs(p, x)
    cos, sin = args[5], args[6]
    positions = [ANSWER] if fit == "query" else NEEDLE
    rows = [(1, positions)]
    plain = _rows_fit(fit, 0.0, None, p, x, pairs, merged, args)
    for weight, extra in ((0.0, rows), (50.0, None), (50.0, [])):  # no rows or W = 0: byte-identical
        assert torch.equal(_rows_fit(fit, weight, extra, p, x, pairs, merged, args), plain)
    fitted = {w: _rows_fit(fit, w, rows, p, x, pairs, merged, args) for w in (1.0, 50.0)}
    assert not torch.equal(fitted[1.0], plain)
    at = torch.tensor(positions)
    q_src, k_src, q_cv, k_cv = (t[1:2] for t in args[1:5])
    if fit == "query":
        # the source's attention at the answer row (every head) against the converted one with the refit queries
        def kl(q_rows):
            q = project_heads(x[1:2], q_rows, D, cos[1:2], sin[1:2], pairs)[0, :, ANSWER]  # [H, D]
            k = k_cv[0].repeat_interleave(R, dim=0)[:, :ANSWER + 1]  # [H, L', D] the merged key
            src = torch.log_softmax(D ** -0.5 * (q_src[0, :, ANSWER, None] * k_src[0].repeat_interleave(R, dim=0)
                                                 [:, :ANSWER + 1]).sum(-1), -1)
            cv = torch.log_softmax(D ** -0.5 * (q[:, None] * k).sum(-1), -1)
            return float((src.exp() * (src - cv)).sum(-1).mean())
        before, one, many = kl(plain), kl(fitted[1.0]), kl(fitted[50.0])  # 0.030, 0.024, 0.019 at writing
        assert many < one < before, (before, one, many)
        # the target it moved toward: the ideal queries at the answer row
        ideal = ideal_queries(q_src, k_src[:, torch.arange(H) // R], q_cv, k_cv[:, 0], D ** -0.5, None, at,
                              QueryRefit(top_k=8))[0, :, 0]
        dist = lambda rows: float((project_heads(x[1:2], rows, D, cos[1:2], sin[1:2], pairs)[0, :, ANSWER]  # noqa
                                   - ideal).norm())
        assert dist(fitted[50.0]) < dist(plain)
    else:
        # the merged key at the needle's positions against the key that best reproduces the source's logits there
        ideal = ideal_keys(q_src[0], k_src[0, torch.arange(H) // R], q_cv[0], k_cv[0, 0], D ** -0.5, None, at,
                           KeyRefit())
        dist = lambda rows: float((project_heads(x[1:2], rows, D, cos[1:2], sin[1:2], pairs)[0, 0, at]  # noqa
                                   - ideal).norm())
        before, one, many = dist(plain), dist(fitted[1.0]), dist(fitted[50.0])
        assert many < one < before and many < 0.5 * before, (before, one, many)
