"""The API functions' own arguments (those that are not a command's options: paths, flags, lists of reports),
checked before any work, each refused with one line that names it: a notebook's `json_out=123` or
`check_reports="r.json"` is a SurgeryError, never a TypeError from inside nor a string read letter by letter."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import SurgeryError


def describe(value: Any) -> str:
    """A value as a message shows it: short scalars as they are, anything else by its type."""
    if isinstance(value, (str, bytes, int, float, bool)) or value is None:
        text = repr(value)
        return text if len(text) <= 60 else text[:57] + "..."
    return type(value).__name__


def path_argument(value: Any, name: str, function: str, optional: bool = False) -> Path | None:
    """`value` as a Path: a non-empty str or os.PathLike (a result, a TeacherStore); None only when `optional`."""
    if value is None and optional:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise SurgeryError(f"{function}: {name} is a path (a str or a pathlib.Path), not {describe(value)}")
    return Path(value)


def flag_argument(value: Any, name: str, function: str) -> bool:
    """`value` when it is True or False (a string like "no" is not silently true)."""
    if not isinstance(value, bool):
        raise SurgeryError(f"{function}: {name} is True or False, not {describe(value)}")
    return value


def int_argument(value: Any, name: str, function: str, minimum: int | None = None) -> int:
    """`value` when it is an int (not a bool, not text), at least `minimum` when given."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise SurgeryError(f"{function}: {name} is an integer, not {describe(value)}")
    if minimum is not None and value < minimum:
        raise SurgeryError(f"{function}: {name} must be at least {minimum}, got {value}")
    return value


def list_argument(value: Any, name: str, function: str) -> list:
    """A list or tuple as a list; a single item (one path, one report) as a list of it, not iterated."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, (str, os.PathLike)) or hasattr(value, "to_dict"):
        return [value]
    raise SurgeryError(f"{function}: {name} is a list, not {describe(value)}")


def tokenizer_argument(tokenizer: Any, source: Any, function: str) -> None:
    """A tokenizer goes with a loaded model only (a folder, a hub id or a result has its own) and is one."""
    if tokenizer is None:
        return
    from .sources import is_model

    if not is_model(source):
        raise SurgeryError(f"{function}: tokenizer goes with a loaded model; {describe(source)} names a checkpoint "
                           "that has its own")
    if not (hasattr(tokenizer, "save_pretrained") and callable(tokenizer)):
        raise SurgeryError(f"{function}: tokenizer is a transformers tokenizer, not {describe(tokenizer)}")
