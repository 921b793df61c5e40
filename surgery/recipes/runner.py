"""Run a recipe: each step runs the library function of the command of the same name (surgery/commands), with the
runner linking outputs to inputs.

Layout under the recipe's output folder: `NN-name/` for a step that writes a model (convert, uptrain) or a stored
teacher pass (teacher: read by the uptrain steps that name it, `teacher_logprobs: STEP`), `NN-name.json` for a check
report or a push record, and `recipe-state.json`, the record of finished steps.

Resuming: a step's fingerprint is the sha256 of its options that differ from their defaults (so an option added
to a command in a later version, at its default, leaves finished steps finished) and of the contents of its inputs
(the source, the model it reads, the reports it publishes). A finished step whose fingerprint is unchanged and whose
output is still on disk, unmodified, is skipped; anything else runs again, and so does every later step that reads
what it rewrote (their inputs change) — but not the others: a check that runs again, with more tokens or
--generate, does not re-run the training after it, which reads the converted model, not the report.
`--from STEP` re-runs STEP and what follows; the steps before it must be finished and unchanged.
An interrupted uptraining continues from its last checkpoint (`surgery uptrain --resume`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr

from ..checkpoint.atomic import local_inputs, missing_parents, remove_empty
from ..errors import SurgeryError
from ..logs import get_logger
from ..options import command_args
from .schema import Recipe, Step, runner_options

logger = get_logger(__name__)

STATE = "recipe-state.json"
MODEL_STEPS = ("convert", "uptrain")
FOLDER_STEPS = (*MODEL_STEPS, "teacher")  # steps whose output is a folder


class StepFailed(Exception):
    def __init__(self, step: str, code: int):
        super().__init__(f"step {step} failed (exit {code})")
        self.code = code


@dataclass
class PlannedStep:
    number: int
    step: Step
    input: str  # the model this step reads: the source spec for steps before the first conversion
    output: Path
    reports: list[Path] = field(default_factory=list)  # check reports a push publishes
    store: Path | None = None  # the teacher step's store an uptrain step reads (`teacher_logprobs: STEP`)

    @property
    def name(self) -> str:
        return self.step.name

    @property
    def kind(self) -> str:
        return self.step.kind

    def reads(self, outputs: set[Path]) -> bool:
        """Whether this step reads one of `outputs` (earlier steps' outputs): its model or a report it publishes."""
        return (Path(self.input) in outputs or any(r in outputs for r in self.reports)
                or (self.store is not None and self.store in outputs))


def plan_steps(recipe: Recipe, output: Path) -> list[PlannedStep]:
    planned, current, reports, stores = [], recipe.source.spec, [], {}
    for i, step in enumerate(recipe.validated_steps(), start=1):
        suffix = "" if step.kind in FOLDER_STEPS else ".json"
        out = output / f"{i:02d}-{step.name}{suffix}"
        if step.kind == "teacher":  # the teacher is the source, whatever the steps before made
            stores[step.name] = out
            planned.append(PlannedStep(i, step, recipe.source.spec, out))
            continue
        store = stores.get(step.options.teacher_logprobs) if step.kind == "uptrain" else None
        planned.append(PlannedStep(i, step, current, out, list(reports) if step.kind == "push" else [], store))
        if step.kind in MODEL_STEPS:
            current = str(out)
            reports = []  # reports describe the model they checked
        elif step.kind == "check":
            reports.append(out)
    return planned


# ---- command lines ---------------------------------------------------------------------------------------
def _option_args(ps: PlannedStep) -> list[str]:
    """The step's options as the command's flags (what `surgery run` shows and an accelerate launch runs); an uptrain
    step's `teacher_logprobs: STEP` is the teacher step's output folder."""
    if ps.store is not None:
        return [*command_args(ps.step.options, exclude=("name", "accelerate", "teacher_logprobs")),
                "--teacher-logprobs", str(ps.store)]
    return command_args(ps.step.options, exclude=("name", "accelerate"))


def command_line(recipe: Recipe, ps: PlannedStep, resume: bool = False) -> list[str]:
    """The `surgery ...` arguments this step runs (without the program name)."""
    src = recipe.source
    revision = ["--revision", src.revision] if src.revision else []
    opts = _option_args(ps)
    if ps.kind == "convert":
        first = ps.input == src.spec
        return ["convert", ps.input, "--out", str(ps.output), "--force", *(revision if first else []), *opts]
    if ps.kind == "check":  # code from the source or the model runs only if the step's options say so (trust_*)
        return ["check", src.spec, ps.input, "--json", str(ps.output), *revision, *opts]
    if ps.kind == "teacher":
        return ["teacher", ps.input, "--out", str(ps.output), "--force", *revision, *opts]
    if ps.kind == "uptrain":
        return ["uptrain", ps.input, "--out", str(ps.output), "--force", *(["--resume"] if resume else []), *opts]
    if ps.kind == "push":
        reports = [a for r in ps.reports for a in ("--check-report", str(r))]
        return ["push", ps.input, ps.step.options.repo_id, "--json", str(ps.output), *opts, *reports]
    raise SurgeryError(f"unknown step kind {ps.kind}")


def launch_prefix(recipe: Recipe, ps: PlannedStep) -> list[str] | None:
    launch = getattr(ps.step.options, "accelerate", None)
    if launch is None:
        return None
    prefix = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(launch.num_processes)]
    if launch.config_file:
        prefix += ["--config_file", str(recipe.relative(launch.config_file))]
    return prefix + ["-m", "surgery.cli"]


