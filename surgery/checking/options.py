"""The options of `surgery check` (and of a recipe's check step): one model, its fields the command's flags, the API's
keywords and a recipe's keys, and every rule on them that needs no checkpoint (counts, what an option needs beside
it, the retrieval tasks and lengths' form): built once, by the command line, the API or a recipe, before any
checkpoint is resolved. The rules that need the checkpoints (a causal LM, the context, the sliding window, the
haystack text's length) are checking/compare.py's `plan_check`."""

from __future__ import annotations

from typing import Literal

from pydantic import ValidationInfo, field_validator, model_validator

from ..dtypes import DTYPE_NAMES
from ..errors import SurgeryError
from ..options import Texts, at_least_one, option, spelling, texts_rule
from ..precision import PrecisionOptions, check_dtype
from .retrieval_spec import EXTRA_TOKENS, check_length, parse_lengths, parse_retrieval_tasks


class CheckOptions(PrecisionOptions):
    data: Texts = option(["pydoc"], "--data", "Text: pydoc, stdlib (the standard library's modules, one document "
                         "each), local .txt/.jsonl/.parquet files or globs, or a hub "
                         "dataset name[:config][@split[@revision]]. Repeat it to check on several texts (e.g. domains) in one "
                         "run, each model loaded once: each text gives its own --tokens tokens and numbers.")
    text_field: str = option("text", "--text-field", "Column holding the text in tabular data.")
    chat_template: Literal["auto", "on", "off"] = option(
        "auto", "--chat-template", "How a text's `messages` column (conversations: lists of {role, content}) is read: "
        "on: rendered with the tokenizer's chat template; off: the contents joined; auto: the template when the "
        "tokenizer has one.")
    tokens: int = option(16384, "--tokens", "Tokens to compare on (at least 1).")
    seq_len: int = option(1024, "--seq-len", "Window length (capped at the context).")
    documents: Literal["joined", "whole"] = option(
        "joined", "--documents", "joined: the documents tokenized one after another, cut into windows; whole: each "
        "window cut from one document at least --seq-len tokens long (long-context numbers; --data stdlib has long "
        "documents), the report names them; none that long: an error.")
    batch_size: int = option(4, "--batch-size", "Windows per forward pass.")
    device: str = option("auto", "--device", "auto (CUDA when present), cpu, cuda, cuda:N.")
    dtype: Literal[DTYPE_NAMES] = option("float32", "--dtype", "The dtype both models are loaded in; --precision bf16 "
                                                            "autocasts float32 weights to bf16.")
    expect: Literal["exact", "none"] = option("none", "--expect", "exact: exit 1 when max |Δlogits| exceeds the dtype's "
                                                                  "tolerance.")
    atol: float | None = option(None, "--atol", "Override the tolerance used by --expect exact.")
    generate: int = option(0, "--generate", "Also let both models continue prompts greedily for N tokens and compare "
                                            "the continuations.")
    prompt_len: int = option(32, "--prompt-len", "With --generate: tokens of each prompt cut from the text (at most "
                                                 "half a window); the continuations start at this position.")
    prompts: str | None = option(None, "--prompts", "With --generate: a text file of extra prompts, one a line.",
                                 path="file")
    layers: bool = option(False, "--layers", "Also report each layer's attention and hidden-state error vs the source.")
    tasks: str | None = option(None, "--tasks", "Also score both models on lm-eval tasks: comma-separated task names "
                                                "and task YAML files (needs the `eval` extra).")
    tasks_limit: int | None = option(None, "--tasks-limit", "With --tasks: at most N examples per task.")
    retrieval: str | None = option(
        None, "--retrieval", "Also score both models on synthetic long-context retrieval (RULER's families, generated "
        "here): comma-separated passkey, niah_single, niah_multikey, variable_tracking, common_words, or all.")
    retrieval_lengths: str | None = option(
        None, "--retrieval-lengths", "With --retrieval: comma-separated example lengths in tokens, or in multiples of "
        "the converted model's sliding window w (its config.json's sliding_window): 2w,4w,8w or 512,4w (default: 512, "
        "1024, ... doubling up to --seq-len, capped at the context).")
    retrieval_samples: int = option(4, "--retrieval-samples", "With --retrieval: examples per task and length, needle "
                                                              "depths spread evenly (the 95% intervals narrow with "
                                                              "more: about +-20 points at 20).")
    retrieval_haystack: Literal["auto", "noise", "text"] = option(
        "auto", "--retrieval-haystack", "With --retrieval: what fills the context around the needles: RULER's noise "
        "sentences, or the check's own --data text (its first --tokens tokens, each example its own stretch); auto: "
        "the text when --data names one other than the default pydoc, else the noise.")
    retrieval_batch: int = option(4, "--retrieval-batch", "With --retrieval: examples per forward pass (all of one "
                                                          "task and length, so equally long; at most 32,768 tokens a "
                                                          "pass).")
    retrieval_metric: Literal["exact", "string"] = option(
        "exact", "--retrieval-metric", "With --retrieval: what counts as retrieved. exact: every answer token the "
        "model's argmax, teacher-forced (one pass; what greedy decoding writes first); string: RULER's "
        f"string_match_all, the answer's text anywhere in a greedy continuation of its length + {EXTRA_TOKENS} "
        "tokens (one generation per example besides the pass: slower; the report keeps the exact hits beside it).")
    plot: str | None = option(None, "--plot", "With --retrieval: write a PNG of accuracy against length here.",
                              path="file")
    tokenizer: Literal["source", "converted"] | None = option(
        None, "--tokenizer", "Which tokenizer encodes the text when the two checkpoints' tokenizers differ.")
    trust_remote_code: bool = option(False, "--trust-remote-code", "Run the modeling code shipped with CONVERTED.")
    trust_source_code: bool = option(False, "--trust-source-code", "Run the modeling code shipped with SOURCE.")
    allow_pickle: bool = option(False, "--allow-pickle", "Accept pickle .bin weights (loaded with weights_only=True).")
    revision: str | None = option(None, "--revision", "Hub revision for hub ids.")

    _data = field_validator("data")(texts_rule("data"))

    _positive = field_validator("retrieval_samples", "retrieval_batch")(at_least_one)

    @field_validator("tokens", "seq_len", "batch_size", "prompt_len")
    @classmethod
    def _count(cls, v: int, info: ValidationInfo) -> int:
        if v < 1:
            raise ValueError(f"{spelling(info, cls).flag(info.field_name)} must be at least 1 (got {v})")
        return v

    @field_validator("generate")
    @classmethod
    def _generate(cls, v: int, info: ValidationInfo) -> int:
        if v < 0:
            raise ValueError(f"{spelling(info, cls).flag('generate')} must be 0 (off) or a number of tokens (got {v})")
        return v

    @field_validator("tasks_limit")
    @classmethod
    def _tasks_limit(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"{spelling(info, cls).flag('tasks_limit')} must be at least 1 (got {v})")
        return v

    @field_validator("retrieval")
    @classmethod
    def _retrieval_tasks(cls, v: str | None) -> str | None:
        if v is not None:
            _refused_as_value(parse_retrieval_tasks, v)
        return v

    @field_validator("retrieval_lengths")
    @classmethod
    def _retrieval_lengths(cls, v: str | None) -> str | None:
        entries = _refused_as_value(parse_lengths, v) or ()
        for n in (e for e in entries if isinstance(e, int)):  # multiples of w: once the window is known
            _refused_as_value(check_length, n)
        return v

    @model_validator(mode="after")
    def _precision_dtype(self, info: ValidationInfo):
        s = spelling(info, type(self))
        check_dtype(self.precision, self.dtype, (s.flag("precision"), s.flag("dtype")))
        return self

    @model_validator(mode="after")
    def _needs(self, info: ValidationInfo):
        """An option that only works beside another, given without it: it would do nothing, silently."""
        s = spelling(info, type(self))
        if self.prompts is not None and not self.generate:
            raise ValueError(f"{s.flag('prompts')} needs {s.flag('generate')} N (the number of tokens to generate)")
        if self.tasks_limit is not None and not self.tasks:
            raise ValueError(f"{s.flag('tasks_limit')} needs {s.flag('tasks')}")
        if self.plot and not self.retrieval:
            raise ValueError(f"{s.flag('plot')} draws the retrieval accuracy: it needs {s.flag('retrieval')} TASKS")
        fields = type(self).model_fields
        alone = [n for n in RETRIEVAL_ONLY if getattr(self, n) != fields[n].default]
        if alone and not self.retrieval:
            listed = [s.flag(n) for n in RETRIEVAL_ONLY]
            raise ValueError(f"{', '.join(listed[:-1])} and {listed[-1]} need {s.flag('retrieval')} TASKS")
        return self

    @property
    def text_given(self) -> bool:
        """Whether the check's text is the user's, not the default (pydoc): --retrieval-haystack auto reads it."""
        return self.data != type(self).model_fields["data"].default


RETRIEVAL_ONLY = ("retrieval_lengths", "retrieval_samples", "retrieval_haystack", "retrieval_batch",
                  "retrieval_metric")


def _refused_as_value(rule, value):
    """`rule(value)`, its SurgeryError as the ValueError a validator raises (the same one line)."""
    try:
        return rule(value)
    except SurgeryError as e:
        raise ValueError(str(e)) from None
