"""The run's output, written once by the main process at the end: the final checkpoint (atomic), its surgery.json
with the "uptraining" record, the metrics and their plot; then the run folder goes."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..checkpoint.atomic import atomic_output_dir, ordinary_permissions
from ..checkpoint.record import public_name, write_record
from ..data import dataset_commits
from ..logs import get_logger
from . import lora, model_io
from .losses import Objective
from .metrics import MetricsLog
from .options import UptrainOptions
from .plot import plot_metrics
from .state import RunState
from .trackers import copy_tensorboard

log = get_logger(__name__)


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
        **({"skip_tokens": o.skip_tokens} if o.skip_tokens else {}),  # the training split's first tokens, unread
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
        **({"retrieval_mix": retrieval_record(o)} if o.retrieval_mix else {}),
        "hidden_weight": o.hidden_weight or None,
        **({"teacher_logprobs": stored_record(o)} if o.teacher_logprobs else {}),
        "teacher": ((public_name(trajectory.get("teacher")) or "surgery.json source")
                    if objective.needs_teacher or "align" in o.stages else None),
        "train": o.train,
        "optimizer": {"name": "adamw", "lr": o.lr, "betas": [0.9, 0.95], "weight_decay": o.weight_decay,
                      "warmup_steps": o.warmup, "schedule": "cosine", "min_lr_ratio": o.min_lr_ratio,
                      "max_grad_norm": o.max_grad_norm,
                      **({"new_lr": o.new_lr, "new_weight_decay": 0.0} if o.new_lr is not None else {})},
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


def retrieval_record(o: UptrainOptions) -> dict:
    """--retrieval-mix in the record: the fraction, the tasks and how many of the run's windows were examples."""
    from .retrieval_mix import RetrievalMix

    return RetrievalMix(o.retrieval_mix, o.seed, None, o.seq_len, answer_weight=o.retrieval_answer_weight,
                        questions=o.retrieval_questions).record(
        o.total_steps * o.sequences_per_step)
