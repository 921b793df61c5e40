"""`surgery run --dry-run` memory estimates against the measured peak RSS of the same commands on a tiny model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf

from surgery import memory_estimate as est
from surgery.recipes.schema import step_models
from surgery.testing.pydoc_llama import make_tokenizer

REPO = Path(__file__).resolve().parents[2]
# Runs the command in a child and prints the child's peak RSS (ru_maxrss is in KiB on Linux).
PEAK = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, rc)")


def peak_rss(*args) -> int:
    result = subprocess.run([sys.executable, "-c", PEAK, sys.executable, "-m", "cli", *map(str, args)], cwd=REPO,
                            capture_output=True, text=True, timeout=600,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    peak, rc = result.stdout.split()[-2:]
    assert rc == "0", result.stderr[-2000:]
    return int(peak)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A Llama of 7.3M parameters (vocabulary 8,192, 4 layers of 256): big enough that the model terms show."""
    tok = make_tokenizer()
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    folder = tmp_path_factory.mktemp("estimate") / "src"
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def within(estimate: int, measured: int, tolerance: float = 0.25) -> bool:
    return abs(estimate - measured) <= tolerance * measured


@pytest.mark.slow  # three CLI processes (~40 s on 2 idle cores)
def test_memory_estimates_are_within_25_percent_of_the_measured_peaks(model, tmp_path):
    options = step_models()
    src = est.stats_from_folder(model)

    convert = options["convert"](to="mqa")
    measured = peak_rss("convert", model, "--to", "mqa", "--out", tmp_path / "mqa")
    estimate = est.convert_memory(src, convert)
    assert within(estimate, measured), (estimate, measured)
    mqa = est.stats_from_folder(tmp_path / "mqa")

    check = options["check"](tokens=1024, seq_len=256)
    measured = peak_rss("check", model, tmp_path / "mqa", "--tokens", 1024, "--seq-len", 256)
    estimate = est.check_memory(src, check)
    assert within(estimate, measured), (estimate, measured)

    uptrain = options["uptrain"](tokens=2048, seq_len=256, batch_tokens=1024, eval_tokens=512)
    measured = peak_rss("uptrain", tmp_path / "mqa", "--out", tmp_path / "up", "--tokens", 2048, "--seq-len", 256,
                        "--batch-tokens", 1024, "--eval-tokens", 512)
    estimate = est.uptrain_memory(mqa, uptrain, src, processes=1)
    assert within(estimate, measured), (estimate, measured)
    # the model terms are a real part of the estimate, not only the runtime constant
    assert est.uptrain_memory(mqa, uptrain, src, 1) - est.RUNTIME["uptrain"] > 0.1 * measured


def test_mla_memory_estimate_is_within_25_percent_of_the_measured_peak(model, tmp_path):
    """`--to mla`'s cost model (surgery/mla/cost.py) against one conversion's peak RSS (~15 s): the float32 layer,
    the float64 fits, the calibration activations and DeepSeek's attention on the math path."""
    from surgery.calibration.stream import RUNTIME_BYTES

    options = step_models()["convert"](to="mla", kv_rank=64, calib_tokens=2048)
    measured = peak_rss("convert", model, "--to", "mla", "--kv-rank", 64, "--calib-tokens", 2048,
                        "--out", tmp_path / "mla")
    estimate = est.convert_memory(est.stats_from_folder(model), options)
    assert within(estimate, measured), (estimate, measured)
    assert estimate - RUNTIME_BYTES > 0.1 * measured  # the model terms are a real part of the estimate
