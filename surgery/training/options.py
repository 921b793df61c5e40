"""What one uptraining run is asked to do, declared once: `UptrainArgs` is the options model of `surgery uptrain`
(its flags, surgery/clickgen.py), of a recipe's `uptrain:` step (its fields, surgery/recipes) and, with MODEL and
OUT, of the library call `uptrain(UptrainOptions(model=..., out=..., tokens=...))`. Its validators are the rules,
worded per front end (`--seq-len` on the command line and in the library, `seq_len` in a recipe); all of them run
before anything is loaded."""

from __future__ import annotations

import math
import typing
from pathlib import Path
from typing import Literal

from pydantic import PrivateAttr, ValidationError, ValidationInfo, field_validator, model_validator

from ..checkpoint.atomic import check_apart
from ..errors import SurgeryError
from ..general_text import resolve_texts
from ..options import Texts, cli_meta, option, spelling, texts_rule
from ..precision import PrecisionOptions

LOSSES = ("auto", "lm", "kd", "mix")
TRAIN = ("all", "attention", "new")
STAGES = ("align", "kd")
DATA_MODES = ("auto", "packed", "stream")  # --stage: layer-local attention alignment, end-to-end training (--loss); in this order
DIVERGENCES = ("forward", "reverse", "jsd")  # KL(teacher‖student), KL(student‖teacher), Jensen-Shannon (losses.kd_loss)
RUNNER_OWNED = ("force", "resume", "run_dir")  # a recipe's runner decides these (and MODEL and --out)

# Options that fix the trajectory of a run: a resumed run must repeat them. (micro_batch and the number of
# processes only change how a step's batch is split, not what the step computes, so they may change on resume.)
TRAJECTORY_KEYS = ("model", "data", "text_field", "tokens", "seq_len", "batch_tokens", "eval_tokens", "loss",
                   "teacher", "temperature", "kd_weight", "kd_divergence", "kd_beta", "on_policy", "gen_tokens",
                   "gen_temperature", "hidden_weight", "train", "lr",
                   "min_lr_ratio", "warmup_steps", "weight_decay", "max_grad_norm", "seed", "stage", "align_tokens",
                   "align_epochs", "align_lr", "lora_rank", "lora_alpha", "lora_targets", "eval_data", "data_weights",
                   "data_mode", "txt_unit", "chat_template", "loss_on", "teacher_logprobs", "retrieval_mix",
                   "retrieval_answer_weight", "new_lr", "skip_tokens", "retrieval_questions")
# Keys added to TRAJECTORY_KEYS after runs were saved without them: such a run had the option's default behaviour
# (TRAJECTORY_DEFAULTS, below the options).
LATER_TRAJECTORY_KEYS = ("hidden_weight", "kd_divergence", "eval_data", "data_weights", "data_mode", "txt_unit",
                         "chat_template", "loss_on", "teacher_logprobs", "kd_beta", "on_policy", "gen_tokens",
                         "gen_temperature", "retrieval_mix", "new_lr", "skip_tokens", "retrieval_answer_weight",
                         "retrieval_questions")
# --data-epochs is not among them: it changes nothing before a source runs dry, so a run stopped by a dry source
# resumes with a higher one.
PACKED_TOKENS = 1 << 22  # --data-mode auto: runs of at most this many training tokens (16 MiB of windows) are packed


AUTO_DATA_WORKERS = 2  # --data-workers auto on CUDA, per process


def resolve_data_workers(requested: int | str, device_type: str, recorded: int | None = None) -> int:
    """--data-workers as a number: `auto` is the number a resumed run started with (`recorded`), else
    AUTO_DATA_WORKERS on CUDA and 0 elsewhere (the CPU's behaviour before `auto`)."""
    if requested != "auto":
        return int(requested)
    if recorded is not None:
        return recorded
    return AUTO_DATA_WORKERS if device_type == "cuda" else 0


