"""The streamed data path against hostile and careless inputs (issue 40): weights, file kinds, tampered positions,
large documents and single-file corpora, each refused in one line or handled with bounded memory."""

from __future__ import annotations

import json
import os

import pytest

from inprocess import time_limit
from surgery.errors import SurgeryError
from surgery.training.stream_held_out import hold_out
from surgery.training.stream_readers import Reader, check_state
from surgery.training.stream_sources import Plan, parse_weights, resolve_sources


def test_weights_whose_sum_overflows_are_normalised_not_zeroed():
    assert parse_weights("1e308,1e308", 2) == [0.5, 0.5]
    assert parse_weights([1.5e308, 0.5e308], 2) == pytest.approx([0.75, 0.25])
    with pytest.raises(SurgeryError, match="differ too much"):
        parse_weights("1e308,1e-320", 2)


# ---- what a data spec may name -------------------------------------------------------------------------------
def jsonl(path, docs: int, tag: str = "doc") -> str:
    from surgery.data import pydoc_texts

    texts = pydoc_texts()
    path.write_text("".join(json.dumps({"text": f"{tag} {d}: " + texts[d % len(texts)][:400]}) + "\n"
                            for d in range(docs)))
    return str(path)


@pytest.mark.parametrize("make, words", [
    (lambda p: os.mkfifo(p), "is a FIFO; only regular files are read"),
    (lambda p: p.symlink_to(p), "a symlink loop"),
    (lambda p: p.symlink_to(p.parent / "gone.jsonl"), "No such file"),
    (lambda p: p.mkdir(), "is a folder"),
])
def test_a_glob_matching_anything_but_a_regular_file_is_one_line(tmp_path, make, words):
    from surgery.data import load_texts

    jsonl(tmp_path / "a.jsonl", 3)
    make(tmp_path / "b.jsonl")
    spec = str(tmp_path / "*.jsonl")
    with time_limit(20):
        for read in (lambda: resolve_sources([spec], [1.0]), lambda: list(load_texts(spec))):
            with pytest.raises(SurgeryError, match=words):
                read()


def test_a_linked_data_file_is_read_through_its_target(tmp_path, tokenizer):
    target = jsonl(tmp_path / "real.jsonl", 4)
    (tmp_path / "link.jsonl").symlink_to(target)
    [source] = resolve_sources([str(tmp_path / "link.jsonl")], [1.0])
    assert source.units == (target,)


# ---- tampered positions ----------------------------------------------------------------------------------------

def plan_for(tokenizer, sources, epochs=1, seq_len=16, readers=1, eval_tokens=0) -> Plan:
    args = dict(tokenizer=tokenizer, eos=tokenizer.eos_token_id, seq_len=seq_len, seed=0, readers=readers,
                epochs=epochs)
    _, held = hold_out(args, sources, eval_tokens)
    return Plan(sources=tuple(sources), held=held, **args)


def saved_state(plan, windows: int) -> dict:
    reader = Reader(plan, 0, None)
    it = iter(reader)
    for _ in range(windows):
        next(it)
    return json.loads(json.dumps(reader.state()))  # as a checkpoint holds it


@pytest.mark.parametrize("field, value, words", [
    ("offset", 10 ** 9, "token 1000000000 of a document of"),  # looped for ever
    ("doc", 10 ** 6, "document 1000000 of epoch 0"),  # was "ran dry ... raise --data-epochs"
])
def test_a_position_past_what_the_data_holds_is_refused_not_read(tmp_path, tokenizer, field, value, words):
    sources = resolve_sources([jsonl(tmp_path / "d.jsonl", 20)], [1.0])
    plan = plan_for(tokenizer, sources)
    state = saved_state(plan, 3)
    check_state(state, plan)
    state["sources"][0]["start"][field] = value
    check_state(state, plan)  # the shape is right: only the data can tell it is past the end
    with time_limit(30), pytest.raises(SurgeryError, match="data position in the checkpoint is not valid") as e:
        next(iter(Reader(plan, 0, state)))
    assert words in str(e.value) and "ran dry" not in str(e.value)


