"""What `check --retrieval` asks for, checked for its form before any checkpoint is read: the retrieval task names
(`--retrieval`) and the lengths (`--retrieval-lengths`: token counts, or multiples of the converted model's sliding
window resolved once the window is known). Plain Python (no torch): the options model (checking/options.py) applies
these rules when it is built."""

from __future__ import annotations

import re
from typing import Sequence

from ..errors import SurgeryError
from ..retrieval_tasks import TASKS

FIRST_LENGTH = 512
MIN_LENGTH = 64  # tokens: the shortest retrieval example
_LENGTH = re.compile(r"(\d+)|(\d+(?:\.\d+)?|\.\d+)?w")
METRICS = {"exact": "exact match", "string": "RULER's string match"}  # --retrieval-metric: its name in the reports
EXTRA_TOKENS = 4  # the string metric's new tokens beyond the answer's length (RULER allows 128)
LENGTHS_FORM = "comma-separated token counts or multiples of the converted model's sliding window (e.g. 512,2w,4w)"


def parse_retrieval_tasks(spec: str) -> list[str]:
    names = list(TASKS) if spec.strip() == "all" else [t.strip() for t in spec.split(",") if t.strip()]
    unknown = [t for t in names if t not in TASKS]
    if unknown or not names:
        raise SurgeryError(f"unknown retrieval task {unknown[0] if unknown else spec!r}; choose from "
                           f"{', '.join(TASKS)} or all")
    return list(dict.fromkeys(names))


def parse_lengths(spec: str | Sequence[int | str] | None) -> tuple[int | str, ...] | None:
    """--retrieval-lengths' entries, checked for their form: token counts (ints) and multiples of the converted
    model's window ("2w", "0.5w", "w", kept as strings until the window is known: `resolve_lengths`)."""
    if spec is None or spec == "" or spec == ():
        return None
    entries = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[int | str] = []
    for entry in entries:
        text = str(entry).strip().lower().replace("_", "")
        if not text and isinstance(spec, str):
            continue  # "512,1024,": a trailing comma
        match = _LENGTH.fullmatch(text)
        if isinstance(entry, bool) or not match:
            raise SurgeryError(f"--retrieval-lengths takes {LENGTHS_FORM}, got {entry!r}")
        out.append(int(match.group(1)) if match.group(1) else text)
    if not out:
        raise SurgeryError(f"--retrieval-lengths takes {LENGTHS_FORM}, got {spec!r}")
    return tuple(out)


def check_length(n: int) -> int:
    """A retrieval length in tokens, refused when no example fits in it (the context and the haystack are the
    checkpoint's and the text's business: checking/retrieval.py)."""
    if n < MIN_LENGTH:
        raise SurgeryError(f"--retrieval-lengths: {n} tokens is too short for a retrieval example ({MIN_LENGTH} at "
                           "least)")
    return n


def window_multiple(entry: str) -> float:
    return float(entry[:-1] or 1)


def resolve_lengths(entries: Sequence[int | str], window: int | None, why_none: str = "") -> list[int]:
    """Token counts of --retrieval-lengths, sorted, each "kw" as round(k x `window`) (the converted model's sliding
    window; None: it has none, and `why_none` says why, e.g. "mqa-out has no sliding window")."""
    lengths = []
    for entry in entries:
        if isinstance(entry, int):
            lengths.append(entry)
            continue
        if not window:
            raise SurgeryError(f"--retrieval-lengths {entry}: w is the converted model's sliding window, and "
                               f"{why_none or 'it has none'}; give the lengths in tokens")
        tokens = round(window_multiple(entry) * window)
        if tokens < 1:
            raise SurgeryError(f"--retrieval-lengths {entry}: {tokens} tokens (w = {window})")
        lengths.append(tokens)
    return sorted(set(lengths))


def default_lengths(longest: int) -> list[int]:
    """512, 1024, ... doubling up to `longest`, which is always the last rung."""
    lengths, n = [], FIRST_LENGTH
    while n < longest:
        lengths.append(n)
        n *= 2
    return lengths + [longest]
