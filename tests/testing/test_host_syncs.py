"""The host-sync counter counts the syncing calls made from the files it watches, and only those, and puts torch
back as it was; the graph-break counter sees a `.tolist()` break."""

from __future__ import annotations

import torch

from surgery.testing.host_syncs import count_host_syncs, graph_breaks


def _syncing(x: torch.Tensor) -> float:
    lo = int(x.argmax())  # Tensor.__int__
    if bool(x.any()):  # Tensor.__bool__
        lo += len(x.nonzero())  # Tensor.nonzero
    return lo + x.sum().item() + len(x.tolist()) + len(torch.nonzero(x))


def test_counts_the_syncs_made_from_the_watched_files_only():
    x = torch.tensor([0.0, 2.0, 1.0])
    with count_host_syncs([__file__]) as mine:
        _syncing(x)
        torch.testing.assert_close(x, x.clone())  # torch's own syncs, from torch's files: not counted
    assert dict(mine) == {"Tensor.__int__": 1, "Tensor.__bool__": 1, "Tensor.nonzero": 1, "Tensor.item": 1,
                          "Tensor.tolist": 1, "torch.nonzero": 1}
    assert mine.total == 6
    with count_host_syncs([torch.__file__]) as others:
        _syncing(x)
    assert others.total == 0
    assert "item" not in vars(torch.Tensor) and torch.nonzero is torch._C._VariableFunctions.nonzero


def test_graph_breaks_counts_a_tolist():
    def clean(x):
        return (x * 2).sum(0)

    def broken(x):
        n = x.sum(0).tolist()
        return x * n[0]

    x = torch.randn(4, 3)
    assert graph_breaks(clean, x) == 0
    assert graph_breaks(broken, x) >= 1
