"""Which source architectures the SwitchHead converter supports, where their attention projections live, and how
to read one layer's projections as plain (out, in) matrices."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..errors import SurgeryError
from ..tensors import CheckpointReader


@dataclass(frozen=True)
class Family:
    model_type: str
    prefix: str  # class name stem: SwitchHead{prefix}Config, SwitchHead{prefix}ForCausalLM, ...
    # Regex over checkpoint tensor names: groups "module" (the attention module), "layer", "proj", "param".
    attention_pattern: str
    causal_lm: str  # suffix of the causal LM head class: ForCausalLM, LMHeadModel
    fused: bool = False  # GPT-2: one Conv1D c_attn (in, 3*out) and a Conv1D c_proj (in, out)
    drop_pattern: str | None = None  # buffers some old checkpoints store
    name_prefix: str = ""  # prefix the in-memory model gives every tensor (old GPT-2 checkpoints lack it)

    def match(self, name: str) -> tuple[str, int, str, str] | None:
        m = re.fullmatch(self.attention_pattern, name)
        return (m.group("module"), int(m.group("layer")), m.group("proj"), m.group("param")) if m else None

    def out_name(self, name: str) -> str:
        if self.name_prefix and not name.startswith((self.name_prefix, "lm_head.")):
            return self.name_prefix + name
        return name

    @property
    def config_class(self) -> str:
        return f"SwitchHead{self.prefix}Config"

    def model_class(self, suffix: str) -> str:
        return f"SwitchHead{self.prefix}{suffix}"

    def auto_map(self) -> dict[str, str]:
        return {
            "AutoConfig": f"configuration_switchhead.{self.config_class}",
            "AutoModel": f"modeling_switchhead.{self.model_class('Model')}",
            "AutoModelForCausalLM": f"modeling_switchhead.{self.model_class(self.causal_lm)}",
        }


_LLAMA = r"(?P<module>(?:.*\.)?layers\.(?P<layer>\d+)\.self_attn)\.(?P<proj>[qkvo]_proj)\.(?P<param>weight|bias)"
_GPT2 = r"(?P<module>(?:.*\.)?h\.(?P<layer>\d+)\.attn)\.(?P<proj>c_attn|c_proj)\.(?P<param>weight|bias)"

FAMILIES: tuple[Family, ...] = (
    Family("llama", "Llama", _LLAMA, "ForCausalLM"),
    Family("mistral", "Mistral", _LLAMA, "ForCausalLM"),
    Family("qwen2", "Qwen2", _LLAMA, "ForCausalLM"),
    Family("qwen3", "Qwen3", _LLAMA, "ForCausalLM"),
    Family("gemma", "Gemma", _LLAMA, "ForCausalLM"),
    Family("gemma2", "Gemma2", _LLAMA, "ForCausalLM"),
    Family("gpt2", "GPT2", _GPT2, "LMHeadModel", fused=True, drop_pattern=r"(?:^|\.)h\.\d+\.attn\.(?:bias|masked_bias)$",
           name_prefix="transformer."),
)


def family_for(config: dict) -> Family:
    model_type = config.get("model_type")
    for family in FAMILIES:
        if family.model_type == model_type:
            return family
    if str(model_type).startswith("switchhead_"):
        raise SurgeryError(f"the source is already a SwitchHead checkpoint ({model_type})")
    raise SurgeryError(f"unsupported architecture {model_type!r} for SwitchHead; supported: "
                       f"{', '.join(f.model_type for f in FAMILIES)}")


@dataclass
class SourceAttention:
    """One layer's projections as (out, in) float32 matrices: q (h*d, D), k and v (kv*d, D), o (D, h*d)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None


def attention_tensors(reader: CheckpointReader, family: Family) -> dict[int, dict[str, str]]:
    """layer -> {"module": module name, "<proj>.<param>": tensor name} for every attention projection tensor."""
    layers: dict[int, dict[str, str]] = {}
    for name in reader.names():
        hit = family.match(name)
        if hit:
            module, layer, proj, param = hit
            entry = layers.setdefault(layer, {"module": module})
            entry[f"{proj}.{param}"] = name
    return layers


def read_attention(reader: CheckpointReader, family: Family, names: dict[str, str], heads: int, kv_heads: int,
                   head_dim: int) -> SourceAttention:
    load = lambda key: reader.load(names[key]).float() if key in names else None  # noqa: E731
    width, kv_width = heads * head_dim, kv_heads * head_dim
    if family.fused:  # Conv1D stores (in, out)
        qkv, qkv_bias = load("c_attn.weight").t(), load("c_attn.bias")
        q, k, v = qkv.split([width, kv_width, kv_width])
        qb, kb, vb = qkv_bias.split([width, kv_width, kv_width]) if qkv_bias is not None else (None, None, None)
        return SourceAttention(q, k, v, load("c_proj.weight").t(), qb, kb, vb, load("c_proj.bias"))
    return SourceAttention(load("q_proj.weight"), load("k_proj.weight"), load("v_proj.weight"), load("o_proj.weight"),
                           load("q_proj.bias"), load("k_proj.bias"), load("v_proj.bias"), load("o_proj.bias"))


def check_attention_shapes(reader: CheckpointReader, family: Family, layers: dict[int, dict[str, str]],
                           n_layers: int, heads: int, kv_heads: int, head_dim: int, hidden: int) -> None:
    if set(layers) != set(range(n_layers)):
        missing = sorted(set(range(n_layers)) - set(layers))
        raise SurgeryError(
            f"checkpoint does not match config.json: attention tensors missing for layer(s) {missing[:8]}"
            if missing else f"checkpoint has attention tensors for layers beyond config.json's {n_layers}")
    width, kv_width = heads * head_dim, kv_heads * head_dim
    if family.fused:
        expected = {"c_attn.weight": (hidden, width + 2 * kv_width), "c_proj.weight": (width, hidden)}
    else:
        expected = {"q_proj.weight": (width, hidden), "k_proj.weight": (kv_width, hidden),
                    "v_proj.weight": (kv_width, hidden), "o_proj.weight": (hidden, width)}
    for layer, names in layers.items():
        for key, shape in expected.items():
            if key not in names:
                raise SurgeryError(f"checkpoint lacks {key} in layer {layer} of {family.model_type}")
            got = reader.tensors[names[key]].shape
            if tuple(got) != shape:
                raise SurgeryError(f"tensor {names[key]} of shape {list(got)} does not match config.json "
                                   f"({heads} heads, {kv_heads} K/V heads of {head_dim}, hidden {hidden})")
