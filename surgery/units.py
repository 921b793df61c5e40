"""Sizes and counts written for people, in one convention: SI prefixes, powers of 1000 (1 KB = 1000 B)."""

from __future__ import annotations


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
