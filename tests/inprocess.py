"""Running the `surgery` command line in tests: `run_cli` inside the test process (no interpreter start-up): (exit
code, stdout, stderr); `surgery` in a child process, for what needs a real process (signals, exit paths, the
environment); `assert_one_line_error` for either's refusals; `cli_args` and `uptrain_error` for uptraining's;
`launch_uptrain` for `surgery uptrain` under `accelerate launch`."""

from __future__ import annotations

import contextlib

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


class Hang(Exception):
    """The command ran past the seconds it was given."""


def fresh_general_text() -> None:
    """The default text's state as a fresh process has it: `general` not yet resolved, no line about its fallback
    owed (an earlier command in this process that resolved `general` offline and was refused before reading it would
    otherwise make a later command reading pydoc say the fallback line)."""
    from surgery import general_text

    general_text.resolve_general.cache_clear()
    general_text._FALLBACK = general_text._Fallback()


def run_cli(capsys, *args, hang_seconds: int | None = None) -> tuple[int, str, str]:
    """Run `surgery ARGS` through `cli.main` as the installed command would, each call with the state a fresh process
    starts with (fresh_general_text); with `hang_seconds`, a command still running then raises Hang (a hang is a
    failure, not a wait)."""
    import cli

    fresh_general_text()

    def alarm(signum, frame):
        raise Hang(f"`surgery {' '.join(map(str, args))}` ran longer than {hang_seconds}s")

    saved, sys.argv = sys.argv, ["surgery", *map(str, args)]
    capsys.readouterr()
    previous = signal.signal(signal.SIGALRM, alarm) if hang_seconds else None
    if hang_seconds:
        signal.alarm(hang_seconds)
    try:
        cli.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        if hang_seconds:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
        sys.argv = saved
    out, err = capsys.readouterr()
    return code, out, err


@contextlib.contextmanager
def time_limit(seconds: int):
    """A block still running after `seconds` raises Hang: a hang becomes a test failure, not a wait."""
    def alarm(signum, frame):
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def surgery(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}, timeout=300)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("surgery: error: "), result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def cli_args(options: dict) -> list[str]:
    """The command line flags of a library options dict (`progress` aside): {"seq_len": 64} -> --seq-len 64."""
    out = []
    for k, v in options.items():
        if k != "progress":
            out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def uptrain_error(monkeypatch, capsys, *args, warnings: bool = False) -> str:
    """`surgery uptrain ARGS` in this process exits 2 with exactly one error line (`warnings`: besides any warning
    lines); returns it. The default text's state starts as in a fresh process: no line owed by an earlier command
    that fell back to pydoc offline."""
    import cli

    fresh_general_text()
    monkeypatch.setattr(sys, "argv", ["surgery", "uptrain", *map(str, args)])
    with pytest.raises(SystemExit) as e:
        cli.main()
    err = capsys.readouterr().err.strip().splitlines()
    if warnings:
        err = [line for line in err if not line.startswith("surgery: warning: ")]
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("surgery: error: "), err
    return err[0]


FSDP_CPU = ["--config_file", str(REPO / "recipes/accelerate/fsdp-cpu.yaml"), "--num_processes", "2"]


def launch_uptrain(launch: list[str], args: list, **env: str) -> subprocess.CompletedProcess:
    """`accelerate launch LAUNCH -m cli uptrain ARGS` from the repository root, offline, with `env` added to the
    environment (e.g. OMP_NUM_THREADS="1"); the finished process, its output captured."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *launch, "-m", "cli", "uptrain", *map(str, args)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **env})
