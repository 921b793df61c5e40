"""talking-heads: learned mixing of the heads' attention logits and weights (Shazeer et al. 2020), initialised to the
identity so that the converted model computes the source's function. Ships its own modeling code."""

from __future__ import annotations

from pathlib import Path

from ..model_types import CONVERTED_PREFIXES
from ..kinds.base import AttentionShape, Kind
from .options import TalkingHeadsOptions
from .refusals import NAME, REFUSES


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
