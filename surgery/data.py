"""Text sources for checks, calibration and training, all read through `datasets` except the embedded default.

`pydoc`: the standard library's pydoc_data.topics (about 100k tokens of English, no download).
`general` (the default of --calib and uptrain --data) and `hf://datasets/REPO@REVISION/FILE`: surgery/general_text.py.
Local files or globs: .txt (one document per file), .jsonl/.json, .parquet, .csv (column --text-field).
Anything else: a hub dataset `name[:config][@split]`, optionally streamed.
"""

from __future__ import annotations

import errno
import glob
import os
import stat
from pathlib import Path
from typing import Iterable, Iterator

import torch

from .errors import SurgeryError

BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def pydoc_texts() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def local_files(spec: str) -> list[str]:
    """The files a local data spec names (a path or a glob, `~` expanded), sorted, each a regular file with its
    symlinks resolved once (the path read later is the target checked now). A FIFO (reading it would block for
    ever), a device, a socket, a folder matched by a glob, a dangling link or a symlink loop is one line. A spec that
    names nothing here gives []."""
    path = os.path.expanduser(spec)
    if any(c in spec for c in "*?["):
        names = sorted(glob.glob(path))
    else:  # a folder of that name is no data file (a hub dataset may share its name)
        names = [path] if os.path.lexists(path) and not os.path.isdir(path) else []
    files = []
    for name in names:
        try:
            mode = os.stat(name).st_mode
        except OSError as e:
            reason = "a symlink loop" if e.errno == errno.ELOOP else e.strerror
            raise SurgeryError(f"data {name}: cannot open it ({reason})") from None
        if not stat.S_ISREG(mode):
            what = ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                    else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
            raise SurgeryError(f"data {name} is {what}; only regular files are read")
        files.append(os.path.realpath(name))
    return files


def parse_hub_spec(spec: str) -> tuple[str, str | None, str]:
    """`name[:config][@split]` -> (name, config, split)."""
    name, _, split = spec.partition("@")
    name, _, config = name.partition(":")
    return name, config or None, split or "train"


def load_texts(spec: str, text_field: str = "text", streaming: bool = False) -> Iterable[str]:
    from .general_text import hub_file_texts, is_hub_file, resolve_text, say_fallback

    spec = resolve_text(spec)  # `general`: the pinned general text, or pydoc offline
    say_fallback(spec)
    if is_hub_file(spec):
        return hub_file_texts(spec, text_field)
    if spec == "pydoc":
        return pydoc_texts()
    pattern = any(c in spec for c in "*?[")  # a hub dataset's name has none of these: a local glob, never online
    files = local_files(spec)
    if files:
        return _local_texts(files, text_field, streaming)
    if pattern:
        where = "" if Path(spec).expanduser().is_absolute() else f" (relative to {Path.cwd()})"
        raise SurgeryError(f"data {spec}: the pattern matches no file{where}")
    if Path(spec).suffix in BUILDERS or spec.startswith((".", "/", "~")):
        raise SurgeryError(f"data {spec} does not exist")
    return _hub_texts(spec, text_field, streaming)


def _local_texts(files: list[str], text_field: str, streaming: bool) -> Iterable[str]:
    suffixes = {Path(f).suffix for f in files}
    if len(suffixes) != 1 or (suffix := suffixes.pop()) not in BUILDERS:
        raise SurgeryError(f"data files must share one of the suffixes {', '.join(BUILDERS)}: got {', '.join(files[:3])}")
    if suffix == ".txt":
        return [Path(f).read_text(errors="replace") for f in files]
    import datasets

    try:
        ds = datasets.load_dataset(BUILDERS[suffix], data_files=files, split="train", streaming=streaming)
    except Exception as e:  # datasets raises many kinds for unreadable files
        raise SurgeryError(f"cannot read data {files[0]}: {str(e).splitlines()[0]}") from None
    return _column(ds, text_field, files[0])


def _hub_texts(spec: str, text_field: str, streaming: bool) -> Iterable[str]:
    import datasets

    name, config, split = parse_hub_spec(spec)
    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=streaming)
    except Exception as e:
        raise SurgeryError(f"cannot load dataset {spec}: {str(e).splitlines()[0]}") from None
    return _column(ds, text_field, spec)


def _column(ds, text_field: str, label: str) -> Iterator[str]:
    columns = ds.column_names or []
    if columns and text_field not in columns:
        raise SurgeryError(f"data {label} has no column {text_field!r} (columns: {', '.join(columns)}); use --text-field")
    return (row[text_field] for row in ds)


def token_stream(texts: Iterable[str], tokenizer, limit: int | None = None, used: list[str] | None = None) -> torch.Tensor:
    """Tokenize documents and join them with EOS between, up to `limit` tokens; `used` collects the documents read."""
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    out: list[int] = []
    for text in texts:
        if not text:
            continue
        out.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if used is not None:
            used.append(text)
        if eos is not None:
            out.append(eos)
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise SurgeryError("the data holds no text")
    return torch.tensor(out[:limit] if limit else out, dtype=torch.long)