# ---- fingerprints and state ------------------------------------------------------------------------------
def folder_digest(folder: Path) -> str:
    """sha256 over the sha256 of every file of a model folder (cached per file by path, size, mtime, inode)."""
    from ..checkpoint.record import hashed_files
    from ..checkpoint.tensors import sha256_files

    folder = Path(folder)
    names = hashed_files(folder)
    digests = dict(zip(names, (d for _, d in sha256_files(folder / n for n in names))))
    return hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()


def output_digest(path: Path) -> str | None:
    path = Path(path)
    if path.is_dir():
        return folder_digest(path)
    if path.is_file():
        return hashlib.sha256(path.read_bytes()).hexdigest()
    return None


class StepRecord(BaseModel):
    """One step's entry in recipe-state.json, with the types the runner relies on."""

    model_config = ConfigDict(extra="allow")
    started: Optional[StrictStr] = None
    finished: StrictBool = False
    fingerprint: Optional[StrictStr] = None
    scheme: StrictInt = 1
    output: Optional[StrictStr] = None
    output_digest: Optional[StrictStr] = None
    seconds: Optional[StrictFloat] = None


class StateFile(BaseModel):
    model_config = ConfigDict(extra="allow")
    steps: dict[str, StepRecord]


class State:
    def __init__(self, output: Path):
        self.path = Path(output) / STATE
        from ..loaders import read_json, validated

        if not self.path.exists():
            self.data = {"steps": {}}
            return
        try:
            self.data = read_json(self.path)
        except SurgeryError as e:
            raise SurgeryError(f"{e}; delete it to run every step again") from None
        steps = self.data.get("steps") if isinstance(self.data, dict) else None
        if not isinstance(steps, dict) or not all(isinstance(v, dict) for v in steps.values()):
            raise SurgeryError(f"{self.path} is not a recipe state (a JSON object with a \"steps\" object); delete "
                               "it to run every step again")
        try:
            validated(StateFile, self.data, str(self.path))
        except SurgeryError as e:
            raise SurgeryError(f"{e}; delete it to run every step again") from None

    def get(self, name: str) -> dict:
        return self.data["steps"].get(name, {})

    def set(self, name: str, **values) -> None:
        self.data["steps"].setdefault(name, {}).update(values)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.data, indent=2) + "\n")
        os.replace(tmp, self.path)


SCHEME = 2  # how a state's fingerprints were computed (recorded with each step; a record without one is scheme 1)


