"""Streamed training data: documents read lazily, tokenized on the fly (in DataLoader workers), packed into windows.

Nothing here grows with `--tokens`: a reader holds one batch of documents and one window at a time, and the run's
data position is a few integers per source and reader, saved as JSON in every checkpoint.

Sources. Each `--data` is a list of *units* read in order (a local file; the whole of pydoc or a hub dataset is one
unit), each unit a sequence of documents. The first documents of every source (its share of `--eval-tokens`, by
`--data-weights`) are held out for evaluation and never trained on; `held[u]` counts those taken from unit `u`.

Readers. A run has R = processes x max(1, --data-workers) readers; reader `role` reads a disjoint part of every
source: the units `role, role+R, ...` when a source has at least R units (by file; their order reshuffled, seeded,
for each further epoch), else every R-th document of the source (by document). A reader packs each source's
documents (EOS after each) into `--seq-len` windows, reads them in blocks of BLOCK_TOKENS tokens and hands each
block out in a seeded order (so a step's windows come from many documents); with several sources it picks the
source of each next window with its own seeded generator in proportion to the weights. Its position is, per
source, where the current block began (epoch, documents read in the epoch, tokens used of the current document),
the block's number and how many of its windows were handed out, plus the generator's state: re-reading (not
re-tokenizing) that many documents, then tokenizing the one block again, puts it back where it was.

Order. Process `rank` reads its readers through a torch DataLoader, which takes items from workers 0, 1, .., W-1,
0, .. in turn; each optimizer step takes the process's next B/processes windows. A resumed process that had read
`c` windows starts its worker `j` as reader `(j + c) mod W`, so the round continues where it stopped: a resumed run
reads exactly the windows the uninterrupted one would have.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from ..errors import SurgeryError
from ..data import PIECE_CHARS, encode_pieces, txt_documents
from ..general_text import hub_file_texts, is_hub_file, say_fallback

TOKENIZE_BATCH = 64  # documents per tokenizer call in a reader
BLOCK_TOKENS = 1 << 18  # a reader's windows are shuffled within blocks of this many tokens (1 MiB of int32)
STATE_FILE = "data-{rank}.json"  # a process's data position, in each checkpoint folder


# ------------------------------------------------------------------------------------------------ sources
@dataclass(frozen=True)
class Source:
    spec: str
    weight: float
    units: tuple[str, ...]  # local files; ("",) for pydoc and hub datasets (one unit)


def parse_weights(weights: str | list | None, count: int, flag: str = "--data-weights",
                  data_flag: str = "--data") -> list[float]:
    """`--data-weights 0.7,0.3` -> normalised weights, one per `--data`; equal weights when not given. (`flag`,
    `data_flag`: how the front end spells the two options, `data_weights` and `data` in a recipe.)"""
    if weights is None or weights == "" or weights == []:
        return [1.0 / count] * count
    items = weights.split(",") if isinstance(weights, str) else list(weights)
    try:
        values = [float(w) for w in items]
    except (TypeError, ValueError):
        raise SurgeryError(f"{flag} {weights!r}: not a comma-separated list of numbers") from None
    if len(values) != count:
        raise SurgeryError(f"{flag} gives {len(values)} weight(s) for {count} {data_flag} source(s): give one "
                           f"per source")
    if not all(np.isfinite(v) and v > 0 for v in values):
        raise SurgeryError(f"{flag} must all be positive numbers, got {weights}")
    top = max(values)  # scaled by the largest first: a sum of huge weights (1e308 + 1e308) would overflow to inf
    scaled = [v / top for v in values]
    if not all(v > 0 for v in scaled):
        raise SurgeryError(f"{flag} {weights}: the weights differ too much in size (a ratio beyond floating point)")
    total = sum(scaled)
    return [v / total for v in scaled]


def resolve_sources(specs: list[str], weights: list[float]) -> list[Source]:
    from ..data import BUILDERS, local_files

    out = []
    for spec, w in zip(specs, weights):
        say_fallback(spec)  # `general` offline: its one line, here in the training process, before any worker
        files = [] if spec == "pydoc" else local_files(spec)
        if files:
            if len({Path(f).suffix for f in files}) != 1 or Path(files[0]).suffix not in BUILDERS:
                raise SurgeryError(f"data files must share one of the suffixes {', '.join(BUILDERS)}: got "
                                   f"{', '.join(files[:3])}")
            out.append(Source(spec, w, tuple(files)))
        elif spec != "pydoc" and (any(c in spec for c in "*?[") or Path(spec).suffix in BUILDERS
                                  or spec.startswith((".", "/", "~"))):
            raise SurgeryError(f"data {spec} matches no file")
        else:
            out.append(Source(spec, w, ("",)))
    return out


def fingerprint(sources: list[Source]) -> list[dict]:
    """What a resumed run must find again: each source's spec, weight and files (with their sizes)."""
    def size(f):
        return os.path.getsize(f) if f else None

    return [{"spec": s.spec, "weight": round(s.weight, 12), "files": [[Path(f).name, size(f)] for f in s.units if f]}
            for s in sources]


