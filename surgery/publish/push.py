"""`surgery push DIR REPO_ID`: validate, write the model card, create the repo, upload.

The card is generated when DIR has no README.md, or when its README.md is one `surgery push` generated (it carries
card.MARKER): a card the user wrote or edited (marker removed) is uploaded as it is. A generated card is uploaded
from memory: push never writes into DIR (which may be a source checkpoint, or a folder the user keeps as is).

The token comes from HF_TOKEN or the cached login (huggingface_hub's own lookup); it is handed to the client
and never printed, logged or written anywhere (error messages are scrubbed of it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import SurgeryError
from ..logs import get_logger
from ..checkpoint.record import RECORD_FILE, public_record, read_record
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


def _network_errors() -> tuple[type[BaseException], ...]:
    """The HTTP client's transport errors (huggingface_hub 2.x speaks httpx2; older versions httpx or requests)."""
    errors = []
    for module, name in (("httpx2", "HTTPError"), ("httpx", "HTTPError"), ("requests", "RequestException")):
        try:
            errors.append(getattr(__import__(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def upload_operations(folder: Path, card_text: str | None) -> list:
    """One commit's files: everything in `folder` but hidden files and temporaries, the generated card (from
    memory, in place of the folder's README.md) when there is one, and surgery.json without its machine-local
    part (from memory: record.public_record). Each file must be a regular file inside `folder` (links within it,
    or a hub snapshot's into its blobs, are fine): a link elsewhere is refused in one line."""
    from huggingface_hub import CommitOperationAdd
    from huggingface_hub.utils import filter_repo_objects

    from ..checkpoint.source import inside_file

    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if not p.is_dir())
    from_memory = {}
    if card_text is not None:
        from_memory["README.md"] = card_text.encode()
    if (folder / RECORD_FILE).is_file():
        from_memory[RECORD_FILE] = (json.dumps(public_record(read_record(folder)), indent=2) + "\n").encode()
    uploaded = list(filter_repo_objects(names, ignore_patterns=IGNORE + list(from_memory)))
    for n in uploaded:  # a link to a file elsewhere on this machine would upload that file: refused, as side files are
        inside_file(folder, folder / n, "file")
    try:
        ops = [CommitOperationAdd(path_in_repo=n, path_or_fileobj=str(folder / n)) for n in uploaded]
    except OSError as e:
        raise SurgeryError(f"cannot read {e.filename or folder}: {e.strerror or e}") from None
    ops += [CommitOperationAdd(path_in_repo=n, path_or_fileobj=data) for n, data in from_memory.items()]
    return ops


def card_inputs(folder: Path, check_reports: list[Path] = (), bench_report: Path | None = None):
    """What the model card is built from (`build_card`): the folder validated, the check reports and the bench
    report read (each refused in one line)."""
    validation = validate_folder(Path(folder))
    reports = load_reports(list(check_reports))
    bench = None
    if bench_report is not None:
        from .reports import load_bench_report

        bench = load_bench_report(bench_report)
    return validation, reports, bench


def push_folder(folder: Path, repo_id: str, private: bool = False, revision: str | None = None,
                exist_ok: bool = False, message: str | None = None, check_reports: list[Path] = (),
                log=get_logger(__name__).info, bench_report: Path | None = None) -> PushResult:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise SurgeryError(f"repo id {repo_id!r} must be of the form owner/name")
    folder = Path(folder)
    token = _token()  # before validating: hashing a large folder first only to learn there is no token wastes time
    validation, reports, bench = card_inputs(folder, check_reports, bench_report)
    card = folder / "README.md"
    card_written = not card.exists() or MARKER in card.read_text(errors="replace")
    card_text = build_card(validation, repo_id, reports, bench=bench) if card_written else None
    if card_written:
        log(f"model card: generated, uploaded as README.md ({folder} itself is not modified)")
    record = validation.record or {}
    message = message or f"Upload {record.get('kind') or 'checkpoint'} made with surgery {record.get('version', '')}".strip()
    operations = upload_operations(folder, card_text)  # every file checked and hashed before the hub is contacted
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
        commit = api.create_commit(repo_id, operations=operations, commit_message=message,
                                   revision=revision, repo_type="model")
    except HfHubHTTPError as e:
        raise SurgeryError(f"cannot push to {repo_id}: {_scrub(str(e), token)}") from None
    except (OSError, ValueError, *_network_errors()) as e:  # an unreachable HF_ENDPOINT, a dropped connection
        raise SurgeryError(f"cannot push to {repo_id} at {_endpoint()}: {_scrub(str(e), token)}") from None
    return PushResult(str(url), commit.commit_url, revision or "main", card_written)
