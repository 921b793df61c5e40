"""The Python API's functions: each validates its keywords with the options model of the command of the same name
(the fields `surgery <command> --help` lists, by their field names) and calls the library function the command and
the recipes call (surgery/commands)."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence, Union

from ..options import refuse_unknown, validate_options
from .arguments import describe, flag_argument, int_argument, list_argument, path_argument, tokenizer_argument
from .results import (CheckReport, ConversionResult, Estimate, InspectReport, PushResult, RecipePlan, RecipeResult,
                      TeacherStore, UptrainResult)
from .sources import is_model, source_spec, text_spec, text_specs

if TYPE_CHECKING:
    from datasets import Dataset, IterableDataset

    from ..checking.options import CheckOptions
    from ..commands.uptrain import UptrainArgs
    from ..kinds import ConvertOptions
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger("surgery")

PathLike = Union[str, os.PathLike]
Source = Union[str, os.PathLike, "PreTrainedModel", ConversionResult, UptrainResult]
"""A checkpoint folder, a hub id, a `.gguf` file, `"smollm2"`, a result, or a loaded model."""
Text = Union[str, Sequence[str], Sequence[dict], "Dataset", "IterableDataset", tuple]
"""A text spec (`pydoc`, `general`, files, a hub dataset), a list of documents or rows, a dataset, or a tuple of
several of these (a mixture)."""


def _default(model, name: str) -> Any:
    return model.model_fields[name].default


def _typed(model, values: dict[str, Any], name: str) -> Any:
    """The option `name` of `values` (its default when not given) checked by its type in `model`, as validate_options
    checks it (one line naming the option, whatever the Python type given): an option read before the whole model
    is validated (the sizes the data objects are written to) is never used unchecked."""
    from pydantic import TypeAdapter, ValidationError

    from ..errors import SurgeryError
    from ..options import cli_meta

    if values.get(name) is None:
        return _default(model, name)
    try:
        return TypeAdapter(model.model_fields[name].annotation).validate_python(values[name])
    except ValidationError as e:
        raise SurgeryError(f"{cli_meta(model, name)['flag']}: {e.errors(include_url=False)[0]['msg']}") from None


def _run_texts(values: dict[str, Any], model) -> None:
    """An uptraining run's `data` / `eval_data` given as objects, written as text specs (in place), each read up to
    the tokens the run needs: its training and held-out tokens, times its data epochs."""
    sizes = [_typed(model, values, name) for name in ("tokens", "eval_tokens", "data_epochs")]
    tokens, eval_tokens, epochs = (max(0, v or 0) for v in sizes)
    need = (tokens + eval_tokens) * max(1, epochs)
    field = _typed(model, values, "text_field") or "text"
    if "data" in values:
        values["data"] = text_specs(values["data"], field, need)
    if "eval_data" in values:
        values["eval_data"] = text_spec(values["eval_data"], field, need)


def _output_folder(out: Any, function: str, force: bool) -> Path:
    """`out` as a Path, checked as the command checks its --out (it may not exist unless `force`; its missing parent
    folders can be made) before any work: before a loaded model is saved into the cache, before any data is read."""
    from ..checkpoint.atomic import check_output_path
    from ..errors import SurgeryError

    if out is None:
        raise SurgeryError(f"{function} needs out (the output folder) unless dry_run")
    out = path_argument(out, "out", function)
    check_output_path(out, force)
    return out


def convert(source: Source, out: PathLike | None = None, options: ConvertOptions | None = None, *,
            to: str | None = None, tokenizer: PreTrainedTokenizerBase | None = None, dry_run: bool = False,
            **values: Any) -> ConversionResult | Estimate:
    """Convert a checkpoint to another attention, as `surgery convert SOURCE --out OUT --to KIND` does.

    Args:
        source: A checkpoint folder, a hub id (`owner/name`, with `revision=`), a `.gguf` file, `"smollm2"` (the
            embedded SmolLM2-135M), or a loaded `transformers.PreTrainedModel`. A loaded model is saved with
            `save_pretrained` (safetensors) into the toolkit's cache (`~/.cache/surgery/loaded/<sha256>`, with
            `tokenizer`) and converted from there: simple and honest, at the cost of one copy on disk. Its lineage
            (a hub id and commit, a local folder's name, or built in memory) is what surgery.json and the card
            record as the source, never the cache folder.
        out: The output folder (written atomically: nothing half-written is left on failure; missing parent
            folders are made, and removed again if the conversion fails); checked before any work. Required unless
            `dry_run`.
        options: The options as one model of `surgery.commands.convert.options_model()` (what the command line
            builds, `to` included), instead of `to` and keywords.
        to: The target attention: `mqa`, `gqa`, `talking-heads`, `switchhead`, `mla` or `swa`.
        tokenizer: With a loaded model: its tokenizer (default: the one in the folder the model was loaded from).
        dry_run: Convert nothing and write nothing: return the estimate `surgery convert --dry-run` prints (peak
            host/device memory and time per layer, from a cost model and a short throughput probe), with the numbers
            its `--json` writes.
        **values: Any option of `surgery convert`, by its field name: `kv_heads=`, `merge=`, `calib=`,
            `calib_tokens=`, `device=`, `dtype=`, `precision=`, `force=`, `revision=`, ... `calib` also takes a
            `datasets.Dataset` / `IterableDataset` (column `text`), a list of strings (documents) or of dicts (rows),
            or a tuple of several sources to mix (`("pydoc", my_dataset)`); `calib_tokens` and `calib_window`
            apply to them as to text read from files.

    Returns:
        The converted checkpoint: its folder, its surgery.json record and `.load()`; with `dry_run`, the `Estimate`.

    Raises:
        SurgeryError: bad input, an unknown option (named with the closest one), or a rule the options break; the
            message is the line the command line prints.
    """
    from ..commands.convert import convert_checkpoint, dry_run as convert_dry_run, options_model
    from ..errors import SurgeryError

    dry_run = flag_argument(dry_run, "dry_run", "convert")
    tokenizer_argument(tokenizer, source, "convert")
    model = options_model()
    parsed = _options_argument(model, options, dict(values, **({} if to is None else {"to": to})), "convert")
    if parsed is None:
        if to is None:
            raise SurgeryError("convert needs to= (the target attention) or options=")
        values = dict(values, to=to)
        refuse_unknown(model, values)  # before any data object is written
        if "calib" in values:
            tokens = max(1, _typed(model, values, "calib_tokens") or 0)
            values["calib"] = text_specs(values["calib"], "text", tokens)
        parsed = validate_options(model, values)
    if dry_run:
        return Estimate(convert_dry_run(source_spec(source, tokenizer), parsed))
    out = _output_folder(out, "convert", parsed.force)
    message = convert_checkpoint(source_spec(source, tokenizer), out, parsed)  # calibration: runtime.load_tokenizer
    log.info(message)
    return ConversionResult.read(Path(out), parsed.to, message)


def export(checkpoint: Source, gguf: PathLike, *, dtype: str = "f32", force: bool = False,
           allow_pickle: bool = False, revision: str | None = None) -> Path:
    """Write a checkpoint as a GGUF file that llama.cpp runs with the same function (as `surgery export --gguf`):
    Llama bodies and their MQA/GQA outputs as `llama`, Qwen2 and Qwen3 bodies and theirs as `qwen2` and `qwen3`,
    `swa` outputs as `granite_swa`, MLA outputs as `deepseek2`, the tokenizer included, streamed one tensor at a time into a temporary file renamed into place.

    Args:
        checkpoint: A folder, hub id, `.gguf` file, `smollm2`, a result or a loaded model.
        gguf: The file to write.
        dtype: How the matrices are stored: f32, f16, bf16 or q8_0 (vectors stay f32).
        force: Replace an existing file.
        allow_pickle: Accept pickle `.bin` weights (read with `weights_only=True`).
        revision: The hub revision when `checkpoint` is a hub id.

    Returns:
        The path of the written file.

    Raises:
        SurgeryError: an unknown dtype, an output that cannot be written, custom code, or a family or feature that
            llama.cpp would not compute exactly (nothing is written).
    """
    from ..commands.export import export_checkpoint

    out = path_argument(gguf, "gguf", "export")
    force = flag_argument(force, "force", "export")
    allow_pickle = flag_argument(allow_pickle, "allow_pickle", "export")
    log.info(export_checkpoint(source_spec(checkpoint), out, dtype=dtype, force=force, allow_pickle=allow_pickle,
                               revision=revision))
    return out


def check(source: Source, converted: Source, options: CheckOptions | None = None, *,
          json_out: PathLike | None = None, show: bool = False, tokenizer: PreTrainedTokenizerBase | None = None,
          **values: Any) -> CheckReport:
    """Compare a converted checkpoint with its source on the same tokens, as `surgery check SOURCE CONVERTED` does.

    Args:
        source: The source: a folder, hub id, `.gguf` file, `"smollm2"` or a loaded model (saved as `convert` does).
        converted: The converted checkpoint: a folder, a `ConversionResult` / `UptrainResult`, or a loaded model.
        options: The options as one `surgery.checking.options.CheckOptions` (what the command line builds), instead
            of keywords.
        json_out: Also write the report as JSON here (what `--json` writes; `"-"`: stdout).
        show: Also print the report's tables on stdout, as `surgery check` does (before `expect` is judged).
        tokenizer: With a loaded model (source or converted): its tokenizer (default: the one in the folder the
            model was loaded from).
        **values: Any option of `surgery check` by its field name (`data=`, `tokens=`, `seq_len=`, `device=`,
            `dtype=`, `expect=`, `generate=`, `layers=`, `retrieval=`, ...). `data` also takes a `datasets.Dataset` /
            `IterableDataset`, a list of strings (documents) or a tuple of several texts, each checked on its own.

    Every rule on the options (counts, retrieval tasks and lengths, what an option needs beside it) is checked
    before any checkpoint is resolved, downloaded or loaded.

    Returns:
        The report: |Δlogits|, KL, top-1 agreement, perplexities, as attributes and as a mapping.

    Raises:
        SurgeryError: bad input or options; `surgery.commands.check.CheckFailed` (a SurgeryError) when
            `expect="exact"` is not met.
    """
    from ..commands.check import CheckOptions, check_checkpoints

    json_out = path_argument(json_out, "json_out", "check", optional=True)
    show = flag_argument(show, "show", "check")
    tokenizer_argument(tokenizer, source if is_model(source) else converted, "check")  # the converted's is optional
    parsed = _options_argument(CheckOptions, options, values, "check")
    if parsed is None:
        refuse_unknown(CheckOptions, values)
        if "data" in values:
            values["data"] = text_specs(values["data"], values.get("text_field") or "text",
                                        values.get("tokens") or _default(CheckOptions, "tokens"))
        parsed = validate_options(CheckOptions, values)
    report = check_checkpoints(source_spec(source, tokenizer, "check"), source_spec(converted, tokenizer), parsed,
                               json_out=json_out, warn=log.warning, show=show)
    return CheckReport(report)


def _options_argument(model, options: Any, values: dict, function: str):
    """`options` when it is an instance of `model` (validated when it was built: the command line builds it once)
    and no keyword option is given beside it; None when `options` is None (the keywords are the options)."""
    from ..errors import SurgeryError

    if options is None:
        return None
    if not isinstance(options, model):
        raise SurgeryError(f"{function}: options is a {model.__name__}, not {describe(options)}")
    if values:
        raise SurgeryError(f"{function}: give the options as a {model.__name__} or as keywords, not both (got "
                           f"{next(iter(values))}= beside options)")
    return options


def inspect(*checkpoints: Source, context: int = 4096, allow_pickle: bool = False) -> list[InspectReport]:
    """Heads, K/V heads, parameters, KV-cache bytes and attention MACs of checkpoints, from their headers only (as
    `surgery inspect --json`).

    Args:
        *checkpoints: Folders, hub ids, `.gguf` files, results or loaded models.
        context: The context length of the per-context numbers.
        allow_pickle: Accept pickle `.bin` weights (read with `weights_only=True`).

    Returns:
        One report per checkpoint, in order.

    Raises:
        SurgeryError: a checkpoint that cannot be read, or a context below 1.
    """
    from ..checkpoint.source import resolve_source
    from ..inspection import inspect_checkpoint

    context = int_argument(context, "context", "inspect")  # its range: the line `surgery inspect --context` prints
    allow_pickle = flag_argument(allow_pickle, "allow_pickle", "inspect")
    reports = []
    for c in checkpoints:
        spec = source_spec(c)
        folder = resolve_source(spec, allow_pickle=allow_pickle).folder
        stats = inspect_checkpoint(folder, context=context, label=spec, allow_pickle=allow_pickle)
        reports.append(InspectReport(stats))
    return reports


def uptrain(model: Source, out: PathLike | None = None, options: UptrainArgs | None = None, *,
            tokenizer: PreTrainedTokenizerBase | None = None, progress: bool = True, dry_run: bool = False,
            **values: Any) -> UptrainResult | Estimate:
    """Continue training a (converted) causal LM, as `surgery uptrain MODEL --out OUT` does.

    Args:
        model: The model to train: a folder, a `ConversionResult`, or a loaded model (saved as `convert` does).
        out: The output folder (written atomically; checkpoints go to `OUT.run`); required unless `dry_run`.
        tokenizer: With a loaded model: its tokenizer.
        progress: Show the progress bar (or progress lines when stderr is not a terminal).
        dry_run: Train nothing and write nothing: return the memory estimate `surgery uptrain --dry-run` prints
            (each process's host and GPU memory, by phase and term; read from the checkpoints' headers). Data
            objects are still copied into the cache, as for a run.
        options: The options as one `surgery.commands.uptrain.UptrainArgs` (what the command line builds), instead
            of keywords.
        **values: Any option of `surgery uptrain` by its field name (`tokens=` is required; `data=`, `loss=`,
            `teacher=`, `seq_len=`, `batch_tokens=`, `lr=`, `device` comes from accelerate, ...). `data` and
            `eval_data` also take a `datasets.Dataset` / `IterableDataset`, a list of strings (documents) or, for
            `data`, a tuple of several sources (a mixture, with `data_weights=`); `teacher` also takes a loaded
            model, `teacher_logprobs` the store `surgery.teacher` returned. Token counts, windows and held-out splits apply to them as to files. A data object is first
            written into the cache as a .jsonl file (up to 32 characters per token the run needs): for a large
            streamed hub dataset, pass its spec (`"name:config@split"`, with `streaming=True`) instead.

    Returns:
        The trained checkpoint: its folder, record, metrics and `.load()`; with `dry_run`, the `Estimate`.

    Raises:
        SurgeryError: bad input or options (the line the command line prints).
    """
    from ..commands.uptrain import UptrainArgs, uptrain_dry_run, uptrain_model
    from ..errors import SurgeryError

    dry_run = flag_argument(dry_run, "dry_run", "uptrain")
    progress = flag_argument(progress, "progress", "uptrain")
    tokenizer_argument(tokenizer, model, "uptrain")
    parsed = _options_argument(UptrainArgs, options, values, "uptrain")
    if parsed is None:
        values = dict(values)
        refuse_unknown(UptrainArgs, values)
        _run_texts(values, UptrainArgs)
        if values.get("teacher") is not None:
            values["teacher"] = source_spec(values["teacher"])
        if values.get("teacher_logprobs") is not None:  # a folder, or the TeacherStore `teacher` returned
            values["teacher_logprobs"] = str(path_argument(values["teacher_logprobs"], "teacher_logprobs",
                                                           "uptrain"))
        parsed = validate_options(UptrainArgs, values)
    if dry_run:
        return Estimate({"lines": uptrain_dry_run(source_spec(model, tokenizer), parsed)})
    out = _output_folder(out, "uptrain", parsed.force)
    uptrain_model(source_spec(model, tokenizer, "uptrain"), out, parsed, progress=progress)
    return UptrainResult.read(Path(out))


def snapshot(run_dir: PathLike, out: PathLike, **options: Any) -> UptrainResult:
    """Write one checkpoint an uptraining run kept (`uptrain(..., save_every=N, keep_run_dir=True)`) as a model folder
    like the run's output, as `surgery snapshot RUN_DIR --out OUT` does: the input model's files and record, the
    step's weights in the input's dtype (LoRA adapters merged), and an `uptraining` record naming the step.

    Args:
        run_dir: The run folder (`OUT.run`, or the run's `run_dir`).
        out: The output folder (written atomically).
        **options: Any option of `surgery snapshot` by its field name (`step=` a step number or `"latest"`,
            `force=`, `trust_remote_code=`, `max_shard_size=`).

    Returns:
        The written folder: its record (`record["uptraining"]["snapshot"]` names the step), metrics up to the step
        and `.load()`.

    Raises:
        SurgeryError: a folder that is no run folder, a missing or damaged step, an existing `out` without `force`.
    """
    from ..commands.snapshot import SnapshotOptions, snapshot_step

    run_dir = path_argument(run_dir, "run_dir", "snapshot")
    parsed = validate_options(SnapshotOptions, dict(options))
    out = _output_folder(out, "snapshot", parsed.force)
    log.info(snapshot_step(run_dir, out, parsed))
    return UptrainResult.read(Path(out))


def push(folder: PathLike | ConversionResult | UptrainResult, repo_id: str, *,
         check_reports: Sequence[PathLike | CheckReport] = (), json_out: PathLike | None = None,
         **options: Any) -> PushResult:
    """Validate a converted folder and upload it to the hub, with its model card, as `surgery push FOLDER REPO_ID`.

    Args:
        folder: The folder (or a `ConversionResult` / `UptrainResult`).
        repo_id: The hub repository, `owner/name`.
        check_reports: Check reports to put in the model card: `surgery check --json` files or `CheckReport`s.
        json_out: Also write the result as JSON here (`"-"`: stdout).
        **options: Any option of `surgery push` by its field name (`private=`, `revision=`, `exist_ok=`,
            `message=`, `bench_report=`).

    Returns:
        Where the upload went.

    Raises:
        SurgeryError: a folder that does not validate, a bad repo id, or a hub refusal.
    """
    from ..commands.push import PushOptions, push_result, pushed_line

    json_out = path_argument(json_out, "json_out", "push", optional=True)
    parsed = validate_options(PushOptions, dict(options, repo_id=repo_id))
    with tempfile.TemporaryDirectory(prefix="surgery-reports-") as tmp:
        paths = _report_paths(check_reports, Path(tmp), "push")
        result = push_result(Path(source_spec(folder)), parsed, paths,
                             json_out=json_out, log=log.info)
    log.info(pushed_line(Path(source_spec(folder)), result))
    return PushResult(repo_id=parsed.repo_id, repo_url=str(result.repo_url), revision=str(result.revision),
                      commit_url=str(result.commit_url), card_written=bool(result.card_written))


def _report_paths(check_reports: Any, tmp: Path, function: str) -> list[Path]:
    """The check reports as files: a path as it is, a CheckReport written into `tmp`; one report alone (not in a
    list) is one report, never its path's letters."""
    import json

    paths = []
    for i, r in enumerate(list_argument(check_reports, "check_reports", function)):
        if isinstance(r, CheckReport):
            path = tmp / f"check-{i}.json"
            path.write_text(json.dumps(r.to_dict()))
            paths.append(path)
        else:
            paths.append(path_argument(r, f"check_reports[{i}]", function))
    return paths


def model_card(folder: PathLike | ConversionResult | UptrainResult, repo_id: str, *,
               check_reports: Sequence[PathLike | CheckReport] = (), bench_report: PathLike | None = None,
               out: PathLike | None = None) -> str:
    """The model card `surgery.push` would upload for `folder`, without uploading anything: hub metadata
    (`base_model`, `datasets`, `model-index` from the check reports, ...) and the body, as one Markdown string.

    Args:
        folder: The converted (or uptrained) folder, validated as `push` validates it.
        repo_id: The hub repository the card names (`owner/name`); nothing is created.
        check_reports: Check reports for the card: `surgery check --json` files or `CheckReport`s.
        bench_report: A `surgery bench --json` report for the speed table.
        out: Also write the card to this file (written atomically; never inside `folder` unless asked).

    Returns:
        The card's text; `huggingface_hub.ModelCard(text)` parses it as the hub does.

    Raises:
        SurgeryError: a folder that does not validate, a bad repo id or report.
    """
    from ..checkpoint.atomic import write_text_atomic
    from ..commands.push import PushOptions
    from ..publish.card import build_card
    from ..publish.push import card_inputs

    repo_id = validate_options(PushOptions, {"repo_id": repo_id}).repo_id  # refused as `push` refuses it
    bench_report = path_argument(bench_report, "bench_report", "model_card", optional=True)
    out = path_argument(out, "out", "model_card", optional=True)
    with tempfile.TemporaryDirectory(prefix="surgery-reports-") as tmp:
        validation, reports, bench = card_inputs(Path(source_spec(folder)),
                                                 _report_paths(check_reports, Path(tmp), "model_card"), bench_report)
    card = build_card(validation, repo_id, reports, bench=bench)
    if out is not None:
        write_text_atomic(out, card, "model card")
    return card


def run_recipe(recipe: PathLike | Mapping[str, Any], *, output: PathLike | None = None, from_step: str | None = None,
               until: str | None = None, overrides: Sequence[str] = (), dry_run: bool = False
               ) -> RecipeResult | RecipePlan:
    """Run a recipe's steps in order, as `surgery run RECIPE` does: finished, unchanged steps are skipped; an
    interrupted uptraining resumes.

    Args:
        recipe: A YAML recipe file, or the recipe as a mapping (`{"source": {...}, "output": ..., "steps": [...]}`;
            its relative paths are then relative to the working folder).
        output: The output folder (default: the recipe's `output`).
        from_step: Re-run from this step (its name or number).
        until: Stop after this step.
        overrides: `KEY=VALUE` overrides, as `--set` takes them.
        dry_run: Run nothing and write nothing: return the plan `surgery run --dry-run` prints (each step's command,
            whether it runs or is skipped, its tokens, peak memory and output size, the texts it reads).

    Returns:
        The output folder and what happened to each step; with `dry_run`, the `RecipePlan`.

    Raises:
        SurgeryError: a recipe that does not validate, or a step's bad input (named by the step).
    """
    from ..recipes import load_recipe, recipe_from_data
    from ..recipes.runner import StepFailed, run_recipe as run

    overrides = list_argument(overrides, "overrides", "run_recipe")
    dry_run = flag_argument(dry_run, "dry_run", "run_recipe")
    output = path_argument(output, "output", "run_recipe", optional=True)
    from_step, until = _step_argument(from_step, "from_step"), _step_argument(until, "until")
    if isinstance(recipe, Mapping):
        r = recipe_from_data(dict(recipe), overrides)
    else:
        r = load_recipe(path_argument(recipe, "recipe", "run_recipe"), overrides=overrides)
    out = output if output is not None else Path(r.output)
    if dry_run:
        from ..recipes.plan import build_plan

        return RecipePlan(build_plan(r, out, from_step=from_step, until=until))
    try:
        steps = run(r, out, from_step=from_step, until=until, log=log.info)
    except StepFailed as e:
        from ..errors import SurgeryError

        error = SurgeryError(str(e))
        error.code = e.code
        raise error from None
    return RecipeResult(output=out, steps=steps)


def _step_argument(step: Any, name: str) -> str | None:
    """A recipe step named by its name or number (as --from and --until take it)."""
    from ..errors import SurgeryError

    if step is None:
        return None
    if isinstance(step, bool) or not isinstance(step, (str, int)):
        raise SurgeryError(f"run_recipe: {name} is a step's name or number, not {type(step).__name__}")
    return str(step)


def teacher(source: Source, out: PathLike, *, top_k: int = 32, device: str = "auto", processes: int = 1,
            revision: str | None = None, tokenizer: PreTrainedTokenizerBase | None = None, progress: bool = True, **options: Any) -> TeacherStore:
    """Store a teacher's top-K next-token log-probs on a run's training windows, as `surgery teacher SOURCE --out OUT`
    does, for `uptrain(..., teacher_logprobs=store.folder)`: distillation with no teacher model loaded. Several
    conversions of one source, trained with the same data options, share one store.

    Args:
        source: The teacher: a folder, a hub id, `"smollm2"`, a result or a loaded model (saved as `convert` does).
        out: The store's folder (written atomically).
        top_k: Teacher candidates stored per position (6K + 2 bytes per token).
        processes: The number of processes of the uptrain run the store is for (streamed data: each process streams
            its own windows, so the store takes them in that order; packed data has one order for any number).
        device: `auto` (CUDA when present), `cpu`, `cuda`, `cuda:N`.
        revision: Hub revision (branch, tag or commit) of a hub id.
        tokenizer: With a loaded model: its tokenizer.
        progress: Show the progress bar.
        **options: The data options of the `uptrain` run the store is for, by field name (`tokens=` is required;
            `data=`, `data_weights=`, `seq_len=`, `batch_tokens=`, `eval_tokens=`, `seed=`, `chat_template=`,
            `temperature=`, `precision=`, `force=`, ...): the store holds exactly the windows that run reads. `data`
            takes the same objects as `uptrain`'s. Options of training itself (`lr=`, `loss=`, ...) are refused.

    Returns:
        The store: its folder and manifest (`bytes_per_token`, `windows`, `tokens`, the teacher's identity).

    Raises:
        SurgeryError: bad input or options (the line the command line prints).
    """
    from ..commands.teacher import TEACHER_OPTIONS, TeacherArgs, UptrainArgs, store_teacher_pass
    from ..errors import SurgeryError

    progress = flag_argument(progress, "progress", "teacher")
    tokenizer_argument(tokenizer, source, "teacher")
    if revision is not None and not isinstance(revision, str):
        raise SurgeryError(f"teacher: revision is a branch, tag or commit (a str), not {type(revision).__name__}")
    values = dict(options)
    refuse_unknown(UptrainArgs, values)
    other = [k for k in values if k not in TEACHER_OPTIONS]
    if other:
        raise SurgeryError(f"teacher takes the run's data options only, not {other[0]!r}")
    _run_texts(values, UptrainArgs)
    parsed = validate_options(UptrainArgs, values)
    own = validate_options(TeacherArgs, {"top_k": top_k, "device": device, "processes": processes})
    out = _output_folder(out, "teacher", parsed.force)
    store_teacher_pass(source_spec(source, tokenizer, "teacher"), out, parsed, own.top_k, device=own.device,
                       progress=progress, revision=revision, processes=own.processes)
    return TeacherStore.read(Path(out))
