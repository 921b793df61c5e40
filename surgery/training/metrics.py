"""metrics.jsonl: one JSON object per line, written by the main process only.

Training lines: step, tokens, loss (and its lm/kd terms), lr, grad_norm, tokens_per_s, elapsed.
Evaluation lines: step, tokens, eval_loss, eval_ppl, with --eval-data other_eval_loss and other_eval_ppl (and
teacher_eval_ppl / teacher_other_eval_ppl once, at the start, with a teacher).
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def read_metrics(path: Path) -> list[dict]:
    if not Path(path).exists():
        return []
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut short by a kill
            break
    return out


def _number(v):
    """Floats to 7 significant digits; a non-finite one (which JSON cannot hold) as null."""
    if isinstance(v, float):
        return float(f"{v:.7g}") if math.isfinite(v) else None
    return v


class MetricsLog:
    """metrics.jsonl, and the same lines sent to the run's experiment trackers (`tracker`: an Accelerator with
    trackers; surgery/training/trackers.py)."""

    def __init__(self, path: Path, enabled: bool, tracker=None):
        self.path = Path(path)
        self.enabled = enabled
        self.tracker = tracker

    def start(self, resumed_step: int | None) -> None:
        """Fresh run: empty the file. Resumed run: keep only lines up to the checkpoint's step."""
        if not self.enabled:
            return
        from ..checkpoint.atomic import write_text_atomic

        kept = [m for m in read_metrics(self.path) if m.get("step", 0) <= resumed_step] if resumed_step is not None else []
        # a new file renamed into place: never written through a link (a hard link's other name keeps its bytes)
        write_text_atomic(self.path, "".join(json.dumps(m) + "\n" for m in kept), "metrics.jsonl")

    def write(self, **fields) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps({k: _number(v) for k, v in fields.items()}, allow_nan=False) + "\n")
            if self.tracker is not None:
                from .trackers import tracker_values

                values, step = tracker_values(fields)
                self.tracker.log(values, step=step)

    def read(self) -> list[dict]:
        return read_metrics(self.path)
