"""Greedy continuations: does the converted model write what the source writes?

Perplexity and log-likelihood can rank models differently from generation, so `check --generate N` lets both
models continue the same prompts for N tokens, greedily (argmax, no sampling, no stop at end-of-text, so every
continuation has exactly N tokens), one model after the other. Prompts are cut out of the evaluation text (evenly
spaced, `PROMPT_TOKENS` tokens each) and read from a `--prompts` file (one prompt a line).

Metrics, over all prompts: token agreement (same token at the same position of the two continuations), the mean
position of the first divergence (N when they never diverge), the exact-match rate of whole continuations, and a
side-by-side sample of a few continuations.

Greedy agreement compounds: one different argmax and the two continuations go separate ways. The per-step quantity
behind it is the forced agreement: the converted model fed the source's own continuation (prompt + the source's
tokens, no sampling of its own) and asked for its argmax at every step, the same prefix as the source's each time.
It is given by the source's margin at that step (its most probable token's probability minus the second's): where
the source itself hesitates (small margin), any change to the logits flips the argmax, so greedy agreement needs
near-exact logits there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SurgeryError
from ..runtime import cache_keyword, forward_keeping, returned_cache

PROMPT_TOKENS = 32
TEXT_PROMPTS = 8
SAMPLES = 3
MARGIN_EDGES = (0.0, 0.1, 0.3, 0.6, 1.0)  # buckets of the source's top-1 minus top-2 probability


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    origin: str  # "text[START:END]" (token positions in the evaluation stream) or "FILE:LINE"
    start: int | None = None  # START of a prompt cut from the stream (None for a prompt from a file)


def prompts_from_stream(ids: torch.Tensor, count: int = TEXT_PROMPTS, length: int = PROMPT_TOKENS) -> list[Prompt]:
    """`count` prompts of `length` tokens at evenly spaced positions of the evaluation token stream."""
    n = ids.numel()
    length = min(length, n)
    if count <= 0 or length <= 0:
        return []
    last = n - length
    starts = sorted({round(i * last / max(count - 1, 1)) for i in range(count)}) if count > 1 else [0]
    return [Prompt(tuple(ids[s:s + length].tolist()), f"text[{s}:{s + length}]", s) for s in starts]


def prompts_from_file(path: Path, tokenizer) -> list[Prompt]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SurgeryError(f"cannot read --prompts {path}: {e}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            ids = tokenizer(line, add_special_tokens=False)["input_ids"]
            if ids:
                prompts.append(Prompt(tuple(ids), f"{Path(path).name}:{number}"))
    if not prompts:
        raise SurgeryError(f"--prompts {path} holds no prompt (one prompt a line)")
    return prompts


def check_lengths(prompts: list[Prompt], new_tokens: int, context: int | None) -> None:
    if context is None:
        return
    longest = max(len(p.ids) for p in prompts)
    if longest + new_tokens > context:
        raise SurgeryError(f"--generate {new_tokens} after a prompt of {longest} tokens exceeds the model's context "
                           f"of {context} tokens")


@torch.no_grad()
def greedy(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """(batch, new_tokens) argmax continuations of `prompt` (batch, length), with the model's KV cache; the prompt's
    pass keeps its last position's logits only (`logits_to_keep`, where the model takes it): never a whole prompt
    of vocabulary logits."""
    out = forward_keeping(model, prompt, 1, use_cache=True)
    past, keyword = returned_cache(out), cache_keyword(model)
    token = out.logits[:, -1].argmax(-1)
    tokens = [token]
    for _ in range(new_tokens - 1):
        out = model(input_ids=token[:, None], use_cache=True, **{keyword: past})
        past = returned_cache(out)
        token = out.logits[:, -1].argmax(-1)
        tokens.append(token)
    return torch.stack(tokens, dim=1)


def same_key_batches(keys: list, batch_size: int):
    """Batches of indices into `keys`, every batch of one key (a prompt length: no padding needed), at most
    `batch_size` long."""
    groups: dict = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    for indices in groups.values():
        for start in range(0, len(indices), batch_size):
            yield indices[start:start + batch_size]


def _by_length(prompts: list[Prompt], batch_size: int):
    """Batches of prompt indices, every batch of one prompt length."""
    return same_key_batches([len(p.ids) for p in prompts], batch_size)


def continue_prompts(model, prompts: list[Prompt], new_tokens: int, batch_size: int, device: torch.device,
                     progress=None) -> list[list[int]]:
    """Every prompt's greedy continuation; prompts of one length are batched together."""
    results: list[list[int] | None] = [None] * len(prompts)
    for chunk in _by_length(prompts, batch_size):
        x = torch.tensor([prompts[i].ids for i in chunk], dtype=torch.long, device=device)
        for i, row in zip(chunk, greedy(model, x, new_tokens).tolist()):
            results[i] = row
        if progress is not None:
            progress.update(len(chunk) * new_tokens)
    return results  # type: ignore[return-value]


