"""What the first model of a check leaves for the second: its float32 outputs, chunk by chunk.

`surgery check` runs the source over every window first, then the converted model, so that only one model is in
memory at a time. Every metric (max and mean |Δlogits| included) needs the source's exact float32 outputs at the
time the converted model's outputs for the same chunk exist, so the source's outputs are kept bit for bit:

- in memory while the whole store stays under `memory_bytes` (256 MiB by default: tiny models, short checks);
- otherwise as raw float32 files, one per chunk, in a temporary folder (under $TMPDIR, removed when the check
  ends, Ctrl-C included), read back a slice of rows at a time, so that a chunk is never in memory twice.
  SmolLM2-135M over 16,384 tokens needs 3.2 GB of scratch disk (tokens x vocabulary x 4 bytes); the free space is
  checked before the run starts.

Raw files, not safetensors: safetensors' writer copies a tensor into Python bytes before writing (a second chunk in
memory) and its reader maps the whole file; a private scratch file needs neither a header nor a format.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from ..errors import SurgeryError
from ..units import human_bytes

MEMORY_BYTES = 256 << 20
DISK_MARGIN = 1 << 30  # left free on the scratch disk


def scratch_dir() -> Path:
    return Path(tempfile.gettempdir())


class SpillStore:
    """float32 tensors by key; `rows(key, a, b)` reads rows a..b of the tensor viewed as (rows, last dim)."""

    def __init__(self, expected_bytes: int, memory_bytes: int = MEMORY_BYTES, what: str = "the source's outputs"):
        self.in_memory = expected_bytes <= memory_bytes
        self._tensors: dict[str, torch.Tensor] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._tmp: tempfile.TemporaryDirectory | None = None
        if not self.in_memory:
            where = scratch_dir()
            free = shutil.disk_usage(where).free
            if free < expected_bytes + DISK_MARGIN:
                raise SurgeryError(f"check keeps {what} on disk between the two models: it needs "
                                   f"{human_bytes(expected_bytes)} in {where} ({human_bytes(free)} free); "
                                   "set TMPDIR to a larger disk or lower --tokens")
            self._tmp = tempfile.TemporaryDirectory(prefix="surgery-check-")

    @property
    def folder(self) -> Path | None:
        return Path(self._tmp.name) if self._tmp else None

    def _path(self, key: str) -> Path:
        return Path(self._tmp.name) / f"{key}.f32"

    def put(self, key: str, tensor: torch.Tensor) -> None:
        t = tensor.detach().to("cpu", torch.float32).contiguous()
        self._shapes[key] = tuple(t.shape)
        if self.in_memory:
            self._tensors[key] = t.clone() if t.data_ptr() == tensor.data_ptr() else t
        else:
            t.numpy().tofile(self._path(key))

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shapes[key]

    def __contains__(self, key: str) -> bool:
        return key in self._shapes

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows start..stop of the tensor seen as (rows, last dimension), as a new float32 CPU tensor."""
        width = self._shapes[key][-1]
        if self.in_memory:
            return self._tensors[key].view(-1, width)[start:stop]
        data = np.fromfile(self._path(key), dtype=np.float32, count=(stop - start) * width, offset=start * width * 4)
        if data.size != (stop - start) * width:
            raise SurgeryError(f"scratch file {self._path(key)} was truncated while the check ran")
        return torch.from_numpy(data).view(stop - start, width)

    def get(self, key: str) -> torch.Tensor:
        shape = self._shapes[key]
        return self.rows(key, 0, int(np.prod(shape[:-1]))).reshape(shape)

    def close(self) -> None:
        self._tensors.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> SpillStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
