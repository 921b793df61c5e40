"""Recipes: schema errors that point at the line and field, dry-run plans, and resumable runs end to end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from hub_server import TOKEN, USER, LocalHub, download, hub_env
from inprocess import assert_one_line_error, surgery
from recipe_files import paired_llama, write_recipe

from surgery.errors import SurgeryError

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


# ---- schema ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_shipped_recipes_validate_and_plan(recipe):
    from surgery.recipes import load_recipe
    from surgery.recipes.plan import build_plan

    r = load_recipe(recipe)
    plan = build_plan(r, Path(r.output))
    kinds = [s.kind for s in r.validated_steps()]
    assert kinds[0] == "convert" and kinds[-1] == "push" and "check" in kinds
    assert all(row["status"] in ("run", "done, unchanged: skip") for row in plan["steps"])
    assert r.hardware and r.hardware.time  # every shipped recipe says what it needs
    if "uptrain" in kinds:
        row = plan["steps"][kinds.index("uptrain")]
        assert row["tokens"] >= r.validated_steps()[kinds.index("uptrain")].options.tokens
    if plan["source_params"] is not None:
        assert all(row["memory"] for row in plan["steps"] if row["name"] != "push")


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_shipped_recipes_steps_are_command_lines_that_parse_back(recipe, tmp_path):
    """Each convert, check and uptrain step of a shipped recipe runs as the command line the plan shows: its flags
    parse, as the command's own (surgery cli), back into the step's options (retrieval calibration, retrieval checks,
    ...), the runner's own values (--force, --out, the teacher step's store) aside."""
    import click

    import surgery.cli as cli
    from surgery.clickgen import parse_options
    from surgery.recipes import load_recipe
    from surgery.recipes.runner import command_line, plan_steps
    from surgery.recipes.schema import _command_models

    r = load_recipe(recipe)
    for ps in plan_steps(r, tmp_path / "out"):
        if ps.kind not in ("convert", "check", "uptrain"):
            continue
        model, owned = _command_models()[ps.kind]
        name, *args = command_line(r, ps)
        ctx = cli.cli.commands[name].make_context(name, args, parent=click.Context(cli.cli, info_name="surgery"))
        with ctx:
            parsed = parse_options(model, dict(ctx.params))
        skip = {*owned, "name", "accelerate", *(["teacher_logprobs"] if ps.store is not None else [])}
        assert parsed.model_dump(exclude=skip) == ps.step.options.model_dump(exclude=skip), (recipe.stem, ps.name)


def test_gpu_recipes_dry_run_from_the_cli():
    """No GPU and no 16 GB download here: the plan is sized from the shipped config.json of each source."""
    result = surgery("run", REPO / "recipes" / "llama3-8b-gqa2.yaml", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "8.03B parameters" in result.stdout  # Llama-3-8B's parameter count, from its config on the meta device
    assert "accelerate launch (8 processes)" in result.stdout and "--gradient-checkpointing" in result.stdout
    assert "/ process" in result.stdout


BASE = {"name": "t", "source": {"id": "smollm2"}, "output": "out",
        "steps": [{"convert": {"to": "mqa"}}, {"check": {"tokens": 512}}, {"uptrain": {"tokens": 1024}}]}


def test_the_plan_counts_the_teacher_and_its_hidden_states_for_hidden_weight(tmp_path):
    """--loss lm needs no teacher, unless --hidden-weight asks for its hidden states: then the teacher's fp32
    weights (4 P) and its hidden states for one micro-batch (4 n (L + 1) H) join the estimate."""
    from surgery.recipes import load_recipe
    from surgery.recipes.plan import build_plan

    memory = {}
    for weight in (0.0, 5.0):
        data = json.loads(json.dumps(BASE))
        data["steps"][2]["uptrain"].update(loss="lm", hidden_weight=weight, seq_len=256, micro_batch=2)
        r = load_recipe(write_recipe(tmp_path / f"h{weight}.yaml", data))
        memory[weight] = build_plan(r, tmp_path / "out")["steps"][2]["memory"]
    from surgery import memory_estimate as est

    folder = resolve_source_folder("smollm2")
    config = json.loads((folder / "config.json").read_text())
    params = est.stats_from_folder(folder).params  # the teacher: the source
    states = 4 * 2 * 256 * (config["num_hidden_layers"] + 1) * config["hidden_size"]
    assert memory[5.0] - memory[0.0] == pytest.approx(4 * params + states, rel=0.01)


def test_a_check_on_several_texts_plans_and_runs_each_text(tmp_path):
    """`data: [A, B]` in a check step: the command line repeats --data, the plan counts each text's tokens."""
    from surgery.recipes import load_recipe
    from surgery.recipes.plan import build_plan
    from surgery.recipes.runner import command_line, plan_steps

    data = json.loads(json.dumps(BASE))
    data["steps"][1]["check"]["data"] = ["pydoc", "texts/*.txt"]
    r = load_recipe(write_recipe(tmp_path / "texts.yaml", data))
    assert build_plan(r, tmp_path / "out")["steps"][1]["tokens"] == 2 * 512
    line = command_line(r, plan_steps(r, tmp_path / "out")[1])
    assert line[line.index("--data"):line.index("--data") + 4] == ["--data", "pydoc", "--data", "texts/*.txt"]
    data["steps"][1]["check"]["data"] = []
    with pytest.raises(SurgeryError, match="data needs at least one text"):
        load_recipe(write_recipe(tmp_path / "none.yaml", data)).validated_steps()


