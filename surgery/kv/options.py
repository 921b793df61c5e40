"""mqa's and gqa's options models: the merge methods' one table (MERGES), KVMergeFields (the merge's own flags),
KVMergeOptions (with calibration's, the retrieval mix's and the query refit's, and the rules), MQAOptions and
GQAOptions; read by the kind (surgery/kv/kind.py) and the converters."""

from __future__ import annotations

import math
from typing import ClassVar, Literal

from pydantic import ValidationInfo, model_validator

from ..kinds.base import (CalibrationOptions, QueryRefitOptions, RetrievalMixOptions, RetrievalWeightOptions,
                          WriteOptions, require_size)
from ..options import option, spelling

ALIGNED = "aligned"  # the calibrated merge; the others are surgery.kv.pool's POOL_METHODS (tests/test_registry.py)
# the merge methods, in the order --merge, a recipe's `merge` and compare-merges list them, with the model card's
# words for each: the one table of their names
MERGES = {
    "mean": "mean of each group's K/V heads (Ainslie et al. 2023)",
    "first": "first K/V head of each group (ablation)",
    "random": "random initialization at the source's scale (ablation)",
    ALIGNED: "activation-aware aligned merge (RoPE-compatible)",
}
METHODS = tuple(MERGES)


class KVMergeFields(WriteOptions):
    """The K/V merge's own options (KVMergeOptions adds calibration's after them, for the aligned merge)."""

    GROUP: ClassVar[str] = "mqa / gqa"
    kv_heads: int | None = option(None, "--kv-heads", "[gqa] K/V heads after conversion; must divide the source's.",
                                  metavar="N", group=GROUP)
    merge: Literal[METHODS] = option(
        "mean", "--merge", "[mqa/gqa] How each group's K/V heads are merged: mean (GQA paper), first head, random init "
        "(the paper's ablations), or aligned (activation-aware, RoPE-compatible).", aliases=("--method",), group=GROUP)
    grouping: Literal["similarity", "consecutive"] = option(
        "similarity", "--grouping", "[aligned] Which K/V heads share a merged head: similarity (the grouping that "
        "loses least, searched over up to C(K, K/G) candidate groups per layer, each scored from per-head products "
        "computed once) or consecutive (as the plain merges; skips the search).", group=GROUP)
    refit_values: bool = option(
        False, "--refit-values", "[aligned] Also refit the merged values so that each query head reproduces its "
        "source head's output under the converted attention (holds one hidden x hidden float64 matrix per query head: "
        "about 4 GB on Llama-3-8B).", group=GROUP)
    refit_keys: bool = option(
        False, "--refit-keys", "[aligned] Also refit the merged keys against the source's attention logits (from all "
        "the group's converted queries) before the query refit.", group=GROUP)


class KVMergeOptions(CalibrationOptions, RetrievalMixOptions, RetrievalWeightOptions, QueryRefitOptions,
                     KVMergeFields):
    @property
    def groups(self) -> int:
        """K/V heads after conversion."""
        return self.kv_heads or 1

    @model_validator(mode="after")
    def _aligned_only(self, info: ValidationInfo):
        """Options only the aligned merge reads: given with a plain merge they would do nothing, silently."""
        if self.merge == ALIGNED:
            return self
        s = spelling(info, type(self))
        if self.retrieval_weight:
            raise ValueError(f"{s.flag('retrieval_weight')} weighs the aligned merge's heads: it does nothing for the "
                             f"{self.merge} merge (use {s.flag('merge')} aligned)")
        for name, what in (("refit_values", "values"), ("refit_keys", "keys")):
            if getattr(self, name):
                raise ValueError(f"{s.flag(name)} refits the aligned merge's {what}: it does nothing for the "
                                 f"{self.merge} merge (use {s.flag('merge')} aligned)")
        if "retrieval_rows_weight" in self.model_fields_set:
            raise ValueError(f"{s.flag('retrieval_rows_weight')} weighs the aligned merge's refit rows: it does "
                             f"nothing for the {self.merge} merge (use {s.flag('merge')} aligned)")
        self.refuse_calibration_options(s, f"the {self.merge} merge", f"{s.flag('merge')} aligned",
                                        more=("query_samples", "grouping", "calib_retrieval_mix"))
        return self

    @model_validator(mode="after")
    def _retrieval_weight(self, info: ValidationInfo):
        """The head weights need scores, which only the retrieval examples give."""
        s = spelling(info, type(self))
        if not (math.isfinite(self.retrieval_weight) and self.retrieval_weight >= 0):
            raise ValueError(f"{s.flag('retrieval_weight')} must be a finite number >= 0, got {self.retrieval_weight}")
        if self.retrieval_weight and self.merge == ALIGNED and not self.calib_retrieval_mix:
            raise ValueError(f"{s.flag('retrieval_weight')} weighs heads by their retrieval scores, measured on "
                             f"retrieval examples: give {s.flag('calib_retrieval_mix')} P > 0 too")
        w = self.retrieval_rows_weight
        if not (math.isfinite(w) and w >= 0):
            raise ValueError(f"{s.flag('retrieval_rows_weight')} must be a finite number >= 0, got {w}")
        if "retrieval_rows_weight" in self.model_fields_set and self.merge == ALIGNED and not self.calib_retrieval_mix:
            raise ValueError(f"{s.flag('retrieval_rows_weight')} weighs the retrieval examples' answer and needle "
                             f"rows: give {s.flag('calib_retrieval_mix')} P > 0 too")
        return self


class MQAOptions(KVMergeOptions):
    @model_validator(mode="after")
    def _one_head(self, info: ValidationInfo):
        if self.kv_heads not in (None, 1):
            s = spelling(info, type(self))
            raise ValueError(f"{s.kind('mqa')} means one K/V head; use {s.use('gqa', ['kv_heads'])} for more")
        return self


class GQAOptions(KVMergeOptions):
    @model_validator(mode="after")
    def _heads_given(self, info: ValidationInfo):
        require_size(self, spelling(info, type(self)), "gqa", "kv_heads")
        return self
