"""Which layers keep their attention: `--attention-layers` as a count (evenly spaced, the last layer included), a
list of layer indices, or `auto` / `auto:N` (the N layers whose replacement perturbs the residual stream most,
scored by calibrate.py; N defaults to a quarter of the layers, rounded up)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import SurgeryError

AUTO = "auto"
AUTO_SHARE = 0.25  # `auto` alone keeps this share of the layers as attention
FLAG = "--attention-layers"


@dataclass(frozen=True)
class AttentionLayers:
    """A parsed `--attention-layers`: `auto` with an optional count, a count, or explicit indices."""

    auto: bool = False
    count: int | None = None
    indices: tuple[int, ...] | None = None

    def resolve_count(self, layers: int) -> int:
        if self.indices is not None:
            return len(self.indices)
        count = self.count if self.count is not None else math.ceil(layers * AUTO_SHARE)
        if not 0 <= count <= layers:
            raise SurgeryError(f"{FLAG} {count}: the model has {layers} layers")
        return count

    def check(self, layers: int) -> None:
        """Refuse what does not fit a model of `layers` layers, before any work."""
        if self.indices is not None:
            bad = [i for i in self.indices if not 0 <= i < layers]
            if bad:
                raise SurgeryError(f"{FLAG}: layer {bad[0]} is out of range (the model has {layers} layers: "
                                   f"0-{layers - 1})")
        self.resolve_count(layers)

    def describe(self) -> str:
        if self.indices is not None:  # one index bracketed: a bare "5" would read back as a count
            return ",".join(map(str, self.indices)) if len(self.indices) > 1 else f"[{self.indices[0]}]"
        if self.auto:
            return f"{AUTO}:{self.count}" if self.count is not None else AUTO
        return str(self.count)


def parse_attention_layers(text: str | int | list) -> AttentionLayers:
    """`auto`, `auto:N`, a count `N`, or a list `0,7,15` (a Python list from a recipe or the API); ValueError with
    the reason otherwise."""
    if isinstance(text, bool):
        raise ValueError(f"{FLAG} takes auto, auto:N, a count or a list of layers, got {text!r}")
    if isinstance(text, list):
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in text):
            raise ValueError(f"{FLAG}: a list holds layer indices, got {text!r}")
        return _indices(text)
    text = str(text).strip()
    if text == AUTO:
        return AttentionLayers(auto=True)
    if text.startswith(AUTO + ":"):
        return AttentionLayers(auto=True, count=_count(text[len(AUTO) + 1:], text))
    if "," in text or text.startswith("["):
        try:
            values = [int(p) for p in text.strip("[]").split(",") if p.strip()]
        except ValueError:
            raise ValueError(f"{FLAG} {text!r}: a list holds layer indices like 0,7,15") from None
        return _indices(values)
    return AttentionLayers(count=_count(text, text))


def _count(value: str, text: str) -> int:
    try:
        count = int(value)
    except ValueError:
        raise ValueError(f"{FLAG} takes auto, auto:N, a count or a list of layers like 0,7,15; got {text!r}") from None
    if count < 0:
        raise ValueError(f"{FLAG} {text!r}: a count cannot be negative")
    return count


def _indices(values: list[int]) -> AttentionLayers:
    if not values:
        raise ValueError(f"{FLAG}: the list is empty (give 0 to replace every layer)")
    seen = set()
    for i in values:
        if i in seen:
            raise ValueError(f"{FLAG}: layer {i} is listed twice")
        if i < 0:
            raise ValueError(f"{FLAG}: layer {i} is out of range (indices start at 0)")
        seen.add(i)
    return AttentionLayers(indices=tuple(sorted(values)))


def evenly_spaced(count: int, layers: int) -> list[int]:
    """`count` layers spread over `layers`, the last one included."""
    return sorted({int((j + 1) * layers / count) - 1 for j in range(count)}) if count else []


def top_layers(scores: list[float], count: int) -> list[int]:
    """The `count` layers with the highest scores (ties: the later layer), in order."""
    ranked = sorted(range(len(scores)), key=lambda i: (scores[i], i), reverse=True)
    return sorted(ranked[:count])
