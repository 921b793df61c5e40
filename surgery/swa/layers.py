"""Which layers keep global attention: `--global-layers` as a count (evenly spaced, the last layer always global), a
list of layer indices, or `auto` / `auto:N` (the N layers that lose most when windowed, scored by score.py; N
defaults to a quarter of the layers, rounded up)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import SurgeryError

SLIDING, FULL = "sliding_attention", "full_attention"
AUTO = "auto"
AUTO_SHARE = 0.25  # `auto` alone keeps this share of the layers global (the "a quarter of the layers")


@dataclass(frozen=True)
class GlobalLayers:
    """A parsed `--global-layers`: `auto` with a count, a count, or explicit indices."""

    auto: bool = False
    count: int | None = None
    indices: tuple[int, ...] | None = None

    def resolve_count(self, layers: int) -> int:
        """How many layers stay global in a model of `layers` layers (checked against it)."""
        if self.indices is not None:
            return len(self.indices)
        count = self.count if self.count is not None else math.ceil(layers * AUTO_SHARE)
        if not 0 <= count <= layers:
            raise SurgeryError(f"--global-layers {count}: the model has {layers} layers")
        return count

    def check(self, layers: int) -> None:
        """Refuse what does not fit a model of `layers` layers, before any work."""
        if self.indices is not None:
            bad = [i for i in self.indices if not 0 <= i < layers]
            if bad:
                raise SurgeryError(f"--global-layers: layer {bad[0]} is out of range (the model has {layers} layers: "
                                   f"0-{layers - 1})")
        self.resolve_count(layers)

    def describe(self) -> str:
        if self.indices is not None:  # one index bracketed: a bare "5" would read back as a count
            return ",".join(map(str, self.indices)) if len(self.indices) > 1 else f"[{self.indices[0]}]"
        return f"{AUTO}:{self.count}" if self.auto and self.count is not None else (AUTO if self.auto else str(self.count))


def parse_global_layers(text: str | int | list) -> GlobalLayers:
    """`auto`, `auto:N`, a count `N`, or a list `0,7,15` (a Python list from a recipe or the API); ValueError with
    the reason otherwise."""
    if isinstance(text, bool):
        raise ValueError(f"--global-layers takes auto, auto:N, a count or a list of layers, got {text!r}")
    if isinstance(text, int):
        text = str(text)
    if isinstance(text, list):
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in text):
            raise ValueError(f"--global-layers: a list holds layer indices, got {text!r}")
        return _indices(text)
    text = str(text).strip()
    if text == AUTO:
        return GlobalLayers(auto=True)
    if text.startswith(AUTO + ":"):
        return GlobalLayers(auto=True, count=_count(text[len(AUTO) + 1:], text))
    if "," in text or text.startswith("["):
        parts = [p for p in text.strip("[]").split(",") if p.strip()]
        try:
            values = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"--global-layers {text!r}: a list holds layer indices like 0,7,15") from None
        return _indices(values)
    return GlobalLayers(count=_count(text, text))


def _count(value: str, text: str) -> int:
    try:
        count = int(value)
    except ValueError:
        raise ValueError(f"--global-layers takes auto, auto:N, a count or a list of layers like 0,7,15; got {text!r}") \
            from None
    if count < 0:
        raise ValueError(f"--global-layers {text!r}: a count cannot be negative")
    return count


def _indices(values: list[int]) -> GlobalLayers:
    if not values:
        raise ValueError("--global-layers: the list is empty (give 0 for no global layer)")
    seen = set()
    for i in values:
        if i in seen:
            raise ValueError(f"--global-layers: layer {i} is listed twice")
        if i < 0:
            raise ValueError(f"--global-layers: layer {i} is out of range (indices start at 0)")
        seen.add(i)
    return GlobalLayers(indices=tuple(sorted(values)))


def evenly_spaced(count: int, layers: int) -> list[int]:
    """`count` layers spread over `layers`, the last one included (as Gemma's every k-th layer)."""
    return sorted({int((j + 1) * layers / count) - 1 for j in range(count)}) if count else []


def top_layers(scores: list[float], count: int) -> list[int]:
    """The `count` layers with the highest scores (ties: the later layer), in order."""
    ranked = sorted(range(len(scores)), key=lambda i: (scores[i], i), reverse=True)
    return sorted(ranked[:count])


def layer_types(layers: int, global_indices: list[int]) -> list[str]:
    keep = set(global_indices)
    return [FULL if i in keep else SLIDING for i in range(layers)]
