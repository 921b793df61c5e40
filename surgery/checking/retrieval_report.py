"""The report of `check --retrieval` (scored in surgery/checking/retrieval.py): accuracy per task and length for
both models, with the counts behind it and a 95% Wilson score interval for each cell (`wilson`), printed as a table,
written in --json (`retrieval`) and drawn by --plot; and the hits by needle depth (`by_depth`, thirds of the
haystack) under it, which show where a converted model loses its needles; and the answers' log-probability gap,
converted minus source over the same examples with a 95% Student t interval (`paired_gap`), which tells a converted
model from its source where the hits are too few to tell them apart (a weak source at long context, a short run).

The interval's trials are the cell's examples (n = --retrieval-samples per task and length; the mean row pools the
tasks' examples). A single-item task's example is a hit or a miss; a multi-item example (variable_tracking's five
variables, common_words' ten words) counts the share of its items it retrieved as a fractional hit. The items of
one example are not independent trials (one missed chain loses every later variable), so counting them as trials
would make the interval too narrow; a fractional hit in [0, 1] varies less than a hit or a miss of the same mean,
so the examples' Wilson interval is, if anything, conservative for those tasks.
"""

from __future__ import annotations

import math

from .retrieval_spec import EXTRA_TOKENS, METRICS

MODELS = ("source", "converted")
DEPTH_BINS = 3  # needle depth in thirds of the haystack: 0 is its start, the farthest from the question
SCORING = {"exact": "teacher-forced greedy exact match per answer item (every token the argmax), one forward pass",
           "string": "RULER's string_match_all: an item's text anywhere in the greedy continuation of the answer's "
                     f"length + {EXTRA_TOKENS} tokens; exact_hits_*: the teacher-forced exact match of the same "
                     "examples"}
GAP = ("the answers' mean log-probability per token, converted minus source, example by example (both models score the "
       "same examples), averaged over the cell with its 95% Student t interval: more sensitive than the hits where "
       "few examples or a weak source leave the counts small")
# Student's t two-sided 95% quantiles for 1..30 degrees of freedom; beyond, the Cornish-Fisher expansion (error < 1e-4)
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
INTERVAL = ("95% Wilson score interval; trials: the cell's examples (a multi-item example counts the share of its "
            "items it retrieved as a fractional hit, which keeps the interval conservative)")


def wilson(hits: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval (lower, upper) of a proportion: `hits` successes in `n` trials, `z` the normal
    quantile (1.96: 95%). Unlike p +- z*sqrt(p(1-p)/n) it stays inside [0, 1] and is not empty at 0 or n hits."""
    if n < 1:
        raise ValueError(f"a Wilson interval needs at least one trial, got n={n}")
    if not -1e-9 <= hits <= n + 1e-9:  # fractional hits (sums of shares) may stray by a rounding
        raise ValueError(f"hits must lie in [0, n], got {hits} of {n}")
    p, z2 = min(1.0, max(0.0, hits / n)), z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def t975(dof: int) -> float:
    """Student's t two-sided 95% quantile for `dof` degrees of freedom (at least 1)."""
    if dof < 1:
        raise ValueError(f"a t quantile needs at least one degree of freedom, got {dof}")
    if dof <= len(T975):
        return T975[dof - 1]
    z = 1.959964
    return (z + (z ** 3 + z) / (4 * dof) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * dof ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * dof ** 3))


def unpaired(source: list[dict], converted: list[dict]) -> str | None:
    """Why two lists of score rows are not the same examples in the same order (task, length, needle depth), or
    None where they are."""
    if len(source) != len(converted):
        return f"paired rows differ in number: {len(source)} source, {len(converted)} converted"
    for s, c in zip(source, converted):
        if (s["task"], s["length"], s["depth"]) != (c["task"], c["length"], c["depth"]):
            return (f"rows do not pair: {s['task']}@{s['length']} depth {s['depth']} against "
                    f"{c['task']}@{c['length']} depth {c['depth']}")
    return None


def paired_gap(source: list[dict], converted: list[dict]) -> tuple[float, float, float] | None:
    """The mean of converted minus source answer log-probability over the same examples, and its 95% t interval
    (mean, low, high); None for fewer than two examples. Rows pair by position and must be the same examples."""
    if why := unpaired(source, converted):
        raise ValueError(why)
    if len(source) < 2:
        return None
    d = [c["logprob"] - s["logprob"] for s, c in zip(source, converted)]
    mean = sum(d) / len(d)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1))
    half = t975(len(d) - 1) * sd / math.sqrt(len(d))
    return mean, mean - half, mean + half


