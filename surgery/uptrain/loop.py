"""The uptraining loop, on accelerate: CPU, one GPU, or several processes under `accelerate launch`.

One optimizer step = `batch_tokens` tokens = B windows of `seq_len`, split over W processes and, within each,
into micro-batches of `micro_batch` windows (gradient accumulation makes up the rest). Losses are means over
positions and DDP averages gradients over processes, so a step computes the same update however it is split.
AdamW over the trainable parameters, linear warmup then cosine decay (the learning rate is a function of the step
alone), gradient clipping. bf16 autocast on CUDA, fp32 on CPU. Only the main process logs and writes files.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
import sys
import time
from pathlib import Path

import torch

from ..atomic import atomic_output_dir, check_output_path, ordinary_permissions
from ..errors import SurgeryError
from ..publish.hashes import record_output_hashes
from ..source import resolve_source
from ..record import local_source_folder, public_name
from . import lora, model_io
from .align import align
from .data import cache_key, pack, read_cache, write_cache
from .heads import OutputHead
from .losses import Objective, _same
from .metrics import MetricsLog
from .options import UptrainOptions
from .params import select_trainable
from .plot import plot_metrics
from .progress import Progress
from .state import Checkpoints, RunState

FEW_STEPS = 20  # fewer optimizer steps than this: warn
OOM_MARKERS = ("out of memory", "can't allocate memory", "CUDA error: out of memory")


def lr_at(step: int, o: UptrainOptions) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then cosine down to lr * min_lr_ratio."""
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


def make_accelerator():
    """bf16 autocast on CUDA, fp32 elsewhere. Without CUDA, cpu=True lets several processes started by
    `accelerate launch --multi_gpu --num_processes N` (torchrun) or `torchrun` run DDP on CPU over gloo, and
    an FSDP config (`accelerate launch --config_file fsdp.yaml`) run FSDP on CPU over gloo (see `use_fsdp_on_cpu`)."""
    import os

    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    cuda = torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "true", "yes")
    precision = "bf16" if cuda and torch.cuda.is_bf16_supported() else "no"
    acc = Accelerator(cpu=not cuda, mixed_precision=precision)
    fsdp_config = os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"  # set by accelerate launch
    if fsdp_config and acc.distributed_type == DistributedType.MULTI_CPU:
        use_fsdp_on_cpu(acc)
    return acc


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


def resolve_objective(o: UptrainOptions, record: dict) -> Objective:
    teacher_known = bool(o.teacher or (record.get("source") or {}).get("spec") or local_source_folder(record))
    if "align" in o.stages and not teacher_known:
        raise SurgeryError("--stage align needs the source to align to: the input has no surgery.json naming its "
                           "source; pass --teacher")
    kind = o.loss if o.loss != "auto" else ("kd" if teacher_known else "lm")
    if kind in ("kd", "mix") and not teacher_known:
        raise SurgeryError(f"--loss {kind} needs a teacher: the input has no surgery.json naming its source; pass --teacher")
    return Objective(kind, temperature=o.temperature, kd_weight=o.kd_weight)


def check_run_dir(o: UptrainOptions, trajectory: dict) -> None:
    """Refuse a run folder that cannot be used: nothing is written here."""
    run_json = o.run_dir / "run.json"
    if o.resume:
        if not run_json.exists():
            raise SurgeryError(f"--resume: {o.run_dir} holds no run to resume (no run.json)")
        try:
            saved = json.loads(run_json.read_text())
            if not isinstance(saved, dict):
                raise ValueError(f"a JSON {type(saved).__name__}, not an object")
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise SurgeryError(f"--resume: corrupt {run_json} ({str(e).splitlines()[0]}): start over with --force") from None
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
    print(f"surgery: warning: {message}", file=sys.stderr, flush=True)


