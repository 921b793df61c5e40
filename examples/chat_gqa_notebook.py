"""A chat model to fewer K/V heads, as a notebook does it, every step through `import surgery`: SmolLM2-135M-Instruct
loaded with transformers, converted (the aligned merge calibrated on a `datasets.Dataset` of chat messages, rendered
with the model's own chat template), checked on held-out conversations, uptrained a few steps on the assistant turns
with TensorBoard logging, and given the model card `surgery push` would upload (hub metadata: base_model, the
check's numbers as model-index).

    python examples/chat_gqa_notebook.py                 # SmolLM2-135M-Instruct, embedded (no download)
    python examples/chat_gqa_notebook.py --fast          # small token budgets (the tests)

The conversations are made from pydoc's topics (no download): the user asks about a topic, the assistant answers
with its text. Half of them calibrate and train, the other half are held out for the check.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def conversations(first: int, stop: int) -> list[list[dict]]:
    """pydoc's topics [first, stop) as one-turn conversations."""
    from pydoc_data.topics import topics

    names = sorted(topics)[first:stop]
    return [[{"role": "user", "content": f"What does the Python reference say about {name.replace('-', ' ')}?"},
             {"role": "assistant", "content": topics[name].strip()}] for name in names]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="a chat model's folder or hub id, or smollm2 (default)")
    parser.add_argument("--kv-heads", type=int, default=1, help="K/V heads after the merge (SmolLM2 has 3)")
    parser.add_argument("--out", type=Path, help="where to write (default: a temporary folder)")
    parser.add_argument("--fast", action="store_true", help="small token budgets (tests)")
    args = parser.parse_args(argv)

    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import surgery
    from surgery.checkpoint.source import resolve_source

    out = args.out or Path(tempfile.mkdtemp(prefix="surgery-chat-"))
    out.mkdir(parents=True, exist_ok=True)
    calib_tokens, check_tokens, train_tokens, seq_len = (512, 512, 512, 128) if args.fast else (4096, 4096, 8192, 256)

    # 1. A loaded chat model and its tokenizer (the template renders the conversations below).
    folder = resolve_source(args.model).folder
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)

    # 2. Conversations as a datasets.Dataset with a `messages` column; the held-out ones never calibrate or train.
    from pydoc_data.topics import topics

    half = len(topics) // 2
    train = datasets.Dataset.from_dict({"messages": conversations(0, half)})
    held_out = datasets.Dataset.from_dict({"messages": conversations(half, len(topics))})

    # 3. Convert: fewer K/V heads, the aligned merge calibrated on the chat-formatted conversations.
    converted = surgery.convert(model, out / "gqa", to="gqa", kv_heads=args.kv_heads, merge="aligned",
                                tokenizer=tokenizer, calib=train, calib_tokens=calib_tokens, calib_window=seq_len,
                                chat_template="on", force=True)
    print(converted.message)

    # 4. Check against the source on held-out conversations.
    report = surgery.check(folder, converted, data=held_out, tokens=check_tokens, seq_len=seq_len,
                           chat_template="on")
    print(f"check: KL {report.kl:.4f}, top-1 agreement {report.top1_agreement:.1%}, perplexity "
          f"{report.ppl_source:.2f} -> {report.ppl_converted:.2f}")

    # 5. Uptrain a few steps: distillation from the source on the assistant turns, logged to TensorBoard.
    trained = surgery.uptrain(converted, out / "gqa-uptrained", data=train, chat_template="on", loss_on="assistant",
                              tokens=train_tokens, seq_len=seq_len, batch_tokens=2 * seq_len, micro_batch=2,
                              eval_tokens=2 * seq_len, eval_every=0, save_every=0, lr=1e-4,
                              report_to="tensorboard", force=True, progress=False)
    print(f"uptrain: {trained.metrics[-1]['tokens']} tokens, TensorBoard logs in {trained.folder / 'runs'}")

    # 6. The card `surgery.push` would upload, written beside (not into) the checkpoint.
    card = surgery.model_card(trained, "your-name/smollm2-gqa-chat", check_reports=[report], out=out / "CARD.md")
    print(f"model card: {out / 'CARD.md'} ({len(card.splitlines())} lines)")
    return {"converted": converted, "check": report, "uptrained": trained, "card": card}


if __name__ == "__main__":
    main()
