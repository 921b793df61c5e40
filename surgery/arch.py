"""Architecture specs as data: where each model type keeps its attention projections, and how heads are laid out.

A spec answers, from `config.json` and tensor names alone (no model is built):
- which tensors are attention projections (q/k/v/o, fused or separate) and which layer they belong to;
- how query, key and value heads are laid out inside them;
- how many heads, K/V heads and head_dim the checkpoint has, and which config keys say so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum

from .errors import SurgeryError


class QKVLayout(str, Enum):
    SEPARATE = "separate"  # q_proj, k_proj, v_proj: rows are [heads, head_dim]
    FUSED = "fused"  # one tensor, rows [q heads | k heads | v heads]
    INTERLEAVED = "interleaved"  # one tensor, rows [head, (q, k, v), head_dim] (GPT-NeoX, GPTBigCode MHA)


@dataclass(frozen=True)
class ArchSpec:
    """How one family of `model_type`s stores its attention."""

    name: str
    model_types: tuple[str, ...]
    layout: QKVLayout
    # Regex over checkpoint tensor names; group "layer" is the layer index, group "proj" the projection name.
    attention_pattern: str
    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    o: str = "o_proj"
    qkv: str = "qkv_proj"  # the fused tensor's projection name (FUSED / INTERLEAVED)
    heads_key: str = "num_attention_heads"
    kv_heads_key: str | None = "num_key_value_heads"  # None: the architecture has no such config key
    hidden_key: str = "hidden_size"
    layers_key: str = "num_hidden_layers"
    head_dim_key: str | None = "head_dim"
    # Conv1D weights stored (in, out) that a Linear-based target stores (out, in).
    conv1d_pattern: str | None = None
    # Tensors that are buffers, not weights, in some old checkpoints.
    drop_pattern: str | None = None
    notes: str = ""
    extra: dict = field(default_factory=dict)

    def match(self, name: str) -> tuple[int, str, str] | None:
        """(layer, projection, 'weight'|'bias') for an attention projection tensor, else None."""
        m = re.search(self.attention_pattern, name)
        if not m:
            return None
        return int(m.group("layer")), m.group("proj"), m.group("param")

    # --- reading head counts from config.json -------------------------------------------------
    def heads(self, config: dict) -> int:
        return int(config[self.heads_key])

    def kv_heads(self, config: dict) -> int:
        if self.name == "gpt_bigcode":
            return 1 if config.get("multi_query", True) else self.heads(config)
        if self.kv_heads_key and config.get(self.kv_heads_key) is not None:
            return int(config[self.kv_heads_key])
        return self.heads(config)

    def head_dim(self, config: dict) -> int:
        if self.head_dim_key and config.get(self.head_dim_key):
            return int(config[self.head_dim_key])
        return int(config[self.hidden_key]) // self.heads(config)

    def layers(self, config: dict) -> int:
        return int(config[self.layers_key])


_LLAMA_ATTN = r"layers\.(?P<layer>\d+)\.self_attn\.(?P<proj>[qkvo]_proj)\.(?P<param>weight|bias)$"

SPECS: tuple[ArchSpec, ...] = (
    ArchSpec(
        name="llama",
        model_types=("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2"),
        layout=QKVLayout.SEPARATE,
        attention_pattern=_LLAMA_ATTN,
        notes="q/k/v/o_proj per layer; Qwen2 has q/k/v biases; Qwen3 and Gemma2 q/k norms act per head_dim and "
        "are shared by all heads, so they carry over unchanged.",
    ),
    ArchSpec(
        name="phi3",
        model_types=("phi3",),
        layout=QKVLayout.FUSED,
        attention_pattern=r"layers\.(?P<layer>\d+)\.self_attn\.(?P<proj>qkv_proj|o_proj)\.(?P<param>weight|bias)$",
        notes="qkv_proj rows are [q heads | k heads | v heads].",
    ),
    ArchSpec(
        name="gpt_neox",
        model_types=("gpt_neox",),
        layout=QKVLayout.INTERLEAVED,
        attention_pattern=r"layers\.(?P<layer>\d+)\.attention\.(?P<proj>query_key_value|dense)\.(?P<param>weight|bias)$",
        qkv="query_key_value",
        o="dense",
        kv_heads_key=None,
        head_dim_key=None,
        drop_pattern=r"(?:^|\.)attention\.(bias|masked_bias|rotary_emb\.inv_freq)$",
        notes="transformers' GPTNeoX has no num_key_value_heads: the pooled K/V heads are stored repeated once per "
        "query head, so the output computes grouped-query attention but its KV cache is not smaller.",
    ),
    ArchSpec(
        name="gpt2",
        model_types=("gpt2",),
        layout=QKVLayout.FUSED,
        attention_pattern=r"(?:^|\.)h\.(?P<layer>\d+)\.attn\.(?P<proj>c_attn|c_proj)\.(?P<param>weight|bias)$",
        qkv="c_attn",
        o="c_proj",
        heads_key="n_head",
        kv_heads_key=None,
        hidden_key="n_embd",
        layers_key="n_layer",
        head_dim_key=None,
        conv1d_pattern=r"(?:^|\.)h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$",
        drop_pattern=r"(?:^|\.)attn\.(bias|masked_bias)$",
        notes="converted into GPTBigCode (multi_query=True for MQA), a standard architecture that stores one K/V "
        "head; GPTBigCode has only MQA and MHA, so G must be 1 or the number of heads.",
    ),
    ArchSpec(
        name="gpt_bigcode",
        model_types=("gpt_bigcode",),
        layout=QKVLayout.FUSED,  # multi_query=True; multi_query=False is INTERLEAVED (see qkv_layout)
        attention_pattern=r"(?:^|\.)h\.(?P<layer>\d+)\.attn\.(?P<proj>c_attn|c_proj)\.(?P<param>weight|bias)$",
        qkv="c_attn",
        o="c_proj",
        heads_key="n_head",
        kv_heads_key=None,
        hidden_key="n_embd",
        layers_key="n_layer",
        head_dim_key=None,
        notes="multi_query=True stores [q heads | k | v]; multi_query=False stores [head, (q, k, v), head_dim]. "
        "Only MQA and MHA exist, so G must be 1 or the number of heads.",
    ),
)

ENCODER_TYPES = ("bert", "roberta", "xlm-roberta", "distilbert", "electra")


def supported_model_types() -> list[str]:
    return sorted(t for s in SPECS for t in s.model_types)


def spec_for(config: dict) -> ArchSpec:
    model_type = config.get("model_type")
    for spec in SPECS:
        if model_type in spec.model_types:
            return spec
    hint = ""
    if model_type in ENCODER_TYPES:
        hint = " (encoders need modeling code that travels with the checkpoint: use --to talking-heads)"
    raise SurgeryError(
        f"unsupported architecture {model_type!r} for MQA/GQA{hint}; supported: {', '.join(supported_model_types())}"
    )


def qkv_layout(spec: ArchSpec, config: dict) -> QKVLayout:
    if spec.name == "gpt_bigcode" and not config.get("multi_query", True):
        return QKVLayout.INTERLEAVED
    return spec.layout