@torch.no_grad()
def evaluate(model, data, acc, micro_batch: int) -> dict:
    """Held-out next-token loss and perplexity; windows sharded over processes, sums reduced.
    Every process runs as many forward passes as the largest shard needs (FSDP gathers parameters and DDP
    broadcasts buffers in collectives inside forward): one that has run out repeats a window, not counted."""
    from .losses import lm_loss

    was_training = model.training
    model.eval()
    shard = data.eval_shard(acc.process_index, acc.num_processes)
    largest = -(-data.eval.shape[0] // acc.num_processes)
    total = torch.zeros(2, dtype=torch.float64, device=acc.device)  # [nll sum, targets]
    for i in range(0, largest, micro_batch):
        ids = shard[i : i + micro_batch].to(acc.device)
        counted = ids.shape[0]
        if counted == 0:
            ids = data.eval[:1].long().to(acc.device)
        with acc.autocast():
            logits = model(input_ids=ids, use_cache=False).logits
        n = counted * (ids.shape[1] - 1)
        total += torch.tensor([lm_loss(logits, ids).double().item() * n, n], dtype=torch.float64, device=acc.device)
    total = acc.reduce(total, reduction="sum")
    model.train(was_training)
    loss = (total[0] / total[1]).item()
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700))}


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
    from accelerate.utils import DistributedType, set_seed
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight loading/writing bars: stderr stays for our bar and errors
    fixed_mmap_threshold()
    logging.getLogger("accelerate.utils.other").setLevel(logging.ERROR)  # "removed shared tensor" on tied weights
    if o.lora_rank:
        lora.require_peft()
    source = resolve_source(o.model)
    record = model_io.read_record(source.folder)
    objective = resolve_objective(o, record)
    acc = make_accelerator()
    main, world = acc.is_main_process, acc.num_processes
    per_process, rem = divmod(o.sequences_per_step, world)
    if rem or per_process % o.micro_batch:
        raise SurgeryError(
            f"--batch-tokens {o.batch_tokens} gives {o.sequences_per_step} sequences of {o.seq_len} per step, which "
            f"{world} process(es) cannot split into micro-batches of {o.micro_batch}: make it a multiple of "
            f"{world * o.micro_batch * o.seq_len}")
    accum = per_process // o.micro_batch
    trajectory = o.trajectory() | {"model": str(Path(source.folder).absolute()), "loss": objective.kind}
    check_output_path(o.out, o.force, source=source.folder)
    check_run_dir(o, trajectory)
    set_seed(o.seed)

    tokenizer = model_io.load_tokenizer(source, "model", o.trust_remote_code)
    model = model_io.load_causal_lm(source, "model", o.trust_remote_code)
    model_io.check_seq_len(model, o.seq_len, source.spec)
    out_dtype = model_io.checkpoint_dtype(source.folder, source.config)
    teacher = None
    if objective.needs_teacher or "align" in o.stages:
        t_src = model_io.teacher_source(record, o.teacher)
        teacher = model_io.load_causal_lm(t_src, "teacher", o.trust_teacher_code)
        model_io.check_teacher(model, teacher, tokenizer, t_src, o.trust_teacher_code)
        teacher.requires_grad_(False)
        teacher.eval().to(acc.device)
    train_tokens = o.total_steps * o.sequences_per_step * o.seq_len
    key = cache_key(data=o.data, text_field=o.text_field, seq_len=o.seq_len, eval_tokens=o.eval_tokens,
                    train_tokens=train_tokens, vocab=len(tokenizer), eos=tokenizer.eos_token_id,
                    tokenizer=type(tokenizer).__name__)

    def build():
        from ..data import load_texts

        return pack(load_texts(o.data, o.text_field, o.streaming), tokenizer, o.seq_len, o.eval_tokens, train_tokens,
                    seed=o.seed)

    with acc.main_process_first():  # the main process packs the data and caches it for the others (and resumes)
        cache = o.run_dir / "data.pt"
        data = read_cache(cache, key, o.seed) if (o.resume or not main) else None
        if data is None:
            data = build()
            if main:
                if not o.resume:
                    start_run_dir(o, trajectory)
                write_cache(cache, key, data)

    ckpts = Checkpoints(o.run_dir, o.keep_last, acc)
    align_record = None
    if "align" in o.stages and not (o.resume and ckpts.latest() is not None):  # else the checkpoint has it
        windows = data.train[data.window_indices(0, o.align_steps * o.sequences_per_step)]
        log = (lambda line: print(line, flush=True)) if main else (lambda line: None)
        model.to(acc.device)
        before = evaluate(model, data, acc, o.micro_batch)["eval_ppl"] if data.eval.shape[0] else None
        held_out = data.eval[: windows.shape[0]]  # the per-layer errors on as many held-out windows as it trains on
        align_record = align(model, teacher, windows.long(), held_out.long(), micro_batch=o.micro_batch,
                             epochs=o.align_epochs, lr=o.align_lr, device=acc.device, log=log)
        align_record["tokens"] = o.align_steps * o.batch_tokens
        align_record["eval_ppl_before"] = before
        if main:
            (o.run_dir / "align.json").write_text(json.dumps(align_record, indent=2) + "\n")
    elif "align" in o.stages and (o.run_dir / "align.json").exists():
        align_record = json.loads((o.run_dir / "align.json").read_text())

    trainable = select_trainable(model, o.train, record)
    lora_targets = None
    if o.lora_rank:
        model, lora_targets = lora.wrap(model, o.lora_rank, o.lora_alpha, o.lora_targets)
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if o.gradient_checkpointing:
        model_io.enable_checkpointing(model, source.spec)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, o)
    model, optimizer = acc.prepare(model, optimizer)
    params = [p for p in model.parameters() if p.requires_grad]  # as prepared (FSDP replaces them)
    if acc.distributed_type == DistributedType.DEEPSPEED:
        raise SurgeryError("uptrain does not run under DeepSpeed (its checkpoints are pickles, which --resume would "
                           "have to run): use FSDP (recipes/accelerate/fsdp-8gpu.yaml) or DDP")
    sharded = acc.distributed_type == DistributedType.FSDP
    if sharded and o.lora_rank:
        raise SurgeryError("--lora-rank does not run under FSDP yet: use DDP or one process")
    state = RunState()
    state.data_key = key
    ckpts.remove_partial()
    metrics = MetricsLog(o.run_dir / "metrics.jsonl", main)
    resumed_from = None
    if o.resume and ckpts.latest() is not None:
        resumed_from = ckpts.load_latest(model, optimizer, state)
        if state.data_key != key:
            raise SurgeryError(f"--resume: the data no longer matches the checkpoint in {resumed_from}")
    acc.wait_for_everyone()
    metrics.start(state.step if resumed_from else None)

    # The output projections move into the losses (no whole-micro-batch logits) where that gives the same logits;
    # not under FSDP, whose root unit may reshard the projection after the forward.
    s_head = None if sharded else OutputHead.of(acc.unwrap_model(model), model_io.vocab_size(acc.unwrap_model(model)))
    t_head = OutputHead.of(teacher, model_io.vocab_size(teacher)) if teacher is not None else None
    projections = (s_head.project if s_head else _same, t_head.project if t_head else _same)

    tokens_per_step = o.sequences_per_step * o.seq_len
    n_params = sum(p.numel() for p in params)
    if main:
        print(f"uptrain: {objective.kind} loss, training {len(trainable)} tensors ({n_params:,} parameters), "
              f"{o.steps} steps x {tokens_per_step} tokens, {world} process(es) x {accum} micro-batch(es) of "
              f"{o.micro_batch}, {data.train.shape[0]} training / {data.eval.shape[0]} held-out windows of {o.seq_len}"
              + (f", parameters sharded by {acc.distributed_type.value}" if sharded else "")
              + (f"; resumed at step {state.step} from {resumed_from.name}" if resumed_from else ""), flush=True)
        if 0 < o.steps < FEW_STEPS:
            warn(f"--tokens {o.tokens} with --batch-tokens {o.batch_tokens} makes only {o.steps} optimizer step"
                 f"{'s' if o.steps > 1 else ''}: too few for the learning-rate schedule to mean much; raise --tokens or "
                 f"lower --batch-tokens")

    def do_eval(step: int) -> dict | None:
        if data.eval.shape[0] == 0:
            return None
        result = evaluate(model, data, acc, o.micro_batch)
        if not all_finite(acc, result["eval_loss"]):
            raise SurgeryError(f"the held-out loss is not finite after step {step} (the weights diverged: lower --lr, "
                               f"now {o.lr:g}); {last_good(ckpts)}")
        metrics.write(step=step, tokens=step * tokens_per_step, **result)
        return result

    try:
        if resumed_from is None:
            first = do_eval(0)
            if teacher is not None and first is not None:
                metrics.write(step=0, tokens=0, teacher_eval_ppl=evaluate(teacher, data, acc, o.micro_batch)["eval_ppl"])
            if align_record is not None and first is not None:  # the evaluation at step 0 came after the alignment
                align_record["eval_ppl"] = first["eval_ppl"]
        bar = Progress(o.steps, state.step, tokens_per_step, enabled=main and o.progress, every_s=o.progress_every)
        for step in range(state.step, o.steps):
            start = time.perf_counter()
            lr = lr_at(step, o)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = data.step_batch(o.align_steps + step, o.sequences_per_step, acc.process_index, world)
            loss_sum = torch.zeros((), device=acc.device)
            parts_sum: dict[str, torch.Tensor] = {}
            for m in range(accum):
                ids = batch[m * o.micro_batch : (m + 1) * o.micro_batch].to(acc.device)
                sync = contextlib.nullcontext() if m == accum - 1 else acc.no_sync(model)
                with sync:
                    with acc.autocast():  # logits, or final hidden states the losses project chunk by chunk
                        with hidden(s_head):
                            logits = model(input_ids=ids, use_cache=False).logits
                        t_logits = None
                        if teacher is not None:
                            with torch.no_grad(), hidden(t_head):
                                t_logits = teacher(input_ids=ids, use_cache=False).logits
                        loss, parts = objective(logits, ids, t_logits, *projections)
                    acc.backward(loss / accum)
                loss_sum += loss.detach() / accum
                for k, v in parts.items():
                    parts_sum[k] = parts_sum.get(k, 0) + v / accum
                del logits, t_logits, loss
            # inf max_norm: the norm (of all processes' gradients) without clipping
            grad_norm = acc.clip_grad_norm_(params, o.max_grad_norm if o.max_grad_norm > 0 else math.inf)
            logged = acc.reduce(torch.stack([loss_sum, *parts_sum.values()]), reduction="mean").tolist()  # syncs
            grad_norm = float(grad_norm)
            if not all_finite(acc, logged[0], grad_norm):
                what = "loss" if not math.isfinite(logged[0]) else "gradient norm"
                raise SurgeryError(f"the training {what} is not finite at step {step + 1} (lower --lr, now {o.lr:g}); "
                                   f"nothing of this step was written, {last_good(ckpts)}")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            state.step = step + 1
            seconds = time.perf_counter() - start
            state.elapsed += seconds
            row = dict(step=state.step, tokens=state.step * tokens_per_step, loss=logged[0],
                       **{f"{k}_loss": v for k, v in zip(parts_sum, logged[1:])}, lr=lr,
                       grad_norm=float(grad_norm),
                       tokens_per_s=tokens_per_step / seconds, elapsed=state.elapsed)
            metrics.write(**row)
            bar.step(row)
            last = state.step == o.steps
            if last or state.step % o.eval_interval == 0:
                result = do_eval(state.step)
                if result is not None and main and o.progress:
                    bar.write(f"step {state.step}: held-out perplexity {result['eval_ppl']:.3f}")
            if last or (o.save_every and state.step % o.save_every == 0):
                if not all_finite(acc, *(p.detach() for p in params)):
                    raise SurgeryError(f"the weights are not finite after step {state.step} (lower --lr, now {o.lr:g});"
                                       f" {last_good(ckpts)}")
                ckpts.save(state.step, model, optimizer, state)
        bar.close()
    except (RuntimeError, torch.OutOfMemoryError) as e:
        if _is_oom(e):
            raise SurgeryError(f"out of memory at step {state.step + 1} (micro-batch {o.micro_batch} x {o.seq_len} "
                               "tokens): lower --micro-batch (accumulation keeps the batch) or add "
                               "--gradient-checkpointing; --resume continues from the last checkpoint") from None
        raise

    # Sharded parameters are gathered for the final save (a collective: every process calls it).
    full_state = acc.get_state_dict(model) if sharded else None
    result = None
    if main:
        result = finish(o, source, acc.unwrap_model(model), full_state, out_dtype, objective, metrics, trajectory,
                        world, state, align_record, lora_targets)
    acc.wait_for_everyone()
    acc.end_training()
    return result


