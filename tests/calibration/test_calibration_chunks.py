"""The chunk rule (surgery/calibration/chunks.py): calibration chunks sized by the model's width, so a wide model's
per-chunk working set stays within the budget while small models keep their 8 windows; `--calib-chunk` overrides
it, and the dry run prices the chunk the conversion will use."""

from __future__ import annotations

import json

import pytest
from inprocess import run_cli

from surgery.calibration.chunks import (CHUNK_BUDGET, MAX_WINDOWS, chunk_bytes_per_token, chunk_windows,
                                        intermediate_size)
from surgery.errors import SurgeryError
from surgery.testing import tiny_models as tm

LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 32, "vocab_size": 128256}
SMOLLM2 = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
           "num_key_value_heads": 3, "head_dim": 64, "num_hidden_layers": 30, "vocab_size": 49152}


def _per_window(config: dict, window: int) -> int:
    h = config["hidden_size"]
    return window * chunk_bytes_per_token(h, config["num_attention_heads"], config["num_key_value_heads"],
                                          config["head_dim"], intermediate_size(config, h), window)


def test_a_wide_model_gets_fewer_windows_and_a_narrow_one_keeps_eight():
    assert chunk_windows(SMOLLM2, 512) == MAX_WINDOWS == 8
    assert MAX_WINDOWS * _per_window(SMOLLM2, 512) <= CHUNK_BUDGET
    wide = chunk_windows(LLAMA_8B, 512)
    assert wide == 1 and 2 * _per_window(LLAMA_8B, 512) > CHUNK_BUDGET  # two windows would not fit
    assert chunk_windows(LLAMA_8B, 128) == CHUNK_BUDGET // _per_window(LLAMA_8B, 128) > wide  # shorter windows: more
    assert chunk_windows(LLAMA_8B, 2048) == 1  # never fewer than one window, whatever it costs
    assert chunk_windows(tm.ARCHS["llama"]().to_dict(), 32) == MAX_WINDOWS  # the test models keep their chunks


def test_the_user_chooses_the_chunk_and_zero_is_refused():
    assert chunk_windows(LLAMA_8B, 512, requested=4) == 4
    assert chunk_windows(SMOLLM2, 512, eager=True) == 1  # eager attention (SwitchHead) keeps one window
    assert chunk_windows(SMOLLM2, 512, requested=3, eager=True) == 3
    with pytest.raises(SurgeryError, match=r"^--calib-chunk must be at least 1 window, got 0$"):
        chunk_windows(SMOLLM2, 512, requested=0)


def _dry_run(capsys, src, *args, report: bool = True):
    code, out, err = run_cli(capsys, "convert", src, "--to", "mla", "--kv-rank", "8", "--calib-tokens", "256",
                             "--calib-window", "32", "--device", "cpu", *args, "--dry-run",
                             *(["--json", "-"] if report else []))
    assert code == 0, err
    return json.loads(out[out.index("{"):]) if report else out


def test_the_dry_run_prices_and_shows_the_chunk_it_will_use(tmp_path, capsys):
    src = tmp_path / "llama"
    tm.make_tiny("llama", src)
    default, one = _dry_run(capsys, src), _dry_run(capsys, src, "--calib-chunk", "1")
    assert default["chunk_windows"] == MAX_WINDOWS and one["chunk_windows"] == 1  # a tiny model: all 8 windows
    assert "calibration chunk   8 windows of 32 tokens" in _dry_run(capsys, src, report=False)
    assert "calibration chunk   1 window of 32 tokens" in _dry_run(capsys, src, "--calib-chunk", "1", report=False)
    for term in ("scratch", "attention scores (math path)", "MLA queries and keys"):  # per chunk: 8x
        assert default["memory_terms"][term] == 8 * one["memory_terms"][term], term
    assert one["host_bytes"] < default["host_bytes"]
    assert one["flops_per_layer"] == default["flops_per_layer"]  # the same work, in smaller pieces
