"""Every kind side by side at long context, at (about) equal KV cache, on SmolLM2-135M at 8,192 tokens.

For each conversion (aligned MQA, MLA at MQA's cache, swa with a quarter of the layers global, MQA + swa): the KV
cache at the context (`surgery inspect --context`, per runtime), perplexity / KL / top-1 agreement by position out
to the full context on long held-out documents, and the retrieval tasks' accuracy by length
(`surgery check --seq-len 8192`; the retrieval tasks of `check --retrieval`, scored by the same code with each model
loaded once), and decode tokens/s at the context in transformers
(`surgery bench --context`). Each step runs the `surgery` command a user would run and is cached in WORK/NAME, so an
interrupted run resumes and `--table` rebuilds the table and plots from what is there.

    python benchmarks/bench_long_context.py --work W --kinds mqa,mla64,swa,mqa+swa \
        --check-args "--data DOC.txt --documents whole --tokens 8192" --tasks passkey,niah_multikey,variable_tracking \
        --lengths 2048,8192 --samples 1 --bench
    python benchmarks/bench_long_context.py --work W --table
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
from pathlib import Path

# name -> (label, the folder it converts (None: the source), `surgery convert` arguments)
KINDS = {
    "mqa": ("MQA, aligned merge (1 K/V head)", None, ["--to", "mqa", "--merge", "aligned"]),
    "mla64": ("MLA R=64 D=64 (MQA's cache)", None, ["--to", "mla", "--kv-rank", "64", "--rope-dim", "64"]),
    "swa": ("swa W=1024, 8 of 30 layers global (auto)", None,
            ["--to", "swa", "--window", "1024", "--global-layers", "auto:8"]),
    "swa-even": ("swa W=1024, 8 evenly spaced global layers", None,
                 ["--to", "swa", "--window", "1024", "--global-layers", "8"]),
    "mqa+swa": ("aligned MQA + swa W=1024, 8 global (auto)", "mqa",
                ["--to", "swa", "--window", "1024", "--global-layers", "auto:8"]),
}
BUCKETS = ((0, 1024), (1024, 2048), (2048, 4096), (4096, 8192))
KD = "+kd"  # NAME+kd: NAME's conversion after the same short KD uptraining (--train-data, --uptrain-args)


def label(name: str) -> str:
    if name.endswith(KD):
        return KINDS[name[: -len(KD)]][0] + ", after KD"
    return KINDS[name][0]


def surgery(*args: str) -> None:
    print("$ surgery " + " ".join(args), flush=True)
    subprocess.run(["surgery", *args], check=True)


def teacher_store(a) -> Path:
    """The source's top-k log-probs on the uptraining windows, stored once: every conversion distils from the same
    teacher on the same windows, and no run loads the teacher model."""
    store = a.work / "teacher"
    if not (store / "manifest.json").exists():
        surgery("teacher", a.source, *shlex.split(a.train_data), "--out", str(store), "--force")
    return store


def folder(name: str, a) -> Path:
    out = a.work / name / "converted"
    if name.endswith(KD) and not (out / "surgery.json").exists():
        start = folder(name[: -len(KD)], a)
        surgery("uptrain", str(start), "--teacher-logprobs", str(teacher_store(a)), *shlex.split(a.train_data),
                *shlex.split(a.uptrain_args), "--out", str(out), "--force")
    elif not (out / "surgery.json").exists():
        _, base, args = KINDS[name]
        src = str(folder(base, a)) if base else a.source
        surgery("convert", src, *args, "--calib-tokens", str(a.calib_tokens), "--out", str(out), "--force")
    return out


def measure(name: str, a) -> None:
    out = folder(name, a)
    work = a.work / name
    if not (work / "inspect.json").exists():
        result = subprocess.run(["surgery", "inspect", a.source, str(out), "--context", str(a.context), "--json"],
                                check=True, capture_output=True, text=True)
        (work / "inspect.json").write_text(result.stdout)
    if not (work / "check.json").exists():
        surgery("check", a.source, str(out), "--seq-len", str(a.context), *shlex.split(a.check_args),
                "--json", str(work / "check.json"))
    if a.bench and not (work / "bench.json").exists():
        # the prompt leaves room for the 16 decoded tokens: the last step attends to the full context
        surgery("bench", a.source, str(out), "--context", str(a.context - 16), "--new", "16", "--rounds", "2",
                "--json", str(work / "bench.json"))


def retrieval_plan(a):
    from surgery.checking.retrieval import plan_retrieval
    from surgery.checkpoint.source import resolve_source
    from surgery.runtime import load_tokenizer

    return plan_retrieval(a.tasks, a.lengths, a.samples, "noise", load_tokenizer(resolve_source(a.source)),
                          a.context, a.context, None)


def retrieval(a) -> dict:
    """`surgery check --retrieval`'s scores for the source and every conversion, each model loaded once in this
    process (the same examples and scoring as the check; the source is scored once instead of once per check)."""
    import torch
    from transformers import AutoModelForCausalLM

    from surgery.checking.retrieval import score_retrieval
    from surgery.checkpoint.source import resolve_source

    path = a.work / "retrieval.json"
    done = json.loads(path.read_text()) if path.exists() else {}
    plan = retrieval_plan(a)
    for name in ["source", *a.kinds]:
        if name in done:
            continue
        where = resolve_source(a.source).folder if name == "source" else folder(name, a)
        print(f"retrieval: {name} ({plan.tokens} tokens)", flush=True)
        model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32).eval()
        done[name] = score_retrieval(model, plan, torch.device("cpu"), progress=True, desc=f"retrieval {name}")
        del model
        path.write_text(json.dumps(done))
    return done


def bucket_ratio(rows: list[dict], lo: int, hi: int, key: str = "ppl_ratio") -> float | None:
    """The target-weighted geometric mean of a per-bucket ratio over the check's buckets inside [lo, hi)."""
    import math

    inside = [r for r in rows if r["positions"][0] >= lo and r["positions"][1] <= hi]
    if not inside:
        return None
    if key == "ppl_ratio":
        n = sum(r["targets"] for r in inside)
        return math.exp(sum(r["targets"] * math.log(r[key]) for r in inside) / n)
    return sum(r[key] * r["targets"] for r in inside) / sum(r["targets"] for r in inside)


