"""The calibration's residual streams ([tokens, hidden] float32 per stream, cut into chunks of windows): in memory up
to a budget, the chunks past it in raw files in a temporary folder.

The residual streams are the only calibration data whose size grows with the token budget (every per-layer stage
works one chunk at a time). Past `budget` bytes of host memory (the process's streams together), further chunks are
written to `folder` (inside the layer store's temporary folder beside the output, so removed with it, whatever
happens) and read back when a pass reaches them: one chunk's file per slot, raw bytes (shape and dtype stay in
memory; no pickle, no mmap lingering in RSS). A chunk on a device (CUDA without offloading) stays there: the budget
is about host memory. Small runs never touch the disk.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path

import numpy as np
import torch

from ..checkpoint.atomic import write_failure

RESIDUAL_BUDGET_ENV = "SURGERY_RESIDUAL_RAM_MB"
DEFAULT_BUDGET = 512 << 20  # bytes of residual stream kept in host memory before chunks go to disk


def default_budget() -> int:
    """`SURGERY_RESIDUAL_RAM_MB` (MiB; 0 spills every chunk) or 512 MiB."""
    from ..options import env_number

    return int(env_number(RESIDUAL_BUDGET_ENV, DEFAULT_BUDGET / (1 << 20), "MiB", maximum=1 << 30) * (1 << 20))


class SpillPolicy:
    """Where the chunks of every residual stream of one calibration go: memory while the host-resident chunks add up
    to at most `budget` bytes, then files in a new folder inside `folder` (None: always memory). `beside` names the output in the
    one-line error of a failed write (a full disk)."""

    def __init__(self, folder: Path | None = None, budget: int | None = None, beside: Path | None = None):
        self.folder = Path(folder) if folder is not None else None
        self.budget = default_budget() if budget is None else budget
        self.beside = Path(beside) if beside is not None else Path("calibration")
        self.resident = 0  # bytes of host-memory chunks, all streams
        self._streams = 0
        if self.folder is not None:  # a folder of its own inside `folder`, removed when the policy is dropped
            Path(folder).mkdir(parents=True, exist_ok=True)
            self.folder = Path(tempfile.mkdtemp(prefix="residual-", dir=folder))
            weakref.finalize(self, shutil.rmtree, self.folder, True)

    def stream(self) -> "ResidualChunks":
        self._streams += 1
        return ResidualChunks(self, f"stream{self._streams}")


def _host_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size() if t.device.type == "cpu" else 0


class ResidualChunks:
    """A list of chunk tensors (index, assign, append, iterate) whose slots live in memory or in files, as the
    policy decides when a slot is first filled."""

    def __init__(self, policy: SpillPolicy, name: str):
        self.policy, self.name = policy, name
        self._memory: list[torch.Tensor | None] = []
        self._files: dict[int, tuple[Path, torch.Size, torch.dtype]] = {}

    def __len__(self) -> int:
        return len(self._memory)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def append(self, t: torch.Tensor) -> None:
        p = self.policy
        self._memory.append(None)
        index = len(self._memory) - 1
        if p.folder is not None and _host_bytes(t) and p.resident + _host_bytes(t) > p.budget:
            self._write(index, t)
        else:
            self._memory[index] = t
            p.resident += _host_bytes(t)

    def __getitem__(self, index: int) -> torch.Tensor:
        if index in self._files:
            path, shape, dtype = self._files[index]
            raw = torch.from_numpy(np.fromfile(path, dtype=np.uint8))
            return raw.view(dtype).reshape(shape)
        return self._memory[index]

    def __setitem__(self, index: int, t: torch.Tensor) -> None:
        if index in self._files:
            self._write(index, t.cpu() if t.device.type != "cpu" else t)
            return
        old = self._memory[index]
        self.policy.resident += _host_bytes(t) - (_host_bytes(old) if old is not None else 0)
        self._memory[index] = t

    def _write(self, index: int, t: torch.Tensor) -> None:
        path = self.policy.folder / f"{self.name}-{index:05d}.bin"
        t = t.detach().to("cpu").contiguous()
        try:
            t.view(torch.uint8).numpy().tofile(path)
        except OSError as e:  # a full disk: one line; the folder goes with the layer store
            raise write_failure(self.policy.beside, e) from None
        self._files[index] = (path, t.shape, t.dtype)

    def copy(self) -> "ResidualChunks":
        """Another stream holding the same chunks (each slot placed anew under the policy)."""
        other = self.policy.stream()
        for t in self:
            other.append(t)
        return other
