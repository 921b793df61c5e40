"""What `--to hybrid` converts, and the Bamba config and tensor names it writes.

The source must have a Llama body that Bamba's layer holds exactly (see the package docstring): RMSNorm, a gated
SiLU MLP, no biases, full rotary embeddings on every layer, no sliding window, and heads that tile the hidden size
(Bamba's attention, and llama.cpp's, take the head size as hidden / heads; the mixers' inner size is heads x head
size). Every refusal is one line, from config.json alone, before any tensor is read.
"""

from __future__ import annotations

import re

from ..errors import SurgeryError

KIND = "hybrid"
TARGET = "bamba"
ARCHITECTURE = "BambaForCausalLM"
BODIES = ("llama", "mistral", "ministral")  # model types whose layer is Llama's (norms, MLP, embeddings, no multipliers)
# why other common families are refused, in their own words
OTHER_BODIES = {
    "qwen2": "q/k/v biases, which Bamba's attention has no place for",
    "qwen3": "per-head q/k norms, which Bamba's attention has no place for",
    "gemma": "a (1 + w) RMSNorm, a scaled embedding and a GELU MLP",
    "gemma2": "soft-capping, sandwich norms and a GELU MLP",
    "phi": "partial rotary embeddings, biases and a non-gated MLP",
    "granite": "embedding, residual, attention and logit multipliers",
    "gpt2": "learned positions, LayerNorm and a non-gated MLP",
}
CONV_KERNELS = (2, 3, 4)


def verdict_text(spec) -> str:
    """The `convert --list` cell of a family the hybrid conversion accepts."""
    windows = "; a sliding window shorter than the context is refused" if spec.name != "llama" else ""
    return f"yes: Llama's layer is Bamba's{windows}"  # the causal-conv1d kernels (CUDA) and llama.cpp's ssm_conv handle these widths


def check_family(config: dict, conv_kernel: int) -> dict:
    """The source's sizes, or one line saying why its body cannot be written as Bamba."""
    model_type = config.get("model_type")
    if model_type not in BODIES:
        why = OTHER_BODIES.get(str(model_type))
        raise SurgeryError(f"hybrid cannot convert {model_type!r}" + (f": it has {why}" if why else "") +
                           f"; supported: {', '.join(BODIES)} (a Llama body that Bamba's layer holds exactly)")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise SurgeryError(f"hybrid cannot convert this {model_type}: it has attention or MLP biases, which Bamba's "
                           "layer has no place for")
    if config.get("hidden_act", "silu") != "silu":
        raise SurgeryError(f"hybrid cannot convert this {model_type}: its MLP uses {config['hidden_act']}, Bamba's "
                           "a gated SiLU")
    if int(config.get("pretraining_tp") or 1) != 1:
        raise SurgeryError(f"hybrid cannot convert this {model_type}: pretraining_tp={config['pretraining_tp']}")
    window, context = config.get("sliding_window"), int(config.get("max_position_embeddings") or 0)
    if window and (not context or int(window) < context):  # a window as long as the context changes nothing
        raise SurgeryError(f"hybrid cannot convert this {model_type}: it has a sliding window "
                           f"({config['sliding_window']} tokens), which Bamba's attention has no place for")
    rope = rope_parameters(config)
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise SurgeryError(f"hybrid cannot convert this {model_type}: its rotary embeddings are partial "
                           f"(partial_rotary_factor={rope['partial_rotary_factor']})")
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    if head_dim * heads != hidden:
        raise SurgeryError(f"hybrid cannot hold this {model_type}'s mixer: {heads} heads of {head_dim} make "
                           f"{heads * head_dim}, not its hidden size {hidden} (Bamba's mixer inner size is a whole "
                           "multiple of the hidden size, and its attention takes the head size as hidden / heads)")
    if heads % kv:
        raise SurgeryError(f"hybrid cannot convert this {model_type}: {heads} heads do not share {kv} K/V heads evenly")
    if conv_kernel not in CONV_KERNELS:
        raise SurgeryError(f"--conv-kernel {conv_kernel}: Bamba's runtimes take a convolution of "
                           f"{', '.join(map(str, CONV_KERNELS))} taps")
    return {"hidden": hidden, "heads": heads, "kv_heads": kv, "head_dim": head_dim,
            "layers": int(config["num_hidden_layers"])}


