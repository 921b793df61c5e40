"""Calibrated conversions and checks at real model sizes: peak memory, seconds per layer, and the estimates.

    python benchmarks/bench_scale.py [--layouts llama3-8b,qwen2.5-3b,gemma2-2b] [--layers K]
                                     [--runs aligned,switchhead,check] [--calib-tokens 1024] [--device cpu]
                                     [--check-tokens 1024] [--root /work/scratch/scale] [--json out.json]

On synthetic checkpoints with the exact layouts of the real models (benchmarks/synthetic.py: random bf16 weights,
written once under --root and reused), runs as subprocesses, exactly as a user would:

    surgery convert SYNTH --to gqa --kv-heads 2 --merge aligned --calib-tokens 1024     (aligned)
    surgery convert SYNTH --to switchhead --heads 8 --experts 4 --topk 2 ...            (switchhead)
    surgery check SYNTH CONVERTED --tokens 1024 --dtype bfloat16                        (check)

and measures each one's peak resident memory (the process tree, polled every 0.1 s with psutil), its wall time and
its seconds per layer (from the per-layer progress lines the calibration prints when stderr is not a terminal, else
from the wall time). Before each conversion `surgery convert ... --dry-run` prints the estimate (surgery/estimate.py,
with its one-second throughput probe on the same device and threads): the script prints measured / estimated.

Ratios are against the bf16 checkpoint's size on disk (the full model's, also for --layers K: per-layer costs do
not depend on the layer count, the embeddings are the same). Targets (issue 12): peak RSS of the conversions
<= 0.19x the bf16 checkpoint (3 GB for the 8B), the check <= 1.3x one bf16 model.

--layers K writes (once) and converts the same layout with K decoder layers: for a model whose whole conversion
would take hours on a small machine, the seconds per layer are measured on K layers and extrapolated.
--device cuda runs the conversions with `--device cuda` (when the convert command has that option) and also
reports the peak GPU memory the run reached (torch.cuda.max_memory_allocated is per process, so nvidia-smi's
per-process memory is polled instead).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from synthetic import DEFAULT_OUT, LAYOUTS, ensure  # noqa: E402

# The conversion each layout gets (a head count that divides the layout's heads).
SWITCHHEAD = {"llama3-8b": (8, 4, 2), "qwen2.5-3b": (4, 4, 2), "gemma2-2b": (4, 2, 2)}
KV_HEADS = {"llama3-8b": 2, "qwen2.5-3b": 1, "gemma2-2b": 2}
TARGET_CONVERT = 0.19
TARGET_CHECK = 1.3
PROGRESS = re.compile(r": layer (\d+)/(\d+) \(([\d.]+) s\)")


class TreeMonitor:
    """Peak resident memory of a process and all its children, and (CUDA) the peak GPU memory nvidia-smi reports."""

    def __init__(self, pid: int, gpu: bool = False):
        self.proc = psutil.Process(pid)
        self.peak = 0
        self.peak_gpu = 0
        self.gpu = gpu and shutil.which("nvidia-smi") is not None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree_rss(self) -> int:
        total = 0
        try:
            procs = [self.proc] + self.proc.children(recursive=True)
        except psutil.NoSuchProcess:
            return 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def _gpu_bytes(self) -> int:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True).stdout
        pids = {self.proc.pid} | {c.pid for c in self.proc.children(recursive=True)}
        return sum(int(used) << 20 for pid, used in (line.split(", ") for line in out.splitlines() if line)
                   if int(pid) in pids)

    def _run(self) -> None:
        ticks = 0
        while not self._stop.wait(0.1):
            self.peak = max(self.peak, self._tree_rss())
            ticks += 1
            if self.gpu and ticks % 5 == 0:
                try:
                    self.peak_gpu = max(self.peak_gpu, self._gpu_bytes())
                except (OSError, ValueError, psutil.Error):
                    pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run(cmd: list[str], log: Path, gpu: bool = False) -> dict:
    """Run `surgery ...` as a subprocess; peak tree RSS, wall time, per-layer progress, exit code."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.time()
    with open(log, "w") as f:
        f.write("$ surgery " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen([sys.executable, "-m", "cli", *cmd], cwd=ROOT, env=env, stdout=f,
                                stderr=subprocess.STDOUT)
        mon = TreeMonitor(proc.pid, gpu)
        code = proc.wait()
        mon.stop()
    wall = time.time() - start
    text = log.read_text()
    marks = [(int(m.group(1)), int(m.group(2)), float(m.group(3))) for m in PROGRESS.finditer(text)]
    return {"command": "surgery " + " ".join(cmd), "returncode": code, "wall_s": round(wall, 1),
            "peak_rss": mon.peak, "peak_gpu": mon.peak_gpu or None, "layer_marks": marks,
            "tail": text.strip().splitlines()[-3:]}


def seconds_per_layer(marks: list[tuple[int, int, float]]) -> float | None:
    """Mean seconds per layer from the progress lines: (layer i/N (t s)) cumulative times."""
    if not marks:
        return None
    if len(marks) == 1:
        return marks[0][2]
    return (marks[-1][2] - marks[0][2]) / (marks[-1][0] - marks[0][0]) if len(marks) > 2 else marks[-1][2] / marks[-1][0]


def dry_run(cmd: list[str]) -> dict:
    """`surgery convert ... --dry-run --json -`: the estimate, probed on this machine now."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "cli", *cmd, "--dry-run", "--json", "-"], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"dry run failed: {out.stderr.strip()}")
    return json.loads(out.stdout[out.stdout.index("{"):])


def checkpoint_bytes(layout: str) -> int:
    """bf16 bytes of the full-size layout (what the ratios are against), counted from its tensor shapes."""
    from synthetic import tensor_layout

    total = 0
    for _, shape in tensor_layout(LAYOUTS[layout]):
        n = 2
        for s in shape:
            n *= s
        total += n
    return total


def gb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f} GB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default="llama3-8b,qwen2.5-3b,gemma2-2b")
    p.add_argument("--layers", type=int, help="Decoder layers of the synthetic checkpoints (default: the real count).")
    p.add_argument("--runs", default="aligned,switchhead,check")
    p.add_argument("--calib-tokens", type=int, default=1024)
    p.add_argument("--extrapolate-tokens", type=int, default=8192)
    p.add_argument("--check-tokens", type=int, default=1024)
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto (passed to convert as --device when not cpu).")
    p.add_argument("--root", type=Path, default=DEFAULT_OUT)
    p.add_argument("--keep", action="store_true", help="Keep the converted checkpoints.")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    runs_dir = args.root / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    gpu = args.device != "cpu"
    results = []
    print(f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, device {args.device}; "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    for layout in [x.strip() for x in args.layouts.split(",") if x.strip()]:
        folder = ensure(layout, args.layers, args.root)
        size = checkpoint_bytes(layout)
        tag = f"{layout}-{args.layers}l" if args.layers else layout
        print(f"\n== {layout} ({folder}; full bf16 checkpoint {gb(size)}) ==")
        converted = None
        for kind in [x.strip() for x in args.runs.split(",") if x.strip()]:
            device_opt = ["--device", args.device] if gpu else []
            if kind == "aligned":
                out = runs_dir / f"{tag}-gqa"
                cmd = ["convert", str(folder), "--to", "gqa", "--kv-heads", str(KV_HEADS[layout]), "--merge", "aligned",
                       "--calib-tokens", str(args.calib_tokens), "--out", str(out), "--force", *device_opt]
            elif kind == "switchhead":
                h, e, k = SWITCHHEAD[layout]
                out = runs_dir / f"{tag}-sh"
                cmd = ["convert", str(folder), "--to", "switchhead", "--heads", str(h), "--experts", str(e), "--topk",
                       str(k), "--calib-tokens", str(args.calib_tokens), "--out", str(out), "--force", *device_opt]
            elif kind == "check":
                if converted is None:
                    print("check: no conversion ran before it in --runs; skipped")
                    continue
                cmd = ["check", str(folder), str(converted), "--tokens", str(args.check_tokens), "--dtype", "bfloat16",
                       "--device", args.device, "--trust-remote-code"]
                out = None
            else:
                raise SystemExit(f"unknown run {kind}")
            estimate = extrapolated = None
            if kind != "check":
                estimate = dry_run(cmd)
                extrapolated = dry_run([*cmd[:cmd.index("--calib-tokens") + 1], str(args.extrapolate_tokens),
                                        *cmd[cmd.index("--calib-tokens") + 2:]])
            r = run(cmd, runs_dir / f"{tag}-{kind}.log", gpu)
            r.update(layout=layout, kind=kind, layers=args.layers or LAYOUTS[layout]["num_hidden_layers"],
                     checkpoint_bytes=size, estimate=estimate, estimate_extrapolated=extrapolated)
            if out is not None and r["returncode"] == 0:
                converted = out
                record = json.loads((out / "surgery.json").read_text())
                r["calibration"] = record.get("calibration")
            r["seconds_per_layer"] = seconds_per_layer(r["layer_marks"])
            results.append(r)
            report(r)
        if converted is not None and not args.keep:
            for d in runs_dir.glob(f"{tag}-*"):
                if d.is_dir():
                    shutil.rmtree(d, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


def report(r: dict) -> None:
    size = r["checkpoint_bytes"]
    ratio = r["peak_rss"] / size
    target = TARGET_CHECK if r["kind"] == "check" else TARGET_CONVERT
    print(f"-- {r['kind']}: {r['command']}")
    if r["returncode"]:
        print(f"   FAILED (exit {r['returncode']}): {' | '.join(r['tail'])}")
    print(f"   wall {r['wall_s']:.0f} s; peak RSS {gb(r['peak_rss'])} = {ratio:.3f}x the bf16 checkpoint "
          f"(target <= {target}x: {'met' if ratio <= target else 'NOT met'})"
          + (f"; peak GPU {gb(r['peak_gpu'])}" if r["peak_gpu"] else ""))
    est = r.get("estimate")
    spl = r["seconds_per_layer"]
    if spl is not None:
        print(f"   seconds per layer {spl:.1f} (from {len(r['layer_marks'])} progress lines)")
    if est:
        host = est["host_bytes"]
        print(f"   estimated: peak host {gb(host)} (measured/estimated {r['peak_rss'] / host:.2f}), "
              f"{est['seconds_per_layer']:.1f} s/layer"
              + (f" (measured/estimated {spl / est['seconds_per_layer']:.2f})" if spl else ""))
        ext = r.get("estimate_extrapolated")
        if ext:
            scale = spl / est["seconds_per_layer"] if spl else 1.0
            print(f"   at {ext['tokens']} calibration tokens: estimated peak host {gb(ext['host_bytes'])}, "
                  f"{ext['seconds_per_layer'] * scale:.1f} s/layer (estimate x measured/estimated), whole model "
                  f"{ext['seconds_per_layer'] * scale * ext['layers'] / 60:.1f} min")


if __name__ == "__main__":
    main()
