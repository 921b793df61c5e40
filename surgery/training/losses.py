"""Training losses: next-token cross-entropy, distillation (forward or reverse KL, or Jensen-Shannon, to a teacher's
logits), their mix, and an optional term pulling every layer's output (the residual stream) toward the teacher's on
the same tokens.

All are means over token positions, so a step's loss does not depend on how its batch is split into
micro-batches or processes (every packed window has the same number of positions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .divergence import check as check_divergence, divergence_per_position, divergence_sum


# Positions per chunk of the losses: each chunk's softmax temporaries ([chunk, V] floats, a few of them) live only
# while that chunk is computed, and are recomputed in the backward pass instead of being kept (activation
# checkpointing of the loss alone). 256 positions x 49,152 logits (SmolLM2) = 50 MB per temporary.
CHUNK_POSITIONS = 256

Projection = Callable[[torch.Tensor], torch.Tensor]


def _chunked_sum(fn, *tensors: torch.Tensor, chunk: int = CHUNK_POSITIONS) -> torch.Tensor:
    """sum over position chunks of fn(*chunks); tensors share their first dimension. The chunks are views (no copy);
    with gradients on, each chunk is checkpointed so its temporaries are freed after its forward."""
    from torch.utils.checkpoint import checkpoint

    n = tensors[0].shape[0]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    total = None
    for i in range(0, n, chunk):
        parts = [t[i : i + chunk] for t in tensors]
        part = checkpoint(fn, *parts, use_reentrant=False) if grad else fn(*parts)
        total = part if total is None else total + part
    return total


def identity(x: torch.Tensor) -> torch.Tensor:
    """The projection of a model without a head adapter: its outputs as they are."""
    return x


def lm_loss(logits: torch.Tensor, ids: torch.Tensor, project: Projection = identity,
            mask: torch.Tensor | None = None, ignore: torch.Tensor | None = None,
            weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy of logits [B, T, V] for ids [B, T] (T-1 targets per sequence), in chunks of
    positions. The targets are shifted (the last position ignored) rather than the logits sliced, which would copy them.
    `project`: given the final hidden states [B, T, H] instead of logits, the output projection (surgery/training/heads.py).
    `mask` [B, T] (--loss-on assistant): only targets whose token is marked count. `ignore` [B, T]: positions whose
    target is not counted (the student's own generated tokens, onpolicy.py). `weights` [B, T]: how much each
    position's term counts (--retrieval-answer-weight): the sum of weight x term over the counted targets, divided by
    their number (all ones: the plain mean), the convention of every loss here."""
    targets = F.pad(ids[:, 1:] if mask is None else ids[:, 1:].masked_fill(~mask[:, 1:], -100), (0, 1), value=-100)
    if ignore is not None:
        targets = targets.masked_fill(ignore, -100)
    targets = targets.flatten()
    counted = (targets != -100).sum().clamp(min=1)

    def nll(x: torch.Tensor, t: torch.Tensor, *w: torch.Tensor) -> torch.Tensor:
        if not w:
            return F.cross_entropy(project(x).float(), t, ignore_index=-100, reduction="sum")
        return (F.cross_entropy(project(x).float(), t, ignore_index=-100, reduction="none") * w[0]).sum()
    return _chunked_sum(nll, logits.flatten(0, 1), targets, *weight_args(weights)) / counted


