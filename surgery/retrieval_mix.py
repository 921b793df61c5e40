"""A fraction P of a run's windows replaced by synthetic retrieval examples (passkey, single- and multi-key needles,
variable tracking: surgery/retrieval_tasks.py) built from the window's own text, so that a converted model trains
(uptrain's `--retrieval-mix P`, surgery/training/retrieval_mix.py) or is calibrated (a calibrated conversion's
`--calib-retrieval-mix P`, surgery/calibration/text.py) on finding what was said far back, in the user's domain.

One window, one example. The window's tokens are the haystack and the window length the example's length: the
needles go in at sentence boundaries of its first tokens, and its end is replaced by the question and the answer
(`make_examples(task, tokenizer, seq_len, DEPTHS, seed, haystack_tokens=window)`, one of its DEPTHS needle depths).
With `questions` K > 1 (uptrain's `--retrieval-questions`) the window holds K examples in one haystack
(`make_packed`, RULER's multi-query needles over every task): each its own task and needle depth, the K questions and
answers in turn at its end. A long window costs the same forward pass whatever it holds, and a single answer is a
few of its tokens: K answers a window give the run K times the retrieval examples at the distances it trains at.

Which windows. Window g of the run's global order (training: g = (align steps + step) * B + rank * B/W + i, as a
stored teacher pass numbers them, surgery/training/stored_kd.py; calibration: the window's index) is an example when floor((g + 1) P + u) > floor(g P + u), u in
[0, 1) from --seed: every stretch of n windows holds floor(n P) or ceil(n P) examples. Its task, needle depth and
numbers come from a generator seeded by (--seed, g). So the choice depends on nothing but the seed and the window's
place: a resumed run, every process, and `surgery teacher` (which must see exactly the windows the run trains on)
agree, in packed and streamed data alike.
"""

from __future__ import annotations

import hashlib
import math
import random

import torch

from .errors import SurgeryError
from .retrieval_tasks import Example, Packed, make_examples, make_packed

TASKS = ("passkey", "niah_single", "niah_multikey", "variable_tracking")
DEPTHS = 8  # needle depths an example may take: (j + 0.5) / DEPTHS of the haystack


