"""The uptraining loop, on accelerate: CPU, one GPU, or several processes under `accelerate launch`.

One optimizer step = `batch_tokens` tokens = B windows of `seq_len`, split over W processes and, within each,
into micro-batches of `micro_batch` windows (gradient accumulation makes up the rest). Losses are means over
positions and DDP averages gradients over processes, so a step computes the same update however it is split.
AdamW over the trainable parameters, linear warmup then cosine decay (the learning rate is a function of the step
alone), gradient clipping. Autocast in --precision (auto: bf16 on CUDA, fp32 on CPU). Only the main process logs and writes files.

Here the run's stages in order (`setup`) and the training steps (`UptrainRecipe`). Each setup stage is a function
that takes what it needs and returns a small frozen dataclass, which `setup` hands on to the later stages and finally
to the recipe: `Inputs` (source, record, objective), `Run` (accelerator, processes, batch split), `Models`, `Data`,
`Checkpoints`, the align stage's record, `Training` (optimizer, trainable parameters, run state, metrics, the resumed
checkpoint) and `Heads`; the stages themselves are in recipe_setup.py and recipe_data.py, the accelerator in
accelerator.py, the optimizer and its schedule optimizer.py, the run folder run_folder.py, the held-out evaluation
evaluation.py, and the final write-out output.py.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import time
from dataclasses import dataclass

import torch

from ..checkpoint.atomic import write_text_atomic
from ..checkpoint.record import public_name
from ..errors import SurgeryError
from ..loaders import read_json
from ..logs import get_logger
from .accelerator import make_accelerator, precision_of
from .align import align
from .evaluation import evaluate_held_out
from .finite import all_finite, last_good
from .heads import OutputHead
from .onpolicy import generating_model
from .optimizer import group_lr, lr_at
from .options import UptrainOptions
from .output import finish
from .progress import Progress
from .recipe_data import check_stream, setup_data, warn_rereading
from .recipe_setup import (Data, Heads, Inputs, Models, Run, Training, read_inputs, setup_environment, setup_heads,
                           setup_models, setup_run, setup_training)
from .retrieval_mix import mixed, mixed_weighted
from .state import Checkpoints
from .trackers import TB_DIR, finish_trackers

FEW_STEPS = 20  # fewer optimizer steps than this: warn
OOM_MARKERS = ("out of memory", "can't allocate memory", "CUDA error: out of memory")
log = get_logger(__name__)


def warn(message: str) -> None:
    log.warning(message)


def hidden(head: OutputHead | None):
    return head.returning_hidden() if head is not None else contextlib.nullcontext()


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or any(m in str(e) for m in OOM_MARKERS)


def run(o: UptrainOptions) -> dict:
    """One uptraining run, in torchtune's recipe shape: setup, train (steps, evaluations, checkpoints), save."""
    recipe = setup(o)
    try:
        recipe.train()
    except SurgeryError:  # refused at the first step (a store whose windows are not the run's): no step to resume,
        if not o.resume and recipe.run.main and recipe.training.state.step == 0:  # so the run folder it started goes
            shutil.rmtree(o.run_dir, ignore_errors=True)  # with it
        raise
    return recipe.save()


def setup(o: UptrainOptions) -> UptrainRecipe:
    """The run's setup stages in order, each handed what the earlier ones returned (nothing is written before the
    inputs prove good); returns the recipe that trains and saves. Refused before the first step (a tracker that cannot
    start, a bad store), a fresh run has nothing to resume, so the run folder it made goes."""
    made_run_dir = not o.resume and not o.run_dir.exists()
    main = True  # until the accelerator says which process this is
    try:
        setup_environment(o)
        inputs = read_inputs(o)
        acc = make_accelerator(o.precision, o.trackers, o.run_dir / TB_DIR)
        main = acc.is_main_process
        run = setup_run(o, inputs, acc)
        if run.main:
            warn_rereading(o, inputs.record)
        check_stream(o, run.world)
        models = setup_models(o, inputs, run)
        data = setup_data(o, run, models.tokenizer, models.chat)
        ckpts = Checkpoints(o.run_dir, o.keep_last, acc)
        align_record = setup_align(o, run, models, data, ckpts)
        models, training = setup_training(o, inputs, run, models, data, ckpts)
        heads = setup_heads(models, acc, training.sharded)
        recipe = UptrainRecipe(o=o, inputs=inputs, run=run, models=models, data=data, ckpts=ckpts, training=training,
                               heads=heads, align_record=align_record)
        recipe.announce()
    except BaseException:
        if made_run_dir and main:
            shutil.rmtree(o.run_dir, ignore_errors=True)
        raise
    return recipe


