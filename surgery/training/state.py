"""Checkpoints of a running uptraining, free of pickles: nothing in a run folder can run code when resumed.

A checkpoint `checkpoints/step-NNNNNNNN/` holds
- `model.safetensors`      the whole model (gathered from FSDP shards), tied weights once (aliases in its metadata);
- `optimizer.safetensors`  AdamW's state as tensors, its parameter groups as JSON in the metadata;
- `rng-R.safetensors`      process R's torch (and CUDA) generator states; Python's and NumPy's as JSON metadata;
- `run-state.json`         the run's position (`RunState`: the step, which fixes the learning rate — the schedule
                           is a function of the step, so there is no scheduler state — and, for packed data, the
                           data position; the sha256 of the packed data it indexes into);
- `data-R.json`            streamed data: process R's position in the stream (surgery/training/stream.py);
- `manifest.json`          written last: the size and sha256 of every file above.

Under FSDP (several processes, parameters sharded) a checkpoint is saved per process instead, without gathering
anything (layout "per-process" in the manifest): process R writes
- `model-rankR.safetensors` its shards of the parameters (the DTensors' local tensors), tied weights once;
- `optim-rankR.safetensors` its shards of AdamW's state, the parameter groups as JSON in the metadata;
- `shards-rankR.json`       the world size, and every tensor's global shape, local shape and placements;
and hashes its own files (the main process only merges the sizes and sha256 into the manifest). A resume reads
only its own process's files, and refuses (one line) a different number of processes: the shards are not
re-sharded. A checkpoint of the whole model (one process, DDP, or written before this layout) still resumes under
FSDP. The consolidated model is written once, at the end of the run (loop.py `save`).

Each checkpoint is written into `checkpoints/.tmp-step-NNNNNNNN`, flushed to disk, and renamed to `step-NNNNNNNN`
only when complete; a run killed at any moment leaves the previous checkpoints plus at most a temporary folder the
next start removes. The last K are kept. `--resume` takes the newest checkpoint whose manifest matches its files
and falls back to an older intact one (saying so) when the newest is damaged. All processes call `save` and
`load_latest` (the model and optimizer state are gathered and scattered with collectives); only the main process
writes the whole model's and optimizer's files, creates, renames and removes folders.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from ..checkpoint.sha256 import sha256_file
from ..errors import SurgeryError
from ..loaders import read_model
from ..logs import get_logger
from ..checkpoint.tensors import save_safetensors

log = get_logger(__name__)

STEP_DIR = re.compile(r"^step-(\d{8})$")
FORMAT = "surgery-uptrain-checkpoint/1"
MANIFEST = "manifest.json"
PER_PROCESS = "per-process"  # the manifest's "layout" of a checkpoint saved in shards, one set of files per process
OWNER = re.compile(r"-(?:rank)?(\d+)\.(?:safetensors|json)$")  # rng-R, data-R, model-rankR, ...: process R's files


def shard_files(rank: int) -> tuple[str, str, str]:
    """Process `rank`'s files of a per-process checkpoint: its model shards, its optimizer shards, their layout."""
    return f"model-rank{rank}.safetensors", f"optim-rank{rank}.safetensors", f"shards-rank{rank}.json"


def owner(name: str) -> int | None:
    """The process whose file `name` is (None: a file of the whole run)."""
    m = OWNER.search(name)
    return int(m.group(1)) if m else None


class RunStateFile(BaseModel):
    """run-state.json as read back: the fields RunState needs, with their types (a mistyped file is one line)."""

    model_config = ConfigDict(extra="allow")
    step: StrictInt = Field(ge=0)
    elapsed: float = Field(ge=0, allow_inf_nan=False)
    data_key: StrictStr


class FileEntry(BaseModel):
    size: StrictInt = Field(ge=0)
    sha256: StrictStr


class Manifest(BaseModel):
    """manifest.json: which files a checkpoint holds, their sizes and sha256."""

    model_config = ConfigDict(extra="allow")
    format: StrictStr
    files: dict[str, FileEntry]
    step: StrictInt | None = None  # checked against run-state.json and the folder's name on --resume


class RunState:
    """The run's position, saved with every checkpoint."""

    def __init__(self):
        self.step = 0  # optimizer steps done
        self.elapsed = 0.0  # training seconds so far (excluding evaluation and saving)
        self.data_key = ""  # which data the steps read (options, sources and their files)
        self.data_sha256 = ""  # packed data: the sha256 of the run folder's data cache the steps index into

    def state_dict(self) -> dict:
        return {"step": self.step, "elapsed": self.elapsed, "data_key": self.data_key, "data_sha256": self.data_sha256}

    def load_state_dict(self, state: dict) -> None:
        step = state["step"]
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step {step!r} is not a count of steps")
        self.step, self.elapsed, self.data_key = step, float(state["elapsed"]), str(state["data_key"])
        self.data_sha256 = str(state.get("data_sha256") or "")


