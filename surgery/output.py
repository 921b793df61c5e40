"""Write a converted checkpoint folder, atomically: the planned tensors in shards, config.json, the source's side
files (tokenizer, generation config), the modeling code a custom kind carries, and surgery.json — a header naming
the toolkit, the kind and the source (with the sha256 of its shards), the converter's own fields, the sha256 of the
modeling code copied ("code_sha256", see surgery/trust.py) and the sha256 of every file written."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Callable

from . import __version__
from .atomic import atomic_output_dir
from .publish.hashes import record_output_hashes
from .source import Source, copy_side_files
from .tensors import CheckpointReader, PlannedTensor, sha256_files, write_checkpoint
from .threads import threads
from .trust import CODE_RECORD, code_record


def conversion_record(kind: str, source: Source, shard_hashes: dict[str, str]) -> dict:
    """The header of surgery.json; `shard_hashes`: {file name: sha256} of the source's weight files."""
    return {
        "toolkit": "surgery",
        "version": __version__,
        "kind": kind,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": {
            "spec": source.spec,
            "folder": str(Path(source.folder).absolute()),
            "revision": source.revision,
            "gguf_file": source.gguf_file,
            "model_type": source.config.get("model_type"),
            "shards_sha256": shard_hashes,
        },
    }


def write_conversion(source: Source, reader: CheckpointReader, out: Path, planned: list[PlannedTensor],
                     new_config: dict, kind: str, record_fields: Callable[[list[str]], dict], *, force: bool,
                     progress: bool, max_shard_bytes: int, code_dir: Path | None = None,
                     code_files: tuple[str, ...] = ()) -> dict:
    """Write `out` and return its surgery.json record.

    `record_fields(output_files)` gives the converter's fields of the record (after the header); it is called once
    everything but surgery.json is written, with the names of the files written (shards and code files). The
    source's shards are hashed in a thread while the tensors are written; the writing is I/O-bound, so it runs with
    one torch thread (more would only spin against the copy and hash threads)."""
    hashes: dict[str, str] = {}
    hasher = threading.Thread(target=lambda: hashes.update(sha256_files(reader.files)), daemon=True)
    hasher.start()
    with threads(1), reader, atomic_output_dir(out, force=force) as tmp:
        bar = progress_bar(sum(t.nbytes for t in planned), progress)
        files = write_checkpoint(tmp, planned, max_shard_bytes, progress=bar.update)
        bar.close()
        (tmp / "config.json").write_text(json.dumps(new_config, indent=2, sort_keys=True) + "\n")
        for name in code_files:
            shutil.copyfile(Path(code_dir) / name, tmp / name)
        copy_side_files(source.folder, tmp)
        hasher.join()
        record = {**conversion_record(kind, source, hashes), **record_fields(files + list(code_files))}
        if code_files:  # lets surgery.trust recognise the toolkit's own, unmodified modeling code
            record[CODE_RECORD] = code_record(tmp, code_files)
        record_output_hashes(tmp, record)  # writes surgery.json, with the sha256 of every file written
    return record


def progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="convert", disable=None if enabled else True, leave=False)
