"""A stored teacher pass: the teacher's top-K next-token log-probabilities on the training windows of a run, written
once (`surgery teacher`, surgery/training/teacher_pass.py) and read by any number of runs (`surgery uptrain
--teacher-logprobs DIR`, surgery/training/stored_kd.py) instead of a live teacher.

Layout of DIR:

- `manifest.json`: FORMAT, the teacher (its spec and the sha256 of each weight file), the tokenizer's identity
  (sha256 of its vocabulary and EOS), the windows (`windows_spec`: data, weights, mode, seq_len, seed, held-out
  tokens, and what else fixes the order the run reads them in), K, the temperature, dtypes, the number of windows
  and the list of shards (file, first window, windows, sha256).
- `shard-NNNNN.safetensors`: consecutive windows of the run's global order (window `g` is the g-th sequence the run
  reads: optimizer step g // B, B = sequences per step), each tensor with the windows first:
  `logprobs` [n, L, K] fp16 (log p of the teacher's top-K tokens, in descending order), `ids` [n, L, K] int32 (those
  tokens), `tail` [n, L] fp16 (log of the probability left outside the top K; -inf when none is) and `window_hash`
  [n] int64 (`window_hash` of the window's token ids: a run checks each window it trains on against it).

Bytes per token: K * (2 + 4) + 2 (K = 32: 194). Shards are written as the pass goes and read by slices, one shard
open at a time: the store is never held whole in memory.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SurgeryError

FORMAT = "surgery-teacher-logprobs/1"
MANIFEST = "manifest.json"
SHARD = "shard-{:05d}.safetensors"
SHARD_BYTES = 4 << 20  # a shard holds as many whole windows as fit in about this many bytes (at least one)
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.gguf")


def bytes_per_token(k: int) -> int:
    """Stored bytes per token for top-`k`: fp16 log-probs and int32 ids per candidate, an fp16 tail."""
    return k * (2 + 4) + 2


def window_hash(ids: torch.Tensor) -> torch.Tensor:
    """[n] int64: an 8-byte BLAKE2b digest of each window's token ids (as int32), for `ids` [n, L]."""
    rows = ids.to(torch.int32).cpu().numpy()
    digests = [int.from_bytes(hashlib.blake2b(r.tobytes(), digest_size=8).digest(), "little", signed=True)
               for r in rows]
    return torch.tensor(digests, dtype=torch.int64)


