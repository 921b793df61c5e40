"""Retrieval heads in the MLA conversion: `--retrieval-weight B` and `--retrieval-rows-weight W` with
`--calib-retrieval-mix P` (the calibration windows holding retrieval examples: surgery/calibration/retrieval.py).

Scores. On each layer's pass that sums the attention input's second moments, the source attention runs on the chunks
that hold retrieval examples, and each query head is scored by the aligned merge's scorer (`HeadScores`: the
attention mass its answer-predicting positions put on the needle's value tokens, on the input the layer really sees,
the converted stream's). Scored whenever P > 0 (recorded in surgery.json); they change the fit only with B or W.

Where the weights enter (surgery/mla/factor.py, `FitWeights`). MLA's one cache is a latent shared by every head: what
a rank-R latent keeps is decided by the factorisation's metric, the sum over heads of the query (key rows) and
o_proj (value rows) metrics. That is where a head's weight 1 + B x score_h goes: its term in its group's key and
value metrics, and its energy in the rope split's group weights, so the shared rope key and the latent's rank go
to the directions the retrieval heads read and write (a head that copies from far back needs its no-position keys,
which only the latent carries). The query refit weighs the heads alike (the aligned merge's `QueryFit` head
weights: a heavier head's sampled positions count more against the pull toward the factorisation's queries). The
output refit fits the layer's summed output: no head to weigh there.

Rows. The retrieval examples' needle positions are the keys and values a retrieval head must find, their answer
positions the queries that look: with W != 1 the needle rows count W times in the keys' and values' second moments
(the data term of the rope split and the latent) and the answer rows W times in the queries' (the metrics). Unlike
the aligned merge, whose W adds the answer rows to the query refit's random sample, MLA's W reweighs statistics
in which every row already counts once: W = 1 is the plain fit, and the query refit keeps its sample.
"""

from __future__ import annotations

import torch

from ..calibration.retrieval import HeadScores, RetrievalWindow, chunk_probes, head_weights
from .factor import FitWeights


class _Rows:
    """One layer's retrieval rows: sums of x x^T over the needle (key) and answer (query) positions, and counts."""

    def __init__(self):
        self.key, self.query = None, None
        self.key_count = self.query_count = self.tokens = 0

    def add(self, x: torch.Tensor, positions: list[int], which: str) -> None:
        rows = x[positions].double()
        part = rows.T @ rows
        total = getattr(self, which)
        setattr(self, which, part if total is None else total + part)
        setattr(self, which + "_count", getattr(self, which + "_count") + len(positions))


class RetrievalCalibration:
    """The retrieval windows of one conversion (`probes`, the calibration split into chunks of `chunk_windows`), the
    head weight `weight` (B) and the rows' `rows_weight` (W): per layer, the heads' scores and the fit's weights."""

    def __init__(self, probes: list[RetrievalWindow], chunk_windows: int, weight: float, rows_weight: float):
        self.probes = chunk_probes(probes, chunk_windows)  # chunk -> [(index in it, probe)]
        self.weight, self.rows_weight = weight, rows_weight
        self.scores = HeadScores()
        self._rows: dict[int, _Rows] = {}

    def see(self, layer: int, chunk: int, x: torch.Tensor, run) -> None:
        """One chunk of `layer`'s second-moment pass: x [b, L, H] its attention input; `run()` the source attention's
        record on it (called only for a chunk holding retrieval windows)."""
        rows = self._rows.setdefault(layer, _Rows())
        rows.tokens += x.shape[0] * x.shape[1]
        probes = self.probes.get(chunk)
        if not probes:
            return
        record = run()
        queries, keys = record.queries[0], record.keys[0]  # [b, H, L, D], [b, KV, L, D]
        scaling = record.scaling if record.scaling is not None else queries.shape[-1] ** -0.5
        self.scores.add(layer, queries, keys, scaling, record.softcap, probes)
        if self.rows_weight != 1:
            for i, p in probes:
                rows.add(x[i], p.needle, "key")
                rows.add(x[i], p.answers, "query")

    def head_weights(self, layer: int, device) -> torch.Tensor | None:
        """[H] the layer's head weights 1 + B x score on `device` (None: 1 each, as without scores)."""
        w = head_weights(self.scores.layer(layer), self.weight)
        return None if w is None else w.to(device)

    def weights(self, layer: int, sigma: torch.Tensor) -> FitWeights | None:
        """The layer's `FitWeights` (`sigma`: the plain second moments of its attention input); None when neither B
        nor W changes the fit (the plain factorisation, bit for bit)."""
        heads = self.head_weights(layer, sigma.device)
        rows = self._rows.pop(layer, None)
        key_sigma = query_sigma = None
        if rows is not None and self.rows_weight != 1:
            key_sigma = _reweighted(sigma, rows.tokens, rows.key, rows.key_count, self.rows_weight)
            query_sigma = _reweighted(sigma, rows.tokens, rows.query, rows.query_count, self.rows_weight)
        if heads is None and key_sigma is None and query_sigma is None:
            return None
        return FitWeights(heads, key_sigma, query_sigma)

    def record(self) -> dict:
        """surgery.json's `mla.retrieval_heads`."""
        return {"score": "attention mass from the answer-predicting positions on the needle's value tokens, mean "
                         "over the retrieval windows, per layer and source query head",
                "weight": self.weight, "head_weight": "1 + weight x score",
                "enters": "each head's term of the latent's key and value metrics, its energy in the rope key's "
                          "split, its samples in the query refit",
                # the needle (keys' and values' moments) and answer (queries' moments) rows count this many times
                "rows_weight": self.rows_weight, "scores": self.scores.record()}


def _reweighted(sigma: torch.Tensor, tokens: int, rows: torch.Tensor | None, count: int,
                weight: float) -> torch.Tensor | None:
    """sigma (the mean over `tokens` rows) with `count` of its rows, summing to `rows`, counted `weight` times."""
    if rows is None or not count:
        return None
    extra = weight - 1
    return (sigma * tokens + extra * rows.to(sigma)) / (tokens + extra * count)
