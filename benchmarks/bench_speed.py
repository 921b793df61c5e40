"""Measured speed of each conversion of one source, through `surgery bench`, next to the decode limit set by the
bytes each decode step reads.

    python benchmarks/bench_speed.py --work DIR                      # SmolLM2-135M -> mqa, switchhead, talking-heads
    python benchmarks/bench_speed.py --work DIR --kinds mqa --batch 1,8 --context 2048,8192 --replicate-prefill
    python benchmarks/bench_speed.py --work DIR --report-only         # tables from the JSON files already in DIR
    python benchmarks/bench_speed.py --work DIR --kinds mqa,mla --engine llama.cpp \
        --llama-converter llama.cpp/convert_hf_to_gguf.py --context 2048,8192    # the same in llama.cpp (f32 GGUF)
    python benchmarks/bench_speed.py ... --engine llama.cpp --flash-attn off  # llama.cpp without flash attention

For every kind: converts SOURCE into DIR/KIND unless it is there (`surgery convert`), runs `surgery bench SOURCE
DIR/KIND --json DIR/KIND.json ...` (both models in one process, alternating rounds, medians), and prints a Markdown
table per kind. With `--engine llama.cpp` (needs llama-cpp-python) SOURCE and DIR/KIND are first converted by
llama.cpp's own converter into DIR/source-f32.gguf and DIR/KIND-f32.gguf (MQA/GQA and MLA outputs are llama.cpp
architectures; an MLA file is completed with `surgery.mla.gguf`), and the reports are DIR/KIND-llama.cpp.json
(DIR/KIND-llama.cpp-flash-off.json with `--flash-attn off`, passed on to `surgery bench`).

The decode limit: a decode step of a small model on CPU is bound by the bytes it reads, the weights plus the KV cache
of the batch, so the best possible decode speed-up is (weights + KV of the source) / (weights + KV of the conversion), with both KV sizes measured by `surgery bench`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONVERT = {"mqa": ["--to", "mqa"],
           "switchhead": ["--to", "switchhead", "--heads", "3", "--experts", "3", "--topk", "2",
                          "--calib-tokens", "2048"],
           "talking-heads": ["--to", "talking-heads"],
           "mla": ["--to", "mla", "--kv-rank", "64", "--rope-dim", "64", "--calib-tokens", "2048"]}
PLAIN = ("mqa", "mla")  # outputs transformers and llama.cpp load without custom code


def surgery(*args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-m", "cli", *args], cwd=REPO, env=env, check=True)


def to_gguf(converter: Path, folder: Path, out: Path) -> Path:
    """llama.cpp's convert_hf_to_gguf.py on a checkpoint folder (f32, unless `out` is already there)."""
    if not out.exists():
        subprocess.run([sys.executable, str(converter), str(folder), "--outtype", "f32", "--outfile", str(out)],
                       check=True)
    return out


def weight_bytes(folder: str) -> int:
    """Bytes of the weights a forward pass reads (tied embeddings once), from the safetensors headers (a .gguf
    file: its size, the tensors and a small header)."""
    from safetensors import safe_open

    if str(folder).endswith(".gguf"):
        return Path(folder).stat().st_size
    total, seen = 0, set()
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for name in st.keys():
                t = st.get_slice(name)
                n = 1
                for s in t.get_shape():
                    n *= s
                size = {"F32": 4, "F16": 2, "BF16": 2}.get(t.get_dtype(), 4)
                total += n * size
                seen.add(name)
    return total