def weights_rule(cls, v, info: ValidationInfo):
    """--data-weights: one positive weight per --data (a recipe's list too), checked when a recipe loads."""
    from .stream_sources import parse_weights

    s = spelling(info, cls)
    try:
        parse_weights(v, len(info.data.get("data") or ["pydoc"]), s.flag("data_weights"), s.flag("data"))
    except SurgeryError as e:
        raise ValueError(str(e)) from None
    return v


def counts_rule(cls, v: int, info: ValidationInfo):
    if info.field_name == "data_workers" and v == "auto":
        return v
    least = 1 if info.field_name == "data_epochs" else 0
    if v < least:
        raise ValueError(f"{spelling(info, cls).flag(info.field_name)} must be at least {least}, got {v}")
    return v


class UptrainArgs(PrecisionOptions):
    """Every option of one uptraining run but the model, the output and the progress display."""

    data: Texts = option(["general"], "--data", "Text: general (general web text, C4, from the hub; pydoc "
                         "offline), pydoc, local .txt/.jsonl/.parquet files or globs, or a hub "
                         "dataset name[:config][@split[@revision]]. Repeat for a mixture (--data-weights).")
    data_weights: str | list[float] | None = option(
        None, "--data-weights", "Mixture weights, one per --data, comma-separated (default: equal).")
    data_mode: Literal[DATA_MODES] = option(
        "auto", "--data-mode", "packed: tokenize the training text up front, in memory (epochs over small data, each "
        "reshuffled); stream: read, tokenize and pack documents as training needs them. auto: packed for one text and "
        "at most 4M training tokens, else stream.")
    data_workers: int | Literal["auto"] = option(
        "auto", "--data-workers", "[stream] Worker processes per training process that read and tokenize (0: the "
        "training process itself). auto: 2 on CUDA (tokenizing off the GPU's critical path), 0 elsewhere; a resumed "
        "run keeps the number it started with.", metavar="N|auto")
    data_epochs: int = option(1, "--data-epochs", "[stream] Passes a source may make over its documents; one that "
                              "runs dry sooner stops the run.")
    tokens: int = option(None, "--tokens", "Training tokens (rounded up to whole steps).", required=True)
    skip_tokens: int = option(
        0, "--skip-tokens", "Start the training split after its first N tokens (the held-out split stays the same): "
        "continuing a run on fresh text, skip the tokens it trained on (its surgery.json's uptraining tokens). "
        "[packed data]", metavar="N")
    text_field: str = option("text", "--text-field", "Column holding the text in tabular data.")
    txt_unit: Literal["paragraph", "line", "file"] = option(
        "paragraph", "--txt-unit", "What one document of a local .txt file is: a paragraph (text between blank "
        "lines), a line, or the whole file (cut every 1M characters); the file is read lazily, never whole.")
    chat_template: Literal["auto", "on", "off"] = option(
        "auto", "--chat-template", "How a tabular text's `messages` column (conversations: lists of {role, content}) "
        "is read: on: rendered with the tokenizer's chat template; off: the contents joined; auto: the template when "
        "the tokenizer has one.")
    loss_on: Literal["all", "assistant"] = option(
        "all", "--loss-on", "Which tokens the LM and KD losses count: all, or only the assistant turns of "
        "conversations (a messages column rendered with the chat template; other text counts whole). [packed data]")
    streaming: bool = option(False, "--streaming", "Stream a hub dataset instead of downloading it whole.")
    loss: Literal[LOSSES] = option(
        "auto", "--loss", "lm: next-token; kd: KL to the teacher's logits; mix: both. auto: kd when a teacher is known.")
    teacher: str | None = option(None, "--teacher", "Teacher checkpoint (default: the source named in "
                                                    "MODEL/surgery.json).")
    teacher_logprobs: str | None = option(
        None, "--teacher-logprobs", "[kd/mix] Distill from a stored teacher pass (`surgery teacher`) made for this "
        "run's data options: no teacher model is loaded.", path="any")
    trust_remote_code: bool = option(False, "--trust-remote-code", "Run modeling code that MODEL's folder ships "
                                     "(auto_map); not needed for this toolkit's own unmodified talking-heads/SwitchHead "
                                     "code.")
    trust_teacher_code: bool = option(False, "--trust-teacher-code", "Run modeling code that the teacher's folder "
                                                                      "ships.")
    temperature: float = option(1.0, "--temperature", "[kd/mix] Distillation temperature.")
    kd_weight: float = option(0.5, "--kd-weight", "[mix] Weight of the KD term.")
    kd_divergence: Literal[DIVERGENCES] = option(
        "forward", "--kd-divergence", "[kd/mix] forward: KL(teacher‖student), covers every token the teacher "
        "considers; reverse: KL(student‖teacher), seeks the teacher's likeliest tokens; jsd: GKD's generalized "
        "Jensen-Shannon, between them by --kd-beta.")
    kd_beta: float = option(0.5, "--kd-beta", "[jsd] GKD's beta: 0 is forward KL, 1 reverse KL, 0.5 the symmetric "
                            "Jensen-Shannon divergence (TRL's GKDTrainer convention).")
    on_policy: float = option(0.0, "--on-policy", "[kd/mix] Fraction of micro-batches whose sequences the student "
                              "writes itself (on-policy distillation, GKD): a window's first --seq-len minus "
                              "--gen-tokens tokens are the prompt, the student continues it, the teacher scores the "
                              "continuation; the KD term counts the generated positions. 0: off.", metavar="P")
    gen_tokens: int = option(64, "--gen-tokens", "[on-policy] Tokens the student generates per sequence.")
    gen_temperature: float = option(1.0, "--gen-temperature", "[on-policy] Sampling temperature of the student's "
                                    "generations (0: greedy).")
    retrieval_mix: float = option(
        0.0, "--retrieval-mix", "Fraction of the training windows replaced by synthetic retrieval examples built from "
        "the window's own text (passkey, single- and multi-key needles, variable tracking: needles hidden in it, the "
        "question and the answer at its end), chosen by --seed and the window's place, so `surgery teacher` sees the "
        "same windows. 0: off.", metavar="P")
    retrieval_answer_weight: float = option(
        1.0, "--retrieval-answer-weight", "[--retrieval-mix] How much each position that predicts a retrieval "
        "example's answer counts in the losses (LM, KD, stored KD), against 1 for every other position: an example's "
        "answer is a few tokens of a window of --seq-len, so its retrieval signal is that small a share of the loss "
        "unless weighted.", metavar="K")
    retrieval_questions: int = option(
        1, "--retrieval-questions", "[--retrieval-mix] Retrieval examples in each retrieval window: K needles (each "
        "its own task and depth, in one haystack of the window's text) and K questions answered in turn at its end "
        "(RULER's multi-query needles). A window costs the same forward pass whatever it holds: K > 1 gives the run "
        "K times the examples at the distances it trains at.", metavar="K")
    hidden_weight: float = option(0.0, "--hidden-weight", "Add this weight times every layer's hidden-state cosine "
                                  "distance to the teacher's (same depth and width) to the loss; 0: off.")
    train: Literal[TRAIN] = option(
        "all", "--train", "What trains: everything, attention (projections + new parameters), or only new parameters.")
    seq_len: int = option(1024, "--seq-len", "Tokens per packed sequence.")
    batch_tokens: int = option(16384, "--batch-tokens", "Tokens per optimizer step (all processes).")
    micro_batch: int = option(4, "--micro-batch", "Sequences per forward pass per process.")
    lr: float = option(1e-4, "--lr", "Peak learning rate (AdamW).")
    new_lr: float | None = option(
        None, "--new-lr", "Peak learning rate of the parameters the conversion introduced (surgery.json's "
        "new_parameters: swa's sinks, talking-heads' mixing, ...): an AdamW group of their own on the same schedule. "
        "Default: --lr. Sinks written exact sit far from where they act: give them a large one (e.g. 0.5).")
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
    report_to: str | list[str] = option(
        "none", "--report-to", "Experiment trackers that get the run's configuration and metrics (metrics.jsonl is "
        "written either way): none, tensorboard (event files in the run folder, copied to OUT/runs), wandb, trackio, "
        "mlflow; comma-separated for several.", metavar="NAME[,NAME]")

    _data = field_validator("data")(texts_rule("data"))

    @field_validator("report_to")
    @classmethod
    def _report_to(cls, v, info: ValidationInfo):
        """--report-to: known tracker names (their packages are checked when the run starts)."""
        from .trackers import parse_report_to

        try:
            parse_report_to(v, spelling(info, cls).flag("report_to"))
        except SurgeryError as e:
            raise ValueError(str(e)) from None
        return v
    _weights = field_validator("data_weights")(weights_rule)

    @field_validator("data_weights", mode="before")
    @classmethod
    def _weights_shape(cls, v, info: ValidationInfo):
        """A recipe's single number (or anything but text or a list): told what the option takes."""
        if v is None or isinstance(v, (str, list)):
            return v
        s = spelling(info, cls)
        raise ValueError(f"{s.flag('data_weights')} takes one weight per {s.flag('data')}: a list of numbers "
                         f"([0.7, 0.3]) or comma-separated text ('0.7,0.3'), not {v!r}")
    _counts = field_validator("data_workers", "data_epochs")(counts_rule)

    @field_validator("run_dir", mode="before")
    @classmethod
    def _run_dir(cls, v):
        return str(v) if isinstance(v, Path) else v  # the library's Path

    @model_validator(mode="after")
    def _uptrain_rules(self, info: ValidationInfo):
        """The run's rules across fields, in the order a run meets them, so that a recipe's uptrain step is refused
        when the recipe loads (and in --dry-run), not when the step starts."""
        check_rules(self, spelling(info, type(self)))
        return self


