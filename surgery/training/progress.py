"""Progress of the training loop: surgery/progress.py's bar or plain lines, one per optimizer step. When stderr is not
a terminal (a log file, a pipe), a plain line on stdout every `every_s` seconds and at the last step: steps and tokens
done, tokens/s, ETA, loss."""

from __future__ import annotations

import sys

from ..progress import Progress as _Progress
from ..progress import format_rate, format_seconds


class Progress(_Progress):
    """Steps of an uptraining run, resumed at `done_steps`; `data_line` (streamed data) a callable giving the
    stream's progress (tokens, shares), added to the plain lines and written above the bar every `every_s`."""

    def __init__(self, total_steps: int, done_steps: int, tokens_per_step: int, enabled: bool, every_s: float = 30.0,
                 stream=None, terminal: bool | None = None, data_line=None):
        self.data_line = data_line
        self.tokens_per_step = tokens_per_step
        self.loss = float("nan")
        super().__init__(total_steps, "uptrain", unit="step", enabled=enabled, every=every_s,
                         stream=stream or sys.stdout, initial=done_steps,
                         terminal=sys.stderr.isatty() if terminal is None else terminal)

    def step(self, row: dict) -> None:
        self.loss = row["loss"]
        n = row["step"] - self.done
        if self.bar is not None and self.data_line and self.due(row["step"]):
            self.write(f"uptrain: {self.data_line()}")
        self.update(n, {"loss": f"{row['loss']:.4f}", "tok_s": f"{row['tokens_per_s']:.0f}"})

    def line(self, now: float | None = None) -> str:
        rate = self.rate(now) * self.tokens_per_step
        left = (self.total - self.done) * self.tokens_per_step / rate if rate > 0 else float("inf")
        return (f"uptrain: step {self.done}/{self.total}, {self.done * self.tokens_per_step:,}/"
                f"{self.total * self.tokens_per_step:,} tokens, {format_rate(rate, 'tokens')}, ETA {format_seconds(left)}, "
                f"loss {self.loss:.4f}" + (f"; {self.data_line()}" if self.data_line else ""))
