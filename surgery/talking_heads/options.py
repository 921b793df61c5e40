"""talking-heads' options model: TalkingHeadsOptions (its flags and its rule), read by the kind
(surgery/talking_heads/kind.py) and the converter."""

from __future__ import annotations

from typing import ClassVar

from pydantic import ValidationInfo, model_validator

from ..kinds.base import WriteOptions
from ..options import option, spelling


class TalkingHeadsOptions(WriteOptions):
    GROUP: ClassVar[str] = "talking-heads"
    logits_mixing: bool = option(True, "--logits-mixing", "[talking-heads] Mix heads' attention logits before the "
                                                          "softmax.", group=GROUP)
    weights_mixing: bool = option(True, "--weights-mixing", "[talking-heads] Mix heads' attention weights after the "
                                                            "softmax.", group=GROUP)
    heads_logits: int | None = option(None, "--heads-logits", "[talking-heads] Query-key heads h_k that logits mixing "
                                      "maps onto the h softmax heads (head size h*d/h_k; default h; multiples of h stay "
                                      "exact).", group=GROUP)
    heads_weights: int | None = option(None, "--heads-weights", "[talking-heads] Value heads h_v that weights mixing "
                                       "maps the h softmax heads onto (head size h*d/h_v; default h; multiples of h "
                                       "stay exact).", group=GROUP)
    chunk_size: int = option(512, "--chunk-size", "[talking-heads] Query chunk for the attention computation (memory "
                                                  "O(h*chunk*S)).", group=GROUP)

    @model_validator(mode="after")
    def _no_calibration(self, info: ValidationInfo):
        if self.device != "auto":
            s = spelling(info, type(self))
            raise ValueError(f"{s.flag('device')} is where calibration runs: {s.kind('talking-heads')} runs none "
                             f"(leave {s.flag('device')} out)")
        return self
