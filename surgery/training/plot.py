"""PNG plots of uptraining runs: training loss and held-out perplexity against training tokens."""

from __future__ import annotations

from pathlib import Path


def plot_runs(runs: dict[str, list[dict]], out: Path, references: dict[str, float] | None = None,
              title: str = "uptraining") -> Path:
    """One or several runs' metrics (label -> metrics.jsonl lines); `references` draws perplexities as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_ppl) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, metrics in runs.items():
        train = [m for m in metrics if "loss" in m]
        evals = [m for m in metrics if "eval_ppl" in m]
        if train:
            ax_loss.plot([m["tokens"] for m in train], [m["loss"] for m in train], label=label)
        if evals:
            line, = ax_ppl.plot([m["tokens"] for m in evals], [m["eval_ppl"] for m in evals], marker="o", label=label)
            other = [m for m in evals if "other_eval_ppl" in m]
            if other:  # --eval-data: the second held-out text, dashed in the same colour
                ax_ppl.plot([m["tokens"] for m in other], [m["other_eval_ppl"] for m in other], marker="s",
                            linestyle="--", color=line.get_color(), label=f"{label}, --eval-data")
    for i, (label, ppl) in enumerate((references or {}).items()):
        ax_ppl.axhline(ppl, linestyle="--", color=f"C{len(runs) + i}", label=f"{label} ({ppl:.3g})")
    ax_loss.set(xlabel="training tokens", ylabel="training loss", title="training loss (each run's objective)")
    ax_ppl.set(xlabel="training tokens", ylabel="held-out perplexity", title="held-out perplexity", yscale="log")
    for ax in (ax_loss, ax_ppl):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)


def plot_metrics(metrics: list[dict], out: Path, title: str = "uptraining") -> Path:
    """The plot of one run; the teacher's perplexity, when measured, as a reference line."""
    first = next((m for m in metrics if "teacher_eval_ppl" in m), {})
    refs = {name: first[key] for name, key in (("teacher", "teacher_eval_ppl"),
                                                ("teacher, --eval-data", "teacher_other_eval_ppl")) if first.get(key)}
    return plot_runs({"student": metrics}, out, refs or None, title=title)