@torch.no_grad()
def forced_steps(model, prompts: list[Prompt], paths: list[list[int]], batch_size: int,
                 device: torch.device) -> tuple[list[list[int]], list[list[float]]]:
    """The model fed every prompt followed by its `paths` continuation (one forward, no cache): at each step of the
    continuation, the model's argmax and its margin (top-1 minus top-2 probability)."""
    argmax: list[list[int] | None] = [None] * len(prompts)
    margin: list[list[float] | None] = [None] * len(prompts)
    for chunk in _by_length(prompts, batch_size):
        n = len(prompts[chunk[0]].ids)
        x = torch.tensor([list(prompts[i].ids) + paths[i] for i in chunk], dtype=torch.long, device=device)
        logits = model(input_ids=x).logits[:, n - 1:-1].float()
        top = logits.topk(2, dim=-1)
        probs = (top.values - logits.logsumexp(-1, keepdim=True)).exp()  # the two largest probabilities, no softmax
        for row, i in enumerate(chunk):
            argmax[i] = top.indices[row, :, 0].tolist()
            margin[i] = (probs[row, :, 0] - probs[row, :, 1]).tolist()
    return argmax, margin  # type: ignore[return-value]


def compare_forced(source: list[list[int]], source_margin: list[list[float]], converted_argmax: list[list[int]]) -> dict:
    """Forced agreement: how often the converted model's argmax on the source's continuation is the source's token,
    overall and by the source's margin at that step (MARGIN_EDGES; the last bucket includes 1)."""
    steps = [(m, x == y) for a, ms, b in zip(source, source_margin, converted_argmax) for x, m, y in zip(a, ms, b)]
    buckets = []
    for k, (lo, hi) in enumerate(zip(MARGIN_EDGES, MARGIN_EDGES[1:])):
        last = k == len(MARGIN_EDGES) - 2
        inside = [same for m, same in steps if lo <= m and (m < hi or last)]
        buckets.append({"margin": [lo, hi], "steps": len(inside),
                        "agreement": sum(inside) / len(inside) if inside else None})
    return {"forced_agreement": sum(same for _, same in steps) / len(steps) if steps else 1.0,
            "forced_by_margin": buckets}


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def token_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """How often `b` has `a`'s token at the same step (over every step of `a`; 1 when `a` has none)."""
    total = sum(len(row) for row in a)
    return sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb)) / total if total else 1.0


def compare_continuations(prompts: list[Prompt], source: list[list[int]], converted: list[list[int]], tokenizer,
                          new_tokens: int, samples: int = SAMPLES) -> dict:
    divergence = [first_divergence(a, b) for a, b in zip(source, converted)]
    exact = sum(a == b for a, b in zip(source, converted))

    def text(ids) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=False)

    shown = [{"origin": p.origin, "prompt": text(p.ids), "source": text(a), "converted": text(b),
              "first_divergence": d}
             for p, a, b, d in list(zip(prompts, source, converted, divergence))[:samples]]
    return {"new_tokens": new_tokens, "prompts": len(prompts),
            "prompt_origins": sorted({p.origin.split("[")[0].split(":")[0] for p in prompts}),
            "token_agreement": token_agreement(source, converted),
            "mean_first_divergence": sum(divergence) / len(divergence) if divergence else float(new_tokens),
            "exact_match_rate": exact / len(prompts) if prompts else 1.0,
            "samples": shown}
