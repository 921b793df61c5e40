"""Talking-heads and SwitchHead forwards on the paths written for GPUs against the paths before them, in one run:
host syncs per forward, graph breaks under torch.compile, and the time ratio new / old.

    python benchmarks/bench_gpu_paths.py [--length 1024] [--repeats 5] [--threads N]

Models: the tiny random Llama (2 layers, hidden 64, 8 heads) and a random Llama of SmolLM2-135M's layer shapes
(hidden 576, 9 query heads, 3 K/V heads of 64, 2 layers, a 96-token vocabulary), each converted to talking-heads
(identity mixing) and to SwitchHead (k=2 of E experts per head: H=3, E=3 for SmolLM2's shapes, H=2, E=4 for the tiny
model; calibrated on 1,024 tokens).

Paths, switched inside the checkpoint's own copy of the modeling code:
- talking-heads old = `block_plan("cpu")` (cache-sized blocks, each block's key range read on the host: what every
  device ran before), new = `block_plan("cuda")` (memory-sized blocks, masked on the device), both run here on CPU;
- SwitchHead old = the sort-and-loop grouped GEMM it had before (copied below: `bincount(...).tolist()` and a Python
  loop over the H*E experts), new = the block-padded batched matmul now shipped. Routing is only taken above
  DENSE_TOKENS (128) tokens a call, so the forwards here are batch 1 x --length tokens.

Syncs: calls that would wait for a GPU (`surgery.testing.host_syncs`), counted on CPU from the modeling file and
this file. Graph breaks: `torch._dynamo.explain` at 256 tokens (the tiny models only: explaining is slow).
`--experts-only`: SwitchHead's two expert computations alone at SmolLM2's shapes, old vs new, at 512, --length and
4 x --length tokens (median of 10 x --repeats).
Time: forwards alternated old/new after a warm-up, median of --repeats, in no-grad fp32 on this CPU; on a GPU the
syncs and the Python loop are what costs, which a CPU cannot show: the ratio here says what the new paths cost
where they were not needed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers as tf

from surgery.checkpoint.source import resolve_source
from surgery.switchhead import convert_to_switchhead
from surgery.switchhead.options import SwitchHeadOptions
from surgery.talking_heads import convert_to_talking_heads
from surgery.talking_heads.options import TalkingHeadsOptions
from surgery.testing import tiny_models as tm
from surgery.testing.host_syncs import count_host_syncs, graph_breaks
from surgery.testing.switchhead_loop import loop_outputs, loop_values


# --- SwitchHead's routed experts before (main at 990b1b1: surgery.testing.switchhead_loop) ------------------------
def old_expert_values(msh):
    new = msh.expert_values

    def expert_values(experts, x, gates, index):
        if index is None or x.shape[0] <= msh.DENSE_TOKENS:
            return new(experts, x, gates, index)
        return loop_values(msh, experts.weight, experts.bias, x, gates, index)

    return expert_values


def old_expert_outputs(msh):
    new = msh.expert_outputs

    def expert_outputs(experts, a, gates, index):
        if index is None or a.shape[0] <= msh.DENSE_TOKENS:
            return new(experts, a, gates, index)
        return loop_outputs(msh, experts.weight, a, gates, index)

    return expert_outputs


# --- models and paths ------------------------------------------------------------------------------------------------
def smollm2_sized(folder: Path) -> Path:
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=tm.VOCAB, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                            num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=4096,
                            rope_theta=100000.0, **tm.TOKENS)
    tf.LlamaForCausalLM(config).save_pretrained(folder)
    tm.char_tokenizer(folder)
    return folder


def converted(source: Path, kind: str, out: Path):
    if kind == "talking-heads":
        convert_to_talking_heads(resolve_source(str(source)), out, TalkingHeadsOptions(), progress=False)
    else:
        heads = 3 if "smol" in source.name else 2  # SmolLM2's 9 heads: 3 x 3; the tiny Llama's 8: 2 x 4
        options = SwitchHeadOptions(heads=heads, experts=9 // 3 if heads == 3 else 4, topk=2, calib=["pydoc"],
                                    calib_tokens=1024)
        convert_to_switchhead(resolve_source(str(source)), out, options, progress=False)
    return tf.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()


def paths(model, kind: str) -> dict:
    """{"old": switch, "new": switch}: each sets the shipped module to that path."""
    shipped = sys.modules[type(model).__module__]
    if kind == "talking-heads":
        plan = shipped.block_plan
        return {"old": lambda: setattr(shipped, "block_plan", lambda _: plan("cpu")),
                "new": lambda: setattr(shipped, "block_plan", lambda _: plan("cuda"))}
    values, outputs = shipped.expert_values, shipped.expert_outputs
    old = (old_expert_values(shipped), old_expert_outputs(shipped))

    def use(v, o):
        shipped.expert_values, shipped.expert_outputs = v, o

    return {"old": lambda: use(*old), "new": lambda: use(values, outputs)}


@torch.no_grad()
def measure(model, kind: str, length: int, repeats: int, explain: bool) -> dict:
    shipped = sys.modules[type(model).__module__]
    switch = paths(model, kind)
    ids = torch.randint(0, tm.VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
    row = {}
    for path, use in switch.items():
        use()
        model(input_ids=ids, logits_to_keep=1)  # warm-up
        with count_host_syncs([shipped.__file__, __file__]) as syncs:
            model(input_ids=ids, logits_to_keep=1)
        row[path] = {"syncs": syncs.total, "times": []}
        if explain:
            row[path]["graph_breaks"] = graph_breaks(model, input_ids=ids[:, :256], logits_to_keep=1)
    for _ in range(repeats):
        for path, use in switch.items():
            use()
            start = time.perf_counter()
            model(input_ids=ids, logits_to_keep=1)
            row[path]["times"].append(time.perf_counter() - start)
    switch["new"]()
    for path in switch:
        row[path]["s"] = statistics.median(row[path]["times"])
    return row


@torch.no_grad()
def experts_alone(tokens: int, repeats: int) -> None:
    """SwitchHead's routed expert computation alone (both sides), SmolLM2-sized: H=3, E=3, k=2, d=64, D=576."""
    from surgery.switchhead import modeling_switchhead as msh

    torch.manual_seed(0)
    heads, n_exp, k, d, dim = 3, 3, 2, 64, 576
    v, o = msh.SwitchHeadExperts(heads, n_exp, dim, d, bias=False), msh.SwitchHeadExperts(heads, n_exp, d, dim, bias=False)
    router = msh.SigmaMoERouter(dim, heads, n_exp, k)
    for p in (*v.parameters(), *o.parameters(), router.weight):
        torch.nn.init.normal_(p, std=0.02)
    x, a = torch.randn(tokens, dim), torch.randn(tokens, heads, d)
    gates, index = router(x)
    fns = {"old": (old_expert_values(msh), old_expert_outputs(msh)), "new": (msh.expert_values, msh.expert_outputs)}
    times = {p: [] for p in fns}
    for r in range(repeats + 1):
        for path, (values, outputs) in fns.items():
            start = time.perf_counter()
            values(v, x, gates, index)
            outputs(o, a, gates, index)
            if r:
                times[path].append(time.perf_counter() - start)
    old, new = (statistics.median(times[p]) for p in ("old", "new"))
    print(f"| SmolLM2-sized | switchhead experts alone, {tokens} tokens | — | — | {old * 1e3:.1f} ms → {new * 1e3:.1f} ms "
          f"| {new / old:.2f}x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--experts-only", action="store_true", help="only SwitchHead's expert computation alone")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.experts_only:
        for tokens in (512, args.length, 4 * args.length):
            experts_alone(tokens, 10 * args.repeats)
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-paths-"))
    tm.tiny("llama", work / "tiny")
    sources = {"tiny": work / "tiny", "SmolLM2-sized": smollm2_sized(work / "smol")}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch 1 x {args.length} tokens, "
          f"median of {args.repeats}")
    print("| model | kind | syncs / forward (old → new) | graph breaks (old → new) | forward s (old → new) | new / old |")
    print("|---|---|---|---|---|---|")
    for name, source in sources.items():
        for kind in ("talking-heads", "switchhead"):
            model = converted(source, kind, work / f"{name}-{kind}")
            row = measure(model, kind, args.length, args.repeats, explain=name == "tiny")
            old, new = row["old"], row["new"]
            breaks = f"{old['graph_breaks']} → {new['graph_breaks']}" if "graph_breaks" in new else "—"
            print(f"| {name} | {kind} | {old['syncs']} → {new['syncs']} | {breaks} | {old['s']:.3f} → {new['s']:.3f} "
                  f"| {new['s'] / old['s']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
