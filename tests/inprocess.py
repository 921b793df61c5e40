"""The `surgery` command line run inside the test process (no interpreter start-up): (exit code, stdout, stderr)."""

from __future__ import annotations

import signal
import sys


class Hang(Exception):
    """The command ran past the seconds it was given."""


def run_cli(capsys, *args, hang_seconds: int | None = None) -> tuple[int, str, str]:
    """Run `surgery ARGS` through `cli.main` as the installed command would; with `hang_seconds`, a command still
    running then raises Hang (a hang is a failure, not a wait)."""
    import cli

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
