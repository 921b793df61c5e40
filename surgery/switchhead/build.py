"""One layer's SwitchHead tensors from the source's projections and the layer's head clusters ("head-clustered
experts").

For cluster c with member heads m_1..m_E (K/V head g(m) of each member):

- q_proj and k_proj of head c ("mean" merge, the default) = the mean of the members' queries and K heads. When the
  members share their K head, the mean query gives the mean of the members' logits, the least-squares merge in
  logit space. ("medoid" merge: the query and K head of the cluster's medoid, the member whose attention maps are
  closest to the other members': head c then attends exactly like one of its members. Measured on SmolLM2-135M,
  H=3 E=3 k=2, with the output refit, calibrated on the source's hidden states, on 16,384 held-out pydoc tokens:
  mean 62.5, medoid 113.0, the source 13.3; BENCHMARKS.md.)
- value expert e = V_{g(m_e)} and output expert e = O_{m_e}: the members' own projections, scaled so that the
  σ-MoE gates at their initial value sigmoid(0) = 1/2 give the source's scale: the output side sums the selected
  experts (each O_e scaled by 2, so a gate of 1/2 counts 1) and the value side averages them (each V_e scaled by
  2/k, so k gates of 1/2 add up to 1: a group's shared V head comes out unchanged, whichever experts are picked).
  The output experts are then refit to the source's attention output (`refit.py`).
- routers (E, D) per head: zero for E = 1 (the gate is exactly 1/2, and the doubled experts make the layer exact
  in floating point); otherwise the calibration fits of the members' importance, scaled so that scores stay
  small (top-k ranks by them while every gate stays within a few percent of 1/2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .families import SourceAttention

GATE_AT_ZERO = 0.5  # sigmoid(0)


@dataclass(frozen=True)
class SwitchHeadShape:
    layers: int
    hidden: int  # D
    heads: int  # h, the source's query heads
    kv_heads: int
    head_dim: int  # d
    new_heads: int  # H
    experts: int  # E
    topk: int  # k

    @property
    def group_of(self) -> list[int]:
        """The K/V head of each source query head."""
        per = self.heads // self.kv_heads
        return [m // per for m in range(self.heads)]

    def tensor_shapes(self, biases: dict[str, bool]) -> dict[str, tuple[int, ...]]:
        H, E, d, D = self.new_heads, self.experts, self.head_dim, self.hidden
        shapes = {"q_proj.weight": (H * d, D), "k_proj.weight": (H * d, D)}
        if biases["q"]:
            shapes["q_proj.bias"] = (H * d,)
        if biases["k"]:
            shapes["k_proj.bias"] = (H * d,)
        shapes["v_router.weight"] = (H * E, D)
        shapes["v_experts.weight"] = (H, E, d, D)
        if biases["v"]:
            shapes["v_experts.bias"] = (H, E, d)
        shapes["o_router.weight"] = (H * E, D)
        shapes["o_experts.weight"] = (H, E, D, d)
        if biases["o"]:
            shapes["o_bias"] = (D,)
        return shapes


def layer_tensors(src: SourceAttention, clusters: list[list[int]], shape: SwitchHeadShape,
                  router_o: torch.Tensor | None, router_v: torch.Tensor | None,
                  pivots: list[int] | None = None) -> dict[str, torch.Tensor]:
    """The layer's new tensors (float32). router_o / router_v: (h, D) fits per source head, or None for zeros.

    pivots: for each cluster the member whose query and K head the cluster takes ("medoid" merge); None: the
    mean of the members' queries and K heads ("mean" merge)."""
    h, kv, d, D = shape.heads, shape.kv_heads, shape.head_dim, shape.hidden
    H, E, k = shape.new_heads, shape.experts, shape.topk
    group = torch.tensor(shape.group_of)
    members = torch.tensor(clusters)  # (H, E)
    v_scale, o_scale = 1.0 / (k * GATE_AT_ZERO), 1.0 / GATE_AT_ZERO
    q, kk, v = src.q.view(h, d, D), src.k.view(kv, d, D), src.v.view(kv, d, D)
    o = src.o.view(D, h, d)
    qk_heads = members if pivots is None else torch.tensor(pivots).view(H, 1)  # heads merged into each q / k
    out = {
        "q_proj.weight": q[qk_heads].mean(1).reshape(H * d, D),
        "k_proj.weight": kk[group[qk_heads]].mean(1).reshape(H * d, D),
        "v_experts.weight": v[group[members]] * v_scale,  # (H, E, d, D)
        "o_experts.weight": o[:, members].permute(1, 2, 0, 3) * o_scale,  # (D, H, E, d) -> (H, E, D, d)
    }
    if src.q_bias is not None:
        out["q_proj.bias"] = src.q_bias.view(h, d)[qk_heads].mean(1).reshape(H * d)
    if src.k_bias is not None:
        out["k_proj.bias"] = src.k_bias.view(kv, d)[group[qk_heads]].mean(1).reshape(H * d)
    if src.v_bias is not None:
        out["v_experts.bias"] = src.v_bias.view(kv, d)[group[members]] * v_scale
    if src.o_bias is not None:
        out["o_bias"] = src.o_bias.clone()
    for side, fit in (("o", router_o), ("v", router_v)):
        out[f"{side}_router.weight"] = torch.zeros(H * E, D) if fit is None else fit[members.reshape(-1)].clone()
    return {name: t.contiguous() for name, t in out.items()}
