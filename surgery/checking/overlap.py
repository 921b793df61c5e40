"""Is the evaluation text part of what the converted model was calibrated on?

A calibrated conversion (aligned merge, SwitchHead) records in its surgery.json
`"calibration": {"data": SPEC, "documents_sha256": [sha256 of each document's UTF-8 text that gave tokens]}`.
`check` hashes every document it evaluates on the same way and warns when any is in that list: the numbers then
flatter the conversion.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..checkpoint.record import read_record_or_empty


def document_sha256(text: str) -> str:
    """How a document is named in surgery.json's calibration record: the hex sha256 of its UTF-8 text."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class HashedTexts:
    """Iterate `texts`, remembering the sha256 of each non-empty document actually handed out (a consumer that
    stops early leaves the rest unhashed, so the list is exactly the documents that gave tokens)."""

    def __init__(self, texts: Iterable[str]):
        self.texts = texts
        self.hashes: list[str] = []

    def __iter__(self) -> Iterator[str]:
        for text in self.texts:
            if text:
                self.hashes.append(document_sha256(text))
            yield text


def calibration_hashes(folder: Path) -> tuple[str | None, set[str]]:
    """(calibration data spec, document hashes) from a checkpoint's surgery.json; (None, empty) when absent."""
    record = read_record_or_empty(Path(folder))  # a corrupt record names no calibration text: nothing to warn about
    calibration = record.get("calibration") or {}
    return calibration.get("data"), set(calibration.get("documents_sha256") or ())


def calibration_overlap(folder: Path, evaluated: list[str]) -> dict | None:
    """{"documents": n, "of": m, "calibration": spec} when n > 0 of the m evaluated documents were calibration
    documents of the checkpoint in `folder`; None otherwise."""
    spec, calibrated = calibration_hashes(folder)
    if not calibrated:
        return None
    shared = sum(h in calibrated for h in set(evaluated))
    if not shared:
        return None
    return {"documents": shared, "of": len(set(evaluated)), "calibration": spec}


def read_sources(folder: Path) -> dict[str, set[str]]:
    """{"calibrated": specs, "trained": specs}: the texts a checkpoint's surgery.json says it read (a calibration
    mixture's parts each; every uptraining, earlier ones included)."""
    record = read_record_or_empty(Path(folder))
    calibration = record.get("calibration") or {}
    calibrated = {p.get("data") for p in calibration.get("mixture") or () if isinstance(p, dict)}
    calibrated |= {calibration.get("data")} if not calibrated else set()
    runs = [record.get("uptraining") or {}, *(record.get("previous_uptraining") or ())]
    trained = {run.get("data") for run in runs if isinstance(run, dict)}
    return {k: {s for s in v if isinstance(s, str)} for k, v in (("calibrated", calibrated), ("trained", trained))}


def shared_source(folder: Path, spec: str) -> str | None:
    """How the model read `spec`, when a check on it alone measures the domain the model was fitted to
    ("calibrated", "trained", "calibrated and trained"), or None
    when `spec` is none of the sources its surgery.json names. Same source, not same documents: pydoc's calibration
    reads other documents than check does, yet rewards fitting pydoc's domain all the same."""
    read = read_sources(folder)
    how = [verb for verb in ("calibrated", "trained") if spec in read[verb]]
    return " and ".join(how) or None
