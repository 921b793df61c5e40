"""Sizes and counts as people write them (printed, and sizes read back), in one convention: SI prefixes, powers of
1000 (1 KB = 1000 B)."""

from __future__ import annotations

import re

from .errors import SurgeryError


def human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000:
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} PB"


def si_number(n: float | None, unit: str = "") -> str:
    """Four significant digits and an SI prefix, no space (`surgery inspect`'s and the model card's tables)."""
    if n is None:
        return "-"
    for prefix in ("", "K", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.4g}{prefix}{unit}"
        n /= 1000
    return f"{n:.4g}P{unit}"


def human_count(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("", "K", "M", "B"):
        if n < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}T"


def parse_size(text: str) -> int:
    """A size as people write it (`500MB`, `5GB`, `5GiB` read as `5GB`: the same convention as human_bytes)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise SurgeryError(f"bad size {text!r}: use e.g. 500MB or 5GB")
    unit = (m.group(2) or "B").upper().replace("I", "")
    return int(float(m.group(1)) * {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}[unit])
