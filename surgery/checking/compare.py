"""Compare two checkpoints on the same tokens: |Δlogits|, KL(source‖converted), top-1 agreement, perplexity, and
the last three by position in the window (`by_position`: where in the context the conversion hurts). Several texts
(e.g. of several domains) are compared in one run, each model loaded once: the report's top level is the first text,
`texts` holds every text's numbers.

Causal LMs are compared on their logits; encoders (no causal LM head) on their last hidden states.

`compare_checkpoints` (the `check` command) holds one model at a time. The source runs over every window first and
leaves its float32 outputs in a spill store (memory when small, else raw files in a scratch folder; see
check/spill.py), and is freed; then the converted model runs over the same windows, and each chunk's metrics are
computed against the stored source outputs, a slice of positions at a time. Peak memory: one model, one chunk of
outputs and one slice. The numbers are the ones a two-models-at-once comparison gives (`compare_models`, kept for
callers that hold both models anyway, like compare-merges), to float rounding of the sums.

The options' own rules hold when their model (checking/options.py: CheckOptions, taken whole) is built, before
any checkpoint is resolved; everything else that can be wrong with the input (trust, pickle weights, truncated or
shape-mismatched checkpoints, different tokenizers, what needs a causal LM, the context) is checked by `plan_check`
before the first model is loaded.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F

from . import documents
from . import generate as gen
from . import layers as layer_errors
from .retrieval import plan_retrieval, score_retrieval
from .retrieval_report import compare_retrieval_scores
from .tasks import compare_task_scores, load_tasks, score_eval_tasks
from .passes import IGNORE, Projection, converted_pass, next_token_targets, outputs, slice_rows, source_pass
from .positions import PositionBuckets, window_positions
from .overlap import HashedTexts, calibration_overlap
from .spill import MEMORY_BYTES, SpillStore
from .tokenizers import choose_tokenizer, has_tokenizer
from ..data import token_stream
from ..errors import SurgeryError
from ..precision import autocast, weights_precision
from ..progress import Progress
from ..runtime import (context_length, is_causal_lm, load_model, load_model_config, load_tokenizer, pick_device,
                       windows)
from ..checkpoint.source import Source
from .options import CheckOptions
from ..kinds import check_checkpoint

TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 1e-1}


def tolerance(dtype: str) -> float:
    return TOLERANCE[dtype]


def precision_tolerance(precision: str) -> float:
    """--expect exact's tolerance for models computing in `precision` (the report's "bf16", "fp16" or "fp32")."""
    return TOLERANCE[{"bf16": "bfloat16", "fp16": "float16"}.get(precision, "float32")]


def vocab_size(config) -> int | None:
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(config, "vocab_size", None)


def hidden_size(config) -> int:
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or 0)


# --- metrics ------------------------------------------------------------------------------------------------------
class Accumulator:
    """Running sums for the comparison metrics, slice of positions after slice (sums in float64)."""

    def __init__(self, seq_len: int | None = None):
        self.by_position = PositionBuckets(seq_len) if seq_len else None
        self.max_abs = 0.0
        self.sum_abs = 0.0
        self.n_values = 0
        self.kl = 0.0
        self.agree = 0
        self.n_positions = 0
        self.nll = [0.0, 0.0]
        self.n_targets = 0

    def add_outputs(self, a: torch.Tensor, b: torch.Tensor) -> None:
        a, b = a.float(), b.float()
        diff = (a - b).abs()
        if diff.numel():
            self.max_abs = max(self.max_abs, diff.max().item())
        self.sum_abs += diff.sum(dtype=torch.float64).item()
        self.n_values += diff.numel()

    def add_logit_rows(self, a: torch.Tensor, b: torch.Tensor, targets: torch.Tensor,
                       positions: torch.Tensor | None = None) -> None:
        """a, b: (rows, vocab) logits of the source and the converted model; targets: (rows,) the next token of each
        row, IGNORE where the window ends; positions: (rows,) each row's position in its window (for
        `by_position`)."""
        a, b = a.float(), b.float()
        self.add_outputs(a, b)
        logp_a, logp_b = F.log_softmax(a, -1), F.log_softmax(b, -1)
        kl = (logp_a.exp() * (logp_a - logp_b)).sum(-1)
        agree = (a.argmax(-1) == b.argmax(-1)).double()
        nll = [F.nll_loss(logp, targets, ignore_index=IGNORE, reduction="none") for logp in (logp_a, logp_b)]
        has_target = (targets != IGNORE).double()
        self.kl += kl.sum(dtype=torch.float64).item()
        self.agree += int(agree.sum().item())
        self.n_positions += a.shape[0]
        for i in (0, 1):
            self.nll[i] += nll[i].sum(dtype=torch.float64).item()
        self.n_targets += int(has_target.sum().item())
        if self.by_position is not None and positions is not None:
            self.by_position.add(positions, nll[0], nll[1], has_target, kl, agree)

    def add_logits(self, a: torch.Tensor, b: torch.Tensor, input_ids: torch.Tensor) -> None:
        """a, b: (batch, length, vocab) logits for `input_ids` (batch, length)."""
        targets = next_token_targets(input_ids).reshape(-1)
        positions = window_positions(*input_ids.shape)
        a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
        step = slice_rows(a.shape[-1])
        for start in range(0, a.shape[0], step):
            rows = slice(start, start + step)
            self.add_logit_rows(a[rows], b[rows], targets[rows], positions[rows])

    def report(self) -> dict:
        out = {"max_abs_diff": self.max_abs, "mean_abs_diff": self.sum_abs / max(self.n_values, 1)}
        if self.n_positions:
            out.update(
                kl=self.kl / self.n_positions,
                top1_agreement=self.agree / self.n_positions,
                ppl_source=math.exp(self.nll[0] / self.n_targets),
                ppl_converted=math.exp(self.nll[1] / self.n_targets),
            )
            if self.by_position is not None and len(self.by_position.edges) > 2:
                out["by_position"] = self.by_position.report()
        return out


@torch.no_grad()
def compare_models(model_a, model_b, ids: torch.Tensor, seq_len: int, batch_size: int, causal: bool,
                   progress: bool = False, desc: str = "compare") -> dict:
    """Both models in memory at once (callers that hold both anyway); `compare_checkpoints` holds one at a time."""
    device = next(model_a.parameters()).device
    batches = windows(ids, seq_len)
    acc = Accumulator(seq_len)
    with Progress(batches.numel(), desc, enabled=progress) as bar:
        for start in range(0, batches.shape[0], batch_size):
            x = batches[start : start + batch_size].to(device)
            if causal:
                acc.add_logits(outputs(model_a, x, True), outputs(model_b, x, True), x)
            else:
                acc.add_outputs(outputs(model_a, x, False), outputs(model_b, x, False))
            bar.update(x.numel())
    return acc.report() | {"tokens": batches.numel(), "windows": batches.shape[0], "seq_len": seq_len,
                           "compared": "logits" if causal else "last_hidden_state"}


# --- checks before any work ----------------------------------------------------------------------------------------
def expected_shapes(config, causal: bool, trust_remote_code: bool) -> tuple[dict[str, tuple], str]:
    """{tensor name: shape} of the model `config` describes (built on the meta device: no memory), and its
    base-model prefix."""
    from transformers import AutoModel, AutoModelForCausalLM

    auto = AutoModelForCausalLM if causal else AutoModel
    try:
        with torch.device("meta"):
            model = auto.from_config(config, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds for configs it cannot build
        raise SurgeryError(f"cannot build a model from this config: {str(e).splitlines()[0]}") from None
    return {n: tuple(t.shape) for n, t in model.state_dict().items()}, model.base_model_prefix or ""


def validate_weights(source: Source, config, causal: bool, trust_remote_code: bool, allow_pickle: bool) -> None:
    """Refuse pickle weights without --allow-pickle, truncated safetensors files and tensors whose shape contradicts
    the config, before any model is loaded."""
    from ..checkpoint.tensors import CheckpointReader

    with CheckpointReader(source.folder, allow_pickle=allow_pickle) as reader:
        shapes = {name: tuple(reader.tensors[name].shape) for name in reader.names()}
    try:
        expected, prefix = expected_shapes(config, causal, trust_remote_code)
    except SurgeryError as e:
        raise SurgeryError(f"{source.spec}: {e}") from None
    for name, shape in shapes.items():
        candidates = [name, f"{prefix}.{name}"]
        if prefix and name.startswith(prefix + "."):
            candidates.append(name[len(prefix) + 1:])
        want = next((expected[c] for c in candidates if c in expected), None)
        if want is not None and want != shape:
            raise SurgeryError(f"{source.spec}: tensor {name} has shape {list(shape)} but its config.json implies "
                               f"{list(want)}: the checkpoint does not match its config")


def resolve_trusts(source: Source, converted: Source, trust_source_code: bool, trust_remote_code: bool):
    from ..trust import resolve_trust

    return (resolve_trust(source.folder, trust_source_code, "--trust-source-code", what=f"the source {source.spec}"),
            resolve_trust(converted.folder, trust_remote_code, "--trust-remote-code",
                          what=f"the converted model {converted.spec}"))


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --- the check -----------------------------------------------------------------------------------------------------
@dataclass
class CheckedText:
    """One text of a check: what it is called, its token windows, and what it shares with the calibration text."""

    data: str
    batches: torch.Tensor  # (windows, seq_len) token ids
    overlap: dict | None = None  # check.overlap.calibration_overlap
    documents: dict | None = None  # which documents the windows hold (checking/documents.py)

    @property
    def label(self) -> str:
        return f"{self.data}[0:{self.batches.numel()}]"

    def describe(self) -> dict:
        """The report's keys that say which tokens were compared."""
        return {"data": self.data, "text": self.label, "tokens": self.batches.numel(), "windows": self.batches.shape[0],
                "seq_len": self.batches.shape[1]} | ({"calibration_overlap": self.overlap} if self.overlap else {}) | (
                    {"documents": self.documents} if self.documents else {})


@dataclass
class CheckPlan:
    """Everything a check needs, validated, before any model is loaded."""

    source: Source
    converted: Source
    device: torch.device
    dtype: str
    trust: tuple[bool, bool]  # trust_remote_code for the source, for the converted model
    causal: bool
    width: int  # last dimension of the compared outputs (vocabulary or hidden size)
    source_attention: str | None  # attention implementation forced on the source (eager for talking-heads)
    tokenizer: object
    tokenizer_note: str | None
    texts: list[CheckedText]  # the first one also gives the prompts of --generate and the windows of --layers
    batch_size: int
    prompts: list
    new_tokens: int
    layer_windows: int  # 0: no --layers
    layer_bytes: int
    task_set: object = None  # checking.tasks.TaskSet of --tasks, loaded before any model
    retrieval_plan: object = None  # checking.retrieval.RetrievalPlan of --retrieval: its examples, checked before any
    # model
    precision: str = "fp32"  # what the models compute in: bf16 (autocast or bf16 weights), fp16 or fp32

    @property
    def batches(self) -> torch.Tensor:
        return self.texts[0].batches

    @property
    def seq_len(self) -> int:
        return self.batches.shape[1]

    def output_bytes(self, head: Projection | None = None) -> int:
        """What waits between the two passes: the source's float32 outputs for every text, or its final hidden
        states where `head` projects them."""
        return sum(t.batches.numel() for t in self.texts) * (head.weight.shape[1] if head else self.width) * 4

    def layer_batches(self) -> list[torch.Tensor]:
        n, size = self.layer_windows, self.batch_size
        return [self.batches[s:min(s + size, n)].to(self.device) for s in range(0, n, size)]


