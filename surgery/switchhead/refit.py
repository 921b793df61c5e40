"""Refit each layer's output experts to the source's attention output, on calibration text.

After the merge, a SwitchHead head attends with one pattern where the source had E (one per member), so the
members' own output projections no longer add up to what the source wrote. With the queries, keys, values and
routers fixed, the layer's output is linear in its output experts:

    y(x) = Σ_h Σ_{e selected} g_h,e(x) O_h,e a_h(x) = W φ(x),   φ(x) = [g_h,e(x) a_h(x) if selected, else 0]

so one ridge regression per layer fits W (D x H*E*d) to the source's attention output (minus its bias), pulled
toward the members' own projections W0:  W = (Yᵀφ + λ W0)(φᵀφ + λ I)⁻¹,  λ = `ridge` · mean(diag φᵀφ).

Every layer is fitted on the source's own hidden states (one pass over the calibration windows; the source's
attention modules are run, and beside each of them the SwitchHead attention built from the new tensors).
"""

from __future__ import annotations

import torch

from .calibrate import attention_modules, run_windows
from .modeling_switchhead import SwitchHeadAttention

RIDGE = 0.1


class OutputStats:
    def __init__(self, features: int, hidden: int):
        self.gram = torch.zeros(features, features, dtype=torch.float64)
        self.cross = torch.zeros(hidden, features, dtype=torch.float64)
        self.energy = 0.0

    def add(self, phi: torch.Tensor, target: torch.Tensor) -> None:
        self.gram += (phi.T @ phi).double()
        self.cross += (target.T @ phi).double()
        self.energy += float(target.double().pow(2).sum())

    def error(self, w: torch.Tensor) -> float:
        """||Y - W φ||² / ||Y||² over the calibration tokens."""
        resid = self.energy - 2 * float((w * self.cross).sum()) + float(((w @ self.gram) * w).sum())
        return max(resid, 0.0) / max(self.energy, 1e-30)

    def solve(self, w0: torch.Tensor, ridge: float) -> torch.Tensor:
        lam = ridge * self.gram.diagonal().mean().clamp(min=1e-30)
        eye = torch.eye(self.gram.shape[0], dtype=self.gram.dtype)
        return torch.linalg.solve(self.gram + lam * eye, (self.cross + lam * w0).T).T


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


@torch.no_grad()
def refit_output_experts(model, windows: torch.Tensor, tensors: list[dict[str, torch.Tensor]], settings: dict,
                         ridge: float = RIDGE, progress: bool = True) -> list[dict]:
    """Refit `tensors[layer]["o_experts.weight"]` in place for every layer; returns the relative errors."""
    attns = attention_modules(model, len(tensors))
    stats, converted, handles = [], [], []
    for layer, attn in enumerate(attns):
        sh = SwitchHeadAttention(attn, model.config, settings).eval()
        missing, unexpected = sh.load_state_dict(tensors[layer], strict=False)
        if unexpected or any(not m.startswith(("q_norm.", "k_norm.")) for m in missing):
            raise RuntimeError(f"layer {layer}: tensors do not fit the attention module ({missing}, {unexpected})")
        o_bias = tensors[layer].get("o_bias")
        st = OutputStats(sh.num_heads * sh.num_experts * sh.head_dim, sh.o_experts.weight.shape[2])
        stats.append(st)
        converted.append(sh)
        caught: dict = {}

        def on_input(module, args, kwargs, caught=caught):
            caught["args"], caught["kwargs"] = args, kwargs

        def on_output(module, args, kwargs, output, caught=caught, sh=sh, st=st, o_bias=o_bias):
            args, kwargs = caught.pop("args"), dict(caught.pop("kwargs"))
            hidden = args[0] if args else kwargs.pop("hidden_states")
            for key in ("past_key_values", "use_cache", "output_attentions"):
                kwargs.pop(key, None)
            heads_out, x, _ = sh.attend(hidden, *args[1:], **kwargs)
            target = output[0].reshape(x.shape[0], -1).float()
            if o_bias is not None:
                target = target - o_bias
            st.add(features(sh, heads_out, x), target)

        handles += [attn.register_forward_pre_hook(on_input, with_kwargs=True),
                    attn.register_forward_hook(on_output, with_kwargs=True)]
    run_windows(model, windows, "refit", progress, handles)
    report = []
    for layer, (sh, st) in enumerate(zip(converted, stats)):
        w_shape = tensors[layer]["o_experts.weight"].shape  # (H, E, D, d)
        w0 = tensors[layer]["o_experts.weight"].double().permute(2, 0, 1, 3).reshape(w_shape[2], -1)
        w = st.solve(w0, ridge)
        report.append({"before": round(st.error(w0), 5), "after": round(st.error(w), 5)})
        tensors[layer]["o_experts.weight"] = w.reshape(w_shape[2], *w_shape[:2], w_shape[3]).permute(1, 2, 0, 3) \
            .float().contiguous()
    return report
