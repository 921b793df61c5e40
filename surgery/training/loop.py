"""The uptraining loop, on accelerate: CPU, one GPU, or several processes under `accelerate launch`.

One optimizer step = `batch_tokens` tokens = B windows of `seq_len`, split over W processes and, within each,
into micro-batches of `micro_batch` windows (gradient accumulation makes up the rest). Losses are means over
positions and DDP averages gradients over processes, so a step computes the same update however it is split.
AdamW over the trainable parameters, linear warmup then cosine decay (the learning rate is a function of the step
alone), gradient clipping. Autocast in --precision (auto: bf16 on CUDA, fp32 on CPU). Only the main process logs and writes files.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path

import torch

from ..checkpoint.atomic import atomic_output_dir, check_apart, check_output_path, ordinary_permissions
from ..checkpoint.sha256 import sha256_file
from ..errors import SurgeryError
from ..kinds import check_checkpoint, find_kind
from ..data import dataset_commits
from ..loaders import read_json
from ..logs import get_logger
from ..precision import resolve_precision
from ..checkpoint.source import resolve_source, side_files
from ..checkpoint.record import local_source_folder, public_name, read_record, write_record
from . import lora, model_io
from .align import align, check_alignable
from .data import DATA_CACHE, cache_key, pack, pack_held_out, read_cache, write_cache
from .heads import OutputHead
from .losses import identity, Objective
from .metrics import MetricsLog
from .onpolicy import OnPolicy, generating_model
from .options import TRAJECTORY_DEFAULTS, UptrainOptions, resolve_data_workers
from .params import select_trainable
from .plot import plot_metrics
from .progress import Progress
from .state import Checkpoints, RunState
from .trackers import TB_DIR, copy_tensorboard, finish_trackers, require_trackers, start_trackers

FEW_STEPS = 20  # fewer optimizer steps than this: warn
OOM_MARKERS = ("out of memory", "can't allocate memory", "CUDA error: out of memory")
log = get_logger(__name__)


def lr_at(step: int, o: UptrainOptions) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then cosine down to lr * min_lr_ratio."""
    # Not transformers' cosine_with_min_lr schedule: its warmup starts at lr 0 (step / warmup, one step later than
    # here), which would make step 0 a no-op and move every saved run's schedule (tests/uptrain/test_lr_schedule.py).
    warmup, total = o.warmup, o.steps
    if step < warmup:
        return o.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def make_optimizer(params: list, o: UptrainOptions) -> torch.optim.Optimizer:
    """AdamW, fused where torch supports it (CPU and CUDA: one kernel over all tensors, several times faster
    than the per-tensor loop on a 135M model), else the plain implementation."""
    kw = dict(lr=o.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=o.weight_decay)
    try:
        return torch.optim.AdamW(params, fused=True, **kw)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(params, **kw)


def make_accelerator(precision: str = "auto", log_with: list[str] | None = None, project_dir: Path | None = None):
    """Autocast in `--precision` (surgery/precision.py; auto: bf16 on CUDA with bf16, fp32 elsewhere; bf16 on the CPU
    is torch's CPU autocast, the same code path as on CUDA). Without CUDA, cpu=True lets several processes started by
    `accelerate launch --multi_gpu --num_processes N` (torchrun) or `torchrun` run DDP on CPU over gloo, and
    an FSDP config (`accelerate launch --config_file fsdp.yaml`) run FSDP on CPU over gloo (see `use_fsdp_on_cpu`);
    under FSDP, `use_fsdp2` sets the mixed precision policy. `log_with`: the experiment trackers (--report-to),
    `project_dir`: where TensorBoard writes (surgery/training/trackers.py)."""
    import os

    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    cuda = torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "true", "yes")
    resolved = resolve_precision(precision, "cuda" if cuda else "cpu")
    mixed = "bf16" if resolved == "bf16" else "no"
    from accelerate.state import AcceleratorState

    if AcceleratorState._shared_state.get("_mixed_precision", mixed) != mixed:
        # an earlier run in this process (the library, tests) left another precision in accelerate's shared state,
        # which refuses a change: start it afresh (the process group, PartialState's, stays)
        AcceleratorState._reset_state(reset_partial_state=False)
    acc = Accelerator(cpu=not cuda, mixed_precision=mixed, log_with=log_with or None,
                      project_dir=str(project_dir) if project_dir is not None else None)
    fsdp_config = os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"  # set by accelerate launch
    if fsdp_config and acc.distributed_type == DistributedType.MULTI_CPU:
        use_fsdp_on_cpu(acc)
    if acc.distributed_type == DistributedType.FSDP:
        use_fsdp2(acc)
    return acc


def precision_of(acc) -> str:
    """The compute precision an Accelerator runs in: "bf16" (autocast) or "fp32"."""
    return "bf16" if str(acc.mixed_precision) == "bf16" else "fp32"