def _cell(rows: dict[str, list[dict]]) -> dict:
    """One cell's accuracy, counts, interval and mean answer log-probability for both models."""
    n = len(rows["source"])
    cell: dict = {"n": n, "items": sum(r.get("items", 1) for r in rows["source"])}
    for model in MODELS:
        hits = sum(r["score"] for r in rows[model])
        low, high = wilson(hits, n)
        cell |= {model: hits / n, f"hits_{model}": round(hits, 6), f"ci_low_{model}": low, f"ci_high_{model}": high,
                 f"items_{model}": round(sum(r["score"] * r.get("items", 1) for r in rows[model])),
                 f"logprob_{model}": sum(r["logprob"] for r in rows[model]) / n}
        if rows[model] and all("exact" in r for r in rows[model]):  # scored by string match: the exact hits beside
            cell[f"exact_hits_{model}"] = round(sum(r["exact"] for r in rows[model]), 6)
    gap = (None if unpaired(rows["source"], rows["converted"])  # rows from elsewhere: no gap, no error
           else paired_gap(rows["source"], rows["converted"]))
    if gap:
        cell |= dict(zip(("logprob_gap", "logprob_gap_low", "logprob_gap_high"), gap))
    return cell


def compare_retrieval_scores(plan, source: list[dict], converted: list[dict]) -> dict:
    """Accuracy per task and length for both models (with counts and intervals), and the mean over tasks per
    length (the tasks' examples pooled)."""
    def cell(task, n):
        pick = lambda rows: [r for r in rows if r["length"] == n and (task is None or r["task"] == task)]
        return _cell({"source": pick(source), "converted": pick(converted)})

    report = {"tasks": plan.tasks, "lengths": plan.lengths, "samples": plan.samples, "haystack": plan.haystack,
              **plan.about,
              "accuracy": {task: {str(n): cell(task, n) for n in plan.lengths} for task in plan.tasks},
              "mean": {str(n): cell(None, n) for n in plan.lengths},
              "by_depth": {task: {str(n): by_depth(task, n, source, converted) for n in plan.lengths}
                           for task in plan.tasks},
              "interval": INTERVAL, "logprob_gap": GAP, "metric": plan.metric, "scoring": SCORING[plan.metric]}
    if plan.window:
        report |= {"window": plan.window, "lengths_in_windows": [round(n / plan.window, 3) for n in plan.lengths]}
    return report


def by_depth(task: str, n: int, source: list[dict], converted: list[dict]) -> list[dict]:
    """One task and length's hits per third of needle depth (the needle's place in the haystack: 0 at its start, the
    farthest from the question), for both models: where a converted model loses its needles."""
    def pick(rows, b):
        return [r for r in rows if r["task"] == task and r["length"] == n
                and min(DEPTH_BINS - 1, int(r["depth"] * DEPTH_BINS)) == b]
    bins = []
    for b in range(DEPTH_BINS):
        rows = {"source": pick(source, b), "converted": pick(converted, b)}
        bins.append({"depth": [round(b / DEPTH_BINS, 4), round((b + 1) / DEPTH_BINS, 4)], "n": len(rows["source"])}
                    | {f"hits_{m}": round(sum(r["score"] for r in rows[m]), 6) for m in MODELS})
    return bins


def _percent(x: float) -> str:
    return f"{100 * x:.0f}"


def cell_text(cell: dict) -> str:
    """'85% [64-95] / 40% [22-61]': source and converted accuracy, each with its 95% interval."""
    return " / ".join(f"{_percent(cell[m])}% [{_percent(cell[f'ci_low_{m}'])}-{_percent(cell[f'ci_high_{m}'])}]"
                      for m in MODELS)


def exact_text(cell: dict) -> str:
    """A string-matched cell's teacher-forced exact hits, source / converted: '17/20 / 12/20'."""
    return " / ".join(f"{cell[f'exact_hits_{m}']:g}/{cell['n']}" for m in MODELS)


