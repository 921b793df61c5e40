"""SwitchHead attention (Csordás et al. 2023, arXiv 2312.07987) on top of transformers' own model classes.

This file travels with converted checkpoints (loaded with `trust_remote_code=True`) and needs only torch and
transformers (v5). The models are the source architecture's own transformers classes (`SwitchHead<class>`, e.g.
SwitchHeadLlamaForCausalLM, made on first use for any architecture) with every self-attention module replaced by
`SwitchHeadAttention`:

- H heads, each with one query and one key projection (`q_proj`, `k_proj`; per-head q/k norms, logit softcaps,
  sliding windows, partial rotary and layers without RoPE are kept as the source has them);
- E value experts and E output experts per head (`v_experts.weight` (H, E, d, D), `o_experts.weight`
  (H, E, D, d)), selected per token by two non-competitive σ-MoE routers (`v_router` on the token that is
  attended to, `o_router` on the token that attends): scores s = sigmoid(W_r x), the top-k experts per head are
  selected and weighted by their score, nothing is normalised and no load-balancing loss is needed:

      v_h(x)  = Σ_{e ∈ topk(s_v,h(x))} s_v,h,e(x) · V_h,e x              (stored in the KV cache: H heads)
      a_h     = attention(q_h, k_h, v_h)                                 (one attention map per head)
      y(x)    = Σ_h Σ_{e ∈ topk(s_o,h(x))} s_o,h,e(x) · O_h,e a_h(x) + b_o

For a few tokens (decode) every expert is computed in one matmul and the gates weigh them (zero for the unselected);
for many (prefill) only the selected experts are: the (token, head, slot) assignments are sorted by expert on the
device, each expert's rows padded to whole blocks, and one batched matmul multiplies every block by its expert's
weight (`expert_blocks`, `grouped_matmul`), with no host sync, no data-dependent shape and no Python loop over the
experts; each token's k slots are then added in a fixed order (deterministic, no atomics). With k = E every expert
is selected and one dense matmul does the same work.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import initialization as hf_init
from transformers.cache_utils import EncoderDecoderCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_switchhead import switchhead_config_class

CLASS_PREFIX = "SwitchHead"
QK_NORM_NAMES = (("q_norm", "k_norm"), ("q_layernorm", "k_layernorm"))
CACHE_KWARGS = ("cache", "past_key_values", "layer_past")  # the names decoder layers give their KV cache


def self_attention_modules(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, name, module) for the self-attention modules of any transformers model: the innermost modules whose
    class is an *Attention (LlamaAttention, GPT2Attention, ...), cross-attention left out."""
    found = []
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if not type(child).__name__.endswith("Attention") or getattr(child, "is_cross_attention", False):
                continue
            if not any(type(c).__name__.endswith("Attention") for c in child.modules() if c is not child):
                found.append((parent, name, child))
    return found


_PROJECTIONS = {"q": ("q_proj", "qkv_proj", "query_key_value", "c_attn"),
                "v": ("v_proj", "qkv_proj", "query_key_value", "c_attn"), "o": ("o_proj", "dense", "c_proj")}


def _has_bias(base: nn.Module, names: tuple[str, ...]) -> bool:
    module = next((getattr(base, n) for n in names if getattr(base, n, None) is not None), None)
    return getattr(module, "bias", None) is not None


def _uses_rope(base: nn.Module) -> bool:
    """Whether the source layer rotates queries and keys (some families leave some layers without RoPE)."""
    if hasattr(base, "use_rope"):  # SmolLM3's no_rope_layers
        return bool(base.use_rope)
    name = type(base).__name__
    if name.startswith("Cohere2"):  # RoPE on sliding-window layers only
        return base.sliding_window is not None
    if name.startswith("Exaone4"):  # global layers without RoPE when sliding windows are used
        return base.sliding_window is None or base.is_sliding
    return True


def _sliding_window(base: nn.Module, config) -> int | None:
    window = base.sliding_window if hasattr(base, "sliding_window") else getattr(config, "sliding_window", None)
    return None if getattr(base, "is_sliding", True) is False else window


