"""A Mamba-2 mixer initialised from the attention it replaces (the map of Mamba-in-the-Llama and Zebra-Llama).

Mamba-2 computes, per head, y_t = sum_{s<=t} (C_t . B_s) exp(A (dt_{s+1} + ... + dt_t)) dt_s x_s + D x_t, with
x, B, C read through a causal depthwise convolution and SiLU, then out = out_proj(norm(y * silu(z))) where the norm
is an RMSNorm per group. Causal linear attention is y_t = sum_{s<=t} (q_t . k_s) v_s, so:

- C <- the query projection, B <- the key projection, x <- the value projection, out_proj <- o_proj. One mixer head
  and one B/C group per query head (n_groups = n_heads = heads, d_state = d_head = head size): every query head has
  its own C, and the K/V heads a query head shares under GQA are repeated into its B and x. Exact in shape.
- conv1d: identity (last tap 1, the others and the bias 0): the mixer reads x, B, C of the token itself.
- dt = softplus(dt_bias) = 1 (its projection rows 0), A = -1/context: the decay over the model's whole context is
  e^-1, as close to linear attention's none as a stable A allows. D = 0: linear attention has no skip term.
- x is read at scale X_SCALE: SiLU is nearly linear near 0 (silu(e v) ~ e v / 2), so the values pass almost
  unbent, and the scale cancels in the norm. B and C keep their scale: SiLU is the feature map on q and k (the
  Mamba-in-the-Llama form; nothing in Mamba-2 gives softmax's positivity or its denominator exactly).
- The gate z and the gated RMSNorm cannot be switched off. The norm is per group = per head, so any positive
  scalar that is the same across a head's channels cancels in it: every z row is GATE_SCALE * u with u the mean
  direction of the layer's (normed) input on calibration text, scaled so u . h = 1 at the mean; silu(z) is then one
  positive number per token wherever u . h > 0 (the share of calibration tokens where it is, is recorded). The
  norm then plays softmax's denominator: each head's output at unit RMS, times the norm weight, fitted per channel
  by least squares to the source attention's output there (pre-o_proj) on calibration text: w_c = sum_t a_c n_c /
  sum_t n_c^2 for the normed mixer output n and the attention output a. Unit-RMS heads with a weight set to the
  attention's RMS would overshoot: many attention heads output almost nothing on most tokens (they attend to a
  sink), which a normed head cannot; the fit shrinks a channel by how little the two agree.
"""

from __future__ import annotations

import math

import torch

X_SCALE = 0.1  # the values' scale into SiLU (its curvature bends v by about X_SCALE * v / 2 relative)
GATE_SCALE = 4.0  # z at the mean input: silu(4) = 3.93, well inside SiLU's linear side
DT = 1.0  # softplus(dt_bias)


def mixer_names(prefix: str) -> list[str]:
    """The mixer's tensors under `prefix` (e.g. model.layers.3.mamba), in the order they are written."""
    return [f"{prefix}.{n}" for n in ("A_log", "D", "conv1d.bias", "conv1d.weight", "dt_bias", "in_proj.weight",
                                      "norm.weight", "out_proj.weight")]


def mixer_shapes(sizes: dict, conv_kernel: int) -> dict[str, tuple[int, ...]]:
    h, d, hidden = sizes["heads"], sizes["head_dim"], sizes["hidden"]
    inner = h * d
    conv_dim = inner + 2 * h * d
    return {"A_log": (h,), "D": (h,), "conv1d.bias": (conv_dim,), "conv1d.weight": (conv_dim, 1, conv_kernel),
            "dt_bias": (h,), "in_proj.weight": (inner + conv_dim + h, hidden), "norm.weight": (inner,),
            "out_proj.weight": (hidden, inner)}


def gate_direction(mean_input: torch.Tensor) -> torch.Tensor:
    """u with u . mean = 1 (a zero mean gives u = 0: the gate then closes, as untrained Mamba-2 gates start)."""
    norm2 = float(mean_input.double().pow(2).sum())
    return mean_input / norm2 if norm2 > 0 else torch.zeros_like(mean_input)


@torch.no_grad()
def mixer_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, sizes: dict, conv_kernel: int,
                  context: int, mean_input: torch.Tensor, norm_weight: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The mixer's tensors (float32, names relative to the mixer) from one layer's q/k/v/o_proj weights ([out, in])
    and its calibration statistics: `mean_input` [hidden] (the layer's normed input, averaged over tokens) and
    `norm_weight` [heads * head_dim] (the gated norm's weight, fitted by calibrate.py; None: ones)."""
    h, kv, d, hidden = sizes["heads"], sizes["kv_heads"], sizes["head_dim"], sizes["hidden"]
    rep = h // kv
    q, k, v, o = (t.float() for t in (q, k, v, o))
    repeat = lambda w: w.view(kv, d, hidden).repeat_interleave(rep, dim=0).reshape(h * d, hidden)  # noqa: E731
    z = (GATE_SCALE * gate_direction(mean_input.float()))[None].expand(h * d, hidden)
    in_proj = torch.cat([z, X_SCALE * repeat(v), repeat(k), q, torch.zeros(h, hidden)], dim=0)
    shapes = mixer_shapes(sizes, conv_kernel)
    conv = torch.zeros(shapes["conv1d.weight"])
    conv[:, 0, -1] = 1.0
    a = 1.0 / max(int(context or 1), 1)
    return {"A_log": torch.full((h,), math.log(a)), "D": torch.zeros(h), "conv1d.bias": torch.zeros(shapes["conv1d.bias"]),
            "conv1d.weight": conv, "dt_bias": torch.full((h,), math.log(math.expm1(DT))),
            "in_proj.weight": in_proj.contiguous(),
            "norm.weight": torch.ones(h * d) if norm_weight is None else norm_weight.float().clone(),
            "out_proj.weight": o.clone()}
