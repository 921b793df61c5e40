"""Peak memory of `surgery check`: one model at a time (today's check) against both models at once (the old check).

    python benchmarks/bench_check_memory.py [--converted FOLDER] [--tokens 16384] [--seq-len 1024] [--batch-size 4]
                                            [--device auto] [--json out.json]

Source: the real SmolLM2-135M (`smollm2`); converted: its MQA conversion (mean merge, written to a temporary
folder unless --converted names one). Text: the first --tokens tokens of pydoc. Each way runs in a fresh child
process that reports its own peak resident memory (ru_maxrss) and wall time:

- `both at once` (the baseline, measured in the same run): both models loaded, `compare_models` on each batch;
- `one at a time`: `compare_checkpoints`, the source's logits kept on scratch disk between the two passes.

It prints both, their ratio, and the largest relative difference between the two ways' metrics (they must agree).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


METRICS = ("max_abs_diff", "mean_abs_diff", "kl", "top1_agreement", "ppl_source", "ppl_converted")


def child(mode: str, converted: str, tokens: int, seq_len: int, batch_size: int, device: str) -> dict:
    from surgery.checking.compare import compare_checkpoints, compare_models
    from surgery.checking.options import CheckOptions
    from surgery.runtime import load_model, load_tokenizer, pick_device
    from surgery.data import pydoc_texts, token_stream
    from surgery.checkpoint.source import resolve_source

    source, target = resolve_source("smollm2"), resolve_source(converted)
    start = time.time()
    if mode == "both":
        dev = pick_device(device)
        a, b = load_model(source, dev, "float32"), load_model(target, dev, "float32")
        ids = token_stream(pydoc_texts(), load_tokenizer(source), tokens)
        report = compare_models(a, b, ids, seq_len, batch_size, causal=True)
    else:
        report = compare_checkpoints(source, target, pydoc_texts(), CheckOptions(
            tokens=tokens, seq_len=seq_len, batch_size=batch_size, device=device, data="pydoc"))
    report["seconds"] = time.time() - start
    report["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return report


def run_child(mode: str, args, converted: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--converted", converted, "--tokens",
                          str(args.tokens), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
                          "--device", args.device], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        sys.exit(f"{mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--converted")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--device", default="auto")
    p.add_argument("--json")
    p.add_argument("--child", choices=["both", "sequential"])
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.converted, args.tokens, args.seq_len, args.batch_size, args.device)))
        return
    with tempfile.TemporaryDirectory(prefix="bench-check-") as tmp:
        converted = args.converted
        if converted is None:
            from surgery.kv.convert import convert_to_kv_heads
            from surgery.kv.options import MQAOptions
            from surgery.checkpoint.source import resolve_source

            converted = str(Path(tmp) / "mqa")
            convert_to_kv_heads(resolve_source("smollm2"), Path(converted), MQAOptions(), progress=False)
        both = run_child("both", args, converted)
        sequential = run_child("sequential", args, converted)
    worst = max(abs(sequential[k] - both[k]) / max(abs(both[k]), 1e-30) for k in METRICS)
    gb = 1e9
    print(f"SmolLM2-135M vs its MQA conversion, {sequential['tokens']} tokens of pydoc, windows {args.seq_len}, "
          f"batch {args.batch_size}, device {sequential['device']}")
    print(f"  both models at once : peak RSS {both['peak_rss_bytes'] / gb:.2f} GB, {both['seconds']:.0f} s")
    print(f"  one model at a time : peak RSS {sequential['peak_rss_bytes'] / gb:.2f} GB, "
          f"{sequential['seconds']:.0f} s (source logits on {sequential['scratch']})")
    print(f"  ratio               : {sequential['peak_rss_bytes'] / both['peak_rss_bytes']:.2f}x memory, "
          f"{sequential['seconds'] / both['seconds']:.2f}x time")
    print(f"  largest relative difference between the two ways' metrics: {worst:.1e}")
    if args.json:
        Path(args.json).write_text(json.dumps({"both": both, "sequential": sequential, "max_rel_diff": worst},
                                              indent=2) + "\n")


if __name__ == "__main__":
    main()
