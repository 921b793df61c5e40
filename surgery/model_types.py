"""The model_type prefix the kinds that ship their own modeling code give the configs they convert, and the source
family's model_type of a converted checkpoint. Kept apart from surgery.arch so the command line starts without
reading the families."""

from __future__ import annotations

# kind name -> prefix of its converted configs' model_type (data: each kind's `model_type_prefix` reads it here)
CONVERTED_PREFIXES: dict[str, str] = {"talking-heads": "talking_heads_", "switchhead": "switchhead_"}


def source_model_type(model_type: str) -> str:
    """A converted checkpoint's model_type without its kind's prefix (the source family's)."""
    for prefix in CONVERTED_PREFIXES.values():
        model_type = model_type.removeprefix(prefix)
    return model_type