def setup_align(o: UptrainOptions, run: Run, models: Models, data: Data, ckpts: Checkpoints) -> dict | None:
    """The `align` stage (attention layer by layer against the teacher), unless a checkpoint already has it; returns
    its record (align.json), None without the stage."""
    acc, windows = run.acc, data.windows
    if "align" not in o.stages:
        return None
    if o.resume and ckpts.latest() is not None:
        align_json = o.run_dir / "align.json"
        return read_json(align_json) if align_json.exists() else None  # (one line when corrupt)
    count = o.align_steps * o.sequences_per_step
    train = mixed(models.mix, windows.take(count) if o.streamed else windows.train[windows.window_indices(0, count)], 0)
    say = log.info if run.main else (lambda line: None)
    models.model.to(acc.device)
    before = evaluate_held_out(models.model, windows, acc, o.micro_batch) if windows.eval.shape[0] else {}
    held_out = windows.eval[: train.shape[0]]  # the per-layer errors on as many held-out windows as it trains on
    record = align(models.model, models.teacher, train.long(), held_out.long(), micro_batch=o.micro_batch,
                   epochs=o.align_epochs, lr=o.align_lr, device=acc.device, log=say)
    record["tokens"] = o.align_steps * o.batch_tokens
    record["eval_ppl_before"] = before.get("eval_ppl")
    if "other_eval_ppl" in before:
        record["other_eval_ppl_before"] = before["other_eval_ppl"]
    if run.main:
        write_text_atomic(o.run_dir / "align.json", json.dumps(record, indent=2) + "\n", "align.json")
    return record


