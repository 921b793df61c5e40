"""`--global-layers auto`: how much each layer would lose if windowed, measured on the source at long context.

The source streams layer by layer over the calibration windows (surgery.calibration.stream: one decoder layer on the
device at a time); its attention calls are recorded (the rotated queries and keys, the softmax scale and soft-cap,
surgery.calibration.capture). For every query at position q ≥ W, the attention probability the full-attention layer
puts on keys a window of W cannot see (positions ≤ q - W) is that layer's far mass; a layer's score is its mean
over heads and those queries. A layer that attends far keeps global attention; one whose attention stays inside
the window loses nothing when windowed. Memory: one block of query rows against the window's keys at a time.
"""

from __future__ import annotations

import torch

from ..calibration.stream import run_layer
from ..calibration import capture
from ..progress import Progress

QUERY_BLOCK = 256  # query rows scored at a time


@torch.no_grad()
def far_mass(queries: torch.Tensor, keys: torch.Tensor, scaling: float, window: int,
             softcap: float | None = None) -> tuple[float, int]:
    """Sum over heads and queries q ≥ `window` of the causal attention probability on keys ≤ q - window, and the
    number of (head, query) rows summed. queries [b, H, L, D], keys [b, KV, L, D] (rotated, grouped heads)."""
    b, heads, length, _ = queries.shape
    keys = keys.repeat_interleave(heads // keys.shape[1], dim=1)
    total, rows = 0.0, 0
    positions = torch.arange(length, device=queries.device)
    for start in range(window, length, QUERY_BLOCK):
        q_pos = positions[start:start + QUERY_BLOCK]
        scores = queries[:, :, start:start + QUERY_BLOCK].float() @ keys.float().transpose(-1, -2) * scaling
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(positions[None, :] > q_pos[:, None], float("-inf"))
        probs = scores.softmax(-1)
        far = positions[None, :] <= (q_pos[:, None] - window)
        total += float((probs * far).sum(dtype=torch.float64))
        rows += b * heads * len(q_pos)
    return total, rows


@torch.no_grad()
def layer_scores(folder, reader, windows: torch.Tensor, device: torch.device, window: int, chunk_windows: int,
                 progress: bool = True) -> list[float]:
    """Each decoder layer's mean far mass (see the module docstring) over `windows` [N, L] of calibration tokens."""
    stream, hidden, calls = capture.open_recorded_stream(folder, reader, device, windows, chunk_windows)
    scores = []
    with Progress(len(stream), "score layers (attention beyond the window)", enabled=progress, unit="layer") as bar:
        for index, _, layer in stream.layers():
            total, rows = 0.0, 0
            for i in range(len(hidden)):
                with capture.recording() as rec:
                    hidden[i] = stream.stash(run_layer(layer, stream.fetch(hidden[i]), calls[i][index]))
                for q, k in zip(rec.queries, rec.keys):
                    t, r = far_mass(q, k, rec.scaling or q.shape[-1] ** -0.5, window, rec.softcap)
                    total, rows = total + t, rows + r
            scores.append(total / max(rows, 1))
            bar.update(1)
    return scores
