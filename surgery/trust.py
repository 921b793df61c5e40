"""The one place that decides whether loading a checkpoint folder may run Python code the folder ships.

A folder "has custom code" when its config.json (or tokenizer_config.json) has an `auto_map`: transformers then
imports the `.py` files it names, with `trust_remote_code=True`. Checkpoints come from strangers, so that code runs
only when the user passed a flag for that very model (`--trust-remote-code`, `--trust-teacher-code`, ...), with one
exception: the toolkit's own outputs (of the kinds that ship modeling code) carry the modeling files this toolkit ships, and
those load without a flag when every file `auto_map` names is byte-for-byte (sha256) the file this version of the
toolkit ships under that name AND the file the folder's surgery.json recorded at conversion ("code_sha256").
One changed byte and the folder is treated like any stranger's.

Nothing here imports, executes or unpickles anything from the folder: it reads JSON and hashes files.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from .checkpoint.sha256 import sha256_file
from .errors import SurgeryError
from .checkpoint.record import CODE_RECORD, read_record_or_empty

PACKAGE = Path(__file__).resolve().parent


def _read_json_object(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):  # a file too deep: refused where it is read
        return {}
    return value if isinstance(value, dict) else {}


def _auto_maps(folder: Path) -> list[dict]:
    folder = Path(folder)
    maps = []
    for name in ("config.json", "tokenizer_config.json"):
        auto_map = _read_json_object(folder / name).get("auto_map")
        if auto_map:
            maps.append(auto_map if isinstance(auto_map, dict) else {"?": auto_map})
    return maps


def has_custom_code(folder) -> bool:
    """The folder's config.json (or tokenizer_config.json) has an `auto_map`: loading it would import its code."""
    return bool(_auto_maps(folder))


def code_references(folder) -> list[str]:
    """The code `auto_map` names: local `.py` file names, and "repo--module" references to other repositories
    (these are kept as they are: they never count as the toolkit's own code)."""
    refs: set[str] = set()
    for auto_map in _auto_maps(folder):
        for value in auto_map.values():
            for ref in value if isinstance(value, (list, tuple)) else [value]:
                if ref is None:
                    continue
                if not isinstance(ref, str) or "." not in ref:
                    refs.add(repr(ref))  # malformed: never matches a shipped file
                elif "--" in ref:
                    refs.add(ref.rsplit(".", 1)[0])
                else:
                    refs.add(ref.rsplit(".", 1)[0].replace(".", "/") + ".py")
    return sorted(refs)


@lru_cache(maxsize=1)
def own_code_hashes() -> dict[str, str]:
    """{file name: sha256} of the modeling/configuration files this version of the toolkit ships: those of every
    kind's package whose outputs carry modeling code (surgery/<package>/modeling_*.py, configuration_*.py)."""
    hashes = {}
    for package in sorted(p for p in PACKAGE.iterdir() if p.is_dir()):
        for pattern in ("configuration_*.py", "modeling_*.py"):
            for path in sorted(package.glob(pattern)):
                hashes[path.name] = sha256_file(path)
    return hashes


def is_own_code(folder) -> bool:
    """Every file `auto_map` names is in the folder, and its sha256 is that of the file of the same name this
    toolkit ships and the one the folder's surgery.json recorded when the toolkit wrote it."""
    folder = Path(folder)
    refs = code_references(folder)
    if not refs:
        return False
    shipped = own_code_hashes()
    recorded = read_record_or_empty(folder).get(CODE_RECORD)
    if not isinstance(recorded, dict):
        return False
    for name in refs:
        path = folder / name
        if name not in shipped or not path.is_file():  # a hub snapshot's symlinked blobs are judged by content
            return False
        actual = sha256_file(path)
        if actual != shipped[name] or recorded.get(name) != actual:
            return False
    return True


def resolve_trust(folder, trusted: bool, flag: str = "--trust-remote-code", what: str | None = None) -> bool:
    """The `trust_remote_code` to load `folder` with.

    False when the folder has no custom code; True when the user passed `flag` for this model, or when the code is
    the toolkit's own (see `is_own_code`); otherwise raise SurgeryError naming the files and the flag to pass."""
    if not has_custom_code(folder):
        return False
    if trusted or is_own_code(folder):
        return True
    files = ", ".join(code_references(folder)) or "auto_map"
    raise SurgeryError(f"{what or folder} ships its own modeling code ({files}); pass {flag} to run it")
