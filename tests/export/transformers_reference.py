"""The export tests' reference: transformers' float32 logits at every position of a token sequence, and pydoc text
as the checkpoint's own tokens."""

from __future__ import annotations

import numpy as np
import torch


def transformers_logits(folder, ids: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].numpy()


def pydoc_ids(folder, tokens: int) -> list[int]:
    from transformers import AutoTokenizer

    from surgery.data import pydoc_texts, token_stream

    return token_stream(pydoc_texts(), AutoTokenizer.from_pretrained(folder), tokens).tolist()
