"""What talking-heads keeps of its own about each family: the modeling class names a converted checkpoint maps to
in `auto_map`. Where the attention lives (and whether talking-heads can convert it) is the family's `ArchSpec`."""

from __future__ import annotations

from dataclasses import dataclass

from ..arch import ArchSpec, spec_for
from ..errors import SurgeryError
from .refusals import KIND, REFUSES

CLASS_PREFIX = "TalkingHeads"
DECODER_HEADS = ("AutoModel", "AutoModelForCausalLM")
ENCODER_HEADS = ("AutoModel", "AutoModelForMaskedLM", "AutoModelForSequenceClassification")


def _transformers_classes(model_type: str, auto_classes: tuple[str, ...]) -> tuple[str, dict[str, str]]:
    """transformers' configuration class name and {auto class: model class name} for `model_type`."""
    from transformers.models.auto import configuration_auto, modeling_auto

    mappings = {"AutoModel": modeling_auto.MODEL_MAPPING_NAMES,
                "AutoModelForCausalLM": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                "AutoModelForMaskedLM": modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
                "AutoModelForSequenceClassification": modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES}
    config = configuration_auto.CONFIG_MAPPING_NAMES.get(model_type)
    heads = {auto: mappings[auto][model_type] for auto in auto_classes if isinstance(mappings[auto].get(model_type), str)}
    if config is None or "AutoModel" not in heads:
        raise SurgeryError(f"transformers has no model classes for {model_type!r}, which talking-heads builds on")
    return config, heads


@dataclass(frozen=True)
class Family:
    spec: ArchSpec
    model_type: str
    config_name: str  # transformers' configuration class, e.g. LlamaConfig
    heads: dict[str, str]  # auto class -> transformers model class, e.g. AutoModelForCausalLM -> LlamaForCausalLM

    @property
    def config_class(self) -> str:
        return CLASS_PREFIX + self.config_name

    def model_class(self, auto: str) -> str:
        return CLASS_PREFIX + self.heads[auto]

    @property
    def rotary(self) -> bool:
        """Whether query-key sub-heads must first order each head's dims as rotation pairs (i, i + d/2): half-split
        RoPE only (interleaved pairs (2i, 2i + 1) are already adjacent)."""
        return self.spec.rotary and self.spec.rotary_pairs == "half"

    def auto_map(self) -> dict[str, str]:
        auto = {"AutoConfig": f"configuration_talking_heads.{self.config_class}"}
        auto.update({name: f"modeling_talking_heads.{self.model_class(name)}" for name in self.heads})
        return auto

    def architecture(self, source_architecture: str) -> str | None:
        """Our class for one of the source's `architectures`, or None when that head is not provided."""
        return CLASS_PREFIX + source_architecture if source_architecture in self.heads.values() else None

    def match(self, name: str) -> tuple[str, int] | None:
        """(attention module, layer) when `name` is a layer's query weight (or its fused q/k/v weight)."""
        hit = self.spec.locate(name)
        if hit and hit[2] == self.spec.query_projection and hit[3] == "weight":
            return hit[0], hit[1]
        return None


def family_for(config: dict) -> Family:
    model_type = config.get("model_type")
    if str(model_type).startswith("talking_heads_"):
        raise SurgeryError(f"the source is already a talking-heads checkpoint ({model_type})")
    spec = spec_for(config, KIND, REFUSES)
    config_name, heads = _transformers_classes(model_type, ENCODER_HEADS if spec.encoder else DECODER_HEADS)
    return Family(spec, model_type, config_name, heads)
