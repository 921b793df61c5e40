"""Which source architectures the talking-heads converter supports, and where their self-attention lives.

Each family names the modeling classes (in `modeling_talking_heads.py`) that a converted checkpoint maps to in
`auto_map`, and a regex over checkpoint tensor names whose match on the query projection's weight gives the
self-attention module's name prefix (where the new `talking_heads.*` tensors go) and the layer index.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import SurgeryError


@dataclass(frozen=True)
class Family:
    model_type: str
    prefix: str  # class name stem: TalkingHeads{prefix}Config, TalkingHeads{prefix}Model, ...
    query_pattern: str  # regex on the query weight's name; groups "module" (attention module) and "layer"
    heads: dict[str, str]  # auto class -> head class suffix, e.g. AutoModelForCausalLM -> ForCausalLM
    rotary: bool = False

    @property
    def config_class(self) -> str:
        return f"TalkingHeads{self.prefix}Config"

    def model_class(self, suffix: str) -> str:
        return f"TalkingHeads{self.prefix}{suffix}"

    def auto_map(self) -> dict[str, str]:
        auto = {"AutoConfig": f"configuration_talking_heads.{self.config_class}"}
        auto.update({name: f"modeling_talking_heads.{self.model_class(suffix)}" for name, suffix in self.heads.items()})
        return auto

    def architecture(self, source_architecture: str) -> str | None:
        """Our class for one of the source's `architectures`, or None when that head is not provided."""
        for suffix in self.heads.values():
            if source_architecture.endswith(suffix) and source_architecture[: -len(suffix)].lower().replace("_", "") == self.prefix.lower():
                return self.model_class(suffix)
        return None

    def match(self, name: str) -> tuple[str, int] | None:
        m = re.fullmatch(self.query_pattern, name)
        return (m.group("module"), int(m.group("layer"))) if m else None


_DECODER_HEADS = {"AutoModel": "Model", "AutoModelForCausalLM": "ForCausalLM"}
_LLAMA_QUERY = r"(?P<module>(?:.*\.)?layers\.(?P<layer>\d+)\.self_attn)\.q_proj\.weight"

FAMILIES: tuple[Family, ...] = (
    Family("llama", "Llama", _LLAMA_QUERY, _DECODER_HEADS, rotary=True),
    Family("mistral", "Mistral", _LLAMA_QUERY, _DECODER_HEADS, rotary=True),
    Family("qwen2", "Qwen2", _LLAMA_QUERY, _DECODER_HEADS, rotary=True),
    Family("qwen3", "Qwen3", _LLAMA_QUERY, _DECODER_HEADS, rotary=True),
    Family("gemma", "Gemma", _LLAMA_QUERY, _DECODER_HEADS, rotary=True),
    Family("gemma2", "Gemma2", _LLAMA_QUERY, _DECODER_HEADS, rotary=True),
    Family("gpt2", "GPT2", r"(?P<module>(?:.*\.)?h\.(?P<layer>\d+)\.attn)\.c_attn\.weight",
           {"AutoModel": "Model", "AutoModelForCausalLM": "LMHeadModel"}),
    Family("bert", "Bert", r"(?P<module>(?:.*\.)?layer\.(?P<layer>\d+)\.attention\.self)\.query\.weight",
           {"AutoModel": "Model", "AutoModelForMaskedLM": "ForMaskedLM",
            "AutoModelForSequenceClassification": "ForSequenceClassification"}),
)


def supported_model_types() -> list[str]:
    return [f.model_type for f in FAMILIES]


def family_for(config: dict) -> Family:
    model_type = config.get("model_type")
    for family in FAMILIES:
        if family.model_type == model_type:
            return family
    if str(model_type).startswith("talking_heads_"):
        raise SurgeryError(f"the source is already a talking-heads checkpoint ({model_type})")
    raise SurgeryError(
        f"unsupported architecture {model_type!r} for talking-heads; supported: {', '.join(supported_model_types())}"
    )
