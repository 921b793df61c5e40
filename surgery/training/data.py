"""Training data: documents tokenized, joined with an EOS between them, and packed into fixed-length windows.

The first documents form the held-out split (whole documents, at least `eval_tokens` tokens, cut to whole
windows; when no document follows them, a single file read whole, the split ends inside the last one, whose rest
is trained on); the rest form the training split, read only as far as the run needs. `skip_tokens` (--skip-tokens,
continuing a run on fresh text) drops the training split's first tokens: its windows start right after them, the
held-out split stays as it was. Training windows are visited
in a seeded random order, a fresh one each epoch when the run needs more tokens than the data holds.
A second held-out text (`--eval-data`, typically of another domain than the training text) is packed the same way
from its own first documents: it tells recovery from adaptation to the training text's domain, which the first
split shares.

Optimizer step `s` reads the windows `s*B .. (s+1)*B - 1` of that order (B = sequences per step); of those,
process `r` of `W` takes the `r`-th contiguous slice of B/W windows. So every window of a step is read by
exactly one process, and the data position of a run is nothing more than its step count.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch

from ..errors import SurgeryError

TOKENIZE_BATCH = 256  # documents per tokenizer call


@dataclass
class PackedData:
    train: torch.Tensor  # [windows, seq_len] int32
    eval: torch.Tensor  # [windows, seq_len] int32 (0 windows when evaluation is off)
    seed: int = 0
    other: torch.Tensor | None = None  # [windows, seq_len] int32: the --eval-data text's held-out windows
    train_mask: torch.Tensor | None = None  # [windows, seq_len] uint8, --loss-on assistant: 1 where a token is trained on

    def __post_init__(self):
        self._perm_epoch = -1
        self._perm = None

    @property
    def seq_len(self) -> int:
        return self.train.shape[1]

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.train.shape[0], generator=g), epoch
        return self._perm

    def window_indices(self, start: int, count: int) -> torch.Tensor:
        """Indices into `train` of the global sequences start .. start+count-1 of the run."""
        n = self.train.shape[0]
        out = torch.empty(count, dtype=torch.long)
        for i in range(count):
            epoch, pos = divmod(start + i, n)
            out[i] = self._order(epoch)[pos]
        return out

    def step_batch(self, step: int, sequences_per_step: int, rank: int, world: int) -> torch.Tensor:
        """This process's share of optimizer step `step`: [sequences_per_step / world, seq_len] int64."""
        share = sequences_per_step // world
        idx = self.window_indices(step * sequences_per_step + rank * share, share)
        return self.train[idx].long()

    def step_mask(self, step: int, sequences_per_step: int, rank: int, world: int) -> torch.Tensor:
        """`step_batch`'s windows' token masks (--loss-on assistant): [sequences_per_step / world, seq_len] bool."""
        share = sequences_per_step // world
        idx = self.window_indices(step * sequences_per_step + rank * share, share)
        return self.train_mask[idx].bool()


def _documents(texts: Iterable[str], tokenizer) -> Iterator[list[int]]:
    batch: list[str] = []
    for text in texts:
        if text and text.strip():
            batch.append(text)
        if len(batch) == TOKENIZE_BATCH:
            yield from tokenizer(batch, add_special_tokens=False)["input_ids"]
            batch = []
    if batch:
        yield from tokenizer(batch, add_special_tokens=False)["input_ids"]


def _masked_documents(texts: Iterable[str], tokenizer) -> Iterator[tuple[list[int], list[int]]]:
    """(ids, mask) per document for --loss-on assistant: a conversation's assistant turns are 1 (surgery/chat.py's
    ChatText spans), everything else 0; a document that is no conversation counts whole."""
    from ..chat import token_mask

    for text in texts:
        if not (text and text.strip()):
            continue
        spans = getattr(text, "assistant_spans", None)
        if spans is None:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            yield ids, [1] * len(ids)
        else:
            yield token_mask(tokenizer, text, spans)


