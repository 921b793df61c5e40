"""`check --retrieval`: synthetic long-context retrieval (surgery/checking/retrieval_tasks.py) scored for the source
and the converted model at a ladder of lengths, reported as accuracy against length (table, --json, --plot).

Scoring is exact and cheap: one forward pass over the example (prompt and answer, teacher-forced) that keeps the
logits of the answer's positions only (`logits_to_keep`: never a whole window of vocabulary logits). An item of the
answer counts as retrieved when every one of its tokens is the model's argmax there, which is what greedy decoding
would produce; items after the first are judged with the earlier ones given, in the order they stand in the text
(variable tracking's chain, common words' first appearances). An example's score is the share of its items
retrieved (one item: 0 or 1), as RULER's string-match scores; the mean log-probability of the answer is kept too.
The examples are built once before any model is loaded, so bad input stops the check before the first load, and
built again, one task and length at a time, while each model is scored: memory holds one rung's examples, never the
whole ladder's (tasks x samples x lengths: millions of token ids at 128k).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from ..errors import SurgeryError
from ..progress import Progress
from ..retrieval_tasks import TASKS, Example, make_examples

FIRST_LENGTH = 512
HAYSTACKS = ("noise", "text")


def parse_tasks(spec: str) -> list[str]:
    names = list(TASKS) if spec.strip() == "all" else [t.strip() for t in spec.split(",") if t.strip()]
    unknown = [t for t in names if t not in TASKS]
    if unknown or not names:
        raise SurgeryError(f"unknown retrieval task {unknown[0] if unknown else spec!r}; choose from "
                           f"{', '.join(TASKS)} or all")
    return list(dict.fromkeys(names))


def default_lengths(longest: int) -> list[int]:
    """512, 1024, ... doubling up to `longest`, which is always the last rung."""
    lengths, n = [], FIRST_LENGTH
    while n < longest:
        lengths.append(n)
        n *= 2
    return lengths + [longest]


@dataclass
class RetrievalPlan:
    tasks: list[str]
    lengths: list[int]
    samples: int
    haystack: str
    build: Callable[[], Iterable[Example]]  # the examples, built anew (deterministically) on each call
    tokens: int  # their total length

    def examples(self) -> Iterator[Example]:
        return iter(self.build())

    @classmethod
    def of(cls, tasks: list[str], lengths: list[int], samples: int, haystack: str,
           examples: list[Example]) -> "RetrievalPlan":
        """A plan of examples already built (tests, benchmarks)."""
        return cls(tasks, lengths, samples, haystack, lambda: examples, sum(e.length for e in examples))


def plan_retrieval(spec: str, lengths: list[int] | None, samples: int, haystack: str, tokenizer, context: int | None,
                   longest: int, text_ids: torch.Tensor | None, seed: int = 0) -> RetrievalPlan:
    """Every example of the check, checked against the model's context and the haystack text."""
    tasks = parse_tasks(spec)
    if samples < 1:
        raise SurgeryError(f"--retrieval-samples must be at least 1, got {samples}")
    if haystack not in HAYSTACKS:
        raise SurgeryError(f"--retrieval-haystack must be noise or text, got {haystack!r}")
    lengths = sorted(set(lengths)) if lengths else default_lengths(longest)
    for n in lengths:
        if n < 64:
            raise SurgeryError(f"--retrieval-lengths: {n} tokens is too short for a retrieval example (64 at least)")
        if context and n > context:
            raise SurgeryError(f"--retrieval-lengths: {n} tokens is beyond the model's context ({context})")
    hay = None
    if haystack == "text":
        hay = text_ids.tolist() if text_ids is not None else []
        if len(hay) < max(lengths):
            raise SurgeryError(f"--retrieval-haystack text: the text gave {len(hay)} tokens, fewer than the longest "
                               f"retrieval length {max(lengths)} (raise --tokens or give a longer --data)")

    def build() -> Iterator[Example]:
        for task in tasks:
            for n in lengths:
                yield from make_examples(task, tokenizer, n, samples, seed, hay)

    tokens = sum(e.length for e in build())  # every example built once now: bad input fails before any model
    return RetrievalPlan(tasks, lengths, samples, haystack, build, tokens)


