"""Retrieval on the calibration windows: `--calib-retrieval-mix P` puts synthetic retrieval examples among them, and the
heads that retrieve are found on those examples.

Mixing. A fraction P of the calibration windows is replaced by retrieval examples built from the window's own text
(surgery/retrieval_mix.py, the builder uptrain's `--retrieval-mix` uses: passkey, single- and multi-key needles,
variable tracking; window g is chosen and its example drawn from the conversion's --seed and g alone). Each
example keeps where its answer is predicted from and where the needle's value stands (`RetrievalWindow`).

Retrieval heads. A head retrieves when, at the positions that predict the answer, its attention lands on the needle's
value tokens: the tokens the answer copies (Wu et al. 2024's retrieval heads, DuoAttention's observation that a few
heads do the long-range lookups). `HeadScores` sums, per query head, the softmax attention mass those positions put
on the needle's value positions, averaged over the answer positions and the examples: a number in [0, 1] per head,
1 for a head that looks only at the needle while answering. `head_weights` turns a layer's scores into the fits'
per-head weights, 1 + B * score_h (B = `--retrieval-weight`; all ones for B = 0 or no scores). The scores are not
divided by the layer's mean: in a layer where no head retrieves (scores ~0.01) that would blow noise up to weights of
~1 + B, as large as a real retrieval head's elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..retrieval_mix import RetrievalMix, answer_positions, needle_positions

FLAG = "--calib-retrieval-mix"


@dataclass(frozen=True)
class RetrievalWindow:
    """One calibration window that holds a retrieval example."""

    window: int  # its index among the calibration windows
    task: str
    answers: list[int]  # positions that predict the answer's tokens
    needle: list[int]  # positions of the needle's value tokens (what the answer copies)


def calibration_mix(fraction: float, seed: int, tokenizer, length: int) -> RetrievalMix:
    """The mix of `fraction` for windows of `length` tokens, refused in one line when its examples do not fit."""
    mix = RetrievalMix(fraction, seed, tokenizer, length, flag=FLAG, length_flag="--calib-window")
    if fraction:
        mix.check_length()
    return mix


def mix_windows(windows: torch.Tensor, mix: RetrievalMix) -> tuple[torch.Tensor, list[RetrievalWindow]]:
    """`windows` [N, L] with the chosen ones replaced by their retrieval examples (a new tensor when any is), and what
    each example holds where."""
    out, probes = windows, []
    for g in range(windows.shape[0]):
        if not mix.chosen(g):
            continue
        example = mix.example(g, windows[g].tolist())
        if out is windows:
            out = windows.clone()
        out[g] = torch.tensor(example.ids, dtype=windows.dtype)
        probes.append(RetrievalWindow(g, example.task, answer_positions(example), needle_positions(example)))
    return out, probes


def mix_record(mix: RetrievalMix, windows: int, probes: list[RetrievalWindow]) -> dict:
    """surgery.json's calibration "retrieval_mix": the fraction, the tasks, which windows hold examples, of what."""
    return mix.record(windows) | {"window_indices": [p.window for p in probes],
                                  "window_tasks": [p.task for p in probes]}


def chunk_probes(probes: list[RetrievalWindow], chunk_windows: int) -> dict[int, list[tuple[int, RetrievalWindow]]]:
    """The retrieval windows by chunk (windows split into chunks of `chunk_windows`): chunk -> [(index in it, probe)]."""
    out: dict[int, list[tuple[int, RetrievalWindow]]] = {}
    for p in probes:
        if p.needle:  # an example whose needle was not found says nothing
            out.setdefault(p.window // chunk_windows, []).append((p.window % chunk_windows, p))
    return out


@torch.no_grad()
def needle_attention(queries: torch.Tensor, keys: torch.Tensor, scaling: float, softcap: float | None,
                     answers: list[int], needle: list[int]) -> torch.Tensor:
    """One window: queries [H, L, D] and keys [KV, L, D] (rotated, as the model computes them) -> [H] the causal
    softmax attention mass each query head puts on the `needle` positions, averaged over the `answers` positions."""
    heads, length, _ = queries.shape
    dev = queries.device
    rows = torch.tensor(answers, device=dev)
    keys = keys.float().repeat_interleave(heads // keys.shape[0], dim=0)  # [H, L, D]
    logits = scaling * (queries[:, rows].float() @ keys.transpose(-1, -2))  # [H, P, L]
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    visible = torch.arange(length, device=dev)[None, :] <= rows[:, None]  # [P, L]
    prob = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    return prob[..., torch.tensor(needle, device=dev)].sum(-1).mean(-1)


class HeadScores:
    """Per layer, the retrieval score of each query head: the mean of `needle_attention` over the retrieval windows."""

    def __init__(self):
        self.sums: dict[int, torch.Tensor] = {}
        self.counts: dict[int, int] = {}

    def add(self, layer: int, queries: torch.Tensor, keys: torch.Tensor, scaling: float, softcap: float | None,
            probes: list[tuple[int, RetrievalWindow]]) -> None:
        """One chunk of `layer`: queries [b, H, L, D], keys [b, KV, L, D]; `probes` its retrieval windows."""
        for i, p in probes:
            mass = needle_attention(queries[i], keys[i], scaling, softcap, p.answers, p.needle).double().cpu()
            self.sums[layer] = self.sums[layer] + mass if layer in self.sums else mass
            self.counts[layer] = self.counts.get(layer, 0) + 1

    def layer(self, layer: int) -> torch.Tensor | None:
        """[H] the layer's scores, None when it saw no retrieval window."""
        return self.sums[layer] / self.counts[layer] if self.counts.get(layer) else None

    def record(self) -> list[list[float]]:
        """Per layer (in order), per query head: the scores, rounded (surgery.json)."""
        return [[round(float(v), 5) for v in self.layer(i)] for i in sorted(self.counts)]


def head_weights(scores: torch.Tensor | None, strength: float) -> torch.Tensor | None:
    """[H] the fits' weight of each query head, 1 + strength * score_h (scores in [0, 1]); None (every head weighs 1,
    the fits as without scores) when `strength` is 0, there are no scores, or no head attends to the needles."""
    if not strength or scores is None:
        return None
    if not float(scores.max()) > 0:
        return None
    return 1 + strength * scores.double()
