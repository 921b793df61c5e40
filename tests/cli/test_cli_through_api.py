"""The command line is a thin layer over the Python API, not beside it: `surgery convert`, `check`, `uptrain`, `push`
and `run` call surgery.api's function of the same name with the options they parsed (`convert`, `check` and
`uptrain`: the command's options model, built once from the options the user gave; the others by field name), and
what that function logs is what the command prints, once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import surgery.api
from surgery.api import CheckReport, RecipeResult
from surgery.commands.check import CheckFailed


def recorded(monkeypatch, name: str, returns=None, raises=None) -> list:
    """surgery.api.NAME replaced by a stand-in that records its arguments (and returns or raises)."""
    calls = []

    def stand_in(*args, **kwargs):
        calls.append((args, kwargs))
        if raises is not None:
            raise raises
        return returns

    monkeypatch.setattr(surgery.api, name, stand_in)
    return calls


@pytest.mark.parametrize("name, args, positional, given", [
    ("convert", ["convert", "SRC", "--to", "gqa", "--kv-heads", "1", "--merge", "aligned", "--calib", "pydoc",
                 "--calib", "notes.txt", "--out", "OUT"],
     ("SRC", Path("OUT")), {"to": "gqa", "kv_heads": 1, "merge": "aligned", "calib": ["pydoc", "notes.txt"]}),
    ("check", ["check", "SRC", "CONV", "--data", "pydoc", "--data", "notes.txt", "--tokens", "128", "--expect",
               "exact", "--json", "r.json"],
     ("SRC", "CONV"), {"data": ["pydoc", "notes.txt"], "tokens": 128, "expect": "exact", "json_out": Path("r.json"),
                       "show": True}),
    ("uptrain", ["uptrain", "MODEL", "--out", "OUT", "--tokens", "1024", "--loss", "lm"],
     ("MODEL", Path("OUT")), {"tokens": 1024, "loss": "lm"}),
    ("push", ["push", "FOLDER", "alice/tiny", "--private", "--check-report", "a.json", "--check-report", "b.json",
              "--json", "p.json"],
     (Path("FOLDER"), "alice/tiny"), {"private": True, "check_reports": [Path("a.json"), Path("b.json")],
                                      "json_out": Path("p.json")}),
    ("run_recipe", ["run", "r.yaml", "--output", "OUT", "--from", "convert", "--until", "check", "--set",
                    "uptrain.tokens=64"],
     (Path("r.yaml"),), {"output": Path("OUT"), "from_step": "convert", "until": "check",
                         "overrides": ("uptrain.tokens=64",), "dry_run": False}),
])
def test_each_command_calls_the_api_function_with_the_options_it_parsed(cli, monkeypatch, name, args, positional,
                                                                        given):
    steps = [("convert", "ran"), ("check", "skipped")]
    calls = recorded(monkeypatch, name, returns=RecipeResult(Path("OUT"), steps) if name == "run_recipe" else None)
    code, out, err = cli(*args)
    assert code == 0, err
    assert len(calls) == 1
    called_args, called = calls[0]
    if name in ("convert", "check", "uptrain"):  # one options model, holding exactly the options given (and their
        # values)
        *called_args, options = called_args
        assert options.model_fields_set == {k for k in given if k in type(options).model_fields}
        called = called | options.model_dump(include=options.model_fields_set)
    assert tuple(called_args) == positional
    assert {k: called[k] for k in given} == given
    if name == "run_recipe":  # the run's own options are the function's keywords, nothing else
        assert set(called) == set(given) and out == "recipe done: 1 step(s) ran, 1 skipped; outputs in OUT\n"
        return
    # everything else the command passes is an option of the command's own model, at its default
    from surgery.commands.check import CheckOptions
    from surgery.commands.convert import options_model
    from surgery.commands.push import PushOptions
    from surgery.commands.uptrain import UptrainArgs

    model = {"convert": options_model(), "check": CheckOptions, "uptrain": UptrainArgs, "push": PushOptions}[name]
    own = {"json_out", "show", "check_reports"}
    assert set(called) - own <= set(model.model_fields)


def test_the_api_s_errors_are_the_command_s_error_line_and_exit_code(cli, monkeypatch):
    recorded(monkeypatch, "check", raises=CheckFailed("not exact: max |Δlogits| 0.5 > tolerance 1e-05"))
    code, out, err = cli("check", "SRC", "CONV", "--expect", "exact")
    assert code == 1 and err.strip() == "surgery: error: not exact: max |Δlogits| 0.5 > tolerance 1e-05"
    recorded(monkeypatch, "push", raises=surgery.api.SurgeryError("repo id 'x' must be of the form owner/name"))
    code, out, err = cli("push", "FOLDER", "alice/x")
    assert code == 2 and err.strip() == "surgery: error: repo id 'x' must be of the form owner/name"


def test_convert_and_check_print_their_lines_once_and_quiet_keeps_the_report(cli, tiny, tmp_path):
    code, out, err = cli("convert", tiny, "--to", "mqa", "--out", tmp_path / "mqa")
    assert code == 0, err
    assert [line for line in out.splitlines() if line.startswith("wrote ")] == [
        f"wrote {tmp_path / 'mqa'}: mqa (2 -> 1 K/V heads, mean merge) in " + out.split(" in ", 1)[1].strip()]
    code, out, err = cli("-q", "convert", tiny, "--to", "mqa", "--out", tmp_path / "quiet")
    assert code == 0 and out == "" and (tmp_path / "quiet" / "surgery.json").is_file()

    # the report is the command's result: printed under -q too, and before --expect exact is judged
    code, out, err = cli("-q", "check", tiny, tmp_path / "mqa", "--tokens", "128", "--seq-len", "64", "--expect",
                         "exact", "--json", tmp_path / "r.json")
    assert code == 1 and err.splitlines()[-1].startswith("surgery: error: not exact: max |Δlogits| "), err
    report = CheckReport(json.loads((tmp_path / "r.json").read_text()))
    assert report.tokens == 128 and report.exact is False
    rows = [line for line in out.splitlines() if "top-1 agreement" in line]
    assert len(rows) == 1 and f"{100 * report.top1_agreement:.2f}%" in rows[0]
