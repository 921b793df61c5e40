"""One step of an uptraining run as a model folder (`surgery snapshot RUN --step N --out X`): the checkpoint a run
kept (`--save-every N --keep-run-dir`, surgery/training/state.py) written as the run's own output would have been
written had the run stopped there, for measuring a recovery curve against training tokens.

The run folder's run.json names the input model; the step's weights are loaded into it as `--resume` loads them (the
kind's training form applied first, LoRA adapters wrapped with the run's rank, alpha and targets), then written as
`finish` writes the final output (surgery/training/output.py): adapters merged, the training form restored,
`model_io.save_uptrained` (the input's dtype, tensor names, side files and code), the input's surgery.json with an
"uptraining" record that says which step of which run this is. Nothing is read before the checkpoint's manifest
matches its files (sha256), and the folder is written beside --out and renamed into place.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint.atomic import atomic_output_dir, check_output_path, ordinary_permissions
from ..checkpoint.record import read_record, write_record
from ..checkpoint.source import Source, resolve_source, side_files
from ..errors import SurgeryError
from ..loaders import read_json, read_model
from ..logs import get_logger
from . import lora, model_io
from .metrics import read_metrics
from .options import stage_steps
from .plot import plot_metrics
from .run_folder import check_no_links
from .state import MANIFEST, PER_PROCESS, Manifest, RunStateFile, damage, read_model_file, shard_files, step_folders

log = get_logger(__name__)

RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
LATEST = "latest"
DIM0 = "Shard(dim=0)"  # FSDP2's placement of a parameter's shards (repr of torch.distributed.tensor.Shard(0))
REPLICATED = "Replicate()"


@dataclass
class Step:
    """A checkpoint of a run folder: its step number and folder, the run's options (run.json), its input model."""

    run_dir: Path
    run: dict
    number: int
    folder: Path
    source: Source


def read_run(run_dir: Path) -> dict:
    """run.json of an uptraining run folder; anything else is refused in one line (nothing followed outside it)."""
    run_dir = Path(run_dir)
    check_no_links(run_dir)
    if not run_dir.is_dir():
        raise SurgeryError(f"run folder {run_dir} does not exist" if not run_dir.exists() else
                           f"{run_dir} is not a folder: give an uptraining run folder (uptrain --run-dir)")
    if not (run_dir / RUN_FILE).is_file():
        raise SurgeryError(f"{run_dir} is not an uptraining run folder (no {RUN_FILE})")
    run = read_json(run_dir / RUN_FILE)
    needed = ("model", "tokens", "batch_tokens")
    if not isinstance(run, dict) or not all(isinstance(run.get(k), str if k == "model" else int) for k in needed):
        raise SurgeryError(f"corrupt {run_dir / RUN_FILE}: not the options of an uptraining run ({', '.join(needed)})")
    return run


def find_step(run_dir: Path, step: int | str) -> Step:
    """Checkpoint `step` (a number, or `latest`) of the run folder and the run's input model, checked before anything
    is read: a missing step names the steps there are."""
    run_dir = Path(run_dir)
    run = read_run(run_dir)
    steps = step_folders(run_dir / "checkpoints")  # (step, folder), oldest first
    if not steps:
        raise SurgeryError(f"{run_dir} holds no checkpoint (uptrain keeps them with --save-every N --keep-run-dir)")
    if step == LATEST:
        number, folder = steps[-1]
    else:
        found = dict(steps).get(int(step))
        if found is None:
            raise SurgeryError(f"{run_dir} has no checkpoint of step {step}; it has step(s) "
                               f"{', '.join(str(n) for n, _ in steps)}")
        number, folder = int(step), found
    model = Path(run["model"])
    if not model.is_dir():
        raise SurgeryError(f"the run's input model {model} (its {RUN_FILE}) is not a folder any more: a snapshot takes "
                           "its config, tokenizer and record from it")
    return Step(run_dir, run, number, folder, resolve_source(str(model)))


def check_intact(step: Step) -> bool:
    """The checkpoint's files match its manifest (sizes and sha256) and its step agrees with its name; returns
    whether it is per-process (FSDP shards). One line when it is damaged or partial."""
    problem = damage(step.folder)
    if problem is not None:
        raise SurgeryError(f"checkpoint of step {step.number} in {step.run_dir} is damaged: {problem}")
    manifest = read_model(step.folder / MANIFEST, Manifest)
    saved = read_model(step.folder / "run-state.json", RunStateFile)
    if not saved.step == manifest.step == step.number:
        raise SurgeryError(f"checkpoint {step.folder} says step {saved.step} in run-state.json, {manifest.step} in its "
                           "manifest: it was altered")
    return getattr(manifest, "layout", None) == PER_PROCESS


def gather_shards(folder: Path, processes: int) -> dict[str, torch.Tensor]:
    """The whole model from a per-process checkpoint: each tensor's shards of every process joined along dim 0
    (FSDP2's placement, as torch.chunk splits), a replicated one taken once; any other placement, or shards that do
    not make the recorded global shape, is refused in one line."""
    layouts = [read_json(folder / shard_files(r)[2]) for r in range(processes)]
    parts = [read_model_file(folder / shard_files(r)[0]) for r in range(processes)]
    whole = {}
    for name, entry in (layouts[0].get("model") or {}).items():
        placements = entry.get("placements")
        pieces = [p.get(name) for p in parts]
        if any(t is None for t in pieces):
            raise SurgeryError(f"checkpoint {folder}: {name!r} is missing from a process's shards")
        if placements in (None, [REPLICATED]):
            whole[name] = pieces[0]
        elif placements == [DIM0]:
            whole[name] = torch.cat(pieces, 0)
        else:
            raise SurgeryError(f"checkpoint {folder} holds {name!r} sharded as {', '.join(placements)}: only FSDP's "
                               f"dim-0 shards are gathered; let the run write its output (--resume)")
        if list(whole[name].shape) != list(entry.get("shape", [])):
            raise SurgeryError(f"checkpoint {folder}: the shards of {name!r} make {list(whole[name].shape)}, the "
                               f"model's is {entry.get('shape')}")
    return whole


