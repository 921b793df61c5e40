"""A teacher store checked before a run trains on it (surgery/training/teacher_store.py writes the layout): the
manifest's fields have their types and agree with each other (shards consecutive, covering its windows, plain file
names inside the store); each shard exists and its header holds exactly the tensors, shapes and dtypes the manifest
lists — all before the first step, from the manifest and the shards' headers only. A shard's contents are checked
against the sha256 the manifest records, and its values checked as distributions (`distribution_problem`), when a
run first opens it (a fresh run's first-step shards before that step), before any of its windows is used: an edited
or swapped shard, or one that is no distribution, is refused, never trained on."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Annotated

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr

from ..errors import SurgeryError

SHARD_NAME = re.compile(r"shard-\d{5}\.safetensors")
SHA256 = re.compile(r"[0-9a-f]{64}")
DTYPES = {"logprobs": "F16", "ids": "I32", "tail": "F16", "window_hash": "I64"}  # the safetensors names

Positive = Annotated[StrictInt, Field(ge=1)]


class Shard(BaseModel):
    model_config = ConfigDict(extra="forbid")
    file: StrictStr
    first: Annotated[StrictInt, Field(ge=0)]
    windows: Positive
    sha256: StrictStr


class Manifest(BaseModel):
    """The fields a run reads; others (the teacher's identity, dtypes, ...) are kept as they are."""

    model_config = ConfigDict(extra="allow")
    format: StrictStr
    top_k: Positive
    seq_len: Positive
    windows: Positive
    tokens: Positive
    vocab: Positive
    temperature: Annotated[StrictFloat | StrictInt, Field(gt=0)]
    tokenizer: StrictStr
    teacher: dict
    windows_spec: dict
    shards: list[Shard] = Field(min_length=1)


def check_manifest(folder: Path, manifest: dict) -> None:
    """One line naming the store and what does not fit, for a manifest a run cannot trust."""
    from ..loaders import validated

    m = validated(Manifest, manifest, f"--teacher-logprobs {folder}: {'manifest.json'}")
    if m.top_k > m.vocab:
        raise SurgeryError(f"--teacher-logprobs {folder}: manifest.json has top_k {m.top_k} > vocab {m.vocab}")
    if m.tokens != m.windows * m.seq_len:
        raise SurgeryError(f"--teacher-logprobs {folder}: manifest.json says {m.tokens} tokens for {m.windows} "
                           f"windows of {m.seq_len} (damaged or edited)")
    first = 0
    for shard in m.shards:
        if not SHARD_NAME.fullmatch(shard.file) or not SHA256.fullmatch(shard.sha256):
            raise SurgeryError(f"--teacher-logprobs {folder}: manifest.json lists a shard {shard.file!r} (sha256 "
                               f"{shard.sha256[:16]!r}) that is not one `surgery teacher` writes")
        if shard.first != first:
            raise SurgeryError(f"--teacher-logprobs {folder}: manifest.json's shards are not consecutive ({shard.file} "
                               f"starts at window {shard.first}, not {first})")
        first += shard.windows
    if first != m.windows:
        raise SurgeryError(f"--teacher-logprobs {folder}: manifest.json's shards hold {first} windows, not its "
                           f"{m.windows}")


def check_shard_headers(folder: Path, manifest: dict) -> None:
    """Each shard is there, whole (its size is its header's plus the data the header lists) and holds exactly the
    tensors of its windows; read from the headers only."""
    k, seq_len = manifest["top_k"], manifest["seq_len"]
    for shard in manifest["shards"]:
        path = Path(folder) / shard["file"]
        n = shard["windows"]
        want = {"logprobs": [n, seq_len, k], "ids": [n, seq_len, k], "tail": [n, seq_len], "window_hash": [n]}
        header, size, data = _header(path, folder)
        got = {name: (v.get("dtype"), v.get("shape")) for name, v in header.items()
               if name != "__metadata__" and isinstance(v, dict)}
        expected = {name: (DTYPES[name], shape) for name, shape in want.items()}
        if got != expected:
            raise SurgeryError(f"--teacher-logprobs {folder}: {shard['file']} does not hold the windows its manifest "
                               f"lists (damaged or edited)")
        end = max((v["data_offsets"][1] for v in header.values() if isinstance(v, dict) and "data_offsets" in v),
                  default=0)
        if size != data + end:
            raise SurgeryError(f"--teacher-logprobs {folder}: {shard['file']} is {size:,} bytes, not the "
                               f"{data + end:,} its header describes (truncated or edited)")


def _header(path: Path, folder: Path) -> tuple[dict, int, int]:
    """(header, file size, offset of the data) of a safetensors shard."""
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise OSError("not a file")
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if length <= 0 or length > min(size - 8, 100 << 20):
                raise ValueError("not a safetensors file")
            header = json.loads(f.read(length))
        if not isinstance(header, dict):
            raise ValueError("not a safetensors header")
    except (OSError, ValueError) as e:
        raise SurgeryError(f"--teacher-logprobs {folder}: cannot read {path.name} "
                           f"({str(e).splitlines()[0] or type(e).__name__})") from None
    return header, size, 8 + length


def check_shard_contents(folder: Path, shard: dict, vocab: int) -> None:
    """The shard's bytes are the ones `surgery teacher` wrote (the sha256 its manifest records), and what they hold
    are distributions over the `vocab` tokens (`distribution_problem`): a store written by another program, or by a
    teacher whose log-probabilities were NaN, is refused, never trained on."""
    from safetensors.torch import load_file

    from ..checkpoint.sha256 import sha256_file

    path = Path(folder) / shard["file"]
    try:
        digest = sha256_file(path)
    except OSError as e:
        raise SurgeryError(f"--teacher-logprobs {folder}: cannot read {shard['file']} ({e.strerror or e})") from None
    if digest != shard["sha256"]:
        raise SurgeryError(f"--teacher-logprobs {folder}: {shard['file']} is not the shard the store was made with "
                           "(its sha256 differs: edited or swapped); remake the store with `surgery teacher`")
    try:
        tensors = load_file(path)  # a shard is about SHARD_BYTES (4 MiB): read whole, once
    except Exception as e:  # noqa: BLE001 - any damage: one line
        raise SurgeryError(f"--teacher-logprobs {folder}: cannot read {shard['file']} "
                           f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    problem = distribution_problem(tensors["logprobs"], tensors["ids"], tensors["tail"], vocab)
    if problem is not None:
        raise SurgeryError(f"--teacher-logprobs {folder}: {shard['file']} holds {problem}; remake the store with "
                           f"`surgery teacher`")


# How far above 1 the probabilities of a position may sum (their fp16 rounding: a few parts in a thousand).
MASS_TOLERANCE = 0.01


def distribution_problem(logprobs: torch.Tensor, ids: torch.Tensor, tail: torch.Tensor, vocab: int) -> str | None:
    """What keeps a stored teacher pass (log-probs and ids [.., K], tail [..]) from being K + 1 buckets of a
    distribution over `vocab` tokens, worded for a message; None when nothing does: every log-probability a number
    below +inf (-inf: a token of no probability), every id in the vocabulary and distinct at its position, the
    probabilities of a position (its K and its tail) summing to more than 0 and at most 1 (+MASS_TOLERANCE)."""
    lp, tail = logprobs.float(), tail.float()
    if not (lp < math.inf).all():  # (NaN < inf is false too)
        return f"log-probabilities that are not numbers ({int((~(lp < math.inf)).sum())} NaN or +inf)"
    if not (tail < math.inf).all():
        return f"tail masses that are not numbers ({int((~(tail < math.inf)).sum())} NaN or +inf)"
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        bad = (ids < 0) | (ids >= vocab)
        return f"token id {int(ids[bad][0])}, outside the teacher's vocabulary of {vocab}"
    ordered = ids.reshape(-1, ids.shape[-1]).sort(dim=-1).values
    if (ordered[:, 1:] == ordered[:, :-1]).any():
        return "the same token id twice at one position (its candidates are not a distribution's top-K)"
    mass = torch.logsumexp(torch.cat([lp, tail[..., None]], dim=-1), dim=-1)
    if (mass == -math.inf).any():
        return "a position of no probability at all (every log-probability -inf)"
    if (mass > math.log1p(MASS_TOLERANCE)).any():
        return f"probabilities that sum to {float(mass.max().exp()):.4g} at one position (more than 1)"
    return None
