"""Attention / Mamba-2 hybrids (`bamba`, the `--to hybrid` output) as GGUF arch `granitehybrid`, the llama.cpp
architecture its own converter writes `BambaForCausalLM` as (llama.cpp's conversion/granite.py, GraniteHybridModel).

A layer is a Mamba-2 mixer where `granitehybrid.attention.head_count_kv` is 0 for it, attention (Llama's, RoPE on:
`rope.scaling.finetuned` true) elsewhere; every layer has the gated SiLU MLP. Granite's multipliers are written as
identity (embedding, residual and logit scale 1, attention scale 1/sqrt(head size)): Bamba has none. The attention
queries and keys are permuted into GGUF's interleaved pairs as for `llama` (llama.cpp's NORM rope).

The mixer as llama.cpp reads it (src/models/mamba-base.cpp, build_mamba2_layer): `ssm_in` = in_proj (z, x, B, C, dt
rows), `ssm_conv1d` = the depthwise convolution (taps last), its bias, `ssm_dt.bias` = dt_bias, `ssm_a` = -exp(A_log),
`ssm_d` = D, `ssm_norm` = the gated RMSNorm's weight as (groups, inner / groups), `ssm_out` = out_proj. Both runtimes
compute y * silu(z) then an RMSNorm over each group of inner / groups channels (transformers' BambaRMSNormGated, its
group_size; llama.cpp's reshape to (inner / groups, groups) before build_norm), with the same epsilon (rms_norm_eps),
and give head h the B/C group h // (heads / groups).

llama.cpp's granitehybrid takes a mixer inner size of exactly twice the hidden size (`GGML_ASSERT(2 * n_embd ==
d_inner)` in src/models/granite-hybrid.cpp: it aborts the process on any other). A mixer of inner size hidden (the
`--to hybrid` output: heads x head size = hidden) is written with as many zero heads again, each with a zero B/C group
of its own: their x, B, C, z and dt rows, convolution taps and bias, D, norm weight and out_proj columns are 0, so
their x after the convolution is silu(0) = 0, their state stays 0, their normed output is 0 and out_proj adds
nothing; the real heads keep their groups (head h, group h // (heads / groups), group size inner / groups). Exact, at a
cost: llama.cpp holds twice the mixer state `surgery inspect` counts and computes the padded projections.

granitehybrid also aborts on a model with no attention layer or no mixer (an empty cache buffer): with every layer
kept as attention the checkpoint is Llama's function and is written as arch `llama`; with none it is refused.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import SurgeryError
from .gguf_file import GGUFTensor
from .llama import attention_tensors, mlp_tensors, output_tensors
from .weights import ExportPlan, Weights, activation_refusal, attention_sizes, llama_attention_keys

MODEL_TYPES = ("bamba",)
ARCH = "granitehybrid"
INNER_PER_HIDDEN = 2  # llama.cpp's granitehybrid: ssm inner size == 2 x hidden size, asserted
PAD_A = -1.0  # the zero heads' A (their state is 0 whatever it is)
# BambaConfig's defaults (transformers 5.24, configuration_bamba.py) for the keys a config.json may leave out
DEFAULTS = {"mamba_n_heads": 128, "mamba_d_head": "auto", "mamba_n_groups": 1, "mamba_d_state": 256,
            "mamba_d_conv": 4, "mamba_expand": 2, "mamba_conv_bias": True, "mamba_proj_bias": False}


def _get(config: dict, key: str):
    value = config.get(key)
    return DEFAULTS.get(key) if value is None else value


def _number(value) -> float:
    """A config number as transformers 5 writes it: plain, or {"__float__": "Infinity"} for a non-finite one."""
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def mixer_sizes(config: dict) -> dict:
    """The mixers' sizes as transformers builds them, and `pad`: how many times the inner size fits in llama.cpp's
    (2 x hidden)."""
    hidden = int(config["hidden_size"])
    inner = int(_get(config, "mamba_expand") * hidden)
    heads, groups = int(_get(config, "mamba_n_heads")), int(_get(config, "mamba_n_groups"))
    d_head = _get(config, "mamba_d_head")
    return {"hidden": hidden, "inner": inner, "heads": heads, "groups": groups,
            "d_head": inner // heads if d_head == "auto" else int(d_head),
            "d_state": int(_get(config, "mamba_d_state")), "d_conv": int(_get(config, "mamba_d_conv")),
            "pad": INNER_PER_HIDDEN * hidden // inner if inner else 0}


def attention_layers(config: dict) -> list[int]:
    return sorted(config.get("attn_layer_indices") or [])


def refusal(config: dict) -> str | None:
    """Why llama.cpp's granitehybrid would compute something else than this bamba config (or cannot hold it), or
    None."""
    why = activation_refusal(config, "granitehybrid MLP")
    if why:
        return why
    for key in ("attention_bias", "mlp_bias", "mamba_proj_bias"):
        if _get(config, key):
            return f"{key} is set (llama.cpp's granitehybrid has no place for these biases; the exporter writes none)"
    limit = config.get("time_step_limit") or (0.0, math.inf)
    limit = [_number(v) for v in limit] if isinstance(limit, (list, tuple)) else [limit]
    if len(limit) != 2 or limit[0] != 0.0 or limit[1] != math.inf:
        return f"time_step_limit {limit} clamps dt, which llama.cpp's Mamba-2 does not"
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if _number(rope.get("partial_rotary_factor", 0.5)) != 1.0:
        given = rope.get("partial_rotary_factor", "unset, which Bamba takes as 0.5")
        return f"partial rotary embeddings (partial_rotary_factor {given}); the exporter writes full RoPE only"
    layers, indices = config["num_hidden_layers"], config.get("attn_layer_indices") or []
    if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < layers for i in indices) \
            or len(set(indices)) != len(indices):
        return f"attn_layer_indices {indices} are not distinct layers of {layers}"
    if not indices:
        return ("no layer keeps attention: llama.cpp's granitehybrid aborts on an empty K/V cache "
                "(GGML_ASSERT(buffer) in ggml-backend.cpp), and its mamba2 layers have no MLP")
    if len(indices) == layers:  # no mixer: written as llama, the mixer sizes unused
        return None
    if any(not isinstance(_get(config, k), int) or _get(config, k) < 1
           for k in ("mamba_n_heads", "mamba_n_groups", "mamba_d_state", "mamba_d_conv", "mamba_expand")) \
            or not (_get(config, "mamba_d_head") == "auto" or isinstance(_get(config, "mamba_d_head"), int)):
        return "a mixer size (mamba_n_heads, _n_groups, _d_state, _d_conv, _expand, _d_head) is not a positive integer"
    s = mixer_sizes(config)
    if s["heads"] * s["d_head"] != s["inner"] or s["heads"] % s["groups"]:
        return (f"{s['heads']} mixer heads of {s['d_head']} do not make its inner size {s['inner']} in "
                f"{s['groups']} equal groups")
    if not s["inner"] or (INNER_PER_HIDDEN * s["hidden"]) % s["inner"]:
        return (f"llama.cpp's granitehybrid takes a mixer inner size of exactly {INNER_PER_HIDDEN} x hidden "
                f"({INNER_PER_HIDDEN * s['hidden']}), and {s['inner']} does not pad to it with whole zero heads")
    return None


def _pad_rows(w: np.ndarray, parts: list[int], pad: int, fill: float = 0.0) -> np.ndarray:
    """`w`'s rows split into `parts` (counts), each part followed by (pad - 1) x its count rows of `fill`."""
    pieces, start = [], 0
    for n in parts:
        pieces += [w[start:start + n], np.full(((pad - 1) * n, *w.shape[1:]), fill, dtype=np.float32)]
        start += n
    assert start == w.shape[0], (start, w.shape)
    return np.concatenate(pieces, axis=0)


