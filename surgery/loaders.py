"""The one way the toolkit parses JSON and YAML it did not write in this run (records, reports, run and recipe state,
tokenizer configs, task YAML, `--set` values): a file nested thousands of levels deep makes the parsers (and any
code walking the value) raise RecursionError, a traceback; here it is one line naming the file, like any bad value.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from .errors import SurgeryError

MAX_DEPTH = 100  # far deeper than any file the toolkit or transformers writes


def nesting_depth(value: Any) -> int:
    """How deep lists and dicts nest in `value` (a scalar: 0), counted without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, depth = todo.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_DEPTH:
            break
        todo.extend((c, depth + 1) for c in children)
    return deepest


def check_depth(value: Any, what: str) -> Any:
    if nesting_depth(value) > MAX_DEPTH:
        raise SurgeryError(f"{what} nests deeper than {MAX_DEPTH} levels")
    return value


def parse_json(text: str | bytes, what: str) -> Any:
    """`text` as JSON; SurgeryError (naming `what`) when it is not JSON or nests deeper than MAX_DEPTH."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise SurgeryError(f"{what} nests deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise SurgeryError(f"{what} is not JSON ({str(e).splitlines()[0][:200]})") from None
    return check_depth(value, what)


def read_json(path: Path, what: str | None = None) -> Any:
    """The JSON file `path` (`what` names it in messages; default: the path)."""
    what = what or str(path)
    try:
        text = Path(path).read_bytes()
    except OSError as e:
        raise SurgeryError(f"{what} cannot be read ({e.strerror or e})") from None
    return parse_json(text, what)


def parse_yaml(text: str, what: str, loader=None) -> Any:
    """`text` as YAML (safe_load, or `loader`); SurgeryError when it does not parse or nests too deeply."""
    import yaml

    try:
        value = yaml.load(text, Loader=loader or yaml.SafeLoader)
    except RecursionError:
        raise SurgeryError(f"{what} nests deeper than {MAX_DEPTH} levels") from None
    except yaml.YAMLError as e:
        raise SurgeryError(f"{what} is not YAML ({str(e).splitlines()[0][:200]})") from None
    return check_depth(value, what)


def validated(model, value: Any, what: str):
    """`value` checked against the pydantic `model` (a file's schema): the model instance, or one line naming the
    file (`what`) and the first field that does not fit."""
    from pydantic import ValidationError

    try:
        return model.model_validate(value)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the top level"
        if first["type"] == "missing":
            raise SurgeryError(f"corrupt {what}: {where} is missing") from None
        shown = repr(first.get("input"))
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        why = re.sub(r" or instance of \w+", "", first["msg"]).lower()
        raise SurgeryError(f"corrupt {what}: {where} is {shown} ({why})") from None


def read_model(path: Path, model, what: str | None = None):
    """The JSON file `path` checked against the pydantic `model`."""
    return validated(model, read_json(path, what), what or str(path))
