"""Property-based fuzzing of the files the toolkit reads back (issue 31), beside tests/checkpoint/test_fuzz.py's checkpoints:
check and bench reports (what `push` puts in the model card), an uptraining's run state (what `uptrain --resume`
continues from) and a recipe's state (what `surgery run` skips by).

Hypothesis replaces fields (or whole files) with arbitrary JSON — wrong types, nesting, huge numbers, NaN — and
every case must end in one of two ways: a valid result (a model card with its check table; a resumed run's output
folder with finite weights; a recipe plan or a finished recipe) or exactly one `surgery: error:` line, exit 2, and
nothing written. Derandomized and small (EXAMPLES per property) so the default suite stays fast.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from inprocess import run_cli as run_in_process

from surgery.errors import SurgeryError
from surgery.testing.pydoc_llama import FAST

EXAMPLES = {"check_report": 40, "bench_report": 30, "run_state": 8, "recipe_state": 12}
HANG_SECONDS = 60
SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])

LEAF = st.one_of(st.none(), st.booleans(), st.integers(-3, 10), st.integers(-(2**70), 2**70),
                 st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6))
JSON = st.recursive(LEAF, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                         max_size=3), max_leaves=6)
DEEP = st.integers(150, 3000).map(lambda n: json.loads("[" * n + "]" * n) if n < 900 else "[" * n + "]" * n)


def mutate(data, value: dict) -> object:
    """`value` with some fields replaced, removed or added (nested dicts too), or the whole of it replaced."""
    choice = data.draw(st.sampled_from(["fields", "fields", "fields", "nested", "whole", "deep"]))
    if choice == "whole":
        return data.draw(JSON)
    if choice == "deep":
        return {**value, data.draw(st.sampled_from(sorted(value))): data.draw(DEEP)}
    out = json.loads(json.dumps(value))
    keys = sorted(out)
    for key in data.draw(st.lists(st.sampled_from(keys), min_size=1, max_size=3, unique=True)):
        action = data.draw(st.sampled_from(["replace", "replace", "remove"]))
        if action == "remove":
            out.pop(key)
        elif choice == "nested" and isinstance(out[key], (dict, list)) and out[key]:
            inner = out[key]
            slot = data.draw(st.sampled_from(sorted(inner) if isinstance(inner, dict) else list(range(len(inner)))))
            inner[slot] = data.draw(JSON)
        else:
            out[key] = data.draw(JSON)
    return out


def dump(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def one_line_or_ok(code: int, err: str) -> bool:
    """True for exit 0; for exit 2 asserts the one line. Anything else fails."""
    assert "Traceback" not in err, err[-3000:]
    if code == 0:
        return True
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("surgery: warning: ") and " ETA " not in ln]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("surgery: error: "), err[-3000:]
    return False


@pytest.fixture(scope="module")
def model(tiny):
    """conftest's tiny Llama with its BPE tokenizer, under the name these tests read as."""
    return tiny


@pytest.fixture(autouse=True)
def private_hash_cache(tmp_path, monkeypatch):
    import surgery.checkpoint.tensors

    monkeypatch.setattr(surgery.checkpoint.tensors._HashCache, "PATH", tmp_path / "cache" / "sha256.json")


# ---- reports -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def validation(model):
    from surgery.publish.validate import validate_folder

    return validate_folder(model)


@pytest.fixture(scope="module")
def check_report(model):
    from surgery.checking.compare import compare_checkpoints
    from surgery.checking.options import CheckOptions
    from surgery.data import load_texts
    from surgery.checkpoint.source import resolve_source

    src = resolve_source(str(model))
    report = compare_checkpoints(src, src, load_texts("pydoc", "text", False),
                                 CheckOptions(data=["pydoc", "other"], tokens=128, seq_len=64, generate=4),
                                 progress=False, more_texts=[("other", ["some other text " * 40])])
    return json.loads(json.dumps(report))


def card_or_one_error(build) -> str | None:
    try:
        return build()
    except SurgeryError as e:
        assert "\n" not in str(e) and str(e), repr(e)
        return None


@settings(max_examples=EXAMPLES["check_report"], **SETTINGS)
@given(data=st.data())
def test_fuzz_check_report_into_the_card(validation, check_report, data):
    from surgery.publish.card import build_card, load_reports

    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "report.json"
        path.write_text(dump(mutate(data, check_report)))
        card = card_or_one_error(lambda: build_card(validation, "me/x", load_reports([path])))
        assert sorted(p.name for p in Path(work).iterdir()) == ["report.json"]
    if card is not None:
        assert "## Check against the source" in card and "| report |" in card


@pytest.fixture(scope="module")
def bench_report():
    row = {"batch": 1, "context": 8, "prefill_batch": 1,
           "source": {k: {"median": 10.0} for k in ("prefill_tokens_per_s", "decode_tokens_per_s")},
           "converted": {k: {"median": 12.0} for k in ("prefill_tokens_per_s", "decode_tokens_per_s")},
           "ratio": {"prefill_tokens_per_s": 1.2, "decode_tokens_per_s": 1.2, "kv_cache_bytes": 0.5,
                     "peak_memory_bytes": None}}
    return {"date": "2026-11-25T00:00:00Z", "engine": "transformers", "dtype": "float32", "rounds": 1,
            "new_tokens": 2, "machine": {"processor": "cpu", "threads": 2}, "results": [row]}


