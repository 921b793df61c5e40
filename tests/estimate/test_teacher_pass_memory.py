"""`surgery run --dry-run`'s estimate of a teacher step (`surgery teacher`, memory_estimate.teacher_pass_memory)
against the measured peak RSS of the command on a Llama whose model terms are half the peak."""

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


@pytest.mark.slow  # 10-30 s: keeps the default suite under 25 minutes on 2 cores
def test_the_teacher_pass_estimate_is_within_20_percent_of_its_measured_peak(tmp_path):
    """A 35M-parameter Llama (vocabulary 8,192, 8 layers of 512) over 8 windows of 512 tokens in one forward on CPU
    (~25 s): fp32 weights, the micro-batch's logits, one layer's activations and one window's top-K temporaries."""
    tok = make_tokenizer()
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    folder = tmp_path / "src"
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    run = dict(tokens=4096, seq_len=512, batch_tokens=4096, micro_batch=8, eval_tokens=512, device="cpu")
    flags = [a for k, v in run.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    result = subprocess.run([sys.executable, "-c", PEAK, sys.executable, "-m", "cli", "teacher", folder, "--out",
                             tmp_path / "store", "--data", "pydoc", "--top-k", "32", *flags],
                            cwd=REPO, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    peak, rc = result.stdout.split()[-2:]
    assert rc == "0", result.stderr[-2000:]
    measured = int(peak)
    estimate = est.teacher_pass_memory(est.stats_from_folder(folder), step_models()["teacher"](**run), device="cpu")
    assert abs(estimate.host_peak - measured) <= 0.2 * measured, (estimate.host_peak, measured)
    assert estimate.host_peak - est.RUNTIME["teacher"] > 0.3 * measured  # the model's terms, not only the runtime