@dataclass(frozen=True)
class Plan:
    """Everything a reader needs, picklable into DataLoader workers."""
    sources: tuple[Source, ...]
    held: tuple[tuple[int, ...], ...]  # per source, per unit: documents held out for evaluation
    tokenizer: object
    eos: int
    seq_len: int
    seed: int
    readers: int  # R: processes x workers
    epochs: int  # passes each source may make (then it has run dry)
    text_field: str = "text"
    streaming: bool = False
    txt_unit: str = "paragraph"  # what one document of a .txt file is (surgery.data.txt_documents)
    chat_template: str = "auto"  # how a `messages` column is read (surgery/chat.py)

    def chat(self):
        """The conversations' format (None before the tokenizer is known: a messages column read plainly)."""
        from ..chat import ChatFormat

        return ChatFormat(self.chat_template, self.tokenizer) if self.tokenizer is not None else None

    def cut(self, s: int) -> tuple[int, int] | None:
        """(unit, tokens) when source `s`'s held-out split ends inside its last document (Held.cut), else None."""
        cuts = getattr(self.held, "cut", ())
        return cuts[s] if s < len(cuts) else None

    def unit_texts(self, s: int, u: int, shard: int | None = None) -> Iterator[str]:
        """The raw documents of unit `u` of source `s`, in order (blank ones included, so indices are stable);
        `shard`: only that one of `readers` contiguous parts of a streamed hub dataset's shards."""
        from ..data import pydoc_texts

        source = self.sources[s]
        unit = source.units[u]
        if source.spec == "pydoc":
            yield from pydoc_texts()
        elif is_hub_file(source.spec):  # one data file of a hub dataset at a revision (the `general` default)
            yield from (t if isinstance(t, str) else "" for t in hub_file_texts(source.spec, self.text_field))
        elif unit.endswith(".txt"):
            yield from txt_documents(unit, self.txt_unit)  # read lazily: never the whole file at once
        else:
            ds = self._dataset(source, unit)
            if shard is not None:
                ds = ds.shard(num_shards=self.readers, index=shard, contiguous=True)
            for batch in _batches(ds, unit or source.spec, self.text_field, chat=self.chat()):
                for t in batch:
                    yield t if isinstance(t, str) else ""

    def hub_shards(self, s: int) -> int:
        """How many shards (files) a streamed hub dataset source has; 0 for anything else."""
        source = self.sources[s]
        if source.units != ("",) or source.spec == "pydoc" or not self.streaming or is_hub_file(source.spec):
            return 0
        return int(getattr(self._dataset(source, ""), "n_shards", 0) or 0)

    def _dataset(self, source: Source, unit: str):
        import datasets

        from ..data import BUILDERS, parse_hub_spec

        try:
            if unit:
                return datasets.load_dataset(BUILDERS[Path(unit).suffix], data_files=[unit], split="train",
                                             streaming=True)
            name, config, split, revision = parse_hub_spec(source.spec)
            return datasets.load_dataset(name, config, split=split, streaming=self.streaming, revision=revision)
        except Exception as e:  # datasets raises many kinds for unreadable files and unknown datasets
            raise SurgeryError(f"cannot read data {unit or source.spec}: {str(e).splitlines()[0]}") from None