def test_an_untampered_position_resumes_to_the_same_windows(tmp_path, tokenizer):
    sources = resolve_sources([jsonl(tmp_path / "d.jsonl", 20)], [1.0])
    plan = plan_for(tokenizer, sources, epochs=3)
    straight = iter(Reader(plan, 0, None))
    expected = [next(straight)[0].tolist() for _ in range(40)]
    for k in (1, 7, 25):
        resumed = iter(Reader(plan, 0, saved_state(plan, k)))
        assert [next(resumed)[0].tolist() for _ in range(40 - k)] == expected[k:]


@pytest.mark.parametrize("bad", [0.7, 1, True, {"a": 1}])
def test_a_recipe_s_scalar_data_weights_is_told_what_the_option_takes(tmp_path, bad):
    import yaml

    from surgery.recipes import load_recipe

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"source": {"path": "src"}, "output": "run", "steps": [
        {"convert": {"to": "mqa"}}, {"uptrain": {"tokens": 512, "data": ["pydoc", "a.jsonl"], "data_weights": bad}}]}))
    with pytest.raises(SurgeryError) as e:
        load_recipe(path)
    assert "data_weights takes one weight per data: a list of numbers ([0.7, 0.3])" in str(e.value), str(e.value)
    assert "valid string" not in str(e.value)


@pytest.mark.slow  # 10-30 s: keeps the default suite under 25 minutes on 2 cores
def test_library_log_lines_stay_off_stderr_unless_verbose(tiny, tmp_path):
    """datasets logs a bad JSON row before raising; the one line says it (`surgery -v` shows the library's too)."""
    import subprocess
    import sys
    from pathlib import Path

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{bad json\n')
    env = {k: v for k, v in os.environ.items() if k not in ("DATASETS_VERBOSITY", "TRANSFORMERS_VERBOSITY")}
    args = ["uptrain", str(tiny), "--data", str(bad), "--data-mode", "stream", "--tokens", "64", "--seq-len", "32",
            "--batch-tokens", "32", "--micro-batch", "1", "--eval-tokens", "0", "--out", str(tmp_path / "o")]

    def run(*flags):
        return subprocess.run([sys.executable, "-m", "cli", *flags, *args], capture_output=True, text=True, env=env,
                              cwd=Path(__file__).resolve().parents[2], timeout=300)

    quiet, verbose = run(), run("-v")
    assert quiet.returncode == verbose.returncode == 2
    assert quiet.stderr.strip().splitlines() == [f"surgery: error: cannot read data {bad}: JSON parse error: Missing a "
                                                 "name for object member. in row 1"], quiet.stderr
    assert "Failed to load JSON" in verbose.stderr
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.run").exists()


def test_transformers_load_report_and_torch_s_worker_warning_stay_off_stderr_unless_verbose(tiny, tmp_path):
    """A checkpoint with a tensor the model does not have makes transformers print its load report, more DataLoader
    workers than CPUs make torch warn (twice): neither reaches stderr without `surgery -v`; with it, both do."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import torch
    from safetensors.torch import load_file, save_file

    model = tmp_path / "extra"
    shutil.copytree(tiny, model)
    tensors = load_file(model / "model.safetensors")
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2, 2)
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    workers = len(os.sched_getaffinity(0)) + 1  # one more than torch suggests
    env = {k: v for k, v in os.environ.items() if k not in ("DATASETS_VERBOSITY", "TRANSFORMERS_VERBOSITY")}

    def run(*flags):
        args = ["uptrain", str(model), "--data", "pydoc", "--data-mode", "stream", "--data-workers", str(workers),
                "--tokens", "64", "--seq-len", "32", "--batch-tokens", "32", "--micro-batch", "1", "--eval-tokens", "0",
                "--out", str(tmp_path / f"out{''.join(flags)}")]
        return subprocess.run([sys.executable, "-m", "cli", *flags, *args], capture_output=True, text=True, env=env,
                              cwd=Path(__file__).resolve().parents[2], timeout=300)

    quiet, verbose = run(), run("-v")
    assert quiet.returncode == verbose.returncode == 0, quiet.stderr + verbose.stderr
    assert all(line.startswith(("uptrain:", "surgery: warning:", "wrote ")) for line in quiet.stderr.splitlines()), \
        quiet.stderr
    assert "LOAD REPORT" in verbose.stderr and "model.layers.0.mlp.extra.weight" in verbose.stderr
    assert f"This DataLoader will create {workers} worker processes" in verbose.stderr
