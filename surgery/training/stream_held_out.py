"""Streamed training data, the held-out split: the first documents of every source (its share of `--eval-tokens`, by
`--data-weights`) are packed into the evaluation windows and never trained on; `held[u]` counts those taken from
unit `u`.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from ..errors import SurgeryError
from ..data import encode_pieces
from .stream_sources import Plan, Source

class Held(tuple):
    """Per source, per unit: how many documents are held out for evaluation (never trained on). `cut[s]`: None, or
    (unit, tokens) when the held-out split of source `s` ends inside the source's last document (too few documents
    to hold out whole ones): that document, the one after the unit's held-out ones, has its first `tokens` tokens
    held out and the rest trained on."""

    cut: tuple = ()

    @classmethod
    def of(cls, counts, cut=None) -> "Held":
        held = cls(tuple(c) for c in counts)
        held.cut = tuple(cut) if cut is not None else (None,) * len(held)
        return held


def hold_out(plan_args: dict, sources: list[Source], eval_tokens: int) -> tuple[torch.Tensor, Held]:
    """The first documents of every source, packed into its share of the held-out windows (by weight); returns the
    windows and, per source and unit, how many documents they took (`Held`). A source with no document left after
    them (one document, a single file read with --txt-unit file) gives only the first tokens of its last document."""
    seq_len = plan_args["seq_len"]
    total = -(-eval_tokens // seq_len) if eval_tokens else 0
    shares = _split(total, [s.weight for s in sources])
    plan = Plan(sources=tuple(sources), held=tuple((0,) * len(s.units) for s in sources), **plan_args)
    windows, held, cuts = [], [], []
    for s, (source, n) in enumerate(zip(sources, shares)):
        counts = [0] * len(source.units)
        need, parts, have, inside = n * seq_len, [], 0, None
        texts = ((u, t) for u in range(len(source.units)) for t in plan.unit_texts(s, u)) if need else iter(())
        for u, text in texts:
            counts[u] += 1
            if text.strip():
                before = have
                for ids in (*_pieces_until(plan.tokenizer, text, need - have), [plan.eos]):
                    parts.append(np.asarray(ids, dtype=np.int32))
                    have += len(ids)
                # the split ends before this document's last token: (unit, its tokens held out)
                inside = (u, need - before) if have - 1 > need else None
            if have >= need:
                break
        if have < need:
            raise SurgeryError(f"data {source.spec} holds only {have} tokens, fewer than its {need} held-out tokens "
                               f"(--eval-tokens)")
        cut = None
        if inside is not None and not any(t.strip() for _, t in texts) and plan.hub_shards(s) < plan.readers:
            counts[inside[0]] -= 1  # nothing after it: the rest of the document is trained on
            cut = inside
        if n:
            windows.append(torch.from_numpy(np.concatenate(parts)[:need].reshape(n, seq_len).copy()))
        held.append(tuple(counts))
        cuts.append(cut)
    eval_windows = torch.cat(windows) if windows else torch.zeros(0, seq_len, dtype=torch.int32)
    return eval_windows, Held.of(held, cuts)


def _pieces_until(tokenizer, text: str, need: int) -> Iterator[list[int]]:
    """A document's token pieces until `need` tokens are there (a long document is not tokenized past them)."""
    for ids in encode_pieces(tokenizer, text):
        yield ids
        need -= len(ids)
        if need <= 0:
            return


def _split(total: int, weights: list[float]) -> list[int]:
    """`total` split in proportion to `weights` (largest remainders)."""
    raw = [total * w for w in weights]
    out = [int(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: out[i] - raw[i])[: total - sum(out)]:
        out[i] += 1
    return out
