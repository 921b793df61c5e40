"""sha256 of the files a conversion wrote, recorded in its surgery.json and checked before publishing.

Converters call `record_output_hashes(tmp)` as the last write into their output folder (it rewrites
surgery.json with an "output_sha256" map); `surgery push` refuses a folder whose files no longer match.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..digest import sha256_file

RECORD = "surgery.json"
# Files that may change after a conversion without invalidating it: the record itself and the model card.
UNHASHED = {RECORD, "README.md"}


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


def record_output_hashes(folder: Path, record: dict | None = None) -> dict:
    """Set record["output_sha256"] = {file: sha256} for the files now in `folder`, and write folder/surgery.json.

    `record` defaults to the folder's surgery.json (a minimal one is started when there is none). Call it after
    the last file of the output is written. Returns the record.
    """
    folder = Path(folder)
    if record is None:
        path = folder / RECORD
        record = json.loads(path.read_text()) if path.exists() else {"toolkit": "surgery"}
    record["output_sha256"] = sha256_many(folder, hashed_files(folder))
    (folder / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return record