def rope_parameters(config: dict) -> dict:
    """The source's rotary settings as transformers 5 writes them (`rope_parameters`), from either spelling."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope.setdefault("rope_type", rope.pop("type", "default"))
    rope.setdefault("rope_theta", float(config.get("rope_theta", 10000.0)))
    if "partial_rotary_factor" in config:
        rope.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    return rope


# the source config keys that carry over unchanged
CARRIED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "hidden_act", "rms_norm_eps", "max_position_embeddings", "initializer_range",
           "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "attention_dropout")


def target_config(config: dict, sizes: dict, attention: list[int], conv_kernel: int, dtype: str | None) -> dict:
    """The output config.json: Bamba with the source's body, `attention` layers kept and Mamba-2 mixers sized for
    the attention-to-mixer map (one mixer head and one B/C group per query head, state = head size)."""
    new = {k: config[k] for k in CARRIED if k in config}
    heads, head_dim = sizes["heads"], sizes["head_dim"]
    rope = rope_parameters(config) | {"partial_rotary_factor": 1.0}  # Bamba's default would be 0.5
    new.update(model_type=TARGET, architectures=[ARCHITECTURE], attn_layer_indices=list(attention),
               num_key_value_heads=sizes["kv_heads"], tie_word_embeddings=bool(config.get("tie_word_embeddings")),
               rope_parameters=rope, attn_rotary_emb=head_dim,  # llama.cpp's and vLLM's rotary width
               attention_bias=False, mlp_bias=False,
               mamba_n_heads=heads, mamba_d_head=head_dim, mamba_n_groups=heads, mamba_d_state=head_dim,
               mamba_d_conv=conv_kernel, mamba_expand=heads * head_dim // sizes["hidden"], mamba_chunk_size=256,
               mamba_conv_bias=True, mamba_proj_bias=False, time_step_limit=[0.0, float("inf")])
    dtype = dtype or config.get("dtype") or config.get("torch_dtype")
    if dtype:
        new["dtype"] = dtype
    return new


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
RENAMES = {"post_attention_layernorm.weight": "pre_ff_layernorm.weight",
           "mlp.gate_proj.weight": "feed_forward.gate_proj.weight", "mlp.up_proj.weight": "feed_forward.up_proj.weight",
           "mlp.down_proj.weight": "feed_forward.down_proj.weight", "input_layernorm.weight": "input_layernorm.weight"}
ATTENTION = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "self_attn.o_proj.weight")
OUTSIDE = {"model.embed_tokens.weight": "model.embed_tokens.weight", "model.norm.weight": "model.final_layernorm.weight",
           "lm_head.weight": "lm_head.weight"}


def output_name(name: str, attention: set[int]) -> tuple[str | None, int | None]:
    """(the output's name for source tensor `name`, or None where the mixer replaces it; its layer)."""
    if name in OUTSIDE:
        return OUTSIDE[name], None
    m = _LAYER.match(name)
    if m is None:
        if name.endswith("rotary_emb.inv_freq"):
            return None, None
        raise SurgeryError(f"hybrid does not know the source tensor {name!r} (a Llama body has none such)")
    layer, rest = int(m.group(1)), m.group(2)
    if rest in RENAMES:
        return f"model.layers.{layer}.{RENAMES[rest]}", layer
    if rest in ATTENTION:
        return (f"model.layers.{layer}.{rest}" if layer in attention else None), layer
    if rest.endswith("rotary_emb.inv_freq"):
        return None, layer
    raise SurgeryError(f"hybrid does not know the source tensor {name!r} (a Llama body has none such)")
