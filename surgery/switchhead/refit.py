"""Refit each layer's output experts to the source's attention output, on calibration text.

After the merge, a SwitchHead head attends with one pattern where the source had E (one per member), so the
members' own output projections no longer add up to what the source wrote. With the queries, keys, values and
routers fixed, the layer's output is linear in its output experts:

    y(x) = Σ_h Σ_{e selected} g_h,e(x) O_h,e a_h(x) = W φ(x),   φ(x) = [g_h,e(x) a_h(x) if selected, else 0]

so one ridge regression per layer fits W (D x H*E*d) to the source's attention output (minus its bias), pulled
toward the members' own projections W0:  W = (Yᵀφ + λ W0)(φᵀφ + λ I)⁻¹,  λ = `ridge` · mean(diag φᵀφ).

Router refit (top-k < E): the output router was fitted at calibration to the members' importance in the source,
before the merge. With the experts refit, the choice that matters is which experts fit each token best, so the
router is refit to that: per token, head and expert the gain of adding the expert (at gate 1/2) to what its head
should write (the target minus the other heads' outputs), relative to the head's mean gain, standardised and
regressed on x like the calibration's fits; then the experts are refit to the new routing. Up to ROUTER_ROUNDS
rounds, each kept only where it lowers the layer's calibration error. The selection then acts like a
token-dependent choice among E output maps, which is what the refit can use: on SmolLM2 H=3 E=3, top-3 (every
expert, one map) measured 6.12x the source's perplexity, top-2 4.71x, top-1 4.57x (BENCHMARKS.md).

Every layer is fitted on the source's own hidden states, right after its calibration (the layer streams through
`surgery.calibration.stream` once): the SwitchHead attention built from the new tensors runs on the source
attention's captured calls, against the source attention's captured outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..solve import lu_in_place
from .build import GATE_AT_ZERO
from .calibrate import AttentionCapture, ridge_fit, router_weights
from .modeling_switchhead import CACHE_KWARGS, SwitchHeadAttention

RIDGE = 0.1
ROUTER_ROUNDS = 2  # output-router refits, each followed by an expert refit, while the error falls


@dataclass(frozen=True)
class OutputRefit:
    """How the output experts (and the output router) are refit: `ridge` is the pull toward the members' own
    projections, `router_rounds` the router refits (0: the calibration's router stays)."""

    ridge: float = RIDGE
    router_rounds: int = ROUTER_ROUNDS
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


def dense_gates(attn: SwitchHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """(N, H, E): each output expert's gate for every token, zero where the router did not select it."""
    gates, index = attn.o_router(x)
    if index is None:
        return gates
    return gates.new_zeros(*gates.shape[:2], attn.num_experts).scatter_(2, index, gates)


class RouterStats:
    """Running sums for refitting the output router to the refit experts (module docstring, "router refit")."""

    def __init__(self, hidden: int, slots: int, device: torch.device | str = "cpu"):
        f64 = dict(dtype=torch.float64, device=device)
        self.xtx = torch.zeros(hidden, hidden, **f64)
        self.xsum = torch.zeros(hidden, **f64)
        self.xtu = torch.zeros(hidden, slots, **f64)
        self.usum = self.usq = 0.0
        self.tokens = 0

    def add(self, x: torch.Tensor, gain: torch.Tensor) -> None:
        """x (N, D); gain (N, H, E): what each expert would add to its head's fit, relative to its head's mean."""
        u = (gain - gain.mean(-1, keepdim=True)).reshape(x.shape[0], -1)
        self.xtx += (x.T @ x).double()
        self.xsum += x.sum(0).double()
        self.xtu += (x.T @ u).double()
        self.usum += float(u.double().sum())
        self.usq += float(u.double().pow(2).sum())
        self.tokens += x.shape[0]

    def finish(self) -> torch.Tensor:
        """Router rows (H*E, D): ridge fits of the standardised gains, scaled like the calibration's router fits."""
        n, slots = self.tokens, self.xtu.shape[1]
        mu = self.usum / (n * slots)
        sd = max(self.usq / (n * slots) - mu * mu, 1e-24) ** 0.5
        second = self.xtx / n
        xtz = (self.xtu - self.xsum[:, None] * mu) / (sd * n)
        return router_weights(ridge_fit(second, xtz), second)


def expert_gains(attn: SwitchHeadAttention, heads_out: torch.Tensor, x: torch.Tensor, target: torch.Tensor,
                 w: torch.Tensor) -> torch.Tensor:
    """(N, H, E): for every token, head and output expert e with weights W_h,e: how much adding g·W_h,e a_h at the
    gate g = 1/2 lowers the squared error of what head h should write, r_h = target - (the other heads' outputs):
    g⟨r_h, W_h,e a_h⟩ - ½ g² ||W_h,e a_h||²  (the error with e alone, against none; the cross terms of two
    selected experts left out)."""
    n, heads, d = heads_out.shape
    experts = attn.num_experts
    w = w.float().view(-1, heads, experts, d)  # (D, H, E, d)
    gates = dense_gates(attn, x)

    def head(h: int) -> tuple[torch.Tensor, torch.Tensor]:  # every expert's output (N, E, D), the head's (N, D)
        c = torch.einsum("nd,Ded->neD", heads_out[:, h], w[:, h])
        return c, (gates[:, h, :, None] * c).sum(1)

    residual = target.clone()
    for h in range(heads):  # one head's expert outputs at a time, twice, rather than all heads' at once
        residual -= head(h)[1]
    g = GATE_AT_ZERO
    gains = []
    for h in range(heads):
        c, own = head(h)
        gains.append(g * torch.einsum("nD,neD->ne", residual + own, c) - 0.5 * g * g * c.pow(2).sum(-1))
    return torch.stack(gains, 1)


@torch.no_grad()
def refit_layer(attn: torch.nn.Module, config, settings: dict, tensors: dict[str, torch.Tensor],
                captures: list[AttentionCapture], how: OutputRefit = OutputRefit()) -> dict:
    """Refit `tensors["o_experts.weight"]` (in place) of the SwitchHead attention replacing the source attention
    `attn`, on the source attention's captured calls, then (top-k < E) the output router to the refit experts and
    the experts again, for up to `how.router_rounds` rounds while the error falls (`tensors["o_router.weight"]` in
    place). Returns the relative errors: the members' own projections, the first refit, the final one."""
    device = next(attn.parameters()).device
    with torch.device(device):
        sh = SwitchHeadAttention(attn, config, settings).eval()
    missing, unexpected = sh.load_state_dict(tensors, strict=False)
    if unexpected or any(not m.startswith(("q_norm.", "k_norm.")) for m in missing):
        raise RuntimeError(f"layer {sh.layer_idx}: tensors do not fit the attention module ({missing}, {unexpected})")
    o_bias = tensors.get("o_bias")
    calls = []  # (heads' outputs, x, target) per capture: none depends on the output router
    for cap in captures:
        kwargs = dict(cap.kwargs)
        hidden = cap.args[0] if cap.args else kwargs.pop("hidden_states")
        for key in (*CACHE_KWARGS, "use_cache", "output_attentions"):
            kwargs.pop(key, None)
        heads_out, x, _ = sh.attend(hidden, *cap.args[1:], **kwargs)
        target = cap.output.reshape(x.shape[0], -1).float()
        calls.append((heads_out, x, target if o_bias is None else target - o_bias))
    w_shape = tensors["o_experts.weight"].shape  # (H, E, D, d)
    w0 = tensors["o_experts.weight"].permute(2, 0, 1, 3).reshape(w_shape[2], -1)  # float32: upcast where used

    def fit_experts() -> tuple[torch.Tensor, float, float]:
        st = OutputStats(sh.num_heads * sh.num_experts * sh.head_dim, w_shape[2], device)
        for heads_out, x, target in calls:
            st.add(features(sh, heads_out, x), target)
        w = st.solve(w0, how.ridge)
        return w, st.error(w), st.error(w0)

    w, error, before = fit_experts()
    report = {"before": round(before, 5), "refit": round(error, 5)}
    rounds = how.router_rounds if sh.topk < sh.num_experts else 0
    for _ in range(rounds):
        kept = sh.o_router.weight.detach().clone()
        stats = RouterStats(w_shape[2], sh.num_heads * sh.num_experts, device)
        for heads_out, x, target in calls:
            stats.add(x, expert_gains(sh, heads_out, x, target, w))
        sh.o_router.weight.copy_(stats.finish())
        w_new, error_new, _ = fit_experts()
        if error_new >= error:  # the refit router fits worse: keep the calibration's
            sh.o_router.weight.copy_(kept)
            break
        w, error = w_new, error_new
    tensors["o_router.weight"] = sh.o_router.weight.detach().clone()
    tensors["o_experts.weight"] = w.reshape(w_shape[2], *w_shape[:2], w_shape[3]).permute(1, 2, 0, 3).float().contiguous()
    return report | {"after": round(error, 5)}
