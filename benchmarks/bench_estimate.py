"""A calibrated conversion's dry-run estimate against the same conversion measured: peak RSS and CPU seconds per
layer.

    python benchmarks/bench_estimate.py SRC [--tiny-llama] [--json out.json] -- CONVERT ARGS...
    python benchmarks/bench_estimate.py --layout llama3-8b [--layers K] -- CONVERT ARGS...   (the estimate only)
    e.g. python benchmarks/bench_estimate.py smollm2 -- --to mla --kv-rank 64 --calib-tokens 2048

Runs `surgery convert SRC ARGS --dry-run --json -` (the estimate, with its one-second throughput probe), then
`surgery convert SRC ARGS --out TMP --force` as a subprocess, polled by bench_scale's monitor (peak RSS of the
process tree every 0.1 s, CPU seconds stamped at each per-layer progress line). CPU seconds per layer are taken
between the first and the last progress line, over every pass the conversion makes (`--to mla` with a choice of
rotary frequencies runs two: the frequency scores, then the conversion), times the number of passes: one decoder
layer's whole work, what the estimate's "CPU time per layer" predicts.

--layout prints the estimate alone for a synthetic layout (benchmarks/synthetic.py's config, with K decoder
layers), without writing the checkpoint: what `--dry-run` on bench_scale.py's synthetic folder prints (the
checkpoint's dtype: bfloat16), for a conversion measured before.

--tiny-llama writes SRC first (if absent): the 7.3M-parameter Llama of tests/estimate/test_estimate_memory.py (vocabulary
8,192, 4 layers of 256, 8 heads, 4 K/V heads), whose model terms are a visible part of the peak.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import time
import sys
import tempfile
from pathlib import Path

import bench_scale  # its subprocess runner and monitor (benchmarks/, the script's own folder, is on sys.path)

PASS = re.compile(r"(?m)^(.*?): layer (\d+)/(\d+) \(")


class AllPassesMonitor(bench_scale.TreeMonitor):
    """Stamps the CPU seconds at every progress line of every pass (bench_scale's stamps the latest layer index,
    which restarts with each pass)."""

    def _stamp_progress(self) -> None:
        size = self.log.stat().st_size
        if size == self.log_size:
            return
        self.log_size = size
        lines = len(PASS.findall(self.log.read_text()))
        if lines and (not self.marks or lines != self.marks[-1][0]):
            self.marks.append((lines, time.time() - self.start, self.cpu))


def write_tiny_llama(folder: Path) -> None:
    import torch
    import transformers as tf
    from surgery.testing.pydoc_llama import make_tokenizer

    tok = make_tokenizer()
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)


def layout_estimate(layout: str, layers: int | None, convert: list[str]) -> None:
    """The kind's estimate for a synthetic layout's config (`--to KIND --flag value ...`), probed on this machine."""
    from synthetic import LAYOUTS

    from surgery.estimate import probe_throughput
    from surgery.recipes.schema import step_models
    from surgery.runtime import compute_threads

    config = LAYOUTS[layout] | ({"num_hidden_layers": layers} if layers else {})
    fields = {flag.removeprefix("--").replace("-", "_"): int(v) if v.isdigit() else v
              for flag, v in zip(convert[::2], convert[1::2])}
    options = step_models()["convert"](**fields)
    rate = probe_throughput("cpu", threads_float32=compute_threads())
    est = options.kind.calibration_estimate(config, options.kind_options, dtype="bfloat16", device="cpu",
                                            throughput=rate)
    print(f"{layout} ({config['num_hidden_layers']} layers, synthetic bf16): surgery convert SYNTH {' '.join(convert)}")
    print("\n".join(est.lines()))


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", nargs="?")
    p.add_argument("--layout", help="A synthetic layout (benchmarks/synthetic.py): print its estimate, run nothing.")
    p.add_argument("--layers", type=int, help="Decoder layers of --layout (default: the real count).")
    p.add_argument("--tiny-llama", action="store_true", help="Write SRC as the 7.3M test Llama first (if absent).")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv[:split])
    convert = argv[split + 1:]
    if args.layout:
        layout_estimate(args.layout, args.layers, convert)
        return
    if args.tiny_llama and not Path(args.src, "config.json").exists():
        write_tiny_llama(Path(args.src))
    bench_scale.TreeMonitor = AllPassesMonitor  # bench_scale.run builds its monitor by this name
    estimate = bench_scale.dry_run(["convert", args.src, *convert])
    with tempfile.TemporaryDirectory() as tmp:
        r = bench_scale.run(["convert", args.src, *convert, "--out", str(Path(tmp) / "out"), "--force"],
                            Path(tmp) / "log.txt")
        log = (Path(tmp) / "log.txt").read_text()
    if r["returncode"]:
        raise SystemExit(f"conversion failed: {' | '.join(r['tail'])}")
    passes = len({m.group(1) for m in PASS.finditer(log)}) or 1
    marks = r["cpu_marks"]
    cpu = (marks[-1][2] - marks[0][2]) / (marks[-1][0] - marks[0][0]) * passes if len(marks) > 1 else None
    est_cpu = estimate.get("cpu_seconds_per_layer")
    print(f"surgery convert {args.src} {' '.join(convert)}")
    # the kernel's peak of the children waited for (the dry run's is smaller), which the 0.1 s polling can miss
    peak = max(r["peak_rss"], resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
    r["peak_rss_kernel"] = peak
    print(f"  peak RSS {peak / 1e6:.0f} MB (polled {r['peak_rss'] / 1e6:.0f} MB), estimated "
          f"{estimate['host_bytes'] / 1e6:.0f} MB (measured/estimated {peak / estimate['host_bytes']:.2f})")
    if cpu is not None and est_cpu:
        print(f"  CPU s per layer {cpu:.2f} ({passes} pass(es), {len(marks)} progress stamps), estimated {est_cpu:.2f} "
              f"(measured/estimated {cpu / est_cpu:.2f}); whole run {r['cpu_s']:.1f} CPU s, {r['wall_s']:.0f} s wall")
    if args.json:
        args.json.write_text(json.dumps({"measured": r, "estimate": estimate, "cpu_per_layer": cpu}, indent=2) + "\n")


if __name__ == "__main__":
    main()
