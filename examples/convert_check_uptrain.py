"""Convert a loaded model to fewer K/V heads, check it, and uptrain it a few steps, all through `import surgery`.

    python examples/convert_check_uptrain.py                  # SmolLM2-135M, embedded (no download)
    python examples/convert_check_uptrain.py --model DIR      # a local checkpoint folder (or a hub id)
    python examples/convert_check_uptrain.py --to gqa --kv-heads 2 --model DIR

SmolLM2-135M has 9 query heads sharing 3 K/V heads; `--kv-heads 1` makes it MQA. The steps, as a notebook would run
them: load the model with transformers, convert the loaded model (the aligned merge, calibrated on a
`datasets.Dataset` of documents), check the result against the source on held-out text, train it for a few steps
with distillation from the source, and load the trained model back. `--fast` shrinks every token budget (for a
tiny model in the tests).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="a checkpoint folder, a hub id, or smollm2 (default)")
    parser.add_argument("--to", default="mqa", choices=["mqa", "gqa"])
    parser.add_argument("--kv-heads", type=int, default=1, help="K/V heads after the merge (gqa)")
    parser.add_argument("--out", type=Path, help="where to write (default: a temporary folder)")
    parser.add_argument("--fast", action="store_true", help="small token budgets (tiny models, tests)")
    args = parser.parse_args(argv)

    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import surgery
    from surgery.checkpoint.source import resolve_source
    from surgery.data import pydoc_texts

    out = args.out or Path(tempfile.mkdtemp(prefix="surgery-example-"))
    out.mkdir(parents=True, exist_ok=True)
    calib_tokens, check_tokens, train_tokens, seq_len = (1024, 256, 1024, 64) if args.fast else (4096, 4096, 8192, 256)

    # 1. What a notebook has: a loaded model and its tokenizer.
    folder = resolve_source(args.model).folder  # smollm2: the embedded GGUF, dequantized once into the cache
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)

    # 2. Calibration text as a datasets.Dataset: pydoc's last documents (the check below reads its first ones).
    docs = pydoc_texts()
    calibration = datasets.Dataset.from_dict({"text": docs[len(docs) // 2:]})

    # 3. Convert the loaded model (saved once into the cache, converted from there).
    options = {"kv_heads": args.kv_heads} if args.to == "gqa" else {}
    converted = surgery.convert(model, out / args.to, to=args.to, tokenizer=tokenizer, merge="aligned",
                                calib=calibration, calib_tokens=calib_tokens, calib_window=seq_len, force=True,
                                **options)
    print(converted.message)

    # 4. Check it against the source on held-out text (pydoc's first documents, a list of strings).
    before = surgery.check(model, converted, data=docs[:len(docs) // 2], tokens=check_tokens, seq_len=seq_len)
    print(f"check: KL {before.kl:.4f}, top-1 agreement {before.top1_agreement:.1%}, perplexity "
          f"{before.ppl_source:.2f} -> {before.ppl_converted:.2f}")

    # 5. Uptrain a few steps, distilling from the source (recorded in the converted folder's surgery.json).
    trained = surgery.uptrain(converted, out / f"{args.to}-uptrained", data=docs[len(docs) // 2:], tokens=train_tokens,
                              seq_len=seq_len, batch_tokens=8 * seq_len, micro_batch=4, eval_tokens=4 * seq_len,
                              eval_every=0, save_every=0, lr=3e-4, force=True, progress=False)
    first, last = trained.metrics[0], trained.metrics[-1]
    print(f"uptrain: {last['tokens']} tokens, held-out perplexity {first['eval_ppl']:.2f} -> {last['eval_ppl']:.2f}")

    # 6. The trained model, ready to use.
    student = trained.load()
    print(f"{type(student).__name__}: {student.config.num_attention_heads} heads, "
          f"{student.config.num_key_value_heads} K/V heads, in {trained.folder}")
    return {"converted": converted, "check": before, "uptrained": trained}


if __name__ == "__main__":
    main()
