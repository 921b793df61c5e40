"""Calibration text: which documents, in which order, cut into windows, and the record of what was read.

`surgery check` (and `compare-merges`) evaluate on pydoc from its FIRST document on; calibration on `pydoc` reads
whole documents from the LAST one backwards, so the two never share a document as long as calibration +
evaluation tokens fit in pydoc's ~113k tokens (SmolLM2 tokenizer). Any other source is read from its start.
Each document that contributed tokens is recorded by the sha256 of its text (`documents_sha256`), so that
`check` can warn when its evaluation text overlaps what calibrated the model. Several sources (`--calib A --calib B`)
mix domains: each gives an equal share of the windows, read as it would be alone. `--calib-retrieval-mix P` replaces a
fraction P of the windows by retrieval examples built from their own text (surgery/calibration/retrieval.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..data import dataset_commits, load_texts, pydoc_texts, token_stream
from ..errors import SurgeryError
from ..general_text import resolve_texts, say_fallback

WINDOW = 512  # calibration window length (tokens); capped by the model's context
PYDOC_SPLIT = ("pydoc documents read from the last one backwards (the default `surgery check` text, pydoc's first "
               "16k tokens, is not used)")
OTHER_SPLIT = "first tokens of the data"


@dataclass
class CalibrationText:
    """The calibration tokens as windows, and where they came from."""

    windows: torch.Tensor  # [N, L] token ids
    data: str
    split: str
    documents_sha256: list[str]
    mixture: list[dict] | None = None  # several texts: each one's share ({"data", "tokens", "windows"})
    data_commits: dict[str, str | None] | None = None  # each hub dataset's resolved commit (surgery/data.py)
    chat: dict | None = None  # the conversations read from a messages column, and how (surgery.chat.chat_record)
    retrieval: list | None = None  # the windows holding retrieval examples (calibration.retrieval.RetrievalWindow)
    retrieval_record: dict | None = None  # what surgery.json records of --calib-retrieval-mix

    @property
    def tokens(self) -> int:
        return int(self.windows.numel())

    def record(self) -> dict:
        """The `surgery.json` "calibration" fields about the text."""
        record = {"data": self.data, "split": self.split, "tokens": self.tokens, "windows": int(self.windows.shape[0]),
                  "window_length": int(self.windows.shape[1]), "documents_sha256": self.documents_sha256}
        return (record | ({"mixture": self.mixture} if self.mixture else {})
                | ({"data_commits": self.data_commits} if self.data_commits else {})
                | ({"chat": self.chat} if self.chat else {})
                | ({"retrieval_mix": self.retrieval_record} if self.retrieval_record else {}))


def calibration_texts(spec: str, text_field: str = "text", chat=None):
    """Documents in calibration order: pydoc from its last document backwards, anything else from its start
    (conversations rendered as `chat`, a surgery.chat.ChatFormat, says)."""
    if spec == "pydoc":
        say_fallback(spec)  # `general` offline: its one line
        return list(reversed(pydoc_texts()))
    return load_texts(spec, text_field=text_field, chat=chat)


def context_of(config: dict) -> int | None:
    """The model's context length from config.json, when it says."""
    return next((int(config[k]) for k in ("max_position_embeddings", "n_positions", "seq_length") if config.get(k)),
                None)


