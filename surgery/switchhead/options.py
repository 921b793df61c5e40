"""switchhead's options model: SwitchHeadOptions (its flags, calibration's and its rule), read by the kind
(surgery/switchhead/kind.py) and the converter."""

from __future__ import annotations

from typing import ClassVar

from pydantic import ValidationInfo, model_validator

from ..kinds.base import CalibrationOptions, WriteOptions
from ..options import option, spelling


class SwitchHeadOptions(CalibrationOptions, WriteOptions):
    GROUP: ClassVar[str] = "switchhead"
    heads: int | None = option(None, "--heads", "[switchhead] Attention heads after conversion (H).", metavar="H",
                               group=GROUP)
    experts: int | None = option(None, "--experts", "[switchhead] Experts per head (E).", metavar="E", group=GROUP)
    topk: int | None = option(None, "--topk", "[switchhead] Experts selected per token (k).", metavar="K", group=GROUP)

    @model_validator(mode="after")
    def _sizes_given(self, info: ValidationInfo):
        if None in (self.heads, self.experts, self.topk):
            s = spelling(info, type(self))
            raise ValueError(f"{s.kind('switchhead')} needs {s.options(['heads', 'experts', 'topk'])}")
        return self