def step_tensors(step: Step) -> dict[str, torch.Tensor]:
    """The step's model tensors by their in-memory names (the whole model; a per-process checkpoint gathered),
    read only after the manifest matched."""
    from safetensors import SafetensorError

    per_process = check_intact(step)
    try:
        if per_process:
            return gather_shards(step.folder, read_model(step.folder / MANIFEST, Manifest).processes)
        return read_model_file(step.folder / "model.safetensors")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, SafetensorError) as e:
        raise SurgeryError(f"cannot read checkpoint {step.folder}: {str(e).splitlines()[0]}") from None


def load_step(step: Step, tensors: dict[str, torch.Tensor], trusted: bool = False):
    """The input model with the step's weights, in its stored form: the run's training form and LoRA adapters as the
    run had them when it saved, the adapters merged and the form restored as `finish` does."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from ..kinds import find_kind

    source, run = step.source, step.run
    model = model_io.load_causal_lm(source, "model", trusted)
    kind = find_kind(read_record(source.folder), source.config)
    training_form = kind.training_form(model) if kind is not None else None
    if run.get("lora_rank"):
        model, _ = lora.wrap(model, run["lora_rank"], run.get("lora_alpha"), run.get("lora_targets"))
    try:
        set_model_state_dict(model, tensors, options=StateDictOptions(full_state_dict=True))
    except (RuntimeError, KeyError, ValueError) as e:
        raise SurgeryError(f"checkpoint {step.folder} does not fit its run's input model {source.folder}: "
                           f"{str(e).splitlines()[0]}") from None
    if run.get("lora_rank"):
        model = model.merge_and_unload()
    if training_form is not None:
        training_form.restore(model)
    return model


def schedule_steps(run: dict) -> tuple[int, int]:
    """(the align stage's steps, the end-to-end stage's steps) of a run's recorded options, as UptrainOptions counts
    them."""
    return stage_steps(run["tokens"], run["batch_tokens"], str(run.get("stage") or "kd").split(","),
                       run.get("align_tokens"))


def snapshot_record(step: Step, rows: list[dict]) -> dict:
    """The "uptraining" entry of the snapshot's surgery.json: which step of which run, the tokens seen, the run's
    options, whether the schedule had ended there, and the held-out perplexities measured up to it."""
    align, steps = schedule_steps(step.run)
    batch = step.run["batch_tokens"]
    evals = [m for m in rows if "eval_ppl" in m]
    return {
        "snapshot": {"step": step.number, "schedule_steps": steps, "intermediate": step.number < steps,
                     "checkpoint": f"{step.run_dir.name}/checkpoints/{step.folder.name}",
                     "local": {"run_dir": str(step.run_dir.absolute())}},
        "tokens": (align + step.number) * batch,  # the align stage's windows come first (UptrainOptions.align_steps)
        "steps": step.number,
        "kd_tokens": step.number * batch,
        "loss": step.run.get("loss"),
        "data": step.run.get("data"),
        "eval_data": step.run.get("eval_data"),
        "run_options": {k: v for k, v in step.run.items() if k != "model"},  # the input: the record's "input"
        "initial_eval_ppl": evals[0]["eval_ppl"] if evals else None,
        "eval_ppl": next((m["eval_ppl"] for m in evals if m.get("step") == step.number), None),  # measured at N
        "final_train_loss": next((m["loss"] for m in reversed(rows) if "loss" in m), None),
    }


def write_snapshot(run_dir: Path, step: int | str, out: Path, force: bool = False, trusted: bool = False,
                   max_shard_size: str = "5GB") -> dict:
    """Write checkpoint `step` of `run_dir` as the model folder `out`; returns its "uptraining" record."""
    found = find_step(run_dir, step)
    source = found.source
    check_output_path(out, force, source=source.folder, inputs=[("run", found.run_dir)])
    side_files(source.folder)  # the files the output copies: refused now, not after the load
    model_io.shipped_code_files(source.folder)
    if found.run.get("lora_rank"):
        lora.require_peft()
    model = load_step(found, step_tensors(found), trusted)
    rows = [m for m in read_metrics(found.run_dir / METRICS_FILE) if m.get("step", 0) <= found.number]
    uptraining = snapshot_record(found, rows)
    dtype = model_io.checkpoint_dtype(source.folder, source.config)
    with atomic_output_dir(out, force=force, source=source.folder) as tmp:
        model_io.save_uptrained(model, None, source, tmp, dtype, max_shard_size)
        (tmp / "uptrain_metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in rows))
        if rows:
            plot_metrics(rows, tmp / "uptrain.png", title=f"uptraining {source.spec} to step {found.number}")
        write_record(tmp, model_io.uptrained_record(source, uptraining))
        ordinary_permissions(tmp)
    return uptraining
