"""Bad input: one clear line on stderr, exit code 2, nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from inprocess import assert_one_line_error, surgery

from surgery.testing import tiny_models as tm

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("src") / "llama"
    tm.make_tiny("llama", folder)
    return folder


def only(folder: Path, *names: str) -> None:
    assert sorted(p.name for p in folder.iterdir()) == sorted(names)


def test_unknown_model(tmp_path):
    assert_one_line_error(surgery("convert", tmp_path / "nope", "--to", "mqa", "--out", tmp_path / "o"), "does not exist")
    assert_one_line_error(surgery("convert", "no-such-owner/no-such-model", "--to", "mqa", "--out", tmp_path / "o"),
                          "no-such-owner/no-such-model")
    only(tmp_path)


def test_groups_that_do_not_divide(llama, tmp_path):
    assert_one_line_error(surgery("convert", llama, "--to", "gqa", "--kv-heads", "3", "--out", tmp_path / "o"),
                          "must divide", "1, 2, 4")
    assert_one_line_error(surgery("convert", llama, "--to", "gqa", "--out", tmp_path / "o"), "--kv-heads")
    assert_one_line_error(surgery("convert", llama, "--to", "mqa", "--kv-heads", "2", "--out", tmp_path / "o"))
    only(tmp_path)


def test_unsupported_architecture(tmp_path):
    import transformers as tf

    tf.BertModel(tf.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=37)).save_pretrained(tmp_path / "bert")
    result = surgery("convert", tmp_path / "bert", "--to", "mqa", "--out", tmp_path / "o")
    assert_one_line_error(result, "'bert'", "llama", "gpt2", "talking-heads")
    only(tmp_path, "bert")


def test_missing_truncated_and_corrupt_shards(tmp_path):
    src = tmp_path / "src"
    tm.make_tiny("llama", src, max_shard_size="30KB")
    shards = sorted(src.glob("model-*.safetensors"))
    missing = shards[1].rename(tmp_path / "aside")
    assert_one_line_error(surgery("convert", src, "--to", "mqa", "--out", tmp_path / "o"), "missing shard", shards[1].name)
    missing.rename(shards[1])

    data = shards[1].read_bytes()
    shards[1].write_bytes(data[:-100])
    assert_one_line_error(surgery("convert", src, "--to", "mqa", "--out", tmp_path / "o"), "truncated", shards[1].name)
    shards[1].write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + data[24:])
    assert_one_line_error(surgery("convert", src, "--to", "mqa", "--out", tmp_path / "o"), "corrupt", shards[1].name)
    (src / "config.json").write_text("{ nope")
    assert_one_line_error(surgery("convert", src, "--to", "mqa", "--out", tmp_path / "o"), "config.json")
    only(tmp_path, "src")


def test_unwritable_or_existing_output(llama, tmp_path):
    (tmp_path / "afile").write_text("x")  # missing parents are made (as save_pretrained does), not under a file
    assert_one_line_error(surgery("convert", llama, "--to", "mqa", "--out", tmp_path / "afile" / "such" / "dir"),
                          "afile is not a folder")
    (tmp_path / "afile").unlink()
    (tmp_path / "exists").mkdir()
    (tmp_path / "exists" / "keep.txt").write_text("mine")
    assert_one_line_error(surgery("convert", llama, "--to", "mqa", "--out", tmp_path / "exists"), "--force")
    assert (tmp_path / "exists" / "keep.txt").read_text() == "mine"
    ok = surgery("convert", llama, "--to", "mqa", "--out", tmp_path / "exists", "--force")
    assert ok.returncode == 0, ok.stderr
    assert not (tmp_path / "exists" / "keep.txt").exists()
    assert json.loads((tmp_path / "exists" / "config.json").read_text())["num_key_value_heads"] == 1
    only(tmp_path, "exists")


def test_bad_dtype_and_bad_options(llama, tmp_path):
    assert_one_line_error(surgery("convert", llama, "--to", "mqa", "--dtype", "float8", "--out", tmp_path / "o"),
                          "--dtype")
    assert_one_line_error(surgery("convert", llama, "--to", "mqa", "--max-shard-size", "lots", "--out", tmp_path / "o"),
                          "bad size")
    assert_one_line_error(surgery("convert", llama, "--to", "mqa", "--merge", "median", "--out", tmp_path / "o"),
                          "--merge")
    only(tmp_path)


def test_pickle_refused_without_flag(tmp_path):
    import torch

    model = tm.make_tiny("llama", tmp_path / "src")
    (tmp_path / "src" / "model.safetensors").unlink()
    torch.save(model.state_dict(), tmp_path / "src" / "pytorch_model.bin")
    assert_one_line_error(surgery("convert", tmp_path / "src", "--to", "mqa", "--out", tmp_path / "o"), "--allow-pickle")
    ok = surgery("convert", tmp_path / "src", "--to", "mqa", "--out", tmp_path / "o", "--allow-pickle")
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "o" / "model.safetensors").exists()


def test_a_mistyped_local_folder_is_named_as_such_before_the_hub(tmp_path):
    result = surgery("inspect", "smol_mqa_typo", env={"HF_HUB_CACHE": str(tmp_path / "cache")})
    assert_one_line_error(result, "no local folder or file named smol_mqa_typo")
    assert result.stderr.index("no local folder") < result.stderr.index("hub")
