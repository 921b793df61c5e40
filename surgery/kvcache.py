"""The keyword a model's forward takes its KV cache by, and the cache a forward returns: transformers 5.24 renamed
`past_key_values` to `cache` (the old name still works, with a warning, until 5.40); earlier 5.x know only the old
name."""

from __future__ import annotations

import inspect


def cache_keyword(model) -> str:
    """`cache` where the model's class takes it, else `past_key_values` (the class's forward: a compiled instance
    forward hides its signature)."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def returned_cache(output):
    """The KV cache a forward with use_cache=True returned, under either name."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values
