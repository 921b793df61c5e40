"""swa's options model: SWAFields (its own flags) and SWAOptions (with calibration's and the rules), read by the
kind (surgery/swa/kind.py) and the converter."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import ValidationInfo, field_validator, model_validator

from ..kinds.base import CalibrationOptions, WriteOptions, require_size
from ..options import option, spelling
from .layers import GlobalLayers, parse_global_layers


class SWAFields(WriteOptions):
    """swa's own options (SWAOptions adds calibration's after them, read by `--global-layers auto`)."""

    GROUP: ClassVar[str] = "swa"
    window: int | None = option(
        None, "--window", "[swa] Tokens a sliding layer sees: the query and the W-1 before it (the runtimes' "
        "sliding_window). Contexts of at most W compute exactly the source's function.", metavar="W", group=GROUP)
    global_layers: str = option(
        "auto", "--global-layers", "[swa] Layers kept global: auto (the quarter of the layers that lose most when "
        "windowed, scored on calibration text at long context: see --layer-score), auto:N (the N such layers), N "
        "(evenly spaced, the last included), or a list of indices like 0,7,15.", metavar="SPEC", group=GROUP)
    layer_score: Literal["cost", "mass"] = option(
        "cost", "--layer-score", "[swa] How `auto` scores a layer: cost (what windowing it alone costs, measured: the "
        "answers' log-probability on retrieval examples built from the calibration text plus the text's NLL beyond "
        "the window, layers halved round by round) or mass (its attention probability beyond the window: cheaper, "
        "blind to retrieval).", group=GROUP)

    sinks: bool = option(
        False, "--sinks", "[swa] Give every attention head a learnable sink (a logit that joins its softmax and takes "
        "weight from the keys, as StreamingLLM's first tokens do), written as granite_swa (Llama and Mistral bodies): "
        "exact until trained, then trained by `uptrain` (the conversion's new parameters; see --new-lr).",
        group=GROUP)

    @field_validator("global_layers", mode="before")
    @classmethod
    def _spec(cls, v, info: ValidationInfo):
        parsed = parse_global_layers(v)  # ValueError carries the reason
        return parsed.describe()


class SWAOptions(CalibrationOptions, SWAFields):
    @property
    def parsed_global_layers(self) -> GlobalLayers:
        return parse_global_layers(self.global_layers)

    @model_validator(mode="after")
    def _rules(self, info: ValidationInfo):
        s = spelling(info, type(self))
        require_size(self, s, "swa", "window")
        if self.parsed_global_layers.auto:
            return self
        self.refuse_calibration_options(s, f"{s.flag('global_layers')} {self.global_layers}",
                                        f"{s.flag('global_layers')} auto", more=("layer_score",))
        return self