def _rng(seed: int, *parts) -> random.Random:
    key = "/".join(map(str, ("retrieval-mix", seed, *parts)))
    return random.Random(int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little"))


class RetrievalMix:
    """The retrieval examples of a run with fraction `fraction`, `seed` and windows of `seq_len` tokens."""

    def __init__(self, fraction: float, seed: int, tokenizer, seq_len: int, flag: str = "--retrieval-mix",
                 length_flag: str = "--seq-len", answer_weight: float = 1.0, questions: int = 1):
        if not (math.isfinite(fraction) and 0 <= fraction <= 1):
            raise SurgeryError(f"{flag} must lie in [0, 1], got {fraction}")
        if questions < 1:
            raise SurgeryError(f"--retrieval-questions must be at least 1, got {questions}")
        self.fraction, self.seed, self.tokenizer, self.seq_len = fraction, seed, tokenizer, seq_len
        self.questions = questions  # examples (questions) in each retrieval window
        self.answer_weight = answer_weight  # how much each position predicting an answer token counts in a loss
        self.flag, self.length_flag = flag, length_flag  # how the errors name the option and the window length
        self.offset = _rng(seed).random()

    @classmethod
    def of(cls, o, tokenizer) -> "RetrievalMix | None":
        """The mix of a run's options `o` (UptrainOptions), its windows checked long enough; None when it is off."""
        if not o.retrieval_mix:
            return None
        mix = cls(o.retrieval_mix, o.seed, tokenizer, o.seq_len, answer_weight=o.retrieval_answer_weight,
                  questions=o.retrieval_questions)
        mix.check_length()
        return mix

    def check_length(self) -> None:
        """Every task's instruction, needles, question and answer (with `questions` K > 1: K of them, of any tasks)
        take at most half a window (the rest of it is the haystack, and an example's own numbers and names, which
        vary, still fit): else one line, before the model loads."""
        for asked in self._widest():
            if not self._fits(asked, self.seq_len // 2):
                enough = next((n for n in (self.seq_len * 2 ** k for k in range(1, 8)) if self._fits(asked, n // 2)),
                              None)
                what = (f"{asked[0]} examples" if self.questions == 1 else
                        f"{self.questions} questions a window (--retrieval-questions), as {', '.join(asked)}")
                raise SurgeryError(f"{self.flag}: {self.length_flag} {self.seq_len} is too short for {what} (their "
                                   f"questions and needles must fit in half a window)"
                                   + (f"; {self.length_flag} {enough} is enough" if enough else ""))

    def _widest(self) -> list[list[str]]:
        """The task lists whose fit check_length checks: each task alone, or for K questions K of each task (the pass
        key once, the others after it) and the four tasks in turn."""
        k = self.questions
        if k == 1:
            return [[task] for task in TASKS]
        others = [t for t in TASKS if t != "passkey"]
        return ([[t] * k for t in others] + [["passkey"] + [t] * (k - 1) for t in others]
                + [["passkey"] + [others[i % len(others)] for i in range(k - 1)]])

    def _fits(self, tasks: list[str], length: int) -> bool:
        try:
            if len(tasks) == 1:
                make_examples(tasks[0], self.tokenizer, length, 2, seed=self.seed)
            else:
                make_packed(self.tokenizer, length, [(t, (i + 0.5) / len(tasks)) for i, t in enumerate(tasks)],
                            seed=self.seed)
        except SurgeryError:
            return False
        return True

    def count(self, n: int) -> int:
        """Retrieval examples among the run's first `n` windows."""
        return math.floor(n * self.fraction + self.offset) - math.floor(self.offset)

    def chosen(self, g: int) -> bool:
        """Whether window `g` of the run's order is a retrieval example."""
        return self.count(g + 1) > self.count(g)

    def example(self, g: int, window: list[int]) -> Example | Packed:
        """Window `g`'s retrieval example (surgery.retrieval_tasks.Example; with `questions` > 1 a Packed one of that
        many, each its own task and depth, the pass key at most once), `window` its haystack."""
        rng = _rng(self.seed, g)
        if self.questions == 1:
            task, depth, seed = rng.choice(TASKS), rng.randrange(DEPTHS), rng.randrange(1 << 62)
            return make_examples(task, self.tokenizer, self.seq_len, DEPTHS, seed=seed, haystack_tokens=window)[depth]
        asked: list[tuple[str, float]] = []
        for _ in range(self.questions):
            task = rng.choice([t for t in TASKS if t != "passkey" or all(a != "passkey" for a, _ in asked)])
            asked.append((task, (rng.randrange(DEPTHS) + 0.5) / DEPTHS))
        return make_packed(self.tokenizer, self.seq_len, asked, seed=rng.randrange(1 << 62), haystack_tokens=window)

    def apply(self, windows: torch.Tensor, first: int) -> torch.Tensor:
        """`windows` [n, seq_len], the run's windows first .. first+n-1, with the chosen ones replaced by their
        examples (a new tensor when any is; same dtype)."""
        return self.replace(windows, first)[0]

    def replace(self, windows: torch.Tensor, first: int) -> tuple[torch.Tensor, dict[int, Example | Packed]]:
        """`apply`'s windows, and the examples that replaced them by row."""
        picked = {i: self.example(first + i, windows[i].tolist())
                  for i in range(windows.shape[0]) if self.chosen(first + i)}
        if not picked:
            return windows, picked
        out = windows.clone()
        for i, example in picked.items():
            out[i] = torch.tensor(example.ids, dtype=windows.dtype)
        return out, picked

    def weighted(self, windows: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`apply`'s windows and the losses' position weights [n, seq_len]: `answer_weight` at the positions that
        predict a retrieval example's answer (`answer_positions`), 1 elsewhere; None when every weight is 1."""
        out, picked = self.replace(windows, first)
        if self.answer_weight == 1 or not picked:
            return out, None
        weights = torch.ones(windows.shape, dtype=torch.float32)
        for i, example in picked.items():
            weights[i, answer_positions(example)] = self.answer_weight
        return out, weights

    def record(self, windows: int) -> dict:
        """What surgery.json records of the mix, for a run of `windows` windows."""
        return ({"fraction": self.fraction, "tasks": list(TASKS), "windows": self.count(windows), "of": windows}
                | ({"questions": self.questions} if self.questions != 1 else {})
                | ({"answer_weight": self.answer_weight} if self.answer_weight != 1 else {}))


def mixed(mix: RetrievalMix | None, windows: torch.Tensor, first: int) -> torch.Tensor:
    """`windows` (the run's windows first ..) with the retrieval examples of `mix` in (unchanged without one)."""
    return windows if mix is None else mix.apply(windows, first)


def mixed_weighted(mix: RetrievalMix | None, windows: torch.Tensor, first: int
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`mixed`'s windows and their position weights (RetrievalMix.weighted; None without a mix or weights)."""
    return (windows, None) if mix is None else mix.weighted(windows, first)


def _occurrences(ids: list[int], seq: list[int], end: int) -> list[int]:
    """Start offsets of `seq` in ids[:end]."""
    n = len(seq)
    return [i for i in range(end - n + 1) if ids[i:i + n] == seq] if n else []


def answer_positions(example: Example | Packed) -> list[int]:
    """The positions whose next token is one of the answer's (a packed example's: any of its answers'): the positions
    that predict the answer."""
    if isinstance(example, Packed):
        return [p for start, end in example.answers for p in range(start - 1, end - 1)]
    return list(range(example.answer_start - 1, example.length - 1))


def needle_positions(example: Example) -> list[int]:
    """Where the needles' values (the tokens the answer copies) stand in the example's text before its question: every
    occurrence of each answer item's tokens (without its leading separator token when the item's tokens are found only
    so, as a tokenizer may merge the separator with what precedes it in the needle). Sorted, without repeats; empty
    when no item is found."""
    ids, end = example.ids, example.answer_start
    found: set[int] = set()
    for item in example.items:
        for seq in (item, item[1:]):
            starts = _occurrences(ids, seq, end)
            if starts:
                found.update(s + j for s in starts for j in range(len(seq)))
                break
    return sorted(found)
