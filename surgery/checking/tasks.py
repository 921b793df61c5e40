"""lm-evaluation-harness tasks on both models (`check --tasks`).

Perplexity can rank models differently from task scores, so `check --tasks hellaswag,arc_easy` also scores the source
and the converted model on lm-eval tasks. An entry of `--tasks` is a task or group name that lm-eval knows, or the path
of a task YAML file (or of a folder of them: every task defined there). The tasks and their data are loaded once,
before any model, so a name lm-eval does not know or data that cannot be had (offline, a hub dataset) is one line and
no model has been loaded. Then each model is scored while `check` holds it anyway: one model at a time, the model
object that `check` loaded (lm-eval never loads a checkpoint by name here, so the toolkit's trust rules hold).

A task YAML of your own may name Python code (`!function`): that runs because you named the file.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..errors import SurgeryError
from ..loaders import parse_yaml


@dataclass
class TaskSet:
    """The tasks of `--tasks`, loaded once: lm-eval's task dict and the names the report uses."""

    spec: str
    names: list[str]
    task_dict: dict
    limit: int | None


def _import_lm_eval():
    try:
        import lm_eval  # noqa: F401
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise SurgeryError("--tasks needs lm-evaluation-harness: pip install 'attention-surgery[eval]'") from None
    for name in ("lm-eval", "lm_eval"):  # its INFO lines would bury check's report
        logging.getLogger(name).setLevel(logging.WARNING)
    return TaskManager


class _TagKeepingLoader(yaml.SafeLoader):
    """A safe YAML loader that reads any `!tag` as plain data (nothing is constructed or imported)."""


_TagKeepingLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def _yaml_task_names(path: Path) -> list[str]:
    """The task names a local YAML file (or every YAML file of a folder) defines."""
    files = sorted(path.glob("*.yaml")) + sorted(path.glob("*.yml")) if path.is_dir() else [path]
    names = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise SurgeryError(f"--tasks: cannot read {f}: {str(e).splitlines()[0]}") from None
        # lm-eval's own tags (!function) are not needed to read the name: load with a loader that keeps them
        doc = parse_yaml(text, f"--tasks: {f}", loader=_TagKeepingLoader)
        task = doc.get("task") if isinstance(doc, dict) else None
        if isinstance(task, str):
            names.append(task)
        elif isinstance(doc, dict) and isinstance(doc.get("group"), str):
            names.append(doc["group"])
    if not names:
        raise SurgeryError(f"--tasks: {path} defines no task (a YAML file with a `task:` name)")
    return names


def parse_eval_tasks(spec: str) -> tuple[list[str], list[Path]]:
    """(task names, include paths) from `--tasks`: comma-separated names and YAML file/folder paths."""
    names, include = [], []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        path = Path(entry).expanduser()
        if entry.endswith((".yaml", ".yml")) or path.is_dir() or path.exists():
            if not path.exists():
                raise SurgeryError(f"--tasks: {entry} does not exist")
            include.append(path if path.is_dir() else path.parent)
            names += _yaml_task_names(path)
        else:
            names.append(entry)
    if not names:
        raise SurgeryError("--tasks names no task")
    return list(dict.fromkeys(names)), list(dict.fromkeys(include))


def load_tasks(spec: str, limit: int | None = None) -> TaskSet:
    """Parse `--tasks`, check every name is a task lm-eval knows and load the tasks' data (one line when it cannot)."""
    if limit is not None and limit < 1:
        raise SurgeryError(f"--tasks-limit must be at least 1 (got {limit})")
    names, include = parse_eval_tasks(spec)
    TaskManager = _import_lm_eval()
    manager = TaskManager(include_path=[str(p) for p in include] or None)
    known = set(manager.all_tasks)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SurgeryError(f"--tasks: lm-eval knows no task {', '.join(unknown)} (`lm-eval ls tasks` lists them; "
                           "or give a task YAML file)")
    try:
        task_dict = manager.load(names)
    except Exception as e:  # noqa: BLE001 - any failure to get a task's data (offline, missing file) is bad input
        first = (str(e).splitlines() or [type(e).__name__])[0][:300]
        raise SurgeryError(f"--tasks: the data of {', '.join(names)} could not be loaded ({type(e).__name__}: "
                           f"{first})") from None
    return TaskSet(spec, names, task_dict, limit)


def _numbers(metrics: dict) -> dict[str, float]:
    """lm-eval's "acc,none" / "acc_stderr,none" keys as {"acc": x, "acc_stderr": y}; numbers only."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            metric, _, filt = key.partition(",")
            out[metric if filt in ("", "none") else f"{metric},{filt}"] = float(value)
    return out


def score_eval_tasks(model, tokenizer, tasks: TaskSet, batch_size: int, device) -> dict[str, dict]:
    """{task: {metric: value}} of one loaded model (lm-eval's HFLM wrapped around the model object)."""
    from lm_eval.evaluator import evaluate
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=str(device))
    results = evaluate(lm=lm, task_dict=tasks.task_dict, limit=tasks.limit, log_samples=False,
                       bootstrap_iters=1000) or {}
    scores = {name: _numbers(m) for name, m in (results.get("results") or {}).items()}
    for name, n in (results.get("n-samples") or {}).items():
        if name in scores and isinstance(n, dict) and isinstance(n.get("effective"), int):
            scores[name]["samples"] = n["effective"]
    return scores


def compare_task_scores(source: dict[str, dict], converted: dict[str, dict]) -> dict[str, dict]:
    """{task: {"source": {...}, "converted": {...}}} for every task either model was scored on."""
    return {task: {"source": source.get(task, {}), "converted": converted.get(task, {})}
            for task in sorted(set(source) | set(converted))}


HEADLINE = ("acc_norm", "acc", "exact_match", "perplexity", "word_perplexity")


def headline(metrics: dict) -> str | None:
    """The metric a task is summarised by: the first of HEADLINE it has."""
    return next((m for m in HEADLINE if m in metrics), None)


def rows(report_tasks: dict) -> list[tuple[str, str, float, float]]:
    """(task, metric, source, converted) of each task's headline metric, for the printed report and the card (a
    report read back from JSON: anything not a number is left out)."""
    out = []
    for task, pair in report_tasks.items():
        if not isinstance(pair, dict):
            continue
        a, b = (pair.get(side) if isinstance(pair.get(side), dict) else {} for side in ("source", "converted"))
        metric = headline(a) or headline(b)
        if metric and all(isinstance(m.get(metric), (int, float)) for m in (a, b)):
            out.append((str(task), metric, float(a[metric]), float(b[metric])))
    return out
