"""`--to swa`: sliding-window layers written as a standard checkpoint. The output loads with no custom code, computes
the source's function exactly at contexts within the window, windows exactly as the runtimes mean it beyond, and
`--global-layers auto` keeps the layers its calibration scores highest."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from surgery.kinds.base import cached_fraction
from surgery.swa.layers import evenly_spaced, parse_global_layers, top_layers
from surgery.swa.score import far_mass
from surgery.testing import tiny_models as tm


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tm.tiny("llama", tmp_path_factory.mktemp("swa") / "llama")


def _load(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def _config(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("arch, target", [("llama", "ministral"), ("qwen2", "qwen2"), ("qwen3", "qwen3"),
                                          ("gemma2", "gemma2"), ("mistral", "ministral")])
def test_the_output_loads_without_code_and_is_exact_within_the_window(arch, target, tmp_path, cli):
    src = tm.tiny(arch, tmp_path / arch)
    code, _, err = cli("convert", src, "--to", "swa", "--window", "8", "--global-layers", "1", "--out", tmp_path / "o")
    assert code == 0, err
    config = _config(tmp_path / "o")
    assert config["model_type"] == target and config["sliding_window"] == 8
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert not any((tmp_path / "o").glob("*.py"))
    model, source = _load(tmp_path / "o"), _load(src)
    assert type(model).__name__.lower().startswith(target.replace("_", ""))
    ids = tm.sample_ids(length=8)  # the window: every key visible, as in the source
    assert torch.allclose(tm.logits(model, ids), tm.logits(source, ids), atol=1e-5)
    long = tm.sample_ids(length=24)  # beyond it the sliding layer sees less
    assert not torch.allclose(tm.logits(model, long)[:, 8:], tm.logits(source, long)[:, 8:], atol=1e-3)


def test_a_sliding_layer_sees_the_query_and_the_window_minus_one_keys_before_it(llama, tmp_path, cli):
    """With every layer sliding, layer 0's output at position q depends only on tokens q-W+1..q: changing token
    q-W leaves it unchanged, changing q-W+1 does not (W = 8)."""
    code, _, err = cli("convert", llama, "--to", "swa", "--window", "8", "--global-layers", "0", "--out", tmp_path / "o")
    assert code == 0, err
    model = _load(tmp_path / "o")
    ids = tm.sample_ids(batch=1, length=20)
    q, w = 19, 8

    def first_layer(x):
        with torch.no_grad():
            return model(input_ids=x, output_hidden_states=True).hidden_states[1][0, q]

    base = first_layer(ids)
    outside, inside = ids.clone(), ids.clone()
    outside[0, q - w] = (ids[0, q - w] + 1) % tm.VOCAB
    inside[0, q - w + 1] = (ids[0, q - w + 1] + 1) % tm.VOCAB
    assert torch.equal(first_layer(outside), base)
    assert not torch.allclose(first_layer(inside), base)


def test_auto_keeps_the_layers_that_attend_most_beyond_the_window(llama, tmp_path, cli):
    code, out, err = cli("convert", llama, "--to", "swa", "--window", "16", "--global-layers", "auto:1",
                         "--layer-score", "mass", "--calib", "pydoc", "--calib-tokens", "256", "--calib-window", "64",
                         "--out", tmp_path / "o")
    assert code == 0, err
    record = json.loads((tmp_path / "o" / "surgery.json").read_text())
    scores = record["swa"]["scores"]
    assert len(scores) == 2 and all(0 < s < 1 for s in scores)
    assert record["swa"]["global_layers"] == [max(range(2), key=lambda i: scores[i])]
    assert record["calibration"]["window_length"] == 64
    types = _config(tmp_path / "o")["layer_types"]
    assert [i for i, t in enumerate(types) if t == "full_attention"] == record["swa"]["global_layers"]


def test_far_mass_is_the_probability_beyond_the_window():
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 12, 8), torch.randn(1, 2, 12, 8)
    total, rows = far_mass(q, k, 8 ** -0.5, 5)
    kk = k.repeat_interleave(2, dim=1)
    probs = (q @ kk.transpose(-1, -2) * 8 ** -0.5).masked_fill(torch.ones(12, 12).triu(1).bool(), -1e9).softmax(-1)
    want = sum(probs[0, h, i, : i - 5 + 1].sum().item() for h in range(4) for i in range(5, 12))
    assert rows == 4 * 7 and total == pytest.approx(want, rel=1e-5)


def test_global_layer_specs():
    for spec in ("auto", "auto:3", "4", "0,7,15", "0,", "[5]", [2]):  # the canonical spelling reads back the same
        parsed = parse_global_layers(spec)
        assert parse_global_layers(parsed.describe()) == parsed
    assert parse_global_layers("0,").indices == (0,) and parse_global_layers("0").count == 0
    assert parse_global_layers("auto").auto and parse_global_layers("auto:3").count == 3
    assert parse_global_layers("4").count == 4 and parse_global_layers("7,0,3").indices == (0, 3, 7)
    assert evenly_spaced(8, 30) == [2, 6, 10, 14, 17, 21, 25, 29] and evenly_spaced(0, 30) == []
    assert top_layers([0.1, 0.5, 0.3, 0.5], 2) == [1, 3]
    for bad, why in (("1,1", "listed twice"), ("x", "auto, auto:N"), ("-2", "negative"), ("auto:x", "auto, auto:N")):
        with pytest.raises(ValueError, match=why):
            parse_global_layers(bad)


def test_the_cache_at_a_context_counts_sliding_layers_at_their_window():
    config = {"num_hidden_layers": 4, "sliding_window": 100, "max_position_embeddings": 1000,
              "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}
    assert cached_fraction(config, 1000) == pytest.approx((1 + 3 * 0.1) / 4)
    assert cached_fraction(config, 50) == 1.0 and cached_fraction(config) == pytest.approx(0.325)
    qwen = config | {"model_type": "qwen2"}
    assert cached_fraction(qwen, 1000) == 1.0  # use_sliding_window off: the runtimes ignore the window
    assert cached_fraction(qwen | {"use_sliding_window": True}, 1000) == pytest.approx(0.325)
    mistral = {"model_type": "mistral", "num_hidden_layers": 4, "sliding_window": 100}
    assert cached_fraction(mistral, 1000) == pytest.approx(0.1)


def test_a_gqa_output_converts_again(llama, tmp_path, cli):
    assert cli("convert", llama, "--to", "gqa", "--kv-heads", "2", "--out", tmp_path / "gqa")[0] == 0
    code, _, err = cli("convert", tmp_path / "gqa", "--to", "swa", "--window", "8", "--global-layers", "1",
                       "--out", tmp_path / "o")
    assert code == 0, err
    config = _config(tmp_path / "o")
    assert config["num_key_value_heads"] == 2 and config["model_type"] == "ministral"
    ids = tm.sample_ids(length=8)
    assert torch.allclose(tm.logits(_load(tmp_path / "o"), ids), tm.logits(_load(tmp_path / "gqa"), ids), atol=1e-5)


@pytest.mark.parametrize("args, arch, message", [
    (["--window", "128", "--global-layers", "1"], "llama", "must be shorter than the model's context (128 tokens)"),
    (["--window", "8", "--global-layers", "0,2"], "llama", "layer 2 is out of range"),
    (["--window", "8", "--global-layers", "1,1"], "llama", "layer 1 is listed twice"),
    (["--window", "8", "--global-layers", "3"], "llama", "--global-layers 3: the model has 2 layers"),
    (["--global-layers", "1"], "llama", "needs --window"),
    (["--window", "8", "--global-layers", "1"], "gpt2", "no per-layer attention types"),
    (["--window", "8", "--global-layers", "1"], "cohere2", "global layers have no RoPE"),
    (["--window", "8", "--global-layers", "1", "--calib-tokens", "64"], "llama",
     "--calib-tokens does nothing for --global-layers 1, which reads no calibration text (use --global-layers auto"),
    (["--window", "8", "--global-layers", "1", "--precision", "bf16"], "llama",
     "--precision is calibration's precision: --global-layers 1 runs none (use --global-layers auto"),
    (["--window", "64", "--global-layers", "auto", "--calib-window", "64"], "llama", "must be longer than --window"),
    (["--window", "8", "--global-layers", "auto", "--calib", "pydoc", "--calib-tokens", "4"], "llama", "windows of 4 tokens, not longer"),
    (["--window", "8", "--global-layers", "1", "--sinks"], "qwen3",
     "--sinks: no standard qwen3 type carries attention sinks beside sliding windows"),
])
def test_bad_input_is_one_line_and_nothing_written(args, arch, message, tmp_path, cli):
    src = tm.tiny(arch, tmp_path / arch)
    code, _, err = cli("convert", src, "--to", "swa", *args, "--out", tmp_path / "o")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_a_swa_output_distils_from_its_source_and_stays_swa(tiny, tmp_path, cli):
    """A standard model: uptraining (KD from the source named in surgery.json) runs on it unchanged, moves it
    towards the source, and writes it back with its layer types."""
    from surgery.testing.pydoc_llama import FAST, metrics
    from surgery.training import UptrainOptions, uptrain

    code, _, err = cli("convert", tiny, "--to", "swa", "--window", "4", "--global-layers", "1", "--out",
                       tmp_path / "swa")
    assert code == 0, err
    uptrain(UptrainOptions(model=str(tmp_path / "swa"), out=tmp_path / "up", **(FAST | dict(tokens=1024, loss="kd", lr=3e-4))))
    kd = [m["kd_loss"] for m in metrics(tmp_path / "up") if "kd_loss" in m]
    assert len(kd) == 2 and kd[1] < kd[0]
    assert _config(tmp_path / "up")["layer_types"] == _config(tmp_path / "swa")["layer_types"]
    assert _load(tmp_path / "up").config.sliding_window == 4


def test_sinks_are_a_standard_granite_swa_exact_until_trained_then_trained_alone(tiny, tmp_path, cli):
    """`--sinks`: granite_swa (no custom code) computing what the sink-less output computes, within float32 noise,
    at every length; `uptrain --train new --new-lr` moves the sinks and nothing else, and the result stays
    granite_swa."""
    from surgery.testing.pydoc_llama import FAST
    from surgery.training import UptrainOptions, uptrain

    for name, extra in (("plain", []), ("sinks", ["--sinks"])):
        code, _, err = cli("convert", tiny, "--to", "swa", "--window", "4", "--global-layers", "1", *extra,
                           "--out", tmp_path / name)
        assert code == 0, err
    config = _config(tmp_path / "sinks")
    assert config["model_type"] == "granite_swa" and config["layer_types"] == _config(tmp_path / "plain")["layer_types"]
    assert not any((tmp_path / "sinks").glob("*.py"))
    record = json.loads((tmp_path / "sinks" / "surgery.json").read_text())
    assert record["new_parameters"] == ["model.layers.{layer}.self_attn.sinks"] and record["swa"]["sinks"]
    plain, sinks = _load(tmp_path / "plain"), _load(tmp_path / "sinks")
    ids = tm.sample_ids(length=16)  # 4 windows
    assert torch.allclose(tm.logits(sinks, ids), tm.logits(plain, ids), atol=1e-4)
    uptrain(UptrainOptions(model=str(tmp_path / "sinks"), out=tmp_path / "up", train="new", new_lr=0.5,
                           **(FAST | dict(tokens=1024, loss="kd", lr=3e-4))))
    up = _load(tmp_path / "up")
    assert up.config.model_type == "granite_swa"
    before, after = dict(sinks.named_parameters()), dict(up.named_parameters())
    moved = {n for n in after if not torch.equal(after[n], before[n])}
    assert moved and all(n.endswith("self_attn.sinks") for n in moved)
    # two steps of at most 0.5 each (Adam's step is about the rate whatever the gradient's size): far beyond what
    # two steps at --lr 3e-4 could move
    assert 0.05 < max((after[n] - before[n]).abs().max().item() for n in moved) <= 1.0 + 1e-6
    assert json.loads((tmp_path / "up" / "surgery.json").read_text())["uptraining"]["optimizer"]["new_lr"] == 0.5


# ---- --layer-score cost: what windowing each layer costs, measured ------------------------------------------------
def _answer_and_text(model, probe, window):
    """The probe's mean answer log-prob and mean NLL beyond the window, from a whole model in memory."""
    from surgery.swa.cost import text_positions

    answer, text = 0.0, 0.0
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=probe.ids).logits.float(), -1)
    for b, start in enumerate(probe.answer_starts):
        ids = probe.ids[b]
        answer += logp[b, start - 1:-1].gather(-1, ids[start:, None]).mean().item()
        at = text_positions(window, start)
        text -= logp[b, at].gather(-1, ids[at + 1, None]).mean().item()
    return answer / len(probe.answer_starts), text / len(probe.answer_starts)


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory, tokenizer):
    """The tiny pydoc Llama (BPE tokens: retrieval examples fit in 512) with 1,024 positions."""
    from surgery.testing.pydoc_llama import make_model

    return make_model(tmp_path_factory.mktemp("swa") / "long", tokenizer, positions=1024)


