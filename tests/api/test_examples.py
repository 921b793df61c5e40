"""The scripts in examples/ run as a user runs them (a fresh process, `python examples/NAME.py`), on the tiny pydoc
Llama instead of SmolLM2 (`--model`, `--fast`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_example(name: str, *args: str, cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), SURGERY_CACHE=str(cache), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, str(REPO / "examples" / name), *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=600)


def test_convert_check_uptrain_example(tiny, tmp_path):
    result = run_example("convert_check_uptrain.py", "--model", tiny, "--fast", "--to", "gqa", "--kv-heads", "1",
                         "--out", tmp_path / "out", cache=tmp_path / "cache")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"wrote {tmp_path / 'out' / 'gqa'}: ")
    assert "(2 -> 1 K/V heads, aligned merge)" in lines[0]
    assert any(line.startswith("check: KL ") for line in lines)
    assert any(line.startswith("uptrain: 1024 tokens, held-out perplexity") for line in lines)
    assert lines[-1] == f"LlamaForCausalLM: 4 heads, 1 K/V heads, in {tmp_path / 'out' / 'gqa-uptrained'}"
    record = json.loads((tmp_path / "out" / "gqa-uptrained" / "surgery.json").read_text())
    assert record["uptraining"]["loss"] == "kd" and record["uptraining"]["tokens"] == 1024
    calibration = json.loads((tmp_path / "out" / "gqa" / "surgery.json").read_text())["calibration"]
    assert calibration["tokens"] == 1024 and Path(calibration["data"]).parent == tmp_path / "cache" / "data"


def test_recipe_from_python_example(tiny, tmp_path):
    result = run_example("recipe_from_python.py", "--model", tiny, "--fast", "--out", tmp_path / "out",
                         cache=tmp_path / "cache")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert "first run: convert ran, check ran" in lines and "second run: convert skipped, check skipped" in lines
    report = json.loads((tmp_path / "out" / "02-check.json").read_text())
    assert report["tokens"] == 256 and lines[-1].startswith(f"check: KL {report['kl']:.4f}")
    record = json.loads((tmp_path / "out" / "01-convert" / "surgery.json").read_text())
    assert record["calibration"]["tokens"] == 512 and record["kind"] == "mqa"


def test_chat_notebook_example_converts_checks_uptrains_logs_and_writes_a_card(tmp_path):
    """SmolLM2-135M-Instruct from a loaded model to one K/V head, calibrated on a Dataset of chat messages rendered
    with its template, checked on held-out conversations, uptrained on the assistant turns with TensorBoard, and a
    card the hub's parser reads back with the check's numbers as model-index."""
    from huggingface_hub import ModelCard
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from surgery.checkpoint.source import resolve_source

    out = tmp_path / "out"
    result = run_example("chat_gqa_notebook.py", "--model", resolve_source("smollm2").folder, "--fast", "--out", out,
                         cache=tmp_path / "cache")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert any("(3 -> 1 K/V heads, aligned merge)" in line for line in lines)
    record = json.loads((out / "gqa-uptrained" / "surgery.json").read_text())["uptraining"]
    assert record["chat_template"] == "on" and record["loss_on"] == "assistant" and record["loss"] == "kd"
    # TensorBoard's event files, read back: one training loss per optimizer step
    events = EventAccumulator(str(next((out / "gqa-uptrained" / "runs").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    losses = [e.value for e in events.Scalars("loss")]
    assert len(losses) == 2 and all(v > 0 for v in losses)
    # the card, parsed as the hub parses it: the check's numbers are its model-index
    check_line = next(line for line in lines if line.startswith("check: KL "))
    card = ModelCard.load(out / "CARD.md")
    results = card.data.eval_results
    kl = next(r.metric_value for r in results if r.metric_type == "kl_divergence")
    assert check_line.startswith(f"check: KL {kl:.4f}")
    assert card.data.library_name == "transformers" and "mqa" in card.data.tags