@dataclass(frozen=True)
class UptrainRecipe:
    """One run after its setup (`setup` builds it from the stages' results; nothing here is set afterwards): `train`
    runs the optimizer steps with their evaluations and checkpoints, `save` writes the output. `align_record` is the
    align stage's record (None without it), which the evaluation at step 0 completes."""

    o: UptrainOptions
    inputs: Inputs
    run: Run
    models: Models
    data: Data
    ckpts: Checkpoints
    training: Training
    heads: Heads
    align_record: dict | None

    def announce(self) -> None:
        o, run, windows, training = self.o, self.run, self.data.windows, self.training
        if not run.main:
            return
        n_params = sum(p.numel() for p in training.params)
        log.info(f"uptrain: {self.inputs.objective.kind} loss, training {len(training.trainable)} tensors "
                 f"({n_params:,} parameters), {o.steps} steps x {run.tokens_per_step} tokens, {run.world} process(es) "
                 f"x {run.accum} micro-batch(es) of {o.micro_batch}, "
                 + (f"training windows streamed from {len(o.data)} source(s) by {max(1, o.data_workers)} reader(s) "
                    f"per process, {windows.eval.shape[0]} held-out " if o.streamed else
                    f"{windows.train.shape[0]} training / {windows.eval.shape[0]} held-out ")
                 + (f"(+ {windows.other.shape[0]} of --eval-data) " if windows.other is not None else "")
                 + f"windows of {o.seq_len}"
                 + (f", parameters sharded by {run.acc.distributed_type.value}" if training.sharded else "")
                 + (" (the teacher's too)" if training.sharded and self.models.teacher is not None else "")
                 + (f"; resumed at step {training.state.step} from {training.resumed_from.name}"
                    if training.resumed_from else ""))
        if 0 < o.steps < FEW_STEPS:
            warn(f"--tokens {o.tokens} with --batch-tokens {o.batch_tokens} makes only {o.steps} optimizer step"
                 f"{'s' if o.steps > 1 else ''}: too few for the learning-rate schedule to mean much; raise --tokens "
                 f"or lower --batch-tokens")

    # --- train ---------------------------------------------------------------------------------------------------
    def train(self) -> None:
        """Optimizer steps from the resumed one to the last, each followed by its evaluation and checkpoint when due."""
        o, run, training, state = self.o, self.run, self.training, self.training.state
        try:
            if training.resumed_from is None:
                self._evaluate_start()
            bar = Progress(o.steps, state.step, run.tokens_per_step, enabled=run.main and o.progress,
                           every_s=o.progress_every, data_line=self.data_line if o.streamed else None)
            for step in range(state.step, o.steps):
                row = self.train_step(step)
                training.metrics.write(**row)
                bar.step(row)
                last = state.step == o.steps
                if last or state.step % o.eval_interval == 0:
                    result = self.evaluate_at(state.step)
                    if result is not None and run.main:
                        other = (f", --eval-data {result['other_eval_ppl']:.3f}" if "other_eval_ppl" in result
                                 else "")
                        line = f"step {state.step}: held-out perplexity {result['eval_ppl']:.3f}{other}"
                        if bar.bar is not None:  # above a terminal's bar
                            bar.write(line)
                        else:  # an informational line, which `surgery -q` keeps off
                            log.info(line)
                if last or (o.save_every and state.step % o.save_every == 0):
                    self.save_checkpoint()
            bar.close()
            if o.streamed:
                self.data.windows.close()
        except (RuntimeError, torch.OutOfMemoryError) as e:
            if _is_oom(e):
                raise SurgeryError(f"out of memory at step {state.step + 1} (micro-batch {o.micro_batch} x {o.seq_len} "
                                   "tokens): lower --micro-batch (accumulation keeps the batch) or add "
                                   "--gradient-checkpointing; --resume continues from the last checkpoint") from None
            raise

    def train_step(self, step: int) -> dict:
        """One optimizer step (0-based `step`): the micro-batches' forward and backward passes, clipping, the
        update; returns the metrics row. A step whose loss or gradient norm is not finite changes nothing."""
        o, run, models, on_policy = self.o, self.run, self.models, self.inputs.on_policy
        acc, world, accum = run.acc, run.world, run.accum
        state, optimizer = self.training.state, self.training.optimizer
        start = time.perf_counter()
        lr = lr_at(step, o)
        for group in optimizer.param_groups:
            group["lr"] = group_lr(group, step, o)
        batch = self.data.windows.step_batch(o.align_steps + step, o.sequences_per_step, acc.process_index, world)
        share = o.sequences_per_step // world  # this process's windows of the step, in the run's global order
        batch, positions = mixed_weighted(models.mix, batch,
                                          (o.align_steps + step) * o.sequences_per_step + acc.process_index * share)
        masks, weights = self._step_masks(step)
        if models.store is not None:  # the stored teacher pass of these windows, taken by the micro-steps in turn
            from .stored_kd import first_window

            first = first_window(o, step, acc.process_index, world)
            self.inputs.objective.queue(models.store.read(first, batch.shape[0]), o.micro_batch)
        loss_sum = torch.zeros((), device=acc.device)
        parts_sum: dict[str, torch.Tensor] = {}
        gen_seconds = 0.0
        for m in range(accum):
            ids = batch[m * o.micro_batch : (m + 1) * o.micro_batch].to(acc.device)
            mask = masks[m * o.micro_batch : (m + 1) * o.micro_batch].to(acc.device) if masks is not None else None
            weight = weights[m] if weights is not None else None
            loss_weights = None  # the objective's per-position masks or weights, if any
            if positions is not None:  # --retrieval-answer-weight: the answers' positions count more
                rows = positions[m * o.micro_batch : (m + 1) * o.micro_batch]
                loss_weights = {"position_weights": rows.to(acc.device)}
            if on_policy is not None and on_policy.generates(step * accum + m):
                g = on_policy.generator(step, m, acc.process_index, acc.device)
                ids, loss_weights, seconds = on_policy.rollout(generating_model(acc.unwrap_model(models.model)), ids, g,
                                                            acc.autocast)
                gen_seconds += seconds
            loss, parts = self._micro_step(ids, last=m == accum - 1, weight=weight, mask=mask,
                                           loss_weights=loss_weights)
            loss_sum += loss / accum if weight is None else loss * weight
            for k, v in parts.items():
                parts_sum[k] = parts_sum.get(k, 0) + (v / accum if weight is None else v * weight)
        # inf max_norm: the norm (of all processes' gradients) without clipping
        grad_norm = acc.clip_grad_norm_(self.training.params, o.max_grad_norm if o.max_grad_norm > 0 else math.inf)
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
        generation = ({"gen_s": gen_seconds, "gen_share": gen_seconds / seconds} if on_policy is not None
                      else {})  # on-policy distillation: the student's generating, its share of the step
        return dict(step=state.step, tokens=state.step * run.tokens_per_step, loss=logged[0],
                    **{f"{k}_loss": v for k, v in zip(parts_sum, logged[1:])}, lr=lr, grad_norm=grad_norm,
                    tokens_per_s=run.tokens_per_step / seconds, elapsed=state.elapsed, **generation)

    def _step_masks(self, step: int) -> tuple[torch.Tensor | None, list[float] | None]:
        """--loss-on assistant: this process's token masks of step `step` and each micro-batch's weight, its share of
        the step's counted targets (all processes) times the number of processes (DDP averages the gradients): the
        step's loss is the mean over every counted target, however the batch is split. Otherwise no masks, and each
        micro-batch weighs 1 / accumulation steps (None)."""
        o, acc, world = self.o, self.run.acc, self.run.world
        if o.loss_on != "assistant":
            return None, None
        masks = self.data.windows.step_mask(o.align_steps + step, o.sequences_per_step, acc.process_index, world)
        counts = [int(masks[m * o.micro_batch : (m + 1) * o.micro_batch, 1:].sum()) for m in range(self.run.accum)]
        total = acc.reduce(torch.tensor([float(sum(counts))], device=acc.device), reduction="sum").item()
        if total == 0:
            raise SurgeryError(f"--loss-on assistant: step {step + 1}'s windows hold no assistant token (is the data "
                               "a messages column rendered with the chat template?)")
        return masks, [c * world / total for c in counts]

    def _micro_step(self, ids: torch.Tensor, last: bool, weight: float | None = None,
                    mask: torch.Tensor | None = None, loss_weights: dict | None = None) -> tuple[torch.Tensor, dict]:
        """Forward and backward of one micro-batch (gradients synchronised on the step's last one only), its loss
        scaled by `weight` (default 1 / accumulation steps); returns its detached loss and loss parts (unscaled).
        `mask`: the tokens the losses count (--loss-on assistant). `loss_weights`: the objective's other weights: the
        loss masks of a micro-batch the student wrote (onpolicy.py), or --retrieval-answer-weight's position weights."""
        acc, model, teacher = self.run.acc, self.models.model, self.models.teacher
        objective, heads = self.inputs.objective, self.heads
        sync = contextlib.nullcontext() if last else acc.no_sync(model)
        with sync:
            states = {"output_hidden_states": True} if objective.needs_hidden_states else {}
            with acc.autocast():  # logits, or final hidden states the losses project chunk by chunk
                with hidden(heads.student):
                    out = model(input_ids=ids, use_cache=False, **states)
                t_out = None
                if teacher is not None:
                    with torch.no_grad(), hidden(heads.teacher):
                        t_out = teacher(input_ids=ids, use_cache=False, **states)
                loss, parts = objective(out.logits, ids, t_out.logits if t_out is not None else None,
                                        *heads.projections, states=out.hidden_states if states else None,
                                        teacher_states=t_out.hidden_states if states else None,
                                        mask=mask, **(loss_weights or {}))
            acc.backward(loss / self.run.accum if weight is None else loss * weight)
        del out, t_out
        return loss.detach(), parts

    def data_line(self) -> str:
        """Progress of the stream (this process's readers): tokens read, blank documents skipped, each source's
        share of the windows so far."""
        got = self.data.windows.shares()
        total = max(1, sum(got["windows"]))
        shares = ", ".join(f"{public_name(name) or name} {n / total:.1%}" for name, n in zip(self.o.data, got["windows"]))
        return f"read {got['tokens']:,} tokens, {got['skipped']} blank documents skipped; shares {shares}"

    def source_shares(self) -> list[dict] | None:
        """Streamed: each source's weight and its share of the windows trained on (all processes), for the record."""
        if not self.o.streamed:
            return None
        acc = self.run.acc
        counts = torch.tensor(self.data.windows.shares()["windows"], dtype=torch.float64, device=acc.device)
        counts = acc.reduce(counts, reduction="sum").cpu().tolist()
        total = max(1.0, sum(counts))
        return [{"data": public_name(spec) or spec, "weight": round(w, 6), "windows": int(n),
                 "share": round(n / total, 6)} for spec, w, n in zip(self.o.data, self.o.weights, counts)]

    # --- evaluate ------------------------------------------------------------------------------------------------
    def evaluate_at(self, step: int) -> dict | None:
        """Held-out loss and perplexity after `step` (None without held-out windows), written to the metrics."""
        o, acc, windows = self.o, self.run.acc, self.data.windows
        if windows.eval.shape[0] == 0:
            return None
        result = evaluate_held_out(self.models.model, windows, acc, o.micro_batch)
        if not all_finite(acc, result["eval_loss"], result.get("other_eval_loss", 0.0)):
            raise SurgeryError(f"the held-out loss is not finite after step {step} (the weights diverged: lower --lr, "
                               f"now {o.lr:g}); {last_good(self.ckpts)}")
        self.training.metrics.write(step=step, tokens=step * self.run.tokens_per_step, **result)
        return result

    def _evaluate_start(self) -> None:
        """A fresh run's step 0: the student's (and the teacher's) held-out perplexity, after any alignment."""
        first = self.evaluate_at(0)
        if self.models.teacher is not None and first is not None:
            teacher = evaluate_held_out(self.models.teacher, self.data.windows, self.run.acc, self.o.micro_batch)
            self.training.metrics.write(step=0, tokens=0,
                                        **{f"teacher_{k}": v for k, v in teacher.items() if k.endswith("ppl")})
        if self.align_record is not None and first is not None:  # the evaluation at step 0 came after the alignment
            self.align_record["eval_ppl"] = first["eval_ppl"]
            if "other_eval_ppl" in first:
                self.align_record["other_eval_ppl"] = first["other_eval_ppl"]

    # --- save ----------------------------------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        """A resumable checkpoint of the current step, refused when the weights are not finite."""
        training = self.training
        if not all_finite(self.run.acc, *(p.detach() for p in training.params)):
            raise SurgeryError(f"the weights are not finite after step {training.state.step} (lower --lr, now "
                               f"{self.o.lr:g}); {last_good(self.ckpts)}")
        data_state = self.data.windows.state_dict() if self.o.streamed else None
        self.ckpts.save(training.state.step, self.models.model, training.optimizer, training.state, data_state)

    def save(self) -> dict | None:
        """The final checkpoint, written by the main process (`finish`); the uptraining record on the main one."""
        acc, models, training = self.run.acc, self.models, self.training
        # Sharded parameters are gathered for the final save (a collective: every process calls it).
        full_state = acc.get_state_dict(models.model) if training.sharded else None
        training.state.sources = self.source_shares()
        finish_trackers(acc)  # TensorBoard's event file complete before the output copies it
        result = None
        if self.run.main:
            result = finish(self.o, self.inputs.source, acc.unwrap_model(models.model), full_state, models.out_dtype,
                            self.inputs.objective, training.metrics, self.run.trajectory, self.run.world,
                            training.state, self.align_record, training.lora_targets, models.training_form,
                            precision=precision_of(acc))
        acc.wait_for_everyone()
        acc.end_training()
        return result
