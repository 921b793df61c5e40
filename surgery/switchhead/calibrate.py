"""What the source's heads do on calibration text: attention-map distances between heads (for clustering) and
linear fits of each head's per-token importance (for the routers' initial weights).

The source streams layer by layer over the calibration tokens (`surgery.calibration.stream`: float32 on the
device, eager attention; the layer's input is what `layers.py` gives it, by default the hidden states of the layers
before it already converted). Hooks on the layer's
self-attention module see its input x, its attention probabilities and the per-head outputs entering the output
projection, and reduce them on the spot to running sums, so memory stays at one chunk's attention map:

- distance(i, j) = mean over query rows of ||A_i[row] - A_j[row]||², from the Gram matrix of the heads' maps;
- importance on the output side: log ||O_i a_i(x)|| (how much head i writes for the token that attends);
  on the value side: log ||O_i V_i x|| (how much the value of the token attended to would write through head i);
  each fitted by ridge regression on x (routers have no bias), standardised over all heads together so that
  the fits keep which heads matter more on average.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..calibration.stream import LayerCall, StopForward, run_layer, run_until_stopped
from ..errors import SurgeryError
from ..precision import full_precision
from .families import family_for, module_value_output

RIDGE = 1e-3  # times the mean eigenvalue of x's second moment
ROUTER_RMS = 0.1  # rms of the initial router scores: gates stay within a few percent of sigmoid(0) = 1/2


@dataclass
class LayerFit:
    distance: torch.Tensor  # (h, h)
    router_o: torch.Tensor  # (h, D): score weights of each source head as an output expert
    router_v: torch.Tensor  # (h, D): ... as a value expert
    r2_o: float  # fraction of the standardised importance the fit explains
    r2_v: float


class LayerStats:
    """Running sums for one layer."""

    def __init__(self, heads: int, hidden: int, device: torch.device | str = "cpu"):
        f64 = dict(dtype=torch.float64, device=device)
        self.gram = torch.zeros(heads, heads, **f64)
        self.rows = 0
        self.xtx = torch.zeros(hidden, hidden, **f64)
        self.xsum = torch.zeros(hidden, **f64)
        self.xty = torch.zeros(2, hidden, heads, **f64)  # [output side, value side]
        self.ysum = torch.zeros(2, **f64)
        self.ysq = torch.zeros(2, **f64)
        self.tokens = 0

    def add(self, x: torch.Tensor, probs: torch.Tensor, importance: torch.Tensor) -> None:
        """x (N, D); probs (b, h, T, S); importance (2, N, h)."""
        h = probs.shape[1]
        maps = probs.transpose(0, 1).reshape(h, -1)
        self.gram += (maps @ maps.T).double()
        self.rows += probs.shape[0] * probs.shape[2]
        self.xtx += (x.T @ x).double()  # float32 products (fast), float64 running sums
        self.xsum += x.sum(0).double()
        y = importance.double()
        self.xty += torch.stack([x.T @ side for side in importance]).double()
        self.ysum += y.sum((1, 2))
        self.ysq += (y * y).sum((1, 2))
        self.tokens += x.shape[0]

    def finish(self) -> LayerFit:
        g = self.gram / max(self.rows, 1)
        diag = g.diagonal()
        distance = (diag[:, None] + diag[None, :] - 2 * g).clamp(min=0)
        n, heads = self.tokens, self.gram.shape[0]
        second = self.xtx / n
        ridge = RIDGE * second.diagonal().mean() * torch.eye(second.shape[0], dtype=second.dtype, device=second.device)
        count = n * heads
        mu = self.ysum / count
        sd = (self.ysq / count - mu * mu).clamp(min=1e-12).sqrt()
        xtz = (self.xty - self.xsum[None, :, None] * mu[:, None, None]) / (sd[:, None, None] * n)  # E[x z] (2, D, h)
        both = torch.linalg.solve(second + ridge, torch.cat(list(xtz), dim=1))  # (D, 2h), one factorisation
        fits, r2 = [], []
        for side in range(2):
            w = both[:, side * heads : (side + 1) * heads]
            explained = float((w * xtz[side]).sum() / heads)  # mean over heads of E[(x.w) z]: R² for a unit-variance z
            rms = ((second @ w) * w).sum(0).mean().clamp(min=1e-30).sqrt()  # rms of the scores x.w
            fits.append((w * (ROUTER_RMS / rms)).T.float())
            r2.append(explained)
        return LayerFit(distance.float().cpu(), fits[0], fits[1], r2[0], r2[1])


def _projections(attn: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.nn.Module]:
    """(V (kv*d, D), V bias, O (D, h*d), output module) of a source attention module, as (out, in) matrices."""
    config = attn.config.to_dict()
    return module_value_output(attn, family_for(config), config)


def attention_path(layer: torch.nn.Module) -> str:
    """Where the decoder layer's self-attention module lives inside it, as its family's spec says."""
    config = next((m.config for m in layer.modules() if getattr(m, "config", None) is not None), None)
    if config is None:
        raise SurgeryError(f"no configuration found in {type(layer).__name__} to locate its attention")
    return family_for(config.to_dict()).spec.attention


def attention_module(layer: torch.nn.Module) -> torch.nn.Module:
    """The decoder layer's self-attention module."""
    try:
        return layer.get_submodule(attention_path(layer))
    except AttributeError:
        raise SurgeryError(f"no self-attention module found in {type(layer).__name__}") from None


