"""The floating dtypes, by name: the one list the options offer and the one table of their sizes (torch-free, so the
command line starts without torch; surgery.checkpoint.tensors.DTYPES maps the same names to torch dtypes)."""

from __future__ import annotations

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # what a checkpoint is written in and a model runs in
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}  # bytes per value
