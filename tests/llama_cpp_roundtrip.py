"""A checkpoint folder through llama.cpp's own converter and llama.cpp itself, against transformers: the slow
round-trip tests of the kinds whose outputs llama.cpp loads (MQA/GQA, MLA) share it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def convert_with_llama_cpp(folder: Path, gguf: Path) -> Path:
    """`LLAMA_CPP_CONVERT` (llama.cpp's convert_hf_to_gguf.py) on `folder`, float32; fails the test with its stderr."""
    done = subprocess.run([sys.executable, os.environ["LLAMA_CPP_CONVERT"], str(folder), "--outtype", "f32",
                           "--outfile", str(gguf)], check=False, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return gguf


def logits_both_ways(folder: Path, gguf: Path, tokens: int):
    """The first `tokens` tokens of pydoc through transformers (float32) and llama.cpp (f32 weights and KV cache) ->
    (transformers' logits, llama.cpp's logits, llama.cpp's metadata)."""
    import llama_cpp
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from surgery.data import pydoc_texts, token_stream

    ids = token_stream(pydoc_texts(), AutoTokenizer.from_pretrained(folder), tokens)[None]
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(input_ids=ids).logits[0].numpy()
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=max(256, tokens), n_batch=128, n_ubatch=128, logits_all=True,
                          verbose=False, n_threads=1, n_threads_batch=1, type_k=llama_cpp.GGML_TYPE_F32,
                          type_v=llama_cpp.GGML_TYPE_F32)
    llm.eval(ids[0].tolist())
    got, metadata = np.asarray(llm.scores[: ids.shape[1]]), dict(llm.metadata)
    del llm
    return ref, got, metadata