def use_fsdp_on_cpu(acc) -> None:
    """accelerate (1.15) selects FSDP only with an accelerator device: on CPU it silently runs DDP instead, every
    process holding the whole model. torch's FSDP runs on CPU over gloo, so select it from the launch config
    (FSDP_* variables) the way accelerate does on GPUs: the distributed type lives in state shared by
    PartialState and AcceleratorState."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = FullyShardedDataParallelPlugin()


def use_fsdp2(acc) -> None:
    """FSDP is FSDP2 (`fully_shard`) or refused: FSDP1 casts buffers to its bf16 buffer dtype (RoPE's inv_freq: a
    phase error of ~7 rad at position 4096 at Llama-3's base) and clips a partly trained model's gradients by each
    shard's local norm. With bf16 the policy is bf16 compute and fp32 gradient reduction (accelerate builds bf16 for
    both from `mixed_precision: bf16`, and a config file cannot say reduce_dtype); FSDP2 casts parameters only, so
    buffers keep the dtype they were built in."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    plugin = acc.state.fsdp_plugin
    if plugin.fsdp_version != 2:
        raise SurgeryError(f"uptrain runs FSDP2 only (the accelerate config asks for FSDP{plugin.fsdp_version}, which "
                           "casts RoPE's inv_freq to bf16): set fsdp_version: 2 under fsdp_config, as "
                           "recipes/accelerate/fsdp-8gpu.yaml does")
    if acc.mixed_precision == "bf16":
        plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif acc.mixed_precision == "no":
        plugin.mixed_precision_policy = None


def shard_teacher(teacher, acc):
    """Under FSDP the frozen teacher is sharded like the student, by accelerate's own FSDP2 preparation (one unit per
    decoder layer, the embeddings, the head; the run's mixed precision policy; with rank-0 loading, the weights
    broadcast from rank 0): each process holds 1/N of its weights and gathers one layer at a time in its forward, so a
    teacher as large as the student, or larger, fits beside it. Each unit is moved to the device as it is sharded: the
    whole teacher never lands on a GPU. No gradients, no optimizer state; the teacher is not one of accelerate's
    models (its checkpoints hold the student alone)."""
    import copy

    from accelerate.utils import fsdp2_prepare_model

    plugin = acc.state.fsdp_plugin
    acc.state.fsdp_plugin = copy.copy(plugin)  # preparing sets the plugin's layer classes: the student's must be its own
    try:
        return fsdp2_prepare_model(acc, teacher)
    finally:
        acc.state.fsdp_plugin = plugin


def rank_zero_loads(acc, o: UptrainOptions, kind) -> bool:
    """Under FSDP, rank 0 alone reads the student and the teacher; the other ranks build them without weights and
    receive their shards in `prepare` (accelerate's cpu_ram_efficient_loading). Not with the align stage (it trains
    whole models on every rank before sharding) nor for a kind with a training form (it rewrites the loaded weights and
    module settings on every rank)."""
    from accelerate.utils import DistributedType

    from ..kinds.base import Kind

    return (acc.distributed_type == DistributedType.FSDP and "align" not in o.stages
            and (kind is None or type(kind).training_form is Kind.training_form))


def teacher_dtype(acc, o: UptrainOptions) -> torch.dtype:
    """The frozen teacher needs no fp32 master copy: loaded in the compute precision (bf16 in a bf16 run), except for
    the align stage, which trains the student's fp32 layers on its hidden states."""
    return torch.bfloat16 if acc.mixed_precision == "bf16" and "align" not in o.stages else torch.float32


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


def input_folders(o: UptrainOptions, source_folder: Path, record: dict) -> list[tuple[str, Path]]:
    """The folders on this machine the run reads (the model, the teacher, the texts): the output and the run folder
    may be none of them, nor lie inside or hold one (the run folder is deleted by --force and after success)."""
    folders = [("source", Path(source_folder))]
    if o.teacher and Path(o.teacher).exists():
        folders.append(("teacher", Path(o.teacher)))
    if local_source_folder(record) is not None:
        folders.append(("teacher", local_source_folder(record)))
    if o.teacher_logprobs:
        folders.append(("--teacher-logprobs", Path(o.teacher_logprobs)))
    texts = [("--data", data) for data in o.data] + [("--eval-data", o.eval_data)]
    for name, data in texts:
        if data and Path(data).is_dir():
            folders.append((f"{name} text", Path(data)))
    return folders


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


def check_run_dir(o: UptrainOptions, trajectory: dict) -> None:
    """Refuse a run folder that cannot be used: nothing is written here."""
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
        diff = sorted(k for k in trajectory if saved.get(k) != trajectory[k])
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


def all_finite(acc, *values) -> bool:
    """True when every value (numbers, tensors) is finite on every process."""
    bad = 0.0
    for v in values:
        v = v.to_local() if hasattr(v, "to_local") else v  # FSDP2 parameters are DTensors: their local shards
        bad += 0.0 if v is None or bool(torch.isfinite(torch.as_tensor(v)).all()) else 1.0
    return acc.reduce(torch.tensor([bad], device=acc.device), reduction="sum").item() == 0


