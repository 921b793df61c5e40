"""What SwitchHead keeps of its own about each family (the modeling class names of `auto_map`), and one layer's
projections read as plain (out, in) matrices. Where the attention lives, its layout, Conv1D and prefixes, and whether
SwitchHead can convert it, is the family's `ArchSpec`."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..arch import ArchSpec, QKVLayout, spec_for
from ..errors import SurgeryError
from ..fused_qkv import split_qkv
from ..checkpoint.tensors import CheckpointReader
from .refusals import KIND, REFUSES

CLASS_PREFIX = "SwitchHead"


@dataclass(frozen=True)
class Family:
    spec: ArchSpec
    model_type: str
    layout: QKVLayout  # of this checkpoint's q/k/v (fused layouts depend on the config)
    config_name: str  # transformers' configuration class, e.g. LlamaConfig
    base_model: str  # transformers' base model class, e.g. LlamaModel
    causal_lm: str  # transformers' causal LM class, e.g. LlamaForCausalLM

    @property
    def fused(self) -> bool:
        return self.layout != QKVLayout.SEPARATE

    def match(self, name: str) -> tuple[str, int, str, str] | None:
        """(attention module, layer, role q/k/v/o/qkv, param) for an attention projection tensor."""
        hit = self.spec.locate(name)
        if hit is None:
            return None
        module, layer, proj, param = hit
        roles = {self.spec.q: "q", self.spec.k: "k", self.spec.v: "v", self.spec.o: "o"}
        return module, layer, ("qkv" if self.fused and proj == self.spec.qkv else roles[proj]), param

    def out_name(self, name: str) -> str:
        return self.spec.out_name(name)

    @property
    def config_class(self) -> str:
        return CLASS_PREFIX + self.config_name

    def auto_map(self) -> dict[str, str]:
        return {
            "AutoConfig": f"configuration_switchhead.{self.config_class}",
            "AutoModel": f"modeling_switchhead.{CLASS_PREFIX}{self.base_model}",
            "AutoModelForCausalLM": f"modeling_switchhead.{CLASS_PREFIX}{self.causal_lm}",
        }

    @property
    def architecture(self) -> str:
        return CLASS_PREFIX + self.causal_lm


def family_for(config: dict) -> Family:
    model_type = config.get("model_type")
    if str(model_type).startswith("switchhead_"):
        raise SurgeryError(f"the source is already a SwitchHead checkpoint ({model_type})")
    spec = spec_for(config, KIND, REFUSES)
    from transformers.models.auto import configuration_auto, modeling_auto

    names = (configuration_auto.CONFIG_MAPPING_NAMES.get(model_type), modeling_auto.MODEL_MAPPING_NAMES.get(model_type),
             modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type))
    if not all(isinstance(n, str) for n in names):
        raise SurgeryError(f"transformers has no causal LM classes for {model_type!r}, which SwitchHead builds on")
    return Family(spec, model_type, spec.qkv_layout(config), *names)


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
    """layer -> {"module": module name, "<role>.<param>": tensor name} for every attention projection tensor."""
    layers: dict[int, dict[str, str]] = {}
    for name in reader.names():
        hit = family.match(name)
        if hit:
            module, layer, role, param = hit
            entry = layers.setdefault(layer, {"module": module})
            entry[f"{role}.{param}"] = name
    return layers


def read_attention(reader: CheckpointReader, family: Family, names: dict[str, str], heads: int, kv_heads: int,
                   head_dim: int) -> SourceAttention:
    conv1d = family.spec.conv1d  # Conv1D stores (in, out)

    def load(key: str) -> torch.Tensor | None:
        if key not in names:
            return None
        t = reader.load(names[key]).float()
        return t.t() if conv1d and t.dim() == 2 else t

    if family.fused:
        qkv, qkv_bias = load("qkv.weight"), load("qkv.bias")
        q, k, v = split_qkv(qkv, family.layout, heads, kv_heads, head_dim)
        qb, kb, vb = split_qkv(qkv_bias, family.layout, heads, kv_heads, head_dim) if qkv_bias is not None \
            else (None, None, None)
        return SourceAttention(q, k, v, load("o.weight"), qb, kb, vb, load("o.bias"))
    return SourceAttention(load("q.weight"), load("k.weight"), load("v.weight"), load("o.weight"),
                           load("q.bias"), load("k.bias"), load("v.bias"), load("o.bias"))


def biases(family: Family, names: dict[str, str]) -> dict[str, bool]:
    """Which of q, k, v and o carry a bias in the source."""
    if family.fused:
        return {"q": "qkv.bias" in names, "k": "qkv.bias" in names, "v": "qkv.bias" in names, "o": "o.bias" in names}
    return {p: f"{p}.bias" in names for p in "qkvo"}


def check_attention_shapes(reader: CheckpointReader, family: Family, layers: dict[int, dict[str, str]],
                           n_layers: int, heads: int, kv_heads: int, head_dim: int, hidden: int) -> None:
    if set(layers) != set(range(n_layers)):
        missing = sorted(set(range(n_layers)) - set(layers))
        raise SurgeryError(
            f"checkpoint does not match config.json: attention tensors missing for layer(s) {missing[:8]}"
            if missing else f"checkpoint has attention tensors for layers beyond config.json's {n_layers}")
    width, kv_width = heads * head_dim, kv_heads * head_dim
    if family.fused:
        expected = {"qkv.weight": (width + 2 * kv_width, hidden), "o.weight": (hidden, width)}
    else:
        expected = {"q.weight": (width, hidden), "k.weight": (kv_width, hidden), "v.weight": (kv_width, hidden),
                    "o.weight": (hidden, width)}
    if family.spec.conv1d:
        expected = {key: shape[::-1] for key, shape in expected.items()}
    for layer, names in layers.items():
        for key, shape in expected.items():
            if key not in names:
                raise SurgeryError(f"checkpoint lacks the {key.split('.')[0]} projection in layer {layer} of "
                                   f"{family.model_type}")
            got = reader.tensors[names[key]].shape
            if tuple(got) != shape:
                raise SurgeryError(f"tensor {names[key]} of shape {list(got)} does not match config.json "
                                   f"({heads} heads, {kv_heads} K/V heads of {head_dim}, hidden {hidden})")


# --- the same projections in a loaded source model (calibration) ------------------------------------------------
def model_attention_modules(model: torch.nn.Module, family: Family, layers: int) -> list[torch.nn.Module]:
    """The loaded source model's self-attention modules, by layer, found where the spec says they live."""
    spec = family.spec
    pattern = re.compile(rf"(?:.*\.)?(?:{spec.layers_path})\.(\d+)\.{re.escape(spec.attention)}")
    found = {int(m.group(1)): module for name, module in model.named_modules() if (m := pattern.fullmatch(name))}
    if sorted(found) != list(range(layers)):
        raise SurgeryError(f"found self-attention modules for layers {sorted(found)[:8]}..., expected {layers}")
    return [found[i] for i in range(layers)]


def module_value_output(attn: torch.nn.Module, family: Family, config: dict
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.nn.Module]:
    """(V (kv*d, D), V bias, O (D, h*d), output module) of a loaded attention module, as (out, in) matrices."""
    spec = family.spec
    weight = lambda m: m.weight.T if spec.conv1d else m.weight  # noqa: E731
    out = attn.get_submodule(spec.o)
    if not family.fused:
        v = attn.get_submodule(spec.v)
        return weight(v), v.bias, weight(out), out
    qkv = attn.get_submodule(spec.qkv)
    shape = (spec.heads(config), spec.kv_heads(config), spec.head_dim(config))
    v_bias = split_qkv(qkv.bias, family.layout, *shape)[2] if qkv.bias is not None else None
    return split_qkv(weight(qkv), family.layout, *shape)[2], v_bias, weight(out), out
