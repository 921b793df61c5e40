"""Attention surgery on pretrained Hugging Face checkpoints.

    import surgery

    result = surgery.convert("smollm2", "smollm2-gqa", to="gqa", kv_heads=1)
    report = surgery.check("smollm2", result, tokens=4096)

The functions (`convert`, `check`, `inspect`, `export`, `uptrain`, `snapshot`, `teacher`, `push`, `run_recipe`) and
their result types live in surgery.api and are loaded on first use: `import surgery` imports neither torch nor transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import SurgeryError
from .version import __version__

_API = ("check", "convert", "export", "inspect", "model_card", "push", "run_recipe", "snapshot", "teacher",
        "uptrain", "CheckReport", "ConversionResult", "Estimate", "InspectReport", "PushResult", "RecipePlan",
        "RecipeResult", "TeacherStore", "UptrainResult")

__all__ = ["SurgeryError", "__version__", *_API]

if TYPE_CHECKING:  # for type checkers and editors; at run time __getattr__ loads them
    from .api import (CheckReport, ConversionResult, Estimate, InspectReport, PushResult, RecipePlan, RecipeResult,
                      TeacherStore, UptrainResult, check, convert, export, inspect, model_card, push, run_recipe,
                      snapshot, teacher, uptrain)


def __getattr__(name: str) -> Any:
    """`surgery.convert` and the other API names, imported from surgery.api when first asked for (the package root
    sits below everything in the layering; importlib keeps this one lazy reference out of its import graph)."""
    if name in _API:
        return getattr(importlib.import_module("surgery.api"), name)
    raise AttributeError(f"module 'surgery' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
