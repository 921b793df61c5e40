"""`surgery push` once its options are validated: validate the folder, write its card, upload it."""

from __future__ import annotations

from pathlib import Path

from pydantic import field_validator

from ..logs import get_logger
from ..options import CliModel, option

RUNNER_OWNED = ()


def hub_repo_id(v: str) -> str:
    """owner/name as the hub allows it (huggingface_hub's validate_repo_id: no `..`, `--`, leading or trailing
    `-`/`.`, at most 96 characters of [A-Za-z0-9_.-]), refused when the options load (a recipe: when it loads)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(v, str) or v.count("/") != 1 or not all(v.split("/")):
        raise ValueError(f"repo id {v!r} must be of the form owner/name")
    try:
        validate_repo_id(v)
    except HFValidationError as e:
        raise ValueError(f"repo id {v!r} is not a hub repository name: {str(e).splitlines()[0]}") from None
    return v


class PushOptions(CliModel):
    repo_id: str = option(None, "--repo-id", "Hub repository (owner/name).", required=True, argument=True)
    private: bool = option(False, "--private", "Create the repository private.")
    revision: str | None = option(None, "--revision", "Branch to upload to (created from main when missing; default "
                                                      "main).")
    exist_ok: bool = option(False, "--exist-ok", "Upload into a repository that already exists.")
    message: str | None = option(None, "--message", "Commit message (default: names the conversion).")
    bench_report: str | None = option(None, "--bench-report", "A `surgery bench --json` report to put in the model "
                                                              "card (measured speed table).", path="any")

    @field_validator("repo_id")
    @classmethod
    def _repo_id(cls, v: str) -> str:
        return hub_repo_id(v)


def push_checkpoint(folder: Path, options: PushOptions, check_reports: list[Path] = (), json_out: Path | None = None,
                    log=get_logger(__name__).info) -> str:
    """Upload `folder`; returns the line that says where it went."""
    return pushed_line(folder, push_result(folder, options, check_reports, json_out, log))


def pushed_line(folder: Path, result) -> str:
    """The line that says where an upload (push_result's result) went."""
    return f"pushed {folder} to {result.repo_url} ({result.revision}): {result.commit_url}"


def push_result(folder: Path, options: PushOptions, check_reports: list[Path] = (), json_out: Path | None = None,
                log=get_logger(__name__).info):
    """Upload `folder`; returns the upload's result (surgery.publish.push: repo_url, revision, commit_url,
    card_written), also written as JSON (`json_out`)."""
    from ..checkpoint.atomic import check_output_file, write_json
    from ..publish.push import push_folder

    o = options
    check_output_file(json_out, "--json")  # before the upload, not after it
    result = push_folder(folder, o.repo_id, private=o.private, revision=o.revision, exist_ok=o.exist_ok,
                         message=o.message, check_reports=list(check_reports), log=log,
                         bench_report=Path(o.bench_report) if o.bench_report else None)
    if json_out:
        write_json({"repo_id": o.repo_id, "repo_url": result.repo_url, "revision": result.revision,
                    "commit_url": result.commit_url, "card_written": result.card_written}, json_out)  # '-': the
        # result on stdout, not a log line (shown under -q too)
    return result
