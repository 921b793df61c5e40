"""The export tests' reading of GGUF files with gguf-py: metadata and tensors by name, a tensor's values in numpy
order, and transformers' rotate-half rows as the interleaved pairs llama.cpp rotates (written independently of the
exporter)."""

from __future__ import annotations

import gguf
import numpy as np


def read(path):
    reader = gguf.GGUFReader(path)
    keys = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: t for t in reader.tensors}
    return keys, tensors


def values(t) -> np.ndarray:
    """A tensor's values in numpy order (GGUF lists the dimensions reversed), dequantized."""
    from gguf.quants import dequantize

    return dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(d) for d in t.shape])))


def hf_rotate_half_to_pairs(w: np.ndarray, heads: int) -> np.ndarray:
    """Written independently of the exporter: row 2j of a head is its row j, row 2j+1 its row j + d/2."""
    d = w.shape[0] // heads
    out = np.empty_like(w)
    for h in range(heads):
        for j in range(d // 2):
            out[h * d + 2 * j] = w[h * d + j]
            out[h * d + 2 * j + 1] = w[h * d + d // 2 + j]
    return out
