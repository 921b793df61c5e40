"""Text sources for checks, calibration and training, all read through `datasets` except the embedded default.

`pydoc`: the standard library's pydoc_data.topics (about 100k tokens of English, no download).
`stdlib`: the standard library's own Python source, one module file a document (long documents for long-context
checks, no download; which modules depends on the Python version: the report names the ones it used).
`general` (the default of --calib and uptrain --data) and `hf://datasets/REPO@REVISION/FILE`: surgery/general_text.py.
Local files or globs: .txt (one document per file; uptrain: per paragraph, line or file, read lazily), .jsonl/.json, .parquet, .csv (column --text-field,
or a `messages` column of conversations: surgery/chat.py).
Anything else: a hub dataset `name[:config][@split[@revision]]`, optionally streamed; `dataset_commit` resolves the
commit it reads, for the record.
"""

from __future__ import annotations

import errno
import glob
import os
import re
import stat
from pathlib import Path
from typing import Iterable, Iterator

import torch

from .errors import SurgeryError

BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
TXT_UNITS = ("paragraph", "line", "file")  # what one document of a local .txt file is (uptrain's --txt-unit)
MAX_TXT_CHARS = 1 << 20  # a .txt document longer than this (a file with no blank line) is cut into documents of it
PIECE_CHARS = 1 << 15  # a longer document is tokenized in pieces of about this many characters, as they are needed


def txt_documents(path: str, unit: str = "paragraph") -> Iterator[str]:
    """The documents of a local .txt file, read lazily (never the whole file at once): its paragraphs (separated by
    blank lines), its lines, or the whole file as one; any of them longer than MAX_TXT_CHARS cut into documents of
    that many characters, so that memory is bounded whatever the file holds."""
    if unit not in TXT_UNITS:
        raise SurgeryError(f"--txt-unit must be one of {', '.join(TXT_UNITS)}, got {unit!r}")
    parts: list[str] = []
    size = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        while True:
            line = f.readline(MAX_TXT_CHARS)  # a file without newlines comes in bounded pieces too
            if not line:
                break
            if unit == "paragraph" and not line.strip() and line.endswith("\n"):
                if parts:
                    yield "".join(parts)
                parts, size = [], 0
                continue
            parts.append(line)
            size += len(line)
            if (unit == "line" and line.endswith("\n")) or size >= MAX_TXT_CHARS:
                yield "".join(parts)
                parts, size = [], 0
    if parts:
        yield "".join(parts)


def text_pieces(text: str, size: int = PIECE_CHARS) -> Iterator[str]:
    """`text` in consecutive pieces of at most about `size` characters, each cut just before a whitespace where
    there is one (so that a word and the space before it stay together for the tokenizer)."""
    start = 0
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            cut = max(text.rfind(" ", start + 1, end), text.rfind("\n", start + 1, end))
            end = cut if cut > start else end
        yield text[start:end]
        start = end


def encode_pieces(tokenizer, text: str) -> Iterator[list[int]]:
    """The token ids of one document, piece by piece: a document of any length is never tokenized whole (a 50 MB
    line would take gigabytes in the tokenizer); a short one is one piece."""
    for piece in text_pieces(text):
        yield tokenizer(piece, add_special_tokens=False)["input_ids"]


class Document(str):
    """A document's text that also says what it is (`name`: a file name, a module path), for reports that list the
    documents they used; anything that takes a str takes it."""

    name: str

    def __new__(cls, text: str, name: str) -> "Document":
        doc = super().__new__(cls, text)
        doc.name = name
        return doc


STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_files() -> list[Path]:
    """The standard library's .py files (its test suites and installed packages left out: not even walked), sorted
    by path."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in STDLIB_SKIP]
        files += [Path(folder) / n for n in names if n.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def stdlib_texts() -> Iterator[Document]:
    """`stdlib`: each standard-library module's source, one document, named by its path (read lazily)."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    for path in stdlib_files():
        yield Document(path.read_text(encoding="utf-8", errors="replace"), path.relative_to(root).as_posix())


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


def parse_hub_spec(spec: str) -> tuple[str, str | None, str, str | None]:
    """`name[:config][@split[@revision]]` -> (name, config, split, revision); `name@@revision` reads the train split.
    The revision (a branch, tag or commit of the dataset repository) comes after the split: `@split` alone keeps
    the meaning it has always had."""
    name, _, rest = spec.partition("@")
    split, _, revision = rest.partition("@")
    name, _, config = name.partition(":")
    return name, config or None, split or "train", revision or None


COMMIT = re.compile(r"[0-9a-f]{40}")


def hub_dataset_id(spec: str) -> str | None:
    """The hub repository (`owner/name`) a data spec reads: a hub dataset spec's name, or the repository of an
    `hf://datasets/OWNER/NAME@REVISION/PATH` file; None for pydoc, `general` unresolved and local files."""
    from .checkpoint.record import is_local_data
    from .general_text import HUB_FILE

    if spec.startswith(HUB_FILE):
        parts = spec[len(HUB_FILE):].split("/", 2)
        return f"{parts[0]}/{parts[1].partition('@')[0]}" if len(parts) >= 2 and parts[0] else None
    if spec in ("pydoc", "stdlib", "general") or is_local_data(spec):
        return None
    return parse_hub_spec(spec)[0] or None


