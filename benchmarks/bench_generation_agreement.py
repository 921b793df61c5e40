"""Greedy-continuation agreement of a conversion against the source's self-agreement baseline (issue 15 §2).

Greedy decoding is chaotic: two runs of the very same source model that differ only in rounding (float32 and
bfloat16) agree on the first tokens of a continuation and then drift apart. That self-agreement is the baseline a
conversion is held to: the converted model's token agreement with the source (both float32, what `surgery check
--generate` reports) divided by the source's agreement with itself in bfloat16. Target: >= 0.8.

Prompts: `--prompts` windows of `--prompt-len` tokens (32), evenly spaced over pydoc's first `--tokens` tokens
(`surgery check`'s default evaluation text, which no calibration reads; give `--tokens 4096` for models uptrained by
bench_uptrain_recovery.py, which holds out only pydoc's first 4,096 tokens). One model in memory at a time.

Each model is also fed the source's float32 continuations and asked for its argmax at every step (forced
agreement, by the source's margin between its two most probable tokens: surgery/checking/generate.py), the per-step
quantity that greedy agreement compounds; and fed the text's own continuation of each prompt, where its argmax is
compared with the source's (top-1 agreement off the source's path: an exposure-bias gap would show as a lower
forced agreement than this).

    python benchmarks/bench_generation_agreement.py SOURCE CONVERTED [CONVERTED ...] [--new 32] [--prompts 16] \
        [--prompt-len 32]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


from surgery.runtime import load_model, load_tokenizer  # noqa: E402
from surgery.checking import generate as gen  # noqa: E402
from surgery.data import pydoc_texts, token_stream  # noqa: E402
from surgery.checkpoint.source import resolve_source  # noqa: E402
from surgery.trust import resolve_trust  # noqa: E402


def continuations(spec: str, dtype: str, prompts, new: int, device: torch.device, text_next, reference=None):
    """The model's greedy continuations; its argmax and margin at every step of `reference` (the source's float32
    continuations; its own when None) fed as input; its argmax at every step of the text's own continuations."""
    source = resolve_source(spec)
    model = load_model(source, device, dtype, resolve_trust(source.folder, False, what=spec))
    out = gen.continue_prompts(model, prompts, new, 8, device)
    argmax, margin = gen.forced_steps(model, prompts, reference or out, 8, device)
    on_text, _ = gen.forced_steps(model, prompts, text_next, 8, device)
    del model
    return out, argmax, margin, on_text


def print_forced(name: str, forced: dict) -> None:
    by_margin = ", ".join(f"{b['margin'][0]:g}-{b['margin'][1]:g}: {b['agreement']:.1%} of {b['steps']}"
                          for b in forced["forced_by_margin"] if b["steps"])
    print(f"  {name}: forced agreement on the source's continuations {forced['forced_agreement']:.1%} (on the "
          f"text's own continuations: {forced['agreement_on_text_continuation']:.1%}); by the source's margin "
          f"{by_margin}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source")
    p.add_argument("converted", nargs="+")
    p.add_argument("--new", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt (the continuation starts at this "
                   "position: `surgery check`'s by-position table says how top-1 agreement varies with it)")
    p.add_argument("--tokens", type=int, default=16384, help="the evaluation text the prompts are cut from")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(resolve_source(a.source))
    ids = token_stream(pydoc_texts(), tokenizer, a.tokens + a.new)  # the text's own continuation of the last prompt
    prompts = gen.prompts_from_stream(ids[:a.tokens], count=a.prompts, length=a.prompt_len)
    text_next = [ids[p.start + len(p.ids):p.start + len(p.ids) + a.new].tolist() for p in prompts]

    reference, _, margin, source_on_text = continuations(a.source, "float32", prompts, a.new, device, text_next)
    rounded, rounded_argmax, _, rounded_on_text = continuations(a.source, "bfloat16", prompts, a.new, device,
                                                                 text_next, reference)
    baseline = gen.compare_continuations(prompts, reference, rounded, tokenizer, a.new, samples=0) | \
        gen.compare_forced(reference, margin, rounded_argmax)
    baseline["agreement_on_text_continuation"] = gen.token_agreement(source_on_text, rounded_on_text)
    print(f"source float32 vs source bfloat16 (the self-agreement baseline): token agreement "
          f"{baseline['token_agreement']:.1%}, first divergence at {baseline['mean_first_divergence']:.1f} of {a.new}")
    print_forced("source bfloat16", baseline)
    result = {"source": a.source, "new_tokens": a.new, "prompts": len(prompts), "prompt_tokens": a.prompt_len,
              "text": f"pydoc[0:{a.tokens}]",
              "baseline": baseline, "converted": {}}
    for spec in a.converted:
        out, argmax, _, on_text = continuations(spec, "float32", prompts, a.new, device, text_next, reference)
        r = gen.compare_continuations(prompts, reference, out, tokenizer, a.new, samples=0) | \
            gen.compare_forced(reference, margin, argmax)
        r["agreement_on_text_continuation"] = gen.token_agreement(source_on_text, on_text)
        r["relative_to_baseline"] = r["token_agreement"] / baseline["token_agreement"]
        result["converted"][spec] = r
        print(f"{spec}: token agreement {r['token_agreement']:.1%} ({r['relative_to_baseline']:.2f}x the baseline; "
              f"target >= 0.8), first divergence at {r['mean_first_divergence']:.1f}")
        print_forced(spec, r)
    if a.json:
        a.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