def last_good(ckpts: Checkpoints) -> str:
    latest = ckpts.latest()
    return f"the last good checkpoint, {latest}, is kept" if latest else "no checkpoint was written"


def warn(message: str) -> None:
    log.warning(message)


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, acc, micro_batch: int) -> dict:
    """Held-out next-token loss and perplexity over `windows`; windows sharded over processes, sums reduced.
    Every process runs as many forward passes as the largest shard needs (FSDP gathers parameters and DDP
    broadcasts buffers in collectives inside forward): one that has run out repeats a window, not counted."""
    from .losses import lm_loss

    was_training = model.training
    model.eval()
    shard = windows[acc.process_index :: acc.num_processes].long()
    largest = -(-windows.shape[0] // acc.num_processes)
    total = torch.zeros(2, dtype=torch.float64, device=acc.device)  # [nll sum, targets]
    for i in range(0, largest, micro_batch):
        ids = shard[i : i + micro_batch].to(acc.device)
        counted = ids.shape[0]
        if counted == 0:
            ids = windows[:1].long().to(acc.device)
        with acc.autocast():
            logits = model(input_ids=ids, use_cache=False).logits
        n = counted * (ids.shape[1] - 1)
        total += torch.tensor([lm_loss(logits, ids).double().item() * n, n], dtype=torch.float64, device=acc.device)
    total = acc.reduce(total, reduction="sum")
    model.train(was_training)
    loss = (total[0] / total[1]).item()
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700))}


def evaluate_held_out(model, data, acc, micro_batch: int) -> dict:
    """`evaluate` on the training text's held-out split and, with --eval-data, on the other text's windows
    (its results prefixed `other_`)."""
    result = evaluate(model, data.eval, acc, micro_batch)
    if data.other is not None:
        result |= {f"other_{k}": v for k, v in evaluate(model, data.other, acc, micro_batch).items()}
    return result


def hidden(head: OutputHead | None):
    return head.returning_hidden() if head is not None else contextlib.nullcontext()


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


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or any(m in str(e) for m in OOM_MARKERS)


def run(o: UptrainOptions) -> dict:
    """One uptraining run, in torchtune's recipe shape: setup, train (steps, evaluations, checkpoints), save."""
    recipe = UptrainRecipe(o)
    made_run_dir = not o.resume and not o.run_dir.exists()
    try:
        recipe.setup()
    except BaseException:  # refused before the first step (a tracker that cannot start, a bad store): nothing to
        if made_run_dir and getattr(recipe, "main", True):  # resume, so the run folder this run made goes
            shutil.rmtree(o.run_dir, ignore_errors=True)
        raise
    recipe.train()
    return recipe.save()


