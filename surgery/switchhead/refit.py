"""Refit each layer's output experts to the source's attention output, on calibration text.

After the merge, a SwitchHead head attends with one pattern where the source had E (one per member), so the
members' own output projections no longer add up to what the source wrote. With the queries, keys, values and
routers fixed, the layer's output is linear in its output experts:

    y(x) = Σ_h Σ_{e selected} g_h,e(x) O_h,e a_h(x) = W φ(x),   φ(x) = [g_h,e(x) a_h(x) if selected, else 0]

so one ridge regression per layer fits W (D x H*E*d) to the source's attention output (minus its bias), pulled
toward the members' own projections W0:  W = (Yᵀφ + λ W0)(φᵀφ + λ I)⁻¹,  λ = `ridge` · mean(diag φᵀφ).

Every layer is fitted right after its calibration, on the same inputs (the layer streams through
`surgery.calibration.stream` once; see `layers.py` for which hidden states): the SwitchHead attention built from
the new tensors runs on the source attention's captured calls, against the source attention's captured outputs.
"""

from __future__ import annotations

from typing import Iterable

import torch

from ..solve import lu_in_place
from .calibrate import AttentionCapture
from .modeling_switchhead import CACHE_KWARGS, SwitchHeadAttention

RIDGE = 0.1
ROW_BLOCK = 512  # rows of W per block (solve, error)


class OutputStats:
    def __init__(self, features: int, hidden: int, device: torch.device | str = "cpu"):
        self.gram = torch.zeros(features, features, dtype=torch.float64, device=device)
        self.cross = torch.zeros(hidden, features, dtype=torch.float64, device=device)
        self.energy = 0.0

    def add(self, phi: torch.Tensor, target: torch.Tensor) -> None:
        self.gram += (phi.T @ phi).double()
        self.cross += (target.T @ phi).double()
        self.energy += float(target.double().pow(2).sum())

    def error(self, w: torch.Tensor) -> float:
        """||Y - W φ||² / ||Y||² over the calibration tokens (W in row blocks: no [D, features] float64 temporary)."""
        cross = quad = 0.0
        for lo in range(0, w.shape[0], ROW_BLOCK):
            wb = w[lo:lo + ROW_BLOCK].double()
            cross += float((wb * self.cross[lo:lo + ROW_BLOCK]).sum())
            quad += float(((wb @ self.gram) * wb).sum())
        resid = self.energy - 2 * cross + quad
        return max(resid, 0.0) / max(self.energy, 1e-30)

    def solve(self, w0: torch.Tensor, ridge: float) -> torch.Tensor:
        """W = (Yᵀφ + λ W0)(φᵀφ + λ I)⁻¹ (float64), factorised in a copy of the Gram (kept for `error`) and solved
        in row blocks of W (each row's solve is independent), so no [D, features] temporaries."""
        lam = float(ridge * self.gram.diagonal().mean().clamp(min=1e-30))
        a = self.gram.clone()
        a.diagonal().add_(lam)
        lu, pivots = lu_in_place(a)
        w = torch.empty_like(self.cross)
        for lo in range(0, w.shape[0], ROW_BLOCK):
            rhs = self.cross[lo:lo + ROW_BLOCK] + lam * w0[lo:lo + ROW_BLOCK].double()
            w[lo:lo + ROW_BLOCK] = torch.linalg.lu_solve(lu, pivots, rhs, left=False)  # X A = rhs, A symmetric
        return w


def features(attn: SwitchHeadAttention, heads_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """φ (N, H*E*d): each head's output, gated, in the slot of every selected output expert."""
    n, heads, d = heads_out.shape
    gates, index = attn.o_router(x)
    if index is None:
        phi = gates.unsqueeze(-1) * heads_out.unsqueeze(2)
    else:
        phi = heads_out.new_zeros(n, heads, attn.num_experts, d)
        k = index.shape[-1]
        phi.scatter_(2, index.unsqueeze(-1).expand(n, heads, k, d), gates.unsqueeze(-1) * heads_out.unsqueeze(2))
    return phi.reshape(n, -1)


def switchhead_attention(attn: torch.nn.Module, config, settings: dict,
                         tensors: dict[str, torch.Tensor]) -> SwitchHeadAttention:
    """The SwitchHead attention that replaces the source attention `attn`, holding `tensors`, on attn's device."""
    device = next(attn.parameters()).device
    with torch.device(device):
        sh = SwitchHeadAttention(attn, config, settings).eval()
    missing, unexpected = sh.load_state_dict(tensors, strict=False)
    if unexpected or any(not m.startswith(("q_norm.", "k_norm.")) for m in missing):
        raise RuntimeError(f"layer {sh.layer_idx}: tensors do not fit the attention module ({missing}, {unexpected})")
    return sh


@torch.no_grad()
def refit_layer(attn: torch.nn.Module, config, settings: dict, tensors: dict[str, torch.Tensor],
                captures: Iterable[AttentionCapture], ridge: float = RIDGE) -> dict:
    """Refit `tensors["o_experts.weight"]` (in place) of the SwitchHead attention replacing the source attention
    `attn`, on the source attention's captured calls; returns the relative errors before and after."""
    sh = switchhead_attention(attn, config, settings, tensors)
    device = sh.q_proj.weight.device
    o_bias = tensors.get("o_bias")
    st = OutputStats(sh.num_heads * sh.num_experts * sh.head_dim, sh.o_experts.weight.shape[2], device)
    for cap in captures:
        kwargs = dict(cap.kwargs)
        hidden = cap.args[0] if cap.args else kwargs.pop("hidden_states")
        for key in (*CACHE_KWARGS, "use_cache", "output_attentions"):
            kwargs.pop(key, None)
        heads_out, x, _ = sh.attend(hidden, *cap.args[1:], **kwargs)
        target = cap.output.reshape(x.shape[0], -1).float()
        if o_bias is not None:
            target = target - o_bias
        st.add(features(sh, heads_out, x), target)
    w_shape = tensors["o_experts.weight"].shape  # (H, E, D, d)
    w0 = tensors["o_experts.weight"].permute(2, 0, 1, 3).reshape(w_shape[2], -1)  # float32: upcast where used
    w = st.solve(w0, ridge)
    tensors["o_experts.weight"] = w.reshape(w_shape[2], *w_shape[:2], w_shape[3]).permute(1, 2, 0, 3).float().contiguous()
    return {"before": round(st.error(w0), 5), "after": round(st.error(w), 5)}
