"""Sizes and counts written for people."""

from __future__ import annotations


def human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000:
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} PB"


def human_count(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("", "K", "M", "B"):
        if n < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}T"
