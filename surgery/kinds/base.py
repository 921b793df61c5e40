"""What every conversion kind declares, and the options every kind shares (how the output is written).

A kind is one `Kind` object in the registry (surgery/kinds/__init__.py):
- `options`: its pydantic options model, `WriteOptions` plus its own fields, with its rules as validators;
- `convert(source, out, options)`: calls the library converter and returns the surgery.json record;
- `calibrates(options)`, `ships_code`: whether it reads calibration text, whether its output carries modeling code;
- `refuses` (or `refusals()`, per `convert --list` column): the family features (surgery.arch.Feature) it cannot
  carry over, each with its one-line reason around the family's own words;
- its cost model: `converted_shape` (parameters and K/V heads after conversion, for the recipe estimate),
  `calibration_estimate` (memory and time of a calibrated conversion, surgery/estimate.py), `attention_macs`
  (the per-token attention work `surgery inspect` and the model card show), `kv_cache_values` (what each runtime
  caches per token: `surgery inspect`, `surgery bench` and the model card), and its model card words.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import ValidationInfo, field_validator

from ..arch import SLIDING_WINDOW_SWITCHED, Feature
from ..dtypes import DTYPE_NAMES
from ..options import CliModel, Texts, option, spelling, texts_rule
from ..precision import PrecisionOptions

DTYPE_CHOICES = ("auto", *DTYPE_NAMES)


class WriteOptions(CliModel):
    """How any conversion reads its source and writes its output."""

    force: bool = option(False, "--force", "Replace an existing output folder.")
    revision: str | None = option(None, "--revision", "Hub revision (branch, tag or commit) when SOURCE is a hub id.")
    dtype: Literal[DTYPE_CHOICES] = option("auto", "--dtype", "Output dtype of floating tensors (auto keeps the "
                                                               "source's).")
    max_shard_size: str = option("5GB", "--max-shard-size", "Largest output shard.")
    allow_pickle: bool = option(False, "--allow-pickle", "Accept pickle .bin weights (loaded with weights_only=True).")
    seed: int = option(0, "--seed", "Seed for random choices.")
    device: str = option("auto", "--device", "Where calibration runs, layer by layer: auto (CUDA when present), "
                                             "cpu, cuda, cuda:N.")

    @field_validator("device")
    @classmethod
    def _device(cls, v: str, info: ValidationInfo) -> str:
        """auto, cpu, cuda or cuda:N: refused before any work, whether or not the conversion calibrates (a kind or
        merge that does not refuses any --device but auto, see its rules)."""
        if v == "auto":
            return v
        import torch

        flag = spelling(info, cls).flag("device")
        try:
            dev = torch.device(v)
        except (RuntimeError, TypeError):
            dev = None
        if dev is None or dev.type not in ("cpu", "cuda"):
            raise ValueError(f"{flag} {v!r}: use auto, cpu, cuda or cuda:N")
        return v  # whether this machine has CUDA is checked when the conversion starts (a recipe plans elsewhere)

    @field_validator("max_shard_size")
    @classmethod
    def _size(cls, v: str) -> str:
        from ..units import parse_size
        from ..errors import SurgeryError

        try:
            parse_size(v)
        except SurgeryError as e:
            raise ValueError(str(e)) from None
        return v

    @property
    def max_shard_bytes(self) -> int:
        from ..units import parse_size

        return parse_size(self.max_shard_size)

    def write_kwargs(self) -> dict:
        """The keyword arguments every library converter takes for writing."""
        return dict(dtype=None if self.dtype == "auto" else self.dtype, max_shard_bytes=self.max_shard_bytes,
                    allow_pickle=self.allow_pickle, seed=self.seed, force=self.force)


def positive_calib_tokens(cls, v: int, info: ValidationInfo) -> int:
    """The rule on calib_tokens, for every model with CalibrationOptions' fields."""
    if v < 1:
        raise ValueError(f"{spelling(info, cls).flag('calib_tokens')} must be positive, got {v}")
    return v


calib_texts_rule = texts_rule("calib")  # at least one calibration text


def calib_window_rule(cls, v: int, info: ValidationInfo) -> int:
    """The rule on calib_window: a window holds at least one query and one earlier key."""
    if v < 2:
        raise ValueError(f"{spelling(info, cls).flag('calib_window')} must be at least 2, got {v}")
    return v


def calib_chunk_rule(cls, v: int | None, info: ValidationInfo) -> int | None:
    """The rule on calib_chunk: a chunk holds at least one window (None: the conversions' rule chooses)."""
    if v is not None and v < 1:
        raise ValueError(f"{spelling(info, cls).flag('calib_chunk')} must be at least 1 window, got {v}")
    return v