# ------------------------------------------------------------------------------------ state dicts <-> files


def _state_options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def _split_aliases(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors sharing storage (tied weights) are stored once; the others are recorded as aliases."""
    first: dict[tuple, str] = {}
    tensors, aliases = {}, {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype) if t.numel() else None
        if key is not None and key in first:
            aliases[name] = first[key]
        else:
            if key is not None:
                first[key] = name
            tensors[name] = t.detach().contiguous()
    return tensors, aliases


def _optimizer_files(state: dict) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors, scalars = {}, {}
    for param, entries in state["state"].items():
        for key, value in entries.items():
            name = f"{param}\x1f{key}"  # unit separator: never part of a parameter name
            if isinstance(value, torch.Tensor):
                tensors[name] = value.detach().contiguous()
            else:
                scalars[name] = value
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in state["param_groups"]]
    return tensors, {"param_groups": json.dumps(groups), "scalars": json.dumps(scalars)}


def _optimizer_state(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict:
    state: dict[str, dict] = {}
    entries = list(tensors.items()) + list(json.loads(metadata["scalars"]).items())
    for name, value in entries:
        param, key = name.split("\x1f")
        state.setdefault(param, {})[key] = value
    groups = json.loads(metadata["param_groups"])
    for g in groups:
        if isinstance(g.get("betas"), list):
            g["betas"] = tuple(g["betas"])
    return {"state": state, "param_groups": groups}


def _rng_files() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = s
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return tensors, {"python": json.dumps([version, list(internal), gauss]),
                     "numpy": json.dumps([kind, keys.tolist(), int(pos), int(has_gauss), float(cached)])}


def _set_rng(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda.")), key=lambda k: int(k[5:]))]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    version, internal, gauss = json.loads(metadata["python"])
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = json.loads(metadata["numpy"])
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


# ------------------------------------------------------------------------------------------------ checking


def _fsync_tree(folder: Path) -> None:
    for root, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def damage(folder: Path, rank: int | None = None) -> str | None:
    """Why checkpoint `folder` cannot be resumed from ("FILE: reason"), or None when it is intact. With `rank`, only
    the files of the whole run and process `rank`'s own are read (a per-process checkpoint's other shards are the
    other processes' to check)."""
    manifest = folder / MANIFEST
    if not manifest.exists():
        return f"{manifest}: missing (an incomplete checkpoint, or one written by an older version)"
    try:
        record = read_model(manifest, Manifest)
    except SurgeryError as e:  # "corrupt MANIFEST: FIELD is ...": the file and the field
        return str(e)
    if record.format != FORMAT:
        return f"{manifest}: unreadable (not a checkpoint manifest of this toolkit)"
    files = {name: entry.model_dump() for name, entry in record.files.items()}
    if getattr(record, "layout", None) == PER_PROCESS:
        processes = getattr(record, "processes", None)
        if not isinstance(processes, int) or processes < 1:
            return f"{manifest}: corrupt (a per-process checkpoint without its number of processes)"
        ranks = range(processes) if rank is None else [rank]
        required = ["run-state.json", *(name for r in ranks if r < processes for name in shard_files(r))]
    else:
        required = ["model.safetensors", "optimizer.safetensors", "run-state.json"]
    for name in required:
        if name not in files:
            return f"{folder / name}: not in the manifest"
    if rank is not None:
        files = {name: entry for name, entry in files.items() if owner(name) in (None, rank)}
    for name, expect in files.items():
        path = folder / name
        if not path.is_file():
            return f"{path}: missing"
        if path.stat().st_size != expect.get("size"):
            return f"{path}: {path.stat().st_size} bytes, {expect.get('size')} when written (truncated or replaced)"
        if sha256_file(path) != expect.get("sha256"):
            return f"{path}: its sha256 differs from the one recorded when it was written (corrupt)"
    return None


def read_model_file(file: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's model tensors (`model.safetensors`, or a process's `model-rankR.safetensors`) by name, each tied
    weight stored once under its first name and given back under its aliases too (the same tensor)."""
    from safetensors import safe_open

    with safe_open(file, "pt") as f:
        aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
        model_state = {k: f.get_tensor(k) for k in f.keys()}
    model_state.update({alias: model_state[target] for alias, target in aliases.items()})
    return model_state


def _local(t):
    """A DTensor's local shard (FSDP2 parameters and their AdamW states); any other value as it is."""
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "placements") else t


