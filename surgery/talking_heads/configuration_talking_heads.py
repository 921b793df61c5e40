"""Configurations of talking-heads checkpoints (Shazeer et al. 2020, arXiv 2003.02436).

This file travels with converted checkpoints (next to `modeling_talking_heads.py`) and needs only `transformers`.
Each class (made on first use, for any architecture) is the source architecture's own configuration under
a new `model_type`, so that plain transformers
refuses to load a talking-heads checkpoint as the source architecture (which would silently drop the mixing).

The talking-heads settings live in `config.talking_heads` (a dict):

- `heads` (h), `head_dim` (d): the source's query heads and head size; the attention width is W = h * d.
- `logits_mixing`, `weights_mixing`: whether P_l (before the softmax) and P_w (after it) exist.
- `heads_logits` (h_k): heads of the query-key logits that P_l mixes, each of size W / h_k.
- `heads_weights` (h_v): heads of the mixed weights that multiply the values, each of size W / h_v.
- `pair_rotary_dims`: order each head's dims as rotation pairs (i, i + d/2) before splitting it into
  query-key sub-heads, so that a sub-head of a RoPE model keeps whole pairs (only matters when h_k != h).
- `chunk_size`: queries per block of the attention computation (0: all at once).
"""

from __future__ import annotations

import transformers

TALKING_HEADS_DEFAULTS = {
    "logits_mixing": True,
    "weights_mixing": True,
    "heads_logits": None,  # None: h
    "heads_weights": None,  # None: h
    "pair_rotary_dims": False,
    "chunk_size": 512,
}


CLASS_PREFIX = "TalkingHeads"


def talking_heads_config_class(name: str) -> type:
    """`TalkingHeads<transformers config class>` (e.g. TalkingHeadsLlamaConfig): that configuration under the
    model_type `talking_heads_<model_type>`; made on first use, for any architecture."""
    cls = globals().get(name)
    if isinstance(cls, type):
        return cls
    base = getattr(transformers, name[len(CLASS_PREFIX):], None) if name.startswith(CLASS_PREFIX) else None
    if not isinstance(base, type) or not issubclass(base, transformers.PretrainedConfig):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")  # noqa: TRY004 (module __getattr__)
    cls = type(name, (base,), {"model_type": f"talking_heads_{base.model_type}", "__module__": __name__})
    globals()[name] = cls
    return cls


def __getattr__(name: str):  # auto_map names a class: make it
    return talking_heads_config_class(name)
