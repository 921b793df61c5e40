"""benchmarks/gpu/run.sh --cpu: the prepared GPU run's every step at tiny shapes on the CPU (FSDP over gloo),
importing as if the packages the GPU machine lacks were absent, so that the script a GPU session runs cannot rot;
and its driver's isolation of steps (a hang is killed at its limit, a failure recorded, the next step still runs)."""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "benchmarks" / "gpu"
KINDS = ("mqa", "gqa", "aligned", "mla", "talking-heads", "switchhead")
BENCHED = ("mqa", "gqa", "mla", "switchhead", "talking-heads")


def load_driver(monkeypatch):
    """benchmarks/gpu/driver.py as its script sees itself: its folder first on sys.path, `steps` beside it."""
    monkeypatch.syspath_prepend(str(GPU))
    for name in ("steps", "driver"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module("driver")


def finite(figures: dict, *keys: str) -> None:
    for key in keys:
        value = figures[key]
        assert isinstance(value, (int, float)) and math.isfinite(value), (key, value)


def test_a_hanging_step_is_killed_at_its_limit_and_a_failing_one_recorded_while_others_run(tmp_path, monkeypatch):
    driver = load_driver(monkeypatch)
    (tmp_path / "figures").mkdir()

    def hang(ctx):
        subprocess.run(["sleep", "60"])  # a launched process too: the whole group goes

    def boom(ctx):
        raise ValueError("a planted failure")

    driver.STEPS |= {"hang": (hang,), "boom": (boom,), "fine": (lambda ctx: {"answer": 42.0},)}
    start = time.monotonic()
    hung = driver.run_child("hang", tmp_path, True, 2.0)
    assert hung["status"] == "timeout" and time.monotonic() - start < 20
    failed = driver.run_child("boom", tmp_path, True, 30.0)
    assert failed["status"] == "failed" and "ValueError: a planted failure" in "\n".join(failed["log_tail"])
    assert driver.run_child("fine", tmp_path, True, 30.0) == {"status": "passed", "seconds": pytest.approx(
        driver.run_child("fine", tmp_path, True, 30.0)["seconds"], abs=30), "figures": {"answer": 42.0}}
    spawned = driver.run_child("device", tmp_path, True, 300.0, fork=False)  # the fallback: a new interpreter
    assert spawned["status"] == "passed" and spawned["figures"]["device"] == "cpu", spawned
    text = driver.summary({"mode": "cpu", "device": {}, "total_s": 1.0, "passed": 1,
                           "steps": {"hang": hung | {"timeout_s": 2.0}, "fine": {"status": "passed", "seconds": 0.1,
                                                                                "timeout_s": 30, "figures": {"a": 1}}}})
    assert "| hang | timeout |" in text and "| a | 1 |" in text


def test_the_cpu_run_passes_every_step_with_finite_figures(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "2"}
    env.pop("OUT", None)
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu" / "run.sh"), "--cpu", "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    results = json.loads((out / "results.json").read_text())
    steps = results["steps"]
    not_passed = {n: s.get("error", "") + "\n" + "\n".join(s.get("log_tail", [])) for n, s in steps.items()
                  if s["status"] != "passed"}
    assert done.returncode == 0 and not not_passed, (done.stdout[-3000:], done.stderr[-3000:], not_passed)
    expected = ({"device", "build", "uptrain-kd", "fsdp2-launch", "agree-cpu-device"}
                | {f"convert-{m}-{k}" for m in ("1b", "8b4l") for k in KINDS} | {f"bench-{k}" for k in BENCHED})
    assert set(steps) == expected
    summary = (out / "summary.md").read_text()
    for name in expected:
        assert f"| {name} | passed |" in summary

    for layout in ("llama-3.2-1b", "llama-3-8b-4l"):
        built = steps["build"]["figures"][layout]
        finite(built, "params", "logits_std", "bf16_max_abs_dlogits", "bf16_top1_agreement")
        assert 2 < built["logits_std"] < 8  # scaled: bf16's rounding is small against it, but not nothing
        assert 0 < built["bf16_max_abs_dlogits"] < built["logits_std"]
    for m in ("1b", "8b4l"):
        for kind in KINDS:
            figures = steps[f"convert-{m}-{kind}"]["figures"]
            finite(figures, "seconds", "seconds_per_layer", "peak_host_rss_bytes")
            assert figures["estimate"], kind  # the dry run's numbers beside the measured ones
    for kind in BENCHED:
        figures = steps[f"bench-{kind}"]["figures"]
        finite(figures, "bandwidth_bytes_per_s")
        for cell in ("b1.c32", "b1.c64", "b2.c32", "b2.c64"):
            for role in ("source", "converted"):
                finite(figures, *(f"{cell}.{role}.{k}" for k in ("decode_tok_s", "prefill_tok_s", "kv_cache_bytes",
                                                                   "decode_limit_tok_s", "decode_of_limit")))
        if kind in ("mqa", "gqa", "mla"):  # fewer K/V bytes cached per token than the source
            assert figures["b1.c64.converted.kv_cache_bytes"] < figures["b1.c64.source.kv_cache_bytes"]
    up = steps["uptrain-kd"]["figures"]
    finite(up, "tokens_per_s", "mfu", "estimate_bytes", "peak_host_rss_bytes", "peak_of_estimate", "loss_first")
    assert up["steps"] == 4 and up["loss_first"] > 0 and up["mfu"] > 0
    fsdp = steps["fsdp2-launch"]["figures"]
    assert fsdp["resumed_at_step"] == 2 and fsdp["processes"] == 2 and fsdp["inv_freq_fp32"] == 1
    assert fsdp["resumed_max_abs_dweight"] == 0.0  # gloo on the CPU: the resume repeats the run exactly
    assert fsdp["distributed_type"] == "FSDP" and fsdp["rotary_exact"] == 1
    agree = steps["agree-cpu-device"]["figures"]
    finite(agree, "check.kl", "check.top1_agreement", "check.max_abs_diff")
    assert agree["check.kl"] == 0.0 and agree["check.top1_agreement"] == 1.0  # the same device twice: deterministic


def test_the_cpu_run_imports_as_if_what_the_gpu_machine_lacks_were_absent():
    """benchmarks/gpu/absent/sitecustomize.py, on the PYTHONPATH of the --cpu run's processes: a package named in
    GPU_RUN_ABSENT fails to import and find_spec reports it missing; others import as before."""
    code = ("import importlib.util, json\n"
            "try:\n    import json.decoder, yaml\n    ok = True\nexcept ImportError:\n    ok = False\n"
            "try:\n    import yaml as y2\n    blocked = False\nexcept ModuleNotFoundError:\n    blocked = True\n"
            "print(ok, blocked, importlib.util.find_spec('yaml') is None)\n")
    absent = str(REPO / "benchmarks" / "gpu" / "absent")
    base = {**os.environ, "PYTHONPATH": absent}
    done = subprocess.run([sys.executable, "-c", code], env=base | {"GPU_RUN_ABSENT": "yaml"}, capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.split() == ["False", "True", "True"], done.stderr
    done = subprocess.run([sys.executable, "-c", code], env=base | {"GPU_RUN_ABSENT": ""}, capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.split() == ["True", "False", "False"], done.stderr
