"""Progress of a long loop: a tqdm bar on a terminal, a plain line every few seconds when stderr is not one.

The plain line says what is done, how fast and how long is left, e.g.
`check source: 4,096/16,384 tokens (25%), 812 tokens/s, ETA 15s`. Lines come at most every
`SURGERY_PROGRESS_SECONDS` seconds (default 10) and once at the end, so a log of a 20-minute run stays short.
"""

from __future__ import annotations

import math
import sys
import time

DEFAULT_SECONDS = 10.0
_shown = True  # False under `surgery -q` (set_shown): no bar and no progress line at all


def set_shown(shown: bool) -> None:
    """Whether progress is shown at all (`surgery -q` turns it off: stderr keeps only warnings and errors)."""
    global _shown
    _shown = bool(shown)


def shown() -> bool:
    """False after `set_shown(False)` (`surgery -q`): every bar and progress line of the package stays off."""
    return _shown


def format_seconds(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def format_rate(rate: float, unit: str) -> str:
    """`812 tokens/s`, `2.5 layer/s`, or `23s each` where one unit takes longer than a second ("-" before any)."""
    if rate >= 10:
        return f"{rate:,.0f} {unit}/s"
    if rate >= 1:
        return f"{rate:.1f} {unit}/s"
    return f"{format_seconds(1 / rate)} each" if rate > 0 else f"- {unit}/s"


def interval_from_env() -> float:
    from .options import env_number

    return env_number("SURGERY_PROGRESS_SECONDS", DEFAULT_SECONDS, "seconds", maximum=86400)


def is_main_process() -> bool:
    """False in the non-zero ranks of a distributed launch (torchrun / accelerate set RANK): one bar per run."""
    import os

    return os.environ.get("RANK", "0").strip() in ("", "0")


class Progress:
    """`with Progress(total, "check source") as p: ... p.update(n)` — a tqdm bar when the output is a terminal,
    else plain lines (`line()`) at most every `every` seconds and at the end; main process only; none at all after
    `set_shown(False)` (`surgery -q`).

    `stream` receives the plain lines; the bar goes to `stream` when it is a terminal, else to stderr (`terminal`
    says whether the output is one, when the caller knows better). Subclasses change `line()`."""

    def __init__(self, total: int, desc: str, unit: str = "tokens", enabled: bool = True,
                 every: float | None = None, stream=None, initial: int = 0, terminal: bool | None = None):
        self.total, self.desc, self.unit = int(total), desc, unit
        self.stream = stream if stream is not None else sys.stderr
        self.every = interval_from_env() if every is None else every
        self.done = self.first = int(initial)
        self.start = self.last = time.monotonic()
        self.bar = None
        self.plain = False
        if enabled and _shown and self.total > 0 and is_main_process():
            if terminal is None:
                terminal = getattr(self.stream, "isatty", lambda: False)()
            if terminal:
                from tqdm import tqdm

                file = self.stream if getattr(self.stream, "isatty", lambda: False)() else sys.stderr
                self.bar = tqdm(total=self.total, initial=self.done, desc=desc, unit=unit, unit_scale=True,
                                dynamic_ncols=True, leave=False, file=file)
            else:
                self.plain = True

    def update(self, n: int = 1, postfix: dict | None = None) -> None:
        """`n` more done; `postfix` (name -> text) shown after the bar."""
        self.done += n
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(n)
        elif self.plain and self.due():
            print(self.line(self.last), file=self.stream, flush=True)

    def due(self, done: int | None = None) -> bool:
        """Whether `every` seconds have passed since the last line (or all is `done`); if so, the clock restarts."""
        now = time.monotonic()
        if now - self.last >= self.every or (self.done if done is None else done) >= self.total:
            self.last = now
            return True
        return False

    def rate(self, now: float | None = None) -> float:
        """Units per second since the start (counting from `initial`)."""
        elapsed = (now if now is not None else time.monotonic()) - self.start
        return (self.done - self.first) / elapsed if elapsed > 0 else 0.0

    def line(self, now: float | None = None) -> str:
        rate = self.rate(now)
        eta = (self.total - self.done) / rate if rate > 0 else math.inf
        percent = 100 * self.done / self.total if self.total else 100.0
        return (f"{self.desc}: {self.done:,}/{self.total:,} {self.unit} ({percent:.0f}%), "
                f"{format_rate(rate, self.unit)}, ETA {format_seconds(eta)}")

    def write(self, line: str) -> None:
        """A message between progress updates (above the bar on a terminal); nothing when progress is off."""
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        elif self.plain:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