def weight_args(weights: torch.Tensor | None, keep: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """The losses' `weights` [B, T] as the extra argument of their chunk function: flattened (the kept positions
    only), float32; none when there are none, so the unweighted path runs its summed kernel."""
    if weights is None:
        return ()
    w = weights.flatten().float()
    return (w if keep is None else w[keep],)


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0,
            project: Projection = identity, project_teacher: Projection = identity, divergence: str = "forward",
            mask: torch.Tensor | None = None, beta: float = 0.5, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over positions of T² · D(teacher ‖ student) on softmax(logits / T) (Hinton et al.'s scaling), computed
    in chunks of positions so that no [positions, V] temporary of the whole batch exists besides the inputs.
    D by `divergence` (surgery/training/divergence.py): forward KL(p_t ‖ p_s) (mass-covering: the student spreads
    over all the teacher's candidates), reverse KL(p_s ‖ p_t) (mode-seeking: the student concentrates on the
    teacher's likeliest tokens, MiniLLM), or jsd, GKD's generalized Jensen-Shannon divergence with `beta`
    (0.5: the symmetric one, ½ KL(p_t ‖ m) + ½ KL(p_s ‖ m), m = ½ (p_t + p_s)). `project` / `project_teacher`: as
    for `lm_loss`, when hidden states are given instead of logits. `mask` [B, T] (--loss-on assistant): only the
    positions predicting a marked token count. `weights` [B, T]: how much each position counts, as in `lm_loss`."""
    check_divergence(divergence, beta)

    def log_probs(s: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_s = F.log_softmax(project(s).float() / temperature, dim=-1)
        with torch.no_grad():
            log_t = F.log_softmax(project_teacher(t).float() / temperature, dim=-1)
        return log_s, log_t

    def term(s: torch.Tensor, t: torch.Tensor, *w: torch.Tensor) -> torch.Tensor:
        if not w:
            return divergence_sum(*log_probs(s, t), divergence, beta)
        return (divergence_per_position(*log_probs(s, t), divergence, beta) * w[0]).sum()

    s, t = student_logits.flatten(0, 1), teacher_logits.flatten(0, 1)
    keep = None
    if mask is not None:
        keep = F.pad(mask[:, 1:], (0, 1), value=False).flatten()
        if not keep.any():  # nothing to distill in this micro-batch: a zero that still reaches every parameter used
            return student_logits.sum() * 0.0
        s, t = s[keep], t[keep]
    return _chunked_sum(term, s, t, *weight_args(weights, keep)) / s.shape[0] * (temperature * temperature)


def hidden_state_loss(student_states: tuple[torch.Tensor, ...], teacher_states: tuple[torch.Tensor, ...]
                      ) -> torch.Tensor:
    """Mean over layers and positions of 1 - cos(h_s, h_t): each layer's output hidden state [B, T, H] against the
    teacher's on the same tokens (the cosine embedding loss of DistilBERT, at every layer). The direction, not the
    norm: residual streams carry a few positions with activations ~100x the others (SmolLM2: norms up to 22,000
    against ~100-500), and a converted model that puts one at another position would make a squared error, even
    one relative to the teacher's norm, a matter of those positions alone (measured: a relative squared error
    of 256 at one SwitchHead position against a median of 0.12, and training on it diverged). The next layer
    normalises its input anyway. The states are the models' `hidden_states` (the embeddings first, then every
    layer's output); the embeddings are left out."""
    if len(student_states) != len(teacher_states):
        raise ValueError(f"{len(student_states)} student hidden states against {len(teacher_states)} of the teacher")
    total = None
    for s, t in zip(student_states[1:], teacher_states[1:]):
        part = (1 - F.cosine_similarity(s.float(), t.detach().float(), dim=-1)).mean()
        total = part if total is None else total + part
    return total / (len(student_states) - 1)


@dataclass(frozen=True)
class Objective:
    kind: str  # lm | kd | mix
    temperature: float = 1.0
    kd_weight: float = 0.5  # mix: kd_weight * kd + (1 - kd_weight) * lm
    hidden_weight: float = 0.0  # > 0: + hidden_weight * hidden_state_loss (needs the teacher's hidden states)
    divergence: str = "forward"  # kd_loss's D: forward / reverse KL or GKD's generalized Jensen-Shannon
    beta: float = 0.5  # jsd: GKD's beta (surgery/training/divergence.py)

    @property
    def needs_teacher(self) -> bool:
        return self.kind in ("kd", "mix") or self.needs_hidden_states

    @property
    def needs_hidden_states(self) -> bool:
        return self.hidden_weight > 0

    def __call__(self, logits: torch.Tensor, ids: torch.Tensor, teacher_logits: torch.Tensor | None = None,
                 project: Projection = identity, project_teacher: Projection = identity,
                 states: tuple[torch.Tensor, ...] | None = None, teacher_states: tuple[torch.Tensor, ...] | None = None,
                 mask: torch.Tensor | None = None, kd_mask: torch.Tensor | None = None,
                 lm_ignore: torch.Tensor | None = None, position_weights: torch.Tensor | None = None):
        """(loss, parts): the loss to minimise and its terms, detached, for logging. `project` / `project_teacher`:
        the output projections when `logits` / `teacher_logits` are final hidden states (see `lm_loss`).
        `states` / `teacher_states`: both models' hidden states, for the hidden-state term (over every position).
        `mask` (--loss-on assistant): the LM and KD terms count only the marked tokens' predictions. `kd_mask` /
        `lm_ignore`: the tokens whose predictions the KD term counts / the positions the LM term leaves out, in a
        micro-batch the student wrote the end of (surgery/training/onpolicy.py).
        `position_weights` [B, T]: how much each position counts in the LM and KD means (--retrieval-answer-weight)."""
        parts: dict[str, torch.Tensor] = {}
        kd_mask = mask if kd_mask is None else (kd_mask if mask is None else mask & kd_mask)
        if self.kind in ("lm", "mix"):
            parts["lm"] = lm_loss(logits, ids, project, mask=mask, ignore=lm_ignore, weights=position_weights)
        if self.kind in ("kd", "mix"):
            parts["kd"] = kd_loss(logits, teacher_logits, self.temperature, project, project_teacher,
                                  self.divergence, mask=kd_mask, beta=self.beta, weights=position_weights)
        if self.kind == "mix":
            loss = self.kd_weight * parts["kd"] + (1 - self.kd_weight) * parts["lm"]
        else:
            loss = parts[self.kind]
        if self.needs_hidden_states:
            parts["hidden"] = hidden_state_loss(states, teacher_states)
            loss = loss + self.hidden_weight * parts["hidden"]
        return loss, {k: v.detach() for k, v in parts.items()}
