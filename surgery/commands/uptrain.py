"""`surgery uptrain` once its options are validated: continue training a model (surgery/uptrain)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Literal

from pydantic import ValidationInfo, field_validator, model_validator

from ..options import CliModel, Texts, option, texts_rule

RUNNER_OWNED = ("force", "resume", "run_dir")  # a recipe's runner decides these (and MODEL and --out)


def weights_rule(cls, v, info: ValidationInfo):
    """--data-weights: one positive weight per --data (a recipe's list too), checked when a recipe loads."""
    from ..errors import SurgeryError
    from ..uptrain.stream import parse_weights

    try:
        parse_weights(v, len(info.data.get("data") or ["pydoc"]))
    except SurgeryError as e:
        raise ValueError(str(e)) from None
    return v


def counts_rule(cls, v: int, info: ValidationInfo):
    least = 1 if info.field_name == "data_epochs" else 0
    if v < least:
        raise ValueError(f"--{info.field_name.replace('_', '-')} must be at least {least}, got {v}")
    return v


class UptrainArgs(CliModel):
    data: Texts = option(["general"], "--data", "Text: general (general web text, C4, from the hub; pydoc "
                         "offline), pydoc, local .txt/.jsonl/.parquet files or globs, or a hub "
                         "dataset name[:config][@split]. Repeat for a mixture (--data-weights).")
    data_weights: str | list[float] | None = option(
        None, "--data-weights", "Mixture weights, one per --data, comma-separated (default: equal).")
    data_mode: Literal["auto", "packed", "stream"] = option(
        "auto", "--data-mode", "packed: tokenize the training text up front, in memory (epochs over small data, each "
        "reshuffled); stream: read, tokenize and pack documents as training needs them. auto: packed for one text and "
        "at most 4M training tokens, else stream.")
    data_workers: int = option(0, "--data-workers", "[stream] Worker processes per training process that read and "
                               "tokenize (0: the training process itself).")
    data_epochs: int = option(1, "--data-epochs", "[stream] Passes a source may make over its documents; one that "
                              "runs dry sooner stops the run.")
    tokens: int = option(None, "--tokens", "Training tokens (rounded up to whole steps).", required=True)
    text_field: str = option("text", "--text-field", "Column holding the text in tabular data.")
    streaming: bool = option(False, "--streaming", "Stream a hub dataset instead of downloading it whole.")
    loss: Literal["auto", "lm", "kd", "mix"] = option(
        "auto", "--loss", "lm: next-token; kd: KL to the teacher's logits; mix: both. auto: kd when a teacher is known.")
    teacher: str | None = option(None, "--teacher", "Teacher checkpoint (default: the source named in "
                                                    "MODEL/surgery.json).")
    trust_remote_code: bool = option(False, "--trust-remote-code", "Run modeling code that MODEL's folder ships "
                                     "(auto_map); not needed for this toolkit's own unmodified talking-heads/SwitchHead "
                                     "code.")
    trust_teacher_code: bool = option(False, "--trust-teacher-code", "Run modeling code that the teacher's folder "
                                                                      "ships.")
    temperature: float = option(1.0, "--temperature", "[kd/mix] Distillation temperature.")
    kd_weight: float = option(0.5, "--kd-weight", "[mix] Weight of the KD term.")
    kd_divergence: Literal["forward", "reverse", "jsd"] = option(
        "forward", "--kd-divergence", "[kd/mix] forward: KL(teacher‖student), covers every token the teacher "
        "considers; reverse: KL(student‖teacher), seeks the teacher's likeliest tokens; jsd: Jensen-Shannon, between.")
    hidden_weight: float = option(0.0, "--hidden-weight", "Add this weight times every layer's hidden-state cosine "
                                  "distance to the teacher's (same depth and width) to the loss; 0: off.")
    train: Literal["all", "attention", "new"] = option(
        "all", "--train", "What trains: everything, attention (projections + new parameters), or only new parameters.")
    seq_len: int = option(1024, "--seq-len", "Tokens per packed sequence.")
    batch_tokens: int = option(16384, "--batch-tokens", "Tokens per optimizer step (all processes).")
    micro_batch: int = option(4, "--micro-batch", "Sequences per forward pass per process.")
    lr: float = option(1e-4, "--lr", "Peak learning rate (AdamW).")
    min_lr_ratio: float = option(0.1, "--min-lr-ratio", "Cosine floor, as a fraction of --lr.")
    warmup_steps: int | None = option(None, "--warmup-steps", "Linear warmup steps (default: 5% of the steps).")
    weight_decay: float = option(0.01, "--weight-decay")
    max_grad_norm: float = option(1.0, "--max-grad-norm", "Gradient clipping (0: off).")
    gradient_checkpointing: bool = option(False, "--gradient-checkpointing", "Recompute activations in the backward "
                                                                              "pass.")
    eval_tokens: int = option(16384, "--eval-tokens", "Held-out tokens (0: no evaluation).")
    eval_data: str | None = option(None, "--eval-data", "A second held-out text, evaluated beside the training "
                                   "text's own held-out split (its first --eval-tokens tokens; same forms as --data): "
                                   "text of another domain tells recovery from fitting the training text's domain.")
    eval_every: int | None = option(None, "--eval-every", "Steps between evaluations (default: about 10 evaluations "
                                                          "per run; 0: only at the start and the end).")
    save_every: int = option(100, "--save-every", "Steps between checkpoints.")
    keep_last: int = option(2, "--keep-last", "Checkpoints kept.")
    resume: bool = option(False, "--resume", "Continue from the newest checkpoint in the run folder.")
    run_dir: str | None = option(None, "--run-dir", "Checkpoints and metrics while running (default OUT.run).",
                                 path="any")
    keep_run_dir: bool = option(False, "--keep-run-dir", "Keep the run folder (checkpoints) after success.")
    seed: int = option(0, "--seed")
    force: bool = option(False, "--force", "Replace an existing output (and an earlier run folder).")
    max_shard_size: str = option("5GB", "--max-shard-size", "Largest output shard.")
    progress_every: float = option(30.0, "--progress-every", "Seconds between progress lines when stderr is not a "
                                                             "terminal (a terminal gets a bar).")
    stage: str = option("kd", "--stage", "align: train each attention to match the teacher's attention output, layer "
                        "by layer; kd: end-to-end training by --loss; align,kd: both, splitting --tokens.")
    align_tokens: int | None = option(None, "--align-tokens", "[align,kd] The align stage's share of --tokens "
                                                              "(default: a quarter).")
    align_epochs: int = option(4, "--align-epochs", "[align] Passes over its windows per layer.")
    align_lr: float = option(1e-3, "--align-lr", "[align] Adam learning rate.")
    lora_rank: int = option(0, "--lora-rank", "Train LoRA adapters of this rank instead of the weights (needs peft: "
                                              "the `lora` extra).")
    lora_alpha: float | None = option(None, "--lora-alpha", "LoRA scaling numerator (default: 2 x rank).")
    lora_targets: str | None = option(None, "--lora-targets", "Comma-separated module-name patterns for LoRA (default: "
                                                              "the attention's linear layers).")
    merge_lora: bool = option(True, "--merge-lora", "Merge the adapters into the output, or keep the input's weights "
                                                    "and write OUT/adapter.")

    @model_validator(mode="after")
    def _uptrain_rules(self):
        """The run's own rules (surgery/uptrain/options.py), so that a recipe's uptrain step is refused when the
        recipe loads (and in --dry-run), not when the step starts. The fields a recipe's runner sets may be absent."""
        from ..errors import SurgeryError
        from ..uptrain.options import UptrainOptions

        known = {f.name for f in fields(UptrainOptions)}
        values = {name: getattr(self, name) for name in type(self).model_fields
                  if name in known and name not in RUNNER_OWNED}
        try:
            UptrainOptions(model="MODEL", out=Path("OUT"), **values)
        except SurgeryError as e:
            raise ValueError(str(e)) from None
        return self


    _data = field_validator("data")(texts_rule("data"))

    _weights = field_validator("data_weights")(weights_rule)
    _counts = field_validator("data_workers", "data_epochs")(counts_rule)


def uptrain_model(model: str, out: Path, options: UptrainArgs) -> None:
    from ..uptrain import UptrainOptions, uptrain

    values = options.model_dump()
    values["run_dir"] = Path(values["run_dir"]) if values["run_dir"] else None
    uptrain(UptrainOptions(model=model, out=Path(out), **values))
