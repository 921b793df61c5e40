"""The output projection taken out of the model's forward, so the losses apply it chunk by chunk.

A causal LM's logits for a micro-batch are [B, T, V] floats (SmolLM2, 4 x 256 positions: 200 MB), and training
keeps three such tensors alive (the student's logits, their gradient, the teacher's logits) besides the softmax
temporaries. With `OutputHead.returning_hidden()` the model returns its final hidden states [B, T, H] instead
(H = 576 for SmolLM2: 85x smaller), and the losses project one chunk of positions at a time inside an
activation checkpoint (surgery/training/losses.py): no [B, T, V] tensor of the whole micro-batch ever exists.

This holds only for models whose logits are exactly `output_embeddings(what the model feeds it)` up to steps that
commute with it: a logit scale (Cohere, Granite) comes back applied to the hidden states and passes, soft-capping
(Gemma 2) or any other non-linear step after the projection does not. `OutputHead.of` checks that on a
short input (the logits of the model and of the projected hidden states must agree) and returns None otherwise;
the loop then falls back to whole logits (the losses still chunk their softmax temporaries). The probe runs in
float32 whatever the run's precision: the model class's own forward (not accelerate's mixed-precision wrapper on the
instance) with autocast off, so that a bf16 run's rounding is not mistaken for a step after the projection.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

PROBE_TOKENS = 8


class OutputHead:
    def __init__(self, module: torch.nn.Linear):
        self.module = module

    @contextlib.contextmanager
    def returning_hidden(self):
        """Within the block, the model's `.logits` are its final hidden states (the projection is skipped)."""
        self.module.forward = _identity  # an instance attribute: nn.Module.__call__ finds it before the class's
        try:
            yield
        finally:
            del self.module.forward

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.module.weight, self.module.bias)

    @classmethod
    @torch.no_grad()
    def of(cls, model, vocab_size: int) -> "OutputHead | None":
        """The model's output projection when its logits are exactly that projection of what it feeds it, else None."""
        module = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if type(module) is not torch.nn.Linear or module.weight.shape[0] != vocab_size:
            return None
        head = cls(module)
        was_training = model.training
        model.eval()
        try:
            device = module.weight.device
            ids = torch.arange(PROBE_TOKENS, device=device)[None] % vocab_size
            forward = type(model).forward  # the class's: accelerate's bf16 autocast wraps the instance's forward
            with torch.autocast(device.type, enabled=False):
                logits = forward(model, input_ids=ids, use_cache=False).logits
                with head.returning_hidden():
                    hidden = forward(model, input_ids=ids, use_cache=False).logits
                if hidden.shape[-1] != module.weight.shape[1]:
                    return None
                same = torch.allclose(head.project(hidden).float(), logits.float(), rtol=1e-4, atol=1e-4)
        except Exception:  # any model whose forward does not take it: whole logits
            return None
        finally:
            model.train(was_training)
        return head if same else None


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x