def calibration_text(spec: str | Sequence[str], tokenizer, tokens: int, context: int | None,
                     text_field: str = "text", window: int = WINDOW, chat_template: str = "auto",
                     retrieval_mix: float = 0.0, seed: int = 0) -> CalibrationText:
    """`tokens` calibration tokens of `spec` as [N, L] windows (L = `window`, or the context when shorter), a
    fraction `retrieval_mix` of them replaced by retrieval examples chosen and drawn from `seed` (refused in one line,
    before any text is read, when the windows are too short for them).

    Several specs mix domains: each gives an equal share of the N windows (the first ones one more when N does not
    divide), read as that spec alone would be (pydoc from its last document, anything else from its start).
    A `messages` column is read per `chat_template` (surgery/chat.py)."""
    from ..chat import ChatFormat, chat_record

    chat = ChatFormat(chat_template, tokenizer)
    specs = resolve_texts([spec] if isinstance(spec, str) else spec)  # `general`: C4 from the hub, or pydoc
    if not specs:
        raise SurgeryError("no calibration text given")
    if tokens < 1:
        raise SurgeryError(f"--calib-tokens must be positive, got {tokens}")
    if window < 2:
        raise SurgeryError(f"--calib-window must be at least 2, got {window}")
    length = min(window, context or window, tokens)
    if retrieval_mix:
        from .retrieval import calibration_mix

        calibration_mix(retrieval_mix, seed, tokenizer, length)  # a bad fraction, too short windows: refused now
    if len(specs) == 1:
        text = _windows(specs[0], tokenizer, tokens, length, text_field, chat)
        text.chat = chat_record(chat)
        return _with_retrieval(text, tokenizer, retrieval_mix, seed)
    n = tokens // length
    if n < len(specs):
        raise SurgeryError(f"--calib-tokens {tokens} makes fewer windows of {length} than the {len(specs)} "
                           f"calibration texts")
    parts = [_windows(one, tokenizer, (n // len(specs) + (i < n % len(specs))) * length, length, text_field, chat)
             for i, one in enumerate(specs)]
    short = next((p for p in parts if p.windows.shape[1] < length), None)
    if short is not None:
        raise SurgeryError(f"calibration data {short.data} gave only {short.tokens} token(s), less than one window "
                           f"of {length}")
    text = CalibrationText(torch.cat([p.windows for p in parts]), " + ".join(specs), "mixture: " + "; ".join(
        f"{p.data}: {p.split}" for p in parts), [h for p in parts for h in p.documents_sha256],
        [{"data": p.data, "tokens": p.tokens, "windows": int(p.windows.shape[0])} for p in parts],
        {k: v for p in parts for k, v in (p.data_commits or {}).items()} or None, chat_record(chat))
    return _with_retrieval(text, tokenizer, retrieval_mix, seed)


def _with_retrieval(text: CalibrationText, tokenizer, fraction: float, seed: int) -> CalibrationText:
    """`text` with a fraction `fraction` of its windows replaced by retrieval examples (unchanged at 0)."""
    if not fraction:
        return text
    from .retrieval import calibration_mix, mix_record, mix_windows

    mix = calibration_mix(fraction, seed, tokenizer, int(text.windows.shape[1]))  # the text may give shorter windows
    text.windows, text.retrieval = mix_windows(text.windows, mix)
    text.retrieval_record = mix_record(mix, int(text.windows.shape[0]), text.retrieval)
    return text


def _windows(spec: str, tokenizer, tokens: int, length: int, text_field: str, chat=None) -> CalibrationText:
    """Up to `tokens` tokens of one spec, cut into windows of `length` (shorter when the text is)."""
    used: list[str] = []
    ids = token_stream(calibration_texts(spec, text_field, chat), tokenizer, tokens, used=used)
    length = min(length, ids.numel())
    if length < 2:
        raise SurgeryError(f"calibration data {spec} gave only {ids.numel()} token(s)")
    n = ids.numel() // length
    digests = [hashlib.sha256(text.encode("utf-8")).hexdigest() for text in used]
    return CalibrationText(ids[: n * length].view(n, length), spec, PYDOC_SPLIT if spec == "pydoc" else OTHER_SPLIT,
                           digests, data_commits=dataset_commits([spec]) or None)


def pydoc_documents_used(tokenizer, tokens: int) -> list[int]:
    """Indices (in pydoc order) of the documents a `pydoc` calibration of `tokens` tokens reads."""
    texts = pydoc_texts()
    used, count = [], 0
    for i in range(len(texts) - 1, -1, -1):
        if count >= tokens:
            break
        if texts[i]:
            used.append(i)
            count += len(tokenizer(texts[i], add_special_tokens=False)["input_ids"]) + 1
    return sorted(used)
