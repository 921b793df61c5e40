"""`dry_run=True` in the Python API: `surgery.convert`, `surgery.uptrain` and `surgery.run_recipe` return what
`--dry-run` prints (the estimates, the plan) and run and write nothing; the command line prints the same thing through
them."""

from __future__ import annotations

import json

import pytest
import yaml

import surgery


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    import surgery.checkpoint.source as source

    monkeypatch.setattr(source, "CACHE_DIR", tmp_path / "cache")


def test_convert_dry_run_returns_the_estimate_and_numbers_the_command_prints_and_writes(cli, tiny, tmp_path):
    estimate = surgery.convert(tiny, tmp_path / "o", to="mqa", dry_run=True)
    assert isinstance(estimate, surgery.Estimate) and not (tmp_path / "o").exists()
    assert estimate.lines[0].startswith(f"{tiny}: llama, ") and estimate.kind == "mqa" and not estimate.calibrated
    assert 0 < estimate.checkpoint_bytes < estimate.host_bytes
    code, out, err = cli("convert", tiny, "--to", "mqa", "--dry-run", "--json", tmp_path / "e.json")
    assert code == 0, err
    assert out == str(estimate) + "\n"
    assert json.loads((tmp_path / "e.json").read_text()) == {k: v for k, v in estimate.items() if k != "lines"}
    with pytest.raises(surgery.SurgeryError, match="^convert needs out"):
        surgery.convert(tiny, to="mqa")


def test_uptrain_dry_run_returns_the_estimate_the_command_prints_and_writes_nothing(cli, tiny, tmp_path):
    estimate = surgery.uptrain(tiny, tmp_path / "o", dry_run=True, tokens=1024, loss="kd", teacher=str(tiny))
    assert isinstance(estimate, surgery.Estimate)
    assert estimate.lines[0].startswith(f"{tiny}: ") and f"teacher {tiny}" in estimate.lines[0]
    assert "memory per process (1 process):" in [line.strip() for line in estimate.lines]
    assert any(line.strip().startswith("host memory: peak ") for line in estimate.lines)
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.run").exists()
    code, out, err = cli("uptrain", tiny, "--tokens", "1024", "--loss", "kd", "--teacher", tiny, "--dry-run")
    assert code == 0, err
    assert out == str(estimate) + "\n"
    # the options' rules hold in a dry run too; a run still needs its output folder
    with pytest.raises(surgery.SurgeryError, match="--batch-tokens 500 must be a multiple of --seq-len 64"):
        surgery.uptrain(tiny, dry_run=True, tokens=1024, seq_len=64, batch_tokens=500)
    with pytest.raises(surgery.SurgeryError, match="^uptrain needs out"):
        surgery.uptrain(tiny, tokens=1024)


def test_run_recipe_dry_run_returns_the_plan_the_command_prints_and_runs_nothing(cli, tiny, tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"source": {"path": str(tiny)}, "output": str(tmp_path / "out"),
                                      "steps": [{"convert": {"to": "mqa"}},
                                                {"check": {"tokens": 128, "seq_len": 64}}]}))
    plan = surgery.run_recipe(recipe, dry_run=True)
    assert isinstance(plan, surgery.RecipePlan)
    assert [(s["name"], s["status"]) for s in plan.steps] == [("convert", "run"), ("check", "run")]
    assert plan.steps[0]["command"].startswith("surgery convert ") and not (tmp_path / "out").exists()
    capsys.readouterr()
    plan.show()
    shown = capsys.readouterr().out
    code, out, err = cli("run", recipe, "--dry-run")
    assert code == 0, err
    assert out == shown and "commands:" in out

    assert surgery.run_recipe(recipe).steps == [("convert", "ran"), ("check", "ran")]
    again = surgery.run_recipe(recipe, dry_run=True, overrides=["check.tokens=192"])
    assert [s["status"] for s in again.steps] == ["done, unchanged: skip", "run"]
