"""Which families the MLA conversion writes as a plain `deepseek_v3` checkpoint, and how faithfully (torch-free: the
kind's `convert --list` column and the converter both read it).

- exact: the family's layer is DeepSeek-V3's outside attention (RMSNorm w * x / rms, gated MLP, plain embedding,
  untied or tied head), so the output computes the source's function up to the latent's documented error (full
  rank, MQA: the kv_a_layernorm's linear regime; tests/mla/test_mla_families.py checks every one at full rank).
- approximate: the family computes something DeepSeek-V3's attention cannot hold and that runtimes would drop
  (vLLM's MLA has no projection biases, DeepSeek has no per-head q/k norms): Qwen2's q/k/v biases, Qwen3's q/k
  norms. Their projections are replaced by their best linear fit on the calibration activations
  (E[t x^T] E[x x^T]^-1 for the source's pre-RoPE queries, keys and values t, biases and norms included, except the
  key bias, dropped: surgery/mla/absorb.py), then the
  query refit and the output refit fit the source's own logits and attention outputs (which carry the biases and
  norms); what remains is measured (surgery.json's `mla.absorption`, `surgery check`, BENCHMARKS.md).
- refused: every other family, in its own words (surgery/arch.py's `body`).

Nothing is written that one runtime honours and another drops: no `attention_bias`, no q/k norm tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

EXACT, APPROXIMATE = "exact", "approximate"


@dataclass(frozen=True)
class MLAFamily:
    """How one family converts: its verdict, why, and what the calibration absorbs (`biases`: q/k/v projection
    biases; `qk_norm`: per-head q/k RMSNorms)."""

    verdict: str
    reason: str
    biases: bool = False
    qk_norm: bool = False
    # multipliers outside attention folded into the weights they scale (surgery/mla/body.py): config keys, or
    # "sqrt(hidden_size)" for Gemma's embedding normaliser
    embedding_multiplier: str | None = None
    residual_multiplier: str | None = None  # scales attention's and the MLP's outputs: o_proj and down_proj
    logits_divisor: str | None = None  # divides the logits: lm_head
    attention_multiplier: str | None = None  # the softmax scale, instead of head_dim^-0.5
    norm_offset: float = 0.0  # RMSNorm weights act as (offset + w) (Gemma: 1)
    rope_layers: str | None = None  # config key: per layer 1 (rotates) or 0 (no RoPE: queries' rope part zero)
    # the MLP as DeepSeek's gated one: "gated" (as it is), "fused_gate_up" (Phi-3's gate_up_proj: rows [gate | up],
    # split), "relu2" (Arcee's down(relu(up x)^2) = down(relu(up x) * up x): gate_proj = up_proj, hidden_act relu)
    mlp: str = "gated"
    # LayerNorm without weights (OLMo): the residual stream kept mean-zero (the embedding rows, o_proj and down_proj
    # centred), where LayerNorm is RMSNorm with weight 1 (written: the source has no norm tensors), at `norm_eps`
    layer_norm: bool = False
    norm_eps: float | None = None  # the source norms' epsilon when config.json has no rms_norm_eps

    @property
    def absorbs(self) -> bool:
        return self.biases or self.qk_norm


FAMILIES: dict[str, MLAFamily] = {
    "llama": MLAFamily(EXACT, "Llama's layer is DeepSeek-V3's outside attention"),
    "mistral": MLAFamily(EXACT, "Llama's layer; a sliding window shorter than the context is refused"),
    "ministral": MLAFamily(EXACT, "Llama's layer; a sliding window shorter than the context is refused"),
    "helium": MLAFamily(EXACT, "Llama's layer with interleaved rotary pairs"),
    "granite": MLAFamily(EXACT, "embedding, attention, residual and logit multipliers folded into the weights they "
                         "scale", embedding_multiplier="embedding_multiplier",
                         residual_multiplier="residual_multiplier",
                         logits_divisor="logits_scaling", attention_multiplier="attention_multiplier"),
    "gemma": MLAFamily(EXACT, "(1 + w) RMSNorm weights and the embedding normaliser folded (the untied lm_head keeps "
                       "the unscaled embedding)", embedding_multiplier="sqrt(hidden_size)", norm_offset=1.0),
    "smollm3": MLAFamily(EXACT, "layers without RoPE keep no rope frequency: every key dimension through the "
                         "latent, the rope query and key zero", rope_layers="no_rope_layers"),
    "phi3": MLAFamily(EXACT, "fused q/k/v rows and fused gate/up rows split into DeepSeek's tensors (LongRoPE, "
                      "whose scale changes with the context, is refused)", mlp="fused_gate_up"),
    "arcee": MLAFamily(EXACT, "the ungated ReLU^2 MLP written gated: relu(u) * u = relu(u)^2 with gate_proj = up_proj "
                       "(the MLP's first projection computed twice)", mlp="relu2"),
    "olmo": MLAFamily(EXACT, "weightless LayerNorm as RMSNorm on a mean-zero residual stream (embedding, o_proj and "
                      "down_proj centred); clip_qkv is refused", layer_norm=True, norm_eps=1e-5),
    "qwen2": MLAFamily(APPROXIMATE, "q/v biases absorbed by calibration, the key bias dropped (nearly "
                       "softmax-invariant), error measured (DeepSeek-V3 has no projection biases)", biases=True),
    "glm": MLAFamily(APPROXIMATE, "q/v biases absorbed by calibration, the key bias dropped (softmax-invariant on "
                     "the non-rotating half, not on the rotating one), error measured; partial interleaved rotary: "
                     "the non-rotating dims join the no-position keys; fused gate/up rows split", biases=True,
                     mlp="fused_gate_up"),
    "qwen3": MLAFamily(APPROXIMATE, "per-head q/k norms absorbed by calibration, error measured (DeepSeek-V3 has "
                       "none)", qk_norm=True),
}


def mla_family(name: str) -> MLAFamily | None:
    return FAMILIES.get(name)


def rotating_layers(family: MLAFamily | None, config: dict, layers: int) -> list[bool]:
    """Per layer, whether its queries and keys rotate (all, unless the family lists layers without RoPE; SmolLM3's
    config.json may leave the list out: then every `no_rope_layer_interval`-th layer (default 4) has none, as
    transformers computes it)."""
    if family is None or family.rope_layers is None:
        return [True] * layers
    flags = config.get(family.rope_layers)
    if flags is None:
        interval = int(config.get("no_rope_layer_interval") or 4)
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    return [bool(f) for f in flags[:layers]]


def verdict_text(spec) -> str:
    """The `convert --list` cell of a family the MLA conversion accepts."""
    family = FAMILIES.get(spec.name)
    return f"{family.verdict}: {family.reason}" if family else "exact"


def body_refusal(spec, trait) -> str | None:
    """Feature.BODY: refused in the family's own words unless the family is in `FAMILIES`."""
    return None if spec.name in FAMILIES else trait.detail