def retrieval_report(a, name: str) -> dict | None:
    from surgery.checking.retrieval_report import compare_retrieval_scores

    path = a.work / "retrieval.json"
    rows = json.loads(path.read_text()) if path.exists() else {}
    if "source" not in rows or name not in rows:
        return None
    return compare_retrieval_scores(retrieval_plan(a), rows["source"], rows[name])


def mean_logprob(report: dict, length: int) -> float:
    """The converted model's answer log-probability at `length`, averaged over the tasks."""
    rows = [report["accuracy"][t][str(length)]["logprob_converted"] for t in report["tasks"]]
    return sum(rows) / len(rows)


def table(a) -> str:
    lines = ["| conversion | KV cache @8k (transformers) | ppl ratio " + " | ".join(f"{lo // 1024}-{hi // 1024}k"
                                                                                     for lo, hi in BUCKETS)
             + " | overall | KL | top-1 | retrieval source:converted, " + " / ".join(f"{n // 1024}k" for n in a.lengths)
             + " | answer log-prob " + " / ".join(f"{n // 1024}k" for n in a.lengths)
             + " | decode tok/s ratio @8k |", "|" + "---|" * (8 + len(BUCKETS))]
    for name in a.kinds:
        work = a.work / name
        if not (work / "check.json").exists():
            continue
        check = json.loads((work / "check.json").read_text())
        inspect = json.loads((work / "inspect.json").read_text())
        src, conv = inspect[0], inspect[1]
        kv = f"{conv['kv_cache_bytes_per_context'] / src['kv_cache_bytes_per_context']:.2f}x"
        ratios = [bucket_ratio(check["by_position"], lo, hi) for lo, hi in BUCKETS]
        r = retrieval_report(a, name)
        retrieval = " / ".join(f"{100 * r['mean'][str(n)]['source']:.0f}:{100 * r['mean'][str(n)]['converted']:.0f}"
                               for n in r["lengths"]) if r else "-"
        logprob = " / ".join(f"{mean_logprob(r, n):.2f}" for n in r["lengths"]) if r else "-"
        decode = "-"
        if (work / "bench.json").exists():
            bench = json.loads((work / "bench.json").read_text())
            decode = f"{bench['results'][0]['ratio']['decode_tokens_per_s']:.2f}x"
        lines.append(f"| {label(name)} | {kv} | "
                     + " | ".join(f"{x:.2f}x" if x else "-" for x in ratios)
                     + f" | {check['ppl_converted'] / check['ppl_source']:.2f}x | {check['kl']:.3f} | "
                     f"{100 * check['top1_agreement']:.1f}% | {retrieval} | {logprob} | {decode} |")
    return "\n".join(lines) + "\n"


