"""The uptraining loop, on accelerate: CPU, one GPU, or several processes under `accelerate launch`.

One optimizer step = `batch_tokens` tokens = B windows of `seq_len`, split over W processes and, within each,
into micro-batches of `micro_batch` windows (gradient accumulation makes up the rest). Losses are means over
positions and DDP averages gradients over processes, so a step computes the same update however it is split.
AdamW over the trainable parameters, linear warmup then cosine decay (the learning rate is a function of the step
alone), gradient clipping. Autocast in --precision (auto: bf16 on CUDA, fp32 on CPU). Only the main process logs and writes files.

Here the run's stages in order and the training steps; the setup stages are `RecipeSetup` (recipe_setup.py) and
`RecipeData` (recipe_data.py), the accelerator accelerator.py, the optimizer and its schedule optimizer.py, the run
folder run_folder.py, the held-out evaluation evaluation.py, and the final write-out output.py.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import time

import torch

from ..checkpoint.atomic import write_text_atomic
from ..checkpoint.record import public_name
from ..errors import SurgeryError
from ..loaders import read_json
from ..logs import get_logger
from .accelerator import precision_of
from .align import align
from .evaluation import evaluate_held_out
from .finite import all_finite, last_good
from .heads import OutputHead
from .onpolicy import generating_model
from .optimizer import group_lr, lr_at
from .options import UptrainOptions
from .output import finish
from .progress import Progress
from .recipe_data import RecipeData
from .recipe_setup import RecipeSetup
from .retrieval_mix import mixed
from .state import Checkpoints
from .trackers import finish_trackers

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
    recipe = UptrainRecipe(o)
    made_run_dir = not o.resume and not o.run_dir.exists()
    try:
        recipe.setup()
    except BaseException:  # refused before the first step (a tracker that cannot start, a bad store): nothing to
        if made_run_dir and getattr(recipe, "main", True):  # resume, so the run folder this run made goes
            shutil.rmtree(o.run_dir, ignore_errors=True)
        raise
    try:
        recipe.train()
    except SurgeryError:  # refused at the first step (a store whose windows are not the run's): no step to resume,
        if not o.resume and recipe.main and recipe.state.step == 0:  # so the run folder it started goes with it
            shutil.rmtree(o.run_dir, ignore_errors=True)
        raise
    return recipe.save()


class UptrainRecipe(RecipeSetup, RecipeData):
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

    def _setup_align(self) -> dict | None:
        """The `align` stage (attention layer by layer against the teacher), unless a checkpoint already has it."""
        o, acc, data = self.o, self.acc, self.data
        if "align" not in o.stages:
            return None
        if o.resume and self.ckpts.latest() is not None:
            align_json = o.run_dir / "align.json"
            return read_json(align_json) if align_json.exists() else None  # (one line when corrupt)
        count = o.align_steps * o.sequences_per_step
        windows = mixed(self.mix, data.take(count) if o.streamed else data.train[data.window_indices(0, count)], 0)
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
            write_text_atomic(o.run_dir / "align.json", json.dumps(record, indent=2) + "\n", "align.json")
        return record

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
                    if result is not None and self.main:
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
            group["lr"] = group_lr(group, step, o)
        batch = self.data.step_batch(o.align_steps + step, o.sequences_per_step, acc.process_index, self.world)
        share = o.sequences_per_step // self.world  # this process's windows of the step, in the run's global order
        batch = mixed(self.mix, batch, (o.align_steps + step) * o.sequences_per_step + acc.process_index * share)
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