def check_rules(o, s) -> None:
    """Every rule of an uptraining run's options `o` (a recipe's step model too), named in spelling `s`; the first
    broken one raises ValueError."""
    if o.data_mode == "packed" and (len(o.data) > 1 or o.data_workers not in (0, "auto")):
        raise ValueError(f"{s.flag('data_mode')} packed reads one text in this process: several {s.flag('data')} or "
                         f"{s.flag('data_workers')} need {s.flag('data_mode')} stream")
    if o.skip_tokens and o.data_mode == "stream":
        raise ValueError(f"{s.flag('skip_tokens')} reads packed data: not with {s.flag('data_mode')} stream")
    if o.loss_on == "assistant" and o.data_mode == "stream":
        raise ValueError(f"{s.flag('loss_on')} assistant reads packed data: not with {s.flag('data_mode')} stream")
    try:
        resolve_texts(o.data)
    except SurgeryError as e:
        raise ValueError(str(e)) from None
    for name in ("tokens", "seq_len", "batch_tokens", "micro_batch", "keep_last"):
        if getattr(o, name) < 1:
            raise ValueError(f"{s.flag(name)} must be at least 1, got {getattr(o, name)}")
    for name in ("lr", "weight_decay", "max_grad_norm", "temperature", "kd_weight", "hidden_weight", "min_lr_ratio",
                 "progress_every", "kd_beta", "on_policy", "gen_temperature", "retrieval_mix",
                 "retrieval_answer_weight"):
        if not math.isfinite(getattr(o, name)):
            raise ValueError(f"{s.flag(name)} must be a finite number, got {getattr(o, name)}")
    for name in ("eval_tokens", "skip_tokens", "eval_every", "save_every", "weight_decay", "max_grad_norm", "hidden_weight"):
        if getattr(o, name) is not None and getattr(o, name) < 0:
            raise ValueError(f"{s.flag(name)} must not be negative, got {getattr(o, name)}")
    if o.new_lr is not None and not (math.isfinite(o.new_lr) and o.new_lr > 0):
        raise ValueError(f"{s.flag('new_lr')} must be a positive number, got {o.new_lr}")
    if o.eval_data is not None and not o.eval_tokens:
        raise ValueError(f"{s.flag('eval_data')} needs held-out tokens ({s.flag('eval_tokens')} above 0)")
    if o.seq_len < 2:
        raise ValueError(f"{s.flag('seq_len')} must be at least 2 (a next-token target needs two tokens)")
    if o.batch_tokens % o.seq_len:
        raise ValueError(f"{s.flag('batch_tokens')} {o.batch_tokens} must be a multiple of {s.flag('seq_len')} "
                         f"{o.seq_len}")
    if not o.lr > 0:
        raise ValueError(f"{s.flag('lr')} must be positive, got {o.lr}")
    if not 0 <= o.min_lr_ratio <= 1:
        raise ValueError(f"{s.flag('min_lr_ratio')} must lie in [0, 1], got {o.min_lr_ratio}")
    if not o.temperature > 0:
        raise ValueError(f"{s.flag('temperature')} must be positive, got {o.temperature}")
    if not 0 <= o.kd_weight <= 1:
        raise ValueError(f"{s.flag('kd_weight')} must lie in [0, 1], got {o.kd_weight}")
    check_on_policy_rules(o, s)
    check_retrieval_mix_rules(o, s)
    stages = stages_of(o.stage)
    if stages is None:
        raise ValueError(f"unknown {s.flag('stage')} {o.stage!r}; choose align, kd or align,kd")
    if o.align_tokens is not None and not 0 < o.align_tokens <= o.tokens:
        raise ValueError(f"{s.flag('align_tokens')} must lie in [1, {s.flag('tokens')} {o.tokens}], got "
                         f"{o.align_tokens}")
    if o.align_tokens is not None and "align" not in stages:
        raise ValueError(f"{s.flag('align_tokens')} needs {s.flag('stage')} align or align,kd")
    if o.align_epochs < 1:
        raise ValueError(f"{s.flag('align_epochs')} must be at least 1, got {o.align_epochs}")
    if not (math.isfinite(o.align_lr) and o.align_lr > 0):
        raise ValueError(f"{s.flag('align_lr')} must be positive, got {o.align_lr}")
    if o.lora_rank < 0:
        raise ValueError(f"{s.flag('lora_rank')} must not be negative, got {o.lora_rank}")
    if o.lora_alpha is not None and not (math.isfinite(o.lora_alpha) and o.lora_alpha > 0):
        raise ValueError(f"{s.flag('lora_alpha')} must be positive, got {o.lora_alpha}")
    if o.lora_targets and not o.lora_rank:
        raise ValueError(f"{s.flag('lora_targets')} needs {s.flag('lora_rank')}")
    try:
        check_shard_size(o.max_shard_size, s.flag("max_shard_size"))
    except SurgeryError as e:
        raise ValueError(str(e)) from None
    if o.teacher_logprobs is not None:
        check_stored_teacher(o, s, stages)
    if o.warmup_steps is not None and o.warmup_steps < 0:
        raise ValueError(f"{s.flag('warmup_steps')} must not be negative, got {o.warmup_steps}")


