"""What the source's heads do on calibration text: attention-map distances between heads (for clustering) and
linear fits of each head's per-token importance (for the routers' initial weights).

The source runs once over the calibration tokens (float32, eager attention, windows of `seq_len`). Hooks on
every self-attention module see its input x, its attention probabilities and the per-head outputs entering the
output projection, and reduce them on the spot to running sums, so memory stays at one layer's attention map:

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

from ..data import load_texts, token_stream
from ..errors import SurgeryError
from .families import family_for, model_attention_modules, module_value_output

SEQ_LEN = 512
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

    def __init__(self, heads: int, hidden: int):
        self.gram = torch.zeros(heads, heads, dtype=torch.float64)
        self.rows = 0
        self.xtx = torch.zeros(hidden, hidden, dtype=torch.float64)
        self.xsum = torch.zeros(hidden, dtype=torch.float64)
        self.xty = torch.zeros(2, hidden, heads, dtype=torch.float64)  # [output side, value side]
        self.ysum = torch.zeros(2, dtype=torch.float64)
        self.ysq = torch.zeros(2, dtype=torch.float64)
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
        ridge = RIDGE * second.diagonal().mean() * torch.eye(second.shape[0], dtype=second.dtype)
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
        return LayerFit(distance.float(), fits[0], fits[1], r2[0], r2[1])


def _projections(attn: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.nn.Module]:
    """(V (kv*d, D), V bias, O (D, h*d), output module) of a source attention module, as (out, in) matrices."""
    config = attn.config.to_dict()
    return module_value_output(attn, family_for(config), config)


def load_calibration_tokens(folder, calib: str, tokens: int) -> torch.Tensor:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError) as e:
        raise SurgeryError(f"calibration needs the source's tokenizer, which cannot be loaded from {folder}: "
                           f"{str(e).splitlines()[0]}") from None
    return token_stream(load_texts(calib), tokenizer, tokens)


def load_calibration_model(folder):
    """The source as a float32 causal LM with eager attention (which returns the attention probabilities)."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    except (OSError, ValueError) as e:
        raise SurgeryError(f"cannot load the source for calibration: {str(e).splitlines()[0]}") from None


def calibration_windows(model, ids: torch.Tensor, seq_len: int = SEQ_LEN) -> torch.Tensor:
    """`ids` (1-D) cut into windows of `seq_len` (at most the model's context; all of `ids` when shorter)."""
    ctx = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    seq_len = min(seq_len, ctx or seq_len, ids.numel())
    return ids[: ids.numel() // seq_len * seq_len].view(-1, seq_len)


def attention_modules(model, layers: int) -> list[torch.nn.Module]:
    """The source's self-attention modules, by layer."""
    return model_attention_modules(model, family_for(model.config.to_dict()), layers)


def run_windows(model, windows: torch.Tensor, desc: str, progress: bool, hooks: list | None = None) -> None:
    """Run the model over every window; `hooks` (handles of forward hooks) are removed afterwards, whatever happens."""
    from tqdm import tqdm

    try:
        for window in tqdm(windows, desc=desc, unit="window", disable=None if progress else True, leave=False):
            model(input_ids=window[None], use_cache=False)
    finally:
        for handle in hooks or []:
            handle.remove()


@torch.no_grad()
def calibrate(model, windows: torch.Tensor, heads: int, kv_heads: int, head_dim: int, layers: int, hidden: int,
              progress: bool = True) -> list[LayerFit]:
    """Run the source (from `load_calibration_model`) over `windows` and fit every layer; see the module docstring."""
    attns = attention_modules(model, layers)
    stats = [LayerStats(heads, hidden) for _ in range(layers)]
    group = torch.arange(heads) // (heads // kv_heads)  # K/V head of each query head
    handles = []
    for layer, attn in enumerate(attns):
        v_w, v_b, o_w, out_module = _projections(attn)
        o_heads = o_w.detach().float().view(hidden, heads, head_dim)
        o_gram = torch.einsum("Dhd,Dhe->hde", o_heads, o_heads)  # O_m^T O_m: ||O_m u||² = u^T (O_m^T O_m) u
        caught: dict = {}

        def on_input(module, args, kwargs, caught=caught):
            caught["x"] = args[0] if args else kwargs["hidden_states"]

        def on_heads(module, args, caught=caught):
            caught["a"] = args[0]

        def on_output(module, args, kwargs, output, caught=caught, layer=layer, v_w=v_w, v_b=v_b, o_gram=o_gram):
            probs = output[1]
            if probs is None:
                raise SurgeryError("calibration needs attention probabilities (eager attention)")
            x = caught.pop("x").reshape(-1, hidden).float()
            a = caught.pop("a").reshape(-1, heads, head_dim).float()
            values = F.linear(x, v_w, v_b).view(-1, kv_heads, head_dim)[:, group]  # (N, h, d)
            sq = torch.stack([(torch.bmm(u.transpose(0, 1), o_gram) * u.transpose(0, 1)).sum(-1).T for u in (a, values)])
            stats[layer].add(x, probs.float(), 0.5 * sq.clamp(min=1e-12).log())  # log ||O_m u||

        handles += [attn.register_forward_pre_hook(on_input, with_kwargs=True),
                    out_module.register_forward_pre_hook(on_heads),
                    attn.register_forward_hook(on_output, with_kwargs=True)]
    run_windows(model, windows, "calibrate", progress, handles)
    return [s.finish() for s in stats]
