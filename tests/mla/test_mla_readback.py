"""An MLA output read back after its config.json was edited (issue 40): `inspect`, `check`, `bench` and `uptrain`
refuse a config that disagrees with the tensors, or whose latent sizes are not positive integers, in the same one
line (surgery/mla/validate.py through surgery.kinds.check_checkpoint), instead of reporting a wrong KV cache or
failing inside transformers."""

from __future__ import annotations

import json
import shutil

import pytest

from mla_sources import convert, tiny_llama


@pytest.fixture(scope="module")
def mla_out(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla-readback")
    return convert(tiny_llama(root / "src", kv_heads=2), root / "mla", 16) and root / "mla"


def tampered(mla_out, tmp_path, **values):
    folder = tmp_path / "tampered"
    shutil.copytree(mla_out, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(values)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def one_line(cli, *args) -> str:
    code, _, err = cli(*map(str, args))
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("surgery: warning: ")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("surgery: error: "), (code, err)
    return lines[0]


def test_inspect_reports_the_cache_of_an_intact_output(mla_out, cli):
    code, out, err = cli("inspect", str(mla_out), "--json")
    assert code == 0, err
    stats = json.loads(out)[0]
    assert stats["kv_cache_bytes_per_token"] == 2 * (16 + 16) * stats["dtype_bytes"]  # 2 layers x (latent + rope)


@pytest.mark.parametrize("values, words", [
    ({"kv_lora_rank": 8}, "kv_lora_rank 8"),  # a smaller cache than the tensors hold: was reported as it
    ({"qk_rope_head_dim": 32}, "qk_rope_head_dim 32"),
    ({"v_head_dim": 8}, "v_head_dim 8"),
])
def test_inspect_refuses_a_config_that_disagrees_with_the_tensors(mla_out, tmp_path, cli, values, words):
    line = one_line(cli, "inspect", tampered(mla_out, tmp_path, **values))
    assert "does not match config.json" in line and words in line


@pytest.mark.parametrize("bad", ["abc", 0, -4, 1.5, True])
def test_a_latent_rank_that_is_no_positive_integer_is_one_line_in_inspect_and_uptrain(mla_out, tmp_path, cli, bad):
    folder = tampered(mla_out, tmp_path, kv_lora_rank=bad)
    expected = f"surgery: error: config.json: kv_lora_rank must be a positive integer, got {bad!r}"
    assert one_line(cli, "inspect", folder) == expected
    assert one_line(cli, "uptrain", folder, "--data", "pydoc", "--tokens", "64", "--seq-len", "32", "--batch-tokens",
                    "32", "--micro-batch", "1", "--eval-tokens", "32", "--out", tmp_path / "o") == expected
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.run").exists()


def test_check_refuses_the_same_inconsistency_in_the_same_words(mla_out, tmp_path, cli):
    folder = tampered(mla_out, tmp_path, kv_lora_rank=8)
    src = json.loads((mla_out / "surgery.json").read_text())["local"]["source_folder"]
    assert one_line(cli, "check", src, folder, "--tokens", "64") == one_line(cli, "inspect", folder)


@pytest.mark.parametrize("field, value, words", [
    ("heads", "x", "heads is 'x'"), ("kv_heads", {"before": 0}, "kv_heads.before is 0"),
    ("mla", {"kv_lora_rank": "16"}, "mla.kv_lora_rank is '16'"), ("head_dim", True, "head_dim is True"),
])
def test_a_mistyped_record_is_refused_by_every_reader_in_the_same_words(mla_out, tmp_path, cli, field, value, words):
    folder = tmp_path / "c"
    shutil.copytree(mla_out, folder)
    record = json.loads((folder / "surgery.json").read_text())
    (folder / "surgery.json").write_text(json.dumps({**record, field: value}))
    line = one_line(cli, "inspect", folder)
    assert line.startswith(f"surgery: error: corrupt {folder / 'surgery.json'}: {words}"), line
    src = record["local"]["source_folder"]
    assert one_line(cli, "check", src, folder, "--tokens", "64") == line
    assert one_line(cli, "uptrain", folder, "--data", "pydoc", "--tokens", "64", "--seq-len", "32", "--batch-tokens",
                    "32", "--micro-batch", "1", "--eval-tokens", "32", "--out", tmp_path / "o") == line


def test_a_record_whose_kv_heads_is_null_is_inspected(mla_out, tmp_path, cli):
    folder = tmp_path / "c"
    shutil.copytree(mla_out, folder)
    record = json.loads((folder / "surgery.json").read_text())
    (folder / "surgery.json").write_text(json.dumps({**record, "kv_heads": None}))
    code, out, err = cli("inspect", str(folder), "--json")
    assert code == 0, err
    assert json.loads(out)[0]["distinct_kv_heads"] == 4  # config.json's (the MLA output stores one per head)


@pytest.mark.parametrize("config, record", [({"kv_lora_rank": 8}, {}), ({"kv_lora_rank": "abc"}, {}),
                                            ({}, {"heads": "x"})], ids=["disagrees", "no-integer", "mistyped-record"])
def test_bench_refuses_what_inspect_refuses_in_the_same_words(mla_out, tmp_path, cli, config, record):
    folder = tampered(mla_out, tmp_path, **config)
    written = json.loads((folder / "surgery.json").read_text())
    (folder / "surgery.json").write_text(json.dumps({**written, **record}))
    src = written["local"]["source_folder"]
    line = one_line(cli, "bench", src, folder, "--batch", "1", "--context", "8", "--new", "1", "--rounds", "1",
                    "--device", "cpu", "--json", tmp_path / "bench.json")
    assert line == one_line(cli, "inspect", folder)
    assert not (tmp_path / "bench.json").exists()
