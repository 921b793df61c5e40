"""Stored teacher pass against live KD at equal tokens (issue 41): SmolLM2-135M converted to MQA (mean pooling) is the
student, SmolLM2-135M the teacher.

1. `surgery teacher smollm2 --top-k K` over the run's training windows (timed; the store's bytes per token measured
   on disk);
2. `surgery uptrain MQA --loss kd --teacher smollm2` (live KD) and `surgery uptrain MQA --loss kd
   --teacher-logprobs STORE` with the same options, each in a fresh process (its peak RSS from wait4), in the order
   given by --order;
3. per run: the mean optimizer-step time (metrics' elapsed / steps, the first step left out: it warms the allocator),
   the peak RSS, the held-out perplexity on pydoc's held-out documents (the first documents of pydoc, never trained
   on) and on a second domain never read in training: the Python source of `json.decoder`, `json.encoder` and
   `json.scanner` (`inspect.getsource`), passed as `--eval-data`.

    python benchmarks/bench_teacher_store.py [--tokens 8192] [--seq-len 256] [--batch-tokens 1024] [--top-k 32]
        [--parallel]   # both arms at once, one thread each: equal machine load for the step-time ratio

Prints the ratios stored / live and writes --json.
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


def python_source_text(folder: Path) -> Path:
    """The second held-out domain: the source of json.decoder, json.encoder and json.scanner, one .txt file."""
    import inspect
    import json.decoder
    import json.encoder
    import json.scanner

    path = folder / "json_source.txt"
    path.write_text("\n\n".join(inspect.getsource(m) for m in (json.decoder, json.encoder, json.scanner)))
    return path


WRAPPER = ("import resource,subprocess,sys;"
           "p=subprocess.run(sys.argv[1:],capture_output=True,text=True);"
           "sys.stdout.write(p.stdout);sys.stderr.write(p.stderr);"
           "print('PEAK', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024);sys.exit(p.returncode)")


def start_child(args: list[str], threads: int | None = None) -> tuple[subprocess.Popen, float]:
    """`surgery ARGS` in a fresh process (through a wrapper that reports its peak RSS); `threads`: its torch threads."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if threads:
        env |= {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    p = subprocess.Popen([sys.executable, "-c", WRAPPER, sys.executable, "-m", "surgery.cli", *map(str, args)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return p, time.perf_counter()


def finish_child(child: tuple[subprocess.Popen, float], args: list[str]) -> tuple[float, int, str]:
    """(seconds, peak RSS in bytes, stdout) of a started child; exits with its stderr if it failed."""
    p, start = child
    out, err = p.communicate()
    seconds = time.perf_counter() - start
    if p.returncode:
        sys.exit(f"surgery {' '.join(map(str, args[:2]))} failed:\n{err[-3000:]}")
    lines = out.splitlines()
    peak = int(next(line for line in reversed(lines) if line.startswith("PEAK")).split()[1])
    return seconds, peak, out


def run_child(args: list[str]) -> tuple[float, int, str]:
    """Run `surgery ARGS` in a fresh process: (seconds, its peak RSS in bytes from a wrapper's getrusage, stdout)."""
    return finish_child(start_child(args), args)


def step_seconds(out: Path) -> float:
    rows = [json.loads(line) for line in (out / "uptrain_metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "elapsed" in r]
    times = [b["elapsed"] - a["elapsed"] for a, b in zip(steps, steps[1:])]  # the first step left out
    return sum(times) / len(times)


def elapsed(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "uptrain_metrics.jsonl").read_text().splitlines()]
    return [r["elapsed"] for r in rows if "elapsed" in r]


def shared_time_ratio(work: Path) -> float:
    """--parallel: steps the stored arm made / steps the live arm made while both ran (up to the end of the one that
    finished first), i.e. live / stored step time under the same load: after one arm ends, the other runs alone."""
    stored, live = elapsed(work / "stored"), elapsed(work / "live")
    end = min(stored[-1], live[-1])
    return sum(e <= end for e in stored) / max(1, sum(e <= end for e in live))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-tokens", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--eval-tokens", type=int, default=2048)
    p.add_argument("--top-k", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--order", default="stored,live", help="the order the two runs go in")
    p.add_argument("--parallel", action="store_true",
                   help="run the two arms at the same time, one torch thread each: both meet the same machine load, "
                        "so their step times compare on a shared machine")
    p.add_argument("--work", type=Path, help="working folder (default: a temporary one)")
    p.add_argument("--json", type=Path, default=Path("bench_teacher_store.json"))
    a = p.parse_args()

    from surgery.checkpoint.source import resolve_source
    from surgery.kv.convert import convert_to_kv_heads
    from surgery.kv.options import MQAOptions

    work = a.work or Path(tempfile.mkdtemp(prefix="bench-teacher-store-"))
    work.mkdir(parents=True, exist_ok=True)
    source = resolve_source("smollm2")
    mqa = work / "smollm2-mqa"
    if not mqa.exists():
        convert_to_kv_heads(source, mqa, MQAOptions(), progress=False)
    other = python_source_text(work)
    data = ["--data", "pydoc", "--tokens", a.tokens, "--seq-len", a.seq_len, "--batch-tokens", a.batch_tokens,
            "--micro-batch", a.micro_batch, "--eval-tokens", a.eval_tokens, "--seed", 0, "--precision", "fp32"]
    store = work / "store"
    t_seconds, t_peak, _ = run_child(["teacher", source.folder, "--out", store, "--top-k", a.top_k, "--device", "cpu",
                                      "--force", *data])
    manifest = json.loads((store / "manifest.json").read_text())
    disk = sum(f.stat().st_size for f in store.iterdir())
    train = [*data, "--loss", "kd", "--lr", a.lr, "--eval-data", other, "--eval-every", 0, "--save-every", 0,
             "--force"]
    results, children = {}, {}
    for name in a.order.split(","):
        extra = ["--teacher", source.folder] if name == "live" else ["--teacher-logprobs", store]
        args = ["uptrain", mqa, "--out", work / name, *train, *extra]
        children[name] = (start_child(args, threads=1 if a.parallel else None), args)
        if not a.parallel:
            children[name] = finish_child(*children[name])
    for name, child in children.items():
        seconds, peak, _ = finish_child(*child) if a.parallel else child
        out = work / name
        record = json.loads((out / "surgery.json").read_text())["uptraining"]
        results[name] = {"wall_seconds": round(seconds, 1), "step_seconds": round(step_seconds(out), 3),
                         "peak_rss_gb": round(peak / 1e9, 3), "initial_pydoc_ppl": record["initial_eval_ppl"],
                         "pydoc_ppl": record["final_eval_ppl"], "json_source_ppl": record["final_other_eval_ppl"],
                         "initial_json_source_ppl": record["initial_other_eval_ppl"]}
        print(name, results[name], flush=True)
    live, stored = results["live"], results["stored"]
    summary = {
        "tokens": manifest["tokens"], "top_k": a.top_k, "store_bytes_per_token": manifest["bytes_per_token"],
        "store_bytes_on_disk_per_token": round(disk / manifest["tokens"], 1), "teacher_pass_seconds": round(t_seconds, 1),
        "teacher_pass_peak_rss_gb": round(t_peak / 1e9, 3),
        "step_time_live_over_stored": round(live["step_seconds"] / stored["step_seconds"], 3),
        **({"steps_stored_over_live_while_both_ran": round(shared_time_ratio(work), 3)} if a.parallel else {}),
        "peak_rss_stored_over_live": round(stored["peak_rss_gb"] / live["peak_rss_gb"], 3),
        "pydoc_ppl_stored_over_live": round(stored["pydoc_ppl"] / live["pydoc_ppl"], 4),
        "json_source_ppl_stored_over_live": round(stored["json_source_ppl"] / live["json_source_ppl"], 4),
        "teacher_pydoc_ppl": json.loads((work / "live" / "surgery.json").read_text())["uptraining"]["teacher_eval_ppl"],
    }
    print(json.dumps(summary, indent=1))
    a.json.write_text(json.dumps({"summary": summary, "runs": results, "options": vars(a) | {"work": str(work),
                                                                                          "json": str(a.json)}},
                                 indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
