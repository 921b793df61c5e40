"""metrics.jsonl: one JSON object per line, written by the main process only.

Training lines: step, tokens, loss (and its lm/kd terms), lr, grad_norm, tokens_per_s, elapsed.
Evaluation lines: step, tokens, eval_loss, eval_ppl (and teacher_eval_ppl once, at the start, with a teacher).
"""

from __future__ import annotations

import json
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


class MetricsLog:
    def __init__(self, path: Path, enabled: bool):
        self.path = Path(path)
        self.enabled = enabled

    def start(self, resumed_step: int | None) -> None:
        """Fresh run: empty the file. Resumed run: keep only lines up to the checkpoint's step."""
        if not self.enabled:
            return
        kept = [m for m in read_metrics(self.path) if m.get("step", 0) <= resumed_step] if resumed_step is not None else []
        self.path.write_text("".join(json.dumps(m) + "\n" for m in kept))

    def write(self, **fields) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps({k: (float(f"{v:.7g}") if isinstance(v, float) else v) for k, v in fields.items()}) + "\n")

    def read(self) -> list[dict]:
        return read_metrics(self.path)