def _batches(ds, label: str, text_field: str = "text", size: int = 256, chat=None) -> Iterator[list]:
    """Rows of `ds` in batches, through `iter` (a DataLoader worker iterating a streamed dataset directly would get
    only its worker's share of the dataset's shards: datasets splits them by worker itself); a `messages` column's
    conversations rendered as `chat` (surgery/chat.py) says."""
    from ..chat import MESSAGES, ChatFormat

    chat = chat if chat is not None else ChatFormat("off")
    try:
        for batch in ds.iter(batch_size=size):
            if chat.reads_messages(list(batch), text_field):
                yield [chat.render(m, label) for m in batch[MESSAGES]]
                continue
            yield batch[text_field] if text_field in batch else _no_column(batch, label, text_field)
    except SurgeryError:
        raise
    except Exception as e:  # a malformed row, an unreachable shard
        raise SurgeryError(f"cannot read data {label}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def _no_column(batch: dict, label: str, text_field: str):
    raise SurgeryError(f"data {label} has no column {text_field!r} (columns: {', '.join(batch)}); use --text-field")


# ------------------------------------------------------------------------------------------------ held out
class Held(tuple):
    """Per source, per unit: how many documents are held out for evaluation (never trained on). `cut[s]`: None, or
    (unit, tokens) when the held-out split of source `s` ends inside the source's last document (too few documents
    to hold out whole ones): that document, the one after the unit's held-out ones, has its first `tokens` tokens
    held out and the rest trained on."""

    cut: tuple = ()

    @classmethod
    def of(cls, counts, cut=None) -> "Held":
        held = cls(tuple(c) for c in counts)
        held.cut = tuple(cut) if cut is not None else (None,) * len(held)
        return held


def hold_out(plan_args: dict, sources: list[Source], eval_tokens: int) -> tuple[torch.Tensor, Held]:
    """The first documents of every source, packed into its share of the held-out windows (by weight); returns the
    windows and, per source and unit, how many documents they took (`Held`). A source with no document left after
    them (one document, a single file read with --txt-unit file) gives only the first tokens of its last document."""
    seq_len = plan_args["seq_len"]
    total = -(-eval_tokens // seq_len) if eval_tokens else 0
    shares = _split(total, [s.weight for s in sources])
    plan = Plan(sources=tuple(sources), held=tuple((0,) * len(s.units) for s in sources), **plan_args)
    windows, held, cuts = [], [], []
    for s, (source, n) in enumerate(zip(sources, shares)):
        counts = [0] * len(source.units)
        need, parts, have, inside = n * seq_len, [], 0, None
        texts = ((u, t) for u in range(len(source.units)) for t in plan.unit_texts(s, u)) if need else iter(())
        for u, text in texts:
            counts[u] += 1
            if text.strip():
                before = have
                for ids in (*_pieces_until(plan.tokenizer, text, need - have), [plan.eos]):
                    parts.append(np.asarray(ids, dtype=np.int32))
                    have += len(ids)
                # the split ends before this document's last token: (unit, its tokens held out)
                inside = (u, need - before) if have - 1 > need else None
            if have >= need:
                break
        if have < need:
            raise SurgeryError(f"data {source.spec} holds only {have} tokens, fewer than its {need} held-out tokens "
                               f"(--eval-tokens)")
        cut = None
        if inside is not None and not any(t.strip() for _, t in texts) and plan.hub_shards(s) < plan.readers:
            counts[inside[0]] -= 1  # nothing after it: the rest of the document is trained on
            cut = inside
        if n:
            windows.append(torch.from_numpy(np.concatenate(parts)[:need].reshape(n, seq_len).copy()))
        held.append(tuple(counts))
        cuts.append(cut)
    eval_windows = torch.cat(windows) if windows else torch.zeros(0, seq_len, dtype=torch.int32)
    return eval_windows, Held.of(held, cuts)


def _pieces_until(tokenizer, text: str, need: int) -> Iterator[list[int]]:
    """A document's token pieces until `need` tokens are there (a long document is not tokenized past them)."""
    for ids in encode_pieces(tokenizer, text):
        yield ids
        need -= len(ids)
        if need <= 0:
            return


def _split(total: int, weights: list[float]) -> list[int]:
    """`total` split in proportion to `weights` (largest remainders)."""
    raw = [total * w for w in weights]
    out = [int(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: out[i] - raw[i])[: total - sum(out)]:
        out[i] += 1
    return out


# ------------------------------------------------------------------------------------------------ one reader
class Sequential:
    """One reader's windows of one source in document order, from a position (epoch, documents read in the epoch,
    tokens used of the current document)."""

    def __init__(self, plan: Plan, s: int, role: int, position: dict | None):
        self.plan, self.s, self.role = plan, s, role
        pos = position or {"epoch": 0, "doc": 0, "offset": 0}
        self.epoch, self.doc, self.offset = int(pos["epoch"]), int(pos["doc"]), int(pos["offset"])
        self.skipped = int((position or {}).get("skipped", 0))  # blank documents passed over
        self.tokens = int((position or {}).get("tokens", 0))  # tokens read into windows
        self._docs = self._tokenized()
        self._current = None  # the current document's tokens (EOS at the end)

    def position(self) -> dict:
        return {"epoch": self.epoch, "doc": self.doc, "offset": self.offset, "skipped": self.skipped,
                "tokens": self.tokens}

    def _units(self, epoch: int) -> tuple[list[int], bool]:
        """The units this reader reads in `epoch` and whether it reads them whole (by file) or every R-th document."""
        n, R = len(self.plan.sources[self.s].units), self.plan.readers
        if n >= R:
            mine = list(range(self.role, n, R))
            if epoch:
                np.random.default_rng([self.plan.seed, self.s, self.role, epoch]).shuffle(mine)
            return mine, True
        return list(range(n)), False

    def _raw(self, epoch: int) -> Iterator[str]:
        """This reader's raw documents of `epoch`, the held-out ones left out."""
        plan, R = self.plan, self.plan.readers
        if plan.hub_shards(self.s) >= R:  # a streamed hub dataset with enough shards: contiguous shards per reader
            held = plan.held[self.s][0] if self.role == 0 else 0  # the first documents are the first shard's
            for i, text in enumerate(plan.unit_texts(self.s, 0, shard=self.role)):
                if i >= held:
                    yield text
            return
        units, whole = self._units(epoch)
        cut = plan.cut(self.s)
        index = 0  # documents of the source after the held-out ones, by document
        for u in units:
            held = plan.held[self.s][u]
            for i, text in enumerate(plan.unit_texts(self.s, u)):
                if i < held:
                    continue
                if whole or index % R == self.role:
                    yield _Cut.of(text, cut[1]) if cut is not None and cut[0] == u and i == held else text
                index += 1

    def _tokenized(self) -> Iterator[list[int] | None]:
        """Documents of this reader from the saved position onward, tokenized in batches; None for a blank one."""
        plan = self.plan
        while True:
            raw = self._raw(self.epoch)
            for i in range(self.doc):  # resumed: re-read, without tokenizing, what was read before
                if next(raw, None) is None:  # a saved position lies within what this reader has to read
                    raise bad_position(f"document {self.doc} of epoch {self.epoch}, but this reader's part of data "
                                       f"{plan.sources[self.s].spec} holds {i} documents")
            batch, read_any = [], self.doc > 0
            for text in raw:
                batch.append(text)
                read_any = True
                if len(batch) == TOKENIZE_BATCH:
                    yield from self._encode(batch)
                    batch = []
            yield from self._encode(batch)
            if not read_any:
                raise SurgeryError(f"data {plan.sources[self.s].spec} has too few documents or files to give each of "
                                   f"the {plan.readers} readers (processes x --data-workers) some")
            if self.epoch + 1 >= plan.epochs:
                raise SurgeryError(
                    f"data {plan.sources[self.s].spec} ran dry after {plan.epochs} pass(es) over its documents, "
                    f"before --tokens: --resume with a higher --data-epochs reads it again")
            self.epoch, self.doc, self.offset = self.epoch + 1, 0, 0

    def _encode(self, batch: list[str]) -> Iterator[Iterator[list[int]] | None]:
        """Each document as its token pieces (EOS last): the short ones tokenized together, a long one piece by
        piece as the windows need them; None for a blank one."""
        short = [str(t) for t in batch if t.strip() and len(t) <= PIECE_CHARS]
        ids = iter(self.plan.tokenizer(short, add_special_tokens=False)["input_ids"]) if short else iter(())
        for t in batch:
            if not t.strip():
                yield None
                continue
            if len(t) <= PIECE_CHARS:
                pieces = iter((next(ids) + [self.plan.eos],))
            else:
                pieces = _with_eos(encode_pieces(self.plan.tokenizer, t), self.plan.eos)
            yield _after(pieces, t.held) if isinstance(t, _Cut) else pieces

    def window(self) -> np.ndarray:
        """The next window of `seq_len` tokens; the position moves past it."""
        need, parts = self.plan.seq_len, []
        while need:
            if self._current is None:
                pieces = next(self._docs)
                current = _Document(pieces) if pieces is not None else None
                if self.offset:  # only a resumed position starts inside a document: it must lie inside it
                    skipped = current.skip(self.offset) if current is not None else 0
                    if skipped < self.offset or current.done():
                        raise bad_position(f"token {self.offset} of a document of {skipped} tokens (document "
                                           f"{self.doc} of data {self.plan.sources[self.s].spec})")
                if current is None:
                    self.skipped += 1
                    self.doc += 1
                    continue
                self._current = current
            take = self._current.take(need)
            parts.extend(take)
            self.offset += len(take)
            need -= len(take)
            if self._current.done():
                self._current, self.doc, self.offset = None, self.doc + 1, 0
        self.tokens += self.plan.seq_len
        return np.asarray(parts, dtype=np.int32)


class _Cut(str):
    """The document in which a source's held-out split ends (Held.cut): its first `held` tokens are not trained on."""

    held: int = 0

    @classmethod
    def of(cls, text: str, held: int) -> "_Cut":
        cut = cls(text)
        cut.held = held
        return cut


def _after(pieces: Iterator[list[int]], n: int) -> Iterator[list[int]]:
    """A document's token pieces without its first `n` tokens."""
    for ids in pieces:
        if n >= len(ids):
            n -= len(ids)
            continue
        yield ids[n:]
        n = 0


def _with_eos(pieces: Iterator[list[int]], eos: int) -> Iterator[list[int]]:
    yield from pieces
    yield [eos]


class _Document:
    """One document's tokens, read piece by piece (a long document is tokenized only as far as the windows need)."""

    def __init__(self, pieces: Iterator[list[int]]):
        self.pieces, self.buf, self.pos = iter(pieces), [], 0

    def _more(self) -> bool:
        while self.pos == len(self.buf):
            nxt = next(self.pieces, None)
            if nxt is None:
                return False
            self.buf, self.pos = nxt, 0
        return True

    def take(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n and self._more():
            k = min(n - len(out), len(self.buf) - self.pos)
            out.extend(self.buf[self.pos : self.pos + k])
            self.pos += k
        return out

    def skip(self, n: int) -> int:
        """Pass over `n` tokens (a resumed position); how many there were."""
        done = 0
        while done < n and self._more():
            k = min(n - done, len(self.buf) - self.pos)
            self.pos += k
            done += k
        return done

    def done(self) -> bool:
        return not self._more()


class Reader:
    """One reader over every source: each window's source drawn by weight with the reader's own generator."""

    def __init__(self, plan: Plan, role: int, state: dict | None):
        self.plan, self.role = plan, role
        state = state or {}
        positions = state.get("sources") or [None] * len(plan.sources)
        self.sources = [SourceReader(plan, s, role, positions[s]) for s in range(len(plan.sources))]
        self.windows = [int(c) for c in state.get("windows", [0] * len(plan.sources))]
        self.rng = np.random.default_rng([plan.seed, role, 0x5eed])
        if "rng" in state:
            self.rng.bit_generator.state = state["rng"]
        self.cumulative = np.cumsum([s.weight for s in plan.sources])

    def state(self) -> dict:
        return {"sources": [s.position() for s in self.sources], "windows": list(self.windows),
                "rng": self.rng.bit_generator.state}

    def __iter__(self):
        while True:
            s = 0
            if len(self.sources) > 1:
                s = min(int(np.searchsorted(self.cumulative, self.rng.random() * self.cumulative[-1], side="right")),
                        len(self.sources) - 1)
            window = self.sources[s].window()
            self.windows[s] += 1
            yield window, s


class SourceReader:
    """One reader's windows of one source, shuffled within blocks: the next `block` windows in document order are
    read (BLOCK_TOKENS tokens, a constant whatever --tokens) and handed out in a seeded order, so that a step's
    windows come from many documents, as the packed path's shuffled windows do. The position is the document
    position where the block began, the block's number and how many of its windows were handed out: a resumed
    reader reads the block again and skips those."""

    def __init__(self, plan: Plan, s: int, role: int, position: dict | None):
        self.plan, self.s, self.role = plan, s, role
        pos = position or {}
        self.seq = Sequential(plan, s, role, pos.get("start"))
        self.start = self.seq.position()
        self.block_index, self.emitted = int(pos.get("block", 0)), int(pos.get("emitted", 0))
        self.size = max(1, BLOCK_TOKENS // plan.seq_len)
        self.windows: list[np.ndarray] | None = None
        self.dry: SurgeryError | None = None  # the source ran dry (or failed) while a block was read

    def position(self) -> dict:
        return {"start": self.start, "block": self.block_index, "emitted": self.emitted,
                "skipped": self.seq.skipped, "tokens": self.seq.tokens}

    def _fill(self) -> None:
        if self.dry is not None:
            raise self.dry
        self.start, windows = self.seq.position(), []
        try:
            while len(windows) < self.size:
                windows.append(self.seq.window())
        except SurgeryError as e:
            self.dry = e
            if not windows:
                raise
        self.windows = windows
        self.order = np.random.default_rng([self.plan.seed, self.s, self.role, self.block_index]).permutation(
            len(windows))

    def window(self) -> np.ndarray:
        if self.windows is None:
            self._fill()  # a fresh reader, or a resumed one: its block read again (`emitted` already handed out)
        if self.emitted >= len(self.windows):
            self.block_index, self.emitted = self.block_index + 1, 0
            self._fill()
        self.emitted += 1
        return self.windows[self.order[self.emitted - 1]]


def check_readers(plan: Plan) -> None:
    """Every local source (and pydoc) gives every reader a document that is not blank in its first epoch, after the
    held-out ones: checked before the model loads and before the run folder exists (a worker would find out only
    after both). Reads no further than each reader's first such document; a hub dataset is left to the workers."""
    for s, source in enumerate(plan.sources):
        if source.units == ("",) and source.spec != "pydoc":
            continue
        for role in range(plan.readers):
            if not any(t.strip() for t in Sequential(plan, s, role, None)._raw(0)):
                if role == 0:
                    raise SurgeryError(f"data {source.spec} holds no text"
                                       + (" after the held-out documents (--eval-tokens)" if any(plan.held[s]) else ""))
                raise SurgeryError(f"data {source.spec} has too few documents or files to give each of the "
                                   f"{plan.readers} readers (processes x --data-workers) some: lower --data-workers")


def early_check(specs: list[str], weights: list[float], readers: int, **plan_args) -> None:
    """check_readers before the tokenizer is loaded (nothing held out yet)."""
    sources = resolve_sources(specs, weights)
    check_readers(Plan(sources=tuple(sources), held=tuple((0,) * len(s.units) for s in sources), tokenizer=None,
                       eos=0, seq_len=1, seed=0, readers=readers, epochs=1, **plan_args))


def bad_position(where: str) -> SurgeryError:
    """A saved data position past what the data holds: the checkpoint was altered, or the data changed under it."""
    return SurgeryError(f"--resume: the data position in the checkpoint is not valid: it points at {where}")


def check_state(state, plan: Plan) -> None:
    """A saved reader state of the right shape (numbers where numbers belong), else one line."""
    try:
        positions = state["sources"]
        if len(positions) != len(plan.sources) or len(state["windows"]) != len(plan.sources):
            raise ValueError("one entry per source expected")
        for p in positions:
            for q, keys in ((p, ("block", "emitted")), (p["start"], ("epoch", "doc", "offset", "skipped", "tokens"))):
                for k in keys:
                    if not isinstance(q[k], int) or isinstance(q[k], bool) or q[k] < 0:
                        raise ValueError(f"{k} is not a count")
            if p["start"]["epoch"] >= plan.epochs or p["emitted"] > max(1, BLOCK_TOKENS // plan.seq_len):
                raise ValueError("an epoch beyond --data-epochs, or more windows than a block holds")
        if not all(isinstance(c, int) and c >= 0 for c in state["windows"]):
            raise ValueError("windows are not counts")
        np.random.default_rng().bit_generator.state = state["rng"]
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise SurgeryError(f"--resume: the data position in the checkpoint is not valid ({e})") from None


# ------------------------------------------------------------------------------------------------ loader
class WindowStream(torch.utils.data.IterableDataset):
    """The readers of one process, one per DataLoader worker (rotated on resume: see the module's docstring)."""

    def __init__(self, plan: Plan, rank: int, workers: int, states: dict[int, dict], rotation: int):
        self.plan, self.rank, self.workers, self.states, self.rotation = plan, rank, workers, states, rotation

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        local = ((info.id if info else 0) + self.rotation) % max(1, self.workers)
        role = self.rank * max(1, self.workers) + local
        reader = Reader(self.plan, role, self.states.get(role))
        try:
            for window, s in reader:
                # bytes and plain containers: cheap to pass from a worker (a tensor would go through shared memory)
                yield {"ids": window.tobytes(), "source": s, "role": role, "state": reader.state()}
        except SurgeryError as e:  # a worker's exception would reach the main process with its traceback as text
            yield {"error": str(e)}


@dataclass
class StreamedData:
    """The training windows of one process, streamed; held-out windows in memory (they do not grow with --tokens)."""
    plan: Plan
    eval: torch.Tensor
    rank: int
    world: int
    workers: int
    other: torch.Tensor | None = None
    consumed: int = 0  # windows this process has taken
    states: dict = field(default_factory=dict)  # reader role -> its state after the last window taken
    _it: object = None

    @property
    def seq_len(self) -> int:
        return self.plan.seq_len

    def _loader(self):
        if self._it is None:
            rotation = self.consumed % max(1, self.workers)
            stream = WindowStream(self.plan, self.rank, self.workers,
                                  {int(k): v for k, v in self.states.items()}, rotation)
            loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=self.workers,
                                                 prefetch_factor=4 if self.workers else None,
                                                 multiprocessing_context="fork" if self.workers else None)
            self._it = iter(loader)
        return self._it

    def take(self, count: int) -> torch.Tensor:
        """This process's next `count` windows, [count, seq_len] int64."""
        rows = []
        for _ in range(count):
            item = next(self._loader())
            if "error" in item:
                raise SurgeryError(item["error"])
            rows.append(torch.from_numpy(np.frombuffer(item["ids"], dtype=np.int32).astype(np.int64)))
            self.states[int(item["role"])] = item["state"]
            self.consumed += 1
        return torch.stack(rows)

    def step_batch(self, step: int, sequences_per_step: int, rank: int, world: int) -> torch.Tensor:
        return self.take(sequences_per_step // world)

    def state_dict(self) -> dict:
        return {"format": "surgery-data-stream/1", "rank": self.rank, "world": self.world, "workers": self.workers,
                "consumed": self.consumed, "readers": {str(k): v for k, v in sorted(self.states.items())}}

    def load_state_dict(self, state: dict, expect_consumed: int) -> None:
        """A checkpoint's position of this process, checked against the run before anything is read."""
        try:
            ok = (state["format"] == "surgery-data-stream/1" and isinstance(state["consumed"], int)
                  and isinstance(state["readers"], dict))
        except (KeyError, TypeError):
            ok = False
        if not ok:
            raise SurgeryError("--resume: the data position in the checkpoint is not valid (not a stream position)")
        if state.get("world") != self.world or state.get("workers") != self.workers:
            raise SurgeryError(f"--resume: the run read its data with {state.get('world')} process(es) x "
                               f"{state.get('workers')} --data-workers; resume it with the same (now {self.world} x "
                               f"{self.workers})")
        if state["consumed"] != expect_consumed:
            raise SurgeryError(f"--resume: the data position in the checkpoint ({state['consumed']} windows read) does "
                               f"not match its step ({expect_consumed} windows): the checkpoint was altered")
        R = max(1, self.workers)
        for k, v in state["readers"].items():
            if not (str(k).isdigit() and self.rank * R <= int(k) < (self.rank + 1) * R):
                raise SurgeryError(f"--resume: the data position in the checkpoint names reader {k}, not one of "
                                   f"process {self.rank}'s")
            check_state(v, self.plan)
        self.states = {int(k): v for k, v in state["readers"].items()}
        self.consumed = state["consumed"]
        self._it = None

    def shares(self) -> dict:
        """Windows taken so far per source, tokens read and blank documents passed over (this process's readers)."""
        n = len(self.plan.sources)
        windows = [sum(st["windows"][s] for st in self.states.values()) for s in range(n)]
        skipped = sum(p["skipped"] for st in self.states.values() for p in st["sources"])
        return {"windows": windows, "skipped": skipped, "tokens": self.consumed * self.seq_len}

    def close(self) -> None:
        it, self._it = self._it, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()


def data_key(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]
