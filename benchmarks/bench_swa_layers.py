"""Which global layers keep retrieval: `--to swa` at one window and one count of global layers, the layer choices
side by side on SmolLM2-135M, zero-shot, scored on retrieval examples whose haystack is held-out text.

    python benchmarks/bench_swa_layers.py --work W --window 256 --count 8 --choices cost,mass,even \
        --lengths 1024,2048 --samples 20 --tasks niah_single,niah_multikey \
        --haystack "/usr/share/vim/vim90/doc/usr_*.txt"

Each choice is one `surgery convert smollm2 --to swa` (cached in WORK/CHOICE): `cost` (`--global-layers auto:N
--layer-score cost`), `mass` (`auto:N --layer-score mass`), `even` (N evenly spaced), or a list of layers
(`list:3,4,5`), or an existing checkpoint (`path:FOLDER`, e.g. a conversion after uptraining). Calibration reads pydoc (--calib-tokens); the haystacks are the --haystack text, which calibration
never reads. Every model (the source once) scores the same examples (surgery/checking/retrieval.py: one
teacher-forced pass each, the answers' logits only); accuracy per cell with its 95% Wilson interval, the answers'
mean log-probability and its gap to the source's over the same examples (paired, 95% t), and the KV cache at the
longest length relative to the source's. Scores are cached in
WORK/scores-NAME.json by task and length: a rerun scores a model again only where its file lacks one of the plan's
cells (60 examples a cell are not the 20 of another run), and keeps the file's other cells.

`--metric string` scores the same examples as RULER does (`string_match_all`): a hit where the answer's text stands
anywhere in the model's greedy continuation of the prompt (the answer's tokens + 4 new tokens; RULER allows 128),
one generation per example, several times the cost of the default `exact` metric (the toolkit's: every answer token
the argmax, teacher-forced, from the first one on); the same scoring as `check --retrieval-metric string`
(surgery/checking/retrieval.py), whose rows keep the exact hit and the log-probability beside it. Its scores are
cached in WORK/string-NAME.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from collections import Counter
from pathlib import Path

import torch

from surgery.checking.retrieval import RetrievalPlan, score_retrieval
from surgery.checking.retrieval_report import by_depth, paired_gap, wilson
from surgery.checkpoint.source import resolve_source
from surgery.data import load_texts
from surgery.retrieval_tasks import make_examples
from surgery.runtime import load_model, load_tokenizer


def convert(choice: str, a) -> Path:
    if choice.startswith("path:"):  # a checkpoint made elsewhere (an uptrained conversion): scored as it is
        return Path(choice.removeprefix("path:"))
    out = a.work / choice
    if (out / "surgery.json").exists():
        return out
    if choice in ("cost", "mass"):
        layers = ["--global-layers", f"auto:{a.count}", "--layer-score", choice, "--calib", "pydoc",
                  "--calib-tokens", str(a.calib_tokens)]
    elif choice == "even":
        layers = ["--global-layers", str(a.count)]
    else:
        layers = ["--global-layers", choice.removeprefix("list:")]
    cmd = ["surgery", "convert", "smollm2", "--to", "swa", "--window", str(a.window), *layers, "--out", str(out),
           "--force"]
    print("$ " + " ".join(cmd), flush=True)
    start = time.time()
    subprocess.run(cmd, check=True)
    print(f"  converted in {time.time() - start:.0f} s", flush=True)
    return out


def plan(a, tokenizer) -> RetrievalPlan:
    hay = []
    for text in load_texts(a.haystack):
        hay += tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(hay) > 200_000:
            break
    examples = [e for task in a.tasks for n in a.lengths for e in make_examples(task, tokenizer, n, a.samples, 0, hay)]
    return RetrievalPlan.of(a.tasks, a.lengths, a.samples, "text", examples, metric=a.metric, tokenizer=tokenizer)


def scores(name: str, folder, a, the_plan) -> list[dict]:
    kind = "scores" if a.metric == "exact" else "string"
    cache = a.work / f"{kind}-{name.replace(':', '_').replace(',', '-')}.json"
    cells = {(task, n) for task in a.tasks for n in a.lengths}
    kept = []  # a cached file's other cells, kept beside this plan's
    if cache.exists():  # reused where it holds every cell of this plan (its examples depend on task and length only)
        rows = json.loads(cache.read_text())
        held = Counter((r["task"], r["length"]) for r in rows)
        if all(held[c] == a.samples for c in cells):
            return [r for r in rows if (r["task"], r["length"]) in cells]
        kept = [r for r in rows if (r["task"], r["length"]) not in cells]
    source = resolve_source(str(folder))
    model = load_model(source, torch.device("cpu"), "float32")
    start = time.time()
    # the string metric decodes with the plan's own tokenizer: every model here is SmolLM2's
    rows = score_retrieval(model, the_plan, torch.device("cpu"), progress=False)
    print(f"  {name}: scored {len(rows)} examples in {time.time() - start:.0f} s", flush=True)
    cache.write_text(json.dumps(kept + rows))
    return rows


def cell(rows, task, n, source=None) -> str:
    """A model's hits in one cell with their interval, exact hits and mean answer log-probability; with `source`,
    also the answers' log-probability minus the source's over the same examples, with its 95% t interval."""
    picked = [r for r in rows if r["task"] == task and r["length"] == n]
    hits = [r["score"] for r in picked]
    lo, hi = wilson(sum(hits), len(hits))
    lp = [r["logprob"] for r in picked if "logprob" in r]
    mean = f" ({sum(lp) / len(lp):.2f})" if lp else ""  # string rows cached by the bench's own metric carry none
    exact = f" exact {sum(r['exact'] for r in picked):.0f}" if all("exact" in r for r in picked) else ""
    gap = ""
    theirs = [r for r in source if r["task"] == task and r["length"] == n] if source is not None else []
    if theirs and all("logprob" in r for r in theirs + picked):  # string rows of older runs carry none
        pair = paired_gap(theirs, picked)
        gap = f" {pair[0]:+.2f} [{pair[1]:+.2f}, {pair[2]:+.2f}]" if pair else ""
    return f"{sum(hits):.0f}/{len(hits)} [{100 * lo:.0f}-{100 * hi:.0f}%]{exact}{mean}{gap}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--count", type=int, default=8)
    ap.add_argument("--choices", default="cost,mass,even")
    ap.add_argument("--lengths", default="1024,2048")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--tasks", default="niah_single,niah_multikey")
    ap.add_argument("--haystack", default="/usr/share/vim/vim90/doc/usr_*.txt")
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--metric", choices=("exact", "string"), default="exact",
                    help="exact: every answer token the argmax, teacher-forced (the toolkit's); string: RULER's "
                         "string_match_all on a greedy continuation")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    a.lengths = [int(n) for n in a.lengths.split(",")]
    a.tasks = a.tasks.split(",")
    choices = [c for c in a.choices.split(";" if "list:" in a.choices else ",") if c]
    torch.set_num_threads(max(1, torch.get_num_threads()))
    src = resolve_source("smollm2")
    tokenizer = load_tokenizer(src)
    the_plan = plan(a, tokenizer)
    results = {"source": scores("source", src.folder, a, the_plan)}
    layers = {"source": "all 30"}
    for choice in choices:
        folder = convert(choice, a)
        results[choice] = scores(choice.replace("/", "_"), folder, a, the_plan)
        types = json.loads((folder / "config.json").read_text()).get("layer_types")  # none: every layer global (mqa, mla)
        layers[choice] = ("all" if types is None
                          else ",".join(str(i) for i, t in enumerate(types) if t == "full_attention"))
    cache = (a.count + (30 - a.count) * a.window / max(a.lengths)) / 30
    print(f"\nsmollm2 -> swa W={a.window}, {a.count} global layers (KV cache at {max(a.lengths)}: {cache:.2f}x); "
          f"haystack {a.haystack} (held out); {a.samples} examples a cell; hits ({a.metric} match) [95% Wilson] "
          f"(answer mean log-prob; string: also the same examples' exact hits); after it, the answers' log-prob "
          f"minus the source's over the same examples [95% t]")
    header = "| choice | global layers | " + " | ".join(f"{t} @ {n}" for t in a.tasks for n in a.lengths) + " |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for name, rows in results.items():
        source = None if name == "source" else results["source"]
        cells = " | ".join(cell(rows, t, n, source) for t in a.tasks for n in a.lengths)
        print(f"| {name} | {layers[name]} | {cells} |")
    print("\nhits by needle depth (thirds of the haystack; 0: its start, the farthest from the question)")
    for name, rows in results.items():
        print(f"  {name}: " + "; ".join(
            f"{t} @ {n} " + " ".join(f"{b['hits_converted']:g}/{b['n']}" for b in by_depth(t, n, rows, rows))
            for t in a.tasks for n in a.lengths))


if __name__ == "__main__":
    main()
