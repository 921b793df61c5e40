"""The metrics of one measured round, and their medians, spread and converted / source ratios over the rounds."""

from __future__ import annotations

import statistics

METRICS = ("prefill_s", "prefill_tokens_per_s", "decode_step_s", "decode_tokens_per_s", "kv_cache_bytes",
           "peak_memory_bytes")
# For the table: which way is better (True: higher).
HIGHER_IS_BETTER = {"prefill_tokens_per_s": True, "decode_tokens_per_s": True, "prefill_s": False,
                    "decode_step_s": False, "kv_cache_bytes": False, "peak_memory_bytes": False}


def derived(raw: dict, batch: int, context: int, prefill_batch: int | None = None) -> dict:
    """The metrics of one measured round (`prefill_batch`: the rows the prefill ran on, default `batch`)."""
    steps = raw["decode_steps_s"]
    step = statistics.median(steps) if steps else None
    decode_total = sum(steps)
    return {
        "prefill_s": raw["prefill_s"],
        "prefill_tokens_per_s": (prefill_batch or batch) * context / raw["prefill_s"],
        "decode_step_s": step,
        "decode_tokens_per_s": batch * len(steps) / decode_total if decode_total > 0 else None,
        "kv_cache_bytes": raw["kv_cache_bytes"],
        "peak_memory_bytes": raw["peak_memory_bytes"],
    }


def summarize(rounds: list[dict]) -> dict:
    """Per metric: median, min, max and spread ((max - min) / median) over the rounds."""
    out = {}
    for key in METRICS:
        values = [r[key] for r in rounds if r.get(key) is not None]
        if not values:
            out[key] = {"median": None, "min": None, "max": None, "spread": None}
            continue
        med = statistics.median(values)
        out[key] = {"median": med, "min": min(values), "max": max(values),
                    "spread": (max(values) - min(values)) / med if med else 0.0}
    return out


def ratios(source: dict, converted: dict) -> dict:
    """converted / source of each metric's median (None where either is missing or zero)."""
    out = {}
    for key in METRICS:
        a, b = source[key]["median"], converted[key]["median"]
        out[key] = b / a if a and b is not None else None
    return out
