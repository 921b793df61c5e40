"""Messages. The library logs through `logging.getLogger("surgery.<module>")` (`get_logger(__name__)`) and never
configures logging: a script or notebook sees surgery's warnings (Python's last-resort handler) and, after
`logging.basicConfig(level=logging.INFO)` or `surgery.logs.configure()`, its informational lines.

The command line calls `configure`: informational lines go to stdout as plain lines (where the commands have always
printed them), warnings and errors to stderr as `surgery: warning: ...`; `-q/--quiet` keeps only warnings and errors,
`-v/--verbose` adds debug lines (and the libraries' own logs, surgery/cli.py)."""

from __future__ import annotations

import logging
import sys

LOGGER = "surgery"
QUIET, NORMAL, VERBOSE = -1, 0, 1


def get_logger(name: str) -> logging.Logger:
    """The logger of a module of the package (`get_logger(__name__)`): a child of `surgery`."""
    return logging.getLogger(name if name == LOGGER or name.startswith(LOGGER + ".") else f"{LOGGER}.{name}")


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.levelno >= logging.ERROR:
            return f"surgery: error: {message}"
        if record.levelno >= logging.WARNING:
            return f"surgery: warning: {message}"
        return message


class ConsoleHandler(logging.Handler):
    """Informational lines to stdout, warnings and errors to stderr: the streams looked up when a line is written
    (so that a redirected or captured sys.stdout/sys.stderr gets it), flushed at once."""

    def __init__(self):
        super().__init__()
        self.setFormatter(_Format())

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def configure(verbosity: int = NORMAL) -> None:
    """The `surgery` logger as the command line shows it (calling it again replaces its handler, never adds one);
    the root logger is left alone (records still propagate to it, where pytest's caplog, for one, finds them)."""
    logger = logging.getLogger(LOGGER)
    for handler in [h for h in logger.handlers if isinstance(h, ConsoleHandler)]:
        logger.removeHandler(handler)
    logger.addHandler(ConsoleHandler())
    logger.setLevel({QUIET: logging.WARNING, NORMAL: logging.INFO}.get(verbosity, logging.DEBUG))
