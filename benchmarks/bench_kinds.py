"""Every kind side by side: which conversion to pick, on SmolLM2-135M, measured on held-out text.

For the source and each conversion: KV-cache values per token (what transformers caches, and the latent + rope
key that vLLM / llama.cpp cache for MLA), attention MACs per token at 4k context (`surgery inspect`), zero-shot
perplexity on every `--eval` text, perplexity after the same `--kd-tokens` of uptraining, and forced agreement with
the source (`surgery check --generate`). Each step runs the `surgery` command a user would run and is cached in
WORK/NAME, so an interrupted run resumes and `--table` rebuilds the table and plot from what is there.

Uptraining is KD from the source for every conversion that starts away from it. Talking-heads starts exactly at
the source (identity mixing), where KD has nothing to learn: it and its control, the source itself (`source-lm`),
are trained with the LM loss on the same tokens — the paper's claim as a conversion: does trained head-mixing beat
the same continued training without it?

    python benchmarks/bench_kinds.py --work W --calib pydoc --calib "mrest/*.txt" --data pydoc \
        --data "mrest/*.txt" --eval pydoc --eval "lic/*.txt" --eval "deb/*.txt" --kinds mqa,mla64,switchhead
    python benchmarks/bench_kinds.py --work W --eval pydoc --eval "lic/*.txt" --eval "deb/*.txt" --table
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

# name -> (label, `surgery convert` arguments or None for the unconverted source, uptraining loss)
KINDS = {
    "source": ("source", None, None),
    "mqa": ("MQA, aligned merge (1 K/V head)", ["--to", "mqa", "--merge", "aligned", "--refit-values",
                                                "--query-samples", "512"], "kd"),
    "mla64": ("MLA R=64 D=64 (MQA's cache)", ["--to", "mla", "--kv-rank", "64", "--rope-dim", "64"], "kd"),
    "mla256": ("MLA R=256 D=64", ["--to", "mla", "--kv-rank", "256", "--rope-dim", "64"], "kd"),
    "switchhead": ("SwitchHead H3 E3 k2", ["--to", "switchhead", "--heads", "3", "--experts", "3", "--topk", "2"],
                   "kd"),
    "talking-heads": ("talking-heads (identity)", ["--to", "talking-heads"], "lm"),
    "source-lm": ("source, trained the same way (LM)", None, "lm"),
}
CUSTOM_CODE = {"switchhead", "talking-heads"}
CALIBRATED = {"mqa", "mla64", "mla256", "switchhead"}


def surgery(*args: str) -> None:
    print("$ surgery " + " ".join(args), flush=True)
    subprocess.run(["surgery", *args], check=True)


def converted(name: str, a, source: str) -> str:
    """The converted folder (the source's own for the source rows)."""
    _, convert_args, _ = KINDS[name]
    if convert_args is None:
        return source
    out = a.work / name / "converted"
    if not (out / "surgery.json").exists():
        calib = [x for c in a.calib for x in ("--calib", c)] if name in CALIBRATED else []
        tokens = ["--calib-tokens", str(a.calib_tokens)] if name in CALIBRATED else []
        surgery("convert", a.source, *convert_args, *calib, *tokens, "--out", str(out), "--force")
    return str(out)


def check(a, model: str, name: str, json_path: Path) -> None:
    if json_path.exists():
        return
    evals = [x for e in a.eval for x in ("--data", e)]
    trust = ["--trust-remote-code"] if name in CUSTOM_CODE else []
    surgery("check", a.source, model, *evals, "--tokens", str(a.eval_tokens), "--seq-len", str(a.seq_len),
            "--generate", str(a.generate), *trust, "--json", str(json_path))


def uptrained(name: str, a, model: str) -> str | None:
    loss = KINDS[name][2]
    if loss is None or a.kd_tokens == 0:
        return None
    out = a.work / name / f"uptrained-{a.kd_tokens}"
    if not (out / "surgery.json").exists():
        data = [x for d in a.data for x in ("--data", d)]
        teacher = ["--teacher", a.source] if name == "source-lm" else []
        trust = ["--trust-remote-code"] if name in CUSTOM_CODE else []
        surgery("uptrain", model, *data, "--tokens", str(a.kd_tokens), "--loss", loss, *teacher, *trust,
                "--seq-len", "256", "--batch-tokens", "512", "--micro-batch", "2", "--lr", "3e-4",
                "--eval-tokens", "4096", "--eval-every", "24", "--save-every", "0", "--out", str(out), "--force")
    return str(out)


def inspect(a, model: str, json_path: Path) -> dict:
    if not json_path.exists():
        done = subprocess.run(["surgery", "inspect", model, "--context", "4096", "--json"], check=True,
                              capture_output=True, text=True)
        json_path.write_text(done.stdout)
    stats = json.loads(json_path.read_text())
    return stats[0] if isinstance(stats, list) else stats


def run_kind(name: str, a, source: str) -> None:
    (a.work / name).mkdir(parents=True, exist_ok=True)
    model = converted(name, a, source)
    inspect(a, model, a.work / name / "inspect.json")
    if name not in ("source", "source-lm"):  # the source's own numbers are in every check's report
        check(a, model, name, a.work / name / "zero-shot.json")
    trained = uptrained(name, a, model)
    if trained:
        check(a, trained, name, a.work / name / f"uptrained-{a.kd_tokens}.json")


def texts(report: dict) -> list[dict]:
    return report["texts"] if "texts" in report else [report]


def table(a) -> list[dict]:
    """One row per kind measured so far: cache, MACs, and per text the zero-shot and uptrained ppl ratios."""
    rows = []
    for name in KINDS:
        folder = a.work / name
        if not (folder / "inspect.json").exists():
            continue
        stats = json.loads((folder / "inspect.json").read_text())
        stats = stats[0] if isinstance(stats, list) else stats
        row = {"name": name, "label": KINDS[name][0], "cache_values": stats["kv_cache_bytes_per_token"]
               // stats["dtype_bytes"],                "macs_4k": stats["attention_macs_per_token"]}
        for when in ("zero-shot", f"uptrained-{a.kd_tokens}"):
            path = folder / f"{when}.json"
            if path.exists():
                report = json.loads(path.read_text())
                row[when] = [{"text": t["text"], "ratio": t["ppl_converted"] / t["ppl_source"],
                              "ppl": t["ppl_converted"], "source_ppl": t["ppl_source"], "kl": t["kl"],
                              "top1": t["top1_agreement"]} for t in texts(report)]
                row[f"{when} forced"] = (report.get("generation") or {}).get("forced_agreement")
        rows.append(row)
    reports = [r["zero-shot"] for r in rows if r.get("zero-shot")]
    for row in rows:
        if row["name"] == "source" and reports:  # every check measured the source on the same windows
            row["zero-shot"] = [t | {"ppl": t["source_ppl"], "ratio": 1.0, "kl": 0.0, "top1": 1.0} for t in reports[0]]
    return rows


def short_name(text: str) -> str:
    """`pydoc[0:8192]` stays; `/path/lic/*.txt[0:8192]` becomes `lic/*.txt` (the folder names the domain)."""
    spec = text.rsplit("[", 1)[0]
    return spec if "/" not in spec else "/".join(spec.split("/")[-2:])


def print_table(rows: list[dict], a) -> None:
    after = f"uptrained-{a.kd_tokens}"
    names = [short_name(t["text"]) for r in rows for t in r.get("zero-shot", [])][: len(a.eval)]
    print(f"\n| kind | cache values / token | attention MACs / token @4k | " +
          " | ".join(f"{n}: zero-shot | {n}: after {a.kd_tokens}" for n in names) + " | forced agreement |")
    print("|" + "---|" * (4 + 2 * len(names)))
    for r in rows:
        cells = []
        for i in range(len(names)):
            for when in ("zero-shot", after):
                t = r.get(when, [None] * len(names))[i] if r.get(when) else None
                cells.append(f"{t['ppl']:.2f} ({t['ratio']:.2f}x)" if t else "–")
        forced = r.get(f"{after} forced", r.get("zero-shot forced"))
        cache = f"{r['cache_values']:,}"
        print(f"| {r['label']} | {cache} | {r['macs_4k'] / 1e6:.1f}M | " + " | ".join(cells) +
              f" | {f'{100 * forced:.1f}%' if forced is not None else '–'} |")


def plot(rows: list[dict], a, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    after = f"uptrained-{a.kd_tokens}"
    fig, axes = plt.subplots(1, len(a.eval), figsize=(5 * len(a.eval), 4), sharey=True, squeeze=False)
    for i, ax in enumerate(axes[0]):
        for r in rows:
            for when, marker in (("zero-shot", "o"), (after, "*")):
                if r.get(when):
                    ax.scatter(r["cache_values"], r[when][i]["ratio"], marker=marker, s=60)
                    ax.annotate(r["name"], (r["cache_values"], r[when][i]["ratio"]), fontsize=7)
        name = short_name(next((r["zero-shot"][i]["text"] for r in rows if r.get("zero-shot")), a.eval[i]))
        ax.set_title(f"{name}"), ax.set_xlabel("KV-cache values / token (transformers)")
        ax.axhline(1.0, color="grey", lw=0.5)
    axes[0][0].set_ylabel(f"perplexity / source's (o zero-shot, * after {a.kd_tokens} tokens)")
    fig.suptitle("SmolLM2-135M: every kind, held-out texts")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default="smollm2")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated, from: " + ", ".join(KINDS))
    p.add_argument("--calib", action="append", help="convert --calib, repeatable (default: the command's)")
    p.add_argument("--calib-tokens", type=int, default=65536)
    p.add_argument("--data", action="append", help="uptrain --data, repeatable (default: the command's)")
    p.add_argument("--eval", action="append", help="held-out texts, repeatable (check --data)")
    p.add_argument("--eval-tokens", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--generate", type=int, default=32)
    p.add_argument("--kd-tokens", type=int, default=49152)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--table", action="store_true", help="only rebuild the table and plot from WORK")
    a = p.parse_args()
    a.calib, a.data, a.eval = a.calib or [], a.data or [], a.eval or ["pydoc"]
    unknown = [k for k in a.kinds.split(",") if k not in KINDS]
    if unknown:
        sys.exit(f"unknown kinds {unknown}; choose from {', '.join(KINDS)}")
    if not a.table:
        from surgery.checkpoint.source import resolve_source

        source = str(resolve_source(a.source).folder)
        for name in a.kinds.split(","):
            run_kind(name, a, source)
    rows = table(a)
    print_table(rows, a)
    plot(rows, a, a.work / "kinds.png")
    (a.work / "kinds.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
