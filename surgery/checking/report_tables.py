"""The printed report of `surgery check`: the metrics table, then one table per part the report holds (texts,
documents, positions, layers, tasks, retrieval, continuations)."""

from __future__ import annotations

from . import documents
from . import retrieval_report
from . import tasks as task_runs
from .positions import print_table as print_position_table


def print_texts_table(texts: list[dict], console) -> None:
    """One row per text of a check on several texts (the first is the main table's)."""
    from rich.table import Table

    causal = all("kl" in t for t in texts)
    table = Table(title="by text")
    columns = ["max |Δ|"] + (["KL", "top-1", "ppl source", "ppl conv.", "ratio"] if causal else ["mean |Δ|"])
    table.add_column("text", overflow="fold", ratio=1)  # a long path wraps instead of being cut
    for col in columns:
        table.add_column(col, justify="right", no_wrap=True)
    for t in texts:
        cells = [t["text"], f"{t['max_abs_diff']:.3e}"]
        cells += ([f"{t['kl']:.4g}", f"{100 * t['top1_agreement']:.2f}%", f"{t['ppl_source']:.3f}",
                   f"{t['ppl_converted']:.3f}", f"{t['ppl_converted'] / t['ppl_source']:.3f}x"]
                  if causal else [f"{t['mean_abs_diff']:.3e}"])
        table.add_row(*cells)
    console.print(table)


def perplexity_label(report: dict) -> str:
    """Where a perplexity was measured, e.g. `pydoc[0:16384], windows 1024`."""
    return f"{report.get('text', '?')}, windows {report.get('seq_len', '?')}"


LOG_WIDTH = 240  # columns of the report printed to a file or a pipe (a log): no table cuts a value short


def report_console():
    """stdout's console: a terminal's own width where it is one; else (redirected to a file, piped: a log) one of
    LOG_WIDTH columns, where rich's default of 80 would cut a wide table's values ("11.0…")."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=LOG_WIDTH)


def print_report(report: dict, title: str = "") -> None:
    from rich.table import Table

    console = report_console()
    table = Table(title=title, show_header=True)
    table.add_column("metric", overflow="fold")
    table.add_column("value", justify="right", overflow="fold")  # a narrow terminal wraps a value, never cuts it
    rows = [
        ("compared", report.get("compared")),
        ("text", f"{report.get('text', '?')}: {report.get('tokens')} tokens"),
        ("window length", f"{report.get('seq_len')} tokens"),
        ("max |Δ|", f"{report['max_abs_diff']:.3e}"),
        ("mean |Δ|", f"{report['mean_abs_diff']:.3e}"),
    ]
    if "kl" in report:
        where = perplexity_label(report)
        rows += [
            ("KL(source‖converted) / token", f"{report['kl']:.4g}"),
            ("top-1 agreement", f"{100 * report['top1_agreement']:.2f}%"),
            (f"perplexity, source ({where})", f"{report['ppl_source']:.3f}"),
            (f"perplexity, converted ({where})", f"{report['ppl_converted']:.3f}"),
        ]
    if "generation" in report:
        g = report["generation"]
        rows += [
            (f"greedy token agreement ({g['prompts']} prompts)", f"{100 * g['token_agreement']:.2f}%"),
            ("mean first divergence (token)", f"{g['mean_first_divergence']:.1f} of {g['new_tokens']}"),
            ("exact-match continuations", f"{100 * g['exact_match_rate']:.1f}%"),
            ("forced agreement on the source's continuations", f"{100 * g['forced_agreement']:.2f}%"),
        ]
        rows += [(f"  where the source's margin is {b['margin'][0]:g}-{b['margin'][1]:g}",
                  f"{100 * b['agreement']:.1f}% of {b['steps']} steps")
                 for b in g["forced_by_margin"] if b["steps"]]
    if "exact" in report:
        rows.append(("exact (tolerance)", f"{'yes' if report['exact'] else 'no'} ({report['tolerance']:g})"))
    for name, value in rows:
        table.add_row(name, str(value))
    console.print(table)
    if report.get("texts"):
        print_texts_table(report["texts"], console)
    if report.get("documents", {}).get("mode") == "whole":
        documents.print_table(report["documents"], console)
    if report.get("by_position"):
        print_position_table(report["by_position"], console)
    if report.get("layers"):
        layers = Table(title=f"per-layer relative error vs the source (first {report.get('layers_tokens')} tokens)")
        for col in ("layer", "attention output", "hidden state"):
            layers.add_column(col, justify="right")
        for row in report["layers"]:
            layers.add_row(str(row["layer"]), f"{row['attention_rel_error']:.3e}", f"{row['hidden_rel_error']:.3e}")
        console.print(layers)
    if report.get("tasks"):
        limit = f", at most {report['tasks_limit']} examples each" if report.get("tasks_limit") else ""
        tasks = Table(title=f"lm-eval tasks{limit}")
        for col in ("task", "metric", "source", "converted"):
            tasks.add_column(col, justify="right")
        for task, metric, a, b in task_runs.rows(report["tasks"]):
            tasks.add_row(task, metric, f"{a:.4g}", f"{b:.4g}")
        console.print(tasks)
    if report.get("retrieval"):
        retrieval_report.print_table(report["retrieval"], console)
    if report.get("generation", {}).get("samples"):
        samples = Table(title="greedy continuations, side by side", show_lines=True)
        for col in ("prompt", "source", "converted"):
            samples.add_column(col, overflow="fold")
        for s in report["generation"]["samples"]:
            samples.add_row(f"[{s['origin']}] {s['prompt'][-200:]}", s["source"], s["converted"])
        console.print(samples)
