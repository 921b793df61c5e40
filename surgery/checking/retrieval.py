"""`check --retrieval`: synthetic long-context retrieval (surgery/retrieval_tasks.py) scored for the source
and the converted model at a ladder of lengths; the report (accuracy against length with its intervals: table,
--json, --plot) is surgery/checking/retrieval_report.py; the form of the tasks and lengths asked for is
surgery/checking/retrieval_spec.py.

Scoring is exact and cheap: one forward pass over the example (prompt and answer, teacher-forced) that keeps the
logits of the answer's positions only (`logits_to_keep`: never a whole window of vocabulary logits). An item of the
answer counts as retrieved when every one of its tokens is the model's argmax there, which is what greedy decoding
would produce; items after the first are judged with the earlier ones given, in the order they stand in the text
(variable tracking's chain, common words' first appearances). An example's score is the share of its items
retrieved (one item: 0 or 1), as RULER's string-match scores; the mean log-probability of the answer is kept too.
The examples of one task and length all have exactly that length, so they go through the model `batch` at a time,
stacked, no padding (at most MAX_BATCH_TOKENS tokens a pass), and score as they do one by one.

`--retrieval-metric string` scores as RULER does (`string_match_all`): an item counts where its text (lower-cased,
stripped) stands anywhere in the model's greedy continuation of the prompt, the answer's length + EXTRA_TOKENS new
tokens (RULER allows 128; fewer where the context ends), one generation per example (those of a batch with equally
long prompts together). It forgives what the exact metric counts as a miss though the answer is there: a model that
writes the needle's own form ("is: 1234567.") or a space more. The teacher-forced pass runs too, so every row keeps
the exact score (`exact`) and the log-probability beside the string score; `said` is the continuation's text.

The examples are built once before any model is loaded, so bad input stops the check before the first load, and
built again, one task and length at a time, while each model is scored: memory holds one rung's examples, never the
whole ladder's (tasks x samples x lengths: millions of token ids at 128k).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

import torch

from ..errors import SurgeryError
from ..progress import Progress
from ..retrieval_tasks import Example, make_examples
from ..runtime import forward_keeping
from .generate import greedy, same_key_batches
from .retrieval_spec import (EXTRA_TOKENS, METRICS, check_length, default_lengths, parse_lengths,
                             parse_retrieval_tasks, resolve_lengths)

MAX_BATCH_TOKENS = 32768  # tokens of one batched pass: 4 examples at 8k, one at 32k and beyond


@dataclass
class RetrievalPlan:
    tasks: list[str]
    lengths: list[int]
    samples: int
    haystack: str  # "noise" or "text"
    build: Callable[[], Iterable[Example]]  # the examples, built anew (deterministically) on each call
    tokens: int  # their total length
    batch: int = 4  # examples of one task and length per forward pass (MAX_BATCH_TOKENS at most)
    window: int | None = None  # the converted model's sliding window, where --retrieval-lengths counted in it
    about: dict = field(default_factory=dict)  # what the report says of the haystack (its text, its tokens)
    metric: str = "exact"  # METRICS: what `score` counts
    tokenizer: object = None  # decodes the string metric's continuations and answers
    context: int | None = None  # the model's context: the string metric generates no further

    def examples(self) -> Iterator[Example]:
        return iter(self.build())

    @classmethod
    def of(cls, tasks: list[str], lengths: list[int], samples: int, haystack: str,
           examples: list[Example], batch: int = 4, metric: str = "exact", tokenizer=None,
           context: int | None = None) -> "RetrievalPlan":
        """A plan of examples already built (tests, benchmarks)."""
        return cls(tasks, lengths, samples, haystack, lambda: examples, sum(e.length for e in examples), batch,
                   metric=metric, tokenizer=tokenizer, context=context)


def plan_retrieval(spec: str, lengths: Sequence[int | str] | None, samples: int, haystack: str, tokenizer,
                   context: int | None, longest: int, text_ids: torch.Tensor | None, seed: int = 0, *,
                   batch: int = 4, window: int | None = None, no_window: str = "", text_name: str = "",
                   text_given: bool = True, metric: str = "exact") -> RetrievalPlan:
    """Every example of the check, checked against the model's context and the haystack text. `lengths`: parsed
    entries (`parse_lengths`; "kw" counts in `window`, the converted model's sliding window, `no_window` saying why
    there is none); None: the default ladder up to `longest`. `haystack` auto is the text when the user gave one
    (`text_given`), else the noise. The options' own rules (samples and batch at least 1, the haystack's choices,
    the tasks' and lengths' form) were checked when the options were built (checking/options.py)."""
    tasks = parse_retrieval_tasks(spec)
    if haystack == "auto":
        haystack = "text" if text_given else "noise"
    entries = parse_lengths(lengths) if lengths else None
    in_windows = bool(entries) and any(isinstance(e, str) for e in entries)
    lengths = resolve_lengths(entries, window, no_window) if entries else default_lengths(longest)
    for n in lengths:
        check_length(n)
        if context and n > context:
            raise SurgeryError(f"--retrieval-lengths: {n} tokens is beyond the model's context ({context})")
    hay, about = None, {}
    if haystack == "text":
        hay = text_ids.tolist() if text_ids is not None else []
        about = ({"haystack_text": text_name} if text_name else {}) | {"haystack_tokens": len(hay)}
        if len(hay) < max(lengths):
            raise SurgeryError(f"--retrieval-haystack text: the text{f' {text_name}' if text_name else ''} gave "
                               f"{len(hay)} tokens, fewer than the longest retrieval length {max(lengths)} (raise "
                               "--tokens, give a longer --data, or use --retrieval-haystack noise)")

    def build() -> Iterator[Example]:
        for task in tasks:
            for n in lengths:
                yield from make_examples(task, tokenizer, n, samples, seed, hay)

    tokens = sum(e.length for e in build())  # every example built once now: bad input fails before any model
    return RetrievalPlan(tasks, lengths, samples, haystack, build, tokens, batch, window if in_windows else None,
                         about, metric, tokenizer, context)


@torch.no_grad()
def _answer_logits(model, ids: torch.Tensor, keep: int) -> torch.Tensor:
    """The logits of the last `keep` positions of examples [B, L] (the model's own `logits_to_keep` where it takes
    it; else its whole logits, sliced): [B, keep, vocabulary], float32."""
    return forward_keeping(model, ids, keep, use_cache=False).logits[:, -keep:].float()


def batches(examples: Iterable[Example], samples: int, batch: int) -> Iterator[list[Example]]:
    """Consecutive examples of one task and length (a rung: `samples` of them, all as long), `batch` at a time
    (fewer where MAX_BATCH_TOKENS says); a batch never spans two rungs and never waits for the next rung's
    examples (memory holds one rung)."""
    pending: list[Example] = []
    for i, e in enumerate(examples):
        if pending and (e.length != pending[0].length or e.task != pending[0].task):  # a plan of mixed examples
            yield pending
            pending = []
        pending.append(e)
        if len(pending) >= max(1, min(batch, MAX_BATCH_TOKENS // e.length)) or (i + 1) % samples == 0:
            yield pending
            pending = []
    if pending:
        yield pending


def _score_batch(model, examples: list[Example], device: torch.device) -> list[dict]:
    ids = torch.tensor([e.ids for e in examples], device=device)
    spans = [e.length - e.answer_start for e in examples]
    keep = max(spans) + 1
    logits = _answer_logits(model, ids, keep)
    rows = []
    for b, (e, n) in enumerate(zip(examples, spans)):
        answer = logits[b, keep - n - 1:keep - 1]  # position p predicts token p + 1
        target = ids[b, e.answer_start:]
        hit = answer.argmax(-1) == target
        logp = torch.log_softmax(answer, -1).gather(-1, target[:, None]).mean().item()
        found, at = 0, 0
        for item in e.items:
            found += bool(hit[at:at + len(item)].all())
            at += len(item)
        rows.append({"task": e.task, "length": e.length, "depth": e.depth, "score": found / len(e.items),
                     "items": len(e.items), "logprob": logp})
    return rows


@torch.no_grad()
def _string_match(model, examples: list[Example], rows: list[dict], plan: RetrievalPlan,
                  device: torch.device) -> None:
    """RULER's string_match_all on each example's greedy continuation: `score` becomes the share of its items whose
    text stands in it, the teacher-forced score moves to `exact`, and `said` keeps the continuation's text."""
    tok = plan.tokenizer
    for members in same_key_batches([e.answer_start for e in examples], len(examples)):  # one prompt length each
        start = examples[members[0]].answer_start
        k = max(examples[i].length - start for i in members)
        new = k + EXTRA_TOKENS if plan.context is None else max(k, min(k + EXTRA_TOKENS, plan.context - start))
        prompt = torch.tensor([examples[i].ids[:start] for i in members], device=device)
        for i, said in zip(members, greedy(model, prompt, new).tolist()):
            text = tok.decode(said, skip_special_tokens=True)
            items = [tok.decode(item, skip_special_tokens=True).strip().lower() for item in examples[i].items]
            rows[i] |= {"exact": rows[i]["score"], "said": text,
                        "score": sum(item in text.lower() for item in items) / len(items)}


@torch.no_grad()
def score_retrieval(model, plan: RetrievalPlan, device: torch.device, progress: bool = True,
          desc: str = "retrieval") -> list[dict]:
    """Per example: its task, length, depth, the share of its items retrieved (`score`, by the plan's metric), how
    many items it has and the answer's mean log-probability (with the string metric also `exact` and `said`)."""
    if plan.metric not in METRICS:
        raise SurgeryError(f"--retrieval-metric: {plan.metric!r} is not one of {', '.join(METRICS)}")
    if plan.metric == "string" and plan.tokenizer is None:
        raise SurgeryError("--retrieval-metric string decodes the continuations: the plan needs a tokenizer")
    rows = []
    with Progress(plan.tokens, desc, enabled=progress) as bar:
        for group in batches(plan.examples(), plan.samples, plan.batch):
            scored = _score_batch(model, group, device)
            if plan.metric == "string":
                _string_match(model, group, scored, plan, device)
            rows += scored
            bar.update(sum(e.length for e in group))
            del group  # nothing of this rung stays while the next one is built
    return rows