def tokenizer_identity(tokenizer) -> str:
    """sha256 of the tokenizer's vocabulary (token -> id) and its EOS: what the stored ids mean."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    blob = json.dumps({"vocab": vocab, "eos": tokenizer.eos_token_id}, ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()


def teacher_identity(spec: str, folder: Path) -> dict:
    """The teacher as the manifest names it: its spec and the sha256 of each weight file in its folder."""
    from ..checkpoint.sha256 import sha256_file

    files = sorted({p for pattern in WEIGHT_PATTERNS for p in Path(folder).glob(pattern) if p.is_file()})
    return {"spec": spec, "weights": {p.name: sha256_file(p) for p in files}}


def windows_spec(o, tokenizer, readers: int) -> dict:
    """What fixes a run's training windows and their order, from its options `o` (UptrainOptions): a store made for
    one spec serves exactly the runs with the same one. Packed data is shuffled over all the windows it packs, whose
    number follows from the run's tokens (so a packed store serves runs of its own --tokens and --batch-tokens);
    streamed data comes in the order of its readers (processes x data workers), and a run of fewer tokens reads a
    prefix of it."""
    spec = {"data": o.data_spec, "data_weights": [round(w, 12) for w in o.weights] if len(o.data) > 1 else None,
            "text_field": o.text_field, "streaming": o.streaming, "seq_len": o.seq_len,
            "eval_tokens": o.eval_tokens, "seed": o.seed, "eos": tokenizer.eos_token_id}
    if any(str(d).endswith(".txt") for d in o.data):  # what a .txt file's documents are (not --eval-data's)
        spec["txt_unit"] = o.txt_unit
    if o.chat_template != "auto":  # how a messages column is rendered (surgery/chat.py)
        spec["chat_template"] = o.chat_template
    if o.skip_tokens:  # the training split's first tokens skipped (--skip-tokens, packed data)
        spec["skip_tokens"] = o.skip_tokens
    if o.retrieval_mix:  # the windows replaced by retrieval examples (surgery/training/retrieval_mix.py)
        spec["retrieval_mix"] = o.retrieval_mix
        if o.retrieval_questions != 1:  # examples a retrieval window holds
            spec["retrieval_questions"] = o.retrieval_questions
    if o.streamed:
        from .stream_sources import fingerprint, resolve_sources

        return {"mode": "stream", **spec, "readers": readers, "data_epochs": o.data_epochs,
                "sources": fingerprint(resolve_sources(o.data, o.weights))}
    return {"mode": "packed", **spec, "train_tokens": o.train_tokens}


SPEC_FLAGS = {"data": "--data", "data_weights": "--data-weights", "text_field": "--text-field", "txt_unit":
              "--txt-unit", "streaming": "--streaming", "seq_len": "--seq-len", "eval_tokens": "--eval-tokens",
              "seed": "--seed", "mode": "--data-mode", "readers": "processes x --data-workers",
              "data_epochs": "--data-epochs", "train_tokens": "--tokens / --batch-tokens (packed data)",
              "sources": "the data's files", "eos": "the tokenizer's EOS",
              "chat_template": "--chat-template", "retrieval_mix": "--retrieval-mix", "skip_tokens": "--skip-tokens",
              "retrieval_questions": "--retrieval-questions"}
# a field a spec leaves out at its default (older stores)
SPEC_DEFAULTS = {"retrieval_mix": 0.0, "skip_tokens": 0, "retrieval_questions": 1}


def spec_difference(stored: dict, run: dict) -> str | None:
    """The first field in which a store's windows spec and a run's differ, worded for the user; None when equal."""
    for key in sorted(set(stored) | set(run)):
        a, b = stored.get(key, SPEC_DEFAULTS.get(key)), run.get(key, SPEC_DEFAULTS.get(key))
        if a != b:
            return f"{SPEC_FLAGS.get(key, key)}: store {a!r}, run {b!r}"
    return None


class StoreWriter:
    """Writes a store's shards into `folder` (a temporary folder that becomes the output) as windows arrive; holds
    at most one shard's windows."""

    def __init__(self, folder: Path, k: int, seq_len: int):
        self.folder, self.k, self.seq_len = Path(folder), k, seq_len
        self.per_shard = max(1, SHARD_BYTES // (seq_len * bytes_per_token(k)))
        self.pending: list[dict[str, torch.Tensor]] = []
        self.pending_windows = 0
        self.shards: list[dict] = []
        self.windows = 0

    def add(self, logprobs: torch.Tensor, ids: torch.Tensor, tail: torch.Tensor, hashes: torch.Tensor) -> None:
        """Windows [n, L, K] log-probs and ids, [n, L] tails, [n] hashes, in the run's order."""
        for i in range(0, logprobs.shape[0]):
            self.pending.append({"logprobs": logprobs[i].to(torch.float16).cpu(), "ids": ids[i].to(torch.int32).cpu(),
                                 "tail": tail[i].to(torch.float16).cpu(), "window_hash": hashes[i:i + 1].cpu()})
            self.pending_windows += 1
            if self.pending_windows == self.per_shard:
                self._flush()

    def _flush(self) -> None:
        from ..checkpoint.sha256 import sha256_file
        from ..checkpoint.tensors import save_safetensors

        if not self.pending:
            return
        tensors = {name: (torch.cat if name == "window_hash" else torch.stack)([w[name] for w in self.pending])
                   for name in self.pending[0]}
        path = self.folder / SHARD.format(len(self.shards))
        save_safetensors({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"format": FORMAT})
        self.shards.append({"file": path.name, "first": self.windows, "windows": self.pending_windows,
                            "sha256": sha256_file(path)})
        self.windows += self.pending_windows
        self.pending, self.pending_windows = [], 0

    def finish(self, fields: dict) -> dict:
        """The last shard and the manifest (`fields` plus the shards' list); returns the manifest."""
        self._flush()
        manifest = {"format": FORMAT, **fields, "top_k": self.k, "seq_len": self.seq_len, "windows": self.windows,
                    "tokens": self.windows * self.seq_len, "bytes_per_token": bytes_per_token(self.k),
                    "dtypes": {"logprobs": "float16", "ids": "int32", "tail": "float16", "window_hash": "int64"},
                    "shards": self.shards}
        (self.folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        return manifest


@dataclass
class StoredTargets:
    """The stored teacher pass of some windows: logprobs [n, L, K] fp16, ids [n, L, K] int32, tail [n, L] fp16,
    hashes [n] int64."""
    logprobs: torch.Tensor
    ids: torch.Tensor
    tail: torch.Tensor
    hashes: torch.Tensor

    def __getitem__(self, index: slice) -> "StoredTargets":
        return StoredTargets(self.logprobs[index], self.ids[index], self.tail[index], self.hashes[index])

    def to(self, device) -> "StoredTargets":
        return StoredTargets(self.logprobs.to(device), self.ids.to(device), self.tail.to(device), self.hashes)


class TeacherStore:
    """A store opened for reading: its manifest checked; windows read by slices of the shards that hold them."""

    def __init__(self, folder: Path):
        from .store_check import check_manifest, check_shard_headers

        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        check_manifest(self.folder, self.manifest)  # before any step: types, shards, headers (store_check.py)
        check_shard_headers(self.folder, self.manifest)
        self.k, self.seq_len, self.windows = self.manifest["top_k"], self.manifest["seq_len"], self.manifest["windows"]
        self._open: tuple[str, object] | None = None  # (file, safe_open handle): one shard open at a time
        self._verified: set[str] = set()  # shards whose sha256 was checked (when first opened)

    def _shard(self, shard: dict):
        from safetensors import safe_open

        from .store_check import check_shard_contents

        name = shard["file"]
        if self._open is None or self._open[0] != name:
            if name not in self._verified:  # before any of its windows is used
                check_shard_contents(self.folder, shard, self.manifest["vocab"])
                self._verified.add(name)
            path = self.folder / name
            try:
                self._open = (name, safe_open(str(path), framework="pt"))
            except Exception as e:  # missing, truncated, not safetensors
                raise SurgeryError(f"--teacher-logprobs {self.folder}: cannot read {name} "
                                   f"({str(e).splitlines()[0]})") from None
        return self._open[1]

    def check_all(self, windows: int) -> None:
        """Check every shard holding one of the first `windows` windows (sha256 and distributions, store_check.py)
        now, before the run's first step; every other shard is checked when first opened, before any of its
        windows is used (a whole store up front would cost a 194 GB store's reading before the first step)."""
        for shard in self.manifest["shards"]:
            if shard["first"] < windows:
                self._shard(shard)

    def read(self, start: int, count: int) -> StoredTargets:
        """Windows start .. start+count-1 of the run's order."""
        if start < 0 or start + count > self.windows:
            raise SurgeryError(f"--teacher-logprobs {self.folder} holds {self.windows} windows; the run needs window "
                               f"{start + count - 1}")
        parts: dict[str, list[torch.Tensor]] = {"logprobs": [], "ids": [], "tail": [], "window_hash": []}
        for shard in self.manifest["shards"]:
            lo, hi = max(start, shard["first"]), min(start + count, shard["first"] + shard["windows"])
            if lo >= hi:
                continue
            f = self._shard(shard)
            for name in parts:
                try:
                    parts[name].append(f.get_slice(name)[lo - shard["first"]: hi - shard["first"]])
                except Exception as e:
                    raise SurgeryError(f"--teacher-logprobs {self.folder}: {shard['file']} is damaged "
                                       f"({str(e).splitlines()[0]})") from None
        got = StoredTargets(*(torch.cat(parts[n]) for n in ("logprobs", "ids", "tail", "window_hash")))
        if got.logprobs.shape != (count, self.seq_len, self.k) or got.ids.shape != got.logprobs.shape:
            raise SurgeryError(f"--teacher-logprobs {self.folder}: its shards do not hold the windows its manifest "
                               f"lists (damaged or edited)")
        return got


def read_manifest(folder: Path) -> dict:
    path = Path(folder) / MANIFEST
    if not Path(folder).is_dir() or not path.is_file():
        raise SurgeryError(f"--teacher-logprobs {folder} is not a teacher store (no {MANIFEST}; make one with "
                           f"`surgery teacher`)")
    from ..loaders import read_json

    manifest = read_json(path, f"--teacher-logprobs {folder}: {MANIFEST}")  # (nesting too deep: one line too)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SurgeryError(f"--teacher-logprobs {folder}: {MANIFEST} is not a {FORMAT} manifest")
    need = ("top_k", "seq_len", "windows", "shards", "windows_spec", "tokenizer", "teacher", "temperature", "vocab")
    missing = [k for k in need if k not in manifest]
    if missing:
        raise SurgeryError(f"--teacher-logprobs {folder}: {MANIFEST} lacks {', '.join(missing)}")
    return manifest


def store_bytes(k: int, tokens: int) -> int:
    return bytes_per_token(k) * tokens


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"