class CalibrationOptions(PrecisionOptions):
    """Text read to fit a conversion to the source's activations (aligned merge, SwitchHead, MLA): the one
    declaration of those options and their rules, mixed into a kind's options model. Fields follow the bases in
    reverse order, so `class MyOptions(CalibrationOptions, WriteOptions)` puts them after the write options and
    `class MyOptions(CalibrationOptions, MyFields)` after the kind's own fields (where `--help` and a recipe list
    them). `precision` (surgery/precision.py) is the calibration's forward passes' precision."""

    GROUP: ClassVar[str] = "calibration (aligned merge, switchhead)"
    calib: Texts = option(["general"], "--calib", "Calibration text (same forms as check --data; general: general web "
                          "text (C4) from the hub, pydoc offline). Repeat it to mix domains: each text gives an equal "
                          "share of the calibration windows.", group=GROUP)
    calib_tokens: int = option(8192, "--calib-tokens", "Calibration tokens.", group=GROUP)
    calib_window: int = option(
        512, "--calib-window", "Tokens per calibration window (capped by the model's context): the longest query-key "
        "distance the fits see. Calibrate at the context the model will serve; the cost per token grows with it.",
        metavar="N", group=GROUP)
    calib_chunk: int | None = option(
        None, "--calib-chunk", "Calibration windows per chunk: each per-layer pass holds one chunk's activations at a "
        "time (default: the most windows, up to 8, whose working set fits 256 MiB: 8 on SmolLM2, 1 on an 8B model). "
        "Fewer: less memory, the same result to float rounding, a little more time; the dry run shows the chunk.",
        metavar="N", group=GROUP)

    chat_template: Literal["auto", "on", "off"] = option(
        "auto", "--chat-template", "How a calibration text's `messages` column (conversations: lists of {role, "
        "content}) is read: on: rendered with the tokenizer's chat template; off: the contents joined; auto: the "
        "template when the tokenizer has one.", group=GROUP)

    _calib = field_validator("calib")(calib_texts_rule)
    _calib_tokens = field_validator("calib_tokens")(positive_calib_tokens)
    _calib_window = field_validator("calib_window")(calib_window_rule)
    _calib_chunk = field_validator("calib_chunk")(calib_chunk_rule)

    def refuse_calibration_options(self, s, choice: str, instead: str, more: tuple[str, ...] = ()) -> None:
        """For a `choice` that reads no calibration text (e.g. "the mean merge"): a calibration option given anyway
        would do nothing, silently, so it is refused in one line naming `instead` (the choice that calibrates).
        `s`: the caller's spelling (flags or recipe keys); `more`: the kind's own calibration-only options."""
        for name, what in (("precision", "calibration's precision"), ("device", "where calibration runs")):
            if getattr(self, name) != "auto":
                raise ValueError(f"{s.flag(name)} is {what}: {choice} runs none (use {instead}, or leave "
                                 f"{s.flag(name)} out)")
        fields = type(self).model_fields
        for name in ("calib", "calib_tokens", "calib_window", "calib_chunk", "chat_template", *more):
            if name in self.model_fields_set and getattr(self, name) != fields[name].default:
                raise ValueError(f"{s.flag(name)} does nothing for {choice}, which reads no calibration text (use "
                                 f"{instead}, or leave {s.flag(name)} out)")


def require_size(options: CliModel, s, kind: str, name: str, rule: str = "must be at least 1") -> None:
    """The rule on a kind's size option that has no default (gqa's kv_heads, mla's kv_rank, swa's window): given,
    and at least 1 (`rule`: the words of the refusal). `s`: the caller's spelling (flags or recipe keys)."""
    value = getattr(options, name)
    if value is None:
        raise ValueError(f"{s.kind(kind)} needs {s.options([name])}")
    if value < 1:
        raise ValueError(f"{s.flag(name)} {rule}, got {value}")


class RetrievalMixOptions(CliModel):
    """Retrieval examples among the calibration windows (aligned merge, MLA): a fraction of the windows replaced by
    synthetic retrieval examples built from their own text (surgery/calibration/retrieval.py), so that the fits see
    queries that copy from far back."""

    GROUP: ClassVar[str] = "retrieval calibration (aligned merge, mla)"
    calib_retrieval_mix: float = option(
        0.0, "--calib-retrieval-mix", "[aligned, mla] Fraction P (0..1) of the calibration windows replaced by "
        "synthetic retrieval examples (passkey, single- and multi-key needles, variable tracking) built from the "
        "window's own text, chosen and drawn from --seed; 0: plain text. Each task's question and needles must fit "
        "in half a --calib-window.", metavar="P", group=GROUP)

    @field_validator("calib_retrieval_mix")
    @classmethod
    def _fraction(cls, v: float, info: ValidationInfo) -> float:
        if not (math.isfinite(v) and 0 <= v <= 1):
            raise ValueError(f"{spelling(info, cls).flag('calib_retrieval_mix')} must lie in [0, 1], got {v}")
        return v