class UptrainRecipe:
    """The stages of one run. `setup` loads and prepares everything (nothing is written before the inputs prove
    good); `train` runs the optimizer steps with their evaluations and checkpoints; `save` writes the output."""

    def __init__(self, o: UptrainOptions):
        self.o = o

    # --- setup -------------------------------------------------------------------------------------------------
    def setup(self) -> None:
        self._setup_environment()
        self._setup_run()
        self._check_stream()
        self._setup_models()
        self._setup_data()
        self.ckpts = Checkpoints(self.o.run_dir, self.o.keep_last, self.acc)
        self.align_record = self._setup_align()
        self._setup_training()
        self._setup_heads()
        self._announce()

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
                                            "loss": self.objective.kind}
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

    def _check_stream(self) -> None:
        """Streamed data that is empty, or has fewer documents than readers: refused before the model loads."""
        if self.o.streamed and not self.o.resume:
            from .stream import early_check

            early_check(self.o.data, self.o.weights, self.world * max(1, self.o.data_workers),
                        text_field=self.o.text_field, streaming=self.o.streaming, txt_unit=self.o.txt_unit)

    def _setup_data(self) -> None:
        """The training and held-out windows: packed up front (small runs, data.py) or streamed (stream.py)."""
        if self.o.loss_on == "assistant" and self.o.streamed:
            raise SurgeryError("--loss-on assistant reads packed data: this run would stream its data (several --data, "
                               "--data-workers, or more than --data-mode auto packs); use --data-mode packed")
        if not self.o.streamed:
            return self._setup_packed()
        self._setup_stream()
        if self.main and not self.o.resume:
            start_run_dir(self.o, self.trajectory)
        self.acc.wait_for_everyone()

    def _setup_packed(self) -> None:
        """Packed training and held-out windows: the main process packs them and caches them for the others (and
        for resuming; the checkpoint records the cache's sha256, which a resumed run must find again)."""
        o, tokenizer = self.o, self.tokenizer
        train_tokens = o.total_steps * o.sequences_per_step * o.seq_len
        self.key = cache_key(data=o.data_spec, text_field=o.text_field, **o.txt_key(), seq_len=o.seq_len, eval_tokens=o.eval_tokens,
                             **({"eval_data": o.eval_data} if o.eval_data is not None else {}),
                             train_tokens=train_tokens, vocab=len(tokenizer), eos=tokenizer.eos_token_id,
                             tokenizer=type(tokenizer).__name__, **self._chat_key())

        def build():
            from ..data import load_texts

            data = pack(load_texts(o.data[0], o.text_field, o.streaming, o.txt_unit, self.chat), tokenizer, o.seq_len,
                        o.eval_tokens, train_tokens, seed=o.seed, masked=o.loss_on == "assistant")
            if o.loss_on == "assistant" and not self.chat.read.get("conversations"):  # every token would count
                raise SurgeryError(f"--loss-on assistant: the data holds no conversation (no 'messages' column "
                                   "read), so it has no assistant turns to train on; use --loss-on all")
            if o.loss_on == "assistant" and data.train_mask is not None and not data.train_mask[:, 1:].any():
                raise SurgeryError("--loss-on assistant: no conversation of the training data has an assistant turn "
                                   "(nothing to train on); use --loss-on all")
            if o.eval_data is not None:
                data.other = pack_held_out(load_texts(o.eval_data, o.text_field, o.streaming, o.txt_unit, self.chat),
                                           tokenizer, o.seq_len, o.eval_tokens)
            return data

        cache = o.run_dir / DATA_CACHE
        with self.acc.main_process_first():
            data = read_cache(cache, self.key, o.seed) if (o.resume or not self.main) else None
            if data is None:
                data = build()
                if self.main:
                    if not o.resume:
                        start_run_dir(o, self.trajectory)
                    write_cache(cache, self.key, data)
        self.data = data
        self.data_sha256 = sha256_file(cache)

    def _setup_stream(self) -> None:
        """Streamed training windows (read, tokenized and packed as the steps need them, by --data-workers); the
        held-out windows (the first documents of every source, and --eval-data) in memory."""
        from .stream import Plan, StreamedData, check_readers, data_key, fingerprint, hold_out, resolve_sources

        o, tokenizer, acc = self.o, self.tokenizer, self.acc
        if "align" in o.stages and self.world > 1:
            raise SurgeryError("--stage align reads its windows in one process: with several processes use "
                               "--data-mode packed")
        eos = tokenizer.eos_token_id
        if eos is None:
            raise SurgeryError("the tokenizer has no EOS token to put between documents")
        if o.data_workers:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the workers are forked from this process
        sources = resolve_sources(o.data, o.weights)
        args = dict(tokenizer=tokenizer, eos=eos, seq_len=o.seq_len, seed=o.seed,
                    readers=self.world * max(1, o.data_workers), epochs=o.data_epochs, text_field=o.text_field,
                    streaming=o.streaming, txt_unit=o.txt_unit, chat_template=o.chat_template)
        eval_windows, held = hold_out(args, sources, o.eval_tokens)
        plan = Plan(sources=tuple(sources), held=held, **args)
        if not o.resume:
            check_readers(plan)  # after the held-out documents, before the run folder is started
        self.data = StreamedData(plan, eval_windows, acc.process_index, self.world, o.data_workers)
        if o.eval_data is not None:
            from ..data import load_texts

            self.data.other = pack_held_out(load_texts(o.eval_data, o.text_field, o.streaming, o.txt_unit, self.chat),
                                            tokenizer, o.seq_len, o.eval_tokens)
        self.key = data_key({"sources": fingerprint(sources), **o.txt_key(), "seq_len": o.seq_len, "eval_tokens": o.eval_tokens,
                             "eval_data": o.eval_data, "seed": o.seed,
                             "vocab": len(tokenizer), "eos": eos, "tokenizer": type(tokenizer).__name__,
                             **self._chat_key()})
        self.data_sha256 = ""

    def _chat_key(self) -> dict:
        """--chat-template for the data's key when it is not the default (other runs' keys stay as they were)."""
        o = self.o
        return ({"chat_template": o.chat_template} if o.chat_template != "auto" else {}) | (
            {"loss_on": o.loss_on} if o.loss_on != "all" else {})

    def _setup_align(self) -> dict | None:
        """The `align` stage (attention layer by layer against the teacher), unless a checkpoint already has it."""
        o, acc, data = self.o, self.acc, self.data
        if "align" not in o.stages:
            return None
        if o.resume and self.ckpts.latest() is not None:
            align_json = o.run_dir / "align.json"
            return json.loads(align_json.read_text()) if align_json.exists() else None
        count = o.align_steps * o.sequences_per_step
        windows = data.take(count) if o.streamed else data.train[data.window_indices(0, count)]
        say = log.info if self.main else (lambda line: None)
        self.model.to(acc.device)
        before = evaluate_held_out(self.model, data, acc, o.micro_batch) if data.eval.shape[0] else {}
        held_out = data.eval[: windows.shape[0]]  # the per-layer errors on as many held-out windows as it trains on
        record = align(self.model, self.teacher, windows.long(), held_out.long(), micro_batch=o.micro_batch,
                       epochs=o.align_epochs, lr=o.align_lr, device=acc.device, log=say)
        record["tokens"] = o.align_steps * o.batch_tokens
        record["eval_ppl_before"] = before.get("eval_ppl")
        if "other_eval_ppl" in before:
            record["other_eval_ppl_before"] = before["other_eval_ppl"]
        if self.main:
            (o.run_dir / "align.json").write_text(json.dumps(record, indent=2) + "\n")
        return record

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
        optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad], o)
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

    def _announce(self) -> None:
        o, data, state = self.o, self.data, self.state
        if not self.main:
            return
        n_params = sum(p.numel() for p in self.params)
        log.info(f"uptrain: {self.objective.kind} loss, training {len(self.trainable)} tensors ({n_params:,} parameters), "
              f"{o.steps} steps x {self.tokens_per_step} tokens, {self.world} process(es) x {self.accum} "
              f"micro-batch(es) of {o.micro_batch}, "
              + (f"training windows streamed from {len(o.data)} source(s) by {max(1, o.data_workers)} reader(s) per "
                 f"process, {data.eval.shape[0]} held-out " if o.streamed else
                 f"{data.train.shape[0]} training / {data.eval.shape[0]} held-out ")
              + (f"(+ {data.other.shape[0]} of --eval-data) " if data.other is not None else "")
              + f"windows of {o.seq_len}"
              + (f", parameters sharded by {self.acc.distributed_type.value}" if self.sharded else "")
              + (" (the teacher's too)" if self.sharded and self.teacher is not None else "")
              + (f"; resumed at step {state.step} from {self.resumed_from.name}" if self.resumed_from else ""))
        if 0 < o.steps < FEW_STEPS:
            warn(f"--tokens {o.tokens} with --batch-tokens {o.batch_tokens} makes only {o.steps} optimizer step"
                 f"{'s' if o.steps > 1 else ''}: too few for the learning-rate schedule to mean much; raise --tokens "
                 f"or lower --batch-tokens")

    # --- train ---------------------------------------------------------------------------------------------------
    def train(self) -> None:
        """Optimizer steps from the resumed one to the last, each followed by its evaluation and checkpoint when due."""
        o, state = self.o, self.state
        try:
            if self.resumed_from is None:
                self._evaluate_start()
            bar = Progress(o.steps, state.step, self.tokens_per_step, enabled=self.main and o.progress,
                           every_s=o.progress_every, data_line=self.data_line if o.streamed else None)
            for step in range(state.step, o.steps):
                row = self.train_step(step)
                self.metrics.write(**row)
                bar.step(row)
                last = state.step == o.steps
                if last or state.step % o.eval_interval == 0:
                    result = self.evaluate_at(state.step)
                    if result is not None and self.main and o.progress:
                        other = (f", --eval-data {result['other_eval_ppl']:.3f}" if "other_eval_ppl" in result
                                 else "")
                        bar.write(f"step {state.step}: held-out perplexity {result['eval_ppl']:.3f}{other}")
                if last or (o.save_every and state.step % o.save_every == 0):
                    self.save_checkpoint()
            bar.close()
            if o.streamed:
                self.data.close()
        except (RuntimeError, torch.OutOfMemoryError) as e:
            if _is_oom(e):
                raise SurgeryError(f"out of memory at step {state.step + 1} (micro-batch {o.micro_batch} x {o.seq_len} "
                                   "tokens): lower --micro-batch (accumulation keeps the batch) or add "
                                   "--gradient-checkpointing; --resume continues from the last checkpoint") from None
            raise

    def train_step(self, step: int) -> dict:
        """One optimizer step (0-based `step`): the micro-batches' forward and backward passes, clipping, the
        update; returns the metrics row. A step whose loss or gradient norm is not finite changes nothing."""
        o, acc, state, optimizer = self.o, self.acc, self.state, self.optimizer
        start = time.perf_counter()
        lr = lr_at(step, o)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = self.data.step_batch(o.align_steps + step, o.sequences_per_step, acc.process_index, self.world)
        masks, weights = self._step_masks(step)
        if self.store is not None:  # the stored teacher pass of these windows, taken by the micro-steps in turn
            from .stored_kd import first_window

            first = first_window(o, step, acc.process_index, self.world)
            self.objective.queue(self.store.read(first, batch.shape[0]), o.micro_batch)
        loss_sum = torch.zeros((), device=acc.device)
        parts_sum: dict[str, torch.Tensor] = {}
        gen_seconds = 0.0
        for m in range(self.accum):
            ids = batch[m * o.micro_batch : (m + 1) * o.micro_batch].to(acc.device)
            mask = masks[m * o.micro_batch : (m + 1) * o.micro_batch].to(acc.device) if masks is not None else None
            weight = weights[m] if weights is not None else None
            generated = None
            if self.on_policy is not None and self.on_policy.generates(step * self.accum + m):
                g = self.on_policy.generator(step, m, acc.process_index, acc.device)
                ids, generated, seconds = self.on_policy.rollout(generating_model(acc.unwrap_model(self.model)), ids,
                                                                 g, acc.autocast)
                gen_seconds += seconds
            loss, parts = self._micro_step(ids, last=m == self.accum - 1, weight=weight, mask=mask, generated=generated)
            loss_sum += loss / self.accum if weight is None else loss * weight
            for k, v in parts.items():
                parts_sum[k] = parts_sum.get(k, 0) + (v / self.accum if weight is None else v * weight)
        # inf max_norm: the norm (of all processes' gradients) without clipping
        grad_norm = acc.clip_grad_norm_(self.params, o.max_grad_norm if o.max_grad_norm > 0 else math.inf)
        logged = acc.reduce(torch.stack([loss_sum, *parts_sum.values()]), reduction="mean").tolist()  # syncs
        grad_norm = float(grad_norm)
        if not all_finite(acc, logged[0], grad_norm):
            what = "loss" if not math.isfinite(logged[0]) else "gradient norm"
            raise SurgeryError(f"the training {what} is not finite at step {step + 1} (lower --lr, now {o.lr:g}); "
                               f"nothing of this step was written, {last_good(self.ckpts)}")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state.step = step + 1
        seconds = time.perf_counter() - start
        state.elapsed += seconds
        generation = ({"gen_s": gen_seconds, "gen_share": gen_seconds / seconds} if self.on_policy is not None
                      else {})  # on-policy distillation: the student's generating, its share of the step
        return dict(step=state.step, tokens=state.step * self.tokens_per_step, loss=logged[0],
                    **{f"{k}_loss": v for k, v in zip(parts_sum, logged[1:])}, lr=lr, grad_norm=grad_norm,
                    tokens_per_s=self.tokens_per_step / seconds, elapsed=state.elapsed, **generation)

    def _step_masks(self, step: int) -> tuple[torch.Tensor | None, list[float] | None]:
        """--loss-on assistant: this process's token masks of step `step` and each micro-batch's weight, its share of
        the step's counted targets (all processes) times the number of processes (DDP averages the gradients): the
        step's loss is the mean over every counted target, however the batch is split. Otherwise no masks, and each
        micro-batch weighs 1 / accumulation steps (None)."""
        o, acc = self.o, self.acc
        if o.loss_on != "assistant":
            return None, None
        masks = self.data.step_mask(o.align_steps + step, o.sequences_per_step, acc.process_index, self.world)
        counts = [int(masks[m * o.micro_batch : (m + 1) * o.micro_batch, 1:].sum()) for m in range(self.accum)]
        total = acc.reduce(torch.tensor([float(sum(counts))], device=acc.device), reduction="sum").item()
        if total == 0:
            raise SurgeryError(f"--loss-on assistant: step {step + 1}'s windows hold no assistant token (is the data "
                               "a messages column rendered with the chat template?)")
        return masks, [c * self.world / total for c in counts]

    def _micro_step(self, ids: torch.Tensor, last: bool, weight: float | None = None,
                    mask: torch.Tensor | None = None, generated: dict | None = None) -> tuple[torch.Tensor, dict]:
        """Forward and backward of one micro-batch (gradients synchronised on the step's last one only), its loss
        scaled by `weight` (default 1 / accumulation steps); returns its detached loss and loss parts (unscaled).
        `mask`: the tokens the losses count (--loss-on assistant). `generated`: the loss masks of a micro-batch the
        student wrote (onpolicy.py)."""
        acc, model, teacher = self.acc, self.model, self.teacher
        sync = contextlib.nullcontext() if last else acc.no_sync(model)
        with sync:
            states = {"output_hidden_states": True} if self.objective.needs_hidden_states else {}
            with acc.autocast():  # logits, or final hidden states the losses project chunk by chunk
                with hidden(self.s_head):
                    out = model(input_ids=ids, use_cache=False, **states)
                t_out = None
                if teacher is not None:
                    with torch.no_grad(), hidden(self.t_head):
                        t_out = teacher(input_ids=ids, use_cache=False, **states)
                loss, parts = self.objective(out.logits, ids, t_out.logits if t_out is not None else None,
                                             *self.projections, states=out.hidden_states if states else None,
                                             teacher_states=t_out.hidden_states if states else None,
                                             mask=mask, **(generated or {}))
            acc.backward(loss / self.accum if weight is None else loss * weight)
        del out, t_out
        return loss.detach(), parts

    def data_line(self) -> str:
        """Progress of the stream (this process's readers): tokens read, blank documents skipped, each source's
        share of the windows so far."""
        got = self.data.shares()
        total = max(1, sum(got["windows"]))
        shares = ", ".join(f"{public_name(name) or name} {n / total:.1%}" for name, n in zip(self.o.data, got["windows"]))
        return f"read {got['tokens']:,} tokens, {got['skipped']} blank documents skipped; shares {shares}"

    def source_shares(self) -> list[dict] | None:
        """Streamed: each source's weight and its share of the windows trained on (all processes), for the record."""
        if not self.o.streamed:
            return None
        counts = torch.tensor(self.data.shares()["windows"], dtype=torch.float64, device=self.acc.device)
        counts = self.acc.reduce(counts, reduction="sum").cpu().tolist()
        total = max(1.0, sum(counts))
        return [{"data": public_name(spec) or spec, "weight": round(w, 6), "windows": int(n),
                 "share": round(n / total, 6)} for spec, w, n in zip(self.o.data, self.o.weights, counts)]

    # --- evaluate ------------------------------------------------------------------------------------------------
    def evaluate_at(self, step: int) -> dict | None:
        """Held-out loss and perplexity after `step` (None without held-out windows), written to the metrics."""
        o = self.o
        if self.data.eval.shape[0] == 0:
            return None
        result = evaluate_held_out(self.model, self.data, self.acc, o.micro_batch)
        if not all_finite(self.acc, result["eval_loss"], result.get("other_eval_loss", 0.0)):
            raise SurgeryError(f"the held-out loss is not finite after step {step} (the weights diverged: lower --lr, "
                               f"now {o.lr:g}); {last_good(self.ckpts)}")
        self.metrics.write(step=step, tokens=step * self.tokens_per_step, **result)
        return result

    def _evaluate_start(self) -> None:
        """A fresh run's step 0: the student's (and the teacher's) held-out perplexity, after any alignment."""
        first = self.evaluate_at(0)
        if self.teacher is not None and first is not None:
            teacher = evaluate_held_out(self.teacher, self.data, self.acc, self.o.micro_batch)
            self.metrics.write(step=0, tokens=0, **{f"teacher_{k}": v for k, v in teacher.items() if k.endswith("ppl")})
        if self.align_record is not None and first is not None:  # the evaluation at step 0 came after the alignment
            self.align_record["eval_ppl"] = first["eval_ppl"]
            if "other_eval_ppl" in first:
                self.align_record["other_eval_ppl"] = first["other_eval_ppl"]

    # --- save ----------------------------------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        """A resumable checkpoint of the current step, refused when the weights are not finite."""
        if not all_finite(self.acc, *(p.detach() for p in self.params)):
            raise SurgeryError(f"the weights are not finite after step {self.state.step} (lower --lr, now "
                               f"{self.o.lr:g}); {last_good(self.ckpts)}")
        data_state = self.data.state_dict() if self.o.streamed else None
        self.ckpts.save(self.state.step, self.model, self.optimizer, self.state, data_state)

    def save(self) -> dict | None:
        """The final checkpoint, written by the main process (`finish`); the uptraining record on the main one."""
        acc = self.acc
        # Sharded parameters are gathered for the final save (a collective: every process calls it).
        full_state = acc.get_state_dict(self.model) if self.sharded else None
        self.state.sources = self.source_shares()
        finish_trackers(acc)  # TensorBoard's event file complete before the output copies it
        result = None
        if self.main:
            result = finish(self.o, self.source, acc.unwrap_model(self.model), full_state, self.out_dtype,
                            self.objective, self.metrics, self.trajectory, self.world, self.state, self.align_record,
                            self.lora_targets, self.training_form, precision=precision_of(acc))
        acc.wait_for_everyone()
        acc.end_training()
        return result


