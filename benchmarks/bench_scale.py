"""Calibrated conversions and checks at real model sizes: peak memory, seconds per layer, and the estimates.

    python benchmarks/bench_scale.py [--layouts llama3-8b,qwen2.5-3b,gemma2-2b] [--layers K]
                                     [--runs aligned,switchhead,check] [--calib-tokens 1024] [--device cpu]
                                     [--check-tokens 1024] [--root /work/scratch/scale] [--json out.json]

On synthetic checkpoints with the exact layouts of the real models (benchmarks/synthetic.py: random bf16 weights,
written once under --root and reused), runs as subprocesses, exactly as a user would:

    surgery convert SYNTH --to gqa --kv-heads 2 --merge aligned --calib-tokens 1024     (aligned)
    surgery convert SYNTH --to switchhead --heads 8 --experts 4 --topk 2 ...            (switchhead)
    surgery convert SYNTH --to mla --kv-rank 512 --rope-dim 32 ...                      (mla, llama3-8b only)
    surgery check SYNTH CONVERTED --tokens 1024 --dtype bfloat16                        (check)

(`--runs search`: the grouping search alone at the layout's shapes, the new way against the old way measured in the
same run; `--runs group-merge`: one K/V group merge) and measures each conversion's peak resident memory (the process tree, polled every 0.1 s with psutil), its wall time and
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

from synthetic import DEFAULT_OUT, LAYOUTS, ensure  # noqa: E402

# The conversion each layout gets (a head count that divides the layout's heads).
SWITCHHEAD = {"llama3-8b": (8, 4, 2), "qwen2.5-3b": (4, 4, 2), "gemma2-2b": (4, 2, 2)}
KV_HEADS = {"llama3-8b": 2, "qwen2.5-3b": 1, "gemma2-2b": 2}
# --to mla's latent rank and rope dims (DeepSeek-V3's 512 + a rope key within Llama 3's unscaled frequencies)
MLA = {"llama3-8b": (512, 32)}
TARGET_CONVERT = 0.19
TARGET_CHECK = 1.3
PROGRESS = re.compile(r": layer (\d+)/(\d+) \(([\d.]+) s\)")


class TreeMonitor:
    """Peak resident memory of a process and all its children, and (CUDA) the peak GPU memory nvidia-smi reports."""

    def __init__(self, pid: int, gpu: bool = False, log: Path | None = None):
        self.proc = psutil.Process(pid)
        self.log, self.log_size = log, 0
        self.marks: list[tuple[int, float, float]] = []  # (layers done, wall s, CPU s of the tree) at each progress line
        self.start = time.time()
        self.cpu = 0.0
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
        cpu = 0.0
        for p in procs:
            try:
                total += p.memory_info().rss
                t = p.cpu_times()
                cpu += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        self.cpu = max(self.cpu, cpu)
        return total

    def _stamp_progress(self) -> None:
        """CPU seconds of the tree when each per-layer progress line appears (wall time on a shared machine
        depends on the other jobs; CPU time is what the estimate's probe predicts for an idle core)."""
        size = self.log.stat().st_size
        if size == self.log_size:
            return
        self.log_size = size
        done = [int(m.group(1)) for m in PROGRESS.finditer(self.log.read_text())]
        if done and (not self.marks or done[-1] != self.marks[-1][0]):
            self.marks.append((done[-1], time.time() - self.start, self.cpu))

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
            if self.log is not None:
                self._stamp_progress()
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
        mon = TreeMonitor(proc.pid, gpu, log)
        code = proc.wait()
        mon.stop()
    wall = time.time() - start
    text = log.read_text()
    marks = [(int(m.group(1)), int(m.group(2)), float(m.group(3))) for m in PROGRESS.finditer(text)]
    return {"command": "surgery " + " ".join(cmd), "returncode": code, "wall_s": round(wall, 1),
            "peak_rss": mon.peak, "peak_gpu": mon.peak_gpu or None, "layer_marks": marks, "cpu_s": round(mon.cpu, 1),
            "cpu_marks": mon.marks, "load_average": os.getloadavg(),
            "tail": text.strip().splitlines()[-3:]}


def seconds_per_layer(marks: list[tuple[int, int, float]]) -> float | None:
    """Mean seconds per layer from the progress lines: (layer i/N (t s)) cumulative times."""
    if not marks:
        return None
    if len(marks) == 1:
        return marks[0][2]
    return (marks[-1][2] - marks[0][2]) / (marks[-1][0] - marks[0][0]) if len(marks) > 2 else marks[-1][2] / marks[-1][0]


def cpu_per_layer(marks: list[tuple[int, float, float]]) -> float | None:
    """CPU seconds per layer between the first and the last progress line (the first layer alone when only one)."""
    if not marks:
        return None
    if len(marks) == 1:
        return None
    (l0, _, c0), (l1, _, c1) = marks[0], marks[-1]
    return (c1 - c0) / (l1 - l0)


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


def group_merge(layout: str, repeats: int = 2) -> dict:
    """One K/V group merge (surgery/kv/aligned/fit.py merge_group, float64, one thread as the pipeline runs it) at the
    layout's shapes, timed against the estimate (group_merge_flops / the float64 probe). With --grouping similarity
    (the default) a layer runs C(K, K/G) + G of them: for the 8B, 8 -> 2 K/V heads, 72."""
    import torch

    from surgery.estimate import layer_shape, probe_throughput
    from surgery.kv.cost import group_evaluations, group_merge_flops
    from surgery.kv.aligned.fit import merge_group
    from surgery.fitting.rotary import rotary_pairs
    from surgery.runtime import threads

    s = layer_shape(LAYOUTS[layout])
    n = s.kv_heads // KV_HEADS[layout]
    r, d, din = s.heads // s.kv_heads, s.head_dim, s.hidden + s.qkv_bias
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * din, din, generator=g, dtype=torch.float64)
    sigma = x.T @ x / x.shape[0]
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64) * 0.02  # noqa: E731
    keys, values, queries, o_heads = rnd(n, d, din), rnd(n, d, din), rnd(n, r, d, din), rnd(n, r, s.hidden, d)
    pairs = rotary_pairs(d, d, "half")
    with threads(1):
        rate = probe_throughput("cpu").float64
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            merge_group(keys, values, queries, o_heads, sigma, pairs, True)
            times.append(time.perf_counter() - start)
    measured = min(times)
    estimated = group_merge_flops(s, n) / rate
    count = len(group_evaluations(s.kv_heads, KV_HEADS[layout]))
    print(f"-- group merge ({n} K/V heads of {d} dims, d_in {din}, float64, 1 thread): measured {measured:.1f} s, "
          f"estimated {estimated:.1f} s ({group_merge_flops(s, n) / 1e9:.0f} GFLOP at {rate / 1e9:.1f} GFLOP/s), "
          f"measured/estimated {measured / estimated:.2f}; {count} per layer with --grouping similarity "
          f"= {count * measured:.0f} s per layer")
    return {"layout": layout, "kind": "group-merge", "members": n, "seconds": measured, "estimated_seconds": estimated,
            "gflop": group_merge_flops(s, n) / 1e9, "float64_rate": rate, "per_layer_with_search": count}


