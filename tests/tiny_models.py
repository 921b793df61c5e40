"""Tiny random checkpoints of every architecture the MQA/GQA converter supports, for fast unit tests."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as tf

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=128)

# name -> (config factory, number of query heads, number of K/V heads)
ARCHS = {
    "llama": lambda: tf.LlamaConfig(**COMMON, num_attention_heads=8, num_key_value_heads=4, head_dim=8),
    "mistral": lambda: tf.MistralConfig(**COMMON, num_attention_heads=4, num_key_value_heads=4),
    "qwen2": lambda: tf.Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2),
    "qwen3": lambda: tf.Qwen3Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "gemma": lambda: tf.GemmaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "gemma2": lambda: tf.Gemma2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "phi3": lambda: tf.Phi3Config(**COMMON, num_attention_heads=4, num_key_value_heads=4, pad_token_id=0),
    "gpt_neox": lambda: tf.GPTNeoXConfig(**COMMON, num_attention_heads=4, rotary_pct=0.5),
    "gpt2": lambda: tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128),
    "gpt_bigcode": lambda: tf.GPTBigCodeConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                               multi_query=False),
    "gpt_bigcode_mq": lambda: tf.GPTBigCodeConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                                  multi_query=True),
}


def kv_heads_of(config) -> int:
    if config.model_type == "gpt_bigcode":
        return 1 if config.multi_query else config.n_head
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def make_tiny(arch: str, folder: Path, seed: int = 0, **save_kwargs):
    """A randomly initialised model of `arch`, with non-trivial biases, saved to `folder`."""
    torch.manual_seed(seed)
    config = ARCHS[arch]()
    if arch == "qwen2":
        config.attention_bias = True
    config._attn_implementation = "eager"
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # default inits leave biases at zero: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(folder, **save_kwargs)
    return model


def load(folder: Path):
    return tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def sample_ids(seed: int = 1, batch: int = 2, length: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits
