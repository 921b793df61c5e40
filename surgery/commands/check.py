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


def default_text(o: CheckOptions) -> bool:
    """Whether the check's text is the default one (pydoc): --retrieval-haystack auto then takes the noise."""
    return o.data == CheckOptions.model_fields["data"].default


def check_checkpoints(source: str, converted: str, options: CheckOptions, json_out: Path | None = None,
                      warn=get_logger(__name__).warning, show: bool = True) -> dict:
    """Compare, print the report (`show`; the Python API returns it instead), write it as JSON (`json_out`);
    CheckFailed when --expect exact is not met."""
    from ..checkpoint.atomic import write_json
    from ..checking.compare import check_counts, check_json_path, compare_checkpoints, precision_tolerance
    from ..checking.retrieval_spec import parse_lengths
    from ..checking.report_tables import print_report
    from ..data import load_texts
    from ..checkpoint.source import resolve_source

    o = options
    check_counts(o.tokens, o.seq_len, o.batch_size, o.generate)
    parse_lengths(o.retrieval_lengths)  # their form, before any checkpoint is read
    check_json_path(json_out)
    if o.plot:
        if not o.retrieval:
            raise SurgeryError("--plot draws the retrieval accuracy: it needs --retrieval TASKS")
        check_json_path(Path(o.plot))
    src = resolve_source(source, revision=o.revision, allow_pickle=o.allow_pickle)
    dst = resolve_source(converted, allow_pickle=o.allow_pickle)
    first, *more = o.data
    warn_same_domain(dst.folder, first, more, warn)
    chat = chat_format(o, src, dst)
    report = compare_checkpoints(src, dst, load_texts(first, text_field=o.text_field, chat=chat),
                                 more_texts=[(d, load_texts(d, text_field=o.text_field, chat=chat)) for d in more],
                                 tokens=o.tokens, seq_len=o.seq_len, batch_size=o.batch_size, device=o.device,
                                 dtype=o.dtype, precision=o.precision, trust_remote_code=o.trust_remote_code,
                                 trust_source_code=o.trust_source_code, allow_pickle=o.allow_pickle,
                                 tokenizer=o.tokenizer, generate=o.generate, prompt_len=o.prompt_len,
                                 prompts_file=Path(o.prompts) if o.prompts else None, layers=o.layers, data=first,
                                 tasks=o.tasks, tasks_limit=o.tasks_limit, retrieval=o.retrieval,
                                 retrieval_lengths=parse_lengths(o.retrieval_lengths),
                                 retrieval_samples=o.retrieval_samples, retrieval_haystack=o.retrieval_haystack,
                                 retrieval_batch=o.retrieval_batch, text_given=not default_text(o),
                                 documents=o.documents,
                                 warn=warn)
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