def resolve_source_folder(spec: str) -> Path:
    from surgery.checkpoint.source import resolve_source

    return Path(resolve_source(spec).folder)


@pytest.mark.parametrize("change, line, fragment", [
    (lambda d: d["steps"][2]["uptrain"].update(tokens="lots"), 11, "steps[2].uptrain.tokens: Input should be a valid integer"),
    (lambda d: d["steps"][1]["check"].update(tokenz=5), 10, "steps[1].check.tokenz: unknown field"),
    (lambda d: d["steps"][0]["convert"].update(to="gqa"), 6, "steps[0].convert: to: gqa needs kv_heads"),
    (lambda d: d["steps"][0]["convert"].update(to="mha"), 7, "steps[0].convert.to: Input should be"),
    (lambda d: d["steps"].append({"deploy": {}}), 12, "steps[3].deploy: unknown step"),
    (lambda d: d["source"].update(path="x"), 2, "source: give exactly one of id, path, gguf"),
    (lambda d: d.pop("output"), 1, "output: Field required"),
])
def test_recipe_errors_point_at_the_line_and_field(tmp_path, change, line, fragment):
    from surgery.errors import SurgeryError
    from surgery.recipes import load_recipe

    data = json.loads(json.dumps(BASE))
    change(data)
    path = write_recipe(tmp_path / "r.yaml", data)
    with pytest.raises(SurgeryError) as e:
        load_recipe(path)
    assert str(e.value).startswith(f"{path}:{line}: "), (str(e.value), path.read_text())
    assert fragment in str(e.value)


def test_recipe_error_from_the_cli_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("source: {id: smollm2}\noutput: o\nsteps:\n  - convert: {to: mqa\n")
    assert_one_line_error(surgery("run", bad, "--dry-run"), f"{bad}:", "not valid YAML")
    data = json.loads(json.dumps(BASE))
    data["steps"][2]["uptrain"]["tokens"] = -1
    result = surgery("run", write_recipe(tmp_path / "neg.yaml", data), "--set", "uptrain.tokens=zero", "--dry-run")
    assert_one_line_error(result, "steps[2].uptrain.tokens")


# ---- running ---------------------------------------------------------------------------------------------
@pytest.fixture
def hub(tmp_path):
    with LocalHub(tmp_path / "hub-data", {TOKEN: USER}) as h:
        yield h


def state(out: Path) -> dict:
    return json.loads((out / "recipe-state.json").read_text())["steps"]


