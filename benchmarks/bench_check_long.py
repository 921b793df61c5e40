"""Long-context `surgery check`: peak memory and time at SmolLM2-135M's full context, and what a conversion does there.

    python benchmarks/bench_check_long.py --converted FOLDER [--data stdlib] [--tokens 16384] [--seq-len 8192]
                                          [--batch-size 4] [--device cpu] [--ways sliced,whole] [--json out.json]

Source: the real SmolLM2-135M (`smollm2`); converted: FOLDER (e.g. `surgery convert smollm2 --to mqa --merge
aligned --calib-tokens 2048 --out FOLDER`). Text: --data (default `stdlib`), windows cut from whole documents at
least --seq-len tokens long (`--documents whole`). Each way runs `compare_checkpoints` in a fresh child process that
reports its own peak resident memory (ru_maxrss) and wall time:

- `sliced` (today's check): both models return their final hidden states, the source's are spilled, the logits
  exist a slice of positions at a time (surgery/checking/passes.py);
- `whole` (the old check, measured in the same run): every forward returns its whole-window logits, the source's
  are spilled as they are (`Projection.of` patched to find no projection).

It prints each way's peak RSS and time, the numbers by position in the window, and the largest relative difference
between the two ways' metrics (they must agree to float rounding).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

METRICS = ("max_abs_diff", "mean_abs_diff", "kl", "top1_agreement", "ppl_source", "ppl_converted")


def child(way: str, args) -> dict:
    from surgery.checking import passes
    from surgery.checking.compare import compare_checkpoints
    from surgery.checking.options import CheckOptions
    from surgery.checkpoint.source import resolve_source
    from surgery.data import load_texts

    if way == "whole":
        passes.Projection.of = classmethod(lambda cls, model, vocab, keep=False: None)
    start = time.time()
    options = CheckOptions(tokens=args.tokens, seq_len=args.seq_len, batch_size=args.batch_size, device=args.device,
                           data=args.data, documents="whole")
    report = compare_checkpoints(resolve_source("smollm2"), resolve_source(args.converted), load_texts(args.data),
                                 options, progress=False, warn=lambda line: print(line, file=sys.stderr))
    report["wall_seconds"] = time.time() - start
    report["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return report


def run_child(way: str, args) -> dict:
    argv = [sys.executable, __file__, "--child", way, "--converted", args.converted, "--data", args.data, "--tokens",
            str(args.tokens), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--device",
            args.device]
    out = subprocess.run(argv, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        sys.exit(f"{way} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--converted", required=True)
    p.add_argument("--data", default="stdlib")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--ways", default="sliced,whole")
    p.add_argument("--json")
    p.add_argument("--child", choices=["sliced", "whole"])
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args)))
        return
    reports = {way: run_child(way, args) for way in args.ways.split(",")}
    first = next(iter(reports.values()))
    docs = ", ".join(f"{d['document']} ({d['windows']})" for d in first["documents"]["used"])
    print(f"SmolLM2-135M vs {args.converted}: {first['tokens']} tokens of {args.data} in {first['windows']} windows of "
          f"{first['seq_len']} from whole documents [{docs}], batch {args.batch_size}, device {first['device']}")
    for way, r in reports.items():
        print(f"  {way:6}: peak RSS {r['peak_rss_bytes'] / 1e9:.2f} GB, {r['wall_seconds']:.0f} s "
              f"(source {r['seconds']['source']:.0f} s, converted {r['seconds']['converted']:.0f} s; "
              f"logits {r['logits']}, scratch {r['scratch']})")
    if len(reports) == 2:
        a, b = reports.values()
        worst = max(abs(a[k] - b[k]) / max(abs(b[k]), 1e-30) for k in METRICS)
        print(f"  largest relative difference between the two ways' metrics: {worst:.1e}")
    print(f"  whole window: ppl source {first['ppl_source']:.3f}, converted {first['ppl_converted']:.3f} "
          f"({first['ppl_converted'] / first['ppl_source']:.2f}x), KL {first['kl']:.4f}, "
          f"top-1 {100 * first['top1_agreement']:.1f}%")
    print("  positions   | ppl source | ppl conv. | ratio | KL     | top-1")
    for row in first["by_position"]:
        a, b = row["positions"]
        print(f"  {a:5}-{b - 1:<5} | {row['ppl_source']:10.3f} | {row['ppl_converted']:9.3f} | "
              f"{row['ppl_ratio']:4.2f}x | {row['kl']:.4f} | {100 * row['top1_agreement']:.1f}%")
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=2) + "\n")


if __name__ == "__main__":
    main()
