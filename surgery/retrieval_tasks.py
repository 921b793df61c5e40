"""Synthetic long-context retrieval examples, generated locally and deterministically (no download), after RULER's
synthetic families (Hsieh et al. 2024): single- and multi-key needle in a haystack, passkey retrieval, variable
tracking and common-word extraction.

Every example is token ids of exactly the asked length: an instruction, a haystack with the needles inserted at
sentence boundaries near their depths, the question, an answer prefix, and the answer itself (the items to
retrieve, each with its own token ids, in the order they stand in the text). The haystack is RULER's noise ("The
grass is green. ...") or any text (`haystack_tokens`: the check's own text), so each task runs on the user's
domain too. Scoring (surgery/checking/retrieval.py) reads the answer's positions of one forward pass.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .errors import SurgeryError

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
WORDS = ("apple", "river", "candle", "mountain", "violin", "garden", "harbor", "lantern", "meadow", "pencil", "rocket",
         "saddle", "thunder", "island", "jacket", "kettle", "ladder", "marble", "needle", "orange", "pillow", "quartz",
         "ribbon", "silver", "tunnel", "velvet", "window", "anchor", "basket", "canyon", "dragon", "feather", "glacier",
         "helmet", "insect", "jungle", "kitten", "lemon", "mirror", "nickel", "oyster", "parrot", "rabbit", "shadow",
         "temple", "walnut", "yogurt", "zipper", "bridge", "castle", "forest", "hammer", "magnet", "planet", "spider")
TASKS = ("passkey", "niah_single", "niah_multikey", "variable_tracking", "common_words")


@dataclass(frozen=True)
class Example:
    task: str
    length: int  # tokens, answer included
    depth: float  # where the (first) needle stands, 0..1 of the haystack
    ids: list[int]
    items: list[list[int]]  # the answer's items' token ids, at the end of `ids`, in order

    @property
    def answer_start(self) -> int:
        return self.length - sum(len(i) for i in self.items)


@dataclass(frozen=True)
class Parts:
    """What a task puts around its haystack: text before it, needles (each with its depth), text after it, and the
    answer items (each starting with its separator, e.g. " 1234567")."""

    intro: str
    needles: list[tuple[float, str]]
    question: str
    items: list[str]
    keys: tuple[str, ...] = ()  # the words its needles are keyed by (niah): no other example of a window may take them


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


def _passkey(rng, depth, avoid=frozenset()):
    key = _number(rng, 5)
    return Parts("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
                 "memorize it. I will quiz you about it afterwards.\n",
                 [(depth, f" The pass key is {key}. Remember it. {key} is the pass key.")],
                 "\nWhat is the pass key? The pass key is", [f" {key}"])


def _niah(rng, depth, keys: int, avoid: frozenset = frozenset()):
    words = rng.sample([w for w in WORDS if w not in avoid], keys)
    values = [_number(rng, 7) for _ in words]
    target = 0
    depths = [depth] + [(depth + (i + 1) / keys) % 1.0 for i in range(keys - 1)]  # distractors spread around it
    needles = [(d, f" One of the special magic numbers for {w} is: {v}.") for d, w, v in zip(depths, words, values)]
    w = words[target]
    return Parts("Some special magic numbers are hidden within the following text. Make sure to memorize them. I "
                 "will quiz you about the numbers afterwards.\n", needles,
                 f"\nWhat is the special magic number for {w} mentioned in the provided text? The special magic "
                 f"number for {w} mentioned in the provided text is", [f" {values[target]}"], tuple(words))


def _variable_tracking(rng, depth, avoid=frozenset(), hops: int = 4):
    names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)) for _ in range(hops + 1)]
    value = _number(rng, 5)
    chain = [f" VAR {names[0]} = {value}."] + [f" VAR {names[i + 1]} = VAR {names[i]}." for i in range(hops)]
    # the chain's links spread from the depth to the end of the text, in order
    needles = [(depth + (1 - depth) * i / (hops + 1), link) for i, link in enumerate(chain)]
    return Parts("Memorize and track the chain(s) of variable assignment hidden in the following text.\n", needles,
                 f"\nQuestion: Find all variables that are assigned the value {value} in the text above. Answer: "
                 f"According to the chain(s) of variable assignment in the text above, {hops + 1} variables are "
                 f"assigned the value {value}, they are:", [f" {n}" for n in names])


TASK_PARTS = {"passkey": _passkey,
              "niah_single": lambda rng, d, avoid=frozenset(): _niah(rng, d, 1, avoid),
              "niah_multikey": lambda rng, d, avoid=frozenset(): _niah(rng, d, 4, avoid),
              "variable_tracking": _variable_tracking}  # task -> (rng, depth, words to avoid) -> Parts


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _boundaries(tokenizer, haystack: list[int]) -> list[int]:
    """Token offsets just after a sentence or line end in `haystack` (where a needle may go)."""
    pieces = tokenizer.convert_ids_to_tokens(haystack)
    return [i + 1 for i, p in enumerate(pieces) if p and p.rstrip("Ġ▁ ").endswith((".", "\n", "Ċ", "<0x0A>"))]


def _fill(task: str, length: int, fixed: int, haystack: list[int]) -> int:
    """Tokens of haystack an example of `length` holds beside its `fixed` tokens (instruction, needles, questions,
    answers); one line when there is no room or too little haystack."""
    fill = length - fixed
    if fill < 1:
        raise SurgeryError(f"--retrieval-lengths: {length} tokens is too short for {task}: its instruction, question, "
                           f"needles and answer alone take {fixed}")
    if len(haystack) < fill:
        raise SurgeryError(f"the haystack text has {len(haystack)} tokens: too short for {task} at {length} tokens "
                           f"(it needs {fill}); give a longer text or use the noise haystack")
    return fill


def _body(tokenizer, hay: list[int], needles: list[tuple[float, list[int]]]) -> list[int]:
    """`hay` with the needles (depth, ids) inserted at the sentence boundaries nearest their depths, in depth order."""
    marks = _boundaries(tokenizer, hay) or list(range(len(hay) + 1))
    body, at = [], 0
    for d, needle in sorted(needles):
        want = round(d * len(hay))
        cut = min((m for m in marks if m >= at), key=lambda m: abs(m - want), default=at)
        body += hay[at:cut] + needle
        at = cut
    return body + hay[at:]


def _assemble(task: str, tokenizer, parts: Parts, length: int, depth: float, haystack: list[int]) -> Example:
    intro, question = _encode(tokenizer, parts.intro), _encode(tokenizer, parts.question)
    needles = [(d, _encode(tokenizer, text)) for d, text in parts.needles]
    items = [_encode(tokenizer, item) for item in parts.items]
    fill = _fill(task, length, len(intro) + len(question) + sum(len(n) for _, n in needles)
                 + sum(len(i) for i in items), haystack)
    ids = intro + _body(tokenizer, haystack[:fill], needles) + question + [t for item in items for t in item]
    assert len(ids) == length, (task, len(ids), length)
    return Example(task, length, depth, ids, items)


@dataclass(frozen=True)
class Packed:
    """Several retrieval examples in one haystack (RULER's multi-query needles, over every task): every example's
    needles hidden in it, then each example's question followed by its answer, in turn."""

    tasks: list[str]
    length: int  # tokens, every answer included
    ids: list[int]
    answers: list[tuple[int, int]]  # example i's answer: ids[start:end]


def make_packed(tokenizer, length: int, questions: list[tuple[str, float]], seed: int,
                haystack_tokens: list[int] | None = None) -> Packed:
    """One example of `length` tokens asking `questions` ((task, needle depth) each) of one haystack: the window's
    text (`haystack_tokens`, read from its start) or RULER's noise. The instructions of its tasks (each once) open it;
    no two questions share a needle's key word, and at most one asks for the pass key (the only one it could mean)."""
    tasks = [t for t, _ in questions]
    if not tasks or any(t not in TASK_PARTS for t in tasks) or tasks.count("passkey") > 1:
        raise SurgeryError(f"a packed retrieval example asks 1 or more of {', '.join(TASK_PARTS)} (the pass key at "
                           f"most once), got {tasks}")
    rng, used, parts = random.Random(f"{seed}/packed/{length}"), frozenset(), []
    for task, depth in questions:
        parts.append(TASK_PARTS[task](rng, depth, used))
        used |= set(parts[-1].keys)
    intro = [t for text in dict.fromkeys(p.intro for p in parts) for t in _encode(tokenizer, text)]
    needles = [(d, _encode(tokenizer, text)) for p in parts for d, text in p.needles]
    asked = [(_encode(tokenizer, p.question), [t for item in p.items for t in _encode(tokenizer, item)])
             for p in parts]
    name = f"{len(tasks)} questions ({', '.join(dict.fromkeys(tasks))})"
    haystack = noise_haystack(tokenizer, length) if haystack_tokens is None else haystack_tokens
    fill = _fill(name, length, len(intro) + sum(len(n) for _, n in needles) + sum(len(q) + len(a) for q, a in asked),
                 haystack)
    ids, answers = intro + _body(tokenizer, haystack[:fill], needles), []
    for question, answer in asked:
        ids += question
        answers.append((len(ids), len(ids) + len(answer)))
        ids += answer
    assert len(ids) == length, (tasks, len(ids), length)
    return Packed(tasks, length, ids, answers)


def noise_haystack(tokenizer, tokens: int) -> list[int]:
    sentence = _encode(tokenizer, " " + NOISE)
    return (sentence * (tokens // len(sentence) + 1))[:tokens]


def _pseudo_word(rng: random.Random) -> str:
    """A pronounceable made-up word (two or three syllables): rare words that never collide with the common ones."""
    return "".join(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(rng.choice((2, 3))))


def _common_words(rng: random.Random, tokenizer, length: int, depth: float, common: int = 10) -> Example:
    """A numbered list of words: `common` words repeated (3 to 30 times each, more for longer examples, as RULER's
    30 against 3), the other words once or twice, shuffled; the question asks for the most common ones (the answer
    lists them in order of first appearance). Noise pads the list to the exact length."""
    intro = _encode(tokenizer, "Below is a numbered list of words. In these words, some appear more often than "
                               "others. Memorize the ones that appear most often.\n")
    question = _encode(tokenizer, f"\nQuestion: What are the {common} most common words in the above list? Answer: "
                                  f"The top {common} words that appear most often in the list are:")
    top = rng.sample(WORDS, common)
    repeats = max(3, min(30, length // 250))
    fixed = len(intro) + len(question) + sum(len(_encode(tokenizer, f" {w}")) for w in top)
    words = [w for w in top for _ in range(repeats)]
    entry = max(len(_encode(tokenizer, f" {len(words)}. {w}")) for w in WORDS)  # the longest an entry can be
    while fixed + entry * (len(words) + 2) < length:
        words += [_pseudo_word(rng)] * rng.choice((1, 2))
    rng.shuffle(words)
    entries = [_encode(tokenizer, f" {i + 1}. {w}") for i, w in enumerate(words)]
    while fixed + sum(map(len, entries)) > length and words:  # too long: the last entries go
        words.pop(), entries.pop()
    order = list(dict.fromkeys(w for w in words if w in top))
    if len(order) < common:
        raise SurgeryError(f"--retrieval-lengths: {length} tokens is too short for common_words: its list cannot hold "
                           f"{common} words {repeats} times each")
    items = [_encode(tokenizer, f" {w}") for w in order]
    body = [t for e in entries for t in e]
    pad = noise_haystack(tokenizer, length - fixed - len(body))
    ids = intro + pad + body + question + [t for item in items for t in item]
    assert len(ids) == length
    return Example("common_words", length, depth, ids, items)


def text_start(text: int, length: int, i: int, samples: int) -> int:
    """Where sample i of `samples` starts reading a text of `text` tokens for an example of `length` tokens: the
    starts spread evenly over [0, text - length] (the first at the text's start, the last at its end)."""
    spare = max(0, text - length)
    return 0 if samples < 2 else (i * spare) // (samples - 1)


def make_examples(task: str, tokenizer, length: int, samples: int, seed: int = 0,
                  haystack_tokens: list[int] | None = None) -> list[Example]:
    """`samples` examples of `task` at `length` tokens, needle depths spread evenly ((i + 0.5) / samples), from
    `seed`; the haystack is `haystack_tokens` (a text's tokens) or RULER's noise. On a text, each sample reads its
    own stretch: their starts are spread evenly from the text's beginning to its last `length` tokens, so the
    stretches are disjoint when the text holds `samples` x `length` tokens (and overlap as little as they can when
    it does not)."""
    if task not in TASKS:
        raise SurgeryError(f"unknown retrieval task {task!r}; choose from {', '.join(TASKS)} (or all)")
    out = []
    for i in range(samples):
        rng = random.Random(f"{seed}/{task}/{length}/{i}")
        depth = (i + 0.5) / samples
        if task == "common_words":
            out.append(_common_words(rng, tokenizer, length, depth))
            continue
        hay = noise_haystack(tokenizer, length) if haystack_tokens is None else \
            haystack_tokens[text_start(len(haystack_tokens), length, i, samples):]
        out.append(_assemble(task, tokenizer, TASK_PARTS[task](rng, depth), length, depth, hay))
    return out
