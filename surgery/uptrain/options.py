"""What one uptraining run is asked to do, checked before anything is loaded."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ..checkpoint.atomic import check_apart
from ..errors import SurgeryError
from ..general_text import resolve_texts
from .losses import DIVERGENCES

LOSSES = ("auto", "lm", "kd", "mix")
TRAIN = ("all", "attention", "new")
STAGES = ("align", "kd")
DATA_MODES = ("auto", "packed", "stream")  # --stage: layer-local attention alignment, end-to-end training (--loss); in this order

# Options that fix the trajectory of a run: a resumed run must repeat them. (micro_batch and the number of
# processes only change how a step's batch is split, not what the step computes, so they may change on resume.)
TRAJECTORY_KEYS = ("model", "data", "text_field", "tokens", "seq_len", "batch_tokens", "eval_tokens", "loss",
                   "teacher", "temperature", "kd_weight", "kd_divergence", "hidden_weight", "train", "lr",
                   "min_lr_ratio", "warmup_steps", "weight_decay", "max_grad_norm", "seed", "stage", "align_tokens",
                   "align_epochs", "align_lr", "lora_rank", "lora_alpha", "lora_targets", "eval_data", "data_weights",
                   "data_mode")
# Keys added to TRAJECTORY_KEYS after runs were saved without them: such a run had the option's default behaviour
# (TRAJECTORY_DEFAULTS, below the options).
LATER_TRAJECTORY_KEYS = ("hidden_weight", "kd_divergence", "eval_data", "data_weights", "data_mode")
# --data-epochs is not among them: it changes nothing before a source runs dry, so a run stopped by a dry source
# resumes with a higher one.
PACKED_TOKENS = 1 << 22  # --data-mode auto: runs of at most this many training tokens (16 MiB of windows) are packed


@dataclass
class UptrainOptions:
    model: str  # checkpoint folder to train (the student)
    out: Path
    data: str | list[str] = "general"  # one text or several mixed by data_weights; "general": C4 from the hub, or pydoc offline (surgery/general_text.py)
    data_weights: str | list[float] | None = None  # None: equal weights
    data_epochs: int = 1  # [stream] passes over a source allowed before it has run dry
    data_workers: int = 0  # [stream] DataLoader worker processes per process that read and tokenize
    data_mode: str = "auto"  # packed: tokenized up front, in memory (epochs reshuffled); stream; auto: by --tokens
    tokens: int = 1_000_000  # training tokens (rounded up to whole optimizer steps)
    text_field: str = "text"
    streaming: bool = False
    seq_len: int = 1024
    batch_tokens: int = 16384  # tokens per optimizer step, all processes together
    micro_batch: int = 4  # sequences per forward pass per process
    eval_tokens: int = 16384  # held-out tokens (0: no evaluation)
    eval_every: int | None = None  # steps between evaluations (0: only at the start and the end; None: ~10 per run)
    eval_data: str | None = None  # a second held-out text (its first eval_tokens tokens), e.g. of another domain
    loss: str = "auto"  # auto: kd when a teacher is known, else lm
    teacher: str | None = None  # overrides the source named in surgery.json
    temperature: float = 1.0
    kd_weight: float = 0.5  # weight of the KD term in `mix`
    kd_divergence: str = "forward"  # forward KL, reverse KL or jsd (surgery/uptrain/losses.py: kd_loss)
    hidden_weight: float = 0.0  # weight of the per-layer hidden-state term (surgery/uptrain/losses.py); 0: none
    train: str = "all"
    lr: float = 1e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int | None = None  # None: 5% of the steps
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    gradient_checkpointing: bool = False
    seed: int = 0
    save_every: int = 100  # steps between checkpoints (0: only at the end)
    keep_last: int = 2
    resume: bool = False
    run_dir: Path | None = None  # checkpoints and metrics while running; default OUT.run beside OUT
    keep_run_dir: bool = False  # keep checkpoints after success
    force: bool = False
    max_shard_size: str = "5GB"
    trust_remote_code: bool = False  # run code the model folder ships (see surgery/trust.py)
    trust_teacher_code: bool = False  # run code the teacher's folder ships
    progress: bool = True
    progress_every: float = 30.0  # seconds between progress lines when stderr is not a terminal
    stage: str = "kd"  # "align", "kd" (end-to-end, by --loss) or "align,kd"
    align_tokens: int | None = None  # of --tokens, for the align stage (None: all for "align", a quarter for "align,kd")
    align_epochs: int = 4  # passes over the alignment windows, per layer
    align_lr: float = 1e-3
    lora_rank: int = 0  # 0: full fine-tuning of the --train parameters
    lora_alpha: float | None = None  # None: 2 x rank
    lora_targets: str | None = None  # None: the linear layers of the attention blocks
    merge_lora: bool = True

    def __post_init__(self):
        from .stream import parse_weights

        self.data = [self.data] if isinstance(self.data, str) else list(self.data)
        if not self.data:
            raise SurgeryError("--data needs at least one text")
        self.weights = parse_weights(self.data_weights, len(self.data))
        if self.data_epochs < 1 or self.data_workers < 0:
            raise SurgeryError(f"--data-epochs must be at least 1 and --data-workers not negative, got "
                               f"{self.data_epochs} and {self.data_workers}")
        if self.data_mode not in DATA_MODES:
            raise SurgeryError(f"unknown --data-mode {self.data_mode!r}; choose from {', '.join(DATA_MODES)}")
        if self.data_mode == "packed" and (len(self.data) > 1 or self.data_workers):
            raise SurgeryError("--data-mode packed reads one text in this process: several --data or --data-workers "
                               "need --data-mode stream")
        self.out = Path(self.out)
        self.data = resolve_texts(self.data)
        self.run_dir = Path(self.run_dir) if self.run_dir else self.out.absolute().parent / f"{self.out.name}.run"
        # the run folder is deleted after success (and by --force): never the output, inside it, or holding it
        check_apart(self.run_dir, "run folder", [("output", self.out)], option="--run-dir")
        positive = ("tokens", "seq_len", "batch_tokens", "micro_batch", "keep_last")
        for name in positive:
            if getattr(self, name) < 1:
                raise SurgeryError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("lr", "weight_decay", "max_grad_norm", "temperature", "kd_weight", "hidden_weight", "min_lr_ratio",
                     "progress_every"):
            if not math.isfinite(getattr(self, name)):
                raise SurgeryError(f"--{name.replace('_', '-')} must be a finite number, got {getattr(self, name)}")
        for name in ("eval_tokens", "eval_every", "save_every", "weight_decay", "max_grad_norm", "hidden_weight"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise SurgeryError(f"--{name.replace('_', '-')} must not be negative, got {getattr(self, name)}")
        if self.eval_data is not None and not self.eval_tokens:
            raise SurgeryError("--eval-data needs held-out tokens (--eval-tokens above 0)")
        if self.seq_len < 2:
            raise SurgeryError("--seq-len must be at least 2 (a next-token target needs two tokens)")
        if self.loss not in LOSSES:
            raise SurgeryError(f"unknown --loss {self.loss!r}; choose from {', '.join(LOSSES)}")
        if self.train not in TRAIN:
            raise SurgeryError(f"unknown --train {self.train!r}; choose from {', '.join(TRAIN)}")
        if self.batch_tokens % self.seq_len:
            raise SurgeryError(f"--batch-tokens {self.batch_tokens} must be a multiple of --seq-len {self.seq_len}")
        if not self.lr > 0:
            raise SurgeryError(f"--lr must be positive, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise SurgeryError(f"--min-lr-ratio must lie in [0, 1], got {self.min_lr_ratio}")
        if not self.temperature > 0:
            raise SurgeryError(f"--temperature must be positive, got {self.temperature}")
        if self.kd_divergence not in DIVERGENCES:
            raise SurgeryError(f"unknown --kd-divergence {self.kd_divergence!r}; choose from {', '.join(DIVERGENCES)}")
        if not 0 <= self.kd_weight <= 1:
            raise SurgeryError(f"--kd-weight must lie in [0, 1], got {self.kd_weight}")
        stages = tuple(s.strip() for s in str(self.stage).split(","))
        if not stages or any(s not in STAGES for s in stages) or list(stages) != sorted(set(stages), key=STAGES.index):
            raise SurgeryError(f"unknown --stage {self.stage!r}; choose align, kd or align,kd")
        self.stage = ",".join(stages)
        if self.align_tokens is not None and not 0 < self.align_tokens <= self.tokens:
            raise SurgeryError(f"--align-tokens must lie in [1, --tokens {self.tokens}], got {self.align_tokens}")
        if self.align_tokens is not None and "align" not in stages:
            raise SurgeryError("--align-tokens needs --stage align or align,kd")
        if self.align_epochs < 1:
            raise SurgeryError(f"--align-epochs must be at least 1, got {self.align_epochs}")
        if not (math.isfinite(self.align_lr) and self.align_lr > 0):
            raise SurgeryError(f"--align-lr must be positive, got {self.align_lr}")
        if self.lora_rank < 0:
            raise SurgeryError(f"--lora-rank must not be negative, got {self.lora_rank}")
        if self.lora_alpha is not None and not (math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise SurgeryError(f"--lora-alpha must be positive, got {self.lora_alpha}")
        if self.lora_targets and not self.lora_rank:
            raise SurgeryError("--lora-targets needs --lora-rank")
        check_shard_size(self.max_shard_size)
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise SurgeryError(f"--warmup-steps must not be negative, got {self.warmup_steps}")

    @property
    def streamed(self) -> bool:
        """Whether the training windows are streamed (surgery/uptrain/stream.py) rather than packed up front (data.py):
        --data-mode auto streams several texts, data workers, and runs of more than PACKED_TOKENS tokens."""
        if self.data_mode != "auto":
            return self.data_mode == "stream"
        return len(self.data) > 1 or self.data_workers > 0 or self.total_steps * self.batch_tokens > PACKED_TOKENS

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
        if "align" not in self.stages:
            return 0
        if "kd" not in self.stages:
            return -(-self.tokens // self.batch_tokens)
        share = self.align_tokens if self.align_tokens is not None else self.tokens // 4
        return min(-(-share // self.batch_tokens), self.total_steps)

    @property
    def total_steps(self) -> int:
        return -(-self.tokens // self.batch_tokens)

    @property
    def steps(self) -> int:
        """Optimizer steps of the end-to-end stage."""
        return self.total_steps - self.align_steps if "kd" in self.stages else 0

    @property
    def eval_interval(self) -> int:
        """Steps between evaluations: --eval-every, else about ten evaluations over the run; 0 -> only at the end."""
        if self.eval_every is None:
            return max(1, round(self.steps / 10))
        return self.eval_every or self.steps

    @property
    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else max(1, round(0.05 * self.steps))

    def trajectory(self) -> dict:
        d = asdict(self)
        d |= {"data": self.data_spec, "data_mode": "stream" if self.streamed else "packed",
              "data_weights": [round(w, 12) for w in self.weights] if len(self.data) > 1 else None}
        return {k: (str(d[k]) if isinstance(d[k], Path) else d[k]) for k in TRAJECTORY_KEYS} | {"warmup_steps": self.warmup}

    def as_record(self) -> dict:
        return {f.name: (str(v) if isinstance(v := getattr(self, f.name), Path) else v) for f in fields(self)}


def check_shard_size(size) -> None:
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
        raise SurgeryError(f"--max-shard-size {size!r}: use a positive size in KB, MB, GB or TB (e.g. 500MB, 5GB)")


TRAJECTORY_DEFAULTS = {f.name: f.default for f in fields(UptrainOptions) if f.name in LATER_TRAJECTORY_KEYS}
TRAJECTORY_DEFAULTS = {f.name: f.default for f in fields(UptrainOptions) if f.name in LATER_TRAJECTORY_KEYS} | {
    "data_mode": "packed"}
