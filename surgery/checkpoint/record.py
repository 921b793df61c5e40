"""surgery.json: what a checkpoint records about how it was made, and which part of it is machine-local.

This module owns the file: `new_record` starts a conversion's record, `write_record` writes it as the last file of
an output (with the sha256 of every other file), `read_record` reads and type-checks it, `verify_record` checks a
folder's files against it (before a push). `Record` is its schema: the fields the toolkit reads, typed; kinds add
their own fields (kept as they are).

Everything under the "local" key (absolute source folders, GGUF file paths, the spec as typed when it is a path)
is useful on the machine that wrote the checkpoint: `uptrain` finds its default teacher there, `push` compares
with the source's folder. It is never published: `public_record` drops it wherever it is nested, and names the
texts (`--data`, `--calib`, `--eval-data`, kept as typed for the local checks) by hub id or file name only.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr, ValidationError

from .sha256 import sha256_file
from ..errors import SurgeryError

RECORD_FILE = "surgery.json"
LOCAL_KEY = "local"
CODE_RECORD = "code_sha256"  # {file name: sha256} of the code files a converter copied (surgery/trust.py reads it)
EMBEDDED_NAMES = ("smollm2",)
# Files that may change after a conversion without invalidating it: the record itself and the model card.
UNHASHED = {RECORD_FILE, "README.md"}


class _Part(BaseModel):
    model_config = ConfigDict(extra="allow")


class SourceRecord(_Part):
    """The source a conversion read: as the user named it (public), and the sha256 of its weight files."""

    spec: StrictStr | None = None
    loaded: Literal["hub", "folder", "memory"] | None = None  # a model the API saved: what it was loaded from
    revision: StrictStr | None = None
    commit: StrictStr | None = None  # the hub commit the revision resolved to (None: not from the hub)
    gguf_file: StrictStr | None = None
    model_type: StrictStr | None = None
    shards_sha256: dict[str, StrictStr] | None = None


class CalibrationRecord(_Part):
    """The text a calibrated conversion read (checked against `check`'s evaluation text)."""

    data: StrictStr | None = None
    documents_sha256: list[StrictStr] | None = None
    data_commits: dict[str, StrictStr | None] | None = None  # each hub dataset's commit (None: offline)


Count = Annotated[StrictInt, Field(ge=1)]  # heads, dims, ranks: a positive integer, never text or a bool
Amount = Annotated[StrictInt, Field(ge=0)]


class HeadCounts(_Part):
    """Heads (or K/V heads) before and after a conversion (`inspect`'s distinct K/V heads, the card's row)."""

    before: Count | None = None
    after: Count | None = None


class MLARecord(_Part):
    """An MLA conversion's latent (the card's and `convert`'s summary)."""

    kv_lora_rank: Count | None = None
    full_rank: Count | None = None
    qk_rope_head_dim: Count | None = None
    rope_frequencies: list[Amount] | None = None


class Record(_Part):
    """surgery.json. Every field is optional (a hand-made or older record may lack any); the ones present must have
    these types. Kinds' own fields (`kv_heads`, `switchhead`, ...) are kept as they are."""

    toolkit: StrictStr | None = None
    version: StrictStr | None = None
    kind: StrictStr | None = None
    created: StrictStr | None = None
    source: SourceRecord | None = None
    heads: Count | HeadCounts | None = None  # SwitchHead's: before and after
    head_dim: Count | None = None
    kv_heads: HeadCounts | None = None
    stored_kv_heads: Count | None = None
    mla: MLARecord | None = None
    added_parameters: Amount | None = None
    seconds: Annotated[StrictFloat | StrictInt, Field(ge=0)] | None = None
    mix_macs_per_query_key_per_layer: Amount | None = None
    calibration: CalibrationRecord | None = None
    code_sha256: dict[str, StrictStr] | None = None  # the toolkit's own modeling files copied (surgery/trust.py)
    output_sha256: dict[str, StrictStr] | None = None  # every file written but this one and the card
    runs_in: dict | None = None  # where the output runs, per runtime, and how that is known (surgery/runs_in.py)
    uptraining: dict | None = None
    previous_uptraining: list[dict] | None = None
    local: dict | None = None  # machine-local part, never published


def looks_like_hub_id(spec: str) -> bool:
    return spec.count("/") == 1 and not spec.startswith((".", "/", "~")) and not path_exists(spec)


def path_exists(spec: str) -> bool:
    """Whether `spec` names something on this machine; a text no path can be (a name longer than the file system
    allows, a NUL byte: a report's or record's hostile name) is not one, never an error."""
    try:
        return Path(spec).expanduser().exists()
    except (OSError, ValueError, RuntimeError):
        return False


def public_name(spec: str | None) -> str | None:
    """What may be published of a source as the user named it: a hub id or an embedded name as it is, a local path
    as its last component only."""
    if spec is None or spec in EMBEDDED_NAMES or looks_like_hub_id(spec):
        return spec
    return Path(spec).expanduser().name or spec


def source_name(source) -> str | None:
    """What may be published of a surgery.checkpoint.source.Source's name: for a model the API saved, what it was
    loaded from (a hub id, a folder's name, None when built in memory), never the cache folder; else public_name."""
    lineage = getattr(source, "lineage", None)
    return lineage["spec"] if lineage else public_name(source.spec)


def new_record(kind: str, source, shard_hashes: dict[str, str]) -> dict:
    """The header of a conversion's record; `source` a surgery.checkpoint.source.Source, `shard_hashes` {file name: sha256}
    of its weight files."""
    from ..version import __version__

    lineage = getattr(source, "lineage", None)  # a model the API saved: what it was loaded from, never the cache
    return {
        "toolkit": "surgery",
        "version": __version__,
        "kind": kind,
        "created": now(),
        "source": {
            "spec": source_name(source),
            **({"loaded": lineage["loaded"]} if lineage else {}),
            "revision": source.revision,
            "commit": source.commit,
            "gguf_file": Path(source.gguf_file).name if source.gguf_file else None,
            "model_type": source.config.get("model_type"),
            "shards_sha256": shard_hashes,
        },
        LOCAL_KEY: {
            "source_spec": source.spec,
            "source_folder": str(Path(source.folder).absolute()),
            "gguf_path": str(Path(source.gguf_file).absolute()) if source.gguf_file else None,
        },
    }


def code_record(folder, names) -> dict[str, str]:
    """{name: sha256} of the code files a converter copied into `folder` (for surgery.json's "code_sha256")."""
    return {name: sha256_file(Path(folder) / name) for name in names}


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def check_record(record: object, path: Path | str = RECORD_FILE) -> dict:
    """`record` if it is a JSON object whose known fields have their types, else one clear error naming `path`."""
    if not isinstance(record, dict):
        raise SurgeryError(f"corrupt {path}: not a JSON object")
    try:
        Record.model_validate(record)
    except ValidationError as e:
        first = e.errors()[0]
        where = _where(record, first["loc"])
        raise SurgeryError(f"corrupt {path}: {where} is {first.get('input')!r} ({first['msg'].lower()})") from None
    return record


def _where(record: dict, loc: tuple) -> str:
    """The dotted path of an error's location in the record itself (a union's member names, which pydantic puts in
    the location, left out)."""
    parts, value = [], record
    for p in loc:
        if (isinstance(value, dict) and p in value) or (isinstance(value, list) and isinstance(p, int)
                                                        and 0 <= p < len(value)):
            parts.append(str(p))
            value = value[p]
    return ".".join(parts)


def read_record(folder: Path) -> dict:
    """The folder's surgery.json, {} when it has none; a corrupt or mistyped one is one clear error."""
    from . import validate

    path = Path(folder) / RECORD_FILE
    if not path.exists():
        return {}
    validate.regular_file(path, "record")
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise SurgeryError(f"corrupt {path}: {str(e).splitlines()[0][:200]}") from None
    from ..loaders import check_depth

    return check_record(check_depth(record, f"corrupt {path}:"), path)


def read_record_or_empty(folder: Path) -> dict:
    """The folder's surgery.json, or {} when it has none or it cannot be read: for readers to whom a broken record
    only means "nothing recorded" (trust of the toolkit's own code, the calibration-overlap warning, the source's
    attention in `check`), never an error."""
    try:
        return read_record(folder)
    except (OSError, SurgeryError):
        return {}


def write_record(folder: Path, record: dict) -> dict:
    """Record the sha256 of every file now in `folder` (`output_sha256`) and write `folder`/surgery.json. Call it as
    the last write of an output. Returns the record."""
    folder = Path(folder)
    record["output_sha256"] = sha256_many(folder, hashed_files(folder))
    check_record(record, folder / RECORD_FILE)
    (folder / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record


def verify_record(folder: Path, record: dict, covered=lambda name: True) -> None:
    """One clear error unless every file `record` hashes is in `folder` with that sha256, and every file for which
    `covered(name)` holds is hashed (a weight or code file added after the conversion is refused)."""
    folder = Path(folder)
    recorded = record.get("output_sha256")
    if not isinstance(recorded, dict) or not recorded:
        raise SurgeryError(f"{folder}/{RECORD_FILE} records no sha256 of the output files, so the folder cannot be "
                           "verified (written by a converter that does not record them?)")
    missing = [n for n in recorded if not (folder / n).is_file()]
    if missing:
        raise SurgeryError(f"{missing[0]} is recorded in {RECORD_FILE} but missing from {folder}")
    actual = sha256_many(folder, sorted(recorded))
    changed = [n for n in recorded if actual[n] != recorded[n]]
    if changed:
        raise SurgeryError(f"{changed[0]} does not match the sha256 recorded in {RECORD_FILE}: changed after the "
                           "conversion")
    extra = [n for n in hashed_files(folder) if n not in recorded and covered(n)]
    if extra:
        raise SurgeryError(f"{extra[0]} is not covered by the sha256 recorded in {RECORD_FILE} (added after the "
                           "conversion?)")


def hashed_files(folder: Path) -> list[str]:
    """Every regular file under `folder` (relative POSIX paths) except the record and the card; no hidden files."""
    folder = Path(folder)
    names = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if p.is_file() and rel.as_posix() not in UNHASHED and not any(part.startswith(".") for part in rel.parts):
            if "__pycache__" not in rel.parts:
                names.append(rel.as_posix())
    return names


def sha256_many(folder: Path, names: list[str]) -> dict[str, str]:
    """Hash files in parallel threads (hashlib releases the GIL on large buffers)."""
    with ThreadPoolExecutor(max_workers=min(4, max(1, len(names)))) as pool:
        return dict(zip(names, pool.map(lambda n: sha256_file(Path(folder) / n), names)))


def local_source_folder(record: dict) -> Path | None:
    """The source's folder on this machine, when the record names one that still exists."""
    local = record.get(LOCAL_KEY) or {}
    folder = local.get("source_folder") or (record.get("source") or {}).get("folder")
    return Path(folder) if folder and path_exists(str(Path(folder) / "config.json")) else None


# Files a data spec can name (surgery/data.py reads these suffixes as local files).
LOCAL_DATA_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet", ".csv")
DATA_KEYS = ("data", "eval_data")  # record keys holding a text as the user named it (--data, --calib, --eval-data)
MIXTURE = "mixture: "  # calibration "split" of several texts: "mixture: SPEC: split; SPEC: split"


def is_local_data(spec: str) -> bool:
    """A data spec naming files of this machine (a path, a glob, a file with a data suffix), not `pydoc` or a hub
    dataset `name[:config][@split[@revision]]`; judged by its form, so it holds on a machine where the file is gone."""
    if spec in ("pydoc", "stdlib", "general") or spec.startswith("hf://"):
        return False
    return (spec.startswith(("/", ".", "~")) or any(c in spec for c in "*?[") or spec.count("/") > 1
            or Path(spec).suffix in LOCAL_DATA_SUFFIXES or path_exists(spec))


def public_data(spec: object) -> object:
    """What may be published of a text as the user named it: `pydoc` and hub datasets as they are, local files and
    globs as their last component (a mixture's " + "-joined parts each alike). Anything but a string is kept."""
    if not isinstance(spec, str):
        return spec
    parts = spec.split(" + ")
    return " + ".join(Path(p).expanduser().name or p if is_local_data(p) else p for p in parts)


def _public_split(split: str) -> str:
    if not split.startswith(MIXTURE):
        return split
    parts = [p.rpartition(": ") for p in split[len(MIXTURE):].split("; ")]
    return MIXTURE + "; ".join(f"{public_data(spec)}{sep}{rest}" for spec, sep, rest in parts)


# A place on this machine inside any text: an absolute POSIX or Windows path or a home-relative one (a URL's
# `scheme://host/...` is not one: its slashes follow a colon or a slash).
LOCAL_PATH = re.compile(r"(?<![\w.:/\\~-])(?:~[^\s'\"]*|[A-Za-z]:[\\/][^\s'\"]*|/[^\s'\"]+)")


def public_text(text: str) -> str:
    """`text` with every place on this machine in it (an absolute or home-relative path, the home folder's path
    anywhere in it) reduced to its last component: what the public record allows of a text no rule above names."""
    text = text.replace(str(Path.home()), "~") if len(str(Path.home())) > 1 else text
    return LOCAL_PATH.sub(lambda m: Path(m.group(0).rstrip("/\\").replace("\\", "/")).name or "~", text)


def _public(value, key: str | None = None):
    if isinstance(value, dict):
        return {public_text(str(k)): _public(v, k) for k, v in value.items() if k != LOCAL_KEY}
    if isinstance(value, list):
        return [_public(v, key) for v in value]
    if isinstance(value, str):
        if key in DATA_KEYS:
            value = public_data(value)
        elif key == "spec":
            value = public_name(value)
        elif key == "split":
            value = _public_split(value)
        return public_text(value)  # whatever the key: no text of the public record names a place on this machine
    return value


def public_record(record: dict) -> dict:
    """The record as `push` uploads it: every machine-local part dropped, at any depth (the conversion's, each
    uptraining's, the ones nested by later uptrainings in `previous_uptraining`), and every text (`data`,
    `eval_data`, a calibration mixture's parts) and source (`spec`) named as `public_data` / `public_name` allow; and
    every other text of it (any key, at any depth, the keys too) as `public_text` allows: no absolute or
    home-relative path and no home folder name, whatever field a later version adds (a stored teacher's `folder`)."""
    return _public(record)
