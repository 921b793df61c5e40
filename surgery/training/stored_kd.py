"""Distillation from a stored teacher pass (`surgery uptrain --teacher-logprobs DIR`, surgery/training/teacher_store.py):
no teacher model is loaded; each step reads the stored top-K of its windows, in the order the data path yields them.

The divergence. The stored teacher distribution is known on K + 1 buckets: each of its top-K tokens alone, and the
rest of the vocabulary as one tail bucket (its stored log mass). The student's distribution is coarsened to the same
buckets: its log-softmax gathered at the K stored ids, and the log of its own mass outside them (a logsumexp over the
other logits, exact even when that mass is tiny). The loss is T² · D(p_t^K ‖ p_s^K) between these two (K+1)-bucket
distributions, D by --kd-divergence as in losses.kd_loss (forward KL by default, reverse KL, or Jensen-Shannon),
the teacher's buckets renormalised after their fp16 rounding. By the data-processing inequality it is at most the
full-vocabulary divergence, equal to it when the teacher's tail is empty (K = V: the live KD loss exactly). T is the
temperature the store was made at (the run must use the same).

Position in the store: the run's global sequence g = (align steps + step) · B + rank · B/W + i (B sequences per step,
W processes) is the store's window g, so a resumed run reads on from its step, nothing else saved.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import SurgeryError
from .losses import Objective, Projection, _chunked_sum, identity, weight_args
from .teacher_store import StoredTargets, TeacherStore, spec_difference, tokenizer_identity, window_hash, windows_spec


def bucket_log_probs(student: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor, tail: torch.Tensor,
                     temperature: float = 1.0, project: Projection = identity) -> tuple[torch.Tensor, torch.Tensor]:
    """(student, teacher) log-probabilities [n, K(+1)] on the buckets: the K stored ids, plus the tail unless the
    store holds the whole vocabulary. `student`: logits (or final hidden states with `project`) [n, V or H]."""
    z = project(student).float() / temperature
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    ids = ids.long()
    log_s = z.gather(-1, ids) - lse
    log_t = logprobs.float()
    if ids.shape[-1] < z.shape[-1]:
        rest = torch.logsumexp(z.scatter(-1, ids, -math.inf), dim=-1, keepdim=True) - lse
        log_s = torch.cat([log_s, rest], dim=-1)
        log_t = torch.cat([log_t, tail.float()[..., None]], dim=-1)
    return log_s, log_t - torch.logsumexp(log_t, dim=-1, keepdim=True)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """Σ a (log a - log b) over the buckets of each row [n], a bucket of zero mass (log a = -inf) adding nothing (nor
    a NaN gradient)."""
    live = log_a > -math.inf
    safe_a = torch.where(live, log_a, torch.zeros_like(log_a))
    return torch.where(live, safe_a.exp() * (safe_a - torch.where(live, log_b, torch.zeros_like(log_b))),
                       torch.zeros_like(log_a)).sum(-1)


def stored_kd_loss(student_logits: torch.Tensor, targets: StoredTargets, temperature: float = 1.0,
                   project: Projection = identity, divergence: str = "forward",
                   mask: torch.Tensor | None = None, beta: float = 0.5,
                   weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over positions of T² · D over the K+1 buckets (module docstring); `student_logits` [B, L, V] (or hidden
    states with `project`), `targets` the stored pass of the same B windows. In chunks of positions, as kd_loss.
    `mask` [B, L] (--loss-on assistant): only the positions predicting a marked token count, as in kd_loss. `beta`:
    jsd's (GKD's generalized JSD, surgery/training/divergence.py). `weights` [B, L]: how much each position counts, as in
    losses.lm_loss (--retrieval-answer-weight)."""

    def divergence_rows(s, ids, lp, tail):
        log_s, log_t = bucket_log_probs(s, ids, lp, tail, temperature, project)
        if divergence == "forward":
            return _kl(log_t, log_s)
        if divergence == "reverse":
            return _kl(log_s, log_t)
        if beta == 0:  # GKD's ends, as in surgery/training/divergence.py: forward and reverse KL exactly
            return _kl(log_t, log_s)
        if beta == 1:
            return _kl(log_s, log_t)
        log_m = torch.logaddexp(log_t + math.log(beta), log_s + math.log1p(-beta))
        return beta * _kl(log_t, log_m) + (1 - beta) * _kl(log_s, log_m)

    def term(s, ids, lp, tail, *w):
        rows = divergence_rows(s, ids, lp, tail)
        return (rows * w[0]).sum() if w else rows.sum()

    s = student_logits.flatten(0, 1)
    t = [targets.ids.flatten(0, 1), targets.logprobs.flatten(0, 1), targets.tail.flatten(0, 1)]
    keep = None
    if mask is not None:
        keep = torch.nn.functional.pad(mask[:, 1:], (0, 1), value=False).flatten()
        if not keep.any():  # nothing to distill in this micro-batch: a zero that still reaches every parameter used
            return student_logits.sum() * 0.0
        s, t = s[keep], [x[keep] for x in t]
    return _chunked_sum(term, s, *t, *weight_args(weights, keep)) / s.shape[0] * (temperature * temperature)


