"""A bench report for people: the ratio table in the terminal (rich), as Markdown (model card, BENCHMARKS.md), and
the plot of tokens/s against context (--plot, its path checked before the measurements)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..checkpoint.atomic import check_output_file, temp_prefix
from ..errors import SurgeryError
from ..units import human_bytes

def _cell(key: str, stats: dict) -> str:
    med = stats["median"]
    if med is None:
        return "-"
    if key.endswith("bytes"):
        return human_bytes(med)
    spread = f" ±{50 * stats['spread']:.0f}%" if stats["spread"] else ""
    if key == "decode_step_s":
        return f"{1000 * med:.1f} ms{spread}"
    return f"{med:,.1f}{spread}"


TABLE_COLUMNS = (("prefill_tokens_per_s", "prefill tok/s"), ("decode_tokens_per_s", "decode tok/s"),
                 ("decode_step_s", "decode step"), ("kv_cache_bytes", "KV cache"), ("peak_memory_bytes", "peak mem"))


def print_bench(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    m = report["machine"]
    title = (f"{report['models']['converted']['spec']} vs {report['models']['source']['spec']} — {report['engine']}, "
             f"{report['dtype']}, {m['device']}, {m['threads']} threads, {report['rounds']} rounds, "
             f"{report['new_tokens']} new tokens"
             + (f", flash attention {report['flash_attn']}" if report.get("flash_attn") else ""))
    table = Table(title=title, caption="median (± half the min-max spread); ratio = converted / source "
                  "(tokens/s: > 1 is faster; time and bytes: < 1 is better)")
    table.add_column("batch", justify="right")
    table.add_column("context", justify="right")
    table.add_column("model")
    for _, name in TABLE_COLUMNS:
        table.add_column(name, justify="right")
    for row in report["results"]:
        for role in ("source", "converted"):
            table.add_row(str(row["batch"]), str(row["context"]), role,
                          *[_cell(key, row[role][key]) for key, _ in TABLE_COLUMNS])
        table.add_row("", "", "[bold]ratio[/bold]",
                      *[f"[bold]{row['ratio'][key]:.3f}x[/bold]" if row["ratio"][key] is not None else "-"
                        for key, _ in TABLE_COLUMNS], end_section=True)
    Console().print(table)


def markdown_table(report: dict) -> list[str]:
    """The ratio table as Markdown (for the model card and BENCHMARKS.md)."""
    lines = ["| batch | context | prefill tok/s (src → conv) | decode tok/s (src → conv) | decode speed-up "
             "| KV cache | peak memory |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for row in report["results"]:
        s, c, r = row["source"], row["converted"], row["ratio"]

        def pair(key, fmt=",.0f"):
            a, b = s[key]["median"], c[key]["median"]
            return "-" if a is None or b is None else f"{a:{fmt}} → {b:{fmt}}"

        def ratio(key):
            return "-" if r[key] is None else f"{r[key]:.2f}x"

        lines.append(f"| {row['batch']} | {row['context']} | {pair('prefill_tokens_per_s')} "
                     f"({ratio('prefill_tokens_per_s')}) | {pair('decode_tokens_per_s', ',.1f')} | "
                     f"{ratio('decode_tokens_per_s')} | {ratio('kv_cache_bytes')} | {ratio('peak_memory_bytes')} |")
    return lines


def plot_bench(report: dict, path: Path) -> None:
    """Tokens/s against context, one panel for prefill and one for decode, a line per model and batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "prefill_tokens_per_s", "prefill"), (axes[1], "decode_tokens_per_s", "decode")):
        for batch in report["batches"]:
            rows = sorted((r for r in report["results"] if r["batch"] == batch), key=lambda r: r["context"])
            for role, style in (("source", "o-"), ("converted", "s--")):
                xs = [r["context"] for r in rows if r[role][key]["median"] is not None]
                ys = [r[role][key]["median"] for r in rows if r[role][key]["median"] is not None]
                ax.plot(xs, ys, style, label=f"{role}, batch {batch}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("tokens / s")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{report['models']['converted']['spec']} vs {report['models']['source']['spec']} "
                 f"({report['engine']}, {report['machine']['device']})", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path, "tmp"), suffix=path.suffix, dir=path.absolute().parent)
    os.close(fd)
    try:  # written beside, then renamed: never half a picture
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
        plt.close(fig)


def check_plot_path(path: Path | None) -> None:
    """--plot can be written, in a format matplotlib knows, checked before the measurements."""
    if path is None:
        return
    check_output_file(path, "--plot")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    formats = Figure().canvas.get_supported_filetypes()
    if Path(path).suffix.lstrip(".").lower() not in formats:
        raise SurgeryError(f"--plot {path}: name a picture file ({', '.join('.' + f for f in sorted(formats))})")
