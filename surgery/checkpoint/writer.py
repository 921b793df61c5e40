"""Write a converted checkpoint folder, atomically: the planned tensors in shards, config.json, the source's side
files (tokenizer, generation config), the modeling code a custom kind carries, and surgery.json — a header naming
the toolkit, the kind and the source (with the sha256 of its shards), the output's dtype, the files written and the
conversion's seconds (the envelope every record has), then the converter's own fields, the sha256 of the modeling code
copied ("code_sha256", see surgery/trust.py), where the output runs ("runs_in", surgery/runs_in.py) and
the sha256 of every file written."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

from .atomic import atomic_output_dir
from ..errors import SurgeryError
from ..runs_in import record_for
from .record import CODE_RECORD, code_record, new_record, write_record
from .source import Source, copy_side_files, custom_code_files, public_config, side_files
from .tensors import CheckpointReader, PlannedTensor, sha256_files, write_checkpoint
from ..threads import threads


def write_conversion(source: Source, reader: CheckpointReader, out: Path, planned: list[PlannedTensor],
                     new_config: dict, kind: str, fields: dict, *, dtype: str | None, start: float, force: bool,
                     progress: bool, max_shard_bytes: int, code_dir: Path | None = None,
                     code_files: tuple[str, ...] = ()) -> dict:
    """Write `out` and return its surgery.json record.

    The record is the envelope every conversion's has (the header, `dtype` the output's dtype, None: "auto", the
    files written (shards and code files) and the seconds since `start`, when the conversion began) followed by
    `fields`, the converter's own; then where the output runs, the modeling code's and every file's sha256. The
    source's shards are hashed in a thread while the tensors are written; the writing is I/O-bound, so it runs with
    one torch thread (more would only spin against the copy and hash threads)."""
    code_files = tuple(code_files)
    source_code = custom_code_files(source.folder, new_config, provided=code_files)
    side_files(source.folder)  # a side file linking outside the source is refused before anything is written
    hashes: dict[str, str] = {}
    failed: list[BaseException] = []

    def hash_source() -> None:
        try:
            hashes.update(sha256_files(reader.files))
        except BaseException as e:  # reported by the main thread, not as a thread traceback
            failed.append(e)

    hasher = threading.Thread(target=hash_source, daemon=True)
    with threads(1), reader, atomic_output_dir(out, force=force, source=source.folder) as tmp:
        hasher.start()
        bar = progress_bar(sum(t.nbytes for t in planned), progress)
        files = write_checkpoint(tmp, planned, max_shard_bytes, progress=bar.update)
        bar.close()
        (tmp / "config.json").write_text(json.dumps(public_config(new_config), indent=2, sort_keys=True) + "\n")
        for name in code_files:
            shutil.copyfile(Path(code_dir) / name, tmp / name)
        for name in source_code:  # the source's custom code that the new config's auto_map still names
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(source.folder) / name, tmp / name)
        copy_side_files(source.folder, tmp)
        hasher.join()
        if failed or set(hashes) != {Path(f).name for f in reader.files}:
            why = f": {failed[0]}" if failed else ""
            raise SurgeryError(f"cannot hash the source's weight files{why}")
        code_files = code_files + tuple(source_code)
        record = {**new_record(kind, source, hashes), "dtype": dtype or "auto", "output_files": files + list(code_files),
                  "seconds": round(time.time() - start, 3), **fields}
        runs_in = record_for(kind, new_config.get("model_type"))  # where it runs, and how that is known
        if runs_in:
            record["runs_in"] = runs_in
        if code_files:  # lets surgery.trust recognise the toolkit's own, unmodified modeling code
            record[CODE_RECORD] = code_record(tmp, code_files)
        write_record(tmp, record)  # surgery.json, with the sha256 of every file written: the last file
    return record


def progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    from ..progress import shown

    return tqdm(total=total, unit="B", unit_scale=True, desc="convert", disable=None if enabled and shown() else True,
                leave=False)
