"""Each `--trust-*` flag runs the code of exactly the checkpoint it names, in every command.

The hostile checkpoint of tests/hostile.py ships `configuration_x.py` / `modeling_x.py` that leave a marker
file when imported. For every command and flag: the flag that names the hostile checkpoint runs its code (the
control: the payload is real), and any other flag, or none, is refused in one line naming the right flag, with
nothing run and nothing written. Commands with no trust flag (convert, inspect, push, compare-merges) never run it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hostile import cli_error, hostile_checkpoint, ran
from inprocess import surgery

from surgery.testing import tiny_models as tm
from surgery.testing.tiny_models import char_tokenizer

BENCH_FAST = ("--context", "8", "--new", "2", "--rounds", "1", "--threads", "1")
CHECK_FAST = ("--tokens", "128", "--seq-len", "32")
UPTRAIN_FAST = ("--tokens", "128", "--seq-len", "32", "--batch-tokens", "128", "--micro-batch", "4",
                "--eval-tokens", "0", "--save-every", "0")


def plain(folder: Path, seed: int = 1) -> Path:
    tm.make_tiny("llama", folder, seed=seed)
    char_tokenizer(folder)
    return folder


@pytest.fixture
def pair(tmp_path):
    """(hostile checkpoint, its markers folder, a plain checkpoint of the same shape and tokenizer)."""
    markers = tmp_path / "markers"
    return hostile_checkpoint(tmp_path / "hostile", markers), markers, plain(tmp_path / "plain")


# (command, the hostile one's role, the flag naming it, a flag naming the other model)
CASES = [
    ("check", "source", "--trust-source-code", "--trust-remote-code"),
    ("check", "converted", "--trust-remote-code", "--trust-source-code"),
    ("bench", "source", "--trust-source-code", "--trust-remote-code"),
    ("bench", "converted", "--trust-remote-code", "--trust-source-code"),
    ("uptrain", "model", "--trust-remote-code", "--trust-teacher-code"),
    ("uptrain", "teacher", "--trust-teacher-code", "--trust-remote-code"),
]


def command(name: str, role: str, hostile: Path, other: Path, out: Path) -> list:
    if name == "uptrain":
        model, teacher = (hostile, other) if role == "model" else (other, hostile)
        return ["uptrain", model, "--out", out, "--teacher", teacher, "--loss", "kd", *UPTRAIN_FAST]
    first, second = (hostile, other) if role == "source" else (other, hostile)
    fast = CHECK_FAST if name == "check" else BENCH_FAST
    return [name, first, second, "--json", out, *fast]


@pytest.mark.parametrize("name, role, flag, other_flag", CASES, ids=[f"{c}-{r}" for c, r, _, _ in CASES])
def test_a_trust_flag_runs_the_code_of_the_model_it_names_and_no_other(name, role, flag, other_flag, pair, tmp_path):
    hostile, markers, other = pair
    out = tmp_path / ("out" if name == "uptrain" else "out.json")
    args = command(name, role, hostile, other, out)
    for refused in ((), (other_flag,)):  # no flag, or the other model's (in this process: no interpreter start-up;
        message = cli_error(*args, *refused)  # tests/check/test_check.py shows the refusal printed as one line)
        assert flag in message and "modeling_x.py" in message
        assert ran(markers) == [] and not out.exists()
    result = surgery(*args, flag)  # the control: the flag that names it runs its code (a fresh process imports it)
    assert result.returncode == 0, result.stderr
    assert ran(markers) == ["configuration_x", "modeling_x"] and out.exists()


def test_bench_trust_remote_code_does_not_reach_the_source(pair, tmp_path):
    """The case that reached too far: `bench --trust-remote-code` is documented for CONVERTED and ran SOURCE's code."""
    from surgery.bench.options import BenchOptions
    from surgery.bench.run import run_bench
    from surgery.errors import SurgeryError

    hostile, markers, other = pair
    with pytest.raises(SurgeryError, match="the source .*--trust-source-code"):
        run_bench(BenchOptions(source=str(hostile), converted=str(other), contexts=[8], new=2, rounds=1, threads=1,
                               trust_remote_code=True))
    assert ran(markers) == []


def recipe(tmp_path: Path, source: Path, check: dict) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"source": {"path": str(source)}, "output": str(tmp_path / "run"),
                                    "steps": [{"convert": {"to": "mqa"}},
                                              {"check": {"tokens": 128, "seq_len": 32, **check}}]}))
    return path


def test_a_recipe_step_trusts_exactly_what_its_fields_name(pair, tmp_path):
    """The converted output carries the source's code (convert copies what auto_map names), so a check step needs
    both fields; one of them is refused naming the other, and both run it."""
    hostile, markers, _ = pair
    one = surgery("run", recipe(tmp_path, hostile, {"trust_remote_code": True}))
    assert one.returncode == 2 and "--trust-source-code" in one.stderr and "Traceback" not in one.stderr
    assert ran(markers) == []
    both = surgery("run", recipe(tmp_path, hostile, {"trust_remote_code": True, "trust_source_code": True}))
    assert both.returncode == 0, both.stderr
    assert ran(markers) == ["configuration_x", "modeling_x"]


def test_commands_without_a_trust_flag_never_run_the_code(pair, tmp_path):
    hostile, markers, other = pair
    inspected = surgery("inspect", hostile, "--json")
    assert inspected.returncode == 0, inspected.stderr
    assert json.loads(inspected.stdout)[0]["parameters"] > 0
    compared = surgery("compare-merges", hostile, "--to", "mqa", "--methods", "mean", "--tokens", "128",
                       "--seq-len", "32")
    assert compared.returncode in (0, 2), compared.stderr  # refusing is fine; running the code is not
    assert ran(markers) == []
