"""Draw issue 52's 8k confirmation against KD tokens: `swa` at a window of 1,024 (nine global layers) judged at 4 W
and 8 W with 20 needles a cell, one retrieval example a training window against eight. Top row: hits with 95% Wilson
intervals against the source's; bottom row: the answers' log-probability minus the source's over the same needles
(nats per answer token, 95% t). Reads the results JSONs of the runs (every cell's `hits`, `n` and
`logprob_minus_source`, keyed by run name) and writes the figure beside the last.

    python benchmarks/plot_swa_8k_curve.py benchmarks/results/swa-w1024-8k-20-a-cell-smollm2-2026-12-01.json \
        benchmarks/results/swa-w1024-8k-8-questions-smollm2-2026-12-01.json \
        benchmarks/results/swa-w1024-8k-250k-smollm2-2026-12-01.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from surgery.checking.retrieval_report import wilson  # noqa: E402

# run name in the JSONs -> (KD tokens in thousands, retrieval examples a training window); zero-shot starts both lines
RUNS = {"zero_shot_auto9": (0, None), "kd_131k": (131, 1), "kd_163k": (163, 1), "kd_131k_8q": (131, 8),
        "kd_250k_8q": (246, 8)}
CELLS = (("niah_single@4096", "single needle @ 4 W (4,096)"), ("niah_single@8192", "single needle @ 8 W (8,192)"),
         ("niah_multikey@8192", "4-key needles @ 8 W (8,192)"))


def main(paths: list[Path]) -> Path:
    cells: dict[str, dict] = {}
    for p in paths:
        for cell, runs in json.loads(p.read_text())["cells"].items():
            cells.setdefault(cell, {}).update(runs)
    fig, axes = plt.subplots(2, len(CELLS), figsize=(11, 5.4), sharex=True)
    for col, (cell, title) in enumerate(CELLS):
        runs = cells.get(cell, {})
        top, bottom = axes[0][col], axes[1][col]
        if "source" in runs:
            src = runs["source"]
            top.axhspan(*(100 * x for x in wilson(src["hits"], src["n"])), color="C0", alpha=0.12, linewidth=0)
            top.axhline(100 * src["hits"] / src["n"], color="C0", label=f"source {src['hits']:g}/{src['n']}")
        bottom.axhline(0, color="C0", linewidth=1)
        for k, color, marker in ((1, "C1", "o"), (8, "C3", "s")):
            names = [n for n, (_, q) in RUNS.items() if n in runs and q in (None, k)]
            if not any(RUNS[n][1] == k for n in names):
                continue
            tokens = [RUNS[n][0] for n in names]
            hits = [runs[n]["hits"] / runs[n]["n"] for n in names]
            bounds = [wilson(runs[n]["hits"], runs[n]["n"]) for n in names]
            label = f"{k} example{'s' if k > 1 else ''} a window"
            top.errorbar(tokens, [100 * h for h in hits], yerr=[[100 * (h - lo) for h, (lo, _) in zip(hits, bounds)],
                         [100 * (hi - h) for h, (_, hi) in zip(hits, bounds)]], fmt=marker + "--", color=color,
                         capsize=3, markersize=4, label=label)
            gaps = [runs[n]["logprob_minus_source"] for n in names]
            bottom.errorbar(tokens, [g[0] for g in gaps], yerr=[[g[0] - g[1][0] for g in gaps],
                            [g[1][1] - g[0] for g in gaps]], fmt=marker + "--", color=color, capsize=3,
                            markersize=4, label=label)
        top.set_ylim(0, 100)
        top.set_title(title, fontsize=9)
        top.grid(alpha=0.3)
        bottom.grid(alpha=0.3)
        top.legend(fontsize=6, loc="upper left")
        ticks = sorted({t for t, _ in RUNS.values()})
        bottom.set_xticks(ticks, [f"{t}k" if t else "0" for t in ticks], fontsize=7, rotation=45)
    axes[0][0].set_ylabel("hits (%), 95% Wilson")
    axes[1][0].set_ylabel("answers' log-prob - source's\n(nats/token, 95% t)")
    fig.supxlabel("KD tokens at 8,192 a window (SmolLM2-135M -> swa W 1,024, nine global layers; needles in Vim's "
                  "user manual, held out, 20 a cell)", fontsize=8)
    fig.tight_layout()
    out = paths[-1].with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    print(main([Path(a) for a in sys.argv[1:]]))