def _layout(state: dict) -> dict:
    """Each tensor's global and local shape, dtype and placements, for a process's shards-rankR.json."""
    out = {}
    for name, t in state.items():
        if isinstance(t, torch.Tensor):
            out[name] = {"shape": list(t.shape), "local_shape": list(_local(t).shape),
                         "dtype": str(t.dtype).removeprefix("torch."),
                         "placements": [repr(p) for p in t.placements] if hasattr(t, "placements") else None}
    return out


def _to_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in tensors.items()}


def _like(templates: dict, loaded: dict, what: str) -> dict:
    """The loaded local shards as the templates' DTensors (same mesh, placements, global shape), or plain tensors on
    the templates' devices; a shard of another shape, a missing or an extra tensor is a KeyError/ValueError."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, t in templates.items():
        if not isinstance(t, torch.Tensor):
            out[name] = loaded.get(name, t)
            continue
        if name not in loaded:
            raise KeyError(f"{what} {name!r} is not in the checkpoint")
        v = loaded[name]
        expect = _local(t).shape
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(expect):
            raise ValueError(f"{what} {name!r}: the checkpoint's shard is {tuple(getattr(v, 'shape', ()))}, this "
                             f"process holds {tuple(expect)}")
        v = v.to(device=t.device, dtype=t.dtype)
        out[name] = (DTensor.from_local(v, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                        stride=t.stride()) if isinstance(t, DTensor) else v)
    extra = sorted(set(loaded) - set(templates))
    if extra:
        raise KeyError(f"{what} {extra[0]!r} of the checkpoint is not in this run")
    return out


def _gather_json(acc, value) -> list:
    """`value` (JSON) of every process, in process order (a byte tensor per process: nothing is pickled)."""
    data = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8)
    sizes = acc.gather(torch.tensor([data.numel()], device=acc.device)).cpu().tolist()
    padded = torch.zeros(1, max(sizes), dtype=torch.uint8)
    padded[0, : data.numel()] = data
    rows = acc.gather(padded.to(acc.device)).cpu()
    return [json.loads(bytes(rows[i, :n].tolist())) for i, n in enumerate(sizes)]


def _hashes(paths: list[Path]) -> dict:
    return {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in paths}


def step_folders(checkpoints: Path) -> list[tuple[int, Path]]:
    """The step checkpoints in a run's `checkpoints` folder (`step-NNNNNNNN`), oldest first: (step, folder)."""
    if not checkpoints.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in checkpoints.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir())


