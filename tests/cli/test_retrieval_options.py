"""`surgery check --retrieval` on the command line, with tiny models: bad retrieval input is one line and exit 2
before any model loads; lengths in multiples of the converted model's window; the check's own text as the haystack
when the user gives one; and a report written to a file (not a terminal) carries whole values."""

from __future__ import annotations

import json
import shutil

import pytest

from surgery.testing.pydoc_llama import make_model

WINDOW = 256


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer):
    """A tiny Llama (context 1024) and the same weights as a Ministral whose first layer slides over 256 tokens."""
    root = tmp_path_factory.mktemp("retrieval-cli")
    source = make_model(root / "llama", tokenizer, positions=1024)
    windowed = root / "windowed"
    shutil.copytree(source, windowed)
    config = json.loads((windowed / "config.json").read_text())
    for key in ("attention_bias", "mlp_bias", "pretraining_tp"):  # no place in Ministral's layer
        config.pop(key, None)
    config |= {"model_type": "ministral", "architectures": ["MinistralForCausalLM"], "sliding_window": WINDOW,
               "layer_types": ["sliding_attention", "full_attention"]}
    (windowed / "config.json").write_text(json.dumps(config))
    return source, windowed


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """A text file with a long name (a long perplexity label) and some 5,000 tokens of the tiny tokenizer."""
    path = tmp_path_factory.mktemp("texts") / "a_text_file_whose_name_makes_the_report_labels_long.txt"
    path.write_text("".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(300)))
    return path


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: refusals must come first."""
    import surgery.checking.compare

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(surgery.checking.compare, "load_model", refuse)


@pytest.mark.parametrize("args, message", [
    (["--retrieval", "niah_multikey", "--retrieval-lengths", "128"], "128 tokens is too short for niah_multikey"),
    (["--retrieval", "passkey", "--retrieval-samples", "0"], "--retrieval-samples must be at least 1, got 0"),
    (["--retrieval", "passkey", "--retrieval-samples", "-3"], "--retrieval-samples must be at least 1, got -3"),
    (["--retrieval", "passkey", "--retrieval-batch", "0"], "--retrieval-batch must be at least 1, got 0"),
    (["--retrieval", "passkey", "--retrieval-lengths", "512,3x"], "got '3x'"),
    (["--retrieval", "passkey", "--retrieval-lengths", "2w"],
     "w is the converted model's sliding window, and {llama} has no sliding window (its config.json sets no "
     "sliding_window)"),
    (["--retrieval", "passkey", "--retrieval-lengths", "1024", "--data", "{text}", "--tokens", "512"],
     "fewer than the longest retrieval length 1024 (raise --tokens, give a longer --data, or use "
     "--retrieval-haystack noise)"),
    (["--retrieval-batch", "2"], "need --retrieval TASKS"),
])
def test_bad_retrieval_input_is_one_line_before_any_model(args, message, models, text, cli, no_model, tmp_path):
    llama, _ = models
    args = [a.format(text=text) for a in args]
    code, _, err = cli("check", llama, llama, "--tokens", "256", "--seq-len", "256", *args, "--json",
                       tmp_path / "r.json")
    assert code == 2 and message.format(llama=llama) in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r.json").exists()


def test_lengths_in_windows_on_the_check_s_own_text(models, text, cli, tmp_path):
    llama, windowed = models
    code, out, err = cli("check", llama, windowed, "--data", text, "--tokens", "1024", "--seq-len", "256",
                         "--retrieval", "passkey", "--retrieval-lengths", "1w,512", "--retrieval-samples", "2",
                         "--json", tmp_path / "r.json")
    assert code == 0, err
    r = json.loads((tmp_path / "r.json").read_text())["retrieval"]
    assert r["lengths"] == [256, 512] and r["window"] == WINDOW and r["lengths_in_windows"] == [1.0, 2.0]
    assert r["haystack"] == "text" and r["haystack_text"] == str(text) and r["haystack_tokens"] == 1024
    for n in ("256", "512"):
        cell = r["accuracy"]["passkey"][n]
        assert cell["n"] == 2 and 0 <= cell["ci_low_source"] <= cell["source"] <= cell["ci_high_source"] <= 1
    assert "(1w)" in out and "(2w)" in out and "w = 256 tokens" in out and "] / " in out


def test_the_default_text_leaves_the_noise_haystack(models, cli, tmp_path):
    llama, _ = models
    code, _, err = cli("check", llama, llama, "--tokens", "256", "--seq-len", "256", "--retrieval", "passkey",
                       "--retrieval-lengths", "256", "--retrieval-samples", "1", "--json", tmp_path / "r.json")
    assert code == 0, err
    assert json.loads((tmp_path / "r.json").read_text())["retrieval"]["haystack"] == "noise"


def test_a_report_written_to_a_file_keeps_whole_values(models, text, cli, tmp_path):
    """The captured stdout is no terminal, as a check redirected to a log file: rich would give it 80 columns and
    cut the values of a table whose labels are long ("11.0…")."""
    llama, _ = models
    code, out, err = cli("check", llama, llama, "--data", text, "--tokens", "512", "--seq-len", "256", "--json",
                         tmp_path / "r.json")
    assert code == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    assert "…" not in out
    for value in (f"{report['ppl_source']:.3f}", f"{report['max_abs_diff']:.3e}",
                  f"{100 * report['top1_agreement']:.2f}%"):
        assert value in out, (value, out)
    assert max(map(len, out.splitlines())) > 80  # the labels stand whole on one line
