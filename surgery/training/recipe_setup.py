"""The setup stages of an uptraining run (loop.py's `setup` calls them in order), each a function that takes what it
needs and returns a small frozen dataclass: `read_inputs` -> `Inputs` (the source, its record, the objective),
`setup_run` -> `Run` (the processes and the batch split; the output and run folders checked), `setup_models` ->
`Models` (tokenizer, student, teacher), `setup_training` -> `Training` (trainable parameters, optimizer, accelerate's
preparation, the resumed state) with the prepared `Models`, `setup_heads` -> `Heads`. The data stage
(`setup_data` -> `Data`) is recipe_data.py; every stage's result, `Data` too, is defined here. Nothing is written
before the inputs prove good."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..checkpoint.atomic import check_apart, check_output_path
from ..checkpoint.record import local_source_folder, read_record
from ..checkpoint.source import Source, resolve_source, side_files
from ..errors import SurgeryError
from ..kinds import check_checkpoint, find_kind
from . import lora, model_io
from .accelerator import precision_of, rank_zero_loads, shard_teacher, teacher_dtype
from .align import check_alignable
from .data import DATA_CACHE, PackedData
from .heads import OutputHead
from .losses import identity, Objective
from .metrics import MetricsLog
from .onpolicy import OnPolicy
from .optimizer import make_optimizer
from .options import UptrainOptions, resolve_data_workers
from .params import new_parameters, select_trainable
from .run_folder import check_run_dir, input_folders, recorded_data_workers
from .state import Checkpoints, RunState
from .trackers import require_trackers, start_trackers

if TYPE_CHECKING:
    from accelerate import Accelerator

    from ..chat import ChatFormat
    from .retrieval_mix import RetrievalMix
    from .stream import StreamedData
    from .teacher_store import TeacherStore


def fixed_mmap_threshold(size: int = 1 << 20) -> None:
    """glibc raises its mmap threshold (up to 32 MiB) whenever a large block is freed; afterwards activations and
    gradients come from the heap, where fragmentation lets the peak RSS creep up over the first steps (SmolLM2 tour:
    3.48 -> 3.87 M KiB by step 3). A fixed threshold makes every large tensor its own mapping, returned to the
    system when freed (the same run: 3.19 M KiB, the same speed). No-op where there is no glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(ctypes.c_int(-3), ctypes.c_int(size))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def resolve_objective(o: UptrainOptions, record: dict) -> Objective:
    if o.teacher_logprobs:  # the KD term from a stored teacher pass (surgery/training/stored_kd.py)
        from .stored_kd import objective

        return objective(o)
    teacher_known = bool(o.teacher or (record.get("source") or {}).get("spec") or local_source_folder(record))
    if "align" in o.stages and not teacher_known:
        raise SurgeryError("--stage align needs the source to align to: the input has no surgery.json naming its "
                           "source; pass --teacher")
    kind = o.loss if o.loss != "auto" else ("kd" if teacher_known else "lm")
    if kind in ("kd", "mix") and not teacher_known:
        raise SurgeryError(f"--loss {kind} needs a teacher: the input has no surgery.json naming its source; pass --teacher")
    if o.hidden_weight and not teacher_known:
        raise SurgeryError("--hidden-weight needs a teacher: the input has no surgery.json naming its source; pass "
                           "--teacher")
    if o.on_policy and kind not in ("kd", "mix"):
        raise SurgeryError(f"--on-policy needs a teacher to score the student's text (--loss kd or mix): the input has "
                           "no surgery.json naming its source; pass --teacher")
    return Objective(kind, temperature=o.temperature, kd_weight=o.kd_weight, hidden_weight=o.hidden_weight,
                     divergence=o.kd_divergence, beta=o.kd_beta)


def resume_identity(o: UptrainOptions, acc) -> dict:
    """What a resumed run must repeat beyond its options (run_folder.IDENTITY_KEYS): the compute precision it
    resolved to, and the stored teacher pass it reads (the sha256 of its manifest, which lists each shard's sha256):
    another store at the same path, or another precision, would change the run's steps after the checkpoint."""
    from ..checkpoint.sha256 import sha256_file
    from .teacher_store import MANIFEST

    store = None
    if o.teacher_logprobs and (Path(o.teacher_logprobs) / MANIFEST).is_file():
        try:
            store = sha256_file(Path(o.teacher_logprobs) / MANIFEST)
        except OSError:
            store = None  # unreadable: opening the store says so
    return {"precision": precision_of(acc), "teacher_logprobs_store": store}


