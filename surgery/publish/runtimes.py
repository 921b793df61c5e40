"""The model card's "Where it runs" section: the row of surgery/runs_in.py's table for this checkpoint's kind and
model_type (today's table, so a card written later says what is known then), each runtime's verdict with how it is
known, and what a runtime would silently change."""

from __future__ import annotations

from ..runs_in import RUNTIME_TITLES, RUNTIMES, SOURCE, row_for


def runs_in_row(record: dict | None, config: dict):
    """The table's row for a checkpoint: its surgery.json's kind (none: a source) and its config's model_type."""
    kind = (record or {}).get("kind") or SOURCE
    return row_for(kind if isinstance(kind, str) else SOURCE, config.get("model_type"))


def runs_in_section(record: dict | None, config: dict) -> list[str]:
    row = runs_in_row(record, config)
    if row is None:
        return []
    lines = ["## Where it runs", "",
             f"From surgery's runtime table ({row.title}): *verified* means a test of surgery shows it, *read* that "
             "the runtime's own source file says so (named, with the version read) and it was not run.", "",
             "| runtime | runs this model's function | how it is known |", "|---|---|---|"]
    for runtime in RUNTIMES:
        cell = row.cells[runtime]
        verdict = {"yes": "yes", "no": "no", "refused": "no: `surgery export` refuses it"}[cell.runs]
        where = ", ".join(f"`{w.strip()}`" for w in cell.where.split(";"))
        lines.append(f"| {RUNTIME_TITLES[runtime]} | {verdict} | {cell.how}: {where}"
                     f"{' (' + cell.note + ')' if cell.note else ''} |")
    lines.append("")
    for change in row.silent:
        lines += [f"**Caution:** {change}.", ""]
    return lines


def vllm_serves(record: dict | None, config: dict) -> bool:
    """Whether the table says vLLM runs this checkpoint's function (verified or read)."""
    row = runs_in_row(record, config)
    return row is not None and row.cells["vllm"].runs == "yes"