def grouping_search(layout: str, full_max: int = 12, sample: int = 2) -> dict | None:
    """The --grouping similarity search for one layer at the layout's shapes (random weights and sigma, float64, one
    thread), the new way (per-head products once, each candidate scored from them: surgery/kv/aligned/grams.py) against
    the old way (merging every candidate: layer.merge_loss), measured in the same run. With more than `full_max`
    candidates the old way is timed on `sample` of them and multiplied by the count (the candidates all cost the
    same: one group merge each); otherwise both searches run whole and must pick the same groups."""
    import itertools

    import torch

    from surgery.estimate import layer_shape, probe_throughput
    from surgery.kv.cost import group_evaluations, search_flops
    from surgery.kv.aligned.assign import assign_groups, searched
    from surgery.kv.aligned.grams import group_loss, head_grams
    from surgery.kv.aligned.layer import group_blocks, merge_loss
    from surgery.kv.aligned.params import AttnParams
    from surgery.fitting.rotary import rotary_pairs
    from surgery.runtime import threads

    s = layer_shape(LAYOUTS[layout])
    kv_out = KV_HEADS[layout]
    if not searched(s.kv_heads, kv_out):
        print(f"-- grouping search: {s.kv_heads} -> {kv_out} K/V heads has a single grouping; nothing to search")
        return None
    n, d, din = s.kv_heads // kv_out, s.head_dim, s.hidden + s.qkv_bias
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * din, din, generator=g, dtype=torch.float64)
    sigma = x.T @ x / x.shape[0]
    rnd = lambda *shape: torch.randn(*shape, generator=g) * 0.02  # noqa: E731  (float32, as the pipeline has them)
    p = AttnParams(rnd(s.heads * d, din), rnd(s.kv_heads * d, din), rnd(s.kv_heads * d, din), rnd(s.hidden, s.heads * d),
                   None, False)
    pairs = rotary_pairs(d, s.rotary, "half")
    candidates = len(group_evaluations(s.kv_heads, kv_out)) - kv_out
    with threads(1):
        rate = probe_throughput("cpu").float64
        start = time.perf_counter()
        grams = head_grams(*group_blocks(p, s.kv_heads, d), sigma, pairs, True)
        shared = time.perf_counter() - start
        new_groups = assign_groups(lambda m: group_loss(grams, m), s.kv_heads, kv_out)
        new = time.perf_counter() - start
        old_cost = merge_loss(p, sigma, s.kv_heads, d, pairs, True)
        start = time.perf_counter()
        if candidates <= full_max:
            old_groups = assign_groups(old_cost, s.kv_heads, kv_out)
            old = time.perf_counter() - start
            same, how = old_groups == new_groups, "whole search"
            worst = None
        else:
            probe = list(itertools.combinations(range(s.kv_heads), n))[:sample]
            scores = [old_cost(m) for m in probe]
            old = (time.perf_counter() - start) / len(probe) * candidates
            worst = max(abs(a - group_loss(grams, m)) / abs(a) for a, m in zip(scores, probe))
            same, how = None, f"{len(probe)} of {candidates} candidates timed, x{candidates}"
    print(f"-- grouping search ({s.kv_heads} -> {kv_out} K/V heads, {candidates} candidate groups of {n}, d_in {din}, "
          f"float64, 1 thread): new {new:.1f} s (shared products {shared:.1f} s; estimated "
          f"{search_flops(s, kv_out) / rate:.1f} s at {rate / 1e9:.1f} GFLOP/s), old {old:.0f} s ({how}); "
          f"old/new {old / new:.1f}x"
          + (f"; same groups: {same}" if same is not None else f"; largest score difference {worst:.1e} (relative)"))
    return {"layout": layout, "kind": "grouping-search", "candidates": candidates, "new_seconds": new,
            "shared_seconds": shared, "old_seconds": old, "old_measured": how, "ratio": old / new,
            "same_groups": same, "score_difference": worst, "estimated_new_seconds": search_flops(s, kv_out) / rate}


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))


