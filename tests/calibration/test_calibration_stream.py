"""Layer streaming (surgery.calibration): the streamed calibrations give the same tensors as the whole model in memory,
one layer at a time, from any checkpoint layout; the calibration text policy and its record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf

from streamed_calibration import assert_same_merge, assert_same_switchhead

from surgery.calibration.stream import estimate_peak_bytes, open_stream
from surgery.calibration.text import calibration_text
from surgery.checkpoint.source import resolve_source
from surgery.checkpoint.tensors import CheckpointReader
from surgery.testing import tiny_models as tm

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2", "gpt2"])
def test_streamed_aligned_merge_equals_in_memory(arch, tmp_path):
    tm.make_tiny(arch, tmp_path / arch)
    kv = tm.kv_heads_of(tm.load(tmp_path / arch).config)
    assert kv > 1
    assert_same_merge(tmp_path / arch, 1)


def test_streams_bf16_sharded_checkpoints_one_layer_at_a_time(tmp_path):
    """A bf16 checkpoint in several shards streams to the same merge as the model loaded whole (bf16 -> float32 is
    exact); while a layer is served, every other layer's weights are on the meta device."""
    model = tm.make_tiny("llama", tmp_path / "f32")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16", max_shard_size="60KB")
    assert len(list((tmp_path / "bf16").glob("*.safetensors"))) > 1
    assert_same_merge(tmp_path / "bf16", 2)
    stream = open_stream(tmp_path / "bf16", CheckpointReader(tmp_path / "bf16"), "cpu")
    embedding = stream.model.get_input_embeddings().weight
    assert embedding.dtype == torch.bfloat16 and not embedding.is_meta  # kept in the checkpoint's dtype
    for index, _, layer in stream.layers():
        live = [i for i, m in enumerate(stream.modules) if not next(m.parameters()).is_meta]
        assert live == [index]
        assert all(p.dtype == torch.float32 for p in layer.parameters())
    assert all(p.is_meta for m in stream.modules for p in m.parameters())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2", "gpt2"])
def test_streamed_switchhead_equals_in_memory(arch, tmp_path):
    folder = tmp_path / arch
    tm.make_tiny(arch, folder)
    h = tm.load(folder).config.num_attention_heads
    assert_same_switchhead(folder, 2, h // 2, max(1, h // 4))


def test_peak_memory_model_counts_one_layer(tmp_path):
    model = tm.make_tiny("llama", tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    est = estimate_peak_bytes(config, 8192, "bfloat16")
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    assert est["layer"] == 4 * layer
    assert est["embedding"] == 2 * model.model.embed_tokens.weight.numel() + 4 * model.model.norm.weight.numel()
    assert est["activations"] > 4 * 8192 * config["hidden_size"]
    assert est["host"] >= est["layer"] + est["embedding"] + est["activations"]
    bigger = estimate_peak_bytes(config, 16384, "bfloat16")
    assert bigger["activations"] - est["activations"] == 4 * 8192 * config["hidden_size"]  # the residual stream
    assert est["spilled"] == 0  # past the spill budget the stream goes to disk, and the memory stops growing:
    capped = estimate_peak_bytes(config, 16384, "bfloat16", budget=4 * 8192 * config["hidden_size"])
    assert capped["activations"] == est["activations"] and capped["spilled"] == 4 * 8192 * config["hidden_size"]


def test_calibration_text_reads_pydoc_from_the_end(tmp_path):
    import hashlib

    from surgery.data import pydoc_texts
    from surgery.testing.tiny_models import char_tokenizer

    char_tokenizer(tmp_path)
    tok = tf.AutoTokenizer.from_pretrained(tmp_path)
    text = calibration_text("pydoc", tok, 3000, 128)
    assert text.windows.shape == (3000 // 128, 128)
    docs = [t for t in reversed(pydoc_texts()) if t]
    assert text.documents_sha256[0] == hashlib.sha256(docs[0].encode()).hexdigest()
    first_docs = {hashlib.sha256(t.encode()).hexdigest() for t in pydoc_texts()[:5]}
    assert not first_docs & set(text.documents_sha256)  # never check's default text
    assert text.record()["tokens"] == text.windows.numel()


def test_cli_records_calibration_and_prints_a_line_per_layer(tmp_path):
    from surgery.testing.tiny_models import tiny

    src = tiny("llama", tmp_path / "src")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "cli", "convert", str(src), "--to", "mqa", "--merge", "aligned",
                          "--calib", "pydoc", "--calib-tokens", "512", "--device", "cpu", "--out",
                          str(tmp_path / "mqa")], cwd=REPO,
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "calibrate + merge: layer 2/2" in run.stderr  # stderr is not a terminal: plain lines
    calib = json.loads((tmp_path / "mqa" / "surgery.json").read_text())["calibration"]
    assert calib["device"] == "cpu" and calib["data"] == "pydoc" and calib["tokens"] == 512
    assert len(calib["documents_sha256"]) >= 1 and all(len(d) == 64 for d in calib["documents_sha256"])
    bad = subprocess.run([sys.executable, "-m", "cli", "convert", str(src), "--to", "mqa", "--merge", "aligned",
                          "--device", "tpu", "--out", str(tmp_path / "bad")], cwd=REPO, capture_output=True,
                         text=True, env=env, timeout=300)
    assert bad.returncode == 2 and bad.stderr.startswith("surgery: error:") and not (tmp_path / "bad").exists()


def test_switchhead_record_and_no_leftovers(tmp_path):
    """SwitchHead calibrates on the same text as the aligned merge (pydoc from its end), records its documents, and
    leaves nothing beside the output (the layer store is removed)."""
    from surgery.calibration.text import PYDOC_SPLIT
    from surgery.switchhead import convert_to_switchhead
    from surgery.switchhead.options import SwitchHeadOptions
    from surgery.testing.tiny_models import tiny

    src = tiny("llama", tmp_path / "src")
    options = SwitchHeadOptions(heads=2, experts=4, topk=2, calib=["pydoc"], calib_tokens=512, device="cpu")
    record = convert_to_switchhead(resolve_source(str(src)), tmp_path / "sh", options, progress=False)
    calib = record["calibration"]
    assert calib["split"] == PYDOC_SPLIT and calib["tokens"] == 512 and calib["device"] == "cpu"
    tok = tf.AutoTokenizer.from_pretrained(src)
    assert calib["documents_sha256"] == calibration_text("pydoc", tok, 512, 128).documents_sha256
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sh", "src"]