@dataclass
class AttentionCapture:
    """One chunk's call of the source attention module and its output: what the output refit regresses onto."""

    args: tuple
    kwargs: dict
    output: torch.Tensor  # (b, t, D)


@torch.no_grad()
def calibrate_layer(layer: torch.nn.Module, hidden: list[torch.Tensor], calls: list[LayerCall], heads: int,
                    kv_heads: int, head_dim: int, fetch=lambda t: t, keep_calls: bool = True, keep_outputs: bool = True
                    ) -> tuple[LayerFit, list[AttentionCapture], list[torch.Tensor] | None]:
    """Run the source layer (float32, eager attention) over every chunk of its input hidden states and fit it.

    Returns the layer's fit (see the module docstring), its attention calls and outputs per chunk (for the output
    refit; empty unless `keep_calls`) and the layer's output hidden states per chunk (the next layer's input).
    Without `keep_outputs` each chunk's forward stops once the attention has run (the rest of the layer, its MLP,
    would only compute outputs nobody reads) and None stands for the outputs."""
    attn = attention_module(layer)
    v_w, v_b, o_w, out_module = _projections(attn)
    hidden_size = o_w.shape[0]
    stats = LayerStats(heads, hidden_size, o_w.device)
    group = torch.arange(heads, device=o_w.device) // (heads // kv_heads)  # K/V head of each query head
    o_heads = o_w.detach().float().view(hidden_size, heads, head_dim)
    o_gram = torch.einsum("Dhd,Dhe->hde", o_heads, o_heads)  # O_m^T O_m: ||O_m u||² = u^T (O_m^T O_m) u
    caught: dict = {}
    captures: list[AttentionCapture] = []

    def on_input(module, args, kwargs):
        caught["x"] = args[0] if args else kwargs["hidden_states"]
        caught["args"], caught["kwargs"] = args, kwargs

    def on_heads(module, args):
        caught["a"] = args[0]

    @full_precision  # the statistics in float32 inside a bf16 forward
    def on_output(module, args, kwargs, output):
        probs = output[1]
        if probs is None:
            raise SurgeryError("calibration needs attention probabilities (eager attention)")
        x = caught.pop("x").reshape(-1, hidden_size).float()
        a = caught.pop("a").reshape(-1, heads, head_dim).float()
        values = F.linear(x, v_w, v_b).view(-1, kv_heads, head_dim)[:, group]  # (N, h, d)
        sq = torch.stack([(torch.bmm(u.transpose(0, 1), o_gram) * u.transpose(0, 1)).sum(-1).T for u in (a, values)])
        stats.add(x, probs.float(), 0.5 * sq.clamp(min=1e-12).log())  # log ||O_m u||
        call_args, call_kwargs = caught.pop("args"), caught.pop("kwargs")
        if keep_calls:
            captures.append(AttentionCapture(call_args, call_kwargs, output[0].float()))
        if not keep_outputs:
            raise StopForward

    handles = [attn.register_forward_pre_hook(on_input, with_kwargs=True),
               out_module.register_forward_pre_hook(on_heads),
               attn.register_forward_hook(on_output, with_kwargs=True)]
    try:
        if keep_outputs:
            outputs = [run_layer(layer, fetch(h), call) for h, call in zip(hidden, calls)]
        else:
            outputs = None
            for h, call in zip(hidden, calls):
                if not run_until_stopped(run_layer, layer, fetch(h), call):
                    raise SurgeryError(f"calibration: the attention of {type(layer).__name__} did not run in its "
                                       "forward")
    finally:
        for handle in handles:
            handle.remove()
    return stats.finish(), captures, outputs


@torch.no_grad()
def source_captures(layer: torch.nn.Module, hidden: list[torch.Tensor], calls: list[LayerCall], fetch=lambda t: t):
    """Chunk by chunk, the source attention's call and output on `hidden` (the output refit's inputs and targets),
    recomputed: each chunk's forward stops once the attention has run. One chunk's capture is alive at a time, where
    holding them all would keep two [tokens, hidden] tensors per layer for the whole refit."""
    attn = attention_module(layer)
    caught: dict = {}

    def on_output(module, args, kwargs, output):
        caught["capture"] = AttentionCapture(args, kwargs, output[0].float())
        raise StopForward

    handle = attn.register_forward_hook(on_output, with_kwargs=True)
    try:
        for h, call in zip(hidden, calls):
            if not run_until_stopped(run_layer, layer, fetch(h), call):
                raise SurgeryError(f"calibration: the attention of {type(layer).__name__} did not run in its forward")
            yield caught.pop("capture")
    finally:
        handle.remove()

