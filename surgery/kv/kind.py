"""mqa and gqa: merge each group of K/V heads into one (mean / first / random: streamed tensor surgery; aligned:
activation-aware, calibrated layer by layer). The output is a standard checkpoint of the source's family."""

from __future__ import annotations

from pathlib import Path

from ..arch import Feature
from ..kinds.base import Kind
from .options import ALIGNED, MERGES, GQAOptions, KVMergeOptions, MQAOptions
from .refusals import ALIGNED_LABEL, ALIGNED_REFUSES, PLAIN_LABEL, PLAIN_REFUSES


class KVMerge(Kind):
    def refusals(self) -> dict[str, dict[Feature, str]]:
        return {PLAIN_LABEL: PLAIN_REFUSES, ALIGNED_LABEL: ALIGNED_REFUSES}

    def calibrates(self, options: KVMergeOptions) -> bool:
        return options.merge == ALIGNED

    def convert(self, source, out: Path, options: KVMergeOptions) -> dict:
        if options.merge == ALIGNED:
            from .aligned import convert_aligned

            return convert_aligned(source, out, options)
        from .convert import convert_to_kv_heads

        return convert_to_kv_heads(source, out, options)

    def summary(self, record: dict, options: KVMergeOptions) -> str:
        kv = record["kv_heads"]
        return (f"{record['kind']} ({kv['before']} -> {kv['after']} K/V heads, {options.merge} merge) "
                f"in {record['seconds']:.1f}s")

    def converted_kv_heads(self, options: KVMergeOptions, kv_heads: int) -> int:
        return options.groups

    def calibration_estimate(self, config: dict, options: KVMergeOptions, *, dtype: str, device: str, throughput=None):
        if not self.calibrates(options):
            return None
        from ..estimate import CalibratedCost, estimate_calibrated
        from .cost import aligned_layer_flops, fit_bytes

        assign = options.grouping == "similarity"
        cost = CalibratedCost(
            ALIGNED,
            lambda s, tokens, window: aligned_layer_flops(s, options.groups or 1, tokens, window, assign,
                                                          options.query_samples, options.refit_values),
            lambda s, chunk: fit_bytes(s, options.refit_values))
        return estimate_calibrated(config, cost, options.calib_tokens, dtype=dtype, device=device,
                                   window=options.calib_window, throughput=throughput, chunk=options.calib_chunk)

    def card_lines(self, record: dict) -> list[str]:
        method = record.get("method")
        return [f"K/V heads merged by: {MERGES.get(method, method)}."] if method else []


# `convert --list`'s columns: the plain merges and the aligned merge (surgery/kv/refusals.py)
SUPPORT_LABELS = (PLAIN_LABEL, ALIGNED_LABEL)
HELP = ("mqa/gqa with mean/first/random merges is pure tensor surgery, streamed tensor by tensor: the model is never "
        "built, so memory stays near the largest tensor. The output is a standard checkpoint that plain transformers "
        "(and vLLM) loads.")
MQA = KVMerge("mqa", MQAOptions, title="multi-query attention (one K/V head)", tags=["mqa", "multi-query-attention"],
              support_labels=SUPPORT_LABELS, help=HELP, example_options={})
GQA = KVMerge("gqa", GQAOptions, title="grouped-query attention", tags=["gqa", "grouped-query-attention"],
              support_labels=SUPPORT_LABELS, help=HELP, example_options={"kv_heads": 2})
