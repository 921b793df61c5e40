"""Configurations of SwitchHead checkpoints (Csordás et al. 2023, arXiv 2312.07987).

This file travels with converted checkpoints (next to `modeling_switchhead.py`) and needs only `transformers`
(v5). Each class is the source architecture's own configuration under a new `model_type`, so that plain
transformers refuses to load a SwitchHead checkpoint as the source architecture.

The head counts of the configuration describe the converted attention: `num_attention_heads` and
`num_key_value_heads` (Llama family) or `n_head` (GPT-2) are the SwitchHead heads H, and `head_dim` is each head's
width d (kept from the source). The SwitchHead settings live in `config.switchhead` (a dict):

- `heads` (H): attention heads; each has one query and one key projection, so the KV cache holds H heads.
- `experts` (E): value and output projections per head (the experts).
- `topk` (k): experts selected per token and head, on the value side and on the output side separately.
- `head_dim` (d): the width of a head.
- `source_heads`, `source_kv_heads`: the source's query and K/V heads (for the record; not used by the model).
"""

from __future__ import annotations

from transformers import Gemma2Config, GemmaConfig, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config


class SwitchHeadLlamaConfig(LlamaConfig):
    model_type = "switchhead_llama"


class SwitchHeadMistralConfig(MistralConfig):
    model_type = "switchhead_mistral"


class SwitchHeadQwen2Config(Qwen2Config):
    model_type = "switchhead_qwen2"


class SwitchHeadQwen3Config(Qwen3Config):
    model_type = "switchhead_qwen3"


class SwitchHeadGemmaConfig(GemmaConfig):
    model_type = "switchhead_gemma"


class SwitchHeadGemma2Config(Gemma2Config):
    model_type = "switchhead_gemma2"


class SwitchHeadGPT2Config(GPT2Config):
    model_type = "switchhead_gpt2"