def finish(o: UptrainOptions, source, model, full_state: dict, dtype, objective: Objective, metrics: MetricsLog,
           trajectory: dict, world: int, state: RunState, align_record: dict | None = None,
           lora_targets: list[str] | None = None) -> dict:
    """Main process: the final checkpoint (atomic), its record, metrics and plot; then the run folder goes."""
    rows = metrics.read()
    evals = [m for m in rows if "eval_ppl" in m]
    teacher_ppl = next((m["teacher_eval_ppl"] for m in rows if "teacher_eval_ppl" in m), None)
    uptraining = {
        "data": o.data,
        "text_field": o.text_field,
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
        "teacher_eval_ppl": teacher_ppl,
        "final_train_loss": next((m["loss"] for m in reversed(rows) if "loss" in m), None),
        "train_seconds": round(state.elapsed, 3),
    }
    recovery = f"the run folder {o.run_dir} keeps the final checkpoint (--resume writes the output from it)"
    with atomic_output_dir(o.out, force=o.force, source=source.folder, recovery=recovery) as tmp:
        if o.lora_rank:
            model = lora.unwrap(model, o.merge_lora, tmp)
        model_io.write_checkpoint(model, full_state, source, tmp, dtype, o.max_shard_size, o.gradient_checkpointing)
        model_io.write_record(source, tmp, uptraining)
        shutil.copy2(metrics.path, tmp / "uptrain_metrics.jsonl")
        plot_metrics(rows, tmp / "uptrain.png", title=f"uptraining {source.spec} ({objective.kind} loss)")
        record_output_hashes(tmp)  # the files changed: record their sha256 in surgery.json, as converters do
        ordinary_permissions(tmp)  # safetensors' save_file makes -rw-------; other outputs are ordinary files
    if not o.keep_run_dir:
        shutil.rmtree(o.run_dir, ignore_errors=True)
    first, last = uptraining["initial_eval_ppl"], uptraining["final_eval_ppl"]
    ppl = f", held-out perplexity {first:.3f} -> {last:.3f}" if first is not None else ""
    done = [f"{o.steps} steps ({objective.kind} loss)"] if o.steps else []
    if align_record is not None:
        done.insert(0, f"{align_record['tokens']} aligning attention layer by layer")
    print(f"wrote {o.out}: {uptraining['tokens']} tokens, {' then '.join(done)}{ppl}, "
          f"{state.elapsed + (align_record or {}).get('seconds', 0):.1f}s of training", flush=True)
    return uptraining
