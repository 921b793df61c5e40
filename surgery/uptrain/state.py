"""Checkpoints of a running uptraining: accelerate's `save_state` (model, optimizer, RNG states) plus the run's
position (`RunState`: the step, which fixes the data position and the learning rate), written atomically.

Each checkpoint is saved into `checkpoints/.tmp-step-NNNNNNNN`, flushed to disk, and renamed to
`checkpoints/step-NNNNNNNN` only when complete; a run killed at any moment leaves either the previous set of
checkpoints or the new one, plus at most a temporary folder that the next start removes. The last K are kept.
All processes call `save`; only the main process creates, renames and removes folders.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from ..errors import SurgeryError

STEP_DIR = re.compile(r"^step-(\d{8})$")


class RunState:
    """The run's position, saved with every checkpoint (registered with `accelerator.register_for_checkpointing`)."""

    def __init__(self):
        self.step = 0  # optimizer steps done
        self.elapsed = 0.0  # training seconds so far (excluding evaluation and saving)
        self.data_key = ""  # which packed data the steps index into

    def state_dict(self) -> dict:
        return {"step": self.step, "elapsed": self.elapsed, "data_key": self.data_key}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.elapsed, self.data_key = int(state["step"]), float(state["elapsed"]), state["data_key"]


def _fsync_tree(folder: Path) -> None:
    for root, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Checkpoints:
    def __init__(self, run_dir: Path, keep_last: int, accelerator):
        self.dir = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last
        self.acc = accelerator

    def steps(self) -> list[tuple[int, Path]]:
        if not self.dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.dir.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
        return sorted(found)

    def latest(self) -> Path | None:
        steps = self.steps()
        return steps[-1][1] if steps else None

    def remove_partial(self) -> None:
        """Drop temporary folders a killed run left behind (main process)."""
        if self.acc.is_main_process and self.dir.is_dir():
            for p in self.dir.glob(".tmp-step-*"):
                shutil.rmtree(p, ignore_errors=True)

    def save(self, step: int) -> Path:
        final = self.dir / f"step-{step:08d}"
        tmp = self.dir / f".tmp-step-{step:08d}"
        if self.acc.is_main_process:
            self.dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        self.acc.wait_for_everyone()
        self.acc.save_state(str(tmp))
        self.acc.wait_for_everyone()
        if self.acc.is_main_process:
            _fsync_tree(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.dir)
            for _, old in self.steps()[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        self.acc.wait_for_everyone()
        return final

    def load_latest(self) -> Path:
        path = self.latest()
        if path is None:
            raise SurgeryError(f"--resume: no checkpoint in {self.dir}")
        self.acc.load_state(str(path))
        return path
