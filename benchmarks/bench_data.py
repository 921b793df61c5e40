"""The streamed uptraining data path (surgery/training/stream.py): its rate alone, next to what training consumes,
and a billion-token run's start (time to the first optimizer step, peak RSS, largest run-folder file).

    OMP_NUM_THREADS=1 python benchmarks/bench_data.py rate            # tokens/s of the data path, 0/1/2 workers
    OMP_NUM_THREADS=1 python benchmarks/bench_data.py consume         # tokens/s of `uptrain` on SmolLM2-135M
    OMP_NUM_THREADS=1 python benchmarks/bench_data.py start           # --tokens 1e9 vs 1e5 on a 32-shard corpus
    OMP_NUM_THREADS=1 python benchmarks/bench_data.py curve           # packed vs streamed loss curve, tiny model

The corpus: `--shards` jsonl files of pydoc topics (each document a topic with its shard and index in front, so no
two documents are equal), tokenized with SmolLM2-135M's tokenizer. `rate` takes windows of `--seq-len` from a
`StreamedData` (what a training process reads) for `--seconds` after one warm-up window, in a fresh process each.
`start` runs `surgery uptrain smollm2 --data "corpus/*.jsonl" --loss lm` as a user would, polls the run folder's
metrics for the first optimizer step and /proc for the peak RSS (VmHWM), and stops the run after `--steps` steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def corpus(folder: Path, shards: int, docs: int) -> str:
    from surgery.data import pydoc_texts

    texts = pydoc_texts()
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        rows = (json.dumps({"text": f"[{s}-{d}] " + texts[(s * docs + d) % len(texts)]}) for d in range(docs))
        (folder / f"shard-{s:04d}.jsonl").write_text("\n".join(rows) + "\n")
    return str(folder / "*.jsonl")


def smollm2_folder() -> str:
    from surgery.checkpoint.source import resolve_source

    return str(resolve_source("smollm2").folder)


def rate_worker(spec: str, workers: int, seq_len: int, seconds: float) -> dict:
    import torch
    from transformers import AutoTokenizer

    from surgery.training.stream import StreamedData
    from surgery.training.stream_held_out import hold_out
    from surgery.training.stream_sources import Plan, resolve_sources

    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder())
    if workers:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    sources = resolve_sources([spec], [1.0])
    args = dict(tokenizer=tokenizer, eos=tokenizer.eos_token_id, seq_len=seq_len, seed=0, readers=max(1, workers),
                epochs=100)
    eval_windows, held = hold_out(args, sources, 2048)
    data = StreamedData(Plan(sources=tuple(sources), held=held, **args), eval_windows, 0, 1, workers)
    t0 = time.perf_counter()
    data.take(1)
    first = time.perf_counter() - t0
    start, windows = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        data.take(8)
        windows += 8
    elapsed = time.perf_counter() - start
    data.close()
    return {"workers": workers, "tokens_per_s": windows * seq_len / elapsed, "first_window_s": first,
            "threads": torch.get_num_threads()}


def cmd_rate(a) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        spec = corpus(Path(tmp) / "corpus", a.shards, a.docs)
        for workers in a.workers:
            out = subprocess.run([sys.executable, __file__, "_rate", spec, str(workers), str(a.seq_len), str(a.seconds)],
                                 capture_output=True, text=True, check=True)
            print(json.dumps(json.loads(out.stdout.strip().splitlines()[-1])), flush=True)


def cmd_consume(a) -> None:
    """`uptrain` on SmolLM2-135M, LM loss, streamed data: tokens/s of steps 2..N from its metrics."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = corpus(Path(tmp) / "corpus", a.shards, a.docs)
        out = Path(tmp) / "out"
        subprocess.run([sys.executable, "-m", "cli", "uptrain", "smollm2", "--data", spec, "--data-mode", "stream",
                        "--loss", "lm", "--tokens", str(a.steps * a.batch_tokens), "--seq-len", str(a.seq_len),
                        "--batch-tokens", str(a.batch_tokens), "--micro-batch", str(a.micro_batch), "--eval-tokens",
                        "0", "--save-every", "0", "--out", str(out)], cwd=REPO, check=True, capture_output=True)
        rows = [json.loads(x) for x in (out / "uptrain_metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "loss" in r]
        seconds = rows[-1]["elapsed"] - rows[0]["elapsed"]
        print(json.dumps({"uptrain_tokens_per_s": a.batch_tokens * (len(rows) - 1) / seconds, "steps": len(rows)}))


def vm_hwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def tiny_smollm2(folder: Path) -> str:
    """A 2-layer, 64-wide Llama with SmolLM2-135M's tokenizer (so the data path is the real one), random weights."""
    import transformers as tf

    from surgery.testing.pydoc_llama import make_model

    tokenizer = tf.AutoTokenizer.from_pretrained(smollm2_folder())
    return str(make_model(folder, tokenizer, positions=4096, bos_token_id=tokenizer.bos_token_id))


def start_run(spec: str, tokens: int, a, tmp: Path, model: str) -> dict:
    out = tmp / f"out-{tokens}"
    run_dir = tmp / f"out-{tokens}.run"
    cmd = [sys.executable, "-m", "cli", "uptrain", model, "--data", spec, "--loss", "lm", "--tokens",
           str(tokens), "--seq-len", str(a.seq_len), "--batch-tokens", str(a.batch_tokens), "--micro-batch",
           str(a.micro_batch), "--eval-tokens", str(a.seq_len * 4), "--eval-every", "0", "--save-every",
           str(a.steps), "--out", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    first, peak, steps = None, 0, 0
    metrics = run_dir / "metrics.jsonl"
    while proc.poll() is None:
        try:
            peak = max(peak, vm_hwm_kib(proc.pid))
        except OSError:
            break
        if metrics.exists():
            steps = sum('"loss"' in line for line in metrics.read_text().splitlines())
            if steps and first is None:
                first = time.perf_counter() - t0
            if steps >= a.steps and (run_dir / "checkpoints" / f"step-{a.steps:08d}").exists():
                break
        time.sleep(0.1)
    files = {str(p.relative_to(run_dir)): p.stat().st_size for p in run_dir.rglob("*") if p.is_file()}
    proc.kill()
    proc.wait()
    ckpt = sum(v for k, v in files.items() if k.startswith("checkpoints/"))
    model_bytes = max((v for k, v in files.items() if k.endswith("model.safetensors")), default=0)
    outside = max(((v, k) for k, v in files.items() if not k.startswith("checkpoints/")), default=(0, ""))
    data = {k: v for k, v in files.items() if Path(k).name.startswith("data")}
    mode = json.loads((run_dir / "run.json").read_text()).get("data_mode")
    return {"tokens": tokens, "data_mode": mode, "first_step_s": round(first or -1, 1), "steps": steps,
            "peak_rss_mib": round(peak / 1024), "checkpoint_bytes": ckpt, "model_bytes": model_bytes,
            "largest_file_outside_checkpoints": outside[1], "its_bytes": outside[0], "data_files": data}


def cmd_start(a) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        spec = corpus(Path(tmp) / "corpus", a.shards, a.docs)
        model = smollm2_folder() if a.model == "smollm2" else tiny_smollm2(Path(tmp) / "tiny")
        for tokens in a.tokens:
            print(json.dumps({"model": a.model, **start_run(spec, tokens, a, Path(tmp), model)}), flush=True)


def cmd_curve(a) -> None:
    """Packed vs streamed on the same text, model and options: the tiny random Llama that the uptraining tests run
    on (surgery.testing.pydoc_llama; LM loss on pydoc, the same held-out windows), with the tests' short-run
    options: the loss curve and held-out perplexity of each."""
    from surgery.testing.pydoc_llama import FAST, make_model, make_tokenizer, metrics
    from surgery.training import UptrainOptions, stream_readers, uptrain

    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "tiny", make_tokenizer())
        curves = {}
        for mode, block in (("packed", None), ("stream", stream_readers.BLOCK_TOKENS), ("stream", a.tokens + 64)):
            stream_readers.BLOCK_TOKENS = block or stream_readers.BLOCK_TOKENS  # the last: one block = the packed run's windows
            out = Path(tmp) / f"{mode}-{block}"
            rec = uptrain(UptrainOptions(model=str(model), out=out, **(FAST | dict(
                data_mode=mode, loss="lm", tokens=a.tokens, micro_batch=8, eval_tokens=4096,
                eval_every=a.tokens // 512 // 8))))
            rows = metrics(out)
            curves[mode] = {"eval_ppl": [round(r["eval_ppl"], 2) for r in rows if "eval_ppl" in r],
                            "final_train_loss": round(rec["final_train_loss"], 4)}
            print(json.dumps({"mode": mode, "block_tokens": block, **curves[mode]}), flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_rate":
        spec, workers, seq_len, seconds = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
        print(json.dumps(rate_worker(spec, workers, seq_len, seconds)))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["rate", "consume", "start", "curve"])
    p.add_argument("--shards", type=int, default=32)
    p.add_argument("--docs", type=int, default=200, help="documents per shard")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--model", choices=["smollm2", "tiny"], default="tiny",
                   help="start: SmolLM2-135M, or a 2-layer random Llama with its tokenizer")
    p.add_argument("--tokens", type=int, nargs="+", default=None)
    a = p.parse_args()
    if a.what == "curve":
        a.tokens = (a.tokens or [49152])[0]
    elif a.tokens is None:
        a.tokens = [1_000_000_000, 100_000]
    {"rate": cmd_rate, "consume": cmd_consume, "start": cmd_start, "curve": cmd_curve}[a.what](a)


if __name__ == "__main__":
    main()
