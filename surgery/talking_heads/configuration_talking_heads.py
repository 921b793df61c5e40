"""Configurations of talking-heads checkpoints (Shazeer et al. 2020, arXiv 2003.02436).

This file travels with converted checkpoints (next to `modeling_talking_heads.py`) and needs only `transformers`.
Each class is the source architecture's own configuration under a new `model_type`, so that plain transformers
refuses to load a talking-heads checkpoint as the source architecture (which would silently drop the mixing).

The talking-heads settings live in `config.talking_heads` (a dict):

- `heads` (h), `head_dim` (d): the source's query heads and head size; the attention width is W = h * d.
- `logits_mixing`, `weights_mixing`: whether P_l (before the softmax) and P_w (after it) exist.
- `heads_logits` (h_k): heads of the query-key logits that P_l mixes, each of size W / h_k.
- `heads_weights` (h_v): heads of the mixed weights that multiply the values, each of size W / h_v.
- `pair_rotary_dims`: order each head's dims as rotation pairs (i, i + d/2) before splitting it into
  query-key sub-heads, so that a sub-head of a RoPE model keeps whole pairs (only matters when h_k != h).
- `chunk_size`: queries per block of the attention computation (0: all at once).
"""

from __future__ import annotations

from transformers import BertConfig, Gemma2Config, GemmaConfig, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

TALKING_HEADS_DEFAULTS = {
    "logits_mixing": True,
    "weights_mixing": True,
    "heads_logits": None,  # None: h
    "heads_weights": None,  # None: h
    "pair_rotary_dims": False,
    "chunk_size": 512,
}


class TalkingHeadsLlamaConfig(LlamaConfig):
    model_type = "talking_heads_llama"


class TalkingHeadsMistralConfig(MistralConfig):
    model_type = "talking_heads_mistral"


class TalkingHeadsQwen2Config(Qwen2Config):
    model_type = "talking_heads_qwen2"


class TalkingHeadsQwen3Config(Qwen3Config):
    model_type = "talking_heads_qwen3"


class TalkingHeadsGemmaConfig(GemmaConfig):
    model_type = "talking_heads_gemma"


class TalkingHeadsGemma2Config(Gemma2Config):
    model_type = "talking_heads_gemma2"


class TalkingHeadsGPT2Config(GPT2Config):
    model_type = "talking_heads_gpt2"


class TalkingHeadsBertConfig(BertConfig):
    model_type = "talking_heads_bert"
