"""MLA from Qwen2 and Qwen3: absorbed biases / q/k norms vs dropping them, on small models trained here on pydoc.

A Qwen2-shaped and a Qwen3-shaped model (4 layers, hidden 128, 4 heads of 32, 2 K/V heads, the character
tokenizer of the tests: 96 ids) are trained from scratch for `--seconds` each on pydoc's middle documents (AdamW,
lr 3e-3, batches of 16 x 128 characters), so that Qwen2's q/k/v biases and Qwen3's q/k norm weights carry trained
statistics rather than their initial values. Each is then converted with `--to mla` at full rank (2 x 2 x 32 =
128, every rotary dim: what is left is the shared rope key's GQA loss and what DeepSeek-V3 cannot hold) and at half
rank (`--kv-heads 1`: MQA models, full rank 64, where only what DeepSeek-V3 cannot hold is left), with the
biases/norms absorbed (the default) and dropped (`absorb=False`, the baseline), calibrating on pydoc's last
documents (the conversion's own default) and measured on pydoc's first documents (read by neither the training nor
the calibration): KL(source || converted) per token and the perplexity ratio. `--keep DIR` keeps the trained
sources (and reuses them).

    OMP_NUM_THREADS=1 timeout 900 python benchmarks/bench_mla_families.py --seconds 150
    OMP_NUM_THREADS=1 timeout 900 python benchmarks/bench_mla_families.py --seconds 150 --kv-heads 1 --ranks 64 32
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch
import transformers as tf

from surgery.checkpoint.source import resolve_source
from surgery.data import pydoc_texts
from surgery.mla import convert_to_mla
from surgery.mla.options import MLAOptions
from surgery.testing.tiny_models import TOKENS, char_tokenizer

CONTEXT = 128
SHAPE = dict(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=CONTEXT, rope_theta=10000.0,
             tie_word_embeddings=True)
FAMILIES = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "glm": "GlmConfig"}  # GLM: `--families glm`


def encode(texts: list[str]) -> torch.Tensor:
    """Characters -> the character tokenizer's ids (printable ASCII 1..95, anything else 0)."""
    ids = [ord(c) - 31 if 32 <= ord(c) < 127 else 0 for c in "\n".join(texts)]
    return torch.tensor(ids)


def windows(ids: torch.Tensor, n: int | None = None) -> torch.Tensor:
    count = ids.numel() // CONTEXT if n is None else n
    return ids[: count * CONTEXT].view(count, CONTEXT)


def train(family: str, folder: Path, data: torch.Tensor, seconds: float, kv_heads: int, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    config = getattr(tf, FAMILIES[family])(**(SHAPE | TOKENS | {"num_key_value_heads": kv_heads}))
    model = tf.AutoModelForCausalLM.from_config(config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(seed)
    start, steps, loss = time.time(), 0, float("nan")
    while time.time() - start < seconds:
        batch = data[torch.randint(len(data), (16,), generator=g)]
        out = model(input_ids=batch, labels=batch)
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps, loss = steps + 1, float(out.loss)
    model.eval().save_pretrained(folder)
    char_tokenizer(folder)
    return {"steps": steps, "train_loss": round(loss, 4), "seconds": round(time.time() - start, 1)}


@torch.no_grad()
def evaluate(src: Path, out: Path, ids: torch.Tensor) -> dict:
    a = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    b = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    kl = nll_a = nll_b = 0.0
    for batch in ids.split(8):
        la, lb = a(input_ids=batch).logits.log_softmax(-1), b(input_ids=batch).logits.log_softmax(-1)
        kl += float((la.exp() * (la - lb)).sum())
        target = batch[:, 1:, None]
        nll_a -= float(la[:, :-1].gather(-1, target).sum())
        nll_b -= float(lb[:, :-1].gather(-1, target).sum())
    tokens, predicted = ids.numel(), ids.shape[0] * (ids.shape[1] - 1)
    return {"kl_per_token": kl / tokens, "ppl_source": math.exp(nll_a / predicted),
            "ppl_converted": math.exp(nll_b / predicted), "ppl_ratio": math.exp((nll_b - nll_a) / predicted)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=150)
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=2, help="1: MQA, where the shared rope key is exact and full "
                    "rank (64) leaves only what DeepSeek-V3 cannot hold")
    ap.add_argument("--ranks", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--families", nargs="+", default=["qwen2", "qwen3"], choices=sorted(FAMILIES))
    ap.add_argument("--keep", type=Path, default=None, help="keep the trained sources here (reused when present)")
    args = ap.parse_args()
    docs = pydoc_texts()
    third = len(docs) // 3
    held_out = windows(encode(docs[:third]), args.eval_windows)  # `surgery check`'s text: pydoc from its start
    training = windows(encode(docs[third: 2 * third]))  # calibration reads from the last document backwards
    results = {"training_windows": len(training), "eval_tokens": held_out.numel(), "kv_heads": args.kv_heads,
               "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            src = (args.keep or Path(tmp)) / family
            if (src / "train.json").exists():
                info = json.loads((src / "train.json").read_text())
            else:
                info = train(family, src, training, args.seconds, args.kv_heads)
                (src / "train.json").write_text(json.dumps(info))
            rows = {}
            for rank in args.ranks:
                for absorb in (True, False):
                    out = Path(tmp) / f"{family}-{rank}-{absorb}"
                    options = MLAOptions(kv_rank=rank, calib=["pydoc"], calib_tokens=args.calib_tokens)
                    record = convert_to_mla(resolve_source(str(src)), out, options, progress=False, absorb=absorb)
                    row = evaluate(src, out, held_out)
                    row["absorption"] = record["mla"]["absorption"]["relative_residual"]
                    rows[f"rank {rank}, {'absorbed' if absorb else 'dropped'}"] = row
                    print(family, rank, "absorbed" if absorb else "dropped",
                          json.dumps({k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in row.items()}),
                          flush=True)
            results["models"][family] = info | {"conversions": rows}
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
