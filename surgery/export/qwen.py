"""Qwen2 and Qwen3 bodies (sources, and their MQA/GQA outputs, which keep model_type qwen2/qwen3) as GGUF archs
`qwen2` and `qwen3`, the layers llama.cpp builds for them (src/models/qwen2.cpp, qwen3.cpp).

Both are Llama's layer (RMS norms, SiLU-gated MLP, full-width RoPE, attention scale 1/sqrt(head_dim)) with llama.cpp's
NEOX RoPE (`LLAMA_ROPE_TYPE_NEOX`: the two halves of each head rotated together, transformers' rotate-half), so the
queries and keys are written as the checkpoint stores them, without the row permutation the `llama` arch needs.
`qwen2` adds the q, k and v biases (`blk.N.attn_q.bias`, ..., transformers' Qwen2 always has them); `qwen3` adds the
per-head RMS norms of the queries and keys before RoPE (`blk.N.attn_q_norm.weight`, `attn_k_norm.weight`).

Refused in one line, before any tensor is read: a sliding window that bites (layers that slide, by `layer_types` or by
`use_sliding_window` and `max_window_layers`, with a window shorter than the context: llama.cpp's qwen2/qwen3 attend
to every past token, and llama.cpp's own converter drops the window without a word), scaled RoPE (weights.rope_theta),
another activation, and Qwen3's `attention_bias` (the exporter writes its attention without biases).
"""

from __future__ import annotations

from ..errors import SurgeryError
from .llama import attention_tensors, mlp_tensors, output_tensors
from .weights import ExportPlan, Weights, activation_refusal, attention_sizes, llama_attention_keys, rope_theta

MODEL_TYPES = ("qwen2", "qwen3")


def sliding_layers(config: dict) -> list[int]:
    """The layers that attend through `sliding_window` in transformers (none without a window): those `layer_types`
    names sliding, or, without layer_types, those from `max_window_layers` on where `use_sliding_window` is set. A
    layer_types that names sliding layers counts even when use_sliding_window is off (refused rather than guessed)."""
    if config.get("sliding_window") is None:
        return []
    layers = config["num_hidden_layers"]
    types = config.get("layer_types")
    if types is not None:
        return [i for i, t in enumerate(types) if t == "sliding_attention"]
    if not config.get("use_sliding_window"):
        return []
    start = config.get("max_window_layers")
    return list(range(layers if start is None else int(start), layers))


def refusal(config: dict) -> str | None:
    """Why llama.cpp's qwen2/qwen3 layer would compute something else than this config's, or None (scaled RoPE
    raises its own line)."""
    model_type = config["model_type"]
    rope_theta(config)
    sliding, window = sliding_layers(config), config.get("sliding_window")
    context = config.get("max_position_embeddings")
    if sliding and (context is None or int(window) < int(context)):
        return (f"sliding-window layers (window {window} on layers {sliding}): llama.cpp's {model_type} attends to "
                f"every past token (llama.cpp's own converter silently drops the window); serve it with transformers")
    why = activation_refusal(config, f"{model_type} layer")
    if why:
        return why
    if model_type == "qwen3" and config.get("attention_bias"):
        return "attention_bias is set (the exporter writes Qwen3 attention without biases)"
    return None


def refuse_before_loading(config: dict) -> None:
    why = refusal(config)
    if why:
        raise SurgeryError(f"cannot export this {config['model_type']} checkpoint: {why}")


def plan(config: dict, weights: Weights) -> ExportPlan:
    a = config["model_type"]
    refuse_before_loading(config)
    layers, heads, kv_heads, head_dim = attention_sizes(config)
    keys = llama_attention_keys(a, config, kv_heads, head_dim, 1e-6)
    tensors = output_tensors(weights, config, "model.norm.weight")
    for i in range(layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        tensors += [weights.tensor(b + "attn_norm.weight", p + "input_layernorm.weight"),
                    *attention_tensors(weights, p, b, heads, kv_heads, permute=False)]
        if a == "qwen2":
            tensors += [weights.tensor(f"{b}attn_{x}.bias", f"{p}self_attn.{x}_proj.bias") for x in "qkv"]
        else:
            tensors += [weights.tensor(f"{b}attn_{x}_norm.weight", f"{p}self_attn.{x}_norm.weight") for x in "qk"]
        tensors += mlp_tensors(weights, p, b, "post_attention_layernorm", "mlp")
    weights.check_all_used(a)
    extra = "q/k/v biases" if a == "qwen2" else "q/k norms"
    return ExportPlan(a, keys, tensors, f"{a}: {heads} query heads, {kv_heads} K/V heads, {extra}")
