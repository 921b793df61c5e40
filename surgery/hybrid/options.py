"""hybrid's options model: HybridFields (its own flags) and HybridOptions (with calibration's), read by the kind
(surgery/hybrid/kind.py) and the converter."""

from __future__ import annotations

from typing import ClassVar

from pydantic import ValidationInfo, field_validator

from ..kinds.base import CalibrationOptions, WriteOptions
from ..options import option, spelling
from .family import CONV_KERNELS
from .layers import AttentionLayers, parse_attention_layers


class HybridFields(WriteOptions):
    """hybrid's own options (HybridOptions adds calibration's after them: the mixers' statistics and `auto`)."""

    GROUP: ClassVar[str] = "hybrid"
    attention_layers: str = option(
        "auto", "--attention-layers", "[hybrid] Layers that keep attention (the others become Mamba-2 mixers): auto "
        "(the quarter of the layers whose replacement moves the residual stream most on calibration text), auto:N "
        "(the N such layers), N (evenly spaced, the last included), or a list of indices like 0,7,15.",
        metavar="SPEC", group=GROUP)
    conv_kernel: int = option(
        4, "--conv-kernel", "[hybrid] Taps of the mixers' causal convolution (2-4; it starts as the identity).",
        metavar="K", group=GROUP)

    @field_validator("attention_layers", mode="before")
    @classmethod
    def _spec(cls, v, info: ValidationInfo):
        return parse_attention_layers(v).describe()  # ValueError carries the reason

    @field_validator("conv_kernel")
    @classmethod
    def _kernel(cls, v: int, info: ValidationInfo):
        if v not in CONV_KERNELS:
            raise ValueError(f"{spelling(info, cls).flag('conv_kernel')} {v}: Bamba's runtimes take a convolution of "
                             f"{', '.join(map(str, CONV_KERNELS))} taps")
        return v


class HybridOptions(CalibrationOptions, HybridFields):
    @property
    def parsed_attention_layers(self) -> AttentionLayers:
        return parse_attention_layers(self.attention_layers)
