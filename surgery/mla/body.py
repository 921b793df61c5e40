"""Folding a family's multipliers outside attention into the weights DeepSeek-V3 reads (pure tensor math).

DeepSeek-V3's layer is Llama's: RMSNorm w * x / rms, residual + attention(x), residual + MLP(x), logits = lm_head h,
the embedding as it is. Granite scales the embedding, the softmax, both residual branches and the logits by config
constants; Gemma's RMSNorms multiply by (1 + w) and its embedding by sqrt(hidden_size) (in the weights' dtype).
Each is a constant that multiplies one weight: the embedding rows, o_proj and down_proj (the residual branches
end there), lm_head (the logits), the norm weights (+ offset), and the queries (the softmax scale, which
surgery/mla/factor.py folds as the source's scaling). The output computes the same function; the tied head, which
DeepSeek writes untied, keeps the unscaled embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .families import MLAFamily

NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")


@dataclass(frozen=True)
class BodyFold:
    """The constants of one checkpoint (1 and 0 where the family has none)."""

    embedding: float = 1.0
    residual: float = 1.0
    logits: float = 1.0  # lm_head's factor (1 / the family's divisor)
    norm_offset: float = 0.0
    attention_scale: float | None = None  # None: head_dim^-0.5

    @classmethod
    def of(cls, family: MLAFamily | None, config: dict, dtype: torch.dtype = torch.float32) -> "BodyFold":
        if family is None:
            return cls()

        def value(key: str | None, default: float = 1.0) -> float:
            if key is None:
                return default
            if key == "sqrt(hidden_size)":  # Gemma multiplies by this scalar cast to the weights' dtype
                return float(torch.tensor(float(config["hidden_size"]) ** 0.5, dtype=dtype))
            return float(config[key]) if config.get(key) is not None else default

        scale = value(family.attention_multiplier, 0.0)
        return cls(value(family.embedding_multiplier), value(family.residual_multiplier),
                   1.0 / value(family.logits_divisor), family.norm_offset, scale or None)

    @property
    def identity(self) -> bool:
        return self == BodyFold(attention_scale=self.attention_scale)

    def factor(self, name: str) -> tuple[float, float]:
        """(multiplier, offset) of a copied tensor, by its name in the output."""
        if name.endswith("embed_tokens.weight"):
            return self.embedding, 0.0
        if name == "lm_head.weight":
            return self.logits, 0.0
        if name.endswith("mlp.down_proj.weight"):
            return self.residual, 0.0
        if name.endswith(NORMS) or (name.endswith("norm.weight") and ".layers." not in name):
            return 1.0, self.norm_offset
        return 1.0, 0.0

    def apply(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        scale, offset = self.factor(name)
        if scale == 1.0 and offset == 0.0:
            return tensor
        return tensor.double() * scale + offset