def table(report: dict) -> list[str]:
    src_w = weight_bytes(report["models"]["source"]["folder"])
    conv_w = weight_bytes(report["models"]["converted"]["folder"])
    lines = ["| batch | context | prefill tok/s source → converted | prefill × | decode tok/s source → converted "
             "| decode × | decode limit (bytes/step) | KV cache × | spread (decode, src/conv) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in report["results"]:
        s, c, r = row["source"], row["converted"], row["ratio"]
        kv_s, kv_c = s["kv_cache_bytes"]["median"], c["kv_cache_bytes"]["median"]
        limit = (src_w + kv_s) / (conv_w + kv_c)
        pb = f" (batch {row['prefill_batch']})" if row.get("prefill_batch", row["batch"]) != row["batch"] else ""
        lines.append(
            f"| {row['batch']} | {row['context']} | {s['prefill_tokens_per_s']['median']:,.0f} → "
            f"{c['prefill_tokens_per_s']['median']:,.0f}{pb} | {r['prefill_tokens_per_s']:.2f}x | "
            f"{s['decode_tokens_per_s']['median']:.2f} → {c['decode_tokens_per_s']['median']:.2f} | "
            f"{r['decode_tokens_per_s']:.2f}x | {limit:.2f}x | {r['kv_cache_bytes']:.3f}x | "
            f"±{50 * s['decode_tokens_per_s']['spread']:.0f}% / ±{50 * c['decode_tokens_per_s']['spread']:.0f}% |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default="smollm2")
    parser.add_argument("--work", type=Path, required=True, help="folder for the conversions and the JSON reports")
    parser.add_argument("--kinds", default="mqa,switchhead,talking-heads")
    parser.add_argument("--batch", default="1")
    parser.add_argument("--context", default="1024,2048")
    parser.add_argument("--new", default="8")
    parser.add_argument("--rounds", default="3")
    parser.add_argument("--threads", default="1")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--replicate-prefill", action="store_true")
    parser.add_argument("--report-only", action="store_true", help="only print the tables of existing reports")
    parser.add_argument("--engine", default="transformers", choices=("transformers", "llama.cpp"))
    parser.add_argument("--llama-converter", type=Path, help="llama.cpp's convert_hf_to_gguf.py (--engine llama.cpp)")
    parser.add_argument("--flash-attn", choices=("on", "off"), help="llama.cpp's flash attention (surgery bench's "
                        "default: on)")
    args = parser.parse_args()
    llama = args.engine == "llama.cpp"
    if args.flash_attn and not llama:
        parser.error("--flash-attn works with --engine llama.cpp only")
    args.work.mkdir(parents=True, exist_ok=True)
    suffix = "-llama.cpp" + (f"-flash-{args.flash_attn}" if args.flash_attn else "") if llama else ""
    if llama and not args.report_only and (args.llama_converter is None or not args.llama_converter.is_file()):
        parser.error("--engine llama.cpp needs --llama-converter PATH/convert_hf_to_gguf.py")
    for kind in args.kinds.split(","):
        if llama and kind not in PLAIN:
            parser.error(f"--engine llama.cpp runs {' and '.join(PLAIN)} outputs only, not {kind}")
        out = args.work / kind
        report = args.work / f"{kind}{suffix}.json"
        if not args.report_only:
            if not (out / "config.json").exists():
                surgery("convert", args.source, *CONVERT[kind], "--out", str(out))
            source, converted, extra = args.source, str(out), []
            if llama:
                from surgery.checkpoint.source import resolve_source

                source = str(to_gguf(args.llama_converter, resolve_source(args.source).folder,
                                     args.work / "source-f32.gguf"))
                converted = str(to_gguf(args.llama_converter, out, args.work / f"{kind}-f32.gguf"))
                if kind == "mla":
                    from surgery.mla.gguf import complete_for_llama_cpp

                    complete_for_llama_cpp(Path(converted))
                extra += ["--engine", "llama.cpp"] + (["--flash-attn", args.flash_attn] if args.flash_attn else [])
            extra += ["--trust-remote-code"] if kind not in PLAIN else []
            extra += ["--replicate-prefill"] if args.replicate_prefill else []
            plot = args.work / f"{kind}{suffix}.png"
            surgery("bench", source, converted, "--batch", args.batch, "--context", args.context, "--new", args.new,
                    "--rounds", args.rounds, "--threads", args.threads, "--device", args.device, "--json", str(report),
                    "--plot", str(plot), *extra)
        data = json.loads(report.read_text())
        m = data["machine"]
        engine = data["models"]["source"]["attention"] if data["engine"] == "llama.cpp" else \
            f"transformers {m['transformers']}"
        print(f"\n### {kind}: `{data['command']}`\n\n{data['date']}, {m['processor']} ({m['cpu_count']} cores, "
              f"load average {', '.join(f'{x:.1f}' for x in m.get('load_average', []))} at the start), "
              f"{m['threads']} thread(s), {engine}, torch {m['torch']}, {data['dtype']}, "
              f"{data['rounds']} alternating rounds, {data['new_tokens']} new tokens\n")
        print("\n".join(table(data)))


if __name__ == "__main__":
    main()
