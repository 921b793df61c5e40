"""Aligned K/V merge ablations on the real SmolLM2-135M (3 -> 1 K/V heads): calibration size and domain, refits.

    python benchmarks/bench_merge_ablation.py NAME [--calib pydoc|FILES] [--calib-tokens 8192] [--tokens 16384]
                                              [--refit-k] [--refit-rounds 1] [--refit-v] [--query-samples 128]
                                              [--json results.jsonl]

The merge runs in memory through the converter's own layer pipeline (`surgery.kv.aligned.pipeline.merge_model` on the
resident model, which keeps the merged layers in the source's shape: the same function as `surgery convert --merge
aligned`, which computes exactly what the grouped checkpoint does; the default run reproduces that command's
27.04 on the same text). Held-out text: the first --tokens tokens of pydoc, windows of 1024 (what `surgery check`
reads). Calibration: --calib-tokens of --calib; for pydoc read from its last document backwards, and the script
stops if the two share a document. The source's perplexity is measured in the same run on the same windows.
Appends one JSON line per run to --json.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch


from surgery.kinds import spec_for  # noqa: E402
from surgery.calibration.stream import resident_stream  # noqa: E402
from surgery.calibration.text import calibration_text, context_of, pydoc_documents_used  # noqa: E402
from surgery.checking.compare import compare_models  # noqa: E402
from surgery.runtime import load_tokenizer  # noqa: E402
from surgery.data import pydoc_texts, token_stream  # noqa: E402
from surgery.calibration import capture  # noqa: E402
from surgery.commands.compare_merges import heldout_documents  # noqa: E402
from surgery.kv.aligned.pipeline import MergeOptions, merge_model  # noqa: E402
from surgery.fitting.refit import QueryRefit  # noqa: E402
from surgery.checkpoint.source import resolve_source  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name")
    ap.add_argument("--calib", default="pydoc")
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--refit-k", action="store_true")
    ap.add_argument("--refit-rounds", type=int, default=1)
    ap.add_argument("--refit-v", action="store_true")
    ap.add_argument("--query-samples", type=int, default=None, help="query refit positions per window (default 128)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    src = resolve_source("smollm2")
    config = src.config
    tok = load_tokenizer(src)
    if a.calib == "pydoc":
        shared = set(heldout_documents(tok, a.tokens)) & set(pydoc_documents_used(tok, a.calib_tokens))
        if shared:
            sys.exit(f"held-out text and calibration share {len(shared)} pydoc document(s)")
    start = time.time()
    model = capture.load_resident_model(src.folder)
    work = copy.deepcopy(model)
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    text = calibration_text(a.calib, tok, a.calib_tokens, context_of(config))
    opts = MergeOptions(groups=a.kv_heads, refit_k=a.refit_k, refit_rounds=a.refit_rounds, refit_v=a.refit_v)
    if a.query_samples:
        opts.query = QueryRefit(samples=a.query_samples)
    result = merge_model(resident_stream(work, "cpu"), spec_for(config, "mqa/gqa aligned"), config, heads, kv,
                         head_dim, text.windows, opts)
    merge_cpu = time.process_time()
    ids = token_stream(pydoc_texts(), tok, a.tokens)
    report = compare_models(model, work, ids, 1024, 1, causal=True)
    row = {"name": a.name, "calib": a.calib, "calib_tokens": text.tokens, "tokens": int(report["tokens"]),
           "refit_k": a.refit_k, "refit_rounds": a.refit_rounds, "refit_v": a.refit_v,
           "query_samples": opts.query.samples,
           "ppl_source": report["ppl_source"], "ppl": report["ppl_converted"],
           "ratio": report["ppl_converted"] / report["ppl_source"], "kl": report["kl"],
           "top1": report["top1_agreement"], "merge_wall_s": round(result.seconds, 1),
           "merge_cpu_s": round(merge_cpu, 1), "total_s": round(time.time() - start, 1), "stages": result.stages}
    print(json.dumps(row))
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
