"""What the API's functions return: results, not lines."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator


class Report(Mapping):
    """A report as a read-only mapping (the JSON the command writes with `--json`) whose keys are also attributes:
    `report["kl"] == report.kl`."""

    def __init__(self, data: dict[str, Any]):
        self._data = dict(data)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_data"][name]
        except KeyError:
            raise AttributeError(f"{type(self).__name__} has no field {name!r}") from None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(sorted(self._data))})"

    def to_dict(self) -> dict[str, Any]:
        """A copy of the report as a plain dict (JSON-serialisable)."""
        return json.loads(json.dumps(self._data, default=str))


class CheckReport(Report):
    """The numbers `surgery check --json` writes: `max_abs_diff`, `mean_abs_diff`, `kl`, `top1_agreement`,
    `ppl_source`, `ppl_converted`, `tokens`, `tolerance`, `exact`, and with several texts `texts` (one entry each),
    with `generate` `generation`, with `layers` `layers`, with `tasks` `tasks`."""

    @property
    def passed_exact(self) -> bool:
        """Whether the largest |Δlogits| is within the tolerance (`exact`)."""
        return bool(self._data.get("exact"))


class Estimate(Report):
    """What a dry run (`dry_run=True`) estimates, nothing run or written: `lines`, the lines the command's
    `--dry-run` prints (also `str(estimate)`), and, for `convert`, the numbers its `--json` writes."""

    def __str__(self) -> str:
        return "\n".join(self._data["lines"])


class RecipePlan(Report):
    """The plan `surgery run --dry-run` prints, nothing run or written: `recipe`, `source`, `output`, `hardware`
    and `steps` (each step's number, name, command, status, tokens, peak memory, size, texts read); `.show()` prints
    it as the command does."""

    def show(self) -> None:
        """Print the plan's tables on stdout, as `surgery run --dry-run` does."""
        from ..recipes.plan import print_plan

        print_plan(self._data)


class InspectReport(Report):
    """The numbers `surgery inspect --json` prints for one checkpoint: heads, K/V heads, parameters, KV-cache bytes
    per token and at the context, attention MACs."""


def _read_record(folder: Path) -> dict[str, Any]:
    path = folder / "surgery.json"
    return json.loads(path.read_text()) if path.is_file() else {}


@dataclass
class _Checkpoint:
    folder: Path
    record: dict[str, Any] = field(repr=False)

    def load(self, *, trust_remote_code: bool = False, **kwargs: Any):
        """The checkpoint as a transformers model (`AutoModelForCausalLM.from_pretrained`, keyword arguments passed
        on: `dtype=`, `device_map=`, ...).

        The modeling code the toolkit itself wrote into the folder (talking-heads, SwitchHead; recognised by its
        sha256 against the code this version ships and the one surgery.json recorded) runs without asking; any
        other code the folder ships needs `trust_remote_code=True`.

        Raises:
            SurgeryError: the folder ships code that is not the toolkit's own and `trust_remote_code` is False.
        """
        from transformers import AutoModelForCausalLM

        from ..trust import resolve_trust

        trust = resolve_trust(self.folder, trust_remote_code, flag="trust_remote_code=True", what=str(self.folder))
        return AutoModelForCausalLM.from_pretrained(self.folder, trust_remote_code=trust, **kwargs)

    def load_tokenizer(self, **kwargs: Any):
        """The checkpoint's tokenizer (`AutoTokenizer.from_pretrained`)."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.folder, **kwargs)

    def __fspath__(self) -> str:
        return str(self.folder)


@dataclass
class ConversionResult(_Checkpoint):
    """A finished conversion.

    Attributes:
        folder: The converted checkpoint's folder.
        record: Its surgery.json (the source, the kind, the options, the calibration, the files' sha256).
        kind: The conversion kind (`gqa`, `mqa`, `mla`, ...).
        message: The line `surgery convert` prints.
    """

    kind: str = ""
    message: str = ""

    @classmethod
    def read(cls, folder: Path, kind: str, message: str) -> "ConversionResult":
        return cls(folder=Path(folder), record=_read_record(Path(folder)), kind=kind, message=message)


@dataclass
class UptrainResult(_Checkpoint):
    """A finished uptraining run.

    Attributes:
        folder: The trained checkpoint's folder.
        record: Its surgery.json; `record["uptraining"]` is this run's record.
        metrics: The rows of `uptrain_metrics.jsonl` (training loss, learning rate, held-out loss and perplexity).
    """

    metrics: list[dict[str, Any]] = field(default_factory=list, repr=False)

    @property
    def uptraining(self) -> dict[str, Any]:
        """This run's record (`record["uptraining"]`)."""
        return self.record.get("uptraining") or {}

    @classmethod
    def read(cls, folder: Path) -> "UptrainResult":
        folder = Path(folder)
        path = folder / "uptrain_metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
        return cls(folder=folder, record=_read_record(folder), metrics=rows)


@dataclass
class PushResult:
    """An upload to the hub.

    Attributes:
        repo_id: The repository (owner/name).
        repo_url: Its URL.
        revision: The branch uploaded to.
        commit_url: The commit's URL.
        card_written: Whether the toolkit wrote the model card.
    """

    repo_id: str
    repo_url: str
    revision: str
    commit_url: str
    card_written: bool


@dataclass
class RecipeResult:
    """A recipe run.

    Attributes:
        output: The recipe's output folder.
        steps: (step name, "ran" or "skipped") for each step, in order.
    """

    output: Path
    steps: list[tuple[str, str]]


@dataclass
class TeacherStore:
    """A stored teacher pass (`surgery teacher`), for `uptrain(..., teacher_logprobs=store.folder)`.

    Attributes:
        folder: The store's folder.
        manifest: Its manifest.json: the teacher's and tokenizer's identity, the windows' spec, K, the windows.
    """

    folder: Path
    manifest: dict[str, Any] = field(repr=False)

    @property
    def bytes_per_token(self) -> int:
        return self.manifest["bytes_per_token"]

    @property
    def windows(self) -> int:
        return self.manifest["windows"]

    @property
    def tokens(self) -> int:
        return self.manifest["tokens"]

    def __fspath__(self) -> str:
        return str(self.folder)

    @classmethod
    def read(cls, folder: Path) -> "TeacherStore":
        return cls(folder=Path(folder), manifest=json.loads((Path(folder) / "manifest.json").read_text()))
