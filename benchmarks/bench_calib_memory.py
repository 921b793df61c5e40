"""Peak RSS of the calibrated conversions against --calib-tokens: main's code (every calibration token's activations
held per layer) against this tree's (chunk by chunk; the residual stream past a budget on disk), in the same run.

    python benchmarks/bench_calib_memory.py --before /path/to/main/checkout [--layers 2] [--tokens 4096,16384,65536]
        [--kinds aligned,mla] [--spill-mb 0] [--source FOLDER] [--json out.json]

The source is the real SmolLM2-135M (`smollm2`) cut to its first `--layers` decoder layers (real weights, written
once beside --json or under /tmp: peak memory is one layer's work, so fewer layers change the time, not the peak).
Each conversion runs as `python -m surgery.cli convert SRC --out TMP ... --calib-tokens T` with PYTHONPATH set to
the code under test, in a child whose peak RSS is the kernel's (`ru_maxrss` of the child). Prints one row per
(kind, tokens): peak before, peak after, after/before, wall seconds and CPU seconds (user + system of the child:
what the load changes less) of each. `--spill-mb M` measures this tree once
more with `SURGERY_RESIDUAL_RAM_MB=M` (0: every residual chunk on disk), an extra column. `--source FOLDER` runs on
that checkpoint instead (e.g. benchmarks/synthetic.py's llama3-8b at 2 layers; `--kinds mla512,aligned` for its
MLA at rank 512, 32 rope dims).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEAK = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
        "r = resource.getrusage(resource.RUSAGE_CHILDREN); print(r.ru_utime + r.ru_stime, r.ru_maxrss * 1024, rc)")
KINDS = {
    "aligned": ["--to", "mqa", "--merge", "aligned"],
    "mla": ["--to", "mla", "--kv-rank", "64"],
    "mla512": ["--to", "mla", "--kv-rank", "512", "--rope-dim", "32"],  # the 8B layout's (issue 29)
}


def truncated_smollm2(layers: int, out: Path) -> Path:
    """SmolLM2-135M's embeddings, final norm and first `layers` decoder layers (the dequantized cache's tensors)."""
    if (out / "config.json").exists():
        return out
    from safetensors import safe_open
    from safetensors.torch import save_file

    from surgery.checkpoint.source import resolve_source

    src = resolve_source("smollm2").folder
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    tensors = {}
    with safe_open(src / "model.safetensors", "pt") as f:
        for name in f.keys():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= layers:
                continue
            tensors[name] = f.get_tensor(name)
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text()) | {"num_hidden_layers": layers}
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    for p in src.iterdir():
        if p.name.startswith(("tokenizer", "special_tokens", "generation", "chat_template")):
            shutil.copy(p, tmp / p.name)
    tmp.rename(out)
    return out


def measure(code: Path, src: Path, args: list[str], tokens: int, spill_mb: int | None = None) -> dict:
    env = os.environ | ({"SURGERY_RESIDUAL_RAM_MB": str(spill_mb)} if spill_mb is not None else {}) | {"PYTHONPATH": str(code), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                        "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory(prefix="calib-memory-") as tmp:
        cmd = [sys.executable, "-m", "surgery.cli", "convert", str(src), "--out", f"{tmp}/out", *args,
               "--calib", "pydoc", "--calib-tokens", str(tokens)]
        start = time.time()
        proc = subprocess.run([sys.executable, "-c", PEAK, *cmd], env=env, capture_output=True, text=True, cwd=tmp)
        wall = time.time() - start
    cpu, peak, rc = proc.stdout.split()[-3:]
    if rc != "0":
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return {"peak_rss": int(peak), "wall_s": round(wall, 1), "cpu_s": round(float(cpu), 1), "load": os.getloadavg()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", type=Path, required=True, help="A checkout of the baseline code (main).")
    p.add_argument("--after", type=Path, default=ROOT)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", default="4096,16384,65536")
    p.add_argument("--kinds", default="aligned,mla")
    p.add_argument("--source", type=Path, help="Where the cut SmolLM2 is written (default /tmp/smollm2-LAYERSl).")
    p.add_argument("--spill-mb", type=int, help="Also measure this tree with SURGERY_RESIDUAL_RAM_MB set to this.")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    src = truncated_smollm2(a.layers, a.source or Path(tempfile.gettempdir()) / f"smollm2-{a.layers}l")
    rows = []
    spill = f" | peak RSS after, residual budget {a.spill_mb} MiB" if a.spill_mb is not None else ""
    print(f"| conversion | calib tokens | peak RSS before | peak RSS after | after / before | wall before / after | "
          f"CPU s before / after{spill} |")
    print("|---|---|---|---|---|---|---|" + ("---|" if spill else ""))
    for tokens in (int(t) for t in a.tokens.split(",")):
        for kind in a.kinds.split(","):
            before = measure(a.before, src, KINDS[kind], tokens)
            after = measure(a.after, src, KINDS[kind], tokens)
            row = {"kind": kind, "args": KINDS[kind], "tokens": tokens, "before": before, "after": after,
                   "ratio": round(after["peak_rss"] / before["peak_rss"], 3)}
            extra = ""
            if a.spill_mb is not None:
                row["after_spill"] = measure(a.after, src, KINDS[kind], tokens, a.spill_mb)
                extra = f" {row['after_spill']['peak_rss'] / 1e9:.2f} GB |"
            rows.append(row)
            print(f"| `{' '.join(KINDS[kind])}` | {tokens:,} | {before['peak_rss'] / 1e9:.2f} GB | "
                  f"{after['peak_rss'] / 1e9:.2f} GB | {row['ratio']:.2f}x | {before['wall_s']:.0f} s / "
                  f"{after['wall_s']:.0f} s | {before['cpu_s']:.0f} / {after['cpu_s']:.0f} |{extra}", flush=True)
            if a.json:
                a.json.write_text(json.dumps({"source": str(src), "layers": a.layers, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
