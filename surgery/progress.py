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


def interval_from_env() -> float:
    from .options import env_number

    return env_number("SURGERY_PROGRESS_SECONDS", DEFAULT_SECONDS, "seconds", maximum=86400)


class Progress:
    """`with Progress(total, "check source") as p: ... p.update(n)` — a bar or plain lines on stderr."""

    def __init__(self, total: int, desc: str, unit: str = "tokens", enabled: bool = True,
                 every: float | None = None, stream=None):
        self.total, self.desc, self.unit = int(total), desc, unit
        self.stream = stream if stream is not None else sys.stderr
        self.every = interval_from_env() if every is None else every
        self.done = 0
        self.start = self.last = time.monotonic()
        self.bar = None
        self.plain = False
        if enabled and self.total > 0:
            if getattr(self.stream, "isatty", lambda: False)():
                from tqdm import tqdm

                self.bar = tqdm(total=self.total, desc=desc, unit=unit, unit_scale=True, dynamic_ncols=True,
                                leave=False, file=self.stream)
            else:
                self.plain = True

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.plain:
            now = time.monotonic()
            if now - self.last >= self.every or self.done >= self.total:
                self.last = now
                print(self.line(now), file=self.stream, flush=True)

    def line(self, now: float | None = None) -> str:
        elapsed = (now if now is not None else time.monotonic()) - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else math.inf
        percent = 100 * self.done / self.total if self.total else 100.0
        return (f"{self.desc}: {self.done:,}/{self.total:,} {self.unit} ({percent:.0f}%), "
                f"{rate:,.0f} {self.unit}/s, ETA {format_seconds(eta)}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