def plot(a) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for i, name in enumerate(a.kinds):
        path = a.work / name / "check.json"
        if not path.exists():
            continue
        check = json.loads(path.read_text())
        rows = check["by_position"]
        base = name.removesuffix(KD)
        color, style = f"C{list(KINDS).index(base)}", "--" if name.endswith(KD) else "-"
        left.plot([r["positions"][1] for r in rows], [r["ppl_ratio"] for r in rows], style, marker="o", color=color,
                  label=label(name))
        r = retrieval_report(a, name)
        if r is None:
            continue
        lengths = r["lengths"]
        right.plot(lengths, [100 * r["mean"][str(n)]["converted"] for n in lengths], style, marker="o",
                   color=color, label=label(name))
        if i == 0:
            right.plot(lengths, [100 * r["mean"][str(n)]["source"] for n in lengths], "k-", marker="s",
                       label="source")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    left.set_xlabel("position in the window (bucket end)")
    left.set_ylabel("perplexity ratio to the source")
    right.set_xlabel("retrieval example length (tokens)")
    right.set_ylabel("mean retrieval accuracy (%)")
    right.legend(fontsize=7)
    kd = " (dashed: after the same KD uptraining)" if any(n.endswith(KD) for n in a.kinds) else ", zero-shot"
    fig.suptitle(f"SmolLM2-135M at 8k: every kind at about a third of the KV cache{kd}", fontsize=10)
    fig.tight_layout()
    fig.savefig(a.work / "long_context.png", dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--source", default="smollm2")
    p.add_argument("--kinds", default="mqa,mla64,swa,mqa+swa")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--samples", type=int, default=2, help="retrieval examples per task and length")
    p.add_argument("--tasks", default="all", help="retrieval tasks (check --retrieval's names)")
    p.add_argument("--lengths", default="1024,2048,4096,8192", help="retrieval example lengths")
    p.add_argument("--calib-tokens", type=int, default=8192)
    p.add_argument("--check-args", default="--tokens 16384", help="more `surgery check` arguments (text, tokens)")
    p.add_argument("--train-data", default="--data stdlib --data-mode packed --seq-len 4096 --tokens 49152 "
                   "--batch-tokens 4096 --micro-batch 1 --eval-tokens 0",
                   help="data options of the uptraining of NAME+kd kinds and of its stored teacher")
    p.add_argument("--uptrain-args", default="--train attention --lr 2e-4 --warmup-steps 1",
                   help="more `surgery uptrain` arguments of NAME+kd kinds")
    p.add_argument("--bench", action="store_true", help="also measure decode speed at the context")
    p.add_argument("--table", action="store_true", help="only rebuild the table and plot from WORK")
    a = p.parse_args()
    a.kinds = [k for k in a.kinds.split(",") if k]
    a.lengths = [int(n) for n in a.lengths.split(",")]
    if not a.table:
        for name in a.kinds:
            measure(name, a)
        retrieval(a)
    text = table(a)
    (a.work / "table.md").write_text(text)
    plot(a)
    print(text)


if __name__ == "__main__":
    main()