# --- the stages' results --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Inputs:
    """What the run trains and towards what: the source checkpoint, its surgery.json record, the objective (the
    losses; a stored teacher pass queues its targets on it) and the on-policy generation (None without it)."""

    source: Source
    record: dict
    objective: Objective
    on_policy: OnPolicy | None


@dataclass(frozen=True)
class Run:
    """The processes and how a step splits over them: the accelerator, whether this is the main process, the number
    of processes (`world`), micro-batches per process and step (`accum`), tokens per step, and the trajectory (what a
    resumed run must repeat: the options, the model, the loss, the precision, the stored teacher pass)."""

    acc: Accelerator
    main: bool
    world: int
    accum: int
    tokens_per_step: int
    trajectory: dict


@dataclass(frozen=True)
class Models:
    """The tokenizer and the chat format of the texts, the retrieval mix (None without --retrieval-mix), the student
    (as accelerate prepared it once `setup_training` returned), its kind's training form (None when it trains as
    stored), the dtype its output is written in, the frozen teacher (None without one) and the stored teacher pass
    (--teacher-logprobs; else None)."""

    tokenizer: Any
    chat: ChatFormat
    mix: RetrievalMix | None
    model: torch.nn.Module
    training_form: Any
    out_dtype: torch.dtype
    teacher: torch.nn.Module | None
    store: TeacherStore | None


@dataclass(frozen=True)
class Data:
    """The data stage's result (recipe_data.py's `setup_data`): the run's windows (`windows`: packed up front, or
    streamed as the steps need them; the held-out ones in memory either way), the key a resumed run must find again
    (sources, files, tokenizer, lengths), and the packed cache's sha256 (streamed: '')."""

    windows: PackedData | StreamedData
    key: str
    sha256: str


@dataclass(frozen=True)
class Training:
    """What the steps update and record: the optimizer, the trainable parameters as prepared (`params`; FSDP replaces
    them) and their names (`trainable`), LoRA's target modules (None without --lora-rank), whether accelerate shards
    the parameters (FSDP), the run state (step, time, the data's key), the metrics log, and the checkpoint the run
    resumed from (None when it starts afresh)."""

    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    trainable: list[str]
    lora_targets: list[str] | None
    sharded: bool
    state: RunState
    metrics: MetricsLog
    resumed_from: Path | None


@dataclass(frozen=True)
class Heads:
    """The output projections the losses apply chunk by chunk (None: the model returns whole logits) and the
    (student, teacher) projections handed to the objective."""

    student: OutputHead | None
    teacher: OutputHead | None
    projections: tuple


# --- the stages -----------------------------------------------------------------------------------------------------
def setup_environment(o: UptrainOptions) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight loading/writing bars: stderr stays for our bar and errors
    fixed_mmap_threshold()
    logging.getLogger("accelerate.utils.other").setLevel(logging.ERROR)  # "removed shared tensor" on tied weights
    if o.lora_rank:
        lora.require_peft()


def read_inputs(o: UptrainOptions) -> Inputs:
    """The source, its record and the objective, refused before anything is loaded or written (so is a tracker's
    missing package)."""
    source = resolve_source(o.model)
    record = read_record(source.folder)
    check_checkpoint(source.folder, source.config, record)  # before anything is loaded or written
    objective = resolve_objective(o, record)
    require_trackers(o.trackers)  # a tracker's missing package: one line, before anything loads
    return Inputs(source, record, objective, OnPolicy.of(o))


