"""The two passes of a check, without whole-window logits: each model returns its final hidden states and the
logits exist one slice of positions at a time.

A causal LM's logits for a chunk of windows are batch x length x vocabulary floats: SmolLM2-135M (49,152 ids)
over one window of 8,192 tokens, 1.6 GB; a 128k-token window of a 128k-id vocabulary, 64 GB. Neither model ever
returns them here. Where the model's logits are exactly its output projection of its final hidden states
(surgery/training/heads.py `OutputHead.of` probes that), the model runs with the projection skipped:

- the source pass keeps its hidden states (batch x length x hidden: 85x smaller than SmolLM2's logits) in the
  spill store, and a copy of its output projection (a `Projection`: vocabulary x hidden, in the model's dtype);
- the converted pass projects the stored hidden states and its own, one slice of positions at a time, and the
  metrics take that slice; then the slice is dropped.

The projection runs in the dtype and under the autocast the model's own head would (hidden states are stored in
float32, which holds a bf16 or fp16 value exactly), so the logits are the model's to float rounding. A model whose
logits are not a plain projection (soft-capping after it, a head that is not an nn.Linear) returns whole logits,
the old way (`Projection` None); encoders are compared on their hidden states.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import SurgeryError
from ..progress import Progress
from ..training.heads import OutputHead
from .positions import window_positions
from .spill import SpillStore

SLICE_BYTES = 64 << 20  # metrics are computed on slices of positions whose float32 logits are this large
IGNORE = -100  # target of a window's last position (no next token inside the window)


@dataclass
class Projection:
    """A model's output projection (logits = hidden @ weight.T + bias), held apart from the model."""

    weight: torch.Tensor  # (vocabulary, hidden)
    bias: torch.Tensor | None = None

    @classmethod
    def of(cls, model, vocab: int, keep: bool = False) -> "Projection | None":
        """The model's head when its logits are exactly that projection (else None); `keep`: a copy that outlives
        the model (the source's, used after the source is freed)."""
        head = OutputHead.of(model, vocab)
        if head is None:
            return None
        weight, bias = head.module.weight.detach(), head.module.bias
        bias = bias.detach() if bias is not None else None
        if keep:
            weight, bias = weight.clone(), bias.clone() if bias is not None else None
        return cls(weight, bias)

    @property
    def vocab(self) -> int:
        return self.weight.shape[0]

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.to(self.weight.device, self.weight.dtype), self.weight, self.bias)


def next_token_targets(input_ids: torch.Tensor) -> torch.Tensor:
    targets = torch.full_like(input_ids, IGNORE)
    targets[:, :-1] = input_ids[:, 1:]
    return targets


def slice_rows(width: int) -> int:
    return max(1, SLICE_BYTES // (4 * max(width, 1)))


def outputs(model, x: torch.Tensor, causal: bool) -> torch.Tensor:
    out = model(input_ids=x)
    return out.logits if causal else out.last_hidden_state


def hidden_outputs(model, x: torch.Tensor, head: Projection | None, causal: bool) -> torch.Tensor:
    """The model's final hidden states for `x` where `head` projects them (its logits skipped), else its outputs."""
    if head is None:
        return outputs(model, x, causal)
    with returning_hidden(model):
        return outputs(model, x, causal)


@contextlib.contextmanager
def returning_hidden(model):
    with OutputHead(model.get_output_embeddings()).returning_hidden():
        yield


@torch.no_grad()
def source_pass(model, batches: torch.Tensor, batch_size: int, store: SpillStore, device: torch.device, causal: bool,
                progress: bool, desc: str, prefix: str = "", head: Projection | None = None) -> None:
    """The source's outputs for every chunk of windows, into `store` (float32) under the keys prefix + chunk: its
    final hidden states where `head` projects them, else its logits (or an encoder's hidden states)."""
    with Progress(batches.numel(), desc, enabled=progress) as bar:
        for k, start in enumerate(range(0, batches.shape[0], batch_size)):
            x = batches[start:start + batch_size].to(device)
            store.put(f"{prefix}{k}", hidden_outputs(model, x, head, causal))
            bar.update(x.numel())


@torch.no_grad()
def converted_pass(model, batches: torch.Tensor, batch_size: int, store: SpillStore, device: torch.device,
                   causal: bool, progress: bool, desc: str, acc, prefix: str = "",
                   source_head: Projection | None = None, head: Projection | None = None):
    """The converted model's outputs for every chunk, compared slice by slice with what `source_pass` stored under
    the same `prefix` (`source_head`: the projection of the source's stored hidden states, None when it stored
    logits); `head`: the converted model's own projection (None: it returns whole logits). Adds to `acc`."""
    with Progress(batches.numel(), desc, enabled=progress) as bar:
        for k, start in enumerate(range(0, batches.shape[0], batch_size)):
            key = f"{prefix}{k}"
            x = batches[start:start + batch_size].to(device)
            out = hidden_outputs(model, x, head, causal)
            check_shapes(store.shape(key), source_head, tuple(out.shape), head)
            rows = out.reshape(-1, out.shape[-1])
            targets = next_token_targets(x).reshape(-1)
            positions = window_positions(*x.shape)
            step = slice_rows(head.vocab if head is not None else rows.shape[-1])
            for r in range(0, rows.shape[0], step):
                a = store.rows(key, r, min(r + step, rows.shape[0])).to(device)
                b = rows[r:r + step]
                if source_head is not None:
                    a = source_head(a)
                if head is not None:
                    b = head(b)
                if causal:
                    acc.add_logit_rows(a, b, targets[r:r + step], positions[r:r + step])
                else:
                    acc.add_outputs(a, b)
                del a, b
            del out, rows
            bar.update(x.numel())
    return acc


def check_shapes(stored: tuple, source_head: Projection | None, out: tuple, head: Projection | None) -> None:
    """The two models' logits (or hidden states) for a chunk have the same shape."""
    a = stored[:-1] + (source_head.vocab,) if source_head is not None else stored
    b = out[:-1] + (head.vocab,) if head is not None else out
    if a != b:
        raise SurgeryError(f"the converted model's outputs have shape {list(b)}, the source's {list(a)}")
