"""Decode steps of several checkpoints alternated step by step: finer than `surgery bench`'s rounds on a busy machine.

    python benchmarks/bench_decode_steps.py --context 2048 --batch 1 --steps 40 src=smollm2 sh=DIR/switchhead
    python benchmarks/bench_decode_steps.py --context 512 old=DIR/a new=DIR/b --trust-remote-code

Every model is prefilled once with the same random tokens (batch x context), then decode steps on that cache are
timed with the models taking turns every step (the order rotates), and each step's token is cropped off the cache
again so that every step sees the same context. Prints per model the median and mean step time and the time spent
in the attention and MLP modules (forward hooks), and the ratios to the first model. `surgery bench` measures the
whole prefill + decode per round instead; use this one when the load swings faster than a round.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch


from surgery.runtime import cache_keyword, load_model, returned_cache
from surgery.checkpoint.source import resolve_source


def load(spec: str, trust: bool):
    source = resolve_source(spec)
    custom = bool(source.config.get("auto_map"))
    if custom and not trust:
        sys.exit(f"{spec} ships its own modeling code: pass --trust-remote-code")
    return load_model(source, torch.device("cpu"), "float32", trust_remote_code=custom,
                      attn_implementation=None if custom else "sdpa")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="NAME=SOURCE; the first is the baseline")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--trust-remote-code", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    specs = dict(m.split("=", 1) for m in args.models)
    models = {name: load(spec, args.trust_remote_code) for name, spec in specs.items()}
    spent = {name: collections.defaultdict(float) for name in models}
    started = {}
    for name, model in models.items():
        for layer in model.model.layers:
            for part in ("self_attn", "mlp"):
                module = getattr(layer, part)
                module.register_forward_pre_hook(lambda *a, p=part: started.__setitem__(p, time.perf_counter()))
                module.register_forward_hook(
                    lambda *a, p=part, n=name: spent[n].__setitem__(p, spent[n][p] + time.perf_counter() - started[p]))
    gen = torch.Generator().manual_seed(0)
    vocab = min(m.config.vocab_size for m in models.values())
    ids = torch.randint(0, vocab, (args.batch, args.context), generator=gen)
    step_ids = torch.randint(0, vocab, (args.batch, 1), generator=gen)
    times = {name: [] for name in models}
    with torch.no_grad():
        caches = {name: returned_cache(m(input_ids=ids, use_cache=True, logits_to_keep=1)) for name, m in models.items()}
        keyword = {name: cache_keyword(m) for name, m in models.items()}
        for name, m in models.items():  # warm-up step
            m(input_ids=step_ids, use_cache=True, **{keyword[name]: caches[name]})
            caches[name].crop(-1)
            spent[name].clear()
        names = list(models)
        for step in range(args.steps):
            for name in names[step % len(names):] + names[: step % len(names)]:
                start = time.perf_counter()
                models[name](input_ids=step_ids, use_cache=True, **{keyword[name]: caches[name]})
                times[name].append(time.perf_counter() - start)
                caches[name].crop(-1)
    base = names[0]
    print(f"batch {args.batch}, context {args.context}, {args.steps} steps alternated, {args.threads} thread(s)")
    for name in names:
        med = statistics.median(times[name])
        parts = ", ".join(f"{p} {1000 * t / args.steps:.1f} ms" for p, t in spent[name].items())
        ratio = "" if name == base else (
            f"  step x {med / statistics.median(times[base]):.3f}, decode speed-up "
            f"{statistics.median(times[base]) / med:.3f}x, attention x "
            f"{spent[name]['self_attn'] / spent[base]['self_attn']:.3f}")
        print(f"{name}: step median {1000 * med:.1f} ms, mean {1000 * statistics.mean(times[name]):.1f} ms ({parts})"
              f"{ratio}")


if __name__ == "__main__":
    main()
