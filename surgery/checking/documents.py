"""Which documents a check's windows hold: joined (the default) or each window cut from one whole document.

`--documents joined` tokenizes the documents one after another (EOS between) and cuts the stream into windows, as
calibration and training do: at --seq-len 1024 on pydoc's short documents most of a window's far positions see
other documents, so the numbers by position say little about long context. `--documents whole` cuts every window
from a single document at least --seq-len tokens long (a longer one gives several consecutive windows, up to
--tokens in all); shorter documents are skipped, and the report names the documents used. No document long enough:
one line (exit 2) before any model loads; fewer windows than --tokens asks for: a warning.

The default stays `joined` (a check's numbers at the default --seq-len do not move); at a --seq-len of LONG_WINDOW
or more a joined check warns when its windows hold document boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch

from ..data import encode_pieces
from ..errors import SurgeryError

MODES = ("joined", "whole")
LONG_WINDOW = 2048  # a joined check at this --seq-len or more warns when its windows straddle documents
MAX_DOCUMENTS = 1_000_000  # documents read looking for long ones before giving up
NAME_CHARS = 60


def document_name(text: str, index: int) -> str:
    """What the report calls a document: its `name` (surgery.data.Document) or its first words."""
    name = getattr(text, "name", None)
    return name if name else f"#{index}: " + " ".join(text[:400].split())[:NAME_CHARS]


@dataclass
class WholeDocuments:
    """Windows cut from whole documents, and which documents gave them."""

    seq_len: int
    batches: torch.Tensor | None = None  # (windows, seq_len)
    used: list[dict] = field(default_factory=list)  # {"document", "tokens" (read), "windows"} per document used
    read: int = 0  # documents looked at
    longest: int = 0  # tokens of the longest document read (counted up to what a window needed)

    def describe(self) -> dict:
        return {"mode": "whole", "min_tokens": self.seq_len, "read": self.read, "qualified": len(self.used),
                "used": self.used}


def whole_document_windows(texts: Iterable[str], tokenizer, seq_len: int, tokens: int, name: str,
                           warn) -> WholeDocuments:
    """Windows of `seq_len` tokens, each from one document of `texts`, `tokens // seq_len` of them (at least one);
    each document tokenized a piece at a time, and only as far as the windows still wanted need."""
    wanted = max(1, tokens // seq_len)
    out = WholeDocuments(seq_len)
    parts: list[torch.Tensor] = []
    have = 0
    for index, text in enumerate(texts):
        if have >= wanted or out.read >= MAX_DOCUMENTS:
            break
        out.read += 1
        if not text:
            continue
        need = (wanted - have) * seq_len
        ids: list[int] = []
        for piece in encode_pieces(tokenizer, text):
            ids.extend(piece)
            if len(ids) >= need:
                break
        out.longest = max(out.longest, len(ids))
        k = min(len(ids) // seq_len, wanted - have)
        if k:
            parts.append(torch.tensor(ids[:k * seq_len], dtype=torch.long).view(k, seq_len))
            out.used.append({"document": document_name(text, index), "tokens": len(ids), "windows": k})
            have += k
    if not have:
        raise SurgeryError(f"no document of {name} is {seq_len} tokens long (the longest of the {out.read} read: "
                           f"{out.longest} tokens): --documents whole needs one document per window; lower "
                           "--seq-len or check on longer documents (e.g. --data stdlib)")
    if have < wanted:
        warn(f"{name}: only {have} windows of {seq_len} tokens come from whole documents ({len(out.used)} of its "
             f"{out.read} documents are that long), not the {wanted} that --tokens asks for")
    out.batches = torch.cat(parts)
    return out


def straddling_windows(batches: torch.Tensor, separator: int | None) -> int:
    """Windows of a joined stream that hold a document boundary (the separator before their last position)."""
    if separator is None:
        return 0
    return int((batches[:, :-1] == separator).any(dim=1).sum().item())


def warn_straddling(batches: torch.Tensor, tokenizer, name: str, warn) -> int:
    """At a long --seq-len, one line when joined windows straddle documents; returns how many do."""
    seq_len = batches.shape[1]
    separator = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    n = straddling_windows(batches, separator)
    if n and seq_len >= LONG_WINDOW:
        warn(f"{n} of the {batches.shape[0]} windows of {seq_len} tokens of {name} hold several documents (their later "
             "positions see other documents, not a long context): --documents whole cuts each window from one "
             "document (--data stdlib has long ones)")
    return n


def print_table(documents: dict, console) -> None:
    """The documents a --documents whole check used."""
    from rich.table import Table

    table = Table(title=f"windows from whole documents ({documents['qualified']} of {documents['read']} read are "
                        f"{documents['min_tokens']} tokens or longer)")
    for col, justify in (("document", "left"), ("tokens read", "right"), ("windows", "right")):
        table.add_column(col, justify=justify, overflow="fold")
    for d in documents["used"]:
        table.add_row(d["document"], str(d["tokens"]), str(d["windows"]))
    console.print(table)
