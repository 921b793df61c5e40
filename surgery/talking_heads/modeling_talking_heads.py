"""Talking-heads attention (Shazeer et al. 2020, arXiv 2003.02436) on top of transformers' own model classes.

This file travels with converted checkpoints (loaded with `trust_remote_code=True`) and needs only torch and
transformers. The models are the source architecture's own transformers classes (`TalkingHeads<class>`, e.g.
TalkingHeadsLlamaForCausalLM, made on first use for any architecture whose attention goes through transformers'
attention interface) with two changes:

1. every self-attention module gets a `talking_heads` submodule holding the mixing matrices
   `logits_mix` P_l (h_k x h) and `weights_mix` P_w (h x h_v), named like the paper;
2. the model always runs the attention function registered here under the name "talking_heads" (whatever
   `attn_implementation` asks for: fused kernels cannot mix heads), with a boolean mask registered under the same
   name (without it transformers would hand the function no mask at all).

Per query block of `chunk_size` rows, with W = h * d the attention width:

    J = (Q K^T) * scaling        h_k query-key heads of size W / h_k     (b, h_k, c, S)
    L = P_l^T J                  mixed into the h softmax heads          (b, h,   c, S)
    L = softcap(L); L[masked] = min
    A = softmax(L)               in float32
    U = P_w^T A                  mixed into h_v weight heads             (b, h_v, c, S)
    O = U V                      h_v value heads of size W / h_v          (b, h_v, c, W / h_v)

so peak memory is O(h * chunk * S) instead of O(h * T * S). On CPU blocks are sized to stay in cache and keys that
no query of a block may see (the future in causal attention, padding, outside a sliding window) are cut from that
block before any of this; on a GPU blocks are sized by memory (a few per layer) and masked on the device, without
reading the mask on the host (`block_plan`).

Initialization ("overlap"): P_l[j, i] is the number of dims that query-key head j shares with source head i,
divided by the size of head j; P_w[i, j] likewise for value head j. With h_k = h_v = h both are the identity and
the model computes exactly the source's function. With h_k or h_v a multiple of h every new head lies inside one
source head: P_l sums the sub-heads' logits back into the source logit and P_w copies a source head's weights to
each of its value sub-heads, so the model is still exact (to float rounding). With fewer, wider heads each new
head spans several source heads and gets their mean; the model is then no longer the source function.
"""

from __future__ import annotations

import torch
import transformers
from torch import nn
from transformers import initialization as hf_init
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface
from transformers.utils import logging

from .configuration_talking_heads import (
    TALKING_HEADS_DEFAULTS,
    talking_heads_config_class,
)

logger = logging.get_logger(__name__)

ATTN_IMPLEMENTATION = "talking_heads"
CLASS_PREFIX = "TalkingHeads"