@dataclass(frozen=True)
class StoredObjective(Objective):
    """The run's Objective (kd, or mix with the LM loss) with the KD term from the store. The loop hands it each step's
    stored windows (`queue`); each call takes the next micro-batch's and checks them against the ids it trains on."""
    queued: deque = field(default_factory=deque, compare=False, repr=False)

    @property
    def needs_teacher(self) -> bool:
        return False  # no teacher model: the store stands for it

    def queue(self, targets: StoredTargets, micro_batch: int) -> None:
        self.queued.clear()
        for i in range(0, targets.hashes.shape[0], micro_batch):
            self.queued.append(targets[i:i + micro_batch])

    def __call__(self, logits, ids, teacher_logits=None, project: Projection = identity,
                 project_teacher: Projection = identity, states=None, teacher_states=None, mask=None,
                 position_weights=None):
        if not self.queued:
            raise RuntimeError("stored KD: no stored windows queued for this micro-batch")
        targets = self.queued.popleft()
        if not torch.equal(window_hash(ids), targets.hashes):
            raise SurgeryError("--teacher-logprobs: the store's windows are not the ones this run trains on (made from "
                               "other data, tokenizer or order); make the store with the run's data options")
        targets = targets.to(logits.device)
        parts: dict[str, torch.Tensor] = {}
        if self.kind == "mix":
            from .losses import lm_loss

            parts["lm"] = lm_loss(logits, ids, project, mask, weights=position_weights)
        parts["kd"] = stored_kd_loss(logits, targets, self.temperature, project, self.divergence, mask, self.beta,
                                     weights=position_weights)
        loss = parts["kd"] if self.kind == "kd" else self.kd_weight * parts["kd"] + (1 - self.kd_weight) * parts["lm"]
        return loss, {k: v.detach() for k, v in parts.items()}


def objective(o) -> StoredObjective:
    """The objective of a run with --teacher-logprobs (its options' rules refused --loss lm and the rest before)."""
    kind = "kd" if o.loss == "auto" else o.loss
    return StoredObjective(kind, temperature=o.temperature, kd_weight=o.kd_weight, divergence=o.kd_divergence,
                           beta=o.kd_beta)


def first_window(o, step: int, rank: int, world: int) -> int:
    """The store's window of the first sequence process `rank` trains on at optimizer step `step`."""
    return (o.align_steps + step) * o.sequences_per_step + rank * (o.sequences_per_step // world)


def open_for_run(o, student, tokenizer, world: int) -> TeacherStore:
    """The store of --teacher-logprobs, checked against the run before any text is read: the student's tokenizer and
    vocabulary, the windows (data, seq_len, seed, order), the temperature, and enough windows for every step."""
    from .model_io import vocab_size

    store = TeacherStore(Path(o.teacher_logprobs))
    m, flag = store.manifest, f"--teacher-logprobs {o.teacher_logprobs}"
    if m["tokenizer"] != tokenizer_identity(tokenizer):
        raise SurgeryError(f"{flag} was made with another tokenizer than the model's (its ids mean other tokens)")
    if m["vocab"] != vocab_size(student):
        raise SurgeryError(f"{flag} was made by a teacher of {m['vocab']} logits; the model has {vocab_size(student)}")
    if m["seq_len"] != o.seq_len:
        raise SurgeryError(f"{flag} holds windows of {m['seq_len']} tokens; the run has --seq-len {o.seq_len}")
    if m["temperature"] != o.temperature:
        raise SurgeryError(f"{flag} holds the teacher at --temperature {m['temperature']}; the run has "
                           f"--temperature {o.temperature}")
    diff = spec_difference(m["windows_spec"], windows_spec(o, tokenizer, world * max(1, o.data_workers)))
    if diff is not None:
        raise SurgeryError(f"{flag} was made for other training windows ({diff}): make it with the run's data options")
    need = (o.align_steps + o.steps) * o.sequences_per_step
    if store.windows < need:
        raise SurgeryError(f"{flag} holds {store.windows} windows ({store.windows * o.seq_len:,} tokens); the run "
                           f"needs {need} ({need * o.seq_len:,} tokens, --tokens {o.tokens})")
    # the shards of a fresh run's first step now; each other shard when the run first opens it, before any use
    store.check_all((o.align_steps + 1) * o.sequences_per_step)
    return store


def record(store: TeacherStore) -> dict:
    """The uptraining record's account of the store."""
    m = store.manifest
    return {"folder": str(store.folder), "teacher": m["teacher"], "top_k": m["top_k"], "windows": m["windows"],
            "temperature": m["temperature"],
            "bytes_per_token": m["bytes_per_token"], "tokenizer": m["tokenizer"]}