def test_windowing_cost_is_what_the_windowed_checkpoint_loses(long_llama, tmp_path, cli):
    """Each layer's cost from the streamed leave-one-out pass equals the loss measured on the swa checkpoint with
    that layer alone windowed, loaded whole by transformers."""
    from surgery.calibration.text import calibration_text
    from surgery.checkpoint.tensors import CheckpointReader
    from surgery.swa.cost import Probe, probe_examples, windowing_costs
    from transformers import AutoTokenizer

    llama, window = long_llama, 64
    tokenizer = AutoTokenizer.from_pretrained(llama)
    text = calibration_text("pydoc", tokenizer, 3 * 512, None, window=512)
    probe = Probe.of(probe_examples(tokenizer, text.windows))
    assert [len(e) for e in probe.ids] == [512] * 3
    costs = windowing_costs(llama, CheckpointReader(llama), probe, torch.device("cpu"), window, 2, [0, 1], [0, 1],
                            progress=False)
    source = _answer_and_text(_load(llama), probe, window)
    for layer, keep in ((0, "1"), (1, "0,")):
        code, _, err = cli("convert", llama, "--to", "swa", "--window", str(window), "--global-layers", keep,
                           "--out", tmp_path / f"w{layer}")
        assert code == 0, err
        windowed = _answer_and_text(_load(tmp_path / f"w{layer}"), probe, window)
        assert costs[layer]["answer"] == pytest.approx(source[0] - windowed[0], abs=1e-4)
        assert costs[layer]["text"] == pytest.approx(windowed[1] - source[1], abs=1e-4)
        assert costs[layer]["cost"] == pytest.approx(costs[layer]["answer"] + costs[layer]["text"])
    assert any(abs(c["cost"]) > 1e-3 for c in costs.values())  # windowing changed something to measure


