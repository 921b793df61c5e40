"""Recovery by uptraining: SmolLM2-135M converted several ways, each trained with the same recipe and tokens.

Held-out perplexity (pydoc text, whole documents the training never sees; the calibration of `aligned` and
`switchhead` reads the last documents, which the held-out split never contains) against training tokens, for
each RUN = CONVERSION:LOSS, plotted next to the source's perplexity on the same windows (a KD run measures its
teacher, the source, at the start) and each conversion's perplexity before training. Every run uses the same
data, order, batch, optimizer and schedule; only the conversion and the loss differ.

Conversions: mean (MQA, mean pooling: the GQA paper's), aligned (MQA, `--merge aligned`), switchhead (H=3
heads, E=3 experts, k=2: the same K/V-cache size as the source's 3 K/V heads), and `source`: the source itself,
unconverted, trained the same way (its own teacher for kd/mix) — the control for LM and mix losses, which also
fit the training text's domain (the held-out documents share it), so that a conversion's perplexity after them is
compared with what the same training does to the source, not only with the source as it was.

    python benchmarks/bench_uptrain_recovery.py --tokens 200000                       # mean:lm,mean:kd
    python benchmarks/bench_uptrain_recovery.py --runs aligned:kd,switchhead:kd,mean:kd,mean:lm --tokens 32768
    python benchmarks/bench_uptrain_recovery.py --runs aligned:kd --converted aligned=DIR --tokens 49152
    python benchmarks/bench_uptrain_recovery.py --runs aligned:mix,source:mix --converted aligned=DIR --tokens 49152
    python benchmarks/bench_uptrain_recovery.py --runs switchhead:kd --stage align,kd --align-tokens 8192 \
        --align-epochs 4 --align-lr 1e-3 --tokens 49152          # layer-local alignment first, then KD

With `--stage align,kd` the align stage reads the first `--align-tokens` of the same training windows and KD the
windows after them (the tokens seen stay equal); its held-out perplexity is measured at the stage's end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

LABELS = {"source": "source (unconverted)", "mean": "MQA (mean pooling)", "aligned": "MQA (aligned merge)", "switchhead": "SwitchHead H=3 E=3 k=2"}


def convert(kind: str, src, out: Path) -> None:
    """Convert the source once per kind (kept between invocations of the benchmark)."""
    if (out / "surgery.json").exists():
        return
    if kind == "mean":
        from surgery.kv.convert import convert_to_kv_heads
        from surgery.kv.options import MQAOptions

        convert_to_kv_heads(src, out, MQAOptions(force=True), progress=False)
    elif kind == "aligned":
        from surgery.kv.aligned import convert_aligned
        from surgery.kv.options import MQAOptions

        convert_aligned(src, out, MQAOptions(merge="aligned", calib=["pydoc"], force=True), progress=False)
    elif kind == "switchhead":
        from surgery.switchhead import convert_to_switchhead
        from surgery.switchhead.options import SwitchHeadOptions

        convert_to_switchhead(src, out, SwitchHeadOptions(heads=3, experts=3, topk=2, calib=["pydoc"], force=True),
                              progress=False)
    else:
        sys.exit(f"unknown conversion {kind!r}; choose from {', '.join(LABELS)}")


def source_ppl_of(records: dict, kinds: dict, key: str) -> float | None:
    """The source's perplexity on a held-out text (`key`: eval_ppl, or other_eval_ppl for --eval-data): measured as
    the teacher of a KD or mix run, else at the start of a `source` run."""
    return next((r[f"teacher_{key}"] for r in records.values() if r.get(f"teacher_{key}")), None) or next(
        (records[label].get(f"initial_{key}") for label, (kind, _) in kinds.items() if kind == "source"), None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", default="smollm2")
    p.add_argument("--runs", default="mean:lm,mean:kd", help="comma-separated CONVERSION:LOSS pairs")
    p.add_argument("--tokens", type=int, default=200_000, help="training tokens per run")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-tokens", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--stage", default="kd", choices=("kd", "align", "align,kd"),
                   help="uptrain --stage: kd (end to end, by LOSS), align (layer-local), or align then kd")
    p.add_argument("--align-tokens", type=int, help="[align,kd] the align stage's share of --tokens "
                   "(default: a quarter)")
    p.add_argument("--align-epochs", type=int, default=4)
    p.add_argument("--align-lr", type=float, default=1e-3)
    p.add_argument("--hidden-weight", type=float, default=0.0,
                   help="uptrain --hidden-weight: weight of every layer's hidden-state cosine distance to the source's")
    p.add_argument("--kd-divergence", default="forward", choices=("forward", "reverse", "jsd"),
                   help="uptrain --kd-divergence: forward KL, reverse KL or Jensen-Shannon to the source's logits")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="uptrain --temperature: both models' logits divided by T in the KD term (scaled by T^2)")
    p.add_argument("--kd-weight", type=float, default=0.5,
                   help="uptrain --kd-weight: [LOSS mix] weight of the KD term, the LM term gets the rest")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="uptrain --min-lr-ratio: the cosine's floor")
    p.add_argument("--teacher", help="uptrain --teacher: the KD teacher (default: the source named in the converted "
                   "folder's surgery.json; give it when training a folder without one, e.g. the source itself)")
    p.add_argument("--train", default="all", choices=("all", "attention", "new"),
                   help="uptrain --train: every parameter, the attention blocks only, or the conversion's new ones")
    p.add_argument("--eval-data", help="uptrain --eval-data: a second held-out text (another domain than pydoc), "
                   "measured beside pydoc's held-out documents at every evaluation")
    p.add_argument("--evals", type=int, default=4, help="evaluations spread over the run (besides the one at 0)")
    p.add_argument("--work", type=Path, default=Path("/tmp/surgery-bench-uptrain-recovery"))
    p.add_argument("--plot", type=Path, help="PNG path (default WORK/recovery.png)")
    p.add_argument("--converted", action="append", default=[], metavar="KIND=DIR",
                   help="train this converted folder for KIND instead of converting with the defaults (e.g. "
                        "aligned=DIR written with --calib-tokens 65536 --refit-values); repeatable")
    a = p.parse_args()
    given = dict(c.split("=", 1) for c in a.converted if "=" in c)
    if len(given) != len(a.converted):
        sys.exit("--converted takes KIND=DIR")

    from surgery.checkpoint.source import resolve_source
    from surgery.training import UptrainOptions, uptrain
    from surgery.training.metrics import read_metrics
    from surgery.training.plot import plot_runs

    runs = [tuple(r.split(":")) for r in a.runs.split(",") if r]
    if any(len(r) != 2 for r in runs):
        sys.exit("--runs takes CONVERSION:LOSS pairs, e.g. aligned:kd,mean:lm")
    a.work.mkdir(parents=True, exist_ok=True)
    src = resolve_source(a.source)
    steps = -(-a.tokens // a.batch_tokens)
    eval_every = max(1, steps // a.evals)
    print(f"{a.source}: {steps} steps x {a.batch_tokens} tokens per run, seq {a.seq_len}, lr {a.lr}, held-out "
          f"{a.eval_tokens} tokens every {eval_every} steps", flush=True)

    metrics, records, seconds, kinds = {}, {}, {}, {}  # kinds: label -> (conversion, loss)
    for kind, loss in runs:
        folder = Path(given[kind]) if kind in given else src.folder if kind == "source" else a.work / kind
        start = time.time()
        if kind not in given and kind != "source":
            convert(kind, src, folder)
        # options away from their defaults name the run (label, folder); the defaults keep earlier runs' names
        variants = [(a.stage != "kd", f", {a.stage}", "-" + a.stage.replace(",", "-")),
                    (a.train != "all", f", train {a.train}", f"-{a.train}"),
                    (a.hidden_weight != 0, f", hidden {a.hidden_weight:g}", f"-hidden{a.hidden_weight:g}"),
                    (a.kd_divergence != "forward", f", {a.kd_divergence}", f"-{a.kd_divergence}"),
                    (a.temperature != 1, f", T {a.temperature:g}", f"-t{a.temperature:g}"),
                    (loss == "mix" and a.kd_weight != 0.5, f", kd weight {a.kd_weight:g}", f"-w{a.kd_weight:g}"),
                    (a.min_lr_ratio != 0.1, f", lr floor {a.min_lr_ratio:g}", f"-floor{a.min_lr_ratio:g}"),
                    (a.lr != 3e-4, f", lr {a.lr:g}", f"-lr{a.lr:g}")]
        label = f"{LABELS.get(kind, kind)}, {loss}" + "".join(part for on, part, _ in variants if on)
        out = a.work / (f"uptrained-{kind}-{loss}" + "".join(part for on, _, part in variants if on))
        records[label] = uptrain(UptrainOptions(
            model=str(folder), out=out, data="pydoc", tokens=a.tokens,
            seq_len=a.seq_len, batch_tokens=a.batch_tokens, micro_batch=a.micro_batch, eval_tokens=a.eval_tokens,
            eval_every=eval_every, save_every=0, loss=loss, lr=a.lr, train=a.train, force=True, progress=False, stage=a.stage,
            align_tokens=a.align_tokens, align_epochs=a.align_epochs, align_lr=a.align_lr, hidden_weight=a.hidden_weight,
            kd_divergence=a.kd_divergence, temperature=a.temperature, kd_weight=a.kd_weight,
            min_lr_ratio=a.min_lr_ratio, eval_data=a.eval_data, teacher=a.teacher or (a.source if kind == "source" else None)))
        seconds[label] = time.time() - start
        kinds[label] = (kind, loss)
        metrics[label] = read_metrics(out / "uptrain_metrics.jsonl")
        r = records[label]
        other = (f"; --eval-data {r['initial_other_eval_ppl']:.2f} -> {r['final_other_eval_ppl']:.2f}"
                 if r.get("final_other_eval_ppl") is not None else "")
        print(f"{label}: ppl {r['initial_eval_ppl']:.2f} -> {r['final_eval_ppl']:.2f} after {r['tokens']} tokens "
              f"({r['tokens'] / r['train_seconds']:.1f} tokens/s){other}", flush=True)

    source_ppl = source_ppl_of(records, kinds, "eval_ppl")
    refs = {"source SmolLM2-135M": source_ppl} if source_ppl else {}
    plot = a.plot or a.work / "recovery.png"
    plot_runs(metrics, plot, refs, title=f"SmolLM2-135M conversions: uptraining, {a.tokens} tokens each")

    print(f"\nheld-out perplexity ({a.eval_tokens} pydoc tokens never trained on)")
    print(f"  source (GQA, 3 K/V heads): {source_ppl:.2f}" if source_ppl else "  source: not measured (no KD or source run)")
    evals = {label: {m["tokens"]: m["eval_ppl"] for m in rows if "eval_ppl" in m} for label, rows in metrics.items()}
    width = max(len(label) for label in evals) + 2
    print("  tokens  " + "".join(f"{label:>{width}s}" for label in evals))
    for t in sorted({t for e in evals.values() for t in e}):
        print(f"  {t:6d}  " + "".join(f"{evals[label].get(t, float('nan')):{width}.2f}" for label in evals))
    if source_ppl:
        print("  final / source: " + ", ".join(f"{label} {r['final_eval_ppl'] / source_ppl:.3f}x"
                                              for label, r in records.items()))
    trained = {loss: records[label]["final_eval_ppl"] for label, (kind, loss) in kinds.items() if kind == "source"}
    against_trained = [f"{label} {records[label]['final_eval_ppl'] / trained[loss]:.3f}x"
                       for label, (kind, loss) in kinds.items() if kind != "source" and loss in trained]
    if against_trained:
        print("  final / the source trained the same way: " + ", ".join(against_trained))
    others = {label: r for label, r in records.items() if r.get("final_other_eval_ppl") is not None}
    if others:
        source_other = source_ppl_of(records, kinds, "other_eval_ppl")
        print(f"\n--eval-data {a.eval_data} ({a.eval_tokens} tokens), before -> after (the source: "
              + (f"{source_other:.2f})" if source_other else "not measured)"))
        for label, r in others.items():
            print(f"  {label}: {r['initial_other_eval_ppl']:.2f} -> {r['final_other_eval_ppl']:.2f}")
    for label, s in seconds.items():
        r = records[label]
        print(f"  {label}: {s:.0f}s wall, {r['train_seconds']:.0f}s training, {r['tokens'] / r['train_seconds']:.1f} tokens/s")
    result = {"source_ppl": source_ppl, "evals": evals, "records": records, "wall_seconds": seconds,
              "args": {k: str(v) for k, v in vars(a).items()}}
    (a.work / "recovery.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"plot {plot}\nresults {a.work / 'recovery.json'}")


if __name__ == "__main__":
    main()
