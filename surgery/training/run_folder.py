"""The run folder (--run-dir: run.json, the checkpoints, metrics): refused when it cannot be used, started afresh, and
kept apart from the folders the run reads."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..checkpoint.atomic import local_inputs
from ..checkpoint.record import local_source_folder
from ..errors import SurgeryError
from ..loaders import read_json
from .options import TRAJECTORY_DEFAULTS, UptrainOptions


# What recipe_setup.resume_identity adds to the trajectory: a run saved before they were recorded resumes unchecked.
IDENTITY_KEYS = ("precision", "teacher_logprobs_store")


def input_folders(o: UptrainOptions, source_folder: Path, record: dict) -> list[tuple[str, Path]]:
    """The folders and files on this machine the run reads (the model, the teacher, the texts): the output and the
    run folder may be none of them, nor lie inside or hold one (the run folder is deleted by --force and after
    success)."""
    folders = [("source", Path(source_folder))]
    if o.teacher and Path(o.teacher).exists():
        folders.append(("teacher", Path(o.teacher)))
    if local_source_folder(record) is not None:
        folders.append(("teacher", local_source_folder(record)))
    if o.teacher_logprobs:
        folders.append(("--teacher-logprobs", Path(o.teacher_logprobs)))
    return folders + local_inputs("--data text", o.data) + local_inputs("--eval-data text", o.eval_data)


def recorded_data_workers(o: UptrainOptions) -> int | None:
    """The --data-workers a streamed run being resumed read with (its newest checkpoint's data position); None when
    there is none to read (not streamed, no checkpoint yet, unreadable: the resume's own checks say so later)."""
    from .stream import STATE_FILE

    steps = sorted((o.run_dir / "checkpoints").glob("step-*/" + STATE_FILE.format(rank=0)))
    try:
        workers = json.loads(steps[-1].read_text()).get("workers") if steps else None
    except (OSError, ValueError, AttributeError):
        return None
    return workers if isinstance(workers, int) and workers >= 0 else None


def check_no_links(run_dir: Path) -> None:
    """Nothing in a run folder is followed outside it: a run folder that is a symbolic link, or holds one (a
    metrics.jsonl or checkpoint pointing elsewhere, which a resume would rewrite or read), is refused."""
    if run_dir.is_symlink():
        raise SurgeryError(f"run folder {run_dir} is a symbolic link: give the folder itself (a run folder's files "
                           f"are never followed outside it)")
    if not run_dir.is_dir():
        return
    for root, dirs, files in os.walk(run_dir):
        for name in dirs + files:
            if (Path(root) / name).is_symlink():
                raise SurgeryError(f"run folder {run_dir} holds a symbolic link {Path(root, name).relative_to(run_dir)}"
                                   f": a run folder's files are never followed outside it; remove the link")


def check_run_dir(o: UptrainOptions, trajectory: dict) -> None:
    """Refuse a run folder that cannot be used: nothing is written here."""
    check_no_links(o.run_dir)
    run_json = o.run_dir / "run.json"
    if o.resume:
        if not run_json.exists():
            raise SurgeryError(f"--resume: {o.run_dir} holds no run to resume (no run.json)")
        try:
            saved = read_json(run_json)
            if not isinstance(saved, dict):
                raise SurgeryError(f"a JSON {type(saved).__name__}, not an object")
        except SurgeryError as e:
            raise SurgeryError(f"--resume: corrupt {run_json} ({str(e).splitlines()[0]}): start over with --force") from None
        saved = TRAJECTORY_DEFAULTS | saved  # a key newer than the run: the run had its default behaviour
        diff = sorted(k for k in trajectory if saved.get(k) != trajectory[k]
                      and (k in saved or k not in IDENTITY_KEYS))  # (a run saved before them: not recorded)
        if diff:
            detail = ", ".join(f"{k}: {saved.get(k)!r} -> {trajectory[k]!r}" for k in diff[:4])
            raise SurgeryError(f"--resume with different options than the run in {o.run_dir} ({detail})")
    elif o.run_dir.exists() and any(o.run_dir.iterdir()):
        if not o.force:
            raise SurgeryError(f"run folder {o.run_dir} holds an earlier run: --resume to continue it or --force to start over")
        if not run_json.exists():
            raise SurgeryError(f"--force would delete {o.run_dir}, which is not a surgery uptraining run folder")


def start_run_dir(o: UptrainOptions, trajectory: dict) -> None:
    """Main process, fresh run, once the inputs proved good: an empty run folder with run.json."""
    if o.run_dir.exists():
        shutil.rmtree(o.run_dir)
    o.run_dir.mkdir(parents=True)
    (o.run_dir / "run.json").write_text(json.dumps(trajectory, indent=2) + "\n")
