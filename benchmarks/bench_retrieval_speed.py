"""Per-example time of `check --retrieval`'s scoring, batched against one example a pass, on the real SmolLM2-135M.

    python benchmarks/bench_retrieval_speed.py [--lengths 1024,2048] [--examples 4] [--batch 4] [--task passkey]
                                               [--device cpu] [--batched-first]

Loads SmolLM2 (`smollm2`) as `check` loads it, builds `--examples` examples of the task per length (noise haystack,
needle depths spread) and scores them (surgery/checking/retrieval.py) twice in the same process: one example a
forward pass (the baseline), then `--batch` examples a pass (`--batched-first`: the other way round, to see what
the order and a shared machine's changing load do); the ratio is baseline / batched seconds per example, of the
wall clock and of this process's CPU time (on a shared CPU the wall clock is mostly the other jobs' load; the CPU
seconds are the work done).
Checks that both give the same scores and the same answer log-probabilities (max |difference| printed), and prints
a markdown table.
"""

from __future__ import annotations

import argparse
import time

import torch

from surgery.checking.retrieval import RetrievalPlan, score_retrieval
from surgery.retrieval_tasks import make_examples
from surgery.checkpoint.source import resolve_source
from surgery.runtime import load_model, load_tokenizer


def timed(model, plan: RetrievalPlan, device: torch.device) -> tuple[float, float, list[dict]]:
    """(wall seconds, this process's CPU seconds, the rows) of scoring `plan`."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start, cpu = time.perf_counter(), time.process_time()
    rows = score_retrieval(model, plan, device, progress=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, time.process_time() - cpu, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048")
    ap.add_argument("--examples", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--task", default="passkey")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batched-first", action="store_true")
    args = ap.parse_args()
    source, device = resolve_source("smollm2"), torch.device(args.device)
    tokenizer = load_tokenizer(source)
    model = load_model(source, device, "float32")
    warm = make_examples(args.task, tokenizer, 256, 1)  # first-call costs out of the measurement
    timed(model, RetrievalPlan.of([args.task], [256], 1, "noise", warm, batch=1), device)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {device}")
    print(f"| length | examples | wall s/example, 1 a pass | batch of {args.batch} | speed-up | CPU s/example, 1 a "
          f"pass | batch of {args.batch} | speed-up | same scores | max abs Δ log-prob |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for length in (int(n) for n in args.lengths.split(",")):
        examples = make_examples(args.task, tokenizer, length, args.examples)
        order = (args.batch, 1) if args.batched_first else (1, args.batch)
        runs = {b: timed(model, RetrievalPlan.of([args.task], [length], args.examples, "noise", examples, batch=b),
                         device) for b in order}
        (alone_s, alone_cpu, alone), (batched_s, batched_cpu, batched) = runs[1], runs[args.batch]
        same = [r["score"] for r in alone] == [r["score"] for r in batched]
        drift = max(abs(a["logprob"] - b["logprob"]) for a, b in zip(alone, batched))
        n = len(examples)
        print(f"| {length} | {n} | {alone_s / n:.2f} | {batched_s / n:.2f} | {alone_s / batched_s:.2f}x | "
              f"{alone_cpu / n:.2f} | {batched_cpu / n:.2f} | {alone_cpu / batched_cpu:.2f}x | "
              f"{'yes' if same else 'NO'} | {drift:.1e} |", flush=True)


if __name__ == "__main__":
    main()