@pytest.mark.slow  # ~50 s
def test_run_resumes_skips_and_reruns_from_a_step(hub, tmp_path):
    paired_llama(tmp_path / "src")
    recipe = write_recipe(tmp_path / "tiny.yaml", {
        "name": "tiny-gqa2",
        "source": {"path": str(tmp_path / "src")},
        "output": str(tmp_path / "runs"),
        "steps": [
            {"convert": {"to": "gqa", "kv_heads": 2}},
            {"check": {"tokens": 256, "seq_len": 64, "expect": "exact"}},
            {"uptrain": {"data": "pydoc", "tokens": 256, "seq_len": 32, "batch_tokens": 128, "micro_batch": 2,
                         "eval_tokens": 64, "eval_every": 1, "loss": "lm"}},
            {"check": {"tokens": 256, "seq_len": 64}},
            {"push": {"repo_id": "alice/tiny-gqa2", "private": True, "exist_ok": True}},
        ]})
    env = hub_env(hub, tmp_path)
    out = tmp_path / "runs"

    first = surgery("run", recipe, env=env)
    assert first.returncode == 0, first.stderr
    assert "5 step(s) ran, 0 skipped" in first.stdout
    steps = state(out)
    assert [s for s in steps if steps[s]["finished"]] == ["convert", "check", "uptrain", "check-2", "push"]
    assert json.loads((out / "02-check.json").read_text())["exact"] is True
    pushed = json.loads((out / "05-push.json").read_text())
    repo = hub.repos["alice/tiny-gqa2"]
    assert pushed["commit_url"].endswith(repo.refs["main"])
    assert not (out / "03-uptrain" / "README.md").exists()  # the card is uploaded, not written into the folder
    card = (download(hub, "alice/tiny-gqa2", tmp_path / "dl") / "README.md").read_text()
    assert "## Uptraining" in card and "04-check-2" in card and "02-check" not in card

    # unchanged: everything skipped, nothing uploaded again
    commits = len(repo.commits)
    second = surgery("run", recipe, env=env)
    assert second.returncode == 0, second.stderr
    assert "0 step(s) ran, 5 skipped" in second.stdout and len(repo.commits) == commits

    # a state written by an earlier version (fingerprint scheme 1: every option counted, and the check reports as
    # inputs of every later step) still counts: nothing runs again, and the records are rewritten the current way
    from surgery.recipes.runner import SCHEME, Fingerprints, plan_steps, resolve_source_folder
    from surgery.recipes.schema import load_recipe

    loaded = load_recipe(recipe)
    planned = plan_steps(loaded, out.absolute())
    prints = Fingerprints(loaded, resolve_source_folder(loaded), planned)
    uptrain_step = next(ps for ps in planned if ps.kind == "uptrain")
    assert prints.of(uptrain_step, scheme=1) != prints.of(uptrain_step)  # its 02-check.json input is scheme 1's only
    old = json.loads((out / "recipe-state.json").read_text())
    for ps in planned:
        record = old["steps"][ps.name]
        record.pop("scheme")
        record["fingerprint"] = prints.of(ps, scheme=1)
    (out / "recipe-state.json").write_text(json.dumps(old))
    upgraded = surgery("run", recipe, env=env)
    assert upgraded.returncode == 0, upgraded.stderr
    assert "0 step(s) ran, 5 skipped" in upgraded.stdout and len(repo.commits) == commits
    assert all(state(out)[ps.name]["scheme"] == SCHEME and state(out)[ps.name]["fingerprint"] == prints.of(ps)
               for ps in planned)

    # --from re-runs from a step (the ones before it are finished and unchanged), here with a changed option
    third = surgery("run", recipe, "--from", "check-2", "--until", "check-2", "--set", "check-2.tokens=128", env=env)
    assert third.returncode == 0, third.stderr
    assert "1 step(s) ran, 3 skipped" in third.stdout
    assert json.loads((out / "04-check-2.json").read_text())["tokens"] == 128

    # a modified output and changed options are noticed: those steps, and the later ones that read what they
    # rewrite, would run again; the uptraining reads the converted model, not the check's report: it stays done
    (out / "02-check.json").write_text("{}")
    dry = surgery("run", recipe, "--dry-run", env=env)
    assert dry.returncode == 0, dry.stderr
    statuses = [line.split("│")[3].strip() for line in dry.stdout.splitlines() if line.startswith("│")]
    assert statuses == ["done, unchanged: skip", "run", "done, unchanged: skip", "run", "run"]
    assert json.loads((out / "02-check.json").read_text()) == {}  # a dry run changes nothing
    trained = (out / "03-uptrain" / "model.safetensors").stat().st_mtime_ns
    rerun = surgery("run", recipe, "--until", "check-2", env=env)
    assert rerun.returncode == 0, rerun.stderr
    assert "uptrain: unchanged, skipped" in rerun.stdout and "2 step(s) ran, 2 skipped" in rerun.stdout
    assert (out / "03-uptrain" / "model.safetensors").stat().st_mtime_ns == trained
    assert json.loads((out / "02-check.json").read_text())["exact"] is True
    # an option given at its default value (or added to a command later, at its default) changes nothing
    dry = surgery("run", recipe, "--dry-run", "--until", "check-2", "--set", "check-2.generate=0", env=env)
    statuses = [line.split("│")[3].strip() for line in dry.stdout.splitlines() if line.startswith("│")]
    assert statuses[:4] == ["done, unchanged: skip"] * 4

    shutil.rmtree(out / "01-convert")
    refused = surgery("run", recipe, "--from", "uptrain", env=env)
    assert_one_line_error(refused, "--from uptrain", "convert")
