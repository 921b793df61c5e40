"""Calibration text, kept apart from the text `surgery check` evaluates on by default.

`surgery check` (and `compare-merges`) read pydoc from its first document on; calibration on `pydoc` reads
whole documents from the *last* one backwards, so the two never share a document as long as
calibration + evaluation tokens fit in pydoc's ~113k tokens (SmolLM2 tokenizer). Any other source is read
from its start.
"""

from __future__ import annotations

import torch

from ..data import load_texts, pydoc_texts, token_stream
from ..errors import SurgeryError

WINDOW = 512  # calibration window length (tokens); capped by the model's context


def calibration_texts(spec: str, text_field: str = "text"):
    if spec == "pydoc":
        return list(reversed(pydoc_texts()))
    return load_texts(spec, text_field=text_field)


def pydoc_documents_used(tokenizer, tokens: int) -> list[int]:
    """Indices (in pydoc order) of the documents a `pydoc` calibration of `tokens` tokens reads."""
    texts = pydoc_texts()
    used, count = [], 0
    for i in range(len(texts) - 1, -1, -1):
        if count >= tokens:
            break
        if texts[i]:
            used.append(i)
            count += len(tokenizer(texts[i], add_special_tokens=False)["input_ids"]) + 1
    return sorted(used)


def calibration_windows(spec: str, tokenizer, tokens: int, context: int | None) -> torch.Tensor:
    """[N, L] token windows for calibration (L = 512, or the context length when shorter)."""
    if tokens < 1:
        raise SurgeryError(f"--calib-tokens must be positive, got {tokens}")
    ids = token_stream(calibration_texts(spec), tokenizer, tokens)
    length = min(WINDOW, context or WINDOW, ids.numel())
    n = ids.numel() // length
    if length < 2:
        raise SurgeryError(f"calibration data {spec} gave only {ids.numel()} token(s)")
    return ids[: n * length].view(n, length)
