"""Recipes that are not recipes, or that would do harm: one line naming the file or the field, exit 2, nothing run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import tiny_models as tm
from test_cli_errors import assert_one_line_error, surgery

from surgery.errors import SurgeryError
from surgery.recipes import load_recipe

GOOD = {"source": {"path": "src"}, "output": "run", "steps": [{"convert": {"to": "mqa"}}]}


def write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def error(path: Path) -> str:
    with pytest.raises(SurgeryError) as e:
        load_recipe(path)
    return str(e.value)


def test_binary_and_huge_files_are_not_recipes(tmp_path):
    binary = tmp_path / "model.safetensors"
    binary.write_bytes(bytes(range(256)) * 64)
    assert_one_line_error(surgery("run", binary, "--dry-run"), str(binary), "not a text file")
    nul = tmp_path / "nul.yaml"
    nul.write_bytes(b"source: {path: src}\x00\n")
    assert "NUL" in error(nul) and str(nul) in error(nul)
    huge = tmp_path / "huge.yaml"
    huge.write_text("# " + "x" * (2 << 20) + "\n" + yaml.safe_dump(GOOD))
    assert "larger than" in error(huge)


def test_deep_nesting_is_refused_in_one_line(tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("source: {path: src}\noutput: run\nsteps: " + "[" * 5000 + "]" * 5000 + "\n")
    assert_one_line_error(surgery("run", deep, "--dry-run"), str(deep), "nested deeper")
    nested = tmp_path / "nested.yaml"  # deep, but within Python's recursion limit: caught by the depth count
    nested.write_text("source: {path: src}\noutput: run\nsteps: " + "[" * 200 + "]" * 200 + "\n")
    assert "nested deeper than" in error(nested)


def test_an_alias_bomb_is_refused_at_once(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    rows = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        rows.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    rows += ["source: {path: src}", "output: run", "steps:", "  - convert: {to: mqa}", "  - check: {data: *i}",
             "# 9^9 = 387 million strings when expanded"]
    bomb.write_text("\n".join(rows) + "\n")
    assert len(rows) == 15
    assert_one_line_error(surgery("run", bomb, "--dry-run"), str(bomb), "expands to more than")

    anchors = tmp_path / "anchors.yaml"  # anchors and aliases used sensibly still work
    anchors.write_text("source: {path: src}\noutput: run\nsteps:\n  - convert: {to: mqa}\n"
                       "  - check: &c {tokens: 512, seq_len: 64}\n  - uptrain: {tokens: 1024}\n  - check: *c\n")
    steps = load_recipe(anchors).validated_steps()
    assert [s.options.tokens for s in steps if s.kind == "check"] == [512, 512]
    recursive = tmp_path / "recursive.yaml"
    recursive.write_text("source: {path: src}\noutput: run\nsteps: &s [*s]\n")
    assert "refers to its own node" in error(recursive) or "not valid YAML" in error(recursive)


def test_push_or_check_before_any_model_step_is_refused(tmp_path):
    for kind, words in (("push", "publish the unconverted source"), ("check", "compare the source with itself")):
        data = {**GOOD, "steps": [{kind: {"repo_id": "me/x"} if kind == "push" else {}}, {"convert": {"to": "mqa"}}]}
        path = write(tmp_path / f"{kind}.yaml", data)
        result = surgery("run", path, "--dry-run")
        assert_one_line_error(result, f"{path}:", f"steps[0].{kind}", words)
    uptrain_first = write(tmp_path / "u.yaml", {**GOOD, "steps": [{"uptrain": {"tokens": 512}}, {"push": {"repo_id": "me/x"}}]})
    assert [s.kind for s in load_recipe(uptrain_first).validated_steps()] == ["uptrain", "push"]  # uptrain writes its own output


def test_a_missing_accelerate_config_file_is_named(tmp_path):
    path = write(tmp_path / "r.yaml", {**GOOD, "steps": [{"convert": {"to": "mqa"}},
                                                          {"uptrain": {"tokens": 512, "accelerate": {"config_file": "nope.yaml", "num_processes": 2}}}]})
    message = error(path)
    assert "steps[1].uptrain.accelerate.config_file" in message and str(tmp_path / "nope.yaml") in message
    (tmp_path / "nope.yaml").write_text("compute_environment: LOCAL_MACHINE\n")
    assert load_recipe(path).validated_steps()[1].options.accelerate.num_processes == 2


@pytest.mark.parametrize("state", ["[1]", "{\"steps\": [1]}", "{\"steps\": {\"convert\": 3}}", "{not json"])
def test_a_corrupt_recipe_state_is_named(state, tmp_path):
    tm.make_tiny("llama", tmp_path / "src")
    path = write(tmp_path / "r.yaml", {"source": {"path": str(tmp_path / "src")}, "output": str(tmp_path / "run"),
                                       "steps": [{"convert": {"to": "mqa"}}]})
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "recipe-state.json").write_text(state)
    from surgery.recipes.plan import build_plan

    with pytest.raises(SurgeryError, match="recipe-state.json"):
        build_plan(load_recipe(path), tmp_path / "run")
    assert_one_line_error(surgery("run", path), "recipe-state.json", "delete it")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["recipe-state.json"]  # nothing ran
    assert (tmp_path / "run" / "recipe-state.json").read_text() == state
