"""Attention surgery on pretrained Hugging Face checkpoints.

    import surgery

    result = surgery.convert("smollm2", "smollm2-gqa", to="gqa", kv_heads=1)
    report = surgery.check("smollm2", result, tokens=4096)

The functions (`convert`, `check`, `inspect`, `uptrain`, `teacher`, `push`, `run_recipe`) and their result types live in
surgery.api and are loaded on first use: `import surgery` imports neither torch nor transformers.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from .errors import SurgeryError

__version__ = "0.1.0"

_API = ("check", "convert", "inspect", "model_card", "push", "run_recipe", "teacher", "uptrain", "CheckReport",
        "ConversionResult", "Estimate", "InspectReport", "PushResult", "RecipePlan", "RecipeResult", "TeacherStore",
        "UptrainResult")

__all__ = ["SurgeryError", "__version__", *_API]

if TYPE_CHECKING:  # for type checkers and editors; at run time __getattr__ loads them
    from .api import (CheckReport, ConversionResult, Estimate, InspectReport, PushResult, RecipePlan, RecipeResult,
                      TeacherStore, UptrainResult, check, convert, inspect, model_card, push, run_recipe, teacher,
                      uptrain)


def __getattr__(name: str) -> Any:
    """`surgery.convert` and the other API names, imported from surgery.api when first asked for (the package root
    sits below everything in the layering; importlib keeps this one lazy reference out of its import graph)."""
    if name in _API:
        return getattr(importlib.import_module("surgery.api"), name)
    raise AttributeError(f"module 'surgery' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


def _api_property(name: str) -> property:
    def get(self) -> Any:
        return getattr(importlib.import_module("surgery.api"), name)

    def set_(self, value: Any) -> None:
        """Ignored: importing the submodule of the same name binds it here; it stays in sys.modules (reach it with
        `from surgery.check import compare`, not `import surgery.check.compare as m`)."""

    return property(get, set_, doc=f"surgery.api.{name}")


class _Package(types.ModuleType):
    """`surgery.check`, `surgery.inspect` and `surgery.uptrain` are the API's functions although submodules of the
    same names exist (surgery/check, surgery/inspect.py, surgery/uptrain): an attribute of the module class wins over
    the import system's binding."""

    check = _api_property("check")
    inspect = _api_property("inspect")
    uptrain = _api_property("uptrain")


sys.modules[__name__].__class__ = _Package