class Checkpoints:
    def __init__(self, run_dir: Path, keep_last: int, accelerator, per_process: bool | None = None):
        """`per_process`: save each process's shards (the default under FSDP) or gather the whole model to the main
        process (the default elsewhere; under FSDP the layout before per-process checkpoints, kept for comparison)."""
        from accelerate.utils import DistributedType

        self.dir = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last
        self.acc = accelerator
        self.sharded = accelerator.distributed_type == DistributedType.FSDP
        self.per_process = self.sharded if per_process is None else per_process

    def steps(self) -> list[tuple[int, Path]]:
        return step_folders(self.dir)

    def latest(self) -> Path | None:
        steps = self.steps()
        return steps[-1][1] if steps else None

    def remove_partial(self) -> None:
        """Drop temporary folders a killed run left behind (main process)."""
        if self.acc.is_main_process and self.dir.is_dir():
            for p in self.dir.glob(".tmp-step-*"):
                shutil.rmtree(p, ignore_errors=True)

    def _any(self, flag: bool) -> bool:
        """Whether `flag` holds on any process (a collective)."""
        return bool(self.acc.reduce(torch.tensor([1.0 if flag else 0.0], device=self.acc.device),
                                    reduction="sum").item())

    def _states(self, model, optimizer) -> tuple[dict, dict]:
        """The model's and the optimizer's state dicts: this process's shards (DTensors, per-process checkpoints) or
        the whole of them gathered to the main process's host memory (collectives: every process calls this)."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=False) if self.per_process else _state_options(cpu_offload=True)
        return (get_model_state_dict(model, options=options),
                get_optimizer_state_dict(model, optimizer, options=options))

    def _write_whole(self, tmp: Path, model_state: dict, optim_state: dict, state: RunState) -> list[Path]:
        """The whole model and optimizer state (gathered to the main process), written by the main process."""
        if not self.acc.is_main_process:
            return []
        tensors, aliases = _split_aliases(model_state)
        save_safetensors(tensors, tmp / "model.safetensors", metadata={"aliases": json.dumps(aliases)})
        del tensors, model_state
        tensors, meta = _optimizer_files(optim_state)
        save_safetensors(tensors, tmp / "optimizer.safetensors", metadata=meta)
        (tmp / "run-state.json").write_text(json.dumps(state.state_dict()) + "\n")
        return [tmp / "model.safetensors", tmp / "optimizer.safetensors", tmp / "run-state.json"]

    def _write_shards(self, tmp: Path, model_state: dict, optim_state: dict, state: RunState) -> list[Path]:
        """This process's shards of the model and the optimizer state (no collective moves a tensor), their layout."""
        rank, world = self.acc.process_index, self.acc.num_processes
        model_file, optim_file, layout_file = shard_files(rank)
        tensors, aliases = _split_aliases({k: _local(v) for k, v in model_state.items()})
        save_safetensors(_to_host(tensors), tmp / model_file, metadata={"aliases": json.dumps(aliases)})
        del tensors
        flat = {f"{p}\x1f{k}": v for p, e in optim_state["state"].items() for k, v in e.items()
                if isinstance(v, torch.Tensor)}
        local = {"state": {p: {k: _local(v) for k, v in e.items()} for p, e in optim_state["state"].items()},
                 "param_groups": optim_state["param_groups"]}
        tensors, meta = _optimizer_files(local)
        save_safetensors(_to_host(tensors), tmp / optim_file, metadata=meta)
        del tensors, local
        (tmp / layout_file).write_text(json.dumps({"rank": rank, "processes": world, "model": _layout(model_state),
                                                   "optimizer": _layout(flat)}) + "\n")
        written = [tmp / model_file, tmp / optim_file, tmp / layout_file]
        if self.acc.is_main_process:
            (tmp / "run-state.json").write_text(json.dumps(state.state_dict()) + "\n")
            written.append(tmp / "run-state.json")
        return written

    def save(self, step: int, model, optimizer, state: RunState, data_state: dict | None = None) -> Path:
        """Write checkpoint `step` atomically. A full disk (or any OSError) leaves the earlier checkpoints as they
        were, removes the partial folder and stops the run with one line."""
        final = self.dir / f"step-{step:08d}"
        tmp = self.dir / f".tmp-step-{step:08d}"
        main = self.acc.is_main_process
        error = None
        hashes: dict = {}

        def agree(err):  # every process learns whether any failed, so all stop together
            return err if err is not None else (OSError("another process failed") if self._any(False) else None)

        try:
            if main:
                self.dir.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
        except OSError as e:
            error = e
        error = agree(error)
        write = self._write_shards if self.per_process else self._write_whole
        model_state, optim_state = self._states(model, optimizer)
        try:
            if error is None:
                rng, rng_meta = _rng_files()
                written = [tmp / f"rng-{self.acc.process_index}.safetensors"]
                save_safetensors(rng, written[0], metadata=rng_meta)
                if data_state is not None:
                    written.append(tmp / f"data-{self.acc.process_index}.json")
                    written[-1].write_text(json.dumps(data_state) + "\n")
                written += write(tmp, model_state, optim_state, state)
                hashes = _hashes(written)  # each process hashes its own files
        except OSError as e:
            error = e
        error = agree(error)
        del model_state, optim_state
        every = _gather_json(self.acc, hashes if error is None else {})
        try:
            if main and error is None:
                files = dict(sorted({name: entry for h in every for name, entry in h.items()}.items()))
                layout = {"layout": PER_PROCESS} if self.per_process else {}
                (tmp / MANIFEST).write_text(json.dumps({"format": FORMAT, "step": step, **layout,
                                                        "processes": self.acc.num_processes, "files": files}) + "\n")
                _fsync_tree(tmp)
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
                _fsync_dir(self.dir)
                for _, old in self.steps()[: -self.keep_last]:
                    shutil.rmtree(old, ignore_errors=True)
        except OSError as e:
            error = e
        error = agree(error)
        if error is not None:
            if main:
                shutil.rmtree(tmp, ignore_errors=True)
            kept = [p.name for _, p in self.steps() if p != final]
            why = os.strerror(error.errno) if error.errno else str(error)
            raise SurgeryError(f"cannot write the checkpoint of step {step} in {self.dir}: {why}; nothing of it was "
                               f"kept" + (f", the last good checkpoint is {kept[-1]} (--resume continues from it)"
                                          if kept else ""))
        self.acc.wait_for_everyone()
        return final


    def _choose(self) -> Path:
        """The newest checkpoint intact on every process (each checks the run's files and its own; a collective)."""
        candidates = list(reversed(self.steps()))
        if not candidates:
            raise SurgeryError(f"--resume: no checkpoint in {self.dir}")
        problems = []
        for _, path in candidates:
            problem = damage(path, self.acc.process_index)
            if problem is not None:
                problems.append(problem)
            if not self._any(problem is not None):
                break
            if problem is None:
                problems.append(f"{path}: damaged in another process's files (that process names them)")
        else:
            raise SurgeryError(f"--resume: no intact checkpoint in {self.dir}: {problems[0]}"
                               + (f" (and {len(problems) - 1} older damaged)" if len(problems) > 1 else ""))
        mine = [p for p in problems if "another process" not in p]
        for p in mine if (self.acc.is_main_process or mine) else []:
            log.warning(f"skipping a damaged checkpoint: {p}")
        if problems and self.acc.is_main_process:
            log.warning(f"resuming from the older intact checkpoint {path.name}")
        return path

    def _read_whole(self, path: Path) -> tuple[dict, dict]:
        from safetensors import safe_open

        model_state = read_model_file(path / "model.safetensors")
        with safe_open(path / "optimizer.safetensors", "pt") as f:
            optim_state = _optimizer_state({k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {})
        return model_state, optim_state

    def _read_shards(self, path: Path) -> tuple[dict, dict]:
        """This process's shards (and nothing of the other processes')."""
        from safetensors import safe_open

        model_file, optim_file, _ = shard_files(self.acc.process_index)
        model_state = read_model_file(path / model_file)
        with safe_open(path / optim_file, "pt") as f:
            optim_state = _optimizer_state({k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {})
        return model_state, optim_state

    def _check_layout(self, path: Path) -> bool:
        """Whether checkpoint `path` is per-process; one that this run cannot take is refused in one line."""
        record = read_model(path / MANIFEST, Manifest)
        if getattr(record, "layout", None) != PER_PROCESS:
            return False
        saved, world = getattr(record, "processes", None), self.acc.num_processes
        if not self.sharded:
            raise SurgeryError(f"--resume: checkpoint {path} holds FSDP shards of {saved} processes; resume it under "
                               f"FSDP with {saved} processes")
        if saved != world:
            raise SurgeryError(f"--resume: checkpoint {path} holds the shards of {saved} processes, this run has "
                               f"{world}: resume with {saved} processes (shards are not re-sharded)")
        return True

    def load_latest(self, model, optimizer, state: RunState) -> Path:
        """Restore the newest intact checkpoint; a damaged newer one is named on stderr and skipped."""
        from safetensors import SafetensorError, safe_open
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict, set_model_state_dict,
                                                             set_optimizer_state_dict)

        path = self._choose()
        try:
            per_process = self._check_layout(path)
            model_state, optim_state = (self._read_shards if per_process else self._read_whole)(path)
            rng = None  # a process that did not exist when the checkpoint was written keeps its seeded generators
            if (path / f"rng-{self.acc.process_index}.safetensors").is_file():
                with safe_open(path / f"rng-{self.acc.process_index}.safetensors", "pt") as f:
                    rng = {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
            saved = read_model(path / "run-state.json", RunStateFile).model_dump()
            manifest_step = read_model(path / MANIFEST, Manifest).step
            state.load_state_dict(saved)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, SafetensorError) as e:
            # (a file that is no safetensors, a pickle with its sha256 in the manifest included: never unpickled)
            raise SurgeryError(f"--resume: cannot read checkpoint {path}: {str(e).splitlines()[0]}") from None
        if not state.step == manifest_step == int(STEP_DIR.match(path.name).group(1)):
            raise SurgeryError(f"--resume: checkpoint {path} says step {state.step} in run-state.json, "
                               f"{manifest_step} in its manifest: it was altered")
        try:
            if per_process:  # the shards into this process's DTensors (the same mesh and placements as when saved)
                options = StateDictOptions(full_state_dict=False)
                model_state = _like(get_model_state_dict(model, options=options), model_state, "parameter")
                templates = get_optimizer_state_dict(model, optimizer, options=options)
                if set(optim_state["state"]) != set(templates["state"]):
                    raise KeyError("the optimizer state's parameters differ from this run's")
                optim_state["state"] = {p: _like(templates["state"][p], e, f"optimizer state of {p}")
                                        for p, e in optim_state["state"].items()}
            else:
                options = _state_options()
            set_model_state_dict(model, model_state, options=options)
            set_optimizer_state_dict(model, optimizer, optim_state, options=options)
        except (RuntimeError, KeyError, ValueError) as e:
            raise SurgeryError(f"--resume: checkpoint {path} does not fit this model: {str(e).splitlines()[0]}") from None
        if rng is not None:
            _set_rng(*rng)
        return path
