"""sha256 of a file, read in 16 MiB blocks (hashlib releases the GIL on large buffers, so threads overlap)."""

from __future__ import annotations

import hashlib
from pathlib import Path

BLOCK = 16 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            h.update(block)
    return h.hexdigest()
