"""--skip-tokens: a continued uptraining run trains on the text after the tokens its input was trained on."""

from __future__ import annotations

import json

import pytest
import torch

from surgery.data import load_texts
from surgery.errors import SurgeryError
from surgery.testing.pydoc_llama import FAST
from surgery.training import UptrainOptions, uptrain
from surgery.training.data import pack
from surgery.training.recipe_data import packed_key, tokens_trained_on

from inprocess import uptrain_error


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    path = tmp_path_factory.mktemp("skip") / "docs.jsonl"
    path.write_text("".join(json.dumps({"body": f"document {i}: " + "words " * (5 + 7 * i)}) + "\n"
                            for i in range(40)))
    return str(path)


@pytest.mark.parametrize("skip", [1, 37, 160])
def test_skipped_windows_are_the_text_after_the_first_training_tokens(tokenizer, docs, skip):
    whole = pack(load_texts(docs, "body"), tokenizer, seq_len=16, eval_tokens=100, train_tokens=400 + skip + 200)
    skipped = pack(load_texts(docs, "body"), tokenizer, seq_len=16, eval_tokens=100, train_tokens=400,
                   skip_tokens=skip)
    assert torch.equal(skipped.eval, whole.eval)  # the held-out split is unchanged
    rest = whole.train.flatten()[skip:]
    assert 400 <= skipped.train.numel() <= rest.numel()
    assert torch.equal(skipped.train.flatten(), rest[: skipped.train.numel()])


def test_a_skip_past_the_text_leaves_no_training_data(tokenizer, docs):
    whole = pack(load_texts(docs, "body"), tokenizer, seq_len=16, eval_tokens=100, train_tokens=10 ** 6)
    total = whole.train.numel()
    pack(load_texts(docs, "body"), tokenizer, seq_len=16, eval_tokens=100, train_tokens=16, skip_tokens=total - 16)
    with pytest.raises(SurgeryError, match=r"no training data left: .* after --skip-tokens \d+ .* lower --skip-tokens"):
        pack(load_texts(docs, "body"), tokenizer, seq_len=16, eval_tokens=100, train_tokens=16, skip_tokens=total)


def test_the_cache_key_and_the_trajectory_hold_the_skip(tiny, tokenizer, tmp_path):
    plain = UptrainOptions(model=str(tiny), out=tmp_path / "o", tokens=512, **FAST)
    skip = UptrainOptions(model=str(tiny), out=tmp_path / "o", tokens=512, skip_tokens=512, **FAST)
    assert packed_key(plain, tokenizer) != packed_key(skip, tokenizer)
    assert plain.trajectory()["skip_tokens"] == 0 and skip.trajectory()["skip_tokens"] == 512


def test_bad_skips_exit_2_before_the_model_loads(tiny, monkeypatch, capsys, tmp_path):
    out = ["--out", tmp_path / "o", "--seq-len", "64", "--batch-tokens", "512", "--eval-tokens", "256",
           "--data", "pydoc", "--tokens", 512]
    assert "--skip-tokens must not be negative" in uptrain_error(monkeypatch, capsys, tiny, *out, "--skip-tokens", -1)
    assert "--skip-tokens reads packed data" in uptrain_error(monkeypatch, capsys, tiny, *out, "--skip-tokens", 5,
                                                              "--data-mode", "stream")
    assert "lower --skip-tokens" in uptrain_error(monkeypatch, capsys, tiny, *out, "--skip-tokens", 10 ** 9)
    assert not (tmp_path / "o").exists()


def test_a_continued_run_is_warned_then_skips_and_records_it(tiny, cli, tmp_path):
    flags = ["--seq-len", "64", "--batch-tokens", "512", "--micro-batch", "4", "--eval-tokens",
             "256", "--eval-every", "0", "--save-every", "0", "--loss", "lm", "--tokens", "512"]
    code, _, err = cli("uptrain", tiny, "--out", tmp_path / "a", *flags, "--data", "pydoc")
    assert code == 0 and "--skip-tokens" not in err  # the tiny model was not uptrained
    code, _, err = cli("uptrain", tmp_path / "a", "--out", tmp_path / "c", *flags, "--data", "pydoc",
                       "--skip-tokens", "512", "--keep-run-dir")
    assert code == 0 and "--skip-tokens" not in err
    record = json.loads((tmp_path / "c" / "surgery.json").read_text())["uptraining"]
    assert record["skip_tokens"] == 512 and record["tokens"] == 512
    assert json.loads((tmp_path / "c.run" / "run.json").read_text())["skip_tokens"] == 512
    code, _, err = cli("uptrain", tmp_path / "a", "--out", tmp_path / "c", *flags, "--data", "pydoc", "--resume",
                       "--force")  # a resume must repeat the skip
    assert code == 2 and "skip_tokens: 512 -> 0" in err
    # continuing c without --skip-tokens: its input was trained on the tokens 512..1024
    code, _, err = cli("uptrain", tmp_path / "c", "--out", tmp_path / "d", *flags, "--data", "pydoc")
    warned = [line for line in err.splitlines() if "--skip-tokens" in line]
    assert code == 0 and len(warned) == 1 and warned[0].startswith("surgery: warning: ")
    assert "first 1024 training tokens" in warned[0] and "--skip-tokens 1024" in warned[0]
    # another text than the input's: nothing to warn of
    a = json.loads((tmp_path / "a" / "surgery.json").read_text())
    assert tokens_trained_on(a, "pydoc") == 512 and tokens_trained_on(a, "stdlib") is None
