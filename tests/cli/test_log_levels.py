"""Messages go through `logging` (loggers under `surgery`): the library configures nothing, the command line shows
informational lines on stdout and warnings on stderr, `-q` keeps only warnings, errors and results, `-v` adds debug."""

from __future__ import annotations

import json
import logging

from surgery.testing.pydoc_llama import FAST

from inprocess import cli_args

ARGS = cli_args(dict(FAST, loss="lm", tokens=512 * 2))  # 2 steps: the "too few steps" warning too


def test_uptrain_informs_on_stdout_warns_on_stderr_and_quiet_keeps_only_the_warning(cli, tiny, tmp_path):
    code, out, err = cli("uptrain", tiny, "--out", tmp_path / "a", *ARGS)
    assert code == 0, err
    assert any(line.startswith("uptrain: lm loss, training ") for line in out.splitlines()), out
    assert any(line.startswith(f"wrote {tmp_path / 'a'}: ") for line in out.splitlines()), out
    warnings = [line for line in err.splitlines() if line.startswith("surgery: warning: --tokens 1024 ")]
    assert len(warnings) == 1, err
    code, out, err = cli("-q", "uptrain", tiny, "--out", tmp_path / "b", *ARGS)
    assert code == 0, err
    assert "uptrain: lm loss" not in out and "wrote " not in out and (tmp_path / "b" / "model.safetensors").exists()
    assert [line for line in err.splitlines() if line.startswith("surgery: warning: --tokens 1024 ")] == warnings


def test_quiet_leaves_stderr_to_warnings_and_errors(cli, tiny, tmp_path):
    """Under -q, uptraining's held-out lines (they went around logging) and every progress bar or line (surgery's,
    transformers' "Loading weights", datasets' "Generating train split") stay off, for that command only: what runs
    after it in the same process shows its progress again."""
    from surgery import progress
    from surgery.data import pydoc_texts

    data = tmp_path / "text.jsonl"  # a new file: datasets generates its split (its bar) rather than reading a cache
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in list(pydoc_texts())[:40]))
    code, out, err = cli("-q", "uptrain", tiny, "--out", tmp_path / "up", *cli_args(dict(FAST, loss="lm",
                         tokens=512 * 2, eval_tokens=1024, data=data)))
    assert code == 0, err
    assert out == "" and (tmp_path / "up" / "model.safetensors").exists()
    assert [line for line in err.splitlines() if not line.startswith("surgery: warning: --tokens 1024 ")] == [], err
    check = ("check", tiny, tmp_path / "up", "--tokens", "128", "--seq-len", "64")
    code, out, err = cli("-q", *check)
    assert code == 0 and err == "" and "top-1 agreement" in out, err
    assert progress.shown()  # -q held for its command: the API and later commands in this process show progress
    code, out, err = cli(*check)
    assert code == 0 and "check source: 128/128 tokens" in err, err


def test_verbose_and_quiet_together_are_refused(cli):
    code, out, err = cli("-v", "-q", "inspect", "nothing")
    assert code == 2 and "-v/--verbose and -q/--quiet contradict each other" in err


def test_the_library_configures_no_logging_and_its_records_reach_callers(tiny, tmp_path, caplog):
    from surgery.training import UptrainOptions, uptrain

    logging.getLogger("surgery").handlers.clear()  # as in a fresh interpreter, whatever the command line set up here
    logging.getLogger("surgery").setLevel(logging.NOTSET)
    root_handlers = list(logging.getLogger().handlers)
    with caplog.at_level(logging.INFO, logger="surgery"):
        uptrain(UptrainOptions(model=str(tiny), out=tmp_path / "o", **(FAST | dict(loss="lm", tokens=512 * 2))))
    assert logging.getLogger().handlers == root_handlers and not logging.getLogger("surgery").handlers
    by_level = {(r.name, r.levelname, r.getMessage().split(",")[0]) for r in caplog.records}
    assert ("surgery.training.loop", "INFO", "uptrain: lm loss") in by_level
    assert any(r.levelname == "WARNING" and r.getMessage().startswith("--tokens 1024 with --batch-tokens 512")
               for r in caplog.records)