def gap_text(cell: dict) -> str:
    """The paired answer log-probability gap, converted minus source, with its interval: '-0.46 [-0.58, -0.34]'."""
    return f"{cell['logprob_gap']:+.2f} [{cell['logprob_gap_low']:+.2f}, {cell['logprob_gap_high']:+.2f}]"


def metric_name(report: dict) -> str:
    """What scored the report's hits, in words (a report written before --retrieval-metric: the exact match)."""
    return METRICS[report.get("metric", "exact")]


def length_label(report: dict, n: int, sep: str = " ") -> str:
    """A length as tokens, and as a multiple of the window where the lengths were given in it: '2048 (4w)'."""
    if not report.get("window"):
        return str(n)
    return f"{n}{sep}({n / report['window']:g}w)"


def print_table(report: dict, console) -> None:
    from rich.table import Table

    window = f", w = {report['window']} tokens" if report.get("window") else ""
    text = f" {report['haystack_text']}" if report.get("haystack_text") else ""
    table = Table(title=f"retrieval accuracy by length (tokens{window}), {metric_name(report)}, source / converted with 95% Wilson "
                        f"intervals ({report['samples']} examples per task and length, {report['haystack']}{text} "
                        "haystack)")
    table.add_column("task", overflow="fold")
    for n in report["lengths"]:
        table.add_column(length_label(report, n, "\n"), justify="right", overflow="fold")
    rows = [(t, report["accuracy"][t]) for t in report["tasks"]] + [("mean", report["mean"])]
    for name, cells in rows:
        table.add_row(name, *(cell_text(cells[str(n)]) for n in report["lengths"]))
        if all("exact_hits_source" in cells[str(n)] for n in report["lengths"]):
            table.add_row(f"  {name}, exact hits", *(exact_text(cells[str(n)]) for n in report["lengths"]))
        if all("logprob_gap" in cells[str(n)] for n in report["lengths"]):
            table.add_row(f"  {name}, answers' log-prob, converted - source (paired, 95% t)",
                          *(gap_text(cells[str(n)]) for n in report["lengths"]))
    console.print(table)
    if report.get("by_depth"):
        print_depth_table(report, console)


def print_depth_table(report: dict, console) -> None:
    """Hits by needle depth, source / converted, one row per task and length."""
    from rich.table import Table

    table = Table(title="retrieval hits by needle depth (share of the haystack before the needle; 0: its start, the "
                        "farthest from the question), source / converted")
    table.add_column("task @ length", overflow="fold")
    for b in range(DEPTH_BINS):
        table.add_column(f"{100 * b // DEPTH_BINS}-{100 * (b + 1) // DEPTH_BINS}%", justify="right")
    for task, cells in report["by_depth"].items():
        for n, bins in cells.items():
            table.add_row(f"{task} @ {length_label(report, int(n))}",
                          *(f"{c['hits_source']:g}/{c['n']} / {c['hits_converted']:g}/{c['n']}" for c in bins))
    console.print(table)


def plot(report: dict, title: str = "") -> bytes:
    """Accuracy against length, one panel per task and one for the mean, source solid and converted dashed, each
    with its 95% interval shaded: PNG bytes."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = report["tasks"] + ["mean"]
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False, sharey=True)
    lengths = report["lengths"]
    ticks = [(f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)) +
             (f"\n{n / report['window']:g}w" if report.get("window") else "") for n in lengths]
    for ax, task in zip(axes.flat, panels):
        cells = report["mean"] if task == "mean" else report["accuracy"][task]
        for model, style, color in (("source", "-", "C0"), ("converted", "--", "C3")):
            ax.fill_between(lengths, [100 * cells[str(n)][f"ci_low_{model}"] for n in lengths],
                            [100 * cells[str(n)][f"ci_high_{model}"] for n in lengths], color=color, alpha=0.15,
                            linewidth=0)
            ax.plot(lengths, [100 * cells[str(n)][model] for n in lengths], style, color=color, marker="o",
                    markersize=3, label=model)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, ticks, fontsize=7)
        ax.set_ylim(-5, 105)
        ax.set_title(task, fontsize=9)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    axes[0][0].set_ylabel("accuracy (%)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title or "retrieval accuracy by context length", fontsize=10)
    fig.supxlabel(f"context length (tokens; {metric_name(report)}; shaded: 95% Wilson interval, {report['samples']} examples per "
                  "task)", fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()
