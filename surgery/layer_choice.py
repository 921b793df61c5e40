"""Which layers a kind keeps as they were (swa's `--global-layers`, hybrid's `--attention-layers`): a count (evenly
spaced, the last layer included), a list of layer indices, or `auto` / `auto:N` (the N layers its calibration scores
highest; N defaults to a quarter of the layers, rounded up). One parser for every kind: a kind subclasses LayerChoice
with its flag and what an empty list would have meant, and gets the same spellings and the same refusals."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from .errors import SurgeryError

AUTO = "auto"
AUTO_SHARE = 0.25  # `auto` alone keeps this share of the layers


@dataclass(frozen=True)
class LayerChoice:
    """A parsed layer choice: `auto` with an optional count, a count, or explicit indices."""

    FLAG: ClassVar[str] = "--layers"
    EMPTY: ClassVar[str] = "give 0 for none"  # what to give instead of an empty list

    auto: bool = False
    count: int | None = None
    indices: tuple[int, ...] | None = None

    def resolve_count(self, layers: int) -> int:
        """How many layers are kept in a model of `layers` layers (checked against it)."""
        if self.indices is not None:
            return len(self.indices)
        count = self.count if self.count is not None else math.ceil(layers * AUTO_SHARE)
        if not 0 <= count <= layers:
            raise SurgeryError(f"{self.FLAG} {count}: the model has {layers} layers")
        return count

    def check(self, layers: int) -> None:
        """Refuse what does not fit a model of `layers` layers, before any work."""
        if self.indices is not None:
            bad = [i for i in self.indices if not 0 <= i < layers]
            if bad:
                raise SurgeryError(f"{self.FLAG}: layer {bad[0]} is out of range (the model has {layers} layers: "
                                   f"0-{layers - 1})")
        self.resolve_count(layers)

    def describe(self) -> str:
        if self.indices is not None:  # one index bracketed: a bare "5" would read back as a count
            return ",".join(map(str, self.indices)) if len(self.indices) > 1 else f"[{self.indices[0]}]"
        if self.auto:
            return f"{AUTO}:{self.count}" if self.count is not None else AUTO
        return str(self.count)

    @classmethod
    def parse(cls, text: str | int | list) -> LayerChoice:
        """`auto`, `auto:N`, a count `N`, or a list `0,7,15` (a Python list from a recipe or the API); ValueError
        with the reason otherwise."""
        if isinstance(text, bool):
            raise ValueError(f"{cls.FLAG} takes auto, auto:N, a count or a list of layers, got {text!r}")
        if isinstance(text, list):
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in text):
                raise ValueError(f"{cls.FLAG}: a list holds layer indices, got {text!r}")
            return cls._indices(text)
        text = str(text).strip()
        if text == AUTO:
            return cls(auto=True)
        if text.startswith(AUTO + ":"):
            return cls(auto=True, count=cls._count(text[len(AUTO) + 1:], text))
        if "," in text or text.startswith("["):
            try:
                values = [int(p) for p in text.strip("[]").split(",") if p.strip()]
            except ValueError:
                raise ValueError(f"{cls.FLAG} {text!r}: a list holds layer indices like 0,7,15") from None
            return cls._indices(values)
        return cls(count=cls._count(text, text))

    @classmethod
    def _count(cls, value: str, text: str) -> int:
        try:
            count = int(value)
        except ValueError:
            raise ValueError(f"{cls.FLAG} takes auto, auto:N, a count or a list of layers like 0,7,15; got "
                             f"{text!r}") from None
        if count < 0:
            raise ValueError(f"{cls.FLAG} {text!r}: a count cannot be negative")
        return count

    @classmethod
    def _indices(cls, values: list[int]) -> LayerChoice:
        if not values:
            raise ValueError(f"{cls.FLAG}: the list is empty ({cls.EMPTY})")
        seen = set()
        for i in values:
            if i in seen:
                raise ValueError(f"{cls.FLAG}: layer {i} is listed twice")
            if i < 0:
                raise ValueError(f"{cls.FLAG}: layer {i} is out of range (indices start at 0)")
            seen.add(i)
        return cls(indices=tuple(sorted(values)))


def evenly_spaced(count: int, layers: int) -> list[int]:
    """`count` layers spread over `layers`, the last one included (as Gemma's every k-th layer)."""
    return sorted({int((j + 1) * layers / count) - 1 for j in range(count)}) if count else []


def top_layers(scores: list[float], count: int) -> list[int]:
    """The `count` layers with the highest scores (ties: the later layer), in order."""
    ranked = sorted(range(len(scores)), key=lambda i: (scores[i], i), reverse=True)
    return sorted(ranked[:count])
