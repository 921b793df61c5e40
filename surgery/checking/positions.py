"""Perplexity, KL and top-1 agreement by position in the window: where in the context a conversion hurts.

A K/V merge or a new attention can cost little at the start of a window (short contexts) and much more deep into
it (long-range retrieval through fewer K/V heads), or the reverse (uptraining fitted the text's style, which helps
most where there is no context yet). One perplexity over the window averages the two away; these buckets keep them
apart. Buckets double in width: positions 0-63, 64-127, 128-255, ... up to the window's length.
"""

from __future__ import annotations

import math

import torch

FIRST_EDGE = 64


def bucket_edges(seq_len: int) -> list[int]:
    """Bucket starts and the end: [0, 64, 128, 256, ..., seq_len]; [0, seq_len] when the window is 64 or shorter."""
    edges, edge = [0], FIRST_EDGE
    while edge < seq_len:
        edges.append(edge)
        edge *= 2
    return edges + [seq_len]


class PositionBuckets:
    """Running float64 sums per bucket of positions within the window."""

    def __init__(self, seq_len: int):
        self.edges = bucket_edges(seq_len)
        n = len(self.edges) - 1
        self.nll = torch.zeros(2, n, dtype=torch.float64)  # source, converted
        self.targets = torch.zeros(n, dtype=torch.float64)
        self.kl = torch.zeros(n, dtype=torch.float64)
        self.agree = torch.zeros(n, dtype=torch.float64)
        self.positions = torch.zeros(n, dtype=torch.float64)

    def add(self, positions: torch.Tensor, nll_a: torch.Tensor, nll_b: torch.Tensor, has_target: torch.Tensor,
            kl: torch.Tensor, agree: torch.Tensor) -> None:
        """Per-row values (rows = positions of the windows, `positions` their index in the window): each model's
        next-token NLL (0 where `has_target` is False), KL(source||converted) and top-1 agreement (0/1)."""
        bucket = (torch.bucketize(positions.cpu(), torch.tensor(self.edges[1:-1]), right=True))
        for sums, values in ((self.nll[0], nll_a), (self.nll[1], nll_b), (self.targets, has_target),
                             (self.kl, kl), (self.agree, agree), (self.positions, torch.ones_like(kl))):
            sums.index_add_(0, bucket, values.detach().cpu().double())

    def report(self) -> list[dict]:
        """One row per bucket that saw positions: its range, both perplexities and their ratio, KL, top-1."""
        rows = []
        for i in range(len(self.edges) - 1):
            if not self.positions[i] or not self.targets[i]:
                continue
            ppl = [math.exp(self.nll[m, i].item() / self.targets[i].item()) for m in (0, 1)]
            rows.append({"positions": [self.edges[i], self.edges[i + 1]], "targets": int(self.targets[i].item()),
                         "ppl_source": ppl[0], "ppl_converted": ppl[1], "ppl_ratio": ppl[1] / ppl[0],
                         "kl": self.kl[i].item() / self.positions[i].item(),
                         "top1_agreement": self.agree[i].item() / self.positions[i].item()})
        return rows


def window_positions(batch: int, seq_len: int) -> torch.Tensor:
    """Each row's position in its window when (batch, seq_len) is flattened row by row."""
    return torch.arange(seq_len).repeat(batch)


def print_table(rows: list[dict], console) -> None:
    from rich.table import Table

    table = Table(title="by position in the window (positions a..b-1; next-token targets)")
    for col in ("positions", "targets", "ppl source", "ppl converted", "ratio", "KL / token", "top-1"):
        table.add_column(col, justify="right")
    for r in rows:
        a, b = r["positions"]
        table.add_row(f"{a}-{b - 1}", str(r["targets"]), f"{r['ppl_source']:.3f}", f"{r['ppl_converted']:.3f}",
                      f"{r['ppl_ratio']:.3f}x", f"{r['kl']:.4g}", f"{100 * r['top1_agreement']:.1f}%")
    console.print(table)
