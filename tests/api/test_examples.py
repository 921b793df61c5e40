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
