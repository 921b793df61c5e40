"""The tiny random Llama that uptraining is tested and benchmarked on (2 layers, hidden 64, 4 query heads, 2 K/V
heads), with a byte-level BPE tokenizer of 320 ids trained on pydoc text, and the short run's options."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers as tf

# A short run: 64-token windows, 8 windows (512 tokens) per optimizer step.
FAST = dict(data="pydoc", seq_len=64, batch_tokens=512, micro_batch=4, eval_tokens=1024, eval_every=0, save_every=0,
            lr=3e-3, progress=False)


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from surgery.data import pydoc_texts

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(pydoc_texts(), trainer)
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def make_model(folder: Path, tokenizer, seed: int = 0, hidden: int = 64, intermediate: int = 128, layers: int = 2,
               positions: int = 256, bos_token_id: int | None = None) -> Path:
    """A random Llama with 4 heads and 2 K/V heads for `tokenizer` (bos: its eos unless given), saved with it."""
    torch.manual_seed(seed)
    config = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=positions, eos_token_id=tokenizer.eos_token_id,
                            bos_token_id=tokenizer.eos_token_id if bos_token_id is None else bos_token_id)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def metrics(folder: Path) -> list[dict]:
    """An uptraining output's uptrain_metrics.jsonl, one dict per line."""
    return [json.loads(line) for line in (folder / "uptrain_metrics.jsonl").read_text().splitlines()]


def weights(folder: Path) -> dict[str, torch.Tensor]:
    """An output's tensors (one model.safetensors: the tiny model is never sharded)."""
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def make_family_model(folder: Path, tokenizer, arch: str, seed: int = 0) -> Path:
    """A tiny random model of family `arch` (surgery/testing/tiny_models.py's, biases and norms that count) for
    `tokenizer` (its vocabulary and eos, 256 positions), saved with it: a family's model whose tokenizer `surgery
    export` can write."""
    from surgery.testing.tiny_models import make_tiny

    eos = tokenizer.eos_token_id
    make_tiny(arch, folder, seed=seed, config_overrides={"vocab_size": len(tokenizer), "eos_token_id": eos,
                                                         "bos_token_id": eos, "pad_token_id": None,
                                                         "max_position_embeddings": 256})
    tokenizer.save_pretrained(folder)
    return folder
