"""Configurations of SwitchHead checkpoints (Csordás et al. 2023, arXiv 2312.07987).

This file travels with converted checkpoints (next to `modeling_switchhead.py`) and needs only `transformers`
(v5). Each class (made on first use, for any architecture) is the source architecture's own configuration under
a new `model_type`, so that plain transformers refuses to load a SwitchHead checkpoint as the source architecture.

The head counts of the configuration describe the converted attention: `num_attention_heads` and
`num_key_value_heads` (Llama family) or `n_head` (GPT-2) are the SwitchHead heads H, and `head_dim` is each head's
width d (kept from the source). The SwitchHead settings live in `config.switchhead` (a dict):

- `heads` (H): attention heads; each has one query and one key projection, so the KV cache holds H heads.
- `experts` (E): value and output projections per head (the experts).
- `topk` (k): experts selected per token and head, on the value side and on the output side separately.
- `head_dim` (d): the width of a head.
- `source_heads`, `source_kv_heads`: the source's query and K/V heads (for the record; not used by the model).
- `bias`: which of q (and k), v and o carry a bias ({"q": bool, "k": bool, "v": bool, "o": bool}).
"""

from __future__ import annotations

import transformers

CLASS_PREFIX = "SwitchHead"


def switchhead_config_class(name: str) -> type:
    """`SwitchHead<transformers config class>` (e.g. SwitchHeadLlamaConfig): that configuration under the model_type
    `switchhead_<model_type>`; made on first use, for any architecture."""
    cls = globals().get(name)
    if isinstance(cls, type):
        return cls
    base = getattr(transformers, name[len(CLASS_PREFIX):], None) if name.startswith(CLASS_PREFIX) else None
    if not isinstance(base, type) or not issubclass(base, transformers.PretrainedConfig):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")  # noqa: TRY004 (module __getattr__)
    cls = type(name, (base,), {"model_type": f"switchhead_{base.model_type}", "__module__": __name__})
    globals()[name] = cls
    return cls


def __getattr__(name: str):  # auto_map names a class: make it
    return switchhead_config_class(name)
