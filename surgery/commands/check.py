"""`surgery check` once its options are validated: compare CONVERTED with SOURCE on the same tokens."""

from __future__ import annotations

from pathlib import Path

from ..checking.options import CheckOptions  # noqa: F401 - the command's options, where callers import them
from ..errors import SurgeryError
from ..logs import get_logger

RUNNER_OWNED = ("revision",)  # a recipe's check compares its source (at the recipe's revision) with the step's input


class CheckFailed(SurgeryError):
    """The comparison ran but the converted model is not what --expect asked for (exit 1)."""

    code = 1


def warn_same_domain(folder: Path, first: str, more: list[str], warn) -> None:
    """One line when the check's only text is a source the converted model was calibrated or trained on: its numbers
    then measure the fit to that domain, not the recovery of the source model."""
    from ..checking.overlap import shared_source
    from ..general_text import resolve_text

    why = None if more else shared_source(folder, resolve_text(first))
    if why:
        warn(f"{first}, the only text checked, is the text the model was {why} on (surgery.json): its numbers "
             "flatter the conversion; add a --data of another domain")


def chat_format(o: CheckOptions, src, dst):
    """How conversations in the check's texts are rendered: with the chat template of the tokenizer that encodes
    the text (the source's unless --tokenizer converted), per --chat-template."""
    from ..chat import ChatFormat
    from ..runtime import load_tokenizer

    if o.chat_template == "off":
        return ChatFormat("off")
    converted = o.tokenizer == "converted"
    return ChatFormat(o.chat_template, load_tokenizer(dst if converted else src, trust_remote_code=(
        o.trust_remote_code if converted else o.trust_source_code)))


def check_checkpoints(source: str, converted: str, options: CheckOptions, json_out: Path | None = None,
                      warn=get_logger(__name__).warning, show: bool = True) -> dict:
    """Compare, print the report (`show`; the Python API returns it instead), write it as JSON (`json_out`);
    CheckFailed when --expect exact is not met. `options` were validated when they were built (every rule that needs
    no checkpoint); the output files are checked here, before any checkpoint is resolved."""
    from ..checkpoint.atomic import check_output_file, write_json
    from ..checking.compare import compare_checkpoints, precision_tolerance
    from ..checking.report_tables import print_report
    from ..data import load_texts
    from ..checkpoint.source import resolve_source

    o = options
    check_output_file(json_out, "--json")
    check_output_file(Path(o.plot) if o.plot else None, "--plot")
    src = resolve_source(source, revision=o.revision, allow_pickle=o.allow_pickle)
    dst = resolve_source(converted, allow_pickle=o.allow_pickle)
    first, *more = o.data
    warn_same_domain(dst.folder, first, more, warn)
    chat = chat_format(o, src, dst)
    report = compare_checkpoints(src, dst, load_texts(first, text_field=o.text_field, chat=chat), o, warn=warn,
                                 more_texts=[(d, load_texts(d, text_field=o.text_field, chat=chat)) for d in more])
    tol = o.atol if o.atol is not None else precision_tolerance(report["precision"])
    worst = max(t["max_abs_diff"] for t in report.get("texts", [report]))
    report["tolerance"] = tol
    report["exact"] = worst <= tol
    if show:
        print_report(report, title=f"{source}  vs  {converted}")
    if json_out:
        write_json(report, json_out)
    if o.plot and report.get("retrieval"):
        from ..checkpoint.atomic import write_bytes_atomic
        from ..checking.retrieval_report import plot

        write_bytes_atomic(Path(o.plot), plot(report["retrieval"], f"{source} vs {converted}"), "--plot")
    if o.expect == "exact" and not report["exact"]:
        raise CheckFailed(f"not exact: max |Δlogits| {worst:.3g} > tolerance {tol:g}")
    return report