def finish(o: UptrainOptions, source, model, full_state: dict, dtype, objective: Objective, metrics: MetricsLog,
           trajectory: dict, world: int, state: RunState, align_record: dict | None = None,
           lora_targets: list[str] | None = None, training_form=None, precision: str = "fp32") -> dict:
    """Main process: the final checkpoint (atomic), its record, metrics and plot; then the run folder goes."""
    rows = metrics.read()
    uptraining = uptraining_record(o, objective, rows, trajectory, world, state, align_record, lora_targets)
    uptraining["precision"] = precision  # the compute precision the run used (--precision resolved)
    recovery = f"the run folder {o.run_dir} keeps the final checkpoint (--resume writes the output from it)"
    with atomic_output_dir(o.out, force=o.force, source=source.folder, recovery=recovery) as tmp:
        if o.lora_rank:
            model = lora.unwrap(model, o.merge_lora, tmp)
        if training_form is not None:  # the kind's training form back to the stored one (Kind.training_form)
            training_form.restore(model, full_state)
        model_io.save_uptrained(model, full_state, source, tmp, dtype, o.max_shard_size, o.gradient_checkpointing)
        shutil.copy2(metrics.path, tmp / "uptrain_metrics.jsonl")
        if "tensorboard" in o.trackers:
            copy_tensorboard(o.run_dir, tmp)
        plot_metrics(rows, tmp / "uptrain.png", title=f"uptraining {source.spec} ({objective.kind} loss)")
        write_record(tmp, model_io.uptrained_record(source, uptraining))  # with the sha256 of the files written
        ordinary_permissions(tmp)  # safetensors' save_file makes -rw-------; other outputs are ordinary files
    if not o.keep_run_dir:
        shutil.rmtree(o.run_dir, ignore_errors=True)
    first, last = uptraining["initial_eval_ppl"], uptraining["final_eval_ppl"]
    ppl = f", held-out perplexity {first:.3f} -> {last:.3f}" if first is not None else ""
    if uptraining.get("final_other_eval_ppl") is not None:
        ppl += (f" (--eval-data {uptraining['initial_other_eval_ppl']:.3f} -> "
                f"{uptraining['final_other_eval_ppl']:.3f})")
    done = [f"{o.steps} steps ({objective.kind} loss)"] if o.steps else []
    if align_record is not None:
        done.insert(0, f"{align_record['tokens']} aligning attention layer by layer")
    log.info(f"wrote {o.out}: {uptraining['tokens']} tokens, {' then '.join(done)}{ppl}, "
             f"{state.elapsed + (align_record or {}).get('seconds', 0):.1f}s of training")
    return uptraining


