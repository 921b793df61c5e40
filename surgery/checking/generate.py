"""Greedy continuations: does the converted model write what the source writes?

Perplexity and log-likelihood can rank models differently from generation, so `check --generate N` lets both
models continue the same prompts for N tokens, greedily (argmax, no sampling, no stop at end-of-text, so every
continuation has exactly N tokens), one model after the other. Prompts are cut out of the evaluation text (evenly
spaced, `PROMPT_TOKENS` tokens each) and read from a `--prompts` file (one prompt a line).

Metrics, over all prompts: token agreement (same token at the same position of the two continuations), the mean
position of the first divergence (N when they never diverge), the exact-match rate of whole continuations, and a
side-by-side sample of a few continuations.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SurgeryError
from ..kvcache import cache_keyword, returned_cache

PROMPT_TOKENS = 32
TEXT_PROMPTS = 8
SAMPLES = 3


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    origin: str  # "text[START:END]" (token positions in the evaluation stream) or "FILE:LINE"


def prompts_from_stream(ids: torch.Tensor, count: int = TEXT_PROMPTS, length: int = PROMPT_TOKENS) -> list[Prompt]:
    """`count` prompts of `length` tokens at evenly spaced positions of the evaluation token stream."""
    n = ids.numel()
    length = min(length, n)
    if count <= 0 or length <= 0:
        return []
    last = n - length
    starts = sorted({round(i * last / max(count - 1, 1)) for i in range(count)}) if count > 1 else [0]
    return [Prompt(tuple(ids[s:s + length].tolist()), f"text[{s}:{s + length}]") for s in starts]


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
    """(batch, new_tokens) argmax continuations of `prompt` (batch, length), with the model's KV cache."""
    out = model(input_ids=prompt, use_cache=True)
    past, keyword = returned_cache(out), cache_keyword(model)
    token = out.logits[:, -1].argmax(-1)
    tokens = [token]
    for _ in range(new_tokens - 1):
        out = model(input_ids=token[:, None], use_cache=True, **{keyword: past})
        past = returned_cache(out)
        token = out.logits[:, -1].argmax(-1)
        tokens.append(token)
    return torch.stack(tokens, dim=1)


def continue_prompts(model, prompts: list[Prompt], new_tokens: int, batch_size: int, device: torch.device,
                     progress=None) -> list[list[int]]:
    """Every prompt's greedy continuation; prompts of one length are batched together."""
    results: list[list[int] | None] = [None] * len(prompts)
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(len(p.ids), []).append(i)
    for indices in by_length.values():
        for start in range(0, len(indices), batch_size):
            chunk = indices[start:start + batch_size]
            x = torch.tensor([prompts[i].ids for i in chunk], dtype=torch.long, device=device)
            for i, row in zip(chunk, greedy(model, x, new_tokens).tolist()):
                results[i] = row
            if progress is not None:
                progress.update(len(chunk) * new_tokens)
    return results  # type: ignore[return-value]


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare_continuations(prompts: list[Prompt], source: list[list[int]], converted: list[list[int]], tokenizer,
                          new_tokens: int, samples: int = SAMPLES) -> dict:
    same = sum(x == y for a, b in zip(source, converted) for x, y in zip(a, b))
    total = sum(len(a) for a in source)
    divergence = [first_divergence(a, b) for a, b in zip(source, converted)]
    exact = sum(a == b for a, b in zip(source, converted))

    def text(ids) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=False)

    shown = [{"origin": p.origin, "prompt": text(p.ids), "source": text(a), "converted": text(b),
              "first_divergence": d}
             for p, a, b, d in list(zip(prompts, source, converted, divergence))[:samples]]
    return {"new_tokens": new_tokens, "prompts": len(prompts),
            "prompt_origins": sorted({p.origin.split("[")[0].split(":")[0] for p in prompts}),
            "token_agreement": same / total if total else 1.0,
            "mean_first_divergence": sum(divergence) / len(divergence) if divergence else float(new_tokens),
            "exact_match_rate": exact / len(prompts) if prompts else 1.0,
            "samples": shown}
