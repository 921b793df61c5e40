"""A recipe's `teacher` step (`surgery teacher`: the source's top-K stored once) and the uptrain steps that read its
store (`teacher_logprobs: STEP`): the dry run's store size and memory without a teacher, a run end to end on the tiny
pydoc Llama that a second run skips, and the refusals of a store made for other windows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from inprocess import assert_one_line_error, surgery
from recipe_files import write_recipe

from surgery.errors import SurgeryError
from surgery.recipes import load_recipe
from surgery.recipes.plan import build_plan
from surgery.training.teacher_store import bytes_per_token

REPO = Path(__file__).resolve().parents[2]
STORED = REPO / "recipes" / "llama3-8b-gqa2-stored-teacher.yaml"
LIVE = REPO / "recipes" / "llama3-8b-gqa2.yaml"


def row(plan: dict, name: str) -> dict:
    return next(r for r in plan["steps"] if r["name"] == name)


def test_the_8b_stored_teacher_recipes_dry_run_states_the_store_and_drops_the_teacher_from_each_gpu(tmp_path):
    """The store for the recipe's 1B tokens (whole steps of 1,048,576) at 6K+2 = 194 bytes per token, printed; each
    GPU of the uptraining (8 processes, FSDP) holds less than with the live teacher (recipes/llama3-8b-gqa2.yaml with
    loss: kd) by the teacher's bf16 shard, its root unit (embeddings and output head, kept gathered) and its logits."""
    stored = build_plan(load_recipe(STORED), tmp_path / "stored")
    live = build_plan(load_recipe(LIVE, ["uptrain.loss=kd"]), tmp_path / "live")
    tokens = -(-1_000_000_000 // 1_048_576) * 1_048_576
    store = row(stored, "teacher")["store"]
    assert bytes_per_token(32) == 194 and store["top_k"] == 32 and store["tokens"] == tokens
    assert store["bytes"] == 194 * tokens == row(stored, "teacher")["size"]
    assert row(stored, "uptrain")["store"]["bytes"] == 194 * tokens

    n, vocab, params = 2 * 4096, 128256, 8.03e9  # micro-batch x seq_len; Llama-3-8B's vocabulary and parameters
    teacher = 2 * params / 8 + 2 * (2 * vocab * 4096) + 4 * n * vocab
    per_gpu = {name: row(plan, "uptrain")["memory_per_process"]["device_main"]
               for name, plan in (("stored", stored), ("live", live))}
    assert per_gpu["live"] - per_gpu["stored"] == pytest.approx(teacher, rel=0.02)
    assert 20e9 < per_gpu["stored"] < 80e9
    assert not any("teacher" in line for line in row(stored, "uptrain")["memory_per_process"]["lines"])
    teacher_gpu = row(stored, "teacher")["memory_per_process"]["device_main"]
    assert 2 * params < teacher_gpu < 80e9  # the bf16 teacher whole on one GPU, and its forward's logits

    for name in ("teacher", "uptrain"):  # the commands the plan shows are the commands' own
        parses(row(stored, name)["command"].removeprefix("accelerate launch (8 processes) "))

    result = surgery("run", STORED, "--dry-run", "--output", tmp_path / "cli")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"194 B/token (fp16 log-probs and int32 ids per candidate, an fp16 tail) x {tokens:,} tokens = 194 GB" in out
    assert "teacher: none in memory" in out
    assert re.search(r"surgery teacher meta-llama/Meta-Llama-3-8B --out \S+/03-teacher --force --revision main", out)
    assert "--teacher-logprobs " + str(tmp_path / "cli" / "03-teacher") in out.replace("\n", "")
    gpu = float(re.search(r"4\. uptrain:.*?GPU memory: peak ([\d.]+) GB", out, re.S).group(1)) * 1e9
    assert gpu == pytest.approx(per_gpu["stored"], rel=0.01)


def parses(command: str) -> None:
    import shlex

    import click

    from surgery.cli import cli

    name, *args = shlex.split(command)[1:]
    cli.commands[name].make_context(name, args, parent=click.Context(cli, info_name="surgery"))


BASE = {"name": "t", "source": {"id": "smollm2"}, "output": "out",
        "steps": [{"convert": {"to": "mqa"}}, {"uptrain": {"tokens": 1024, "seq_len": 256, "batch_tokens": 512,
                                                             "micro_batch": 2, "loss": "kd"}}]}


def test_an_uptrain_step_reading_a_store_is_planned_without_the_teacher(tmp_path):
    """One process distilling from the live teacher holds its fp32 weights (4 P of the source); from a store (a folder
    not made yet: the default top-32) it holds none, and the plan states the store's size for the run's tokens."""
    from surgery import memory_estimate as est
    from surgery.checkpoint.source import resolve_source

    memory = {}
    for store in (None, str(tmp_path / "store")):
        data = json.loads(json.dumps(BASE))
        if store:
            data["steps"][1]["uptrain"]["teacher_logprobs"] = store
        plan = build_plan(load_recipe(write_recipe(tmp_path / "r.yaml", data)), tmp_path / "out")
        memory[store is not None] = row(plan, "uptrain")["memory"]
    params = est.stats_from_folder(resolve_source("smollm2").folder).params
    assert memory[False] - memory[True] == pytest.approx(4 * params, rel=0.01)
    assert row(plan, "uptrain")["store"] == {"top_k": 32, "bytes_per_token": 194, "tokens": 1024, "bytes": 194 * 1024,
                                             "made": False, "held": None, "folder": str(tmp_path / "store")}


def tiny_recipe(path: Path, source: Path, out: Path, **teacher) -> Path:
    return write_recipe(path, {
        "name": "tiny-stored-kd", "source": {"path": str(source)}, "output": str(out),
        "steps": [{"convert": {"to": "mqa"}},
                  {"teacher": {"top_k": 8, "device": "cpu", **teacher}},
                  {"uptrain": {"data": "pydoc", "tokens": 1024, "seq_len": 64, "batch_tokens": 512, "micro_batch": 4,
                               "eval_tokens": 512, "eval_every": 0, "save_every": 0, "lr": 0.003, "loss": "kd",
                               "teacher_logprobs": "teacher"}}]})


def test_a_teacher_step_and_the_uptraining_from_its_store_run_and_a_second_run_skips_them(tiny, tmp_path):
    from surgery.recipes.runner import run_recipe

    out = tmp_path / "runs"
    recipe = load_recipe(tiny_recipe(tmp_path / "tiny.yaml", tiny, out))
    assert run_recipe(recipe, out, log=lambda *_: None) == [("convert", "ran"), ("teacher", "ran"), ("uptrain", "ran")]
    manifest = json.loads((out / "02-teacher" / "manifest.json").read_text())
    assert manifest["top_k"] == 8 and manifest["windows"] == 16 and manifest["tokens"] == 1024  # 2 steps x 8 windows
    assert manifest["windows_spec"]["seq_len"] == 64 and manifest["windows_spec"]["eval_tokens"] == 512
    record = json.loads((out / "03-uptrain" / "surgery.json").read_text())["uptraining"]
    assert Path(record["teacher_logprobs"]["folder"]) == out / "02-teacher"
    assert record["teacher_logprobs"]["top_k"] == 8

    assert run_recipe(load_recipe(tmp_path / "tiny.yaml"), out, log=lambda *_: None) == [
        ("convert", "skipped"), ("teacher", "skipped"), ("uptrain", "skipped")]
    # another K rewrites the store, so the uptraining that reads it runs again; the conversion does not
    plan = build_plan(load_recipe(tmp_path / "tiny.yaml", ["teacher.top_k=4"]), out)
    assert [r["status"] for r in plan["steps"]] == ["done, unchanged: skip", "run", "run"]


@pytest.mark.parametrize("teacher, fragment", [
    ({"seq_len": 32}, "steps[1].teacher.seq_len: 32 here, 64 in uptrain step 'uptrain'"),
    ({"seed": 3}, "steps[1].teacher.seed: 3 here, 0 in uptrain step 'uptrain'"),
    ({"data": "general"}, "steps[1].teacher.data: ['general'] here, ['pydoc'] in uptrain step 'uptrain'"),
])
def test_a_teacher_step_made_for_other_windows_is_refused_in_one_line_before_anything_runs(tmp_path, teacher,
                                                                                          fragment):
    out = tmp_path / "runs"
    recipe = tiny_recipe(tmp_path / "bad.yaml", tmp_path / "no-such-source", out, **teacher)
    with pytest.raises(SurgeryError, match=re.escape(fragment)):
        load_recipe(recipe)
    if "seq_len" in teacher:
        result = surgery("run", recipe)
        assert_one_line_error(result, f"{recipe}:", fragment, "leave seq_len out of the teacher step")
        assert not out.exists()


@pytest.mark.parametrize("edit, fragment", [
    (lambda steps: steps.insert(2, steps.pop(1)), "reads the store of teacher step 'teacher', which comes after it"),
    (lambda steps: steps[2]["uptrain"].pop("teacher_logprobs"), "no uptrain step reads this store"),
    (lambda steps: (steps[1]["teacher"].update(processes=4), steps[2]["uptrain"].update(data_mode="stream", accelerate={
        "config_file": str(REPO / "recipes" / "accelerate" / "fsdp-cpu.yaml"), "num_processes": 2})),
     "steps[1].teacher.processes: 4 here, 2 in uptrain step 'uptrain'"),
])
def test_a_store_its_reader_cannot_use_is_refused_when_the_recipe_loads(tmp_path, edit, fragment):
    import yaml

    path = tiny_recipe(tmp_path / "r.yaml", tmp_path / "src", tmp_path / "out")
    data = yaml.safe_load(path.read_text())
    edit(data["steps"])
    with pytest.raises(SurgeryError, match=re.escape(fragment)):
        load_recipe(write_recipe(path, data))


def test_a_teacher_step_takes_its_readers_number_of_processes(tmp_path):
    """A streamed uptrain step in 2 processes: its teacher step stores the windows in the order 2 processes read
    them (`processes: 2`, `surgery teacher --processes 2` in the plan)."""
    import yaml

    path = tiny_recipe(tmp_path / "r.yaml", tmp_path / "src", tmp_path / "out")
    data = yaml.safe_load(path.read_text())
    data["steps"][2]["uptrain"].update(data_mode="stream", accelerate={
        "config_file": str(REPO / "recipes" / "accelerate" / "fsdp-cpu.yaml"), "num_processes": 2})
    recipe = load_recipe(write_recipe(path, data))
    teacher = next(s for s in recipe.validated_steps() if s.kind == "teacher")
    assert teacher.options.processes == 2
