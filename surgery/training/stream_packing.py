"""Streamed training data, one reader's part of one source: its documents (the units `role, role+R, ...` when the
source has at least R units, their order reshuffled, seeded, for each further epoch; else every R-th document),
tokenized in batches (a long document piece by piece) and packed, EOS after each, into `--seq-len` windows in
document order. The position is (epoch, documents read in the epoch, tokens used of the current document):
re-reading (not re-tokenizing) that many documents puts a resumed reader back where it was. And the checks, before
the model loads, that every reader gets some text.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from ..errors import SurgeryError
from ..data import PIECE_CHARS, encode_pieces
from .stream_sources import Plan, resolve_sources

TOKENIZE_BATCH = 64  # documents per tokenizer call in a reader


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