@settings(max_examples=EXAMPLES["bench_report"], **SETTINGS)
@given(data=st.data())
def test_fuzz_bench_report_into_the_card(validation, bench_report, data):
    from surgery.publish.reports import load_bench_report as load_report
    from surgery.publish.card import build_card

    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "bench.json"
        report = mutate(data, bench_report)
        if isinstance(report, dict) and isinstance(report.get("results"), list) and report["results"] \
                and data.draw(st.booleans()):
            # a row's own fields, in a new list: `mutate` may share the fixture's list, and changing it in place
            # would make later examples differ from their replays (hypothesis: FlakyStrategyDefinition)
            report["results"] = [mutate(data, bench_report["results"][0]), *report["results"][1:]]
        path.write_text(dump(report))
        card = card_or_one_error(lambda: build_card(validation, "me/x", bench=load_report(path)))
    if card is not None:
        assert "## Measured speed" in card


# ---- run state ---------------------------------------------------------------------------------------------
UPTRAIN = ["--seq-len", "64", "--batch-tokens", "512", "--micro-batch", "4", "--eval-tokens", "256", "--loss", "lm",
           "--lr", "0.003", "--tokens", "1024", "--save-every", "1", "--eval-every", "0"]


@pytest.fixture(scope="module")
def finished_run(model, tmp_path_factory):
    from surgery.training import UptrainOptions, uptrain

    out = tmp_path_factory.mktemp("fuzzrec") / "up"
    uptrain(UptrainOptions(model=str(model), out=out, keep_run_dir=True,
                           **(FAST | dict(loss="lm", tokens=1024, save_every=1, eval_tokens=256))))
    return out.parent / "up.run"


@settings(max_examples=EXAMPLES["run_state"], **SETTINGS)
@given(data=st.data())
def test_fuzz_run_state_on_resume(model, finished_run, capsys, data):
    import torch
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as work:
        run_dir, out = Path(work) / "o.run", Path(work) / "o"
        shutil.copytree(finished_run, run_dir)
        shutil.rmtree(run_dir / "checkpoints" / "step-00000002")
        ck = run_dir / "checkpoints" / "step-00000001"
        state = json.loads((ck / "run-state.json").read_text())
        raw = dump(mutate(data, state)).encode()
        (ck / "run-state.json").write_bytes(raw)
        manifest = json.loads((ck / "manifest.json").read_text())  # re-hashed, as someone editing it would
        manifest["files"]["run-state.json"] = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
        (ck / "manifest.json").write_text(json.dumps(manifest))
        code, _, err = run_in_process(capsys, "uptrain", str(model), "--out", str(out), "--run-dir", str(run_dir),
                                      "--resume", *UPTRAIN, hang_seconds=HANG_SECONDS)
        if one_line_or_ok(code, err):
            weights = load_file(out / "model.safetensors")
            assert weights and all(bool(torch.isfinite(t).all()) for t in weights.values())
        else:
            assert not out.exists() and not [p for p in Path(work).iterdir() if p.name.startswith(".o.")]


# ---- recipe state ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def finished_recipe(model, tmp_path_factory):
    """A one-step recipe (convert) run once: its state is what the cases mutate."""
    from surgery.recipes import load_recipe
    from surgery.recipes.runner import run_recipe

    folder = tmp_path_factory.mktemp("fuzzrec")
    path = folder / "r.yaml"
    path.write_text(yaml.safe_dump({"source": {"path": str(model)}, "output": str(folder / "out"),
                                    "steps": [{"convert": {"to": "mqa"}}]}, sort_keys=False))
    run_recipe(load_recipe(path), folder / "out", log=lambda line: None)
    return folder / "out"


@settings(max_examples=EXAMPLES["recipe_state"], **SETTINGS)
@given(data=st.data())
def test_fuzz_recipe_state(model, finished_recipe, capsys, data):
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "out"
        shutil.copytree(finished_recipe, out)
        state = json.loads((out / "recipe-state.json").read_text())
        if data.draw(st.booleans()):  # the step's record, or the whole file
            state = {**state, "steps": {"convert": mutate(data, state["steps"]["convert"])}}
        else:
            state = mutate(data, state)
        text = dump(state)
        (out / "recipe-state.json").write_text(text)
        recipe = Path(work) / "r.yaml"
        recipe.write_text(yaml.safe_dump({"source": {"path": str(model)}, "output": str(out),
                                          "steps": [{"convert": {"to": "mqa"}}]}, sort_keys=False))
        before = sorted(p.name for p in out.iterdir())
        code, stdout, err = run_in_process(capsys, "run", str(recipe), "--dry-run", hang_seconds=HANG_SECONDS)
        if one_line_or_ok(code, err):
            assert "convert" in stdout
        assert sorted(p.name for p in out.iterdir()) == before and (out / "recipe-state.json").read_text() == text
        code, stdout, err = run_in_process(capsys, "run", str(recipe), hang_seconds=HANG_SECONDS)
        if one_line_or_ok(code, err):
            assert "recipe done" in stdout and (out / "01-convert" / "model.safetensors").is_file()
            assert json.loads((out / "recipe-state.json").read_text())["steps"]["convert"]["finished"] is True
        else:
            assert (out / "recipe-state.json").read_text() == text