def mixer_tensors(weights: Weights, layer: int, s: dict) -> list[GGUFTensor]:
    """Layer `layer`'s mixer as llama.cpp's ssm_* tensors, padded with zero heads to llama.cpp's inner size."""
    p, b = f"model.layers.{layer}.mamba.", f"blk.{layer}."
    inner, heads, groups, n, pad, k = s["inner"], s["heads"], s["groups"], s["d_state"], s["pad"], s["d_conv"]
    conv_dim = inner + 2 * groups * n
    expected = {"in_proj.weight": (inner + conv_dim + heads, s["hidden"]), "conv1d.weight": (conv_dim, 1, k),
                "A_log": (heads,), "D": (heads,), "dt_bias": (heads,), "norm.weight": (inner,),
                "out_proj.weight": (s["hidden"], inner)}
    for rel, shape in expected.items():
        if weights.shape(p + rel) != shape:
            raise SurgeryError(f"{p + rel} has shape {weights.shape(p + rel)}, not {shape} as config.json's mixer "
                               f"sizes make it")
    xbc = [inner, groups * n, groups * n]
    tensors = [
        weights.tensor(b + "ssm_in.weight", p + "in_proj.weight", lambda w: _pad_rows(w, [inner, *xbc, heads], pad),
                       shape=(pad * (inner + conv_dim + heads), s["hidden"])),
        weights.tensor(b + "ssm_conv1d.weight", p + "conv1d.weight", lambda w: _pad_rows(w[:, 0, :], xbc, pad),
                       shape=(pad * conv_dim, k), f32=True),
        weights.tensor(b + "ssm_dt.bias", p + "dt_bias", lambda w: _pad_rows(w, [heads], pad), shape=(pad * heads,)),
        weights.tensor(b + "ssm_a", p + "A_log", lambda w: _pad_rows(-np.exp(w), [heads], pad, PAD_A)[:, None],
                       shape=(pad * heads, 1), f32=True),
        weights.tensor(b + "ssm_d", p + "D", lambda w: _pad_rows(w, [heads], pad)[:, None], shape=(pad * heads, 1),
                       f32=True),
        weights.tensor(b + "ssm_norm.weight", p + "norm.weight",
                       lambda w: _pad_rows(w, [inner], pad).reshape(pad * groups, inner // groups),
                       shape=(pad * groups, inner // groups), f32=True),
        weights.tensor(b + "ssm_out.weight", p + "out_proj.weight", lambda w: _pad_rows(w.T, [inner], pad).T.copy(),
                       shape=(s["hidden"], pad * inner)),
    ]
    if p + "conv1d.bias" in weights.reader:
        if weights.shape(p + "conv1d.bias") != (conv_dim,):
            raise SurgeryError(f"{p}conv1d.bias has shape {weights.shape(p + 'conv1d.bias')}, not ({conv_dim},)")
        tensors.append(weights.tensor(b + "ssm_conv1d.bias", p + "conv1d.bias", lambda w: _pad_rows(w, xbc, pad),
                                      shape=(pad * conv_dim,)))
    else:  # llama.cpp adds the bias unconditionally: a convolution without one is a zero bias
        tensors.append(GGUFTensor(b + "ssm_conv1d.bias", (pad * conv_dim,),
                                  lambda: np.zeros(pad * conv_dim, dtype=np.float32)))
    return tensors


def plan(config: dict, weights: Weights) -> ExportPlan:
    why = refusal(config)
    if why:
        raise SurgeryError(f"cannot export this bamba checkpoint: {why}")
    s = mixer_sizes(config)
    attention = attention_layers(config)
    layers, heads, kv_heads, head_dim = attention_sizes(config)
    mixers = layers - len(attention)
    a = ARCH if mixers else "llama"  # every layer attention: Llama's function (granitehybrid aborts on no state)
    keys = llama_attention_keys(a, config, kv_heads, head_dim, 1e-5)
    if mixers:
        keys |= {
            f"{a}.attention.head_count_kv": [kv_heads if i in attention else 0 for i in range(layers)],
            f"{a}.rope.scaling.finetuned": True,  # granitehybrid's switch for RoPE on the attention layers
            f"{a}.logit_scale": 1.0, f"{a}.embedding_scale": 1.0, f"{a}.residual_scale": 1.0,
            f"{a}.attention.scale": head_dim ** -0.5,
            f"{a}.ssm.conv_kernel": s["d_conv"],
            f"{a}.ssm.inner_size": s["pad"] * s["inner"],
            f"{a}.ssm.state_size": s["d_state"],
            f"{a}.ssm.time_step_rank": s["pad"] * s["heads"],  # llama.cpp reads the mixer's head count from it
            f"{a}.ssm.group_count": s["pad"] * s["groups"],
        }
    tensors = output_tensors(weights, config, "model.final_layernorm.weight")
    for i in range(layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        tensors.append(weights.tensor(b + "attn_norm.weight", p + "input_layernorm.weight"))
        tensors += attention_tensors(weights, p, b, heads, kv_heads) if i in attention else mixer_tensors(weights, i, s)
        tensors += mlp_tensors(weights, p, b, "pre_ff_layernorm", "feed_forward")
    weights.check_all_used("bamba")
    if not mixers:
        return ExportPlan(a, keys, tensors, f"llama: every layer of this bamba checkpoint keeps attention "
                                            f"({heads} query heads, {kv_heads} K/V heads)")
    padded = f", each padded with {(s['pad'] - 1) * s['heads']} zero heads to llama.cpp's inner size" \
        if s["pad"] > 1 else ""
    what = (f"granitehybrid: attention on {len(attention)} of {layers} layers, Mamba-2 mixers on the others "
            f"({s['heads']} heads of {s['d_head']}, {s['groups']} groups{padded})")
    return ExportPlan(a, keys, tensors, what)
