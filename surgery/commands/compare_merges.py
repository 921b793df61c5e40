"""`surgery compare-merges`: every K/V merge method side by side on held-out text.

Each method converts the source into a temporary folder, the converted model is compared with the source
on the same held-out tokens (perplexity, KL(source||converted), top-1 agreement) and then deleted, so at
most two models are in memory at a time.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from ..checking.compare import compare_models
from ..kv.convert import convert_to_kv_heads
from ..data import load_texts, token_stream
from ..errors import SurgeryError
from ..checkpoint.source import Source, resolve_source
from ..calibration.text import pydoc_documents_used
from ..runtime import compute_threads, context_length, is_causal_lm, load_model, load_tokenizer, pick_device, threads
from ..kinds import options_for
from ..kv.options import ALIGNED, METHODS
from ..kv.aligned.convert import convert_aligned



def heldout_documents(tokenizer, tokens: int) -> list[int]:
    """Indices of the pydoc documents the first `tokens` tokens of pydoc come from (what `check` reads)."""
    from ..data import pydoc_texts

    used, count = [], 0
    for i, text in enumerate(pydoc_texts()):
        if count >= tokens:
            break
        if text:
            used.append(i)
            count += len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 1
    return used


def compare_merges(source: Source, kv_heads: int, methods: tuple[str, ...] = METHODS, data: str = "pydoc",
                   text_field: str = "text", tokens: int = 16384, seq_len: int = 1024, batch_size: int = 4,
                   calib: str = "pydoc", calib_tokens: int = 8192, seed: int = 0, device: str = "auto",
                   progress: bool = True) -> dict:
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise SurgeryError(f"unknown merge method(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(METHODS)}")
    calibration = dict(calib=[calib], calib_tokens=calib_tokens, device=device)  # the aligned merge's
    merges = {m: options_for("gqa", kv_heads=kv_heads, merge=m, seed=seed, **(calibration if m == ALIGNED else {}))
              for m in methods}  # each method's options, checked before any work
    tokenizer = load_tokenizer(source)
    overlap = None
    if data == "pydoc" and calib == "pydoc" and "aligned" in methods:
        overlap = sorted(set(heldout_documents(tokenizer, tokens)) & set(pydoc_documents_used(tokenizer, calib_tokens)))
        if overlap:
            raise SurgeryError(f"held-out text (first {tokens} pydoc tokens) and calibration ({calib_tokens} pydoc "
                               f"tokens from the end) share {len(overlap)} document(s): lower --tokens or --calib-tokens")
    dev = pick_device(device)
    src_model = load_model(source, dev, "float32")
    if not is_causal_lm(src_model.config):
        raise SurgeryError(f"{source.spec} is not a causal LM: compare-merges needs perplexity")
    ctx = context_length(src_model.config)
    seq_len = min(seq_len, ctx) if ctx else seq_len
    ids = token_stream(load_texts(data, text_field=text_field), tokenizer, tokens)
    rows = []
    with tempfile.TemporaryDirectory(prefix="surgery-compare-") as tmp:
        for method in methods:
            out = Path(tmp) / method
            start = time.time()
            with threads(compute_threads()):  # the plain converter drops to one thread for its I/O
                convert = convert_aligned if method == ALIGNED else convert_to_kv_heads
                record = convert(source, out, merges[method], progress=progress)
            seconds = time.time() - start
            with threads(compute_threads()):
                model = load_model(resolve_source(str(out)), dev, "float32")
                report = compare_models(src_model, model, ids, seq_len, batch_size, causal=True, progress=progress,
                                        desc=f"evaluate {method}")
            del model
            rows.append({"method": method, "ppl": report["ppl_converted"], "kl": report["kl"],
                         "top1_agreement": report["top1_agreement"], "max_abs_diff": report["max_abs_diff"],
                         "convert_seconds": round(seconds, 2), "kv_heads": record["kv_heads"]})
    return {"source": source.spec, "kv_heads": kv_heads, "data": data, "tokens": int(report["tokens"]),
            "seq_len": seq_len, "calibration": {"data": calib, "tokens": calib_tokens} if "aligned" in methods else None,
            "ppl_source": report["ppl_source"], "rows": rows}


COLUMNS = (("method", "merge method"), ("ppl", "perplexity on the held-out text"), ("x src", "perplexity / the source's"),
           ("KL", "KL(source‖merged) per token"), ("top-1", "top-1 agreement with the source"),
           ("secs", "conversion time"))


def print_comparison(result: dict, console=None) -> None:
    """One table that fits an 80-column terminal: short headers, spelled out in the caption."""
    from rich.console import Console
    from rich.table import Table

    kv = result["rows"][0]["kv_heads"]
    title = (f"{result['source']}: {kv['before']} -> {kv['after']} K/V heads, zero-shot on {result['data']}"
             f"[0:{result['tokens']}], windows {result['seq_len']} (source perplexity {result['ppl_source']:.3f})")
    table = Table(title=title, caption="; ".join(f"{h}: {what}" for h, what in COLUMNS[1:]))
    for header, _ in COLUMNS:
        table.add_column(header, justify="left" if header == "method" else "right", no_wrap=True)
    for r in result["rows"]:
        table.add_row(r["method"], f"{r['ppl']:.3f}", f"{r['ppl'] / result['ppl_source']:.2f}", f"{r['kl']:.4f}",
                      f"{100 * r['top1_agreement']:.2f}%", f"{r['convert_seconds']:.1f}")
    (console or Console()).print(table)
