"""On-policy distillation (GKD, Agarwal et al. 2024; TRL's GKDTrainer): some micro-batches are text the student
wrote itself, scored by the teacher, so that the student meets its own mistakes in training and learns what the
teacher would do after them. Off-policy KD (the teacher's distributions on the data's text) never shows it those.

`--on-policy P` makes a fraction P of the run's micro-batches on-policy. Micro-batch slot k (= step x micro-batches
per step + m, counted from the end-to-end stage's first step) is one when floor((k + 1) P) > floor(k P): exactly
P of every 1/P slots, evenly spread, the same slots in every process (under FSDP every process generates at the
same time, with the same shapes: the forward passes gather parameters in collectives). In such a micro-batch each
window's first `seq_len - gen_tokens` tokens are the prompt; the student continues all of them together, with its
KV cache, in eval mode and without gradients, sampling at `--gen-temperature` (0: greedy), for `--gen-tokens`
tokens, so the sequence keeps its length. The micro-batch then trains as any other (the teacher's forward on the
same ids), except that the KD term counts only the positions that predict a generated token (TRL's completion
positions: prompt_len - 1 .. seq_len - 2), each micro-batch's weighted mean, and an LM term (--loss mix) counts only
the prompt's targets (never the student's own tokens).

Sampling draws from a generator of its own, seeded from (--seed, step, micro-batch, process): the generator state
is a function of the run's position, which the run state holds (its step), as the learning rate is. A resumed run
samples exactly what the uninterrupted run sampled, and the run's other random streams (saved in every checkpoint:
surgery/training/state.py) are never drawn from. Which slots are on-policy depends on the number of micro-batches per
step, so a resume that changes --micro-batch or the number of processes trains on a different schedule.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from fractions import Fraction

import torch

from ..runtime import cache_keyword, forward_keeping, returned_cache


class OnPolicy:
    def __init__(self, fraction: float, gen_tokens: int, temperature: float, seed: int):
        self.fraction = Fraction(fraction).limit_denominator(1_000_000)
        self.gen_tokens, self.temperature, self.seed = gen_tokens, temperature, seed

    @classmethod
    def of(cls, o) -> "OnPolicy | None":
        """The run's on-policy distillation (UptrainOptions), None when --on-policy is 0."""
        return cls(o.on_policy, o.gen_tokens, o.gen_temperature, o.seed) if o.on_policy else None

    def generates(self, slot: int) -> bool:
        """Whether micro-batch slot `slot` (0-based over the run) is written by the student."""
        n, d = self.fraction.numerator, self.fraction.denominator
        return (slot + 1) * n // d > slot * n // d

    def generator(self, step: int, micro: int, rank: int, device: torch.device) -> torch.Generator:
        """The sampling generator of one micro-batch, a function of the run's seed and position."""
        key = f"surgery-on-policy:{self.seed}:{step}:{micro}:{rank}".encode()
        g = torch.Generator(device=device)
        g.manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1)
        return g

    def rollout(self, model, ids: torch.Tensor, generator: torch.Generator, autocast=contextlib.nullcontext
                ) -> tuple[torch.Tensor, dict, float]:
        """(ids, masks, seconds): the windows `ids` [B, T] with their last gen_tokens tokens replaced by the student's
        continuation of the rest; the loss masks (`Objective`'s kd_mask and lm_ignore); the seconds generating
        took. `model`: the student itself (not a DDP wrapper), `autocast`: the run's autocast context."""
        batch, length = ids.shape
        prompt_len = length - self.gen_tokens
        sync = torch.cuda.synchronize if ids.device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        was_training = model.training
        model.eval()
        try:
            with autocast():
                new = generate(model, ids[:, :prompt_len], self.gen_tokens, self.temperature, generator)
        finally:
            model.train(was_training)
        sync()
        seconds = time.perf_counter() - start
        return torch.cat([ids[:, :prompt_len], new], dim=1), masks(batch, length, prompt_len, ids.device), seconds


def masks(batch: int, length: int, prompt_len: int, device) -> dict:
    """The loss masks of a micro-batch of generated continuations (`Objective`'s): kd_mask [B, T], True at the
    generated tokens (prompt_len .. length - 1), so the KD term is the mean over the positions predicting them;
    lm_ignore [B, T], True at those positions (prompt_len - 1 .. length - 2: their targets are the student's own)."""
    tokens = torch.zeros(batch, length, dtype=torch.bool, device=device)
    tokens[:, prompt_len:] = True
    return {"kd_mask": tokens, "lm_ignore": torch.roll(tokens, -1, dims=1)}


@torch.no_grad()
def generate(model, prompt: torch.Tensor, new_tokens: int, temperature: float = 0.0,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """[B, new_tokens] continuations of `prompt` [B, P] (one length, no padding) with the model's KV cache (a model
    that returns none reads the whole sequence at each token): the
    argmax at temperature 0 (what `model.generate(do_sample=False)` writes, without stopping at end-of-text), else a
    sample of softmax(logits / temperature) drawn from `generator`."""
    out = forward_keeping(model, prompt, 1, use_cache=True)
    cache, keyword = returned_cache(out), cache_keyword(model)
    token = pick(out.logits[:, -1], temperature, generator)
    tokens = [token]
    for _ in range(new_tokens - 1):
        if cache is None:  # a model that keeps no KV cache: the next token from the whole sequence so far
            out = forward_keeping(model, torch.cat([prompt, torch.stack(tokens, dim=1)], dim=1), 1, use_cache=False)
        else:
            out = model(input_ids=token[:, None], use_cache=True, **{keyword: cache})
            cache = returned_cache(out)
        token = pick(out.logits[:, -1], temperature, generator)
        tokens.append(token)
    return torch.stack(tokens, dim=1)


def pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """The next token of every row of logits [B, V]."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def generating_model(model):
    """The module to generate with, given the student unwrapped from accelerate's DDP wrapper (whose forward would
    prepare a gradient reduction): with LoRA, the base model under peft's wrapper (its adapters active)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