def stored_record(o: UptrainOptions) -> dict:
    from .stored_kd import record
    from .teacher_store import TeacherStore

    return record(TeacherStore(Path(o.teacher_logprobs)))


def uptraining_record(o: UptrainOptions, objective: Objective, rows: list[dict], trajectory: dict, world: int,
                      state: RunState, align_record: dict | None, lora_targets: list[str] | None) -> dict:
    """The "uptraining" entry of the output's surgery.json, from the options and the run's metrics rows."""
    evals = [m for m in rows if "eval_ppl" in m]
    teacher = next((m for m in rows if "teacher_eval_ppl" in m), {})
    return {
        "data": o.data_spec,
        "data_mode": "stream" if o.streamed else "packed",
        "data_workers": o.data_workers,  # the number `auto` resolved to on this run's device
        "sources": getattr(state, "sources", None),
        "eval_data": o.eval_data,
        "data_commits": dataset_commits([*o.data, o.eval_data]) or None,  # each hub dataset's resolved commit
        "text_field": o.text_field,
        **o.txt_key(),  # a .txt file's documents: its paragraphs, lines or whole
        **({"chat_template": o.chat_template} if o.chat_template != "auto" else {}),  # (other records unchanged)
        **({"loss_on": o.loss_on} if o.loss_on != "all" else {}),
        "tokens": o.total_steps * o.batch_tokens,
        "stage": o.stage,
        "steps": o.steps,
        "kd_tokens": o.steps * o.batch_tokens,
        "align": align_record,
        "lora": ({"rank": o.lora_rank, "alpha": o.lora_alpha if o.lora_alpha is not None else 2 * o.lora_rank,
                  "targets": o.lora_targets or "attention linear layers", "modules": len(lora_targets or []),
                  "merged": o.merge_lora, "adapter": None if o.merge_lora else lora.ADAPTER_DIR}
                 if o.lora_rank else None),
        "loss": objective.kind if o.steps else None,
        "temperature": o.temperature if objective.needs_teacher else None,
        "kd_weight": o.kd_weight if objective.kind == "mix" else None,
        "kd_divergence": o.kd_divergence if objective.kind in ("kd", "mix") else None,
        **({"kd_beta": o.kd_beta} if objective.kind in ("kd", "mix") and o.kd_divergence == "jsd" else {}),
        **({"on_policy": {"fraction": o.on_policy, "gen_tokens": o.gen_tokens, "gen_temperature": o.gen_temperature,
                          "gen_seconds": round(sum(m.get("gen_s", 0.0) for m in rows), 3)}} if o.on_policy else {}),
        "hidden_weight": o.hidden_weight or None,
        **({"teacher_logprobs": stored_record(o)} if o.teacher_logprobs else {}),
        "teacher": ((public_name(trajectory.get("teacher")) or "surgery.json source")
                    if objective.needs_teacher or "align" in o.stages else None),
        "train": o.train,
        "optimizer": {"name": "adamw", "lr": o.lr, "betas": [0.9, 0.95], "weight_decay": o.weight_decay,
                      "warmup_steps": o.warmup, "schedule": "cosine", "min_lr_ratio": o.min_lr_ratio,
                      "max_grad_norm": o.max_grad_norm},
        "seq_len": o.seq_len,
        "batch_tokens": o.batch_tokens,
        "micro_batch": o.micro_batch,
        "processes": world,
        "seed": o.seed,
        "eval_tokens": o.eval_tokens,
        "initial_eval_ppl": ((align_record or {}).get("eval_ppl_before")  # before the alignment
                             or (evals[0]["eval_ppl"] if evals else None)),
        "final_eval_ppl": evals[-1]["eval_ppl"] if evals else None,
        "teacher_eval_ppl": teacher.get("teacher_eval_ppl"),
        **({"initial_other_eval_ppl": ((align_record or {}).get("other_eval_ppl_before")
                                       or (evals[0].get("other_eval_ppl") if evals else None)),
            "final_other_eval_ppl": evals[-1].get("other_eval_ppl") if evals else None,
            "teacher_other_eval_ppl": teacher.get("teacher_other_eval_ppl")} if o.eval_data is not None else {}),
        "final_train_loss": next((m["loss"] for m in reversed(rows) if "loss" in m), None),
        "train_seconds": round(state.elapsed, 3),
    }
