"""MLA outputs (`deepseek_v3`, dense, no query LoRA) as GGUF arch `deepseek2`, laid out for llama.cpp's absorbed MLA.

llama.cpp caches one row per token and layer, the latent (kv_lora_rank R) and the shared rope key (D), and absorbs
the up-projections: `kv_b_proj` (per head: the no-position key rows, then the value rows) is split into `attn_k_b`
(per head R x nope, transposed: llama.cpp multiplies the queries' no-position part by it) and `attn_v_b` (per head
v x R). The attention is written as one K/V head of R + D (key_length) and R (value_length), the per-head sizes as
the `_mla` lengths. `q_lora_rank` is 0 (no query LoRA: llama.cpp builds the plain query projection `attn_q`), every
layer is dense (`leading_dense_block_count` = the layer count). The rope part of the queries and the shared key is
kept as the checkpoint stores it: `rope_interleave: true` is the interleaved pairs llama.cpp rotates for
deepseek2, so no permutation (a checkpoint without it is refused).
"""

from __future__ import annotations

from ..errors import SurgeryError
from .weights import ExportPlan, Weights, body_keys, rope_theta

MODEL_TYPES = ("deepseek_v3",)


def refusal(config: dict) -> str | None:
    layers = config["num_hidden_layers"]
    if config.get("q_lora_rank"):
        return "a query LoRA (q_lora_rank); the exporter writes the plain query projection of this toolkit's outputs"
    if (config.get("first_k_dense_replace") or 0) < layers:
        return "mixture-of-experts layers (first_k_dense_replace < num_hidden_layers); the exporter writes dense layers"
    if not config.get("rope_interleave", False):
        return "rope_interleave is not set (the exporter maps the interleaved rope layout llama.cpp rotates)"
    if config.get("attention_bias"):
        return "attention_bias is set"
    if config.get("hidden_act", "silu") != "silu":
        return f"hidden_act {config['hidden_act']!r}"
    if (config.get("num_key_value_heads") or config["num_attention_heads"]) != config["num_attention_heads"]:
        return "num_key_value_heads differs from num_attention_heads"
    return None


def plan(config: dict, weights: Weights) -> ExportPlan:
    why = refusal(config)
    if why:
        raise SurgeryError(f"cannot export this deepseek_v3 checkpoint: {why}")
    a = "deepseek2"
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    rank, rope, nope, v = (config["kv_lora_rank"], config["qk_rope_head_dim"], config["qk_nope_head_dim"],
                           config["v_head_dim"])
    keys = body_keys(a, config, 1) | {
        f"{a}.rope.freq_base": rope_theta(config),
        f"{a}.rope.dimension_count": rope,
        f"{a}.attention.layer_norm_rms_epsilon": float(config.get("rms_norm_eps", 1e-6)),
        f"{a}.vocab_size": config["vocab_size"],
        f"{a}.leading_dense_block_count": layers,
        f"{a}.attention.q_lora_rank": 0,
        f"{a}.attention.kv_lora_rank": rank,
        f"{a}.attention.key_length": rank + rope,
        f"{a}.attention.value_length": rank,
        f"{a}.attention.key_length_mla": nope + rope,
        f"{a}.attention.value_length_mla": v,
        f"{a}.expert_feed_forward_length": int(config.get("moe_intermediate_size") or config["intermediate_size"]),
        f"{a}.expert_shared_count": 0,
        f"{a}.expert_weights_scale": 1.0,
    }

    def k_b(w):  # (heads*(nope+v), R) -> per head the no-position key rows, transposed: (heads, R, nope)
        return w.reshape(heads, nope + v, rank)[:, :nope, :].transpose(0, 2, 1)

    def v_b(w):  # -> per head the value rows: (heads, v, R)
        return w.reshape(heads, nope + v, rank)[:, nope:, :]

    tensors = [weights.tensor("token_embd.weight", "model.embed_tokens.weight"),
               weights.tensor("output_norm.weight", "model.norm.weight")]
    if config.get("tie_word_embeddings", False):
        weights.skip("lm_head.weight")
    else:
        tensors.append(weights.tensor("output.weight", "lm_head.weight"))
    for i in range(layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        kv_b = p + "self_attn.kv_b_proj.weight"
        if weights.shape(kv_b) != (heads * (nope + v), rank):
            raise SurgeryError(f"{kv_b} has shape {weights.shape(kv_b)}, not heads x (nope + v) by kv_lora_rank")
        tensors += [
            weights.tensor(b + "attn_norm.weight", p + "input_layernorm.weight"),
            weights.tensor(b + "attn_q.weight", p + "self_attn.q_proj.weight"),
            weights.tensor(b + "attn_kv_a_mqa.weight", p + "self_attn.kv_a_proj_with_mqa.weight"),
            weights.tensor(b + "attn_kv_a_norm.weight", p + "self_attn.kv_a_layernorm.weight"),
            weights.tensor(b + "attn_k_b.weight", kv_b, k_b, shape=(heads, rank, nope)),
            weights.tensor(b + "attn_v_b.weight", kv_b, v_b, shape=(heads, v, rank)),
            weights.tensor(b + "attn_output.weight", p + "self_attn.o_proj.weight"),
            weights.tensor(b + "ffn_norm.weight", p + "post_attention_layernorm.weight"),
            weights.tensor(b + "ffn_gate.weight", p + "mlp.gate_proj.weight"),
            weights.tensor(b + "ffn_up.weight", p + "mlp.up_proj.weight"),
            weights.tensor(b + "ffn_down.weight", p + "mlp.down_proj.weight"),
        ]
    weights.check_all_used("deepseek_v3")
    return ExportPlan(a, keys, tensors, f"deepseek2: MLA, latent {rank} + rope key {rope} per token and layer")
