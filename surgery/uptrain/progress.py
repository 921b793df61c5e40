"""Progress of the training loop: a tqdm bar on a terminal; when stderr is not a terminal (a log file, a pipe), a
plain line on stdout every `every_s` seconds and at the last step: steps and tokens done, tokens/s, ETA, loss."""

from __future__ import annotations

import sys
import time


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class Progress:
    def __init__(self, total_steps: int, done_steps: int, tokens_per_step: int, enabled: bool, every_s: float = 30.0,
                 stream=None, terminal: bool | None = None, data_line=None):
        self.data_line = data_line  # streamed data: a callable giving the stream's progress (tokens, shares)
        self.total, self.done, self.tokens_per_step = total_steps, done_steps, tokens_per_step
        self.every_s = every_s
        self.stream = stream or sys.stdout
        self.first_step = done_steps
        self.started = time.perf_counter()
        self.last_line = self.started
        terminal = sys.stderr.isatty() if terminal is None else terminal
        self.bar = None
        self.plain = enabled and not terminal
        if enabled and terminal:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=done_steps, desc="uptrain", unit="step", dynamic_ncols=True)

    def step(self, row: dict) -> None:
        self.done = row["step"]
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")
            if self.data_line and (self.done == self.total or time.perf_counter() - self.last_line >= self.every_s):
                self.last_line = time.perf_counter()
                self.bar.write(f"uptrain: {self.data_line()}")
            self.bar.update(1)
            return
        now = time.perf_counter()
        if self.plain and (now - self.last_line >= self.every_s or self.done == self.total):
            self.last_line = now
            rate = (self.done - self.first_step) * self.tokens_per_step / max(now - self.started, 1e-9)
            left = (self.total - self.done) * self.tokens_per_step / rate if rate > 0 else float("inf")
            print(f"uptrain: step {self.done}/{self.total}, {self.done * self.tokens_per_step:,}/"
                  f"{self.total * self.tokens_per_step:,} tokens, {rate:,.0f} tokens/s, ETA {duration(left)}, "
                  f"loss {row['loss']:.4f}" + (f"; {self.data_line()}" if self.data_line else ""),
                  file=self.stream, flush=True)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        elif self.plain:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
