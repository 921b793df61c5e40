"""A recipe's messages go through `logging` (the runner's and its steps' lines): `surgery run` shows them on stdout,
`-q` keeps only the results (a check's report, the `recipe done` line) and the errors; the Python API's caller sees
them as records."""

from __future__ import annotations

import logging

import yaml

import surgery


def write_recipe(path, tiny, output, expect="none", convert=None):
    path.write_text(yaml.safe_dump({"source": {"path": str(tiny)}, "output": str(output),
                                    "steps": [{"convert": convert or {"to": "mqa"}},
                                              {"check": {"tokens": 128, "seq_len": 64, "expect": expect}}]}))
    return path


def test_quiet_keeps_the_results_and_errors_of_a_recipe(cli, tiny, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", tiny, tmp_path / "loud")
    code, out, err = cli("run", recipe)
    assert code == 0, err
    lines = out.splitlines()
    assert "[1/2] convert" in lines and "[2/2] check" in lines
    assert any(line.startswith("$ surgery convert ") for line in lines)
    assert any(line.startswith(f"wrote {tmp_path / 'loud' / '01-convert'}: mqa") for line in lines)
    assert lines[-1] == f"recipe done: 2 step(s) ran, 0 skipped; outputs in {tmp_path / 'loud'}"

    quiet = write_recipe(tmp_path / "q.yaml", tiny, tmp_path / "quiet", expect="exact")
    code, out, err = cli("-q", "run", quiet)
    assert code == 1
    assert not [line for line in out.splitlines() if line.startswith(("[", "$ surgery", "wrote "))], out
    assert sum("top-1 agreement" in line for line in out.splitlines()) == 1  # the check's report: its result
    errors = [line for line in err.splitlines() if line.startswith("surgery: error: ")]
    assert errors[0].startswith("surgery: error: not exact: max |Δlogits| ") and len(errors) == 2
    assert errors[1] == "surgery: error: step check failed (exit 1)"


def test_the_api_s_caller_sees_a_recipe_s_messages_and_warnings_as_records(tiny, tmp_path, caplog, capsys):
    caplog.set_level(logging.INFO, logger="surgery")
    calibrated = {"to": "mqa", "merge": "aligned", "calib": "pydoc", "calib_tokens": 256, "device": "cpu"}
    result = surgery.run_recipe(write_recipe(tmp_path / "r.yaml", tiny, tmp_path / "out", convert=calibrated))
    assert result.steps == [("convert", "ran"), ("check", "ran")]
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert "[1/2] convert" in said and any(m.startswith("$ surgery check ") for m in said)
    assert any(m.startswith(f"wrote {tmp_path / 'out' / '01-convert'}: mqa") for m in said)
    # the check step's warning (its only text calibrated the model) is a record too, not a line printed past logging
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage().split(",")[0] for r in warned] == ["pydoc"]
    assert "the text the model was calibrated on" in warned[0].getMessage()
