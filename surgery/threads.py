"""Torch compute threads for a block of code (below checkpoint I/O, which copies and hashes on one torch thread)."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def threads(n: int):
    """Run a block with `n` torch compute threads, restoring the caller's setting afterwards.

    The merge's small dense linear algebra (eigh and solves on ~100x100 matrices) runs single-threaded: measured
    here, multi-threaded it was 2x to 80x slower; the plain converter is I/O-bound and needs no compute threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