def check_stored_teacher(o, s, stages) -> None:
    """--teacher-logprobs: the KD term from the store, which holds the teacher's top-K alone (no live teacher)."""
    flag = s.flag("teacher_logprobs")
    if o.loss == "lm":
        raise ValueError(f"{flag} needs {s.flag('loss')} kd or mix (lm uses no teacher)")
    if o.teacher is not None:
        raise ValueError(f"{flag} stands for the teacher: give it or {s.flag('teacher')}, not both")
    if "align" in stages:
        raise ValueError(f"{flag}: the align stage needs the live teacher's attention outputs; use {s.flag('teacher')}")
    if o.hidden_weight:
        raise ValueError(f"{flag}: {s.flag('hidden_weight')} needs the live teacher's hidden states")


def check_on_policy_rules(o, s) -> None:
    """--kd-beta and on-policy distillation's options (surgery/training/onpolicy.py)."""
    if not 0 <= o.kd_beta <= 1:
        raise ValueError(f"{s.flag('kd_beta')} must lie in [0, 1], got {o.kd_beta}")
    if o.kd_beta != 0.5 and o.kd_divergence != "jsd":
        raise ValueError(f"{s.flag('kd_beta')} is the generalized JSD's: it needs {s.flag('kd_divergence')} jsd")
    if not 0 <= o.on_policy <= 1:
        raise ValueError(f"{s.flag('on_policy')} must lie in [0, 1], got {o.on_policy}")
    if o.gen_temperature < 0:
        raise ValueError(f"{s.flag('gen_temperature')} must not be negative, got {o.gen_temperature}")
    if o.gen_tokens < 1:
        raise ValueError(f"{s.flag('gen_tokens')} must be at least 1, got {o.gen_tokens}")
    if o.on_policy and o.gen_tokens >= o.seq_len:
        raise ValueError(f"{s.flag('gen_tokens')} must be below {s.flag('seq_len')} {o.seq_len} (the rest of a "
                         f"window is the prompt), got {o.gen_tokens}")
    if o.on_policy and o.loss == "lm":
        raise ValueError(f"{s.flag('on_policy')} distils the student's own text against the teacher: it needs "
                         f"{s.flag('loss')} kd or mix")
    if o.on_policy and o.teacher_logprobs is not None:
        raise ValueError(f"{s.flag('on_policy')} needs the live teacher to score the student's own text: a stored "
                         f"pass ({s.flag('teacher_logprobs')}) holds the teacher on the data's text only")
    if o.on_policy and o.loss_on == "assistant":
        raise ValueError(f"{s.flag('on_policy')} continues the end of each window, not the assistant turns: not with "
                         f"{s.flag('loss_on')} assistant (yet)")
    if 0 < o.gen_temperature < 1e-4:  # logits / T overflow (NaN probabilities) long before T reaches 0
        raise ValueError(f"{s.flag('gen_temperature')} {o.gen_temperature:g} is greedy in all but name: use 0 (greedy) "
                         f"or at least 1e-4")
    unused = [n for n in ("gen_tokens", "gen_temperature") if getattr(o, n) != type(o).model_fields[n].default]
    if unused and not o.on_policy:
        raise ValueError(f"{s.flag(unused[0])} sets the student's generations: it needs {s.flag('on_policy')} above 0")
    for name in ("kd_beta", "kd_divergence"):
        if o.loss == "lm" and getattr(o, name) != type(o).model_fields[name].default:
            raise ValueError(f"{s.flag(name)} shapes the KD term: {s.flag('loss')} lm has none (use kd or mix)")


