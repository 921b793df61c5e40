"""Folding a family's multipliers outside attention into the weights DeepSeek-V3 reads (pure tensor math).

DeepSeek-V3's layer is Llama's: RMSNorm w * x / rms, residual + attention(x), residual + MLP(x), logits = lm_head h,
the embedding as it is. Granite scales the embedding, the softmax, both residual branches and the logits by config
constants; Gemma's RMSNorms multiply by (1 + w) and its embedding by sqrt(hidden_size) (in the weights' dtype).
Each is a constant that multiplies one weight: the embedding rows, o_proj and down_proj (the residual branches
end there), lm_head (the logits), the norm weights (+ offset), and the queries (the softmax scale, which
surgery/mla/factor.py folds as the source's scaling). The output computes the same function; the tied head, which
DeepSeek writes untied, keeps the unscaled embedding. MLPs that are not gated as DeepSeek's are rewritten as gated
ones computing the same function (`mlp_tensors`): Phi-3's fused gate/up rows split, Arcee's relu(u)^2 as
relu(u) * u with the up projection also as the gate.
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
    mlp: str = "gated"  # surgery/mla/families.py's MLAFamily.mlp
    stream: float = 1.0  # the residual stream's scale: sqrt(output eps / source eps) (see `of`)
    center: bool = False  # keep the residual stream mean-zero (weightless LayerNorm -> RMSNorm of weight 1)

    @classmethod
    def of(cls, family: MLAFamily | None, config: dict, dtype: torch.dtype = torch.float32,
           eps: float | None = None) -> "BodyFold":
        """The constants of `config`'s checkpoint. With `eps` (the output's rms_norm_eps) and a source whose norms
        use another epsilon e, the residual stream is scaled by c = sqrt(eps / e) (the embedding, o_proj and
        down_proj, where everything the stream holds comes from): every norm reads c x, and
        RMSNorm_eps(c x) = RMSNorm_e(x) exactly, so the body's norms compute the source's at the output's epsilon
        (which kv_a_layernorm fixes); the logits read the final norm's output and do not change."""
        source_eps = config.get("rms_norm_eps") or (family.norm_eps if family else None)
        stream = (eps / float(source_eps)) ** 0.5 if eps and source_eps else 1.0
        if family is None:
            return cls(stream=stream)

        def value(key: str | None, default: float = 1.0) -> float:
            if key is None:
                return default
            if key == "sqrt(hidden_size)":  # Gemma multiplies by this scalar cast to the weights' dtype
                return float(torch.tensor(float(config["hidden_size"]) ** 0.5, dtype=dtype))
            return float(config[key]) if config.get(key) is not None else default

        scale = value(family.attention_multiplier, 0.0)
        return cls(value(family.embedding_multiplier), value(family.residual_multiplier),
                   1.0 / value(family.logits_divisor), family.norm_offset, scale or None, family.mlp, stream,
                   family.layer_norm)

    @property
    def branch(self) -> float:
        """What multiplies the last weight of each residual branch (o_proj, down_proj)."""
        return self.residual * self.stream

    @property
    def hidden_act(self) -> str | None:
        """The output's hidden_act where the MLP is rewritten (None: the source's)."""
        return "relu" if self.mlp == "relu2" else None

    def mlp_tensors(self, name: str, rows: int) -> list[tuple[str, slice | None]]:
        """The output tensors (name, rows of the source tensor; None: all) a source tensor becomes."""
        if self.mlp == "fused_gate_up" and name.endswith("mlp.gate_up_proj.weight"):
            stem = name.removesuffix("gate_up_proj.weight")
            return [(stem + "gate_proj.weight", slice(0, rows // 2)), (stem + "up_proj.weight", slice(rows // 2, rows))]
        if self.mlp == "relu2" and name.endswith("mlp.up_proj.weight"):
            return [(name.removesuffix("up_proj.weight") + "gate_proj.weight", None), (name, None)]
        return [(name, None)]

    @property
    def identity(self) -> bool:
        return self == BodyFold(attention_scale=self.attention_scale)

    def factor(self, name: str) -> tuple[float, float]:
        """(multiplier, offset) of a copied tensor, by its name in the output."""
        if name.endswith("embed_tokens.weight"):
            return self.embedding * self.stream, 0.0
        if name == "lm_head.weight":
            return self.logits, 0.0
        if name.endswith(("mlp.down_proj.weight", "self_attn.o_proj.weight")):
            return self.branch, 0.0
        if name.endswith(NORMS) or (name.endswith("norm.weight") and ".layers." not in name):
            return 1.0, self.norm_offset
        return 1.0, 0.0

    def centred(self, name: str) -> int | None:
        """The dim over which a tensor's hidden-size outputs are centred (None: not centred)."""
        if not self.center:
            return None
        if name.endswith("embed_tokens.weight"):
            return 1  # [vocab, hidden]: each token's row
        if name.endswith(("mlp.down_proj.weight", "self_attn.o_proj.weight")):
            return 0  # [hidden, in]: each input's column
        return None

    def changes(self, name: str) -> bool:
        return self.factor(name) != (1.0, 0.0) or self.centred(name) is not None

    def apply(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if not self.changes(name):
            return tensor
        scale, offset = self.factor(name)
        out = tensor.double()
        dim = self.centred(name)
        if dim is not None:  # P = I - 11^T/H on the outputs: the residual stream gains no mean
            out = out - out.mean(dim, keepdim=True)
        return out * scale + offset

    def added_norms(self, layers: int, prefix: str = "model.") -> list[str]:
        """The norm weights DeepSeek reads that a weightless-LayerNorm source lacks (written as ones)."""
        if not self.center:
            return []
        return [f"{prefix}layers.{i}.{n}" for i in range(layers) for n in NORMS] + [f"{prefix}norm.weight"]
