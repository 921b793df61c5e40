"""The model_type prefix each kind gives the configs it converts (filled by surgery.kinds.register), and the source
family's model_type of a converted checkpoint. Kept apart from surgery.arch so the command line starts without
reading the families."""

from __future__ import annotations

CONVERTED_PREFIXES: dict[str, str] = {}  # kind name -> prefix of its converted configs' model_type


def source_model_type(model_type: str) -> str:
    """A converted checkpoint's model_type without its kind's prefix (the source family's)."""
    for prefix in CONVERTED_PREFIXES.values():
        model_type = model_type.removeprefix(prefix)
    return model_type