def self_attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules of any transformers model: the innermost modules whose class is an *Attention
    (BertSelfAttention inside BertAttention, LlamaAttention, GPT2Attention, ...), cross-attention left out."""
    found = []
    for module in model.modules():
        if not type(module).__name__.endswith("Attention") or getattr(module, "is_cross_attention", False):
            continue
        if not any(type(c).__name__.endswith("Attention") for c in module.modules() if c is not module):
            found.append(module)
    return found


# --- mixing matrices ------------------------------------------------------------------------------------------
def overlap_mixing(heads_in: int, heads_out: int, width: int) -> torch.Tensor:
    """(heads_in, heads_out): how many of the `width` dims head i of one partition shares with head j of another."""
    a, b = width // heads_in, width // heads_out
    start_a = torch.arange(heads_in).unsqueeze(1) * a
    start_b = torch.arange(heads_out).unsqueeze(0) * b
    shared = (torch.minimum(start_a + a, start_b + b) - torch.maximum(start_a, start_b)).clamp(min=0)
    return shared.to(torch.float64)


def initial_logits_mix(heads: int, heads_logits: int, head_dim: int) -> torch.Tensor:
    """P_l (h_k x h): query-key head j feeds softmax head i with weight |j ∩ i| / size(j)."""
    width = heads * head_dim
    return (overlap_mixing(heads_logits, heads, width) / (width // heads_logits)).float()


def initial_weights_mix(heads: int, heads_weights: int, head_dim: int) -> torch.Tensor:
    """P_w (h x h_v): softmax head i feeds value head j with weight |i ∩ j| / size(j)."""
    width = heads * head_dim
    return (overlap_mixing(heads, heads_weights, width) / (width // heads_weights)).float()


def talking_heads_settings(config) -> dict:
    """The talking-heads settings of `config`, with defaults filled in and head counts checked."""
    settings = {**TALKING_HEADS_DEFAULTS, **(getattr(config, "talking_heads", None) or {})}
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    settings["heads"], settings["head_dim"] = heads, head_dim
    for key, on in (("heads_logits", "logits_mixing"), ("heads_weights", "weights_mixing")):
        settings[key] = int(settings[key] or heads)
        if (heads * head_dim) % settings[key]:
            raise ValueError(f"talking_heads.{key}={settings[key]} must divide the attention width {heads * head_dim}")
        if not settings[on] and settings[key] != heads:
            raise ValueError(f"talking_heads.{key}={settings[key]} needs {on}: without it the count is h={heads}")
    return settings


class TalkingHeadsMixing(nn.Module):
    """The mixing matrices of one attention layer and the head re-partitions around them."""

    def __init__(self, settings: dict):
        super().__init__()
        self.heads, self.head_dim = settings["heads"], settings["head_dim"]
        self.heads_logits, self.heads_weights = settings["heads_logits"], settings["heads_weights"]
        self.pair_rotary_dims = bool(settings["pair_rotary_dims"])
        self.chunk_size = int(settings["chunk_size"] or 0)
        self.logits_mix = self.weights_mix = None
        if settings["logits_mixing"]:
            self.logits_mix = nn.Parameter(initial_logits_mix(self.heads, self.heads_logits, self.head_dim))
        if settings["weights_mixing"]:
            self.weights_mix = nn.Parameter(initial_weights_mix(self.heads, self.heads_weights, self.head_dim))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Overlap initialization; parameters loaded from a checkpoint are left alone (their flag is set)."""
        if self.logits_mix is not None:
            hf_init.copy_(self.logits_mix, initial_logits_mix(self.heads, self.heads_logits, self.head_dim))
        if self.weights_mix is not None:
            hf_init.copy_(self.weights_mix, initial_weights_mix(self.heads, self.heads_weights, self.head_dim))

    def query_key_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(b, h, S, d) -> (b, h_k, S, W / h_k)."""
        if self.heads_logits == self.heads:
            return x
        d = x.shape[-1]
        if self.pair_rotary_dims and d % 2 == 0:
            x = x.unflatten(-1, (2, d // 2)).transpose(-1, -2).flatten(-2)
        return _repartition(x, self.heads_logits)

    def value_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(b, h, S, d) -> (b, h_v, S, W / h_v)."""
        return x if self.heads_weights == self.heads else _repartition(x, self.heads_weights)

    def extra_repr(self) -> str:
        return (f"h={self.heads}, h_k={self.heads_logits}, h_v={self.heads_weights}, "
                f"logits_mix={self.logits_mix is not None}, weights_mix={self.weights_mix is not None}, "
                f"chunk_size={self.chunk_size}")


def _repartition(x: torch.Tensor, heads: int) -> torch.Tensor:
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b, s, heads, h * d // heads).transpose(1, 2)