class Fingerprints:
    """Step fingerprints; the source's digest is computed once (it may need the source resolved first).

    Scheme 2 (2026-11-25) counts the options away from their defaults and, as inputs, the check reports of push
    steps alone. Scheme 1, what earlier versions recorded, counted every option and, for every step, the check
    reports written since the last model step: a finished step recorded that way is compared with a scheme-1
    fingerprint, so upgrading the toolkit does not re-run a finished conversion or training."""

    def __init__(self, recipe: Recipe, source_folder: Path | None, planned: list[PlannedStep]):
        self.recipe = recipe
        self.source_folder = source_folder
        self.planned = planned
        self._source = None

    def source(self) -> str | None:
        if self._source is None and self.source_folder is not None:
            s = self.recipe.source
            self._source = hashlib.sha256(f"{s.spec}\n{s.revision}\n{folder_digest(self.source_folder)}".encode()).hexdigest()
        return self._source

    def of(self, ps: PlannedStep, scheme: int = SCHEME) -> str | None:
        src = self.source()
        if src is None:
            return None
        inputs = {"source": src}
        if ps.input != self.recipe.source.spec:
            inputs["model"] = output_digest(Path(ps.input))
            if inputs["model"] is None:
                return None
        for r in (ps.reports if scheme >= 2 else self._reports_since_model_step(ps)):
            inputs[r.name] = output_digest(r)
        if ps.store is not None:  # the stored teacher pass it distils from
            inputs["teacher_logprobs"] = output_digest(ps.store)
            if inputs["teacher_logprobs"] is None:
                return None
        options = ps.step.options.model_dump(mode="json", exclude={"name"}, exclude_defaults=scheme >= 2)
        text = json.dumps({"kind": ps.kind, "options": options, "inputs": inputs}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def _reports_since_model_step(self, ps: PlannedStep) -> list[Path]:
        """Scheme 1's report inputs: the check reports written after the last model step before `ps`."""
        reports: list[Path] = []
        for other in self.planned[: self.planned.index(ps)]:
            if other.kind in MODEL_STEPS:
                reports = []
            elif other.kind == "check":
                reports.append(other.output)
        return reports


def is_done(state: State, ps: PlannedStep, fingerprints: Fingerprints, current: str | None = None) -> bool:
    """Finished, its output on disk unmodified, and its fingerprint (computed the way its record was) unchanged.
    `current`: the step's fingerprint in the current scheme when the caller has it already."""
    rec = state.get(ps.name)
    if not rec.get("finished") or rec.get("output_digest") is None:
        return False
    scheme = rec.get("scheme", 1)
    fingerprint = current if scheme == SCHEME and current is not None else fingerprints.of(ps, scheme)
    return (fingerprint is not None and rec.get("fingerprint") == fingerprint
            and output_digest(ps.output) == rec["output_digest"])


def find_step(planned: list[PlannedStep], key: str | None, option: str) -> int | None:
    if key is None:
        return None
    for i, ps in enumerate(planned):
        if key in (ps.name, str(ps.number)):
            return i
    raise SurgeryError(f"{option} {key}: no such step; the steps are {', '.join(ps.name for ps in planned)}")


def step_range(planned: list[PlannedStep], from_step: str | None, until: str | None) -> tuple[int, int]:
    """Indices of the first and last step `--from` / `--until` select (the plan and the run select alike)."""
    start = find_step(planned, from_step, "--from") or 0
    stop = find_step(planned, until, "--until")
    stop = len(planned) - 1 if stop is None else stop
    if stop < start:
        raise SurgeryError(f"--until {until} comes before --from {from_step}")
    return start, stop


# ---- running ---------------------------------------------------------------------------------------------
def resolve_source_folder(recipe: Recipe) -> Path:
    from ..checkpoint.source import resolve_source

    return resolve_source(recipe.source.spec, revision=recipe.source.revision).folder


def _invoke(recipe: Recipe, ps: PlannedStep, args: list[str], resume: bool, env_note=logger.info) -> None:
    prefix = launch_prefix(recipe, ps)
    env_note(f"$ surgery {shlex.join(args)}" if prefix is None else f"$ accelerate launch ... -m surgery.cli {shlex.join(args)}")
    if prefix is not None:
        result = subprocess.run([*prefix, *args])
        if result.returncode:
            raise StepFailed(ps.name, result.returncode)
        return
    try:
        run_step(recipe, ps, resume, log=env_note)
    except SurgeryError as e:
        code = getattr(e, "code", 2)
        if code != 2:  # a command's own failure (check --expect exact: exit 1), said as the command says it
            logger.error(str(e))
            raise StepFailed(ps.name, code) from None
        raise SurgeryError(f"step {ps.name}: {e}") from None
    except ModuleNotFoundError as e:  # a conversion this installation does not have yet
        if not (e.name or "").startswith("surgery"):
            raise
        raise SurgeryError(f"step {ps.name}: this installation of surgery has no {e.name} module, "
                           f"so `surgery {shlex.join(args[:1])}` cannot do this step") from None


def run_step(recipe: Recipe, ps: PlannedStep, resume: bool = False, log=logger.info) -> None:
    """Run one step in this process by calling the command's library function (surgery/commands) with the step's
    options and what the runner links in (the step's input, its output, the source's revision)."""
    from ..commands import check, convert, push, teacher, uptrain

    revision = recipe.source.revision
    if ps.kind == "convert":
        first = ps.input == recipe.source.spec
        options = runner_options("convert", ps.step.options, force=True, revision=revision if first else None)
        log(convert.convert_checkpoint(ps.input, ps.output, options))
    elif ps.kind == "check":
        options = runner_options("check", ps.step.options, revision=revision)
        check.check_checkpoints(recipe.source.spec, ps.input, options, json_out=ps.output,
                                warn=logger.warning)
    elif ps.kind == "teacher":
        o = ps.step.options
        values = o.model_dump(exclude={"name", "top_k", "device", "processes"}, exclude_unset=True)
        teacher.store_teacher_pass(ps.input, ps.output, teacher.UptrainArgs(**values, force=True), o.top_k,
                                   device=o.device, revision=revision, processes=o.processes)
    elif ps.kind == "uptrain":
        store = {"teacher_logprobs": str(ps.store)} if ps.store is not None else {}
        uptrain.uptrain_model(ps.input, ps.output, runner_options("uptrain", ps.step.options, force=True, resume=resume,
                                                                  **store))
    elif ps.kind == "push":
        log(push.push_checkpoint(Path(ps.input), runner_options("push", ps.step.options), check_reports=ps.reports,
                                 json_out=ps.output, log=log))
    else:
        raise SurgeryError(f"unknown step kind {ps.kind}")


def recipe_inputs(recipe: Recipe, source_folder: Path | None) -> list[tuple[str, Path]]:
    """The folders and files on this machine a recipe reads: its source and the local teachers, stored teacher passes
    (not a teacher step's, which the recipe writes) and texts its steps name."""
    folders = [("source", source_folder)] if source_folder is not None else []
    steps = recipe.validated_steps()
    teacher_steps = {s.name for s in steps if s.kind == "teacher"}
    for step in steps:
        for name in ("teacher", "teacher_logprobs", "data", "eval_data", "calib"):
            if name == "teacher_logprobs" and getattr(step.options, name, None) in teacher_steps:
                continue
            folders += local_inputs(f"{step.name} {name}", getattr(step.options, name, None))
    return folders


def check_recipe_output(recipe: Recipe, output: Path, source_folder: Path | None) -> None:
    """The recipe's output (where every step writes, and --force replaces) is none of the folders it reads, nor
    inside or holding one."""
    from ..checkpoint.atomic import check_apart

    check_apart(output, "recipe output", recipe_inputs(recipe, source_folder),
                option="output (the recipe's `output`, --output or --set output=)")


def run_recipe(recipe: Recipe, output: Path, from_step: str | None = None, until: str | None = None,
               log=logger.info) -> list[tuple[str, str]]:
    """Run the recipe's steps in order; returns (step, 'ran'|'skipped') for each step considered."""
    output = Path(output).absolute()
    planned = plan_steps(recipe, output)
    start, stop = step_range(planned, from_step, until)
    source_folder = resolve_source_folder(recipe)
    check_recipe_output(recipe, output, source_folder)  # before the output folder or its state is made
    made = missing_parents(output / STATE)  # the output and the folders above it that this run makes
    output.mkdir(parents=True, exist_ok=True)
    try:
        return _run_steps(recipe, output, planned, start, stop, source_folder, from_step, log)
    except BaseException:
        state_file = output / STATE
        if made and [p.name for p in output.iterdir()] == [STATE]:  # no step left anything (to resume)
            state_file.unlink()
        remove_empty(made)  # a run that made its output and failed before writing anything leaves no folder
        raise


def _run_steps(recipe: Recipe, output: Path, planned: list, start: int, stop: int, source_folder: Path | None,
               from_step: str | None, log) -> list[tuple[str, str]]:
    state = State(output)
    fingerprints = Fingerprints(recipe, source_folder, planned)
    done: list[tuple[str, str]] = []
    for i, ps in enumerate(planned[: stop + 1]):
        fp = fingerprints.of(ps)
        if i < start:
            if not is_done(state, ps, fingerprints, fp):
                raise SurgeryError(f"--from {from_step}: step {ps.name} before it is not finished or its inputs "
                                   "changed; run without --from")
            done.append((ps.name, "skipped"))
            continue
        if from_step is None and is_done(state, ps, fingerprints, fp):  # the inputs as they are now, after any rerun
            log(f"[{ps.number}/{len(planned)}] {ps.name}: unchanged, skipped")
            if state.get(ps.name).get("scheme") != SCHEME and fp is not None:
                state.set(ps.name, fingerprint=fp, scheme=SCHEME)  # recorded the current way from now on
            done.append((ps.name, "skipped"))
            continue
        rec = state.get(ps.name)
        resume = (ps.kind == "uptrain" and rec.get("started") == fp
                  and (ps.output.parent / f"{ps.output.name}.run" / "run.json").exists())
        log(f"[{ps.number}/{len(planned)}] {ps.name}" + (" (resuming)" if resume else ""))
        state.set(ps.name, started=fp, finished=False)
        t0 = time.time()
        _invoke(recipe, ps, command_line(recipe, ps, resume=resume), resume, env_note=log)
        if not ps.output.exists():
            raise SurgeryError(f"step {ps.name} finished without writing {ps.output}")
        state.set(ps.name, fingerprint=fingerprints.of(ps) if fp is None else fp, scheme=SCHEME, finished=True,
                  output=str(ps.output), output_digest=output_digest(ps.output), seconds=round(time.time() - t0, 1))
        done.append((ps.name, "ran"))
    return done
