"""mla's options model: MLAFields (its own flags) and MLAOptions (with calibration's, the retrieval mix's and
weights' (surgery/mla/retrieval.py), the query refit's, and the rules), read by the kind (surgery/mla/kind.py) and
the converter."""

from __future__ import annotations

import math
from typing import ClassVar

from pydantic import ValidationInfo, model_validator

from ..kinds.base import (CalibrationOptions, QueryRefitOptions, RetrievalMixOptions, RetrievalWeightOptions,
                          WriteOptions, require_size)
from ..options import option, spelling


class MLAFields(WriteOptions):
    """MLA's own options (MLAOptions adds calibration's after them)."""

    GROUP: ClassVar[str] = "mla"
    kv_rank: int | None = option(
        None, "--kv-rank", "[mla] Rank of the cached latent (kv_lora_rank): at most 2 x K/V heads x head_dim, the "
        "source's keys and values (that rank reproduces the source's values and no-position keys).", metavar="R",
        group=GROUP)
    rope_dim: int | None = option(
        None, "--rope-dim", "[mla] Rotary dims of the one rope key every head shares (qk_rope_head_dim; even, at most "
        "head_dim; default head_dim).", metavar="D", group=GROUP)


class MLAOptions(CalibrationOptions, RetrievalMixOptions, RetrievalWeightOptions, QueryRefitOptions, MLAFields):
    @model_validator(mode="after")
    def _sizes(self, info: ValidationInfo):
        s = spelling(info, type(self))
        require_size(self, s, "mla", "kv_rank", rule="must be positive")
        if self.rope_dim is not None and (self.rope_dim < 2 or self.rope_dim % 2):
            raise ValueError(f"{s.flag('rope_dim')} must be even and at least 2 (RoPE rotates pairs), got "
                             f"{self.rope_dim}")
        return self

    @model_validator(mode="after")
    def _retrieval_weights(self, info: ValidationInfo):
        """The head weights need scores and the row weights rows, which only the retrieval examples give."""
        s = spelling(info, type(self))
        for name in ("retrieval_weight", "retrieval_rows_weight"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{s.flag(name)} must be a finite number >= 0, got {value}")
        if self.retrieval_weight and not self.calib_retrieval_mix:
            raise ValueError(f"{s.flag('retrieval_weight')} weighs heads by their retrieval scores, measured on "
                             f"retrieval examples: give {s.flag('calib_retrieval_mix')} P > 0 too")
        if "retrieval_rows_weight" in self.model_fields_set and not self.calib_retrieval_mix:
            raise ValueError(f"{s.flag('retrieval_rows_weight')} weighs the retrieval examples' answer and needle "
                             f"rows: give {s.flag('calib_retrieval_mix')} P > 0 too")
        return self
