"""One attention block alone: SwitchHead and talking-heads against the source's sdpa attention, SmolLM2-135M shapes.

    python benchmarks/bench_attention_block.py [--lengths 1024 2048] [--rounds 5] [--threads 1] [--device cpu]

Modules with random weights (dim 576; source: 9 query heads, 3 K/V heads, head_dim 64, sdpa; SwitchHead H=3 E=3
k=2 with random routers; talking-heads with random 9x9 mixing matrices, query chunks of 512) on random hidden
states: prefill = one causal forward of T tokens through the block; decode = one token against a KV cache of T
tokens (the cache is cut back to T after each step). The blocks run interleaved in each round and the median of
the rounds is kept, so that load on a shared machine hits all of them alike. Prints ratios against the source.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


from transformers import LlamaConfig  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding  # noqa: E402

from surgery.runtime import cache_keyword  # noqa: E402
from surgery.switchhead.modeling_switchhead import SwitchHeadAttention  # noqa: E402
from surgery.talking_heads.modeling_talking_heads import TalkingHeadsMixing, talking_heads_settings  # noqa: E402


def smollm2_config(attn: str) -> LlamaConfig:
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, num_hidden_layers=1, max_position_embeddings=8192, vocab_size=128)
    config._attn_implementation = attn
    return config


def blocks(device: torch.device, experts: tuple[int, int, int]) -> dict:
    torch.manual_seed(0)
    out = {}
    source = LlamaAttention(smollm2_config("sdpa"), layer_idx=0)
    out["source"] = (source, smollm2_config("sdpa"))
    heads, n_exp, topk = experts
    sh_config = smollm2_config("sdpa")
    sh_config.switchhead = {"heads": heads, "experts": n_exp, "topk": topk, "head_dim": 64}
    sh = SwitchHeadAttention(source, sh_config, sh_config.switchhead)
    with torch.no_grad():
        for p in sh.parameters():
            p.normal_(0, 0.05)
    out["switchhead"] = (sh, sh_config)
    th_config = smollm2_config("talking_heads")
    th_config.talking_heads = {"chunk_size": 512}
    th = LlamaAttention(th_config, layer_idx=0)
    th.load_state_dict(source.state_dict())
    th.talking_heads = TalkingHeadsMixing(talking_heads_settings(th_config))
    with torch.no_grad():
        th.talking_heads.logits_mix.add_(torch.randn(9, 9) * 0.05)
        th.talking_heads.weights_mix.add_(torch.randn(9, 9) * 0.05)
    out["talking-heads"] = (th, th_config)
    return {name: (module.to(device).eval(), config) for name, (module, config) in out.items()}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def time_prefill(module, config, x, rope) -> float:
    cos, sin = rope
    mask = None
    if config._attn_implementation == "talking_heads":
        t = x.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()[None, None]
    sync(x.device)
    start = time.perf_counter()
    module(x, position_embeddings=(cos, sin), attention_mask=mask)
    sync(x.device)
    return time.perf_counter() - start


@torch.no_grad()
def time_decode(module, config, x, rope, steps: int) -> float:
    cos, sin = rope
    t = x.shape[1] - 1
    cache = DynamicCache()
    keyword = cache_keyword(module)  # the attention module's own name for it
    module(x[:, :t], position_embeddings=(cos[:, :t], sin[:, :t]), **{keyword: cache},
           attention_mask=None if config._attn_implementation != "talking_heads"
           else torch.ones(t, t, dtype=torch.bool, device=x.device).tril()[None, None])
    times = []
    for _ in range(steps):
        sync(x.device)
        start = time.perf_counter()
        module(x[:, t:], position_embeddings=(cos[:, t:], sin[:, t:]), **{keyword: cache}, attention_mask=None)
        sync(x.device)
        times.append(time.perf_counter() - start)
        cache.crop(-1)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--decode-steps", type=int, default=20)
    parser.add_argument("--experts", default="3,3,2", help="SwitchHead H,E,k")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--only", nargs="+", help="blocks to run besides the source (switchhead, talking-heads)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    mods = blocks(device, tuple(int(v) for v in args.experts.split(",")))
    if args.only:
        mods = {k: v for k, v in mods.items() if k == "source" or k in args.only}
    rotary = LlamaRotaryEmbedding(smollm2_config("sdpa")).to(device)
    print(f"device {device}, threads {torch.get_num_threads()}, SwitchHead H,E,k = {args.experts}")
    results = {}
    for t in args.lengths:
        x = torch.randn(1, t + 1, 576, device=device)
        rope = rotary(x, torch.arange(t + 1, device=device)[None])
        prefill = {k: [] for k in mods}
        decode = {k: [] for k in mods}
        for name, (module, config) in mods.items():  # warm-up
            time_prefill(module, config, x[:, :t], (rope[0][:, :t], rope[1][:, :t]))
        for r in range(args.rounds):
            names = list(mods) if r % 2 == 0 else list(mods)[::-1]
            for name in names:
                module, config = mods[name]
                prefill[name].append(time_prefill(module, config, x[:, :t], (rope[0][:, :t], rope[1][:, :t])))
                decode[name].append(time_decode(module, config, x, rope, args.decode_steps))
        row = {}
        for name in mods:
            p, d = statistics.median(prefill[name]), statistics.median(decode[name])
            row[name] = {"prefill_s": p, "decode_step_s": d, "prefill_rounds": prefill[name],
                         "decode_rounds": decode[name]}
            ratio = "" if name == "source" else (f"  ratio prefill {p / row['source']['prefill_s']:.3f}x, "
                                                 f"decode {d / row['source']['decode_step_s']:.3f}x")
            print(f"T={t:>5} {name:>13}: prefill {1000 * p:8.2f} ms, decode step {1000 * d:6.3f} ms{ratio}")
        results[t] = row
    if args.json:
        args.json.write_text(json.dumps({"device": str(device), "threads": torch.get_num_threads(),
                                         "experts": args.experts, "lengths": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
