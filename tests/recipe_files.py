"""Files the recipe tests run on: a recipe written from a dict, and a tiny Llama with SmolLM2's tokenizer whose GQA
conversion is exact."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import transformers as tf
import yaml

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def pair_kv_heads(model) -> None:
    """Make a tiny Llama's 4 K/V heads of 8 identical in pairs (1 = 0, 3 = 2): merging them to 2 is then exact."""
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                w = proj.weight.view(4, 8, -1)
                w[1], w[3] = w[0], w[2]


def paired_llama(folder: Path, seed: int = 0) -> None:
    """A tiny llama with SmolLM2's real tokenizer whose 4 K/V heads come in identical pairs (0=1, 2=3), so that
    mean-pooling them into 2 K/V heads is exact: a GQA conversion `surgery check --expect exact` passes."""
    from surgery.checkpoint.source import resolve_source

    smollm2 = resolve_source("smollm2").folder
    torch.manual_seed(seed)
    config = tf.LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=4, head_dim=8, max_position_embeddings=256,
                            bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    model = tf.AutoModelForCausalLM.from_config(config)
    pair_kv_heads(model)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (smollm2 / name).exists():
            shutil.copy(smollm2 / name, Path(folder) / name)


def write_recipe(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
