"""Peak memory and time of `check --retrieval`'s scoring alone, at one length, on the real SmolLM2-135M.

    python benchmarks/bench_retrieval_memory.py [--task passkey] [--length 8192] [--samples 1] [--device cpu]

Loads SmolLM2 (`smollm2`) as `check` loads it, builds the task's examples (noise haystack) and scores them
(surgery/checking/retrieval.py: one forward pass each, no KV cache, the answer's logits only). Prints the peak
resident memory after loading and after scoring (ru_maxrss), the seconds, and each example's scores.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from surgery.checking.retrieval import RetrievalPlan, score_retrieval
from surgery.retrieval_tasks import make_examples
from surgery.checkpoint.source import resolve_source
from surgery.runtime import load_model, load_tokenizer


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="passkey")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    source, device = resolve_source("smollm2"), torch.device(args.device)
    examples = make_examples(args.task, load_tokenizer(source), args.length, args.samples)
    model = load_model(source, device, "float32")
    print(f"after loading: peak RSS {peak_gb():.2f} GB")
    start = time.time()
    rows = score_retrieval(model, RetrievalPlan.of([args.task], [args.length], args.samples, "noise", examples), device,
                 progress=False)
    print(f"scored {len(rows)} example(s) of {args.length} tokens in {time.time() - start:.1f} s: peak RSS "
          f"{peak_gb():.2f} GB")
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
