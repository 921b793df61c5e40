"""K/V-head merging on the real SmolLM2-135M: aligned against mean/first/random, zero-shot, on held-out text.

    python benchmarks/bench_merge.py [--kv-heads 1] [--tokens 16384] [--calib-tokens 8192]
                                     [--methods mean,first,random,aligned] [--uptrain-tokens 0] [--json out.json]

Held-out text: the first --tokens tokens of pydoc (what `surgery check` and `surgery uptrain` evaluate on by
default). Calibration: --calib-tokens of pydoc read from its last document backwards. The script prints both
document sets and stops if they intersect. Every number is measured in this run: the source's perplexity on the
same windows is the baseline the ratios use, mean pooling the baseline the aligned merge is compared with.
Also measured: wall and CPU seconds of each conversion, the peak resident memory added while converting, the
3 -> 3 K/V-head case (must be exact), and optionally (--uptrain-tokens N) the default uptraining recipe
(`surgery uptrain`, KD from the source) on the aligned and mean outputs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch


from surgery.kv.options import METHODS, GQAOptions  # noqa: E402
from surgery.checking.compare import compare_models  # noqa: E402
from surgery.kv.convert import convert_to_kv_heads  # noqa: E402
from surgery.data import pydoc_texts, token_stream  # noqa: E402
from surgery.kv.aligned import convert_aligned  # noqa: E402
from surgery.calibration.text import pydoc_documents_used  # noqa: E402
from surgery.commands.compare_merges import heldout_documents  # noqa: E402
from surgery.runtime import compute_threads, load_model, load_tokenizer, threads  # noqa: E402
from surgery.checkpoint.source import resolve_source  # noqa: E402


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    """Peak resident set size above the starting point, sampled every 50 ms."""

    def __enter__(self):
        self.base = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())
        self.added = self.peak - self.base


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def convert(method: str, src, out: Path, kv_heads: int, calib_tokens: int) -> dict:
    wall, cpu = time.time(), cpu_seconds()
    with PeakMemory() as mem, threads(compute_threads()):
        if method == "aligned":
            options = GQAOptions(kv_heads=kv_heads, merge="aligned", calib=["pydoc"], calib_tokens=calib_tokens)
            record = convert_aligned(src, out, options, progress=False)
        else:
            record = convert_to_kv_heads(src, out, GQAOptions(kv_heads=kv_heads, merge=method), progress=False)
    return {"record": record, "wall_s": time.time() - wall, "cpu_s": cpu_seconds() - cpu, "peak_added_bytes": mem.added}


def evaluate(src_model, folder: Path, ids: torch.Tensor) -> dict:
    with threads(compute_threads()):
        model = load_model(resolve_source(str(folder)), torch.device("cpu"), "float32")
        report = compare_models(src_model, model, ids, 1024, 4, causal=True)
    del model
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--uptrain-tokens", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(compute_threads())
    load_start = os.getloadavg()
    src = resolve_source("smollm2")
    tokenizer = load_tokenizer(src)
    held = heldout_documents(tokenizer, args.tokens)
    calib = pydoc_documents_used(tokenizer, args.calib_tokens)
    print(f"held-out: pydoc documents {held[0]}..{held[-1]} (first {args.tokens} tokens; what `surgery check` reads)")
    print(f"calibration: pydoc documents {calib[0]}..{calib[-1]} of {len(pydoc_texts())} ({args.calib_tokens} tokens "
          f"from the end)")
    if set(held) & set(calib):
        sys.exit("held-out and calibration documents intersect: lower --tokens or --calib-tokens")
    ids = token_stream(pydoc_texts(), tokenizer, args.tokens)
    src_model = load_model(src, torch.device("cpu"), "float32")
    results = {"held_out_documents": held, "calibration_documents": calib, "methods": {}}
    with tempfile.TemporaryDirectory(prefix="bench-merge-", dir=os.environ.get("BENCH_TMP")) as tmp:
        tmp = Path(tmp)
        for method in [m.strip() for m in args.methods.split(",") if m.strip()]:
            conv = convert(method, src, tmp / method, args.kv_heads, args.calib_tokens)
            report = evaluate(src_model, tmp / method, ids)
            results["ppl_source"] = report["ppl_source"]
            results["methods"][method] = {
                "ppl": report["ppl_converted"], "kl": report["kl"], "top1": report["top1_agreement"],
                "wall_s": round(conv["wall_s"], 1), "cpu_s": round(conv["cpu_s"], 1),
                "peak_added_mib": round(conv["peak_added_bytes"] / 2**20, 1),
                "calibration": conv["record"].get("calibration"),
            }
            print(f"{method:8s} ppl {report['ppl_converted']:12.3f}  x{report['ppl_converted'] / report['ppl_source']:9.2f}"
                  f"  KL {report['kl']:.4f}  top-1 {100 * report['top1_agreement']:.2f}%  convert {conv['wall_s']:.1f}s wall "
                  f"/ {conv['cpu_s']:.1f}s CPU, +{conv['peak_added_bytes'] / 2**20:.0f} MiB peak", flush=True)
        # 3 -> 3: nothing to merge, must be exact
        exact = convert("aligned", src, tmp / "same", 3, args.calib_tokens)
        same = evaluate(src_model, tmp / "same", ids[:2048])
        results["same_kv_heads_max_abs_diff"] = same["max_abs_diff"]
        print(f"3 -> 3 aligned: max |dlogits| {same['max_abs_diff']:.3g} ({exact['wall_s']:.1f}s)")
        if args.uptrain_tokens:
            from surgery.training import UptrainOptions, uptrain

            for method in ("aligned", "mean"):
                if method not in results["methods"]:
                    continue
                out = tmp / f"{method}-uptrained"
                start = time.time()
                rec = uptrain(UptrainOptions(model=str(tmp / method), out=out, data="pydoc", tokens=args.uptrain_tokens,
                                             progress=False))
                report = evaluate(src_model, out, ids)
                results["methods"][method]["uptrained"] = {"tokens": args.uptrain_tokens, "ppl": report["ppl_converted"],
                                                           "kl": report["kl"], "seconds": round(time.time() - start),
                                                           "record": rec}
                print(f"{method:8s} after {args.uptrain_tokens} uptraining tokens (default recipe): ppl "
                      f"{report['ppl_converted']:.3f} x{report['ppl_converted'] / report['ppl_source']:.2f}  KL {report['kl']:.4f}",
                      flush=True)
    print(f"source   ppl {results['ppl_source']:12.3f}  ({args.tokens} held-out tokens, windows of 1024)")
    results["loadavg_start"], results["loadavg_end"] = load_start, os.getloadavg()
    print(f"load average (1/5/15 min) at start {load_start}, at end {results['loadavg_end']} on {os.cpu_count()} CPUs")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
