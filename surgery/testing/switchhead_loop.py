"""SwitchHead's routed experts as they were computed before the batched path (main at 990b1b1): rows sorted by expert,
`bincount(...).tolist()` (a host sync) and a Python loop over the H*E experts. The reference the routing test holds the
batched path to, and the "old" path the GPU-paths benchmark times; `msh` is the modeling module whose routing it
uses (this package's, or a converted checkpoint's own copy)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dispatch(msh, index: torch.Tensor, experts: int) -> tuple[torch.Tensor, list[int]]:
    """The routed rows in expert order and each (head, expert)'s count."""
    flat = msh.flat_expert_index(index, experts).reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=index.shape[1] * experts).tolist()
    return order, counts


def loop_values(msh, w: torch.Tensor, b: torch.Tensor | None, x: torch.Tensor, gates: torch.Tensor,
                index: torch.Tensor) -> torch.Tensor:
    """Every head's gated value experts: x [n, dim], w [H, E, d, dim] -> [n, H, d]."""
    heads, n_exp, d, _ = w.shape
    n, k = x.shape[0], index.shape[-1]
    order, counts = dispatch(msh, index, n_exp)
    rows = order // k
    tokens = rows // heads
    g = gates.reshape(-1)[order].unsqueeze(-1).to(x.dtype)
    out = x.new_zeros(n * heads, d)
    start = 0
    for j, count in enumerate(counts):
        if count:
            h, e = divmod(j, n_exp)
            part = slice(start, start + count)
            y = F.linear(x.index_select(0, tokens[part]), w[h, e], None if b is None else b[h, e])
            out.index_add_(0, rows[part], y * g[part])
            start += count
    return out.view(n, heads, d)


def loop_outputs(msh, w: torch.Tensor, a: torch.Tensor, gates: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The heads' gated output experts summed: a [n, H, k, d] per selected expert, w [H, E, dim, d] -> [n, dim]."""
    heads, n_exp, dim, d = w.shape
    n, k = a.shape[0], index.shape[-1]
    gated = (a.unsqueeze(2) * gates.unsqueeze(-1).to(a.dtype)).reshape(n * heads * k, d)
    order, counts = dispatch(msh, index, n_exp)
    tokens = order // (k * heads)
    out = a.new_zeros(n, dim)
    start = 0
    for j, count in enumerate(counts):
        if count:
            h, e = divmod(j, n_exp)
            part = slice(start, start + count)
            out.index_add_(0, tokens[part], F.linear(gated.index_select(0, order[part]), w[h, e]))
            start += count
    return out
