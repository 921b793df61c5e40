"""The options of `surgery check` (and of a recipe's check step): one model, its fields the command's flags, the API's
keywords and a recipe's keys."""

from __future__ import annotations

from typing import Literal

from pydantic import ValidationInfo, field_validator, model_validator

from ..dtypes import DTYPE_NAMES
from ..options import Texts, option, spelling, texts_rule
from ..precision import PrecisionOptions, check_dtype


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
    plot: str | None = option(None, "--plot", "With --retrieval: write a PNG of accuracy against length here.",
                              path="file")
    tokenizer: Literal["source", "converted"] | None = option(
        None, "--tokenizer", "Which tokenizer encodes the text when the two checkpoints' tokenizers differ.")
    trust_remote_code: bool = option(False, "--trust-remote-code", "Run the modeling code shipped with CONVERTED.")
    trust_source_code: bool = option(False, "--trust-source-code", "Run the modeling code shipped with SOURCE.")
    allow_pickle: bool = option(False, "--allow-pickle", "Accept pickle .bin weights (loaded with weights_only=True).")
    revision: str | None = option(None, "--revision", "Hub revision for hub ids.")

    _data = field_validator("data")(texts_rule("data"))

    @field_validator("retrieval_samples", "retrieval_batch")
    @classmethod
    def _positive(cls, v: int, info: ValidationInfo) -> int:
        if v < 1:
            raise ValueError(f"{spelling(info, cls).flag(info.field_name)} must be at least 1, got {v}")
        return v

    @model_validator(mode="after")
    def _precision_dtype(self, info: ValidationInfo):
        s = spelling(info, type(self))
        check_dtype(self.precision, self.dtype, (s.flag("precision"), s.flag("dtype")))
        return self
