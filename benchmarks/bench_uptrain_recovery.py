"""Recovery by uptraining: SmolLM2-135M converted to MQA by mean pooling, then trained with `lm` and with `kd`.

Held-out perplexity (pydoc text, a split the training never sees) against training tokens for both losses,
plotted next to the source's perplexity on the same windows (the KD run measures its teacher, the source, at
the start) and the converted model's before training. Both runs use the same data, order, batch, optimizer
and schedule; only the loss differs.

    python benchmarks/bench_uptrain_recovery.py --tokens 200000            # the issue's budget
    python benchmarks/bench_uptrain_recovery.py --tokens 8192 --work /tmp/rec   # what fits ~25 min on 2 busy cores
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", default="smollm2")
    p.add_argument("--tokens", type=int, default=200_000, help="training tokens per loss")
    p.add_argument("--losses", default="lm,kd")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-tokens", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--eval-tokens", type=int, default=1024)
    p.add_argument("--evals", type=int, default=4, help="evaluations spread over the run (besides the one at 0)")
    p.add_argument("--work", type=Path, default=Path("/tmp/surgery-bench-uptrain-recovery"))
    p.add_argument("--plot", type=Path, help="PNG path (default WORK/recovery.png)")
    a = p.parse_args()

    from surgery.convert_kv import KVOptions, convert_to_kv_heads
    from surgery.source import resolve_source
    from surgery.uptrain import UptrainOptions, uptrain
    from surgery.uptrain.metrics import read_metrics
    from surgery.uptrain.plot import plot_runs

    a.work.mkdir(parents=True, exist_ok=True)
    src = resolve_source(a.source)
    mqa = a.work / "mqa"
    if not (mqa / "surgery.json").exists():
        convert_to_kv_heads(src, mqa, KVOptions(kv_heads=1, method="mean"), force=True, progress=False)
    steps = -(-a.tokens // a.batch_tokens)
    eval_every = max(1, steps // a.evals)
    print(f"{a.source} -> MQA (mean pooling) at {mqa}; {steps} steps x {a.batch_tokens} tokens per loss, "
          f"seq {a.seq_len}, lr {a.lr}, held-out {a.eval_tokens} tokens every {eval_every} steps", flush=True)

    runs, seconds, records = {}, {}, {}
    for loss in a.losses.split(","):
        out = a.work / f"uptrained-{loss}"
        start = time.time()
        records[loss] = uptrain(UptrainOptions(
            model=str(mqa), out=out, data="pydoc", tokens=a.tokens, seq_len=a.seq_len, batch_tokens=a.batch_tokens,
            micro_batch=a.micro_batch, eval_tokens=a.eval_tokens, eval_every=eval_every, save_every=0,
            loss=loss, lr=a.lr, force=True, progress=False))  # kd: the teacher is the source named in surgery.json
        seconds[loss] = time.time() - start
        runs[loss] = read_metrics(out / "uptrain_metrics.jsonl")

    source_ppl = next((r["teacher_eval_ppl"] for r in records.values() if r.get("teacher_eval_ppl")), None)
    converted_ppl = next(iter(records.values()))["initial_eval_ppl"]
    refs = {"converted, before uptraining": converted_ppl}
    if source_ppl:
        refs["source SmolLM2-135M"] = source_ppl
    plot = a.plot or a.work / "recovery.png"
    plot_runs(runs, plot, refs, title=f"SmolLM2-135M -> MQA (mean pooling): uptraining, {a.tokens} tokens")

    print(f"\nheld-out perplexity ({a.eval_tokens} pydoc tokens never trained on)")
    print(f"  source (GQA, 3 K/V heads)          {source_ppl:10.2f}" if source_ppl else "  source: not measured")
    print(f"  MQA by mean pooling, no training   {converted_ppl:10.2f}")
    evals = {loss: {m["tokens"]: m["eval_ppl"] for m in rows if "eval_ppl" in m} for loss, rows in runs.items()}
    print("  tokens   " + "".join(f"{loss:>12s}" for loss in evals))
    for t in sorted({t for e in evals.values() for t in e}):
        print(f"  {t:7d}  " + "".join(f"{evals[loss].get(t, float('nan')):12.2f}" for loss in evals))
    for loss, s in seconds.items():
        train_s = records[loss]["train_seconds"]
        print(f"  {loss}: {s:.0f}s wall, {train_s:.0f}s training, {records[loss]['tokens'] / train_s:.1f} tokens/s")
    result = {"source_ppl": source_ppl, "converted_ppl": converted_ppl, "evals": evals, "wall_seconds": seconds,
              "args": {k: str(v) for k, v in vars(a).items()}}
    (a.work / "recovery.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"plot {plot}\nresults {a.work / 'recovery.json'}")


if __name__ == "__main__":
    main()
