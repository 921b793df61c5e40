"""The fields of `surgery check --json` and `surgery bench --json` reports that `push` puts in the model card, with
their types: a report edited or damaged by hand is refused (one line naming the file and the field) before anything
is uploaded, instead of a traceback half-way through writing the card. Unknown fields are allowed (newer reports)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr

Number = StrictFloat  # a number as JSON writes it (an integer too; not a string that looks like one, not a boolean)


class Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


class Compared(Loose):
    """The numbers of one comparison (the report itself, or one of its `texts`)."""

    text: Optional[StrictStr] = None
    tokens: Optional[StrictInt] = None
    max_abs_diff: Optional[Number] = None
    kl: Optional[Number] = None
    top1_agreement: Optional[Number] = None
    ppl_source: Optional[Number] = None
    ppl_converted: Optional[Number] = None


class PositionRow(Loose):
    positions: tuple[StrictInt, StrictInt]
    ppl_source: Number
    ppl_converted: Number
    ppl_ratio: Number
    kl: Number
    top1_agreement: Number


class MarginBucket(Loose):
    agreement: Optional[Number] = None
    steps: StrictInt = 0


class Generation(Loose):
    prompts: StrictInt
    new_tokens: StrictInt
    token_agreement: Number
    mean_first_divergence: Number
    forced_agreement: Optional[Number] = None
    forced_by_margin: list[MarginBucket] = []


class CheckReport(Compared):
    max_abs_diff: Number
    texts: Optional[list[Compared]] = None
    by_position: Optional[list[PositionRow]] = None
    generation: Optional[Generation] = None
    tasks: Optional[dict[str, Any]] = None
    exact: Optional[StrictBool] = None


class Median(Loose):
    median: Optional[Number]


class Side(Loose):
    """One model's measurements at one batch x context (the card's table reads these)."""

    prefill_tokens_per_s: Median
    decode_tokens_per_s: Median


class Ratios(Loose):
    prefill_tokens_per_s: Optional[Number]
    decode_tokens_per_s: Optional[Number]
    kv_cache_bytes: Optional[Number]
    peak_memory_bytes: Optional[Number]


class BenchRow(Loose):
    batch: StrictInt
    context: StrictInt
    source: Side
    converted: Side
    ratio: Ratios


class BenchReport(Loose):
    machine: dict[str, Any]
    results: list[BenchRow]
    engine: Optional[StrictStr] = None
    dtype: Optional[StrictStr] = None
    date: StrictStr = ""
    rounds: Optional[StrictInt] = None
    new_tokens: Optional[StrictInt] = None
    flash_attn: Optional[Literal["on", "off"]] = None  # llama.cpp's attention path (surgery bench --flash-attn)


def load_bench_report(path: Path) -> dict:
    """A `surgery bench --json` report, with the fields the card reads of the right types (else one line)."""
    from ..errors import SurgeryError
    from ..loaders import read_json, validated

    report = read_json(path, f"bench report {path}")
    if not isinstance(report, dict) or not isinstance(report.get("results"), list) or "machine" not in report:
        raise SurgeryError(f"{path} is not a `surgery bench --json` report")
    validated(BenchReport, report, f"bench report {path}")
    return report
