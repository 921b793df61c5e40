"""The setup stages of `UptrainRecipe` (loop.py): the environment, the run (source, objective, processes, batch split,
folders checked), the models, the training state (trainable parameters, optimizer, accelerate's preparation, the
resumed checkpoint) and the output heads. Nothing is written before the inputs prove good."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..checkpoint.atomic import check_apart, check_output_path
from ..checkpoint.record import local_source_folder, read_record
from ..checkpoint.source import resolve_source, side_files
from ..errors import SurgeryError
from ..kinds import check_checkpoint, find_kind
from . import lora, model_io
from .accelerator import make_accelerator, precision_of, rank_zero_loads, shard_teacher, teacher_dtype
from .align import check_alignable
from .data import DATA_CACHE
from .heads import OutputHead
from .losses import identity, Objective
from .metrics import MetricsLog
from .onpolicy import OnPolicy
from .optimizer import make_optimizer
from .options import UptrainOptions, resolve_data_workers
from .params import new_parameters, select_trainable
from .run_folder import check_run_dir, input_folders, recorded_data_workers
from .state import RunState
from .trackers import TB_DIR, require_trackers, start_trackers


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


class RecipeSetup:
    """The setup stages of `UptrainRecipe` other than the data (`RecipeData`) and the alignment (loop.py): they set
    the source, the accelerator, the models, the optimizer, the run state and the output heads from the options `o`."""

    def _setup_environment(self) -> None:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # weight loading/writing bars: stderr stays for our bar and errors
        fixed_mmap_threshold()
        logging.getLogger("accelerate.utils.other").setLevel(logging.ERROR)  # "removed shared tensor" on tied weights
        if self.o.lora_rank:
            lora.require_peft()

    def _setup_run(self) -> None:
        """The source, the objective, the processes and the batch split; the output and run folders checked."""
        from accelerate.utils import set_seed

        o = self.o
        self.source = resolve_source(o.model)
        self.record = read_record(self.source.folder)
        check_checkpoint(self.source.folder, self.source.config, self.record)  # before anything is loaded or written
        self.objective = resolve_objective(o, self.record)
        require_trackers(o.trackers)  # a tracker's missing package: one line, before anything loads
        self.on_policy = OnPolicy.of(o)
        self.acc = make_accelerator(o.precision, o.trackers, o.run_dir / TB_DIR)
        self.main, self.world = self.acc.is_main_process, self.acc.num_processes
        o.data_workers = resolve_data_workers(o.data_workers, self.acc.device.type,
                                              recorded_data_workers(o) if o.resume else None)
        per_process, rem = divmod(o.sequences_per_step, self.world)
        if rem or per_process % o.micro_batch:
            raise SurgeryError(
                f"--batch-tokens {o.batch_tokens} gives {o.sequences_per_step} sequences of {o.seq_len} per step, "
                f"which {self.world} process(es) cannot split into micro-batches of {o.micro_batch}: make it a "
                f"multiple of {self.world * o.micro_batch * o.seq_len}")
        self.accum = per_process // o.micro_batch
        self.tokens_per_step = o.sequences_per_step * o.seq_len
        self.trajectory = o.trajectory() | {"model": str(Path(self.source.folder).absolute()),
                                            "loss": self.objective.kind, **resume_identity(o, self.acc)}
        inputs = input_folders(o, self.source.folder, self.record)
        check_output_path(o.out, o.force, source=self.source.folder, inputs=inputs[1:])
        check_apart(o.run_dir, "run folder", inputs, option="--run-dir")
        side_files(self.source.folder)  # the files the output will copy: refused now, not after the training
        model_io.shipped_code_files(self.source.folder)
        check_run_dir(o, self.trajectory)
        set_seed(o.seed)

    def _setup_models(self) -> None:
        """The student (and its tokenizer) and, when the objective or the alignment needs one, the frozen teacher."""
        o, source = self.o, self.source
        from accelerate.utils import DistributedType

        acc = self.acc
        self.tokenizer = model_io.load_trusted_tokenizer(source, "model", o.trust_remote_code)
        from ..chat import ChatFormat

        # --chat-template on without a template: refused now
        self.chat = ChatFormat(o.chat_template, self.tokenizer, spans=o.loss_on == "assistant")
        from .retrieval_mix import RetrievalMix

        self.mix = RetrievalMix.of(o, self.tokenizer)  # windows too short for its tasks: refused now
        kind = find_kind(self.record, source.config)
        fsdp = acc.distributed_type == DistributedType.FSDP
        rank_zero = rank_zero_loads(acc, o, kind)
        if fsdp:
            acc.state.fsdp_plugin.cpu_ram_efficient_loading = rank_zero
        reads = self.main or not rank_zero  # this process reads the weights
        # without FSDP each process reads its weights straight onto its device (FSDP: rank 0 reads on the host and
        # `prepare` shards them out; the align stage moves the student itself once it is aligned)
        straight = None if fsdp or "align" in o.stages else acc.device
        self.model = model_io.load_causal_lm(source, "model", o.trust_remote_code, weights=reads, device=straight)
        select_trainable(self.model, o.train, self.record)  # a --train that selects nothing: refused before any text
        self.training_form = kind.training_form(self.model) if kind is not None else None
        model_io.check_seq_len(self.model, o.seq_len, source.spec)
        self.out_dtype = model_io.checkpoint_dtype(source.folder, source.config)
        self.teacher = None
        self.store = None  # --teacher-logprobs: the stored teacher pass, checked against this run before any text
        if o.teacher_logprobs:
            from .stored_kd import open_for_run

            self.store = open_for_run(o, self.model, self.tokenizer, self.world)
        if self.objective.needs_teacher or "align" in o.stages:
            t_src = model_io.teacher_source(self.record, o.teacher)
            teacher = model_io.load_causal_lm(t_src, "teacher", o.trust_teacher_code, dtype=teacher_dtype(acc, o),
                                              weights=reads, device=straight)
            model_io.check_teacher(self.model, teacher, self.tokenizer, t_src, o.trust_teacher_code)
            if "align" in o.stages:  # refused here, before the run folder is started (_setup_data)
                check_alignable(self.model, teacher)
            if self.objective.needs_hidden_states:
                check_alignable(self.model, teacher, "--hidden-weight")
            teacher.requires_grad_(False)
            teacher.eval()
            # sharded before it reaches the device, unless the align stage needs it whole (sharded after it)
            self.teacher = shard_teacher(teacher, acc) if fsdp and "align" not in o.stages else teacher.to(acc.device)

    def _setup_training(self) -> None:
        """Trainable parameters (LoRA adapters), optimizer, accelerate's preparation, and the resumed state."""
        from accelerate.utils import DistributedType

        o, acc = self.o, self.acc
        model = self.model
        self.trainable = select_trainable(model, o.train, self.record)
        self.lora_targets = None
        if o.lora_rank:
            model, self.lora_targets = lora.wrap(model, o.lora_rank, o.lora_alpha, o.lora_targets)
            self.trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        if o.gradient_checkpointing:
            model_io.enable_checkpointing(model, self.source.spec)
        model.train()
        optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad], o,
                                   new=new_parameters(model, self.record) if o.new_lr is not None else [])
        self.model, self.optimizer = acc.prepare(model, optimizer)
        self.params = [p for p in self.model.parameters() if p.requires_grad]  # as prepared (FSDP replaces them)
        if acc.distributed_type == DistributedType.DEEPSPEED:
            raise SurgeryError("uptrain does not run under DeepSpeed (its checkpoints are pickles, which --resume "
                               "would have to run): use FSDP (recipes/accelerate/fsdp-8gpu.yaml) or DDP")
        self.sharded = acc.distributed_type == DistributedType.FSDP
        if self.sharded and o.lora_rank:
            raise SurgeryError("--lora-rank does not run under FSDP yet: use DDP or one process")
        if self.sharded and self.teacher is not None and "align" in o.stages:
            self.teacher = shard_teacher(self.teacher, acc)
        self.state = RunState()
        self.state.data_key, self.state.data_sha256 = self.key, self.data_sha256
        self.ckpts.remove_partial()
        self.metrics = MetricsLog(o.run_dir / "metrics.jsonl", self.main, tracker=acc if o.trackers else None)
        self.resumed_from = None
        if o.resume and self.ckpts.latest() is not None:
            self.resumed_from = self.ckpts.load_latest(self.model, self.optimizer, self.state)
            self._check_resumed()
        acc.wait_for_everyone()
        self.metrics.start(self.state.step if self.resumed_from else None)
        start_trackers(acc, o.trackers, o.model_dump(mode="json") | self.trajectory | {
            "processes": self.world, "steps": o.steps, "precision": precision_of(acc)})

    def _check_resumed(self) -> None:
        """The resumed checkpoint against this run: its step within the run, its data the same (sources, files and,
        packed, the cache's sha256; streamed, each process's position)."""
        o, state, path = self.o, self.state, self.resumed_from
        if state.step > o.steps:
            raise SurgeryError(f"--resume: checkpoint {path.name} is at step {state.step}, beyond this run's {o.steps} "
                               f"steps (the checkpoint was altered, or belongs to a longer run)")
        if state.data_key != self.key:
            raise SurgeryError(f"--resume: the data no longer matches the checkpoint in {path} (its sources or files "
                               f"changed)")
        if not o.streamed:
            if state.data_sha256 and state.data_sha256 != self.data_sha256:
                raise SurgeryError(f"--resume: the packed data {o.run_dir / DATA_CACHE} is not the data the checkpoint "
                                   f"trained on (damaged, replaced, or rebuilt from changed data): start over with "
                                   f"--force")
            return
        from .stream import STATE_FILE

        file = path / STATE_FILE.format(rank=self.acc.process_index)
        try:
            saved = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise SurgeryError(f"--resume: cannot read the data position {file} ({str(e).splitlines()[0]})") from None
        share = o.sequences_per_step // self.world
        self.data.load_state_dict(saved, (o.align_steps + state.step) * share)

    def _setup_heads(self) -> None:
        """The output projections move into the losses (no whole-micro-batch logits) where that gives the same
        logits; not under FSDP, whose root unit may reshard the projection after the forward."""
        student = self.acc.unwrap_model(self.model)
        self.s_head = None if self.sharded else OutputHead.of(student, model_io.vocab_size(student))
        teacher = self.teacher
        self.t_head = (OutputHead.of(teacher, model_io.vocab_size(teacher)) if teacher is not None and not self.sharded
                       else None)  # a sharded teacher's output projection is a shard outside its forward
        self.projections = (self.s_head.project if self.s_head else identity,
                            self.t_head.project if self.t_head else identity)