class RetrievalWeightOptions(CliModel):
    """The retrieval heads' and rows' weights in a calibrated fit (aligned merge, MLA), from the scores measured on the
    --calib-retrieval-mix examples (surgery/calibration/retrieval.py). Each kind says where they enter its fit and
    refuses them without the examples (surgery/kv/options.py, surgery/mla/options.py)."""

    GROUP: ClassVar[str] = "retrieval calibration (aligned merge, mla)"
    retrieval_weight: float = option(
        0.0, "--retrieval-weight", "[aligned, mla, with --calib-retrieval-mix] Weigh each query head by 1 + B x its "
        "retrieval score (in [0, 1]: the attention its answer positions put on the needle on the retrieval "
        "examples, recorded in surgery.json): in the aligned merge its queries' energy, the key refit and the query "
        "refit; in mla the rope key's split, the latent's metric (its keys' and values' share of the rank) and the "
        "query refit. 0: every head weighs the same.", metavar="B", group=GROUP)
    retrieval_rows_weight: float = option(
        1.0, "--retrieval-rows-weight", "[aligned, mla, with --calib-retrieval-mix] Weigh the retrieval examples' "
        "answer and needle positions: in the aligned merge the query refit also fits the answer positions' rows and "
        "the key refit (--refit-keys) the needle's, each row weighing W sampled rows (0: only the random samples); in "
        "mla the needle's rows count W times in the keys' and values' second moments and the answer's in the "
        "queries' (the factorisation's statistics; 1: as any row).", metavar="W", group=GROUP)


class QueryRefitOptions(CliModel):
    """The query refit's sampling (aligned merge, MLA): after the keys change, q_proj is regressed onto the queries
    that best reproduce the source's attention logits at sampled positions of every calibration window."""

    GROUP: ClassVar[str] = "query refit (aligned merge, mla)"
    query_samples: int = option(
        128, "--query-samples", "[aligned, mla] Query positions per calibration window whose ideal queries the query "
        "refit solves for (more fits better and costs more; the window's length = every position).", metavar="N",
        group=GROUP)

    @field_validator("query_samples")
    @classmethod
    def _samples(cls, v: int, info: ValidationInfo) -> int:
        if v < 1:
            raise ValueError(f"{spelling(info, cls).flag('query_samples')} must be positive, got {v}")
        return v




def sliding_layers(config: dict) -> tuple[int, int | None]:
    """(layers with sliding-window attention, their window) as the runtimes read config.json: `layer_types` where
    the config lists them, every layer where it sets only `sliding_window` (Mistral), none where the family's switch
    is off (Qwen2/3, SmolLM3)."""
    window = config.get("sliding_window")
    if not isinstance(window, int) or window < 1:
        return 0, None
    if config.get("model_type") in SLIDING_WINDOW_SWITCHED and not config.get("use_sliding_window"):
        return 0, None
    types = config.get("layer_types")
    if isinstance(types, list):
        return sum(t == "sliding_attention" for t in types), window
    layers = config.get("num_hidden_layers")
    return (int(layers), window) if config.get("model_type") in ("mistral", "mixtral") and layers else (0, None)


def cached_fraction(config: dict, context: int | None = None, kept: int = 0) -> float:
    """The share of a full-attention KV cache (or of its attention work) that the model keeps at `context` tokens
    (None: the model's context): sliding layers hold min(context, window + `kept`) tokens, the others all of them.
    transformers' sliding cache keeps the W - 1 tokens before the next query (kept=-1); vLLM's and llama.cpp's hold
    the window."""
    sliding, window = sliding_layers(config)
    layers = config.get("num_hidden_layers")
    if not sliding or not isinstance(layers, int) or layers < 1:
        return 1.0
    context = context or next((int(config[k]) for k in ("max_position_embeddings", "n_positions") if config.get(k)),
                              None)
    if not context:
        return 1.0
    return (layers - sliding + sliding * min(context, max(window + kept, 1)) / context) / layers


