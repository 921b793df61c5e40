"""--to mla on the approximate families (Qwen2's q/k/v biases, Qwen3's per-head q/k norms): the converted error vs
the no-absorption baseline (the biases / norms dropped, no refits), on models whose biases and norms carry real
statistics.

Each family: a small model of its shape (hidden 128, 4 layers, 4 heads, 2 K/V heads, head_dim 32, character
tokenizer) trained from scratch with AdamW on pydoc's documents 8.. (the standard library's `pydoc_data.topics`)
for `--minutes`, then converted at `--ranks` with calibration on `pydoc` (read from its last document backwards),
with and without absorption. Measured on pydoc's first 8 documents (never trained on, never read by calibration):
KL(source || converted) per token and the perplexity ratio converted / source.

    OMP_NUM_THREADS=2 python benchmarks/bench_mla_families.py --work /tmp/bench_mla --minutes 4
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import transformers as tf

from surgery.checkpoint.source import resolve_source
from surgery.data import pydoc_texts
from surgery.mla import convert_to_mla
from surgery.testing.tiny_models import char_tokenizer

SHAPE = dict(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=512, pad_token_id=0, bos_token_id=0,
             eos_token_id=0, tie_word_embeddings=True)
FAMILIES = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
HELD_OUT = 8  # pydoc's first documents: evaluation only
LENGTH = 256


def ids_of(tok, texts: list[str], length: int) -> torch.Tensor:
    ids = tok("\n\n".join(texts))["input_ids"]
    n = len(ids) // length
    return torch.tensor(ids[: n * length]).view(n, length)


def train(family: str, folder: Path, minutes: float, seed: int) -> dict:
    torch.manual_seed(seed)
    config = getattr(tf, FAMILIES[family])(**SHAPE)
    model = tf.AutoModelForCausalLM.from_config(config)
    char_tokenizer(folder)
    tok = tf.AutoTokenizer.from_pretrained(folder)
    data = ids_of(tok, pydoc_texts()[HELD_OUT:], LENGTH)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    start, step, loss = time.time(), 0, float("nan")
    model.train()
    while time.time() - start < minutes * 60:
        batch = data[torch.randint(0, len(data), (16,))]
        out = model(input_ids=batch, labels=batch)
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step, loss = step + 1, float(out.loss.detach())
    model.eval().save_pretrained(folder)
    return {"steps": step, "batch": f"16 x {LENGTH} tokens", "final_train_loss": round(loss, 4),
            "seconds": round(time.time() - start, 1)}


@torch.no_grad()
def log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    return torch.cat([model(input_ids=b[None]).logits.float().log_softmax(-1) for b in ids])


def measure(src: Path, out: Path, ids: torch.Tensor, reference: torch.Tensor) -> dict:
    model = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    lp = log_probs(model, ids)
    kl = float((reference.exp() * (reference - lp)).sum(-1).mean())
    nll = lambda p: float(-p[:, :-1].gather(-1, ids[:, 1:, None]).mean())  # noqa: E731
    return {"kl": round(kl, 5), "ppl_ratio": round(math.exp(nll(lp) - nll(reference)), 4)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--minutes", type=float, default=4.0)
    p.add_argument("--ranks", default="128,32")
    p.add_argument("--calib-tokens", type=int, default=8192)
    p.add_argument("--families", default="qwen2,qwen3")
    args = p.parse_args()
    results = {}
    for family in args.families.split(","):
        src = args.work / family / "source"
        training = train(family, src, args.minutes, seed=0)
        source = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        ids = ids_of(tf.AutoTokenizer.from_pretrained(src), pydoc_texts()[:HELD_OUT], LENGTH)[:16]
        reference = log_probs(source, ids)
        nll = float(-reference[:, :-1].gather(-1, ids[:, 1:, None]).mean())
        row = {"training": training, "source_ppl": round(math.exp(nll), 4), "eval_tokens": ids.numel()}
        for rank in map(int, args.ranks.split(",")):
            for absorb in (False, True):
                name = f"r{rank}-{'absorbed' if absorb else 'baseline'}"
                out = args.work / family / name
                record = convert_to_mla(resolve_source(str(src)), out, kv_rank=rank, calib_tokens=args.calib_tokens,
                                        progress=False, force=True, absorb=absorb)
                row[name] = measure(src, out, ids, reference) | {
                    "calib_attention_error": record["mla"]["approximated"]["attention_error"]["mean"],
                    "latent_loss": record["mla"]["latent_loss"], "rope_loss": record["mla"]["rope_loss"]}
                print(family, name, row[name], flush=True)
        results[family] = row
    print(json.dumps(results, indent=1))
    (args.work / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
