"""Host syncs and graph breaks of a forward, measured on CPU.

On CUDA every call that brings a tensor's value to Python (`.item()`, `bool(t)`, `int(t)`, `.tolist()`, ...) or
whose output size depends on the data (`nonzero`, `bincount`, `unique`, `masked_select`, ...) waits for the GPU
to finish everything queued before it. `torch.cuda.set_sync_debug_mode` reports them there; on CPU nothing waits,
so `count_host_syncs` patches those entry points for the duration of a `with` block and counts the calls made
directly from the files you name (the modeling code), not the ones torch or transformers make on their own.

`graph_breaks` counts the places where `torch.compile` has to leave its graph for Python (data-dependent control
flow, `.tolist()`, ...), with `torch._dynamo.explain`.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

# (owner, name): what brings a value to the host, or sizes its output by the data
SYNCING = (
    *((torch.Tensor, n) for n in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero",
                                  "bincount", "unique", "masked_select", "repeat_interleave", "numpy")),
    *((torch, n) for n in ("nonzero", "bincount", "unique", "masked_select", "repeat_interleave", "argwhere")),
)


class HostSyncs(Counter):
    """Calls that would sync the host with a GPU, by name ("Tensor.item", "torch.nonzero", ...)."""

    @property
    def total(self) -> int:
        return sum(self.values())


@contextlib.contextmanager
def count_host_syncs(files: Iterable[str | Path]) -> Iterator[HostSyncs]:
    """Count, inside the block, the syncing calls made from code in `files` (e.g. a modeling module's __file__)."""
    watched = {str(Path(f).resolve()) for f in files}
    counts = HostSyncs()
    originals = []

    def wrap(owner, name, original):
        label = f"{'Tensor' if owner is torch.Tensor else 'torch'}.{name}"

        def counted(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller in watched or str(Path(caller).resolve()) in watched:
                counts[label] += 1
            return original(*args, **kwargs)

        return counted

    try:
        for owner, name in SYNCING:
            original = getattr(owner, name, None)
            if original is None:
                continue
            originals.append((owner, name, original, name in vars(owner)))
            setattr(owner, name, wrap(owner, name, original))
        yield counts
    finally:
        for owner, name, original, own in reversed(originals):
            if own:
                setattr(owner, name, original)
            else:  # inherited (Tensor.item is TensorBase's): inherited again
                delattr(owner, name)


def graph_breaks(model, *args, **kwargs) -> int:
    """How many times `torch.compile` breaks its graph on `model(*args, **kwargs)` (torch._dynamo.explain), after
    one eager call (what a first call caches is then cached, as in use)."""
    import torch._dynamo

    model(*args, **kwargs)
    torch._dynamo.reset()
    try:
        return torch._dynamo.explain(model)(*args, **kwargs).graph_break_count
    finally:
        torch._dynamo.reset()
