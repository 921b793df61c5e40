"""`surgery push DIR REPO_ID`: validate, write the model card, create the repo, upload.

The card is written when DIR has no README.md, or rewritten when its README.md is one `surgery push` wrote
(it carries card.MARKER): a card the user wrote or edited (marker removed) is uploaded as it is.

The token comes from HF_TOKEN or the cached login (huggingface_hub's own lookup); it is handed to the client
and never printed, logged or written anywhere (error messages are scrubbed of it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import SurgeryError
from .card import MARKER, build_card, load_reports
from .validate import validate_folder

IGNORE = [".*", "**/.*", "__pycache__", "**/__pycache__/**", "*.tmp"]


@dataclass
class PushResult:
    repo_url: str
    commit_url: str
    revision: str
    card_written: bool


def _token() -> str:
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise SurgeryError("no Hugging Face token: set HF_TOKEN or log in with `hf auth login`")
    return token


def _scrub(message: str, token: str) -> str:
    return message.replace(token, "***").splitlines()[0] if message else "unknown error"


def push_folder(folder: Path, repo_id: str, private: bool = False, revision: str | None = None,
                exist_ok: bool = False, message: str | None = None, check_reports: list[Path] = (),
                log=print, bench_report: Path | None = None) -> PushResult:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise SurgeryError(f"repo id {repo_id!r} must be of the form owner/name")
    folder = Path(folder)
    validation = validate_folder(folder)
    reports = load_reports(list(check_reports))
    bench = None
    if bench_report is not None:
        from ..bench import load_report

        bench = load_report(bench_report)
    token = _token()

    card = folder / "README.md"
    card_written = not card.exists() or MARKER in card.read_text(errors="replace")
    if card_written:
        card.write_text(build_card(validation, repo_id, reports, bench=bench))
        log(f"wrote the model card {card}")
    record = validation.record or {}
    message = message or f"Upload {record.get('kind') or 'checkpoint'} made with surgery {record.get('version', '')}".strip()
    api = HfApi(token=token)
    try:
        try:
            url = api.create_repo(repo_id, private=private, exist_ok=exist_ok, repo_type="model")
        except HfHubHTTPError as e:
            if e.response is not None and e.response.status_code == 409:
                raise SurgeryError(f"repository {repo_id} already exists (pass --exist-ok to upload into it)") from None
            raise
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        commit = api.upload_folder(folder_path=folder, repo_id=repo_id, revision=revision, commit_message=message,
                                   ignore_patterns=IGNORE)
    except HfHubHTTPError as e:
        raise SurgeryError(f"cannot push to {repo_id}: {_scrub(str(e), token)}") from None
    except (OSError, ValueError) as e:
        raise SurgeryError(f"cannot push to {repo_id}: {_scrub(str(e), token)}") from None
    return PushResult(str(url), commit.commit_url, revision or "main", card_written)