def switchhead_settings(config) -> dict:
    """heads H, experts E, topk k and head_dim d of a SwitchHead config, checked."""
    raw = dict(getattr(config, "switchhead", None) or {})
    try:
        s = {key: int(raw[key]) for key in ("heads", "experts", "topk", "head_dim")}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"config.switchhead must give heads, experts, topk and head_dim ({e})") from None
    if min(s.values()) < 1 or s["topk"] > s["experts"]:
        raise ValueError(f"config.switchhead needs positive counts and topk <= experts, got {raw}")
    if isinstance(raw.get("bias"), dict):
        s["bias"] = {k: bool(v) for k, v in raw["bias"].items()}
    return s


# --- routing and experts -----------------------------------------------------------------------------------------
class SigmaMoERouter(nn.Module):
    """One side's σ-MoE router: sigmoid scores of E experts for each of H heads, top-k selection."""

    def __init__(self, hidden_size: int, heads: int, experts: int, topk: int):
        super().__init__()
        self.heads, self.experts, self.topk = heads, experts, topk
        self.weight = nn.Parameter(torch.empty(heads * experts, hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (N, D) -> gates (N, H, k) and expert indices (N, H, k); indices None when every expert is selected."""
        logits = F.linear(x, self.weight).view(x.shape[0], self.heads, self.experts)
        return select_experts(logits, self.topk)

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        hf_init.normal_(self.weight, mean=0.0, std=std)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, experts={self.experts}, topk={self.topk}"


def select_experts(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Router logits (N, H, E) -> gates sigmoid(logit) of the top-k experts and their indices (None: all selected).
    The sigmoid is monotonic, so the top-k logits are the top-k scores and only k sigmoids are computed."""
    if topk >= logits.shape[-1]:
        return torch.sigmoid(logits), None
    top, index = logits.topk(topk, dim=-1, sorted=False)
    return torch.sigmoid(top), index


class SwitchHeadExperts(nn.Module):
    """E linear maps per head: weight (H, E, out, in), optional bias (H, E, out)."""

    def __init__(self, heads: int, experts: int, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(heads, experts, out_features, in_features))
        self.bias = nn.Parameter(torch.empty(heads, experts, out_features)) if bias else None

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        hf_init.normal_(self.weight, mean=0.0, std=std)
        if self.bias is not None:
            hf_init.zeros_(self.bias)

    def extra_repr(self) -> str:
        h, e, o, i = self.weight.shape
        return f"heads={h}, experts={e}, in_features={i}, out_features={o}, bias={self.bias is not None}"


# Up to this many tokens per call (decode steps, small batches, short prompts) every expert of every head is computed
# and the gates weigh them, zero for the experts a token did not select: one matmul on each side that reads each
# weight once, in place. It multiplies E/k times the selected experts' MACs, which costs less at these sizes than the
# alternatives, measured on SmolLM2's shapes on one CPU thread: gathering the selected experts' weights per token
# copies k/E of every weight per token (1.6x the dense step at 1 token, 4x at 8 tokens), and sorting the
# assignments by expert (the grouped GEMM below) costs a dispatch per call (measured with the loop over the H*E
# experts it then had: 2x at 8 tokens, 1.2x at 128). Above it (prefill) each expert multiplies only the rows routed
# to it, padded to whole blocks (cost ∝ k, plus under one block per expert).
DENSE_TOKENS = 128


def dense_gates(gates: torch.Tensor, index: torch.Tensor | None, experts: int) -> torch.Tensor:
    """Gates (N, H, k) of the experts `index` (N, H, k) names -> (N, H, E) with zeros for the unselected."""
    if index is None:  # k = E: every expert selected, in order
        return gates
    return gates.new_zeros(*gates.shape[:2], experts).scatter(2, index, gates)


def flat_expert_index(index: torch.Tensor, experts: int) -> torch.Tensor:
    """(N, H, k) expert numbers per head -> (N, H, k) numbers h*E+e among all H*E experts."""
    heads = index.shape[1]
    key = (heads, experts, index.device)
    offsets = _EXPERT_OFFSETS.get(key)
    if offsets is None:  # made once: an arange per call is a measurable part of a decode step
        offsets = _EXPERT_OFFSETS[key] = torch.arange(0, heads * experts, experts, device=index.device).view(1, heads, 1)
    return index + offsets


_EXPERT_OFFSETS: dict = {}


def expert_block_rows(assignments: int, groups: int) -> int:
    """Rows of one block of the grouped matmul: a power of two from 16 to 1024, small enough that the padding (under
    one block per expert) stays near a quarter of the `assignments` rows or less, large enough for a fast matmul."""
    rows = 16
    while rows < 1024 and 8 * rows * groups <= assignments:
        rows *= 2
    return rows


def expert_blocks(index: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Lay the M = N*H*k (token, head, slot) assignments of `index` (N, H, k) out for one batched matmul, on the
    device and without reading anything on the host (no sync, no data-dependent shape).

    The assignments are sorted by expert h*E+e and each expert's rows are padded to whole blocks of `rows` rows;
    there are at most ceil(M / rows) + H*E blocks (a number known from the shapes alone), each of one expert.
    Returns, for each assignment in (N, H, k) order, its row in that layout (M,); for each row of the layout, its
    assignment (M for padding and unused trailing blocks: a zero input whose output is never read); the expert of
    each block; and `rows`."""
    n, heads, k = index.shape
    groups, m = heads * experts, index.numel()
    rows = expert_block_rows(m, groups)
    flat = flat_expert_index(index, experts).reshape(-1)
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    ids = torch.arange(groups, device=flat.device)
    first = torch.searchsorted(by_expert, ids)
    padded = (torch.searchsorted(by_expert, ids, right=True) - first + rows - 1) // rows * rows
    padded_end = padded.cumsum(0)
    row = (padded_end - padded)[by_expert] + torch.arange(m, device=flat.device) - first[by_expert]
    blocks = -(-m // rows) + groups
    assignment = torch.full((blocks * rows,), m, dtype=order.dtype, device=flat.device).index_copy_(0, row, order)
    row = torch.empty_like(row).index_copy_(0, order, row)  # back to (N, H, k) order
    starts = torch.arange(0, blocks * rows, rows, device=flat.device)
    block_expert = torch.searchsorted(padded_end, starts, right=True).clamp_(max=groups - 1)
    return row, assignment, block_expert, rows


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, layout: tuple) -> torch.Tensor:
    """x (M, in) assignment rows, weight (H*E, out, in) -> (M, out): each row times its expert's weight, as one
    batched matmul over the blocks of `expert_blocks` (`layout`), each block with its expert's weight."""
    row, assignment, block_expert, rows = layout
    blocks = block_expert.shape[0]
    # index_select, not [...]: the same gathers, several times faster on CPU
    laid_out = torch.cat([x, x.new_zeros(1, x.shape[1])]).index_select(0, assignment).view(blocks, rows, -1)
    y = torch.bmm(laid_out, weight.index_select(0, block_expert).transpose(1, 2))  # (gathered as stored: fast)
    return y.view(blocks * rows, -1).index_select(0, row)


def expert_values(experts: SwitchHeadExperts, x: torch.Tensor, gates: torch.Tensor,
                  index: torch.Tensor | None) -> torch.Tensor:
    """x (N, D) -> (N, H, d): per token and head, the sum over its selected experts of gate * (V_e x + b_e)."""
    w, b = experts.weight, experts.bias
    heads, n_exp, d, dim = w.shape
    n = x.shape[0]
    if index is None or n <= DENSE_TOKENS:  # every expert in one matmul, weighed by the (zero-padded) gates
        y = F.linear(x, w.reshape(heads * n_exp * d, dim)).view(n, heads, n_exp, d)
        if b is not None:
            y = y + b
        return (y * dense_gates(gates, index, n_exp).unsqueeze(-1).to(y.dtype)).sum(2)
    k = index.shape[-1]
    row, assignment, block_expert, rows = expert_blocks(index, n_exp)
    # each token's row stands for its H*k assignments: the layout reads it by token (assignment // (H*k))
    token = torch.where(assignment < n * heads * k, assignment // (heads * k), n)
    y = grouped_matmul(x, w.reshape(heads * n_exp, d, dim), (row, token, block_expert, rows)).view(n, heads, k, d)
    if b is not None:
        y = y + b.reshape(heads * n_exp, d)[flat_expert_index(index, n_exp)]
    return (y * gates.unsqueeze(-1).to(y.dtype)).sum(2)  # the k slots of each head, added in order


def expert_outputs(experts: SwitchHeadExperts, a: torch.Tensor, gates: torch.Tensor,
                   index: torch.Tensor | None) -> torch.Tensor:
    """a (N, H, d) -> (N, D): the sum over heads and their selected experts of gate * O_e a_h."""
    w = experts.weight
    heads, n_exp, dim, d = w.shape
    n = a.shape[0]
    if index is None or n <= DENSE_TOKENS:  # every expert, weighed by the (zero-padded) gates
        z = a.unsqueeze(2) * dense_gates(gates, index, n_exp).unsqueeze(-1).to(a.dtype)  # (N, H, E, d)
        if n <= DENSE_TOKENS:  # one batched matmul over the H*E weights where they are, summed
            return torch.bmm(z.reshape(n, heads * n_exp, d).transpose(0, 1),
                             w.reshape(heads * n_exp, dim, d).transpose(1, 2)).sum(0)
        return F.linear(z.reshape(n, heads * n_exp * d), w.permute(2, 0, 1, 3).reshape(dim, heads * n_exp * d))
    k = index.shape[-1]
    gated = a.unsqueeze(2) * gates.unsqueeze(-1).to(a.dtype)  # (N, H, k, d): the gate applied on the small side
    y = grouped_matmul(gated.reshape(n * heads * k, d), w.reshape(heads * n_exp, dim, d), expert_blocks(index, n_exp))
    return y.view(n, heads * k, dim).sum(1)  # every head's k slots, added in order


# --- the attention module ------------------------------------------------------------------------------------------
class SwitchHeadAttention(nn.Module):
    """Replaces one self-attention module; takes scaling, softcap, sliding window and q/k norms from it."""

    def __init__(self, base: nn.Module, config, settings: dict):
        super().__init__()
        heads, n_exp, topk, d = settings["heads"], settings["experts"], settings["topk"], settings["head_dim"]
        dim = config.hidden_size
        self.config = config
        self.layer_idx = base.layer_idx
        self.num_heads, self.num_experts, self.topk, self.head_dim = heads, n_exp, topk, d
        self.num_key_value_groups = 1
        self.is_causal = getattr(base, "is_causal", True)
        bias = settings.get("bias")
        if type(base).__name__ == "GPT2Attention":
            scaling = d**-0.5 if config.scale_attn_weights else 1.0
            if config.scale_attn_by_inverse_layer_idx:
                scaling /= float(self.layer_idx + 1)
            self.scaling, self.attention_dropout = scaling, config.attn_pdrop
        else:
            self.scaling = base.scaling
            dropout = getattr(base, "attention_dropout", getattr(base, "attn_pdrop", 0.0))
            self.attention_dropout = dropout.p if isinstance(dropout, nn.Dropout) else float(dropout or 0.0)
        if bias is None:  # checkpoints written before the converter recorded the biases, and calibration
            bias = {side: _has_bias(base, names) for side, names in _PROJECTIONS.items()}
        qk_bias, v_bias, o_bias = bias["q"], bias["v"], bias["o"]
        dropout = getattr(base, "resid_dropout", None)
        if dropout is None and isinstance(getattr(base, "residual_dropout", None), float):
            dropout = nn.Dropout(base.residual_dropout)
        self.resid_dropout = dropout if isinstance(dropout, nn.Dropout) else None
        self.sliding_window = _sliding_window(base, config)
        self.softcap = getattr(base, "attn_logit_softcapping", None)
        self.use_rope = _uses_rope(base)
        family = sys.modules[type(base).__module__]
        self._eager_attention = family.eager_attention_forward
        self._apply_rotary = getattr(family, "apply_rotary_pos_emb", None)

        self.q_proj = nn.Linear(dim, heads * d, bias=qk_bias)
        self.k_proj = nn.Linear(dim, heads * d, bias=qk_bias)
        # q/k norms per head_dim are kept under the source's names (Phi: q_layernorm)
        self._qk_norm_names = next((n for n in QK_NORM_NAMES if getattr(base, n[0], None) is not None), None)
        if self._qk_norm_names is None:
            self.q_norm = self.k_norm = None
        for name in self._qk_norm_names or ():
            setattr(self, name, getattr(base, name))
        self.v_router = SigmaMoERouter(dim, heads, n_exp, topk)
        self.v_experts = SwitchHeadExperts(heads, n_exp, dim, d, bias=v_bias)
        self.o_router = SigmaMoERouter(dim, heads, n_exp, topk)
        self.o_experts = SwitchHeadExperts(heads, n_exp, d, dim, bias=False)
        self.o_bias = nn.Parameter(torch.empty(dim)) if o_bias else None

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        if self.o_bias is not None:
            hf_init.zeros_(self.o_bias)

    def _router_weight(self) -> torch.Tensor:
        """Both routers' weights stacked; kept between calls while neither changes and no gradient is recorded."""
        v, o = self.v_router.weight, self.o_router.weight
        if torch.is_grad_enabled() and (v.requires_grad or o.requires_grad) or torch.compiler.is_compiling():
            # (compiled: the cache's key, data pointers, would break the graph; the cat is fused there)
            return torch.cat([v, o])
        key = (v.data_ptr(), v._version, o.data_ptr(), o._version, v.dtype, v.device)
        cached = getattr(self, "_router_cache", None)
        if cached is None or cached[0] != key:
            cached = (key, torch.cat([v, o]).detach())
            self._router_cache = cached
        return cached[1]

    def route(self, x: torch.Tensor) -> tuple[tuple, tuple]:
        """Both routers on x (N, D): ((value gates, indices), (output gates, indices)), in one matmul when the two
        select alike (they read the same token: the one that attends is the one whose value is computed)."""
        v, o = self.v_router, self.o_router
        if (v.experts, v.topk) != (o.experts, o.topk) or v.heads != o.heads:
            return v(x), o(x)
        logits = F.linear(x, self._router_weight()).view(x.shape[0], 2 * v.heads, v.experts)
        gates, index = select_experts(logits, v.topk)
        h = v.heads
        if index is None:
            return (gates[:, :h], None), (gates[:, h:], None)
        return (gates[:, :h], index[:, :h]), (gates[:, h:], index[:, h:])

    def attend(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
               past_key_values=None, value_routing=None, **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Everything up to the output experts: the attention output of every head (b*t, H, d), the input
        flattened to (b*t, D) (what the output router reads) and the attention weights (when computed)."""
        b, t, dim = hidden_states.shape
        heads, d = self.num_heads, self.head_dim
        x = hidden_states.reshape(b * t, dim)
        query = self.q_proj(hidden_states).view(b, t, heads, d)
        key = self.k_proj(hidden_states).view(b, t, heads, d)
        if self._qk_norm_names is not None:
            q_norm, k_norm = (getattr(self, name) for name in self._qk_norm_names)
            query, key = q_norm(query), k_norm(key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)
        routing = value_routing if value_routing is not None else self.v_router(x)
        value = expert_values(self.v_experts, x, *routing).view(b, t, heads, d).transpose(1, 2)
        if position_embeddings is not None and self._apply_rotary is not None and self.use_rope:
            cos, sin = position_embeddings
            rot = cos.shape[-1]
            if rot < d:  # partial rotary (Phi, StableLM, GPT-NeoX, GLM): the first `rot` dims of each head
                q_rot, k_rot = self._apply_rotary(query[..., :rot], key[..., :rot], cos, sin)
                query, key = torch.cat([q_rot, query[..., rot:]], -1), torch.cat([k_rot, key[..., rot:]], -1)
            else:
                query, key = self._apply_rotary(query, key, cos, sin)
        # the decoder layer's cache: `cache` (transformers >= 5.24), `past_key_values` (earlier 5.x) or `layer_past`
        # (GPT-NeoX, GPTBigCode); whichever names it, none of them goes on to the attention function
        for name in CACHE_KWARGS:
            passed = kwargs.pop(name, None)
            if past_key_values is None:
                past_key_values = passed
        if isinstance(past_key_values, EncoderDecoderCache):
            past_key_values = past_key_values.self_attention_cache
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)

        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, self._eager_attention)
        extra = {}
        if self.sliding_window is not None:
            extra["sliding_window"] = self.sliding_window
        if self.softcap is not None:
            extra["softcap"] = self.softcap
        out, weights = attention(self, query, key, value, attention_mask,
                                 dropout=self.attention_dropout if self.training else 0.0, scaling=self.scaling,
                                 **extra, **kwargs)
        return out.reshape(b * t, heads, d), x, weights

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                past_key_values=None, **kwargs):
        value_routing, output_routing = self.route(hidden_states.reshape(-1, hidden_states.shape[-1]))
        heads_out, x, weights = self.attend(hidden_states, position_embeddings, attention_mask, past_key_values,
                                            value_routing=value_routing, **kwargs)
        y = expert_outputs(self.o_experts, heads_out, *output_routing)
        if self.o_bias is not None:
            y = y + self.o_bias
        y = y.view(hidden_states.shape)
        if self.resid_dropout is not None:
            y = self.resid_dropout(y)
        return y, weights

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, experts={self.num_experts}, topk={self.topk}, head_dim={self.head_dim}"


SWITCHHEAD_MODULES = (SwitchHeadAttention, SwitchHeadExperts, SigmaMoERouter)


# --- models ------------------------------------------------------------------------------------------------------
def attach_switchhead(model: nn.Module, config) -> None:
    """Replace every self-attention module of `model` by a SwitchHead attention (cross-attention is left alone)."""
    settings = switchhead_settings(config)
    for parent, name, child in self_attention_modules(model):
        setattr(parent, name, SwitchHeadAttention(child, config, settings))


class SwitchHeadMixin:
    """Added in front of a transformers model class: SwitchHead attention in every layer."""

    def post_init(self):
        # The source class's __init__ ends with post_init(), which initialises weights: attach before it runs.
        attach_switchhead(self, self.config)
        super().post_init()

    def _init_std(self) -> float:
        return float(getattr(self.config, "initializer_range", None) or 0.02)

    @torch.no_grad()
    def _init_weights(self, module):
        if isinstance(module, SWITCHHEAD_MODULES):
            module.reset_parameters(self._init_std())
        else:
            super()._init_weights(module)

    @torch.no_grad()
    def initialize_weights(self):
        # The attention modules sit inside a plain sub-model (e.g. LlamaModel in LlamaForCausalLM), whose
        # _init_weights does not know them. transformers' init functions skip every parameter that was loaded from
        # the checkpoint (its _is_hf_initialized flag), so this only initialises parameters the checkpoint lacks.
        super().initialize_weights()
        for module in self.modules():
            if isinstance(module, SWITCHHEAD_MODULES):
                module.reset_parameters(self._init_std())


def switchhead_model_class(name: str) -> type:
    """`SwitchHead<transformers model class>` (e.g. SwitchHeadLlamaForCausalLM): that class with SwitchHead attention
    and the matching SwitchHead configuration; made on first use, for any architecture."""
    cls = globals().get(name)
    if isinstance(cls, type):
        return cls
    base = getattr(transformers, name[len(CLASS_PREFIX):], None) if name.startswith(CLASS_PREFIX) else None
    if not isinstance(base, type) or not issubclass(base, nn.Module):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")  # noqa: TRY004 (module __getattr__)
    config_class = switchhead_config_class(CLASS_PREFIX + base.config_class.__name__)
    cls = type(name, (SwitchHeadMixin, base), {"config_class": config_class, "__module__": __name__})
    _share_weight_conversions(name, base)
    globals()[name] = cls
    return cls


def _share_weight_conversions(name: str, base: type) -> None:
    """transformers renames some families' tensors between checkpoint and memory (MoE experts, GPT-NeoX's embed_out)
    by class name or model_type, and never for custom code: register the source class's renamings for ours."""
    try:
        from transformers.conversion_mapping import (
            USER_REGISTERED_MAPPINGS,
            get_checkpoint_conversion_mapping,
            register_checkpoint_conversion_mapping,
        )
    except ImportError:
        return
    mapping = get_checkpoint_conversion_mapping(base.__name__) or get_checkpoint_conversion_mapping(
        base.config_class.model_type)
    if mapping and name not in USER_REGISTERED_MAPPINGS:
        register_checkpoint_conversion_mapping(name, mapping, overwrite=True)


def __getattr__(name: str):  # auto_map names a class: make it
    return switchhead_model_class(name)
