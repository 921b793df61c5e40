"""Recipes that are not recipes, or that would do harm: one line naming the file or the field, exit 2, nothing run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from inprocess import assert_one_line_error, surgery

from surgery.testing import tiny_models as tm

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


# ---- fuzz: whatever the file holds, a recipe loads and plans, or one SurgeryError says why ------------------
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

SHIPPED = (Path(__file__).resolve().parents[2] / "recipes" / "smollm2-mqa.yaml").read_text()
YAML_CHARS = st.sampled_from(list(":-[]{}&*!|>'\"#%@`,? \n\t") + ["\n  ", "- ", ": ", "&a ", "*a", "!!python/name:os.system", "\x00", "\ufeff"])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20), st.floats(allow_nan=True), st.text(max_size=12))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)
KINDS = st.sampled_from(["convert", "check", "teacher", "uptrain", "push"])
OPTION_KEYS = st.sampled_from(["to", "kv_heads", "merge", "tokens", "seq_len", "repo_id", "accelerate", "name",
                               "trust_remote_code", "allow_pickle", "batch_size", "loss", "teacher", "heads", "experts",
                               "topk", "calib_tokens", "private", "teacher_logprobs", "top_k"])
PLAUSIBLE = st.sampled_from(["mqa", "gqa", "talking-heads", "switchhead", "mean", "aligned", "pydoc", "me/x", "kd", "teacher",
                             "lm", True, False, 0, 1, 2, 3, 512, -1, None, {"num_processes": 2}]) | SCALARS
STEP = st.builds(lambda kind, options: {kind: options}, KINDS,
                 st.none() | st.dictionaries(OPTION_KEYS, PLAUSIBLE, max_size=4))
FIRST = st.just({"convert": {"to": "mqa"}}) | st.just({"convert": {"to": "gqa", "kv_heads": 2}}) | STEP


WILD = st.fixed_dictionaries({
    "source": st.sampled_from([{"path": "src"}, {"package": "json", "path": "x"}, {"id": "smollm2"}])
    | st.dictionaries(st.sampled_from(["id", "path", "gguf", "package", "revision", "config"]), VALUES, max_size=3),
    "output": st.just("run") | VALUES,
    "steps": st.builds(lambda first, rest: [first, *rest], FIRST, st.lists(STEP | VALUES, max_size=4)) | VALUES})
# a valid frame whose step options are fuzzed: gets past the frame's validation to the options, order and plan
FRAMED = st.builds(lambda steps: {"source": {"path": "src"}, "output": "run", "steps": steps},
                   st.builds(lambda first, rest: [first, *rest], FIRST, st.lists(STEP, max_size=4)))
RECIPES = FRAMED | WILD


def load_and_plan(path: Path, out: Path) -> None:
    """The property: loading and planning either work or raise one SurgeryError (no other exception, no hang)."""
    from surgery.recipes.plan import build_plan

    try:
        build_plan(load_recipe(path), out)
    except SurgeryError as e:
        assert "\n" not in str(e).strip() and str(e)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=RECIPES)
def test_fuzz_structured_recipes(data, tmp_path):
    path = tmp_path / "fuzz.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    load_and_plan(path, tmp_path / "run")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, len(SHIPPED)), st.integers(0, 3), YAML_CHARS), min_size=1, max_size=6))
def test_fuzz_mutated_recipe_text(edits, tmp_path):
    text = SHIPPED
    for at, cut, insert in edits:
        at = min(at, len(text))
        text = text[:at] + insert + text[at + cut:]
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    load_and_plan(path, tmp_path / "run")
