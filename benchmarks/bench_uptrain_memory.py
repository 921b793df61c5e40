"""Peak memory (RSS) of the README tour's uptrain of SmolLM2-135M, against a baseline code tree and the estimate.

    python benchmarks/bench_uptrain_memory.py --baseline-repo /work/main --tokens 4096

Runs, in fresh processes, `surgery uptrain MQA --tokens N --seq-len 256 --batch-tokens 1024 --lr 3e-4
--eval-tokens 4096` (the tour's command; the tour trains 32,768 tokens, the peak is reached in the first steps)
with the code of --baseline-repo (when given) and of this repository, each process's peak RSS read with
getrusage(RUSAGE_CHILDREN) in a wrapper process; then `surgery run --dry-run`'s estimate for the same command
(surgery/memory_estimate.py). MQA: a mean-pooled MQA conversion of the embedded SmolLM2-135M, made once under
--work (the merge method does not change the memory).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PEAK = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
        "print('PEAK', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, rc)")


def peak_rss(repo: Path, args: list[str]) -> int:
    env = {**os.environ, "PYTHONPATH": str(repo), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", PEAK, sys.executable, "-m", "cli", *args], cwd=repo, env=env,
                            capture_output=True, text=True)
    line = [ln for ln in result.stdout.splitlines() if ln.startswith("PEAK ")][-1].split()
    if line[2] != "0":
        sys.exit(f"{repo}: uptrain failed:\n{result.stderr[-3000:]}")
    return int(line[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-repo", type=Path, help="another checkout of this project to compare with")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench_uptrain_memory"))
    a = ap.parse_args()
    from surgery import memory_estimate as est
    from surgery.recipes.schema import step_models

    a.work.mkdir(parents=True, exist_ok=True)
    mqa = a.work / "smol-mqa"
    if not (mqa / "config.json").exists():
        subprocess.run([sys.executable, "-m", "cli", "convert", "smollm2", "--to", "mqa", "--out", str(mqa)], cwd=REPO,
                       check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    tour = ["--tokens", str(a.tokens), "--seq-len", "256", "--batch-tokens", "1024", "--lr", "3e-4",
            "--eval-tokens", "4096"]
    options = step_models()["uptrain"](tokens=a.tokens, seq_len=256, batch_tokens=1024, lr=3e-4, eval_tokens=4096)
    teacher = est.stats_from_folder(Path(__import__("json").loads((mqa / "surgery.json").read_text())["source"]["folder"]))
    estimate = est.uptrain_memory(est.stats_from_folder(mqa), options, teacher, processes=1)
    rows = []
    for label, repo in (("baseline", a.baseline_repo), ("this tree", REPO)):
        if repo is None:
            continue
        peak = peak_rss(repo, ["uptrain", str(mqa), "--out", str(a.work / f"up-{label.replace(' ', '-')}"), "--force",
                               *tour])
        rows.append((label, repo, peak))
    gb = 1e9
    print(f"uptrain of SmolLM2-135M MQA, tour command with --tokens {a.tokens}; estimate {estimate / gb:.2f} GB")
    for label, repo, peak in rows:
        ratio = f", {peak / rows[0][2]:.2f}x the baseline" if len(rows) > 1 and label != "baseline" else ""
        print(f"  {label:10s} {str(repo):30s} peak RSS {peak / gb:.2f} GB (estimate/measured {estimate / peak:.2f}){ratio}")


if __name__ == "__main__":
    main()