def _eos(tokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise SurgeryError("the tokenizer has no EOS token to put between documents")
    return tokenizer.eos_token_id


def pack(texts: Iterable[str], tokenizer, seq_len: int, eval_tokens: int, train_tokens: int, seed: int = 0,
         masked: bool = False, skip_tokens: int = 0) -> PackedData:
    """Tokenize documents until the held-out split has `eval_tokens` and the training split `train_tokens` after
    its first `skip_tokens` (dropped: the windows start at token `skip_tokens` of the training split);
    `masked` (--loss-on assistant): also each training token's mask (`_masked_documents`; EOS after a conversation
    is 0, after other text 1)."""
    eos = _eos(tokenizer)
    eval_need = -(-eval_tokens // seq_len) * seq_len
    parts: dict[str, list[np.ndarray]] = {"eval": [], "train": []}
    masks: dict[str, list[np.ndarray]] = {"eval": [], "train": []}
    have = {"eval": 0, "train": 0}
    documents = 0
    docs = _masked_documents(texts, tokenizer) if masked else ((ids, None) for ids in _documents(texts, tokenizer))
    for ids, mask in docs:
        documents += 1
        split = "eval" if have["eval"] < eval_need else "train"
        parts[split].append(np.asarray(ids + [eos], dtype=np.int32))
        if masked:
            masks[split].append(np.asarray(mask + [mask[-1] if mask and min(mask) == 1 else 0], dtype=np.uint8))
        have[split] += len(ids) + 1
        if have["train"] >= skip_tokens + train_tokens + seq_len:
            break
    if documents == 0:
        raise SurgeryError("the data holds no text")
    if not parts["train"] and have["eval"] > eval_need:  # no document after the held-out split: it ends inside the
        flat = np.concatenate(parts["eval"])  # last one, whose rest (past the first eval_need tokens) is trained on
        parts = {"eval": [flat[:eval_need]], "train": [flat[eval_need:]]}
        if masked:
            flat_mask = np.concatenate(masks["eval"])
            masks = {"eval": [flat_mask[:eval_need]], "train": [flat_mask[eval_need:]]}
        have = {"eval": eval_need, "train": int(flat.size) - eval_need}
    if have["eval"] < eval_need:
        raise SurgeryError(f"the data holds only {have['eval']} tokens, fewer than --eval-tokens {eval_tokens}")
    if skip_tokens:
        parts["train"] = [np.concatenate(parts["train"])[skip_tokens:]] if parts["train"] else []
        if masked:
            masks["train"] = [np.concatenate(masks["train"])[skip_tokens:]] if masks["train"] else []
    train = _windows(parts["train"], seq_len)
    if train.shape[0] == 0:
        skipped = (f", {max(0, have['train'] - skip_tokens)} after --skip-tokens {skip_tokens}" if skip_tokens else "")
        raise SurgeryError(
            f"no training data left: the data's {have['eval'] + have['train']} tokens give {have['train']} after the "
            f"{eval_need} held out{skipped} (need at least --seq-len {seq_len}); lower "
            f"{'--skip-tokens' if skip_tokens else '--eval-tokens'}")
    return PackedData(train=train, eval=_windows(parts["eval"], seq_len)[: eval_need // seq_len], seed=seed,
                      train_mask=_windows(masks["train"], seq_len, np.uint8) if masked else None)


def pack_held_out(texts: Iterable[str], tokenizer, seq_len: int, tokens: int,
                  what: str = "--eval-data") -> torch.Tensor:
    """The first documents of `texts` packed into the whole windows that hold `tokens` tokens (rounded up)."""
    eos = _eos(tokenizer)
    need = -(-tokens // seq_len) * seq_len
    parts, have = [], 0
    for ids in _documents(texts, tokenizer):
        parts.append(np.asarray(ids + [eos], dtype=np.int32))
        have += len(ids) + 1
        if have >= need:
            return _windows(parts, seq_len)[: need // seq_len]
    raise SurgeryError(f"{what} holds only {have} tokens, fewer than --eval-tokens {tokens} rounded up to whole "
                       f"windows of {seq_len} ({need})")


def _windows(parts: list[np.ndarray], seq_len: int, dtype=np.int32) -> torch.Tensor:
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    n = flat.size // seq_len
    return torch.from_numpy(flat[: n * seq_len].reshape(n, seq_len).copy())


def cache_key(**fields) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


DATA_CACHE = "data.safetensors"  # the packed token windows of a run, in its run folder (reused by --resume)


def read_cache(cache: Path, key: str, seed: int) -> PackedData | None:
    """The packed data saved in `cache` (safetensors: nothing is unpickled) when it was built with the same key,
    else None (an unreadable or foreign file is rebuilt)."""
    from safetensors import safe_open

    if not cache.exists():
        return None
    try:
        with safe_open(str(cache), framework="pt") as f:
            if (f.metadata() or {}).get("key") != key:
                return None
            other = f.get_tensor("other") if "other" in f.keys() else None
            mask = f.get_tensor("train_mask") if "train_mask" in f.keys() else None
            return PackedData(f.get_tensor("train"), f.get_tensor("eval"), seed=seed, other=other, train_mask=mask)
    except Exception:  # unreadable, or not a safetensors file: rebuilt
        return None


def write_cache(cache: Path, key: str, data: PackedData) -> None:
    from ..checkpoint.tensors import save_safetensors  # a full disk: one line, not SafetensorError's traceback

    tmp = cache.with_name(cache.name + ".tmp")
    tensors = {"train": data.train, "eval": data.eval} | ({"other": data.other} if data.other is not None else {}) | (
        {"train_mask": data.train_mask} if data.train_mask is not None else {})
    save_safetensors({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata={"key": key})
    tmp.replace(cache)