def check_retrieval_mix_rules(o, s) -> None:
    """--retrieval-mix (surgery/training/retrieval_mix.py): a fraction, of whole windows whose every token counts; the
    window length is checked against the tasks once the tokenizer is loaded."""
    flag = s.flag("retrieval_mix")
    if not 0 <= o.retrieval_mix <= 1:
        raise ValueError(f"{flag} must lie in [0, 1], got {o.retrieval_mix}")
    if o.retrieval_mix and o.loss_on == "assistant":
        raise ValueError(f"{flag} replaces whole windows, whose tokens all count: not with {s.flag('loss_on')} "
                         "assistant")
    if o.retrieval_mix and o.on_policy:
        raise ValueError(f"{flag}: the student would write over a retrieval example's question and answer: not "
                         f"with {s.flag('on_policy')}")
    weight = s.flag("retrieval_answer_weight")
    if not o.retrieval_answer_weight > 0:
        raise ValueError(f"{weight} must be positive, got {o.retrieval_answer_weight}")
    if o.retrieval_answer_weight != 1 and not o.retrieval_mix:
        raise ValueError(f"{weight} weighs the answers of {flag}'s examples: it needs {flag} above 0")
    questions = s.flag("retrieval_questions")
    if o.retrieval_questions < 1:
        raise ValueError(f"{questions} must be at least 1, got {o.retrieval_questions}")
    if o.retrieval_questions != 1 and not o.retrieval_mix:
        raise ValueError(f"{questions} sets how many examples each of {flag}'s windows holds: it needs {flag} above 0")
    if o.retrieval_answer_weight != 1 and stages_of(o.stage) == ("align",):
        raise ValueError(f"{weight} weighs the end-to-end losses: {s.flag('stage')} align has none")


