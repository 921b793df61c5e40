"""`surgery convert` once its options are validated: check the output path, resolve the source, let the kind
convert, and say what was written; or estimate what the conversion will need (--dry-run)."""

from __future__ import annotations

from pathlib import Path

from ..kinds import ConvertOptions, convert_options_model

RUNNER_OWNED = ("force", "revision")  # set by a recipe's runner, not by a recipe's convert step


def options_model() -> type[ConvertOptions]:
    return convert_options_model()


def convert_checkpoint(source: str, out: Path, options: ConvertOptions) -> str:
    """Convert `source` into `out`; returns the line that says what was written."""
    from ..checkpoint.atomic import check_output_path, output_parents
    from ..checkpoint.source import resolve_source

    check_output_path(out, options.force)
    src = resolve_source(source, revision=options.revision, allow_pickle=options.allow_pickle)
    check_output_path(out, options.force, source=src.folder)  # before any work: --out may not be or hold the source
    with output_parents(out):  # missing folders above --out made, and removed again if the conversion fails
        record = options.kind.convert(src, out, options.kind_options)
    return f"wrote {out}: {options.kind.summary(record, options.kind_options)}{prepared_note(src)}"


def prepared_note(src) -> str:
    """The time spent before converting (dequantizing a GGUF file), when it was noticeable."""
    if src.prepare_seconds >= 1:
        return f" (+ {src.prepare_seconds:.1f}s dequantizing the GGUF file, cached for next time)"
    return ""


def dry_run(source: str, options: ConvertOptions) -> dict:
    """The estimate `surgery convert --dry-run` prints ({"lines": [...]} and the numbers)."""
    from ..dry_run import convert_dry_run
    from ..checkpoint.source import resolve_source

    src = resolve_source(source, revision=options.revision, allow_pickle=options.allow_pickle)
    return convert_dry_run(src, options.kind, options.kind_options)
