"""Streamed training data, one reader over every source: each source's windows read in blocks of BLOCK_TOKENS tokens
and handed out in a seeded order (so a step's windows come from many documents), the source of each next window
picked by weight with the reader's own seeded generator; its state (per source, where the current block began, the
block's number and how many of its windows were handed out, plus the generator's state), and the check of a saved
one.
"""

from __future__ import annotations

import numpy as np

from ..errors import SurgeryError
from .stream_packing import Sequential
from .stream_sources import Plan

BLOCK_TOKENS = 1 << 18  # a reader's windows are shuffled within blocks of this many tokens (1 MiB of int32)


class Reader:
    """One reader over every source: each window's source drawn by weight with the reader's own generator."""

    def __init__(self, plan: Plan, role: int, state: dict | None):
        self.plan, self.role = plan, role
        state = state or {}
        positions = state.get("sources") or [None] * len(plan.sources)
        self.sources = [SourceReader(plan, s, role, positions[s]) for s in range(len(plan.sources))]
        self.windows = [int(c) for c in state.get("windows", [0] * len(plan.sources))]
        self.rng = np.random.default_rng([plan.seed, role, 0x5eed])
        if "rng" in state:
            self.rng.bit_generator.state = state["rng"]
        self.cumulative = np.cumsum([s.weight for s in plan.sources])

    def state(self) -> dict:
        return {"sources": [s.position() for s in self.sources], "windows": list(self.windows),
                "rng": self.rng.bit_generator.state}

    def __iter__(self):
        while True:
            s = 0
            if len(self.sources) > 1:
                s = min(int(np.searchsorted(self.cumulative, self.rng.random() * self.cumulative[-1], side="right")),
                        len(self.sources) - 1)
            window = self.sources[s].window()
            self.windows[s] += 1
            yield window, s


class SourceReader:
    """One reader's windows of one source, shuffled within blocks: the next `block` windows in document order are
    read (BLOCK_TOKENS tokens, a constant whatever --tokens) and handed out in a seeded order, so that a step's
    windows come from many documents, as the packed path's shuffled windows do. The position is the document
    position where the block began, the block's number and how many of its windows were handed out: a resumed
    reader reads the block again and skips those."""

    def __init__(self, plan: Plan, s: int, role: int, position: dict | None):
        self.plan, self.s, self.role = plan, s, role
        pos = position or {}
        self.seq = Sequential(plan, s, role, pos.get("start"))
        self.start = self.seq.position()
        self.block_index, self.emitted = int(pos.get("block", 0)), int(pos.get("emitted", 0))
        self.size = max(1, BLOCK_TOKENS // plan.seq_len)
        self.windows: list[np.ndarray] | None = None
        self.dry: SurgeryError | None = None  # the source ran dry (or failed) while a block was read

    def position(self) -> dict:
        return {"start": self.start, "block": self.block_index, "emitted": self.emitted,
                "skipped": self.seq.skipped, "tokens": self.seq.tokens}

    def _fill(self) -> None:
        if self.dry is not None:
            raise self.dry
        self.start, windows = self.seq.position(), []
        try:
            while len(windows) < self.size:
                windows.append(self.seq.window())
        except SurgeryError as e:
            self.dry = e
            if not windows:
                raise
        self.windows = windows
        self.order = np.random.default_rng([self.plan.seed, self.s, self.role, self.block_index]).permutation(
            len(windows))

    def window(self) -> np.ndarray:
        if self.windows is None:
            self._fill()  # a fresh reader, or a resumed one: its block read again (`emitted` already handed out)
        if self.emitted >= len(self.windows):
            self.block_index, self.emitted = self.block_index + 1, 0
            self._fill()
        self.emitted += 1
        return self.windows[self.order[self.emitted - 1]]


def check_state(state, plan: Plan) -> None:
    """A saved reader state of the right shape (numbers where numbers belong), else one line."""
    try:
        positions = state["sources"]
        if len(positions) != len(plan.sources) or len(state["windows"]) != len(plan.sources):
            raise ValueError("one entry per source expected")
        for p in positions:
            for q, keys in ((p, ("block", "emitted")), (p["start"], ("epoch", "doc", "offset", "skipped", "tokens"))):
                for k in keys:
                    if not isinstance(q[k], int) or isinstance(q[k], bool) or q[k] < 0:
                        raise ValueError(f"{k} is not a count")
            if p["start"]["epoch"] >= plan.epochs or p["emitted"] > max(1, BLOCK_TOKENS // plan.seq_len):
                raise ValueError("an epoch beyond --data-epochs, or more windows than a block holds")
        if not all(isinstance(c, int) and c >= 0 for c in state["windows"]):
            raise ValueError("windows are not counts")
        np.random.default_rng().bit_generator.state = state["rng"]
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise SurgeryError(f"--resume: the data position in the checkpoint is not valid ({e})") from None