def setup_run(o: UptrainOptions, inputs: Inputs, acc: Accelerator) -> Run:
    """The processes of accelerator `acc` and the batch split (`o.data_workers` resolved for this device); the output
    and run folders checked, and the seed set."""
    from accelerate.utils import set_seed

    source = inputs.source
    main, world = acc.is_main_process, acc.num_processes
    o.data_workers = resolve_data_workers(o.data_workers, acc.device.type,
                                          recorded_data_workers(o) if o.resume else None)
    per_process, rem = divmod(o.sequences_per_step, world)
    if rem or per_process % o.micro_batch:
        raise SurgeryError(
            f"--batch-tokens {o.batch_tokens} gives {o.sequences_per_step} sequences of {o.seq_len} per step, "
            f"which {world} process(es) cannot split into micro-batches of {o.micro_batch}: make it a "
            f"multiple of {world * o.micro_batch * o.seq_len}")
    trajectory = o.trajectory() | {"model": str(Path(source.folder).absolute()), "loss": inputs.objective.kind,
                                   **resume_identity(o, acc)}
    folders = input_folders(o, source.folder, inputs.record)
    check_output_path(o.out, o.force, source=source.folder, inputs=folders[1:])
    check_apart(o.run_dir, "run folder", folders, option="--run-dir")
    side_files(source.folder)  # the files the output will copy: refused now, not after the training
    model_io.shipped_code_files(source.folder)
    check_run_dir(o, trajectory)
    set_seed(o.seed)
    return Run(acc=acc, main=main, world=world, accum=per_process // o.micro_batch,
               tokens_per_step=o.sequences_per_step * o.seq_len, trajectory=trajectory)


def setup_models(o: UptrainOptions, inputs: Inputs, run: Run) -> Models:
    """The student (and its tokenizer) and, when the objective or the alignment needs one, the frozen teacher."""
    from accelerate.utils import DistributedType

    source, record, acc = inputs.source, inputs.record, run.acc
    tokenizer = model_io.load_trusted_tokenizer(source, "model", o.trust_remote_code)
    from ..chat import ChatFormat

    # --chat-template on without a template: refused now
    chat = ChatFormat(o.chat_template, tokenizer, spans=o.loss_on == "assistant")
    from .retrieval_mix import RetrievalMix

    mix = RetrievalMix.of(o, tokenizer)  # windows too short for its tasks: refused now
    kind = find_kind(record, source.config)
    fsdp = acc.distributed_type == DistributedType.FSDP
    rank_zero = rank_zero_loads(acc, o, kind)
    if fsdp:
        acc.state.fsdp_plugin.cpu_ram_efficient_loading = rank_zero
    reads = run.main or not rank_zero  # this process reads the weights
    # without FSDP each process reads its weights straight onto its device (FSDP: rank 0 reads on the host and
    # `prepare` shards them out; the align stage moves the student itself once it is aligned)
    straight = None if fsdp or "align" in o.stages else acc.device
    model = model_io.load_causal_lm(source, "model", o.trust_remote_code, weights=reads, device=straight)
    select_trainable(model, o.train, record)  # a --train that selects nothing: refused before any text
    training_form = kind.training_form(model) if kind is not None else None
    model_io.check_seq_len(model, o.seq_len, source.spec)
    out_dtype = model_io.checkpoint_dtype(source.folder, source.config)
    teacher = None
    store = None  # --teacher-logprobs: the stored teacher pass, checked against this run before any text
    if o.teacher_logprobs:
        from .stored_kd import open_for_run

        store = open_for_run(o, model, tokenizer, run.world)
    if inputs.objective.needs_teacher or "align" in o.stages:
        t_src = model_io.teacher_source(record, o.teacher)
        loaded = model_io.load_causal_lm(t_src, "teacher", o.trust_teacher_code, dtype=teacher_dtype(acc, o),
                                         weights=reads, device=straight)
        model_io.check_teacher(model, loaded, tokenizer, t_src, o.trust_teacher_code)
        if "align" in o.stages:  # refused here, before the run folder is started (setup_data)
            check_alignable(model, loaded)
        if inputs.objective.needs_hidden_states:
            check_alignable(model, loaded, "--hidden-weight")
        loaded.requires_grad_(False)
        loaded.eval()
        # sharded before it reaches the device, unless the align stage needs it whole (sharded after it)
        teacher = shard_teacher(loaded, acc) if fsdp and "align" not in o.stages else loaded.to(acc.device)
    return Models(tokenizer=tokenizer, chat=chat, mix=mix, model=model, training_form=training_form,
                  out_dtype=out_dtype, teacher=teacher, store=store)


