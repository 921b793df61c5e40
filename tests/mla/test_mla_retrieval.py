"""--to mla with retrieval heads weighted (`--retrieval-weight B`, `--retrieval-rows-weight W`, on the
`--calib-retrieval-mix` examples: surgery/mla/retrieval.py): the weights reduce to today's factorisation at 1, spend
the latent's rank on a heavy head, count the retrieval rows W times, and the scores and weights land in surgery.json;
on random layers and on the tiny pydoc Llama (its tokenizer's examples need windows of 1,024)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from surgery.calibration.retrieval import RetrievalWindow
from surgery.checkpoint.source import resolve_source
from surgery.mla import convert_to_mla
from surgery.mla.factor import FitWeights, SourceAttention, factor_latent, mla_layer, split_rope
from surgery.mla.options import MLAOptions
from surgery.mla.retrieval import RetrievalCalibration
from surgery.testing.pydoc_llama import make_model

H_Q, D, DIN = 4, 8, 24  # query heads, head_dim, input width


def _source(kv_heads: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, DIN, generator=g, dtype=torch.float64) * torch.linspace(0.3, 2.0, DIN, dtype=torch.float64)
    sigma = x.T @ x / x.shape[0]
    shapes = ((H_Q * D, DIN), (kv_heads * D, DIN), (kv_heads * D, DIN), (DIN, H_Q * D))
    src = SourceAttention(*(torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes), H_Q, kv_heads, D)
    return src, sigma


def _heavy(head: int, weight: float = 200.0) -> torch.Tensor:
    w = torch.ones(H_Q, dtype=torch.float64)
    w[head] = weight
    return w


def _latent_errors(src: SourceAttention, sigma: torch.Tensor, rank: int, weights: FitWeights | None):
    """Per head (MHA: its own K/V group), the relative error of its keys (in its queries' metric) and of its values
    (in its o_proj columns' metric) through the latent, every key dim without position (no kept frequency)."""
    keys = src.k.reshape(H_Q, D, DIN)
    a, b, _ = factor_latent(keys, src, sigma, rank, weights)
    full = torch.cat([src.k, src.v])
    diff = full - b @ a
    q, o = src.q.reshape(H_Q, D, DIN), src.o.T.reshape(H_Q, D, -1)
    out = []
    for h in range(H_Q):
        for rows, metric in ((slice(h * D, (h + 1) * D), q[h] @ sigma @ q[h].T),
                             (slice((H_Q + h) * D, (H_Q + h + 1) * D), o[h] @ o[h].T)):
            err = torch.trace(metric @ diff[rows] @ sigma @ diff[rows].T)
            out.append(float(err / torch.trace(metric @ full[rows] @ sigma @ full[rows].T)))
    return torch.tensor(out).reshape(H_Q, 2)  # [head, (key, value)]


def test_head_weights_of_one_are_today_s_factorisation():
    src, sigma = _source(kv_heads=2)
    ones = FitWeights(heads=torch.ones(H_Q, dtype=torch.float64))
    plain, same = mla_layer(src, sigma, [0, 2], "half", 12, D ** -0.5, 1e-5), \
        mla_layer(src, sigma, [0, 2], "half", 12, D ** -0.5, 1e-5, weights=ones)
    for name in ("q_proj", "kv_a", "kv_a_norm", "kv_b", "o_proj"):
        assert torch.equal(getattr(plain, name), getattr(same, name)), name
    heavy = mla_layer(src, sigma, [0, 2], "half", 12, D ** -0.5, 1e-5, weights=FitWeights(heads=_heavy(1)))
    assert not torch.allclose(heavy.kv_b, plain.kv_b) and torch.isfinite(heavy.kv_b).all()


def test_a_heavy_head_keeps_more_of_its_keys_and_values_through_the_latent():
    """MHA (each head its own K/V group), rank 12 of 64: weighting head 1 by 200 spends the rank on it, its key and
    value errors fall well below the unweighted fit's, and the other heads pay for it."""
    src, sigma = _source(kv_heads=H_Q)
    plain = _latent_errors(src, sigma, 12, None)
    weighted = _latent_errors(src, sigma, 12, FitWeights(heads=_heavy(1)))
    assert (weighted[1] < 0.5 * plain[1]).all(), (plain[1], weighted[1])
    others = [0, 2, 3]
    assert weighted[others].sum() > plain[others].sum(), (plain, weighted)


def test_a_heavy_group_s_keys_lean_the_shared_rope_key_toward_it():
    """GQA 4 -> 2: the rope key is one direction per frequency shared by both groups; weighting group 0's heads
    makes it follow group 0's keys, whose residual (what loses its rotation) shrinks."""
    src, sigma = _source(kv_heads=2, seed=3)

    def residual_share(weights):
        _, _, nope, _ = split_rope(src, sigma, [0, 1, 2], "half", weights)
        k0, r0 = src.k.reshape(2, D, DIN)[0], nope[0]
        rows = torch.tensor([0, 1, 2, 4, 5, 6])  # the kept frequencies' rows of a "half" head of 8
        return float(torch.trace(r0[rows] @ sigma @ r0[rows].T) / torch.trace(k0[rows] @ sigma @ k0[rows].T))

    heads = torch.tensor([300.0, 300.0, 1.0, 1.0], dtype=torch.float64)
    assert residual_share(FitWeights(heads=heads)) < 0.5 * residual_share(None)


def _record(queries, keys):
    return SimpleNamespace(queries=[queries], keys=[keys], scaling=None, softcap=None)


def test_rows_count_w_times_in_the_moments_and_the_heads_are_scored():
    """Window 1 of a chunk of two holds an example: with W = 3 its needle rows count three times in the keys'
    moments and its answer rows in the queries' (as if repeated), the plain sigma elsewhere; a head whose answer
    positions look only at the needle scores 1, and its weight is 1 + B."""
    g = torch.Generator().manual_seed(0)
    n, length = 2, 12
    x = torch.randn(n, length, DIN, generator=g, dtype=torch.float64)
    probe = RetrievalWindow(1, "passkey", answers=[10, 11], needle=[3, 4])
    retrieval = RetrievalCalibration([probe], chunk_windows=2, weight=4.0, rows_weight=3.0)
    queries, keys = torch.zeros(n, 2, length, D), torch.zeros(n, 1, length, D)
    keys[1, 0, [3, 4], 0] = 1.0
    queries[1, 0, :, 0] = 1e3  # head 0 looks at the needle from everywhere; head 1 sees every visible key alike
    calls = []
    retrieval.see(0, 0, x, lambda: calls.append(1) or _record(queries, keys))
    retrieval.see(0, 1, x, lambda: calls.append(2) or _record(queries, keys))  # chunk 1: no probe, not run
    assert calls == [1]
    flat = torch.cat([x, x]).reshape(-1, DIN)  # both chunks' rows
    sigma = flat.T @ flat / flat.shape[0]
    fit = retrieval.weights(0, sigma)

    def repeated(positions):
        rows = torch.cat([flat, x[1, positions], x[1, positions]])  # each counted 3 times in all
        return rows.T @ rows / rows.shape[0]

    torch.testing.assert_close(fit.key_sigma, repeated([3, 4]), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fit.query_sigma, repeated([10, 11]), rtol=1e-12, atol=1e-12)
    scores = retrieval.scores.layer(0)
    assert abs(float(scores[0]) - 1) < 1e-6 and abs(float(scores[1]) - (2 / 11 + 2 / 12) / 2) < 1e-6, scores
    torch.testing.assert_close(fit.heads, 1 + 4.0 * scores)
    plain = RetrievalCalibration([probe], 2, 0.0, 1.0)  # B = 0, W = 1: scored, the plain fit
    plain.see(0, 0, x, lambda: _record(queries, keys))
    assert plain.weights(0, sigma) is None and plain.scores.layer(0) is not None


WINDOW = 1024


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory, tokenizer):
    """The tiny pydoc Llama (4 query heads, 2 K/V heads) with a context of 1,024: room for the retrieval examples."""
    return make_model(tmp_path_factory.mktemp("long-tiny-mla") / "src", tokenizer, positions=WINDOW)


def _convert(src, out, **kw) -> tuple[dict, dict]:
    options = MLAOptions(kv_rank=24, calib=["pydoc"], calib_tokens=2 * WINDOW, calib_window=WINDOW,
                         calib_retrieval_mix=0.5, seed=1, **kw)
    record = convert_to_mla(resolve_source(str(src)), out, options, progress=False)
    return record, load_file(out / "model.safetensors")


def test_scores_are_recorded_and_change_nothing_and_the_weights_change_the_latent(long_tiny, tmp_path, monkeypatch):
    record, scored = _convert(long_tiny, tmp_path / "p")
    weighted_record, weighted = _convert(long_tiny, tmp_path / "b", retrieval_weight=16.0, retrieval_rows_weight=32.0)
    heads = record["mla"]["retrieval_heads"]
    assert heads["weight"] == 0.0 and heads["rows_weight"] == 1.0
    scores = heads["scores"]
    assert len(scores) == 2 and all(len(layer) == 4 and all(0 <= s <= 1 for s in layer) for layer in scores)
    assert max(scores[0]) > 0
    written = json.loads((tmp_path / "b" / "surgery.json").read_text())["mla"]["retrieval_heads"]
    assert written["weight"] == 16.0 and written["rows_weight"] == 32.0
    assert written["scores"][0] == scores[0]  # layer 0 sees the same input: scored before any weight is used
    attention = [n for n in scored if ".self_attn." in n]
    assert any(not torch.equal(scored[n], weighted[n]) for n in attention)
    assert all(torch.equal(scored[n], weighted[n]) for n in scored if ".self_attn." not in n)
    assert all(torch.isfinite(t).all() for t in weighted.values())
    # the scoring alone (B = 0, W = 1) writes the same tensors as the conversion that scores nothing
    monkeypatch.setattr("surgery.mla.convert.RetrievalCalibration", lambda *a: None)
    unscored_record, unscored = _convert(long_tiny, tmp_path / "u")
    assert "retrieval_heads" not in unscored_record["mla"]
    assert (tmp_path / "u" / "model.safetensors").read_bytes() == (tmp_path / "p" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("flags,message", [
    (["--retrieval-weight", "1"], "--retrieval-weight weighs heads by their retrieval scores, measured on retrieval "
                                  "examples: give --calib-retrieval-mix P > 0 too"),
    (["--calib-retrieval-mix", "0.5", "--retrieval-weight", "-1"], "--retrieval-weight must be a finite number >= 0"),
    (["--retrieval-rows-weight", "5"], "--retrieval-rows-weight weighs the retrieval examples' answer and needle "
                                       "rows: give --calib-retrieval-mix P > 0 too"),
    (["--calib-retrieval-mix", "0.5", "--retrieval-rows-weight", "-1"], "--retrieval-rows-weight must be a finite "
                                                                        "number >= 0, got -1"),
])
def test_bad_retrieval_weights_are_refused_in_one_line(flags, message, long_tiny, tmp_path, cli):
    code, _, err = cli("convert", long_tiny, "--to", "mla", "--kv-rank", 8, "--calib", "pydoc", "--out",
                       tmp_path / "o", *flags)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()