def _mix(x: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """(b, n_in, c, S) mixed over heads by `mix` (n_in x n_out) -> (b, n_out, c, S), one small matmul."""
    b, n_in, c, s = x.shape
    # bmm with the small matrix broadcast over the batch: torch.matmul(2-D, 3-D) would transpose-copy x twice.
    left = mix.t().to(x.dtype).unsqueeze(0).expand(b, -1, -1)
    return torch.bmm(left, x.reshape(b, n_in, c * s)).view(b, mix.shape[1], c, s)


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    b, kv, s, d = x.shape
    if kv == heads:
        return x
    return x[:, :, None].expand(b, kv, heads // kv, s, d).reshape(b, heads, s, d)


def _key_range(mask: torch.Tensor | None, keys: int) -> tuple[int, int, int, int]:
    """For the boolean mask of one query block: the keys [lo, hi) that some query may attend to, and the keys
    [mlo, mhi) inside it that some query may not (only they need masking; mlo == mhi: nothing to mask). Float or no
    masks: all keys, all masked (a float mask is added where it applies)."""
    if mask is None:
        return 0, keys, 0, 0
    if mask.dtype != torch.bool or torch.compiler.is_compiling():  # (compiled: no data-dependent Python ints)
        return 0, keys, 0, keys
    rows = mask.flatten(0, -2)
    if bool(rows.all()):  # every key visible to every query (a decode step without padding): one reduction
        return 0, keys, 0, 0
    visible = rows.any(0).nonzero()
    if visible.numel() == 0:
        return 0, keys, 0, keys
    lo, hi = int(visible[0]), int(visible[-1]) + 1
    partial = (~rows[:, lo:hi].all(0)).nonzero()
    if partial.numel() == 0:
        return lo, hi, lo, lo
    return lo, hi, lo + int(partial[0]), lo + int(partial[-1]) + 1


def _whole_keys(mask: torch.Tensor | None, keys: int) -> tuple[int, int, int, int]:
    """`_key_range` without reading the mask: every key computed, every key masked (none if there is no mask)."""
    return 0, keys, 0, (0 if mask is None else keys)


# Rows of one attention block on CPU: the block's scores (heads x rows x keys) are kept near this many elements, so
# that the passes over them (mixing, masking, softmax, mixing) stay in cache; `chunk_size` remains the upper bound.
BLOCK_ELEMENTS = 2**21
# Elsewhere (CUDA, ...) a block is as large as memory allows: its scores (batch x heads x rows x keys) are kept under
# this many elements (512 MiB in float32; the block's few temporaries of that size come and go), so that a 4k-token
# forward of an 8B model is a few blocks per layer at batch 1; `chunk_size` remains the upper bound.
DEVICE_BLOCK_ELEMENTS = 2**27


def block_plan(device_type: str) -> tuple[int, bool]:
    """How `talking_heads_attention` cuts its work on a device type: (elements of a block's scores, whether a
    block's keys are narrowed by its mask). Narrowing skips the keys that no query of a block may see (the future,
    padding) but reads the mask's values on the host, four times a block: free on CPU, a wait for the whole queue
    on a GPU, where every key is masked on the device instead."""
    if device_type == "cpu":
        return BLOCK_ELEMENTS, True
    return DEVICE_BLOCK_ELEMENTS, False


def _block_rows(plan: tuple[int, bool], batch: int, heads: int, keys: int) -> int:
    elements, narrow = plan
    per_row = heads * max(keys, 1) * (1 if narrow else batch)  # (the CPU's blocks were tuned per sequence)
    return max(1, elements // per_row)


# --- the attention function and its mask -------------------------------------------------------------------------
def talking_heads_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Talking-heads attention over query blocks. query (b, h, T, d); key/value (b, kv, S, d) with kv | h.

    Returns (b, T, h_v, W / h_v), i.e. (b, T, W) once the caller flattens the last two dims, and no weights.
    """
    mixer: TalkingHeadsMixing | None = getattr(module, "talking_heads", None)
    b, h, t, d = query.shape
    keys, kv = key.shape[-2], key.shape[1]
    # Grouped-query attention with the heads as they are: each K/V head serves its group of h / kv query heads in
    # one matmul (no copy of the keys and values for every query head).
    grouped = kv < h and (mixer is None or (mixer.heads_logits == h and mixer.heads_weights == h))
    if not grouped:
        key, value = _repeat_kv(key, h), _repeat_kv(value, h)
    scaling = d**-0.5 if scaling is None else scaling
    if attention_mask is None and getattr(module, "is_causal", False) and t > 1:
        attention_mask = torch.ones(t, keys, dtype=torch.bool, device=query.device).tril(keys - t)[None, None]
    if attention_mask is not None:
        attention_mask = attention_mask[..., :keys]
    logits_mix = weights_mix = None
    chunk = t
    if mixer is not None:
        query, key, value = mixer.query_key_heads(query), mixer.query_key_heads(key), mixer.value_heads(value)
        logits_mix, weights_mix = mixer.logits_mix, mixer.weights_mix
        chunk = mixer.chunk_size or t
    plan = block_plan(query.device.type)
    chunk = max(1, min(chunk, _block_rows(plan, b, max(h, query.shape[1]), keys)))
    heads_v, value_dim = (h if grouped else value.shape[1]), value.shape[-1]
    out = query.new_empty(b, t, heads_v, value_dim)
    for start in range(0, t, chunk):
        stop = min(t, start + chunk)
        mask = None if attention_mask is None else attention_mask[:, :, start:stop]
        lo, hi, mlo, mhi = _key_range(mask, keys) if plan[1] else _whole_keys(mask, keys)
        block = query[:, :, start:stop]
        if grouped:  # (b, h, c, d) -> (b, kv, h/kv * c, d): the query heads of a group share their keys
            block = block.reshape(b, kv, (h // kv) * (stop - start), d)
        # scaled after the product, as the source's eager attention does: the same rounding, so identity mixing
        # reproduces the source to float precision (scaling the queries first drifted BERT's outputs by 8e-5)
        scores = torch.matmul(block, key[:, :, lo:hi].transpose(-1, -2)).mul_(scaling)
        if grouped:
            scores = scores.view(b, h, stop - start, hi - lo)
        if logits_mix is not None:
            scores = _mix(scores, logits_mix)
        if softcap is not None:  # out of place: tanh's backward needs its output
            scores = torch.tanh(scores / softcap) * softcap
        if mhi > mlo:  # only the keys that some query of the block may not see
            part = mask[..., mlo:mhi]
            if part.dtype == torch.bool:
                # the scores' own dtype: under autocast they are bf16 while the query is fp32
                scores[..., mlo - lo : mhi - lo].masked_fill_(~part, torch.finfo(scores.dtype).min)
            else:
                scores[..., mlo - lo : mhi - lo].add_(part)
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        del scores
        if weights_mix is not None:
            weights = _mix(weights, weights_mix)
        weights = nn.functional.dropout(weights, p=dropout, training=module.training)
        if grouped:
            rows = weights.reshape(b, kv, (h // kv) * (stop - start), hi - lo)
            out[:, start:stop] = torch.matmul(rows, value[:, :, lo:hi]).view(b, h, stop - start, -1).transpose(1, 2)
        else:
            out[:, start:stop] = torch.matmul(weights, value[:, :, lo:hi]).transpose(1, 2)
    return out, None


def talking_heads_mask(*args, **kwargs) -> torch.Tensor | None:
    """A boolean (b, 1, q, kv) mask, always materialized for causal attention (None: attend to everything)."""
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(ATTN_IMPLEMENTATION, talking_heads_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, talking_heads_mask)


# --- models ----------------------------------------------------------------------------------------------------
def attach_talking_heads(model: nn.Module, config) -> None:
    """Give every self-attention module of `model` its mixing submodule (cross-attention is left alone)."""
    settings = talking_heads_settings(config)
    for module in self_attention_modules(model):
        if getattr(module, "talking_heads", None) is None:
            module.talking_heads = TalkingHeadsMixing(settings)


class TalkingHeadsMixin:
    """Added in front of a transformers model class: mixing submodules, and talking-heads attention always."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        attach_talking_heads(self, config)

    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        if attn_implementation not in (None, ATTN_IMPLEMENTATION, "eager", "sdpa"):
            logger.warning_once(f"talking-heads attention mixes heads, which {attn_implementation} cannot do: "
                                f"using the {ATTN_IMPLEMENTATION} implementation instead")
        return ATTN_IMPLEMENTATION

    @torch.no_grad()
    def _init_weights(self, module):
        if isinstance(module, TalkingHeadsMixing):
            module.reset_parameters()
        else:
            super()._init_weights(module)

    @torch.no_grad()
    def initialize_weights(self):
        # Mixing modules inside a plain sub-model (e.g. LlamaModel in LlamaForCausalLM) are dispatched to that
        # sub-model's _init_weights, which does not know them: initialize the ones not loaded from a checkpoint here.
        super().initialize_weights()
        for module in self.modules():
            if isinstance(module, TalkingHeadsMixing):
                module.reset_parameters()

    def set_talking_heads_chunk_size(self, chunk_size: int) -> None:
        """Queries per attention block (0: all at once); memory is O(heads * chunk_size * keys)."""
        for module in self.modules():
            if isinstance(module, TalkingHeadsMixing):
                module.chunk_size = int(chunk_size)


def talking_heads_model_class(name: str) -> type:
    """`TalkingHeads<transformers model class>` (e.g. TalkingHeadsLlamaForCausalLM): that class with talking-heads
    attention and the matching talking-heads configuration; made on first use, for any architecture."""
    cls = globals().get(name)
    if isinstance(cls, type):
        return cls
    base = getattr(transformers, name[len(CLASS_PREFIX):], None) if name.startswith(CLASS_PREFIX) else None
    if not isinstance(base, type) or not issubclass(base, nn.Module):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")  # noqa: TRY004 (module __getattr__)
    config_class = talking_heads_config_class(CLASS_PREFIX + base.config_class.__name__)
    cls = type(name, (TalkingHeadsMixin, base), {"config_class": config_class, "__module__": __name__})
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
    return talking_heads_model_class(name)
