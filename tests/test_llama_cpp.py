"""An MQA output of the real SmolLM2-135M, converted by llama.cpp's own `convert_hf_to_gguf.py`, runs in llama.cpp
(llama-cpp-python) with the logits transformers gives it. Slow, and skipped (with the reason) unless
llama-cpp-python is installed and LLAMA_CPP_CONVERTER names llama.cpp's convert_hf_to_gguf.py (e.g.
vendor/llama.cpp/convert_hf_to_gguf.py in the llama-cpp-python sdist; it needs the gguf package of that
llama.cpp, which it finds in gguf-py/ beside itself, and sentencepiece)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from surgery.check import load_model
from surgery.convert_kv import KVOptions, convert_to_kv_heads
from surgery.data import pydoc_texts, token_stream
from surgery.source import embedded_smollm2_gguf, resolve_source

pytestmark = pytest.mark.slow
TOKENS = 96


@pytest.fixture(scope="module")
def converter() -> Path:
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (pip install llama-cpp-python: it compiles llama.cpp, ~25 min)")
    path = os.environ.get("LLAMA_CPP_CONVERTER")
    if not path or not Path(path).is_file():
        pytest.skip("LLAMA_CPP_CONVERTER does not name llama.cpp's convert_hf_to_gguf.py")
    return Path(path)


def test_mqa_output_converted_by_llama_cpp_gives_transformers_logits(converter, tmp_path):
    import llama_cpp
    from transformers import AutoTokenizer

    source = resolve_source(str(embedded_smollm2_gguf()))
    out = tmp_path / "mqa"
    convert_to_kv_heads(source, out, KVOptions(kv_heads=1), progress=False)
    gguf = tmp_path / "mqa-f32.gguf"
    done = subprocess.run([sys.executable, str(converter), str(out), "--outtype", "f32", "--outfile", str(gguf)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]

    # real text the conversion never saw (MQA by averaging needs none)
    ids = token_stream(pydoc_texts(), AutoTokenizer.from_pretrained(out), TOKENS)[:TOKENS].tolist()
    model = load_model(resolve_source(str(out)), torch.device("cpu"), "float32")
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([ids])).logits[0].numpy()

    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=2 * TOKENS, n_batch=TOKENS, n_ubatch=TOKENS, logits_all=True,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, verbose=False)
    assert llm.metadata["llama.attention.head_count_kv"] == "1"
    llm.eval(ids)
    got = np.array(llm.scores[:TOKENS])
    assert got.shape == expected.shape
    # f32 weights and cache: rounding only (measured 2.5e-3 over 256 tokens; llama.cpp's default f16 cache: 0.2)
    assert np.abs(got - expected).max() <= 5e-3, np.abs(got - expected).max()
    assert (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.98
