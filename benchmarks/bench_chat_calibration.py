"""Calibrating on chat-formatted text vs plain text: SmolLM2-135M-Instruct (a chat model) merged to MQA by the
aligned merge, once calibrated on conversations rendered with its chat template, once on the same documents as
plain text; both evaluated against the source on held-out chat-formatted text and on held-out plain text.

    python benchmarks/bench_chat_calibration.py [--calib-tokens 8192] [--eval-tokens 8192] [--kv-heads 1]
                                                [--json out.json]

Data, built offline from pydoc topics: a conversation is a user asking "Explain <topic name>" and the assistant
answering with the topic's text. The calibration documents are the second half of the topics (sorted by name), the
held-out ones the first half: no document is shared, and both calibrations read the same documents, only formatted
differently (`--chat-template auto` on the messages column, vs a text column). Every number is measured in this
run: the source's perplexity on the same windows is the baseline.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from surgery.chat import ChatFormat
from surgery.checking.compare import compare_models
from surgery.checkpoint.source import resolve_source
from surgery.data import load_texts, token_stream
from surgery.kv.aligned import convert_aligned
from surgery.kv.options import GQAOptions
from surgery.runtime import load_model, load_tokenizer


def topics_split() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    from pydoc_data.topics import topics

    names = sorted(topics)
    half = len(names) // 2
    return [(n, topics[n]) for n in names[half:]], [(n, topics[n]) for n in names[:half]]


def write_sources(folder: Path, docs: list[tuple[str, str]], name: str) -> tuple[Path, Path]:
    """The documents as conversations (a messages column) and as plain text (a text column)."""
    chat, plain = folder / f"{name}-chat.jsonl", folder / f"{name}-plain.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Explain {title}"},
                                                     {"role": "assistant", "content": text}]}) + "\n"
                            for title, text in docs))
    plain.write_text("".join(json.dumps({"text": text}) + "\n" for _, text in docs))
    return chat, plain


def evaluate(src_model, folder: Path, held: dict[str, torch.Tensor]) -> dict:
    model = load_model(resolve_source(str(folder)), torch.device("cpu"), "float32")
    try:
        return {name: compare_models(src_model, model, ids, 512, 4, causal=True) for name, ids in held.items()}
    finally:
        del model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    src = resolve_source("smollm2")
    tokenizer = load_tokenizer(src)
    calib_docs, held_docs = topics_split()
    with tempfile.TemporaryDirectory(prefix="bench-chat-") as tmp:
        tmp = Path(tmp)
        calib_chat, calib_plain = write_sources(tmp, calib_docs, "calib")
        held_chat, held_plain = write_sources(tmp, held_docs, "held")
        chat = ChatFormat("auto", tokenizer)
        assert chat.templated, "the source's tokenizer has no chat template"
        held = {"chat": token_stream(load_texts(str(held_chat), chat=chat), tokenizer, args.eval_tokens),
                "plain": token_stream(load_texts(str(held_plain), chat=chat), tokenizer, args.eval_tokens)}
        src_model = load_model(src, torch.device("cpu"), "float32")
        results = {}
        for name, calib, mode in (("chat", calib_chat, "auto"), ("plain", calib_plain, "off")):
            start = time.time()
            out = tmp / f"mqa-{name}"
            options = GQAOptions(kv_heads=args.kv_heads, merge="aligned", calib=[str(calib)],
                                 calib_tokens=args.calib_tokens, chat_template=mode)
            convert_aligned(src, out, options, progress=False)
            seconds = time.time() - start
            results[name] = {"convert_s": round(seconds, 1), **evaluate(src_model, out, held)}
            print(f"calibrated on {name} text ({seconds:.0f}s)", flush=True)
    print(f"\nSmolLM2-135M-Instruct -> {args.kv_heads} K/V head(s), aligned merge, {args.calib_tokens} calibration "
          f"tokens; held-out windows of 512, {args.eval_tokens} tokens each")
    print("| calibrated on | eval text | source ppl | converted ppl | ppl ratio | KL | top-1 agreement |")
    print("|---|---|---|---|---|---|---|")
    for name in ("chat", "plain"):
        for text in ("chat", "plain"):
            r = results[name][text]
            print(f"| {name} | {text} | {r['ppl_source']:.3f} | {r['ppl_converted']:.3f} | "
                  f"{r['ppl_converted'] / r['ppl_source']:.3f} | {r['kl']:.4f} | {r['top1_agreement']:.4f} |")
    for text in ("chat", "plain"):
        ratio = results["chat"][text]["ppl_converted"] / results["plain"][text]["ppl_converted"]
        print(f"{text} held-out text: converted ppl, chat-calibrated / plain-calibrated = {ratio:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                        indent=2, default=str))


if __name__ == "__main__":
    main()