def test_auto_by_cost_keeps_the_costliest_layers_and_records_every_round(long_llama, tmp_path, cli):
    code, _, err = cli("convert", long_llama, "--to", "swa", "--window", "64", "--global-layers", "auto:1",
                       "--calib", "pydoc", "--calib-tokens", "2304", "--calib-window", "768", "--out", tmp_path / "o")
    assert code == 0, err
    record = json.loads((tmp_path / "o" / "surgery.json").read_text())
    swa, rounds = record["swa"], record["calibration"]["rounds"]
    assert swa["layer_score"] == "cost" and len(rounds) == 1 and rounds[0]["global"] == [0, 1]
    costs = {int(k): v["cost"] for k, v in rounds[0]["costs"].items()}
    assert swa["global_layers"] == [max(costs, key=costs.get)]
    assert swa["scores"] == pytest.approx([costs[0], costs[1]], abs=1e-5)


def test_successive_halving_rescores_the_survivors():
    from surgery.swa.cost import choose_by_cost

    seen = []

    def score_round(kept, candidates):  # a layer's cost: its index, but layer 4 is vital once 3 (its twin) is windowed
        seen.append(list(kept))
        return {i: {"cost": float(100 if i == 4 and 3 not in kept else i)} for i in candidates}

    chosen, rounds = choose_by_cost(score_round, 8, 2)  # one ranking from every layer global would keep 6 and 7
    assert seen == [list(range(8)), [4, 5, 6, 7]] and chosen == [4, 7]
    assert [r["global"] for r in rounds] == seen
