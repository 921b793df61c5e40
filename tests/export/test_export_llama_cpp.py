"""Exported files in llama.cpp itself (llama-cpp-py-sync, a prebuilt CPU llama.cpp from PyPI; skipped where it is
missing or does not load) against transformers, float32 both: the logits at every position, inside and beyond the
sliding window, and the KV cache llama.cpp allocates against `surgery inspect`. The tiny pydoc Llama and its swa and
MLA outputs in the default suite; SmolLM2's source, MQA, swa and MLA outputs at 2,048 tokens (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from exported_files import exported  # noqa: F401 (a fixture)
from llama_cpp_run import llama_cpp_library, llama_cpp_loads, llama_cpp_logits
from transformers_reference import pydoc_ids, transformers_logits

from surgery.bench.llama_cpp_bindings import kv_cache_lines

pytestmark = pytest.mark.skipif(not llama_cpp_loads(), reason="needs llama-cpp-py-sync (a prebuilt llama.cpp) loadable here")


def test_tiny_kinds_compute_the_same_logits_in_llama_cpp(exported):
    llama_cpp_library()
    ids = pydoc_ids(exported["llama"][0], 96)  # the sliding layer's window is 8: 88 positions beyond it
    source = transformers_logits(exported["llama"][0], ids)
    for kind, (folder, gguf_file) in exported.items():
        ref = transformers_logits(folder, ids)
        got, _ = llama_cpp_logits(gguf_file, ids, batch=32)
        scale = np.abs(ref).max()
        assert np.abs(got - ref).max() <= 1e-3 * scale, (kind, np.abs(got - ref).max(), scale)
        if kind == "swa":  # the window is applied: beyond it llama.cpp computes the hybrid, not the source
            assert np.abs(ref[:8] - source[:8]).max() <= 1e-4 * scale
            assert np.abs(got[8:] - source[8:]).max() > 100 * np.abs(got[8:] - ref[8:]).max()


@pytest.mark.parametrize("dtype, tolerance", [("f16", 2e-3), ("bf16", 2e-2), ("q8_0", 2e-2)])
def test_stored_dtypes_load_and_stay_close(exported, tmp_path, dtype, tolerance):
    """The swa output (granite_swa) stored as f16, bf16 and q8_0 loads in llama.cpp, its logits within the storage's
    rounding of the f32 file's."""
    from surgery.commands.export import export_checkpoint

    folder, f32_file = exported["swa"]
    ids = pydoc_ids(folder, 64)
    exact, _ = llama_cpp_logits(f32_file, ids, batch=32)
    out = tmp_path / f"{dtype}.gguf"
    export_checkpoint(str(folder), out, dtype=dtype)
    got, _ = llama_cpp_logits(out, ids, batch=32)
    delta = np.abs(got - exact).max()
    assert 0 < delta <= tolerance * np.abs(exact).max(), delta


# ---- SmolLM2 at 2,048 tokens (slow) --------------------------------------------------------------------------------
TOKENS, WINDOW, UBATCH = 2048, 256, 256
CONVERSIONS = {  # kind -> `surgery convert smollm2` options (None: the source itself)
    "source": None,
    "mqa": ["--to", "mqa"],
    "swa": ["--to", "swa", "--window", str(WINDOW), "--global-layers", "8"],
    "mla": ["--to", "mla", "--kv-rank", "64", "--calib-tokens", "2048"],
}


def smollm2_output(kind: str, root):
    """The checkpoint folder of `kind`: converted here, or taken from $SURGERY_EXPORT_OUTPUTS/KIND when that folder
    holds one converted beforehand with the same options (a conversion to MLA takes minutes)."""
    import os
    import subprocess
    import sys

    from surgery.checkpoint.source import resolve_source

    if CONVERSIONS[kind] is None:
        return resolve_source("smollm2").folder
    given = os.environ.get("SURGERY_EXPORT_OUTPUTS")
    if given and (Path(given) / kind / "config.json").is_file():
        return Path(given) / kind
    done = subprocess.run([sys.executable, "-m", "surgery.cli", "convert", "smollm2", *CONVERSIONS[kind], "--out",
                           str(root / kind)], capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-2000:]
    return root / kind


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(CONVERSIONS))
def test_smollm2_kinds_in_llama_cpp_at_2048_tokens(kind, tmp_path):
    """Every position of 2,048 pydoc tokens: max |Δlogits| ≤ 1e-3 of the logits' scale (f32 rounding), top-1 the
    same; llama.cpp's KV cache is `surgery inspect --context 2048`'s (the sliding layers hold W + one micro-batch of
    cells in llama.cpp, W - 1 past keys in transformers' cache, which inspect counts)."""
    llama_cpp_library()
    from surgery.api import inspect as inspect_checkpoints
    from surgery.commands.export import export_checkpoint

    folder = smollm2_output(kind, tmp_path)
    gguf_file = tmp_path / f"{kind}.gguf"
    export_checkpoint(str(folder), gguf_file)
    ids = pydoc_ids(folder, TOKENS)
    ref = transformers_logits(folder, ids)
    got, lines = llama_cpp_logits(gguf_file, ids, batch=UBATCH)
    delta, scale = np.abs(got - ref).max(-1), float(np.abs(ref).max())
    spans = {f"{a}-{b}": float(delta[a:b].max()) for a, b in ((0, WINDOW), (WINDOW, 1024), (1024, TOKENS))}
    top1 = float((got.argmax(-1) == ref.argmax(-1)).mean())
    caches = kv_cache_lines(lines)
    inspected = dict(inspect_checkpoints(str(folder), context=TOKENS)[0])["kv_cache_bytes_per_context"]
    config = json.loads((folder / "config.json").read_text())
    swa_extra = 0
    if kind == "swa":
        assert [c["layers"] for c in caches] == [8, 22] and caches[1]["cells"] == WINDOW + UBATCH
        per_cell = caches[1]["mib"] * 2**20 / (caches[1]["cells"] * caches[1]["layers"])
        swa_extra = (UBATCH + 1) * caches[1]["layers"] * per_cell  # transformers keeps W - 1 past keys
    else:
        assert len(caches) == 1 and caches[0]["layers"] == config["num_hidden_layers"]
    assert caches[0]["cells"] == TOKENS
    if kind == "mla":
        assert caches[0]["v_mib"] == 0  # the latent and the rope key only: values are absorbed
    llama_bytes = sum(c["mib"] for c in caches) * 2**20
    beyond = {}
    if kind == "swa":  # llama.cpp computes the hybrid beyond the window, not the source
        source = transformers_logits(smollm2_output("source", tmp_path), ids)
        beyond = {"llama_cpp_vs_source_beyond_window": float(np.abs(got[WINDOW:] - source[WINDOW:]).max())}
        assert beyond["llama_cpp_vs_source_beyond_window"] > 100 * max(spans.values())
    print(json.dumps({"kind": kind, "max_abs_delta": spans, "logit_scale": scale, "top1": top1,
                      "llama_cpp_kv_mib": [c["mib"] for c in caches], "llama_cpp_kv_cells": [c["cells"] for c in caches],
                      "inspect_kv_mib": inspected / 2**20, **beyond}))
    assert max(spans.values()) <= 1e-3 * scale, spans
    assert top1 >= 0.99
    assert llama_bytes - swa_extra == pytest.approx(inspected, abs=TOKENS)  # inspect rounds bytes per token
