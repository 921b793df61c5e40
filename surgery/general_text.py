"""The text read when the user names none (`--calib`, `uptrain --data`): general web text, decided here once.

`general` resolves, once per process, to one shard of C4 (`allenai/c4`, English, ODC-BY 1.0) at a pinned commit,
streamed from the hub (`hf://datasets/allenai/c4@REVISION/en/c4-train.00000-of-01024.json.gz`: ~356k web documents,
far more than any default token budget reads). Offline (`HF_HUB_OFFLINE=1`, or the hub not answering) it resolves to
the embedded `pydoc` text, with one line on stderr when it is read; then nothing is sent to the network.

Why C4: calibration tools of the field read general text (AutoAWQ pile-val, GPTQ C4 or wikitext2, llm-compressor
ultrachat, TransMLA wikitext2). Of those, C4 is permissively licensed (the Pile's licensing is disputed; wikitext is
CC BY-SA; ultrachat is chat turns, not a text column), streams shard by shard (one 300 MB shard, read from its
start, is all a run touches), and is not the text the field reports perplexity on (wikitext2 is: calibrating on it
would flatter those numbers).

`hf://datasets/REPO@REVISION/PATH` also names any single data file of a hub dataset repository (.json/.jsonl,
.parquet, .csv, .txt, optionally compressed), always streamed at that revision.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import SurgeryError
from .logs import get_logger

GENERAL = "general"  # the default of --calib and uptrain --data
OFFLINE_TEXT = "pydoc"  # what `general` reads without the hub
GENERAL_REPO = "allenai/c4"
GENERAL_REVISION = "1588ec454efa1a09f29cd18ddd04fe05fc8653a2"
GENERAL_FILE = "en/c4-train.00000-of-01024.json.gz"
HUB_FILE = "hf://datasets/"
BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
PROBE_SECONDS = 10.0  # how long the hub may take to answer before `general` falls back to pydoc


def general_url(repo: str = GENERAL_REPO, revision: str = GENERAL_REVISION, path: str = GENERAL_FILE) -> str:
    return f"{HUB_FILE}{repo}@{revision}/{path}"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it, also when set after huggingface_hub was imported."""
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}


def resolve_text(spec: str) -> str:
    """The text a spec reads: `general` -> the pinned C4 shard, or pydoc offline; any other spec as it is."""
    return resolve_general() if spec == GENERAL else spec


def resolve_texts(specs: Iterable[str]) -> list[str]:
    return [resolve_text(s) for s in specs]


@dataclass
class _Fallback:
    """Why `general` resolved to pydoc in this process (None: it did not), and whether the line saying so was
    printed: the dry runs' descriptions read the reason, the readers print it once."""

    reason: str | None = None
    said: bool = False


_FALLBACK = _Fallback()


@functools.cache
def resolve_general() -> str:
    """Decided once per process, so a command that reads the default text twice reads the same text. Offline, the
    line saying so waits for the text to be read (`say_fallback`): a command refused before it reads any text
    prints its one line of error and nothing else."""
    reason = _hub_unavailable()
    if reason is None:
        return general_url()
    _FALLBACK.reason, _FALLBACK.said = reason, False
    return OFFLINE_TEXT


def describe_texts(specs: Iterable[str]) -> list[str]:
    """What each spec will read, as the dry runs show it: `general` says which text it became and why."""
    out = []
    for spec in specs:
        text = resolve_text(spec)
        if spec == GENERAL and text == OFFLINE_TEXT:
            out.append(f"{OFFLINE_TEXT} (the general default offline: {_FALLBACK.reason or 'no hub'})")
        elif spec == GENERAL:
            out.append(f"general web text ({GENERAL_REPO}@{GENERAL_REVISION[:8]}, {GENERAL_FILE}, streamed)")
        else:
            out.append(text)
    return out


def say_fallback(spec: str) -> None:
    """One warning (a line on stderr from the command line), the first time a text is read that `general` fell back
    to (called by the readers in the main process, before any worker starts)."""
    if spec == OFFLINE_TEXT and _FALLBACK.reason and not _FALLBACK.said:
        _FALLBACK.said = True
        get_logger(__name__).warning(f"{_FALLBACK.reason}: reading the embedded {OFFLINE_TEXT} text instead of "
                                     f"{GENERAL_REPO} (general web text)")


def _hub_unavailable() -> str | None:
    """Why the pinned general text cannot be read from the hub, or None when it can (one metadata request)."""
    if hub_offline():
        return "HF_HUB_OFFLINE is set"
    from huggingface_hub import HfApi

    try:
        HfApi().dataset_info(GENERAL_REPO, revision=GENERAL_REVISION, timeout=PROBE_SECONDS)
    except Exception as e:  # noqa: BLE001 - unreachable, refused, not found: all mean "not from the hub"
        first = (str(e).splitlines() or [type(e).__name__])[0]
        return f"cannot read {GENERAL_REPO}@{GENERAL_REVISION[:8]} from the hub ({first[:120]})"
    return None


def is_hub_file(spec: str) -> bool:
    return spec.startswith(HUB_FILE)


def hub_file_texts(spec: str, text_field: str = "text") -> Iterable[str]:
    """The documents of one data file of a hub dataset repository at a revision, streamed (never downloaded whole)."""
    import datasets

    name = spec.rsplit("/", 1)[-1]
    stem = next((name[: -len(c)] for c in COMPRESSIONS if name.endswith(c)), name)
    builder = next((b for suffix, b in BUILDERS.items() if stem.endswith(suffix)), None)
    parts = spec[len(HUB_FILE):].split("/", 2)  # OWNER, NAME@REVISION, PATH
    if builder is None or len(parts) < 3 or "@" not in parts[1]:
        raise SurgeryError(f"data {spec}: name one file ({', '.join(BUILDERS)}, optionally compressed) as "
                           f"{HUB_FILE}OWNER/NAME@REVISION/PATH")
    if hub_offline():
        raise SurgeryError(f"data {spec} is on the hub and HF_HUB_OFFLINE is set")
    try:
        ds = datasets.load_dataset(builder, data_files=[spec], split="train", streaming=True)
        columns = ds.column_names or []
    except Exception as e:  # datasets raises many kinds for unreachable or unreadable files
        raise SurgeryError(f"cannot read data {spec}: {(str(e).splitlines() or [type(e).__name__])[0]}") from None
    if columns and text_field not in columns:
        raise SurgeryError(f"data {spec} has no column {text_field!r} (columns: {', '.join(columns)}); use --text-field")
    return (row[text_field] for row in ds)
