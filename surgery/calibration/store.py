"""Converted tensors of every layer, kept from the layer's calibration until the writer asks for them.

The output plan is written after the last layer is calibrated, so each layer's new tensors wait. They wait in a
temporary folder beside the output (one safetensors file per layer, removed afterwards, whatever happens), so
host memory stays at one layer's tensors whatever the model's size; `spill=False` keeps them in memory instead.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path

import torch

from ..checkpoint.atomic import clean_stale_siblings, temp_prefix, write_failure
from ..checkpoint.tensors import CheckpointReader, save_safetensors


class LayerStore:
    def __init__(self, beside: Path | None = None, spill: bool = True):
        self.dir = None
        self.beside = Path(beside) if beside is not None else Path("calibration store")
        if spill:
            parent = Path(beside).absolute().parent if beside is not None else None
            # `.OUT.calib-PID-*`: a killed run's store is removed by the next run's stale-folder cleanup (here too)
            if beside is not None:
                clean_stale_siblings(beside)
            self.dir = Path(tempfile.mkdtemp(prefix=temp_prefix(beside or "surgery", "calib"), dir=parent))
            # removed on close(), or when the store is dropped (an error on the way) or the interpreter exits
            self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, True)
        self._memory: dict[int, dict[str, torch.Tensor]] = {}
        self._cached: tuple[int, dict[str, torch.Tensor]] | None = None

    def put(self, layer: int, tensors: dict[str, torch.Tensor]) -> None:
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items() if v is not None}
        if self.dir is None:
            self._memory[layer] = tensors
            return
        folder = self.dir / f"layer-{layer:05d}"
        try:
            folder.mkdir()
            save_safetensors(tensors, folder / "model.safetensors")
        except OSError as e:  # a full disk: one line; the store is removed when it is dropped
            shutil.rmtree(folder, ignore_errors=True)
            raise write_failure(self.beside, e) from None

    def scratch(self, name: str) -> Path | None:
        """A folder for other calibration data that may go to disk (the residual streams past their memory budget),
        inside the store's temporary folder so that it goes with it; None when the store keeps memory."""
        return self.dir / name if self.dir is not None else None

    def get(self, layer: int) -> dict[str, torch.Tensor]:
        if self.dir is None:
            return self._memory[layer]
        if self._cached is None or self._cached[0] != layer:
            with CheckpointReader(self.dir / f"layer-{layer:05d}") as reader:  # pread, no mmap lingering in RSS
                self._cached = (layer, {name: reader.load(name) for name in reader.names()})
        return self._cached[1]

    def close(self) -> None:
        self._memory.clear()
        self._cached = None
        if self.dir is not None:
            self._cleanup()

    def __enter__(self) -> "LayerStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
