"""`check --retrieval`: RULER-style synthetic retrieval built here, scored teacher-forced for both models."""

from __future__ import annotations

import json

import pytest
import torch

from surgery.checking.retrieval import RetrievalPlan, score_retrieval
from surgery.checking.retrieval_spec import default_lengths
from surgery.retrieval_tasks import TASKS, make_examples


@pytest.fixture(scope="module")
def smol(smollm2):
    from transformers import AutoModelForCausalLM

    from surgery.runtime import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2.folder, dtype=torch.float32).eval()
    return model, load_tokenizer(smollm2)


@pytest.mark.parametrize("task", TASKS)
def test_examples_are_exact_in_length_deterministic_and_hold_their_answer(task, smol):
    _, tok = smol
    examples = make_examples(task, tok, 700, 3)
    assert [e.ids for e in examples] == [e.ids for e in make_examples(task, tok, 700, 3)]
    assert [e.ids for e in examples] != [e.ids for e in make_examples(task, tok, 700, 3, seed=1)]
    assert [e.depth for e in examples] == pytest.approx([1 / 6, 1 / 2, 5 / 6])
    for e in examples:
        assert len(e.ids) == 700 and e.ids[e.answer_start:] == [t for item in e.items for t in item]
        prompt = tok.decode(e.ids[:e.answer_start])
        for item in e.items:  # each item to retrieve stands in the context
            assert tok.decode(item).strip() in prompt
    if task in ("passkey", "niah_single"):  # the needle moves with the depth
        places = [tok.decode(e.ids).index(tok.decode(e.items[0]).strip()) for e in examples]
        assert places == sorted(places)


def test_a_text_haystack_fills_the_context_with_that_text(smol):
    _, tok = smol
    text = tok("The quick brown fox jumps over the lazy dog. " * 200)["input_ids"]
    e = make_examples("niah_single", tok, 600, 1, haystack_tokens=text)[0]
    assert len(e.ids) == 600 and tok.decode(e.ids).count("lazy dog") > 50


def test_teacher_forced_scores_are_greedy_decoding_s_exact_match(smol):
    """An example scores 1 exactly when greedy decoding from its prompt writes the whole answer."""
    model, tok = smol
    examples = [e for task in ("passkey", "variable_tracking", "common_words")
                for e in make_examples(task, tok, 300, 1)]
    plan = RetrievalPlan.of(["x"], [300], 1, "noise", examples)
    rows = score_retrieval(model, plan, torch.device("cpu"), progress=False)
    for e, row in zip(examples, rows):
        n = e.length - e.answer_start
        prompt = torch.tensor([e.ids[:e.answer_start]])
        out = model.generate(prompt, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(prompt),
                             pad_token_id=tok.eos_token_id)[0, e.answer_start:].tolist()
        assert (row["score"] == 1.0) == (out == e.ids[e.answer_start:]), (e.task, row, tok.decode(out))
    assert any(r["score"] == 1.0 for r in rows)  # SmolLM2 retrieves the passkey at 300 tokens


def test_default_lengths_double_up_to_the_window():
    assert default_lengths(8192) == [512, 1024, 2048, 4096, 8192] and default_lengths(3000) == [512, 1024, 2048, 3000]


def test_check_reports_retrieval_by_length_with_a_plot(smollm2, tmp_path, cli):
    code, out, err = cli("check", smollm2.folder, smollm2.folder, "--tokens", "256", "--seq-len", "256",
                         "--retrieval", "passkey,niah_multikey", "--retrieval-lengths", "256,384",
                         "--retrieval-samples", "1", "--retrieval-metric", "string", "--json", tmp_path / "r.json",
                         "--plot", tmp_path / "r.png")
    assert code == 0, err
    r = json.loads((tmp_path / "r.json").read_text())["retrieval"]
    assert r["tasks"] == ["passkey", "niah_multikey"] and r["lengths"] == [256, 384]
    for task in r["tasks"]:
        for n in ("256", "384"):
            cell = r["accuracy"][task][n]
            assert cell["source"] == cell["converted"]  # the same model twice
            assert cell["n"] == 1 and (cell["ci_low_source"], cell["ci_high_source"]) == \
                (cell["ci_low_converted"], cell["ci_high_converted"])
            assert cell["exact_hits_source"] == cell["exact_hits_converted"] <= cell["hits_source"]  # string >= exact
    assert r["haystack"] == "noise" and "window" not in r  # the default text: the noise; lengths in tokens
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG" and "retrieval accuracy by length" in out
    assert "95% Wilson" in out and "] / " in out and r["metric"] == "string" and "exact hits" in out


@pytest.mark.parametrize("args, message", [
    (["--retrieval", "needle"], "unknown retrieval task 'needle'"),
    (["--retrieval", "passkey", "--retrieval-lengths", "9000"], "beyond the model's context (8192)"),
    (["--retrieval", "passkey", "--retrieval-lengths", "2x"], "comma-separated token counts"),
    (["--retrieval", "passkey", "--retrieval-haystack", "text", "--retrieval-lengths", "1024"],
     "fewer than the longest retrieval length 1024"),
    (["--plot", "p.png"], "--plot draws the retrieval accuracy: it needs --retrieval"),
    (["--retrieval-samples", "2"], "need --retrieval TASKS"),
    (["--retrieval", "passkey", "--retrieval-metric", "fuzzy"], "'fuzzy' is not one of 'exact', 'string'"),
])
def test_bad_retrieval_input_is_one_line_before_any_model(args, message, smollm2, tmp_path, cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = cli("check", smollm2.folder, smollm2.folder, "--tokens", "256", *args, "--json", tmp_path / "r.json")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "p.png").exists()
