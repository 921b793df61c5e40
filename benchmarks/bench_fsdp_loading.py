"""Peak RSS per rank of a KD uptraining run's setup under FSDP2 on 2 CPU processes (gloo): rank-0 loading against
every rank reading the student and an fp32 teacher (the loading before it), measured in the same run.

    OMP_NUM_THREADS=1 python benchmarks/bench_fsdp_loading.py [--model smollm2] [--precision bf16]

Each mode is one `accelerate launch --config_file recipes/accelerate/fsdp-cpu.yaml -m surgery.testing.fsdp_probe`:
uptrain's own make_accelerator, loading, teacher sharding and `prepare` (the student is its own teacher), then each
rank's peak RSS (getrusage) before anything else is loaded; the probe also checks that every rank's weights equal the
checkpoint's and the rotary tables are exact.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def probe(model: str, precision: str, every_rank_reads: bool) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO / "recipes/accelerate/fsdp-cpu.yaml"), "--num_processes", "2", "--main_process_port", "0",
               "-m", "surgery.testing.fsdp_probe", out, precision, model, model,
               *(["--every-rank-reads"] if every_rank_reads else [])]
        result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
        if result.returncode:
            sys.exit(f"probe failed:\n{result.stderr[-3000:]}")
        return [json.loads((Path(out) / f"rank-{r}.json").read_text()) for r in (0, 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "no"])
    args = ap.parse_args()
    rows = {}
    for name, every in (("every rank reads (fp32 teacher)", True), ("rank-0 loading (bf16 teacher)", False)):
        ranks = probe(args.model, args.precision, every)
        for r in ranks:
            assert not r["student"]["weights_differ"] and not r["teacher"]["weights_differ"], r
            assert all(r[role]["rotary_exact"].values() for role in ("student", "teacher")), r
        rows[name] = [r["peak_rss_kib"] / 1024 for r in ranks]
        print(f"{name:34s} rank 0 {rows[name][0]:7.0f} MiB   rank 1 {rows[name][1]:7.0f} MiB   "
              f"teacher {','.join(ranks[0]['teacher_param_dtypes'])}", flush=True)
    (old0, old1), (new0, new1) = rows.values()
    print(f"ratio new/old: rank 0 {new0 / old0:.2f}x, rank 1 {new1 / old1:.2f}x; rank 1 / rank 0 (new) {new1 / new0:.2f}x")


if __name__ == "__main__":
    main()