def setup_training(o: UptrainOptions, inputs: Inputs, run: Run, models: Models, data: Data,
                   ckpts: Checkpoints) -> tuple[Models, Training]:
    """Trainable parameters (LoRA adapters), optimizer, accelerate's preparation, and the resumed state; returns the
    models as prepared (the student wrapped, a teacher the align stage kept whole sharded) and the training state."""
    from accelerate.utils import DistributedType

    acc = run.acc
    model = models.model
    trainable = select_trainable(model, o.train, inputs.record)
    lora_targets = None
    if o.lora_rank:
        model, lora_targets = lora.wrap(model, o.lora_rank, o.lora_alpha, o.lora_targets)
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if o.gradient_checkpointing:
        model_io.enable_checkpointing(model, inputs.source.spec)
    model.train()
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad], o,
                               new=new_parameters(model, inputs.record) if o.new_lr is not None else [])
    model, optimizer = acc.prepare(model, optimizer)
    params = [p for p in model.parameters() if p.requires_grad]  # as prepared (FSDP replaces them)
    if acc.distributed_type == DistributedType.DEEPSPEED:
        raise SurgeryError("uptrain does not run under DeepSpeed (its checkpoints are pickles, which --resume "
                           "would have to run): use FSDP (recipes/accelerate/fsdp-8gpu.yaml) or DDP")
    sharded = acc.distributed_type == DistributedType.FSDP
    if sharded and o.lora_rank:
        raise SurgeryError("--lora-rank does not run under FSDP yet: use DDP or one process")
    teacher = models.teacher
    if sharded and teacher is not None and "align" in o.stages:
        teacher = shard_teacher(teacher, acc)
    state = RunState()
    state.data_key, state.data_sha256 = data.key, data.sha256
    ckpts.remove_partial()
    metrics = MetricsLog(o.run_dir / "metrics.jsonl", run.main, tracker=acc if o.trackers else None)
    resumed_from = None
    if o.resume and ckpts.latest() is not None:
        resumed_from = ckpts.load_latest(model, optimizer, state)
        check_resumed(o, run, data, state, resumed_from)
    acc.wait_for_everyone()
    metrics.start(state.step if resumed_from else None)
    start_trackers(acc, o.trackers, o.model_dump(mode="json") | run.trajectory | {
        "processes": run.world, "steps": o.steps, "precision": precision_of(acc)})
    training = Training(optimizer=optimizer, params=params, trainable=trainable, lora_targets=lora_targets,
                        sharded=sharded, state=state, metrics=metrics, resumed_from=resumed_from)
    return replace(models, model=model, teacher=teacher), training


def check_resumed(o: UptrainOptions, run: Run, data: Data, state: RunState, path: Path) -> None:
    """The resumed checkpoint `path` (its state loaded into `state`) against this run: its step within the run, its
    data the same (sources, files and, packed, the cache's sha256; streamed, each process's position, which the
    stream takes up)."""
    if state.step > o.steps:
        raise SurgeryError(f"--resume: checkpoint {path.name} is at step {state.step}, beyond this run's {o.steps} "
                           f"steps (the checkpoint was altered, or belongs to a longer run)")
    if state.data_key != data.key:
        raise SurgeryError(f"--resume: the data no longer matches the checkpoint in {path} (its sources or files "
                           f"changed)")
    if not o.streamed:
        if state.data_sha256 and state.data_sha256 != data.sha256:
            raise SurgeryError(f"--resume: the packed data {o.run_dir / DATA_CACHE} is not the data the checkpoint "
                               f"trained on (damaged, replaced, or rebuilt from changed data): start over with "
                               f"--force")
        return
    from .stream import STATE_FILE

    file = path / STATE_FILE.format(rank=run.acc.process_index)
    try:
        saved = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise SurgeryError(f"--resume: cannot read the data position {file} ({str(e).splitlines()[0]})") from None
    share = o.sequences_per_step // run.world
    data.windows.load_state_dict(saved, (o.align_steps + state.step) * share)


def setup_heads(models: Models, acc: Accelerator, sharded: bool) -> Heads:
    """The output projections move into the losses (no whole-micro-batch logits) where that gives the same
    logits; not under FSDP (`sharded`), whose root unit may reshard the projection after the forward."""
    student = acc.unwrap_model(models.model)
    s_head = None if sharded else OutputHead.of(student, model_io.vocab_size(student))
    teacher = models.teacher
    t_head = (OutputHead.of(teacher, model_io.vocab_size(teacher)) if teacher is not None and not sharded
              else None)  # a sharded teacher's output projection is a shard outside its forward
    return Heads(student=s_head, teacher=t_head, projections=(s_head.project if s_head else identity,
                                                              t_head.project if t_head else identity))
