"""Streamed training data, its sources: each `--data` resolved into a list of *units* read in order (a local file; the
whole of pydoc or a hub dataset is one unit), each unit a sequence of documents; `--data-weights`; what a resumed
run must find again (fingerprint); and the Plan every reader shares, which reads a unit's raw documents.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import SurgeryError
from ..data import txt_documents
from ..general_text import hub_file_texts, is_hub_file, say_fallback

@dataclass(frozen=True)
class Source:
    spec: str
    weight: float
    units: tuple[str, ...]  # local files (stdlib: its modules); ("",) for pydoc and hub datasets (one unit)


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
    from ..data import BUILDERS, local_files, stdlib_files

    out = []
    for spec, w in zip(specs, weights):
        say_fallback(spec)  # `general` offline: its one line, here in the training process, before any worker
        if spec == "stdlib":  # the standard library's modules, one file a unit and a document (surgery.data)
            out.append(Source(spec, w, tuple(str(f) for f in stdlib_files())))
            continue
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
        elif source.spec == "stdlib":
            yield Path(unit).read_text(encoding="utf-8", errors="replace")
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
