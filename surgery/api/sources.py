"""What a notebook has, turned into what the commands read: a loaded model into a checkpoint folder, a dataset or a
list of documents into a local .jsonl file. Both are written once into the toolkit's cache, named by the sha256 of
their contents, so the same object gives the same path (a check can see that its text calibrated the model; a
resumed training run finds its data again) and the folder a conversion records as its source still exists when
uptraining looks for its teacher."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator

from ..checkpoint.source import LINEAGE_FILE
from ..errors import SurgeryError
from .lineage import model_lineage

CHARS_PER_TOKEN = 32  # a dataset object is written up to this many characters per token needed: no tokenizer's
# tokens average that many characters on text (English averages about 4), so the token limits are what cut it
CHAT_COLUMN = "messages"  # kept beside the text column when a dataset has it (chat data)


def cache_dir() -> Path:
    from ..checkpoint.source import CACHE_DIR

    return Path(CACHE_DIR)


def _digest_folder(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(path.relative_to(folder).as_posix().encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def is_model(obj: Any) -> bool:
    """A loaded transformers model (checked by duck type: importing transformers to ask would cost seconds)."""
    return hasattr(obj, "save_pretrained") and hasattr(obj, "config") and hasattr(obj, "state_dict")


def model_folder(model: Any, tokenizer: Any = None) -> str:
    """`model` (and `tokenizer`) saved with `save_pretrained` (safetensors) into the cache, with its lineage
    (LINEAGE_FILE), under the sha256 of the files written; the folder's path. Without a tokenizer, the one of the
    folder the model was loaded from, when that is a local folder that has one."""
    root = cache_dir() / "loaded"
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".saving-", dir=root))
    try:
        try:
            model.save_pretrained(tmp)
        except Exception as e:  # noqa: BLE001 - a model (or its remote code) whose save fails: one line
            why = str(e).splitlines()[0] if str(e) else ""
            raise SurgeryError(f"saving the loaded {type(model).__name__} with save_pretrained failed: "
                               f"{type(e).__name__}{': ' + why if why else ''}") from None
        if tokenizer is None:
            tokenizer = _tokenizer_beside(model)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / LINEAGE_FILE).write_text(json.dumps(model_lineage(model)) + "\n")
        final = root / _digest_folder(tmp)[:16]
        if final.is_dir():
            shutil.rmtree(tmp)  # the same model was saved before
        else:
            os.rename(tmp, final)
        return str(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _tokenizer_folder(model: Any) -> Path | None:
    """The local folder the model was loaded from, when it has a tokenizer."""
    name = str(getattr(model, "name_or_path", "") or "")
    folder = Path(name)
    if not name or not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return folder


def _tokenizer_beside(model: Any):
    folder = _tokenizer_folder(model)
    if folder is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def source_spec(source: Any, tokenizer: Any = None, needs_tokenizer: str | None = None) -> str:
    """A source as the commands take it: a path or hub id as it is, a result's folder, or a loaded model saved into
    the cache (`model_folder`). `needs_tokenizer`: the function, when it reads text with the model's tokenizer (a
    loaded model with none given and none beside it is refused, naming `tokenizer=`, before anything is saved)."""
    if isinstance(source, (str, os.PathLike)):
        return os.fspath(source)
    folder = getattr(source, "folder", None)  # a ConversionResult or an UptrainResult
    if isinstance(folder, Path):
        return str(folder)
    if is_model(source):
        if needs_tokenizer and tokenizer is None and _tokenizer_folder(source) is None:
            raise SurgeryError(f"{needs_tokenizer}: the loaded {type(source).__name__} comes with no tokenizer (it was "
                               f"not loaded from a local folder that has one): pass tokenizer=... (e.g. "
                               f"AutoTokenizer.from_pretrained of its checkpoint)")
        return model_folder(source, tokenizer)
    raise SurgeryError(f"a source is a folder, a hub id, a .gguf file or a loaded model, not {type(source).__name__}")


# ---- text data ---------------------------------------------------------------------------------------------------
def text_specs(value: Any, text_field: str, tokens: int) -> list[str] | Any:
    """A data option's value as text specs: a spec string as it is; a list of strings (documents), a list of dicts
    (rows) or a datasets Dataset / IterableDataset written into a .jsonl file (`data_file`); a tuple: several
    sources, each in any of these forms (a mixture, as `--calib A --calib B`). Anything else is left for the
    options' own validation to refuse."""
    if isinstance(value, tuple):
        return [one for v in value for one in _as_list(text_specs(v, text_field, tokens))]
    if isinstance(value, (str, os.PathLike)):
        return [os.fspath(value)]
    if isinstance(value, list) or _is_dataset(value) or _is_iterator(value):
        return [data_file(value, text_field, tokens)]
    return value


