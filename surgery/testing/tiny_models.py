"""Tiny random checkpoints of every architecture the MQA/GQA converter supports, and the tokenizers that go with
them (a character tokenizer over their 96 ids, a BPE one trained on pydoc), for fast tests and benchmarks."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as tf

import surgery.kinds  # noqa: F401 (refused() asks by `convert --list` label: the registered kinds answer)


VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=128)

SLIDING = {"sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]}
GQA = {"num_attention_heads": 4, "num_key_value_heads": 2}
TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # inside the tiny vocabulary
MOE = {"num_experts": 2, "num_experts_per_tok": 1}


def _cfg(name: str, **kw):
    return lambda: getattr(tf, name)(**(COMMON | TOKENS | kw))


# name -> config factory: one tiny random model per supported model_type (2 layers, hidden 64, K/V heads < heads
# wherever the family allows it, and each family's own attention features switched on)
ARCHS = {
    "llama": _cfg("LlamaConfig", num_attention_heads=8, num_key_value_heads=4, head_dim=8),
    "mistral": _cfg("MistralConfig", num_attention_heads=4, num_key_value_heads=4),
    "ministral": _cfg("MinistralConfig", **GQA, **SLIDING, head_dim=16),
    "mixtral": _cfg("MixtralConfig", **GQA, num_local_experts=2, num_experts_per_tok=1),
    "qwen2": _cfg("Qwen2Config", num_attention_heads=4, num_key_value_heads=2),
    "qwen2_moe": _cfg("Qwen2MoeConfig", **GQA, **MOE, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                      qkv_bias=True),
    "qwen3": _cfg("Qwen3Config", num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "qwen3_moe": _cfg("Qwen3MoeConfig", **GQA, **MOE, head_dim=16, moe_intermediate_size=32),
    "gemma": _cfg("GemmaConfig", num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "gemma2": _cfg("Gemma2Config", num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "gemma3_text": _cfg("Gemma3TextConfig", **GQA, **SLIDING, head_dim=16, query_pre_attn_scalar=16),
    "olmo": _cfg("OlmoConfig", **GQA),
    "olmo2": _cfg("Olmo2Config", **GQA),
    "olmoe": _cfg("OlmoeConfig", **GQA, **MOE),
    "smollm3": _cfg("SmolLM3Config", **GQA, no_rope_layers=[1, 0]),
    "phi": _cfg("PhiConfig", **GQA, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                     "partial_rotary_factor": 0.5}),
    "stablelm": _cfg("StableLmConfig", **GQA, use_qkv_bias=True),
    "starcoder2": _cfg("Starcoder2Config", **GQA, use_bias=True),
    "granite": _cfg("GraniteConfig", **GQA, attention_multiplier=0.2, embedding_multiplier=2.0,
                    residual_multiplier=0.5, logits_scaling=2.0),
    "cohere": _cfg("CohereConfig", **GQA, logit_scale=0.5),
    "cohere_qk": _cfg("CohereConfig", **GQA, use_qk_norm=True),  # K norm with a weight per head: pooled too
    "cohere2": _cfg("Cohere2Config", **GQA, **SLIDING),
    "helium": _cfg("HeliumConfig", **GQA, head_dim=16),
    "glm": _cfg("GlmConfig", **GQA, head_dim=16, attention_bias=True),  # partial (half), interleaved rotary
    "exaone4": _cfg("Exaone4Config", **GQA, **SLIDING),
    "arcee": _cfg("ArceeConfig", **GQA),
    "apertus": _cfg("ApertusConfig", **GQA),
    "phi3": _cfg("Phi3Config", num_attention_heads=4, num_key_value_heads=4),
    "gpt_neox": lambda: tf.GPTNeoXConfig(**COMMON, num_attention_heads=4, rotary_pct=0.5),
    "gpt2": lambda: tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128),
    "gpt_bigcode": lambda: tf.GPTBigCodeConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                               multi_query=False),
    "gpt_bigcode_mq": lambda: tf.GPTBigCodeConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                                  multi_query=True),
    "falcon": lambda: tf.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_kv_heads=2, new_decoder_architecture=True, bias=True,
                                      max_position_embeddings=128),
}


def refused(arch: str, kind: str) -> str | None:
    """Why `kind` refuses this tiny model (its family and config), or None."""
    from surgery.arch import find_spec
    from surgery.kinds import refusals_of

    config = ARCHS[arch]().to_dict()
    return find_spec(config["model_type"]).refusal(kind, config, refusals_of(kind))


def kv_heads_of(config) -> int:
    if config.model_type == "gpt_bigcode":
        return 1 if config.multi_query else config.n_head
    if config.model_type == "falcon":
        return config.num_kv_heads if config.new_decoder_architecture else 1 if config.multi_query else \
            config.num_attention_heads
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def make_tiny(arch: str, folder: Path, seed: int = 0, config_overrides: dict | None = None, **save_kwargs):
    """A randomly initialised model of `arch` (its config with `config_overrides` set: another tokenizer's
    vocab_size and token ids), with non-trivial biases, saved to `folder`."""
    torch.manual_seed(seed)
    config = ARCHS[arch]()
    for key, value in (config_overrides or {}).items():
        setattr(config, key, value)
    if arch == "qwen2":
        config.attention_bias = True

    config._attn_implementation = "eager"
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # default inits leave biases at zero: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif "norm" in name and name.endswith("weight"):  # norms start at one: make them count
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder, **save_kwargs)
    return model


def load(folder: Path):
    return tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def sample_ids(seed: int = 1, batch: int = 2, length: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits


def char_tokenizer(folder: Path) -> None:
    """A character-level tokenizer over printable ASCII (96 ids, the tiny models' vocabulary): id 0 is EOS/unknown."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0} | {chr(c): i + 1 for i, c in enumerate(range(32, 127))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<eos>"))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<eos>").save_pretrained(folder)


def tiny_tokenizer(vocab: int = VOCAB):
    """A character-level BPE tokenizer with the tiny models' vocabulary size, trained on pydoc text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from surgery.data import pydoc_texts

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<eos>"], limit_alphabet=vocab - 10,
                                  show_progress=False)
    tok.train_from_iterator(pydoc_texts()[:40], trainer)
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def tiny(arch: str, folder: Path, seed: int = 0) -> Path:
    """A tiny random `arch` model with the character tokenizer."""
    make_tiny(arch, folder, seed=seed)
    char_tokenizer(folder)
    return folder