@torch.no_grad()
def _answer_logits(model, ids: torch.Tensor, keep: int) -> torch.Tensor:
    """The logits of the last `keep` positions of one example [1, L] (the model's own `logits_to_keep` where it
    takes it; else its whole logits, sliced)."""
    try:
        out = model(input_ids=ids, logits_to_keep=keep, use_cache=False)
    except TypeError:
        out = model(input_ids=ids, use_cache=False)
    return out.logits[0, -keep:].float()


@torch.no_grad()
def score(model, plan: RetrievalPlan, device: torch.device, progress: bool = True, desc: str = "retrieval") -> list[dict]:
    """Per example: its task, length, depth, the share of items retrieved and the answer's mean log-probability."""
    rows = []
    with Progress(plan.tokens, desc, enabled=progress) as bar:
        for e in plan.examples():
            ids = torch.tensor([e.ids], device=device)
            n = e.length - e.answer_start
            logits = _answer_logits(model, ids, n + 1)[:n]  # position p predicts token p + 1
            target = ids[0, e.answer_start:]
            hit = logits.argmax(-1) == target
            logp = torch.log_softmax(logits, -1).gather(-1, target[:, None]).mean().item()
            found, at = 0, 0
            for item in e.items:
                found += bool(hit[at:at + len(item)].all())
                at += len(item)
            rows.append({"task": e.task, "length": e.length, "depth": e.depth, "score": found / len(e.items),
                         "logprob": logp})
            bar.update(e.length)
            del ids, logits
    return rows


def compare(plan: RetrievalPlan, source: list[dict], converted: list[dict]) -> dict:
    """Accuracy per task and length for both models, and the mean over tasks per length."""
    def mean(rows, task, n, key="score"):
        values = [r[key] for r in rows if r["length"] == n and (task is None or r["task"] == task)]
        return sum(values) / len(values)

    table = {task: {str(n): {"source": mean(source, task, n), "converted": mean(converted, task, n),
                             "logprob_source": mean(source, task, n, "logprob"),
                             "logprob_converted": mean(converted, task, n, "logprob")} for n in plan.lengths}
             for task in plan.tasks}
    overall = {str(n): {"source": mean(source, None, n), "converted": mean(converted, None, n)} for n in plan.lengths}
    return {"tasks": plan.tasks, "lengths": plan.lengths, "samples": plan.samples, "haystack": plan.haystack,
            "accuracy": table, "mean": overall,
            "scoring": "teacher-forced greedy exact match per answer item (RULER's string match), one forward pass"}


def print_table(report: dict, console) -> None:
    from rich.table import Table

    table = Table(title=f"retrieval accuracy by length, source / converted ({report['samples']} examples per cell, "
                        f"{report['haystack']} haystack)")
    table.add_column("task")
    for n in report["lengths"]:
        table.add_column(str(n), justify="right")
    rows = [(t, report["accuracy"][t]) for t in report["tasks"]] + [("mean", report["mean"])]
    for name, cells in rows:
        table.add_row(name, *(f"{100 * cells[str(n)]['source']:.0f}% / {100 * cells[str(n)]['converted']:.0f}%"
                              for n in report["lengths"]))
    console.print(table)


def plot(report: dict, title: str = "") -> bytes:
    """Accuracy against length, one panel per task and one for the mean, source solid and converted dashed: PNG
    bytes."""
    import io
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = report["tasks"] + ["mean"]
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False, sharey=True)
    lengths = report["lengths"]
    for ax, task in zip(axes.flat, panels):
        cells = report["mean"] if task == "mean" else report["accuracy"][task]
        for model, style, color in (("source", "-", "C0"), ("converted", "--", "C3")):
            ax.plot(lengths, [100 * cells[str(n)][model] for n in lengths], style, color=color, marker="o",
                    markersize=3, label=model)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n) for n in lengths],
                      fontsize=7)
        ax.set_ylim(-5, 105)
        ax.set_title(task, fontsize=9)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    axes[0][0].set_ylabel("accuracy (%)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title or "retrieval accuracy by context length", fontsize=10)
    fig.supxlabel("context length (tokens)", fontsize=9)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()
