"""Streamed training data: documents read lazily, tokenized on the fly (in DataLoader workers), packed into windows.

Nothing here grows with `--tokens`: a reader holds one batch of documents and one window at a time, and the run's
data position is a few integers per source and reader, saved as JSON in every checkpoint.

- `stream_sources.py`  the sources (`--data`, `--data-weights`), their units and documents, the readers' Plan.
- `stream_held_out.py` the first documents of every source, held out for evaluation.
- `stream_packing.py`  one reader's part of one source, tokenized and packed into windows in document order.
- `stream_readers.py`  one reader over every source: blocks shuffled, sources mixed by weight; its saved state.
- this module          a process's readers in DataLoader workers, and the process's position in the stream.

Readers. A run has R = processes x max(1, --data-workers) readers; reader `role` reads a disjoint part of every
source (stream_packing.py) and hands its windows out block by block, mixing the sources (stream_readers.py).

Order. Process `rank` reads its readers through a torch DataLoader, which takes items from workers 0, 1, .., W-1,
0, .. in turn; each optimizer step takes the process's next B/processes windows. A resumed process that had read
`c` windows starts its worker `j` as reader `(j + c) mod W`, so the round continues where it stopped: a resumed run
reads exactly the windows the uninterrupted one would have.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import SurgeryError
from .stream_readers import Reader, check_state
from .stream_sources import Plan

STATE_FILE = "data-{rank}.json"  # a process's data position, in each checkpoint folder


class WindowStream(torch.utils.data.IterableDataset):
    """The readers of one process, one per DataLoader worker (rotated on resume: see the module's docstring)."""

    def __init__(self, plan: Plan, rank: int, workers: int, states: dict[int, dict], rotation: int):
        self.plan, self.rank, self.workers, self.states, self.rotation = plan, rank, workers, states, rotation

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        local = ((info.id if info else 0) + self.rotation) % max(1, self.workers)
        role = self.rank * max(1, self.workers) + local
        reader = Reader(self.plan, role, self.states.get(role))
        try:
            for window, s in reader:
                # bytes and plain containers: cheap to pass from a worker (a tensor would go through shared memory)
                yield {"ids": window.tobytes(), "source": s, "role": role, "state": reader.state()}
        except SurgeryError as e:  # a worker's exception would reach the main process with its traceback as text
            yield {"error": str(e)}


@dataclass
class StreamedData:
    """The training windows of one process, streamed; held-out windows in memory (they do not grow with --tokens)."""
    plan: Plan
    eval: torch.Tensor
    rank: int
    world: int
    workers: int
    other: torch.Tensor | None = None
    consumed: int = 0  # windows this process has taken
    states: dict = field(default_factory=dict)  # reader role -> its state after the last window taken
    _it: object = None

    @property
    def seq_len(self) -> int:
        return self.plan.seq_len

    def _loader(self):
        if self._it is None:
            rotation = self.consumed % max(1, self.workers)
            stream = WindowStream(self.plan, self.rank, self.workers,
                                  {int(k): v for k, v in self.states.items()}, rotation)
            loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=self.workers,
                                                 prefetch_factor=4 if self.workers else None,
                                                 multiprocessing_context="fork" if self.workers else None)
            self._it = iter(loader)
        return self._it

    def take(self, count: int) -> torch.Tensor:
        """This process's next `count` windows, [count, seq_len] int64."""
        rows = []
        for _ in range(count):
            item = next(self._loader())
            if "error" in item:
                raise SurgeryError(item["error"])
            rows.append(torch.from_numpy(np.frombuffer(item["ids"], dtype=np.int32).astype(np.int64)))
            self.states[int(item["role"])] = item["state"]
            self.consumed += 1
        return torch.stack(rows)

    def step_batch(self, step: int, sequences_per_step: int, rank: int, world: int) -> torch.Tensor:
        return self.take(sequences_per_step // world)

    def state_dict(self) -> dict:
        return {"format": "surgery-data-stream/1", "rank": self.rank, "world": self.world, "workers": self.workers,
                "consumed": self.consumed, "readers": {str(k): v for k, v in sorted(self.states.items())}}

    def load_state_dict(self, state: dict, expect_consumed: int) -> None:
        """A checkpoint's position of this process, checked against the run before anything is read."""
        try:
            ok = (state["format"] == "surgery-data-stream/1" and isinstance(state["consumed"], int)
                  and isinstance(state["readers"], dict))
        except (KeyError, TypeError):
            ok = False
        if not ok:
            raise SurgeryError("--resume: the data position in the checkpoint is not valid (not a stream position)")
        if state.get("world") != self.world or state.get("workers") != self.workers:
            raise SurgeryError(f"--resume: the run read its data with {state.get('world')} process(es) x "
                               f"{state.get('workers')} --data-workers; resume it with the same (now {self.world} x "
                               f"{self.workers})")
        if state["consumed"] != expect_consumed:
            raise SurgeryError(f"--resume: the data position in the checkpoint ({state['consumed']} windows read) does "
                               f"not match its step ({expect_consumed} windows): the checkpoint was altered")
        R = max(1, self.workers)
        for k, v in state["readers"].items():
            if not (str(k).isdigit() and self.rank * R <= int(k) < (self.rank + 1) * R):
                raise SurgeryError(f"--resume: the data position in the checkpoint names reader {k}, not one of "
                                   f"process {self.rank}'s")
            check_state(v, self.plan)
        self.states = {int(k): v for k, v in state["readers"].items()}
        self.consumed = state["consumed"]
        self._it = None

    def shares(self) -> dict:
        """Windows taken so far per source, tokens read and blank documents passed over (this process's readers)."""
        n = len(self.plan.sources)
        windows = [sum(st["windows"][s] for st in self.states.values()) for s in range(n)]
        skipped = sum(p["skipped"] for st in self.states.values() for p in st["sources"])
        return {"windows": windows, "skipped": skipped, "tokens": self.consumed * self.seq_len}

    def close(self) -> None:
        it, self._it = self._it, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()


def data_key(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]