@dataclass
class AttentionShape:
    """Per-layer attention sizes as surgery/inspection.py reads them (L layers, h heads, kv K/V heads, d head_dim,
    H hidden)."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int


@dataclass
class Kind:
    """One conversion kind. Subclasses override the cost model where their attention differs from plain MHA/GQA."""

    name: str
    options: type[WriteOptions]
    title: str = ""  # the model card's words for the target attention
    help: str = ""  # what `surgery convert --help` says of the kind (kinds sharing words give the same text)
    # the columns of `surgery convert --list` this kind answers (the names its converters give surgery.arch's
    # spec_for); empty: one column, the kind's name
    support_labels: tuple[str, ...] = ()
    # the family features (surgery.arch.Feature) this kind cannot carry over, each with its one-line reason: a
    # template over the family's own words for the feature ("{detail}"); a kind whose columns differ overrides
    # `refusals`
    refuses: dict[Feature, str] = field(default_factory=dict)
    # what `convert --list` says of a family the kind converts: a function spec -> text (None: "yes")
    verdict: Any = None
    tags: list[str] = field(default_factory=list)  # the model card's hub tags
    ships_code: bool = False  # the output carries its own modeling code (load with trust_remote_code=True)
    # options that convert a Llama-like model of 8 heads and 4 K/V heads (tests/kinds/test_kind_contract.py runs them)
    example_options: dict[str, Any] = field(default_factory=dict)
    model_type_prefix: str | None = None  # converted configs' model_type = prefix + the source's
    config_key: str | None = None  # the converted config.json's key holding the kind's settings
    # the attention implementation `surgery check` runs the source with, when the converted model computes its
    # attention the way one implementation does (talking-heads: eager), so the check measures the surgery and not
    # the source's own sdpa-vs-eager rounding
    source_attention: str | None = None

    def refusals(self) -> dict[str, dict[Feature, str]]:
        """Per support label (a `convert --list` column), the features it refuses and why."""
        return {label: self.refuses for label in self.support_labels or (self.name,)}

    # ---- conversion -------------------------------------------------------------------------------------------
    def calibrates(self, options: WriteOptions) -> bool:
        """Whether this conversion with these options reads calibration text (and so streams the model's layers)."""
        return False

    def convert(self, source, out: Path, options: WriteOptions) -> dict:
        raise NotImplementedError

    def summary(self, record: dict, options: WriteOptions) -> str:
        """What `surgery convert` prints after `wrote OUT: `."""
        return f"{self.name} in {record['seconds']:.1f}s"

    # ---- cost model -------------------------------------------------------------------------------------------
    def converted_kv_heads(self, options: WriteOptions, kv_heads: int) -> int:
        """Stored K/V heads per layer after conversion (of a source with `kv_heads`)."""
        return kv_heads

    def calibration_estimate(self, config: dict, options: WriteOptions, *, dtype: str, device: str, throughput=None):
        """Peak memory and time of the calibrated conversion (surgery/estimate.py), or None when it streams."""
        return None

    def attention_macs(self, shape: AttentionShape, config: dict, record: dict, context: int) -> dict[str, Any]:
        """Multiply-accumulates per token of the attention, as `surgery inspect` reports them: the projections, and
        (kinds that add work between the scores and the values) that extra work at `context` keys."""
        L, h, kv, d, H = shape.layers, shape.heads, shape.kv_heads, shape.head_dim, shape.hidden
        return {"proj": L * (H * h * d + 2 * H * kv * d + h * d * H), "mixing": None}

    def kv_cache_values(self, shape: AttentionShape, config: dict, context: int | None = None) -> dict[str, int]:
        """Values each runtime caches per token, all layers together, for a checkpoint this kind wrote (`config`:
        its config.json), averaged over a cache of `context` tokens (None: the model's context) where sliding-window
        layers keep only their window: {"transformers": n, "vllm": n, "llama.cpp": n}. Bytes = values x the cache
        dtype's size."""
        n = 2 * shape.layers * shape.kv_heads * shape.head_dim
        return {"transformers": round(n * cached_fraction(config, context, kept=-1)),
                "vllm": round(n * cached_fraction(config, context)), "llama.cpp": round(n * cached_fraction(config, context))}

    def experts(self, config: dict) -> tuple[int | None, int | None]:
        """Experts per head and experts each token uses, from the converted config (`surgery inspect`'s row);
        (None, None): the attention has no experts."""
        return None, None

    def attention_layers(self, shape: AttentionShape, config: dict) -> int:
        """Layers that attend (their work and K/V grow with the context; the others, if any, keep a fixed state)."""
        return shape.layers

    def state_values(self, config: dict) -> int:
        """Values the model keeps whatever the context (recurrent mixers' state and convolution windows), all layers
        together, for a checkpoint this kind wrote; 0: none."""
        return 0

    def added_parameters(self, record: dict) -> int | None:
        """Parameters the conversion added (None: it adds none worth a row)."""
        return None

    def training_form(self, model):
        """Put a loaded checkpoint of this kind into an exactly equivalent form that trains better (uptrain), in place;
        returns what maps it back before saving (`.restore(model, state=None)`), or None: train it as loaded."""
        return None

    def check_checkpoint(self, config: dict, shapes: dict[str, tuple[int, ...]]) -> None:
        """A checkpoint this kind wrote, read back: its config.json's own settings (`config_key`'s and the sizes
        they imply) and its tensors' `shapes` (name -> shape, from the headers) agree, else one line
        (surgery.kinds.check_checkpoint runs it for every command that reads a checkpoint back)."""

    def card_lines(self, record: dict) -> list[str]:
        """Kind-specific lines of the model card's "what was done" section."""
        return []