def gb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f} GB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default="llama3-8b,qwen2.5-3b,gemma2-2b")
    p.add_argument("--layers", type=int, help="Decoder layers of the synthetic checkpoints (default: the real count).")
    p.add_argument("--runs", default="aligned,switchhead,check",
                   help="Comma-separated: aligned, switchhead, mla, check (of the last conversion), group-merge (one K/V "
                        "group merge in isolation), search (the grouping search, new way vs old way).")
    p.add_argument("--grouping", default="similarity", choices=["similarity", "consecutive"],
                   help="The aligned merge's --grouping (consecutive skips the search over groupings).")
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
        kinds = [x.strip() for x in args.runs.split(",") if x.strip()]
        needs_checkpoint = any(k not in ("group-merge", "search") for k in kinds)
        folder = ensure(layout, args.layers, args.root) if needs_checkpoint else None
        size = checkpoint_bytes(layout)
        tag = f"{layout}-{args.layers}l" if args.layers else layout
        print(f"\n== {layout} ({folder}; full bf16 checkpoint {gb(size)}) ==")
        converted = None
        for kind in kinds:
            device_opt = ["--device", args.device] if gpu else []
            if kind == "aligned":
                out = runs_dir / f"{tag}-gqa"
                cmd = ["convert", str(folder), "--to", "gqa", "--kv-heads", str(KV_HEADS[layout]), "--merge", "aligned",
                       "--grouping", args.grouping, "--calib", "pydoc", "--calib-tokens", str(args.calib_tokens), "--out", str(out), "--force", *device_opt]
            elif kind == "switchhead":
                h, e, k = SWITCHHEAD[layout]
                out = runs_dir / f"{tag}-sh"
                cmd = ["convert", str(folder), "--to", "switchhead", "--heads", str(h), "--experts", str(e), "--topk",
                       str(k), "--calib", "pydoc", "--calib-tokens", str(args.calib_tokens), "--out", str(out), "--force",
                       *device_opt]
            elif kind == "mla":
                rank, rope = MLA[layout]
                out = runs_dir / f"{tag}-mla"
                cmd = ["convert", str(folder), "--to", "mla", "--kv-rank", str(rank), "--rope-dim", str(rope),
                       "--calib", "pydoc", "--calib-tokens", str(args.calib_tokens), "--out", str(out),
                       "--force", *device_opt]
            elif kind == "group-merge":
                results.append(group_merge(layout))
                continue
            elif kind == "search":
                results.append(grouping_search(layout))
                continue
            elif kind == "check":
                if converted is None:
                    print("check: no conversion ran before it in --runs; skipped")
                    continue
                cmd = ["check", str(folder), str(converted), "--tokens", str(args.check_tokens), "--dtype", "bfloat16",
                       "--device", args.device]
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
                     checkpoint_bytes=size, folder_bytes=folder_bytes(folder), estimate=estimate,
                     estimate_extrapolated=extrapolated)
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
    # A conversion's peak is bounded by one layer: it is compared with the full model's checkpoint, also when only
    # K layers ran. The check holds one whole model: it is compared with the checkpoint it loaded.
    check = r["kind"] == "check"
    size = r["folder_bytes"] if check else r["checkpoint_bytes"]
    ratio = r["peak_rss"] / size
    target = TARGET_CHECK if check else TARGET_CONVERT
    print(f"-- {r['kind']}: {r['command']}")
    if r["returncode"]:
        print(f"   FAILED (exit {r['returncode']}): {' | '.join(r['tail'])}")
    what = "the checked bf16 checkpoint" if check else "the full bf16 checkpoint"
    print(f"   wall {r['wall_s']:.0f} s; peak RSS {gb(r['peak_rss'])} = {ratio:.3f}x {what} ({gb(size)}; "
          f"target <= {target}x: {'met' if ratio <= target else 'NOT met'})"
          + (f"; peak GPU {gb(r['peak_gpu'])}" if r["peak_gpu"] else ""))
    est = r.get("estimate")
    spl = r["seconds_per_layer"]
    cpl = cpu_per_layer(r["cpu_marks"])
    r["cpu_seconds_per_layer"] = cpl
    if spl is not None:
        print(f"   seconds per layer {spl:.1f} wall (from {len(r['layer_marks'])} progress lines)"
              + (f", {cpl:.1f} CPU" if cpl else "") + f"; load average at the end {r['load_average'][0]:.1f}")
    if est:
        host = est["host_bytes"]
        print(f"   estimated: peak host {gb(host)} (measured/estimated {r['peak_rss'] / host:.2f}), "
              f"{est['seconds_per_layer']:.1f} s/layer"
              + (f" (measured/estimated {spl / est['seconds_per_layer']:.2f})" if spl else ""))
        if est.get("cpu_seconds_per_layer"):
            print(f"   estimated CPU time per layer {est['cpu_seconds_per_layer']:.1f} s"
                  + (f", measured {cpl:.1f} s (measured/estimated {cpl / est['cpu_seconds_per_layer']:.2f})"
                     if cpl else ""))
        ext = r.get("estimate_extrapolated")
        if ext:
            scale = spl / est["seconds_per_layer"] if spl else 1.0
            print(f"   at {ext['tokens']} calibration tokens: estimated peak host {gb(ext['host_bytes'])}, "
                  f"{ext['seconds_per_layer'] * scale:.1f} s/layer (estimate x measured/estimated), whole model "
                  f"{ext['seconds_per_layer'] * scale * ext['layers'] / 60:.1f} min")


if __name__ == "__main__":
    main()