def stages_of(stage: str) -> tuple[str, ...] | None:
    """--stage as its stages, in order ("align,kd" -> ("align", "kd")); None when it is not one of them."""
    stages = tuple(part.strip() for part in str(stage).split(","))
    if not stages or any(part not in STAGES for part in stages) or list(stages) != sorted(set(stages),
                                                                                          key=STAGES.index):
        return None
    return stages


def stage_steps(tokens: int, batch_tokens: int, stages, align_tokens: int | None) -> tuple[int, int]:
    """(the align stage's optimizer steps, the end-to-end stage's) of --tokens in steps of --batch-tokens: align alone
    takes every step, with kd it takes --align-tokens (default a quarter of --tokens), its windows first."""
    total = -(-tokens // batch_tokens)
    if "align" not in stages:
        return 0, total
    if "kd" not in stages:
        return total, 0
    share = align_tokens if align_tokens is not None else tokens // 4
    align = min(-(-share // batch_tokens), total)
    return align, total - align


class UptrainOptions(UptrainArgs):
    """One run, as the library takes it: `uptrain(UptrainOptions(model=..., out=..., tokens=..., ...))`. A broken
    rule raises SurgeryError, worded as the command line's."""

    model: str  # checkpoint folder to train (the student)
    out: Path
    tokens: int = option(1_000_000, "--tokens", "Training tokens (rounded up to whole steps).")
    run_dir: Path | None = option(None, "--run-dir", "Checkpoints and metrics while running (default OUT.run).",
                                  path="any")
    progress: bool = True
    _weights_: list[float] = PrivateAttr(default_factory=list)

    def __init__(self, **values):
        try:
            super().__init__(**values)
        except ValidationError as e:
            raise SurgeryError(library_message(type(self), e)) from None

    @model_validator(mode="after")
    def _resolve(self):
        """What the run reads: the texts resolved, the mixture's weights, the run folder (default OUT.run)."""
        from .stream_sources import parse_weights

        self._weights_ = parse_weights(self.data_weights, len(self.data))
        self.data = resolve_texts(self.data)
        self.stage = ",".join(stages_of(self.stage))
        self.run_dir = Path(self.run_dir) if self.run_dir else self.out.absolute().parent / f"{self.out.name}.run"
        # the run folder is deleted after success (and by --force): never the output, inside it, or holding it
        check_apart(self.run_dir, "run folder", [("output", self.out)], option="--run-dir")
        return self

    @property
    def trackers(self) -> list[str]:
        """--report-to as tracker names (none: an empty list)."""
        from .trackers import parse_report_to

        return parse_report_to(self.report_to)

    @property
    def weights(self) -> list[float]:
        """The mixture's weights, normalised, one per --data."""
        return self._weights_

    @property
    def streamed(self) -> bool:
        """Whether the training windows are streamed (surgery/training/stream.py) rather than packed up front (data.py):
        --data-mode auto streams several texts, data workers, and runs of more than PACKED_TOKENS tokens."""
        if self.data_mode != "auto":
            return self.data_mode == "stream"
        workers = self.data_workers != "auto" and self.data_workers > 0  # (auto never streams a run by itself)
        return len(self.data) > 1 or workers or self.total_steps * self.batch_tokens > PACKED_TOKENS

    @property
    def data_spec(self) -> str | list[str]:
        """--data as recorded: the text, or the list of texts of a mixture."""
        return self.data[0] if len(self.data) == 1 else list(self.data)

    @property
    def sequences_per_step(self) -> int:
        return self.batch_tokens // self.seq_len

    @property
    def stages(self) -> tuple[str, ...]:
        return tuple(self.stage.split(","))

    @property
    def align_steps(self) -> int:
        """The align stage's share of --tokens, in whole optimizer steps of --batch-tokens (its windows are the
        first of the training order; the end-to-end stage reads the windows after them)."""
        return stage_steps(self.tokens, self.batch_tokens, self.stages, self.align_tokens)[0]

    @property
    def total_steps(self) -> int:
        return -(-self.tokens // self.batch_tokens)

    @property
    def train_tokens(self) -> int:
        """The tokens the run's windows hold: every step's sequences of --seq-len (--tokens rounded up)."""
        return self.total_steps * self.sequences_per_step * self.seq_len

    @property
    def steps(self) -> int:
        """Optimizer steps of the end-to-end stage."""
        return stage_steps(self.tokens, self.batch_tokens, self.stages, self.align_tokens)[1]

    @property
    def eval_interval(self) -> int:
        """Steps between evaluations: --eval-every, else about ten evaluations over the run; 0 -> only at the end."""
        if self.eval_every is None:
            return max(1, round(self.steps / 10))
        return self.eval_every or self.steps

    @property
    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else max(1, round(0.05 * self.steps))

    def txt_key(self) -> dict:
        """--txt-unit for the data's key, when a .txt file is read (other runs' keys stay as they were)."""
        specs = [*self.data, *([self.eval_data] if self.eval_data else [])]
        return {"txt_unit": self.txt_unit} if any(str(s).endswith(".txt") for s in specs) else {}

    def trajectory(self) -> dict:
        d = self.model_dump()
        d |= {"data": self.data_spec, "data_mode": "stream" if self.streamed else "packed",
              "data_weights": [round(w, 12) for w in self.weights] if len(self.data) > 1 else None}
        return {k: (str(d[k]) if isinstance(d[k], Path) else d[k]) for k in TRAJECTORY_KEYS} | {"warmup_steps": self.warmup}


def library_message(model, error: ValidationError) -> str:
    """A validation error as the library's one line, spelled as the command line spells the option."""
    err = error.errors(include_url=False)[0]
    field = next((p for p in err["loc"] if isinstance(p, str) and p in model.model_fields), None)
    if err["type"] == "literal_error" and field is not None:
        choices = typing.get_args(model.model_fields[field].annotation)
        return f"unknown {cli_meta(model, field)['flag']} {err['input']!r}; choose from {', '.join(choices)}"
    message = err["msg"].removeprefix("Value error, ")
    if field is not None and err["type"] not in ("value_error", "assertion_error"):
        message = f"{cli_meta(model, field)['flag']}: {message}"
    return message


def check_shard_size(size, flag: str = "--max-shard-size") -> None:
    """--max-shard-size as save_pretrained (huggingface_hub's parse_size_to_int) reads it, checked before the run,
    not after the training it would end."""
    from huggingface_hub.serialization._base import parse_size_to_int

    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return
    try:
        ok = isinstance(size, str) and parse_size_to_int(size) > 0
    except (ValueError, TypeError):
        ok = False
    if not ok:
        raise SurgeryError(f"{flag} {size!r}: use a positive size in KB, MB, GB or TB (e.g. 500MB, 5GB)")


TRAJECTORY_DEFAULTS = {k: UptrainOptions.model_fields[k].default for k in LATER_TRAJECTORY_KEYS} | {
    "data_mode": "packed"}  # (a run saved before --txt-unit that read a .txt file: its data key differs, refused)