def dataset_commit(spec: str) -> str | None:
    """The commit of the hub dataset repository `spec` reads (a branch or tag, or no revision, resolved now: what
    the run read, though the branch moves later); None for anything not on the hub, or offline (HF_HUB_OFFLINE, or
    the hub not answering: then nothing says which commit `datasets` read from its cache)."""
    from .general_text import HUB_FILE, PROBE_SECONDS, hub_offline

    name = hub_dataset_id(spec)
    if name is None:
        return None
    if spec.startswith(HUB_FILE):
        revision = spec[len(HUB_FILE):].split("/", 2)[1].partition("@")[2] or None
    else:
        revision = parse_hub_spec(spec)[3]
    if revision is not None and COMMIT.fullmatch(revision):
        return revision
    if hub_offline():
        return None
    from huggingface_hub import HfApi

    try:
        return HfApi().dataset_info(name, revision=revision, timeout=PROBE_SECONDS).sha
    except Exception:  # noqa: BLE001 - unreachable, refused, not found: the record then says it is not known
        return None


def dataset_commits(specs) -> dict[str, str | None]:
    """{spec: its commit} for each hub dataset among `specs` (a mixture's " + "-joined parts each); {} when none."""
    parts = [p for spec in specs if isinstance(spec, str) for p in spec.split(" + ")]
    return {p: dataset_commit(p) for p in dict.fromkeys(parts) if hub_dataset_id(p) is not None}


def load_texts(spec: str, text_field: str = "text", streaming: bool = False,
               txt_unit: str | None = None, chat=None) -> Iterable[str]:
    """The documents of a text spec; a local .txt file's are its `txt_unit`s read lazily (txt_documents), or, when
    None (calibration and `check`, whose records hash whole files), each file whole. A tabular source's `messages`
    column is read as `chat` (a surgery.chat.ChatFormat; None: contents joined, when there is no text column)
    renders it."""
    from .general_text import hub_file_texts, is_hub_file, resolve_text, say_fallback

    spec = resolve_text(spec)  # `general`: the pinned general text, or pydoc offline
    say_fallback(spec)
    if is_hub_file(spec):
        return hub_file_texts(spec, text_field)
    if spec == "pydoc":
        return pydoc_texts()
    if spec == "stdlib":
        return stdlib_texts()
    pattern = any(c in spec for c in "*?[")  # a hub dataset's name has none of these: a local glob, never online
    files = local_files(spec)
    if files:
        return _local_texts(files, text_field, streaming, txt_unit, chat)
    if pattern:
        where = "" if Path(spec).expanduser().is_absolute() else f" (relative to {Path.cwd()})"
        raise SurgeryError(f"data {spec}: the pattern matches no file{where}")
    if Path(spec).suffix in BUILDERS or spec.startswith((".", "/", "~")):
        raise SurgeryError(f"data {spec} does not exist")
    return _hub_texts(spec, text_field, streaming, chat)


def _local_texts(files: list[str], text_field: str, streaming: bool, txt_unit: str | None = None,
                 chat=None) -> Iterable[str]:
    suffixes = {Path(f).suffix for f in files}
    if len(suffixes) != 1 or (suffix := suffixes.pop()) not in BUILDERS:
        raise SurgeryError(f"data files must share one of the suffixes {', '.join(BUILDERS)}: got {', '.join(files[:3])}")
    if suffix == ".txt":
        if txt_unit is not None:  # read lazily, document by document
            return (doc for f in files for doc in txt_documents(f, txt_unit))
        return [Document(Path(f).read_text(errors="replace"), Path(f).name) for f in files]
    import datasets

    try:
        ds = datasets.load_dataset(BUILDERS[suffix], data_files=files, split="train", streaming=streaming)
    except Exception as e:  # datasets raises many kinds for unreadable files
        raise SurgeryError(f"cannot read data {files[0]}: {str(e).splitlines()[0]}") from None
    return _column(ds, text_field, files[0], chat)


def _hub_texts(spec: str, text_field: str, streaming: bool, chat=None) -> Iterable[str]:
    import datasets

    name, config, split, revision = parse_hub_spec(spec)
    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=streaming, revision=revision)
    except Exception as e:
        raise SurgeryError(f"cannot load dataset {spec}: {str(e).splitlines()[0]}") from None
    return _column(ds, text_field, spec, chat)


def _column(ds, text_field: str, label: str, chat=None) -> Iterator[str]:
    from .chat import MESSAGES, ChatFormat

    chat = chat if chat is not None else ChatFormat("off")
    columns = ds.column_names or []
    if columns and chat.reads_messages(columns, text_field):
        return (chat.render(row[MESSAGES], label) for row in ds)
    if columns and text_field not in columns:
        raise SurgeryError(f"data {label} has no column {text_field!r} (columns: {', '.join(columns)}); use "
                           f"--text-field, or give conversations a {MESSAGES!r} column")
    return (chat.render(row[MESSAGES], label) if not columns and chat.reads_messages(list(row), text_field)
            else row[text_field] for row in ds)


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
