"""surgery.json: what a checkpoint records about how it was made, and which part of it is machine-local.

Everything under the "local" key (absolute source folders, GGUF file paths, the spec as typed when it is a path)
is useful on the machine that wrote the checkpoint: `uptrain` finds its default teacher there, `push` compares
with the source's folder. It is never published: `public_record` drops it, and the other fields hold only hub
ids, file names and hashes.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import SurgeryError

RECORD_FILE = "surgery.json"
LOCAL_KEY = "local"
EMBEDDED_NAMES = ("smollm2",)


def looks_like_hub_id(spec: str) -> bool:
    return spec.count("/") == 1 and not spec.startswith((".", "/", "~")) and not Path(spec).expanduser().exists()


def public_name(spec: str | None) -> str | None:
    """What may be published of a source as the user named it: a hub id or an embedded name as it is, a local path
    as its last component only."""
    if spec is None or spec in EMBEDDED_NAMES or looks_like_hub_id(spec):
        return spec
    return Path(spec).expanduser().name or spec


def read_record(folder: Path) -> dict:
    """The folder's surgery.json, {} when it has none; a corrupt one is one clear error."""
    from . import sanity

    path = Path(folder) / RECORD_FILE
    if not path.exists():
        return {}
    sanity.regular_file(path, "record")
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise SurgeryError(f"corrupt {path}: {str(e).splitlines()[0][:200]}") from None
    if not isinstance(record, dict):
        raise SurgeryError(f"corrupt {path}: not a JSON object")
    return record


def local_source_folder(record: dict) -> Path | None:
    """The source's folder on this machine, when the record names one that still exists."""
    local = record.get(LOCAL_KEY) or {}
    folder = local.get("source_folder") or (record.get("source") or {}).get("folder")
    return Path(folder) if folder and (Path(folder) / "config.json").exists() else None


def public_record(record: dict) -> dict:
    """The record without its machine-local part (what `push` uploads)."""
    out = {k: v for k, v in record.items() if k != LOCAL_KEY}
    uptraining = out.get("uptraining")
    if isinstance(uptraining, dict):
        out["uptraining"] = {k: v for k, v in uptraining.items() if k != LOCAL_KEY}
    return out
