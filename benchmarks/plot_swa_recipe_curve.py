"""Draw the `swa` retrieval recipe's 8 W needles against KD tokens from its results JSON (60 examples a cell):
hits with 95% Wilson intervals against the source's, the hits by needle depth (thirds of the haystack), and RULER's
string match where the JSON has it (`string_match_sixty_a_cell`). More
than one JSON draws one curve each (their `label`; the source's line from the first), the figure beside the last.

    python benchmarks/plot_swa_recipe_curve.py benchmarks/results/swa-retrieval-recipe-224k-smollm2-2026-11-30.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from surgery.checking.retrieval_report import wilson  # noqa: E402


def main(paths: list[Path]) -> Path:
    runs = [json.loads(p.read_text()) for p in paths]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, cell, title in ((axes[0], "niah_single@2048", "single needle @ 8 W"),
                            (axes[1], "niah_multikey@2048", "4-key needles @ 8 W")):
        src = runs[0]["sixty_a_cell"]["source"][cell]
        ax.axhspan(*(100 * x for x in wilson(src["hits"], src["n"])), color="C0", alpha=0.12, linewidth=0)
        ax.axhline(100 * src["hits"] / src["n"], color="C0", label=f"source {src['hits']:g}/{src['n']}")
        ticks = set()
        for i, run in enumerate(runs):
            data = run["sixty_a_cell"]
            steps = [k for k in data if k != "source" and cell in data[k]]
            tokens = [int(k.rstrip("k")) for k in steps]
            ticks.update(tokens)
            hits = [data[k][cell]["hits"] for k in steps]
            n = data[steps[0]][cell]["n"]
            bounds = [wilson(h, n) for h in hits]
            color = ("C3", "C1", "C4")[i % 3]
            ax.fill_between(tokens, [100 * lo for lo, _ in bounds], [100 * hi for _, hi in bounds], color=color,
                            alpha=0.15, linewidth=0)
            label = run.get("label", "swa W 256, 8 global")
            ax.plot(tokens, [100 * h / n for h in hits], "o--", color=color, label=label)
            far = [data[k][cell]["by_depth_thirds"][0] for k in steps]
            ax.plot(tokens, [100 * f / (n / 3) for f in far], "s:", color=color, markersize=3, alpha=0.7,
                    label=f"{label}: needle in the first third")
            string = run.get("string_match_sixty_a_cell", {})  # RULER's string match, where it was scored
            steps = [k for k in string if k != "source" and cell in string[k]]
            if steps:
                ax.plot([int(k.rstrip("k")) for k in steps], [100 * string[k][cell]["hits"] / n for k in steps], "^-",
                        color=color, label=f"{label}: RULER's string match")
        ax.set_xticks(sorted(ticks), [f"{t}k" for t in sorted(ticks)])
        ax.set_ylim(0, 105)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="lower right")
    axes[0].set_ylabel("hits (%)")
    fig.supxlabel(f"KD tokens (Vim's user manual, held out, {src['n']} examples a cell; shaded: 95% Wilson)",
                  fontsize=8)
    fig.tight_layout()
    out = paths[-1].with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    print(main([Path(a) for a in sys.argv[1:]]))