def plan_check(source: Source, converted: Source, texts: Iterable[str], r: CheckOptions, warn,
               more_texts: Sequence[tuple[str, Iterable[str]]] = ()) -> CheckPlan:
    """Check what the options alone cannot (trust, weights, tokenizers, prompts, what needs a causal LM, the context
    and the sliding window: the options' own rules held when `r` was built) and tokenize the texts (`texts`, called
    `r.data[0]`, then each (name, texts) of `more_texts`); loads no model."""
    name = r.data[0]
    dev = pick_device(r.device)
    try:
        precision = weights_precision(r.precision, dev, r.dtype)
    except ValueError as e:
        raise SurgeryError(str(e)) from None
    trust_a, trust_b = resolve_trusts(source, converted, r.trust_source_code, r.trust_remote_code)
    for s in (source, converted):  # a kind's config.json against its tensors, before transformers reads it
        check_checkpoint(s.folder, s.config)
    config_a, config_b = load_model_config(source, trust_a), load_model_config(converted, trust_b)
    causal = is_causal_lm(config_a)
    if causal != is_causal_lm(config_b):
        raise SurgeryError(f"{source.spec} and {converted.spec} are not the same kind of model "
                           "(one is a causal LM, the other not)")
    if vocab_size(config_a) != vocab_size(config_b):
        raise SurgeryError(f"the two checkpoints have different vocabularies ({vocab_size(config_a)} and "
                           f"{vocab_size(config_b)} ids)")
    if r.generate and not causal:
        raise SurgeryError("--generate needs a causal LM")
    if r.tasks and not causal:
        raise SurgeryError("--tasks needs a causal LM")
    validate_weights(source, config_a, causal, trust_a, r.allow_pickle)
    validate_weights(converted, config_b, causal, trust_b, r.allow_pickle)

    texts = iter(texts)
    head = list(islice(texts, 2))
    tok, tokenizer_note = choose_tokenizer(
        load_tokenizer(source, trust_a),
        load_tokenizer(converted, trust_b) if has_tokenizer(converted.folder) else None, r.tokenizer,
        probes=[t[:4000] for t in head if t])
    ctx = context_length(config_a)
    # windows: --seq-len, capped at the context and at --tokens (the report says which length was used)
    seq_len = min(r.seq_len, ctx or r.seq_len, r.tokens)

    def tokenized(name: str, text: Iterable[str]) -> tuple[CheckedText, torch.Tensor]:
        hashed = HashedTexts(text)
        what = f"the text {name}" if more_texts else "the data"
        if r.documents == "whole":
            whole = documents.whole_document_windows(hashed, tok, seq_len, r.tokens, name, warn)
            checked = CheckedText(name, whole.batches, documents=whole.describe())
            ids = whole.batches.reshape(-1)
        else:
            ids = token_stream(hashed, tok, r.tokens)
            checked = CheckedText(name, windows(ids, seq_len, what))
            straddling = documents.warn_straddling(checked.batches, tok, name, warn)
            checked.documents = {"mode": "joined", "straddling_windows": straddling}
        checked.overlap = calibration_overlap(converted.folder, hashed.hashes)
        if checked.overlap:
            o = checked.overlap
            warn(f"{o['documents']} of the {o['of']} documents checked on{f' in {name}' if more_texts else ''} were "
                 f"calibration documents of {converted.spec} (surgery.json: calibration on {o['calibration']}): its "
                 "numbers are optimistic; check on text it never saw")
        return checked, ids

    first, ids = tokenized(name, chain(head, texts))
    checked = [first] + [tokenized(name, text)[0] for name, text in more_texts]
    batches = first.batches

    prompts: list[gen.Prompt] = []
    if r.generate:
        prompts = gen.prompts_from_stream(ids, length=min(r.prompt_len, max(1, batches.shape[1] // 2)))
        if r.prompts is not None:
            prompts = gen.prompts_from_file(Path(r.prompts), tok) + prompts
        gen.check_lengths(prompts, r.generate, ctx)
    n_layer_windows = layer_errors.layer_windows(batches.shape[0], batches.shape[1]) if r.layers else 0
    # A talking-heads model computes eager attention: compare it with the source's eager attention, so that the
    # report measures the surgery and not the source's own sdpa-vs-eager rounding (~1e-4 on SmolLM2's logits).
    source_attention = _source_attention(converted)
    task_set = load_tasks(r.tasks, r.tasks_limit) if r.tasks else None  # a task's data that cannot be had: before any model
    retrieval_plan = None
    if r.retrieval:
        if not causal:
            raise SurgeryError("--retrieval needs a causal LM")
        window, no_window = retrieval_window(converted)
        retrieval_plan = plan_retrieval(
            r.retrieval, r.retrieval_lengths, r.retrieval_samples, r.retrieval_haystack, tok, ctx,
            min(r.seq_len, ctx or r.seq_len), ids, batch=r.retrieval_batch, window=window, no_window=no_window,
            text_name=name, text_given=r.text_given, metric=r.retrieval_metric)
    return CheckPlan(source, converted, dev, r.dtype, (trust_a, trust_b), causal,
                     vocab_size(config_a) if causal else hidden_size(config_a), source_attention, tok, tokenizer_note,
                     checked, r.batch_size, prompts, r.generate, n_layer_windows,
                     layer_errors.expected_bytes(config_a, n_layer_windows * batches.shape[1]), task_set, retrieval_plan,
                     precision)


def compare_checkpoints(source: Source, converted: Source, texts: Iterable[str], options: CheckOptions | None = None,
                        progress: bool = True, spill_bytes: int = MEMORY_BYTES, warn=None,
                        more_texts: Sequence[tuple[str, Iterable[str]]] = ()) -> dict:
    """Run the source, then the converted model, over the same windows of `texts` (the first of `options.data`);
    see the module docstring. `more_texts`: further (name, texts) pairs compared in the same run, each on its own
    first `tokens` tokens (the report's `texts`).

    `options`: the check's options (default: CheckOptions()); of them, trust_remote_code trusts the converted
    model's own code, trust_source_code the source's (the toolkit's own modeling files in its own outputs are
    recognised by their sha256 and need neither). `warn(line)` receives warnings (the CLI prints them on stderr).
    `spill_bytes`: the largest store of source outputs kept in memory."""
    plan = plan_check(source, converted, texts, options or CheckOptions(), warn or (lambda line: None), more_texts)
    return run_check(plan, progress, spill_bytes)


def run_check(plan: CheckPlan, progress: bool = True, spill_bytes: int = MEMORY_BYTES) -> dict:
    p, seconds = plan, {}
    several = len(p.texts) > 1
    with contextlib.ExitStack() as stack:
        layer_store = stack.enter_context(SpillStore(p.layer_bytes, spill_bytes, what="the source's per-layer outputs"))
        stack.enter_context(autocast(p.precision, p.device))  # the passes in --precision; the metrics in float32
        # pass 1: the source alone; what the metrics need waits in the stores (text i's chunks under "i-")
        start = time.time()
        model = load_model(p.source, p.device, p.dtype, p.trust[0], attn_implementation=p.source_attention)
        source_attention = model.config._attn_implementation
        source_head = Projection.of(model, p.width, keep=True) if p.causal else None  # None: whole logits
        store = stack.enter_context(SpillStore(p.output_bytes(source_head), spill_bytes))
        for i, t in enumerate(p.texts):
            source_pass(model, t.batches, p.batch_size, store, p.device, p.causal, progress,
                        f"check source on {t.data}" if several else "check source", prefix=f"{i}-", head=source_head)
        source_continuations = continuations(model, p, progress, "generate source")
        source_forced = forced(model, p, source_continuations)  # the source's margins along its own continuations
        source_layers = layer_errors.record_layers(model, p.layer_batches(), layer_store) if p.layer_windows else 0
        source_scores = task_scores(model, p)
        source_retrieval_rows = retrieval_scores(model, p, progress, "retrieval source")
        del model
        free(p.device)
        seconds["source"] = round(time.time() - start, 2)

        # pass 2: the converted model alone, against what the source left
        start = time.time()
        model = load_model(p.converted, p.device, p.dtype, p.trust[1])
        head = Projection.of(model, p.width) if p.causal else None
        texts = [converted_pass(model, t.batches, p.batch_size, store, p.device, p.causal, progress,
                                f"check converted on {t.data}" if several else "check converted",
                                Accumulator(t.batches.shape[1]), prefix=f"{i}-", source_head=source_head,
                                head=head).report() | t.describe() for i, t in enumerate(p.texts)]
        store.close()
        sliced = source_head is not None and head is not None
        del source_head
        report = dict(texts[0])
        if p.new_tokens:
            report["generation"] = gen.compare_continuations(
                p.prompts, source_continuations, continuations(model, p, progress, "generate converted"),
                p.tokenizer, p.new_tokens) | gen.compare_forced(
                source_continuations, source_forced[1], forced(model, p, source_continuations)[0])
        if p.layer_windows:
            report["layers"] = layer_errors.compare_layers(model, p.layer_batches(), layer_store, source_layers)
            report["layers_tokens"] = p.layer_windows * p.seq_len
        if p.task_set is not None:
            report["tasks"] = compare_task_scores(source_scores, task_scores(model, p))
            report["tasks_limit"] = p.task_set.limit
        if p.retrieval_plan is not None:
            report["retrieval"] = compare_retrieval_scores(
                p.retrieval_plan, source_retrieval_rows, retrieval_scores(model, p, progress, "retrieval converted"))
        del model, head
        free(p.device)
        seconds["converted"] = round(time.time() - start, 2)

    report |= {"compared": "logits" if p.causal else "last_hidden_state", "device": str(p.device), "dtype": p.dtype,
               "precision": p.precision, "source_attention": source_attention, "seconds": seconds,
               "scratch": "memory" if store.in_memory else "disk"}
    if p.causal:  # sliced: no model returned whole logits (passes.py); whole: one or both did
        report["logits"] = "sliced" if sliced else "whole"
    if several:
        report["texts"] = texts
    if p.tokenizer_note:
        report["tokenizer"] = p.tokenizer_note
    return report


def task_scores(model, plan: CheckPlan) -> dict:
    """--tasks: lm-eval's scores of the loaded model ({} without --tasks)."""
    if plan.task_set is None:
        return {}
    return score_eval_tasks(model, plan.tokenizer, plan.task_set, plan.batch_size, plan.device)


def retrieval_scores(model, plan: CheckPlan, progress: bool, desc: str) -> list[dict] | None:
    """--retrieval: each example's score for the loaded model (None without --retrieval)."""
    if plan.retrieval_plan is None:
        return None
    return score_retrieval(model, plan.retrieval_plan, plan.device, progress, desc)


def retrieval_window(converted: Source) -> tuple[int | None, str]:
    """The converted model's sliding window as its config.json says (the `w` of --retrieval-lengths), or None and
    why it has none."""
    from ..kinds.base import SLIDING_WINDOW_SWITCHED, sliding_layers

    config = converted.config
    layers, window = sliding_layers(config)
    if layers and window:
        return window, ""
    if not config.get("sliding_window"):
        why = "its config.json sets no sliding_window"
    elif config.get("model_type") in SLIDING_WINDOW_SWITCHED and not config.get("use_sliding_window"):
        why = "its config.json sets sliding_window but not use_sliding_window"
    else:
        why = "none of its layers is a sliding_attention layer"
    return None, f"{converted.spec} has no sliding window ({why})"


def continuations(model, plan: CheckPlan, progress: bool, desc: str) -> list[list[int]] | None:
    if not plan.new_tokens:
        return None
    with Progress(len(plan.prompts) * plan.new_tokens, desc, enabled=progress) as bar:
        return gen.continue_prompts(model, plan.prompts, plan.new_tokens, plan.batch_size, plan.device, bar)


def forced(model, plan: CheckPlan, paths: list[list[int]] | None) -> tuple[list[list[int]], list[list[float]]] | None:
    """The model's argmax and margin at every step of `paths` (the source's continuations), fed them as input."""
    if not plan.new_tokens:
        return None
    return gen.forced_steps(model, plan.prompts, paths, plan.batch_size, plan.device)


def _source_attention(converted: Source) -> str | None:
    """The attention implementation the source runs with in the check, as the converted checkpoint's kind says."""
    from ..kinds import find_kind
    from ..checkpoint.record import read_record_or_empty

    kind = find_kind(record=read_record_or_empty(Path(converted.folder)))
    return kind.source_attention if kind else None
