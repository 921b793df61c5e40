"""Peak memory (RSS) of one uptrain run at --precision fp32 and at --precision bf16: bf16 must not cost more.

    python benchmarks/bench_precision_memory.py                 # SmolLM2-135M (its MQA conversion, KD from SmolLM2)
    python benchmarks/bench_precision_memory.py --model tiny    # the pydoc tiny Llama (surgery/testing/pydoc_llama.py)

The same `surgery uptrain MODEL --tokens N --seq-len S --batch-tokens B --micro-batch M --eval-tokens E` runs twice,
each in a fresh process, once per precision (fp32 first, then bf16; `--rounds R` repeats the pair and keeps each
precision's smallest peak), and each process's peak RSS is read with getrusage(RUSAGE_CHILDREN) in a wrapper
process. bf16 is accelerate's mixed precision (torch's CPU autocast here): float32 weights, gradients and AdamW
moments, bf16 matmuls. Prints both peaks and the ratio bf16 / fp32, plus each run's final train loss (the same run,
so the losses must agree to bf16 rounding).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PEAK = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
        "print('PEAK', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, rc)")


def surgery(args: list[str], capture: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", PEAK, sys.executable, "-m", "cli", *args], cwd=REPO, env=env,
                          capture_output=capture, text=True)


def peak_rss(args: list[str]) -> int:
    result = surgery(args)
    line = [ln for ln in result.stdout.splitlines() if ln.startswith("PEAK ")][-1].split()
    if line[2] != "0":
        sys.exit(f"uptrain failed:\n{result.stderr[-3000:]}")
    return int(line[1])


def model_folder(which: str, work: Path) -> Path:
    """The model trained: the mean-pooled MQA conversion of SmolLM2-135M (KD from SmolLM2), or the tiny Llama."""
    if which == "tiny":
        from surgery.testing.pydoc_llama import make_model, make_tokenizer

        folder = work / "tiny"
        if not (folder / "config.json").exists():
            make_model(folder, make_tokenizer())
        return folder
    folder = work / "smol-mqa"
    if not (folder / "config.json").exists():
        subprocess.run([sys.executable, "-m", "cli", "convert", "smollm2", "--to", "mqa", "--out", str(folder)],
                       cwd=REPO, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--eval-tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench_precision_memory"))
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    model = model_folder(a.model, a.work)
    loss = ["--loss", "lm", "--data", "pydoc"] if a.model == "tiny" else []
    run = ["--tokens", str(a.tokens), "--seq-len", str(a.seq_len), "--batch-tokens", str(a.batch_tokens),
           "--micro-batch", str(a.micro_batch), "--eval-tokens", str(a.eval_tokens), "--lr", "3e-4", *loss]
    peaks: dict[str, int] = {}
    losses: dict[str, float] = {}
    for _ in range(a.rounds):
        for precision in ("fp32", "bf16"):
            out = a.work / f"up-{precision}"
            peak = peak_rss(["uptrain", str(model), "--out", str(out), "--force", "--precision", precision, *run])
            peaks[precision] = min(peak, peaks.get(precision, peak))
            record = json.loads((out / "surgery.json").read_text())["uptraining"]
            assert record["precision"] == precision, record["precision"]
            losses[precision] = record["final_train_loss"]
    gb = 1e9
    print(f"uptrain of {a.model} ({model}), {' '.join(run)}, best of {a.rounds} round(s):")
    for precision in ("fp32", "bf16"):
        print(f"  --precision {precision}: peak RSS {peaks[precision] / gb:.3f} GB, final train loss "
              f"{losses[precision]:.4f}")
    print(f"  bf16 / fp32 peak RSS: {peaks['bf16'] / peaks['fp32']:.3f}x")


if __name__ == "__main__":
    main()
