"""Llama-bodied checkpoints as GGUF: arch `llama` (Llama/Mistral sources, their MQA/GQA outputs), or arch
`granite_swa` when some layers attend through a sliding window (the `swa` output, `ministral`; a Mistral whose
`sliding_window` applies to every layer; the `swa --sinks` output, `granite_swa` itself, multipliers and trained
sinks carried over).

`granite_swa` is llama.cpp's Llama layer with Granite's multipliers, per-head attention sinks and a per-layer window
pattern (`granite_swa.attention.sliding_window_pattern`, one bool per layer, true where the layer slides, and
`granite_swa.attention.sliding_window`, the window W). Written with identity multipliers (embedding, residual and
logit scale 1, attention scale 1/sqrt(head_dim)) and sinks at -1e30 (exp(-1e30 - max) = 0: no sink), it is the
ministral layer. Its window is transformers' (a query at q sees keys q-W+1..q: llama.cpp masks p1 - p0 >= W).

Queries and keys are permuted from transformers' rotate-half layout into GGUF's interleaved pairs (llama.cpp's
`LLAMA_ROPE_TYPE_NORM`), per head, as llama.cpp's converter does for Llama.
"""

from __future__ import annotations

import numpy as np

from ..errors import SurgeryError
from .gguf_file import GGUFTensor
from .weights import ExportPlan, Weights, activation_refusal, attention_sizes, llama_attention_keys

MODEL_TYPES = ("llama", "mistral", "ministral", "granite_swa")
SINK_OFF = -1e30  # a sink logit that takes no weight in any softmax


def sliding_layers(config: dict) -> tuple[int | None, list[bool]]:
    """(window, one bool per layer: True where the layer attends through the window)."""
    layers = config["num_hidden_layers"]
    window = config.get("sliding_window")
    if config["model_type"] == "llama" or window is None:
        return None, [False] * layers
    if config["model_type"] == "mistral":  # Mistral's window, when set, applies to every layer
        return int(window), [True] * layers
    types = config.get("layer_types") or (  # granite_swa's default: every fourth layer full, from the first
        ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(layers)]
        if config["model_type"] == "granite_swa" else ["sliding_attention"] * layers)
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if len(types) != layers or unknown:
        raise SurgeryError(f"layer_types must name sliding_attention or full_attention once per layer "
                           f"({layers}); got {unknown or len(types)}")
    return int(window), [t == "sliding_attention" for t in types]


def refusal(config: dict) -> str | None:
    """Why the Llama layer llama.cpp runs would compute something else than this config's, or None."""
    why = activation_refusal(config, "Llama layer")
    if why:
        return why
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            return f"{key} is set (the exporter writes Llama layers without biases)"
    if config.get("pretraining_tp", 1) not in (1, None):
        return "pretraining_tp > 1"
    return None


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Each head's rows from rotate-half order (x_0..x_{d/2-1}, y_0..) to interleaved pairs (x_0, y_0, x_1, ...)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def output_tensors(weights: Weights, config: dict, final_norm: str) -> list[GGUFTensor]:
    """The embedding, the final norm `final_norm` and, untied, the output head (a tied lm_head is skipped: llama.cpp
    reads token_embd for the output), for every Llama-bodied arch written here."""
    tensors = [weights.tensor("token_embd.weight", "model.embed_tokens.weight"),
               weights.tensor("output_norm.weight", final_norm)]
    if not config.get("tie_word_embeddings", False):
        tensors.append(weights.tensor("output.weight", "lm_head.weight"))
    weights.skip("lm_head.weight")
    return tensors


def attention_tensors(weights: Weights, p: str, b: str, heads: int, kv_heads: int,
                      permute: bool = True) -> list[GGUFTensor]:
    """Layer prefix `p`'s Llama attention as GGUF block `b`'s: q and k rows permuted to llama.cpp's NORM RoPE layout
    (interleaved pairs), or kept in transformers' rotate-half order where not `permute` (the NEOX RoPE of qwen2/3)."""
    q = (lambda w: permute_rows(w, heads)) if permute else None
    k = (lambda w: permute_rows(w, kv_heads)) if permute else None
    return [weights.tensor(b + "attn_q.weight", p + "self_attn.q_proj.weight", q),
            weights.tensor(b + "attn_k.weight", p + "self_attn.k_proj.weight", k),
            weights.tensor(b + "attn_v.weight", p + "self_attn.v_proj.weight"),
            weights.tensor(b + "attn_output.weight", p + "self_attn.o_proj.weight")]


def mlp_tensors(weights: Weights, p: str, b: str, norm: str, mlp: str) -> list[GGUFTensor]:
    """Layer prefix `p`'s norm before the MLP (`norm`) and gated MLP (module `mlp`) as GGUF block `b`'s."""
    return [weights.tensor(b + "ffn_norm.weight", p + norm + ".weight"),
            weights.tensor(b + "ffn_gate.weight", p + mlp + ".gate_proj.weight"),
            weights.tensor(b + "ffn_up.weight", p + mlp + ".up_proj.weight"),
            weights.tensor(b + "ffn_down.weight", p + mlp + ".down_proj.weight")]


def plan(config: dict, weights: Weights) -> ExportPlan:
    why = refusal(config)
    if why:
        raise SurgeryError(f"cannot export this {config['model_type']} checkpoint: {why}")
    layers, heads, kv_heads, head_dim = attention_sizes(config)
    window, sliding = sliding_layers(config)
    own_sinks = config["model_type"] == "granite_swa"  # its multipliers and sinks are the checkpoint's
    arch = "granite_swa" if any(sliding) or own_sinks else "llama"
    a = arch
    keys = llama_attention_keys(a, config, kv_heads, head_dim, 1e-6)
    if own_sinks and config.get("layer_rope_theta") and len(set(config["layer_rope_theta"])) > 1:
        raise SurgeryError("cannot export a granite_swa checkpoint whose layers have different RoPE bases "
                           "(layer_rope_theta): llama.cpp's granite_swa has one")
    if arch == "granite_swa":
        c = config if own_sinks else {}
        keys |= {f"{a}.attention.sliding_window": window, f"{a}.attention.sliding_window_pattern": sliding,
                 f"{a}.logit_scale": float(c.get("logits_scaling", 1.0)),
                 f"{a}.embedding_scale": float(c.get("embedding_multiplier", 1.0)),
                 f"{a}.residual_scale": float(c.get("residual_multiplier", 1.0)),
                 f"{a}.attention.scale": float(c.get("attention_multiplier", head_dim ** -0.5))}

    tensors = output_tensors(weights, config, "model.norm.weight")
    for i in range(layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        tensors += [weights.tensor(b + "attn_norm.weight", p + "input_layernorm.weight"),
                    *attention_tensors(weights, p, b, heads, kv_heads),
                    *mlp_tensors(weights, p, b, "post_attention_layernorm", "mlp")]
        if own_sinks:
            tensors.append(weights.tensor(b + "attn_sinks.weight", p + "self_attn.sinks",
                                          lambda w: w.astype(np.float32)))
        elif arch == "granite_swa":
            tensors.append(GGUFTensor(b + "attn_sinks.weight", (heads,),
                                      lambda: np.full(heads, SINK_OFF, dtype=np.float32)))
    weights.check_all_used(config["model_type"])
    if arch == "granite_swa":
        what = f"granite_swa: window {window} on {sum(sliding)} of {layers} layers, the others full"
    else:
        what = f"llama: {heads} query heads, {kv_heads} K/V heads"
    return ExportPlan(arch, keys, tensors, what)