def _is_iterator(value: Any) -> bool:
    """A generator (or any other iterator) of documents or rows: read as a list is, up to the tokens needed (never
    taken for a list of specs, each a hub dataset's name)."""
    return hasattr(value, "__next__") and hasattr(value, "__iter__") and not isinstance(value, (str, bytes))


def text_spec(value: Any, text_field: str, tokens: int) -> str | Any:
    """A single-text option's value (uptrain's eval_data) as one spec."""
    if value is None or isinstance(value, str):
        return value
    specs = text_specs(value, text_field, tokens)
    if isinstance(specs, list) and len(specs) == 1:
        return specs[0]
    raise SurgeryError("eval_data takes one text (a spec, a list of documents or a dataset), not several")


def _as_list(v) -> list:
    return v if isinstance(v, list) else [v]


def _is_dataset(value: Any) -> bool:
    return type(value).__module__.startswith("datasets.") and hasattr(value, "column_names")


def _rows(value: Any, text_field: str) -> Iterator[dict]:
    if isinstance(value, list) or _is_iterator(value):
        what = "list" if isinstance(value, list) else type(value).__name__
        for i, row in enumerate(value):
            if isinstance(row, str):
                yield {text_field: row}
            elif isinstance(row, dict):
                if text_field not in row and CHAT_COLUMN not in row:
                    raise SurgeryError(f"data: row {i} of the {what} has no {text_field!r} (a document) nor "
                                       f"{CHAT_COLUMN!r} (a chat); its keys: {', '.join(map(str, row)) or 'none'}")
                yield _text_row(row, text_field, i)
            else:
                raise SurgeryError(f"data: item {i} of the {what} is a {type(row).__name__}, not a string (a document) "
                                   "or a dict (a row)")
        return
    columns = list(value.column_names or [])
    keep = [c for c in (text_field, CHAT_COLUMN) if c in columns]
    if columns and not keep:
        raise SurgeryError(f"data {type(value).__name__} has no column {text_field!r} (columns: {', '.join(columns)});"
                           " use text_field")
    for i, row in enumerate(value):
        yield _text_row({c: row[c] for c in keep} if keep else row, text_field, i)


def _text_row(row: dict, text_field: str, i: int) -> dict:
    """A row whose document (`text_field`, when it is the column read) is text: a number or a list there is refused
    in one line (it was a TypeError from inside the tokenizer)."""
    if CHAT_COLUMN not in row and text_field in row and not isinstance(row[text_field], str):
        raise SurgeryError(f"data: row {i}'s {text_field!r} is not text but {type(row[text_field]).__name__}; use "
                           f"text_field to name the column that holds the text")
    return row


def data_file(value: Iterable, text_field: str, tokens: int) -> str:
    """Rows of `value` written as JSON lines into the cache, named by their sha256 (the same data, the same file),
    until CHARS_PER_TOKEN x `tokens` characters are written (a streamed dataset is read no further than that).
    Token limits and windows then apply as to any local .jsonl file."""
    root = cache_dir() / "data"
    root.mkdir(parents=True, exist_ok=True)
    budget = max(1, tokens) * CHARS_PER_TOKEN
    h = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=".writing-", suffix=".jsonl", dir=root)
    try:
        written = 0
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in _rows(value, text_field):
                line = json.dumps(row, ensure_ascii=False, default=str) + "\n"
                f.write(line)
                h.update(line.encode("utf-8"))
                written += len(line)
                if written >= budget:
                    break
        if not written:
            raise SurgeryError("the data holds no text")
        final = root / f"{h.hexdigest()[:16]}.jsonl"
        os.replace(tmp, final)
        return str(final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
