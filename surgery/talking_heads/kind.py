"""talking-heads: learned mixing of the heads' attention logits and weights (Shazeer et al. 2020), initialised to the
identity so that the converted model computes the source's function. Ships its own modeling code."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import ValidationInfo, model_validator

from ..model_types import CONVERTED_PREFIXES
from ..options import option, spelling
from ..kinds.base import AttentionShape, Kind, WriteOptions


from .refusals import NAME, REFUSES


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


class TalkingHeads(Kind):
    def convert(self, source, out: Path, options: TalkingHeadsOptions) -> dict:
        from . import convert_to_talking_heads

        return convert_to_talking_heads(source, out, options)

    def attention_macs(self, shape: AttentionShape, config: dict, record: dict, context: int) -> dict:
        # mixing the logits (h_k x h) and the weights (h x h_v) costs h_k*h + h*h_v per query-key pair
        macs = super().attention_macs(shape, config, record, context)
        return {**macs, "mixing": shape.layers * int(record.get("mix_macs_per_query_key_per_layer", 0)) * context}

    def added_parameters(self, record: dict) -> int | None:
        return record.get("added_parameters")


TALKING_HEADS = TalkingHeads(NAME, TalkingHeadsOptions, title="talking-heads attention (Shazeer et al. 2020)",
                             tags=["talking-heads"], ships_code=True, model_type_prefix=CONVERTED_PREFIXES[NAME],
                             source_attention="eager", example_options={},
                             refuses=REFUSES)
