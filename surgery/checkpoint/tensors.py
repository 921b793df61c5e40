"""Lazy checkpoint tensor I/O: read one tensor at a time, write shards as they fill.

Reading parses the safetensors headers only; a tensor's bytes are read with `pread` when it is asked for
(no mmap, so pages never linger in the process's RSS). Writing plans every output tensor's dtype and shape
first, so each shard's header can be written up front and the tensors streamed after it one by one.
Tensors that pass through unchanged are copied file-to-file (`copy_file_range`) without entering Python.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from .sha256 import sha256_file
from ..dtypes import DTYPE_NAMES
from . import validate
from ..errors import SurgeryError

# Every element type the safetensors format defines (its Rust `Dtype` enum), by code. Written out here because
# safetensors.torch's own table (`_TYPES`) is private and lacks F8_E8M0.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,
}
# The format's sub-byte types: torch has no dtype holding one such value per element (float4_e2m1fn_x2 packs two
# per byte, so a tensor's torch shape would not be its header's shape; there is no 6-bit dtype at all).
SUBBYTE_DTYPES = {"F4": "4-bit", "F6_E2M3": "6-bit", "F6_E3M2": "6-bit"}
DTYPE_CODES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
# The floating dtypes a user names (--dtype), by name: the one table every command uses.
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
WEIGHTS_INDEX = "model.safetensors.index.json"
PICKLE_INDEX = "pytorch_model.bin.index.json"


def dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file, byte range, dtype, shape."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int = 0  # absolute byte offset in `file` (safetensors only)
    nbytes: int = 0

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def read_safetensors_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse a safetensors file's header; check that every tensor lies inside the file, without overlaps."""
    validate.regular_file(path, "weight file")
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("file shorter than its 8-byte header length")
            (header_len,) = struct.unpack("<Q", raw)
            if header_len > size - 8 or header_len > 100_000_000:
                raise ValueError("header length points past the end of the file")
            header = json.loads(f.read(header_len))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:
        raise SurgeryError(f"corrupt safetensors file {path}: {str(e).splitlines()[0][:200]}") from None
    if not isinstance(header, dict):
        raise SurgeryError(f"corrupt safetensors file {path}: the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SurgeryError(f"corrupt safetensors file {path}: __metadata__ is not an object of strings")
    base = 8 + header_len
    infos: dict[str, TensorInfo] = {}
    ranges = []
    for name, entry in header.items():
        code, shape, begin, end = validate.safetensors_entry(path, name, entry, SAFETENSORS_DTYPES,
                                                              SUBBYTE_DTYPES)
        dtype = SAFETENSORS_DTYPES[code]
        info = TensorInfo(name, path, dtype, shape, base + begin, end - begin)
        if info.numel * dtype_size(dtype) != info.nbytes or base + end > size:
            raise SurgeryError(f"truncated or corrupt safetensors file {path}: tensor {name} is incomplete")
        infos[name] = info
        ranges.append((name, begin, end))
    validate.check_byte_ranges(path, ranges, size - base)
    return infos, metadata


class CheckpointReader:
    """All tensors of a checkpoint folder (single file or sharded), loaded one at a time on demand."""

    def __init__(self, folder: Path, allow_pickle: bool = False):
        self.folder = Path(folder)
        self.files = self._weight_files(allow_pickle)
        self.is_pickle = self.files[0].suffix == ".bin"
        self.tensors: dict[str, TensorInfo] = {}
        self._pickled: dict[Path, dict[str, torch.Tensor]] = {}
        for file in self.files:
            if self.is_pickle:
                state = self._load_pickle(file)
                self._pickled[file] = state
                for name, t in state.items():
                    self.tensors[name] = TensorInfo(name, file, t.dtype, tuple(t.shape))
            else:
                infos = read_safetensors_header(file)[0]
                twice = next((n for n in infos if n in self.tensors), None)
                if twice is not None:
                    raise SurgeryError(f"tensor {twice} is stored twice ({self.tensors[twice].file.name} and {file.name})")
                self.tensors.update(infos)
        self._fds: dict[Path, int] = {}

    def _weight_files(self, allow_pickle: bool) -> list[Path]:
        d = self.folder
        for index_name, single in ((WEIGHTS_INDEX, "model.safetensors"), (PICKLE_INDEX, "pytorch_model.bin")):
            index = d / index_name
            if index.exists():
                validate.regular_file(index, "index")
                try:
                    parsed = json.loads(index.read_text())
                except (OSError, ValueError, RecursionError) as e:
                    raise SurgeryError(f"corrupt index {index}: {str(e).splitlines()[0][:200]}") from None
                weight_map = validate.weight_map(parsed, index)
                files = [validate.name_inside(d, f, f"index {index}") for f in dict.fromkeys(weight_map.values())]
            elif (d / single).exists():
                files = [d / single]
            else:
                continue
            missing = [f.name for f in files if not f.exists()]
            if missing:
                raise SurgeryError(f"checkpoint {d} is missing shard(s): {', '.join(missing)}")
            for f in files:
                validate.regular_file(f, "weight file")
            if single.endswith(".bin") and not allow_pickle:
                raise SurgeryError(
                    f"{d} holds only pickle (.bin) weights, which can run code when loaded; "
                    "pass --allow-pickle to load them with torch.load(weights_only=True)"
                )
            return files
        raise SurgeryError(f"no model weights (*.safetensors or *.bin) found in {d}")

    @staticmethod
    def _load_pickle(file: Path) -> dict[str, torch.Tensor]:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # torch raises many kinds here
            raise SurgeryError(f"cannot read pickle checkpoint {file}: {str(e).splitlines()[0]}") from None
        if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
            raise SurgeryError(f"pickle checkpoint {file} is not a state dict of tensors")
        return state

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def _fd(self, file: Path) -> int:
        if file not in self._fds:
            self._fds[file] = os.open(file, os.O_RDONLY)
        return self._fds[file]

    def load(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        if self.is_pickle:
            return self._pickled[info.file][name].clone()
        buf = bytearray(info.nbytes)
        view = memoryview(buf)
        fd, done = self._fd(info.file), 0
        while done < info.nbytes:
            n = os.preadv(fd, [view[done:]], info.start + done)
            if n <= 0:
                raise SurgeryError(f"truncated safetensors file {info.file} while reading {name}")
            done += n
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        return torch.frombuffer(buf, dtype=info.dtype).reshape(info.shape)

    def copy_raw(self, name: str, out_fd: int) -> None:
        """Append tensor `name`'s bytes to `out_fd` without going through Python memory."""
        info = self.tensors[name]
        src, offset, left = self._fd(info.file), info.start, info.nbytes
        while left > 0:
            try:
                n = os.copy_file_range(src, out_fd, left, offset)
            except OSError:
                n = os.write(out_fd, os.pread(src, min(left, 64 << 20), offset))
            if n <= 0:
                raise SurgeryError(f"truncated safetensors file {info.file} while copying {name}")
            offset += n
            left -= n

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class PlannedTensor:
    """One output tensor: its name, dtype and shape, and how to produce it.

    `produce()` returns the tensor; `raw_source` (reader, name) marks a byte-for-byte copy instead.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor] | None = None
    raw_source: tuple[CheckpointReader, str] | None = None

    @property
    def nbytes(self) -> int:
        n = dtype_size(self.dtype)
        for s in self.shape:
            n *= s
        return n


def plan_shards(tensors: list[PlannedTensor], max_shard_bytes: int) -> list[list[PlannedTensor]]:
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _header_bytes(shard: list[PlannedTensor], metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for t in shard:
        header[t.name] = {"dtype": DTYPE_CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _write_tensor(fd: int, t: PlannedTensor) -> None:
    if t.raw_source is not None:
        reader, name = t.raw_source
        reader.copy_raw(name, fd)
        return
    value = t.produce()
    if value.dtype != t.dtype or tuple(value.shape) != t.shape:
        raise RuntimeError(f"{t.name}: produced {value.dtype}{tuple(value.shape)}, planned {t.dtype}{t.shape}")
    data = value.contiguous().reshape(-1).view(torch.uint8).numpy() if value.numel() else b""
    view = memoryview(data)
    while len(view):
        n = os.write(fd, view)
        view = view[n:]


def write_checkpoint(
    folder: Path,
    tensors: list[PlannedTensor],
    max_shard_bytes: int,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Write `tensors` as safetensors shards (plus an index when more than one). Returns the file names."""
    shards = plan_shards(tensors, max_shard_bytes)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map: dict[str, str] = {}
    for file_name, shard in zip(names, shards):
        fd = os.open(Path(folder) / file_name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, _header_bytes(shard, {"format": "pt"}))
            for t in shard:
                _write_tensor(fd, t)
                weight_map[t.name] = file_name
                if progress:
                    progress(t.nbytes)
        finally:
            os.close(fd)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)}, "weight_map": weight_map}
        (Path(folder) / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return names


def sha256_files(files: Iterable[Path]) -> Iterator[tuple[str, str]]:
    """(file name, sha256) for each file.

    Free for hub downloads: huggingface_hub stores an LFS file as a blob named by its sha256 (the LFS oid).
    Otherwise the file is read in 16 MiB blocks (hashlib releases the GIL) and the digest is cached in
    ~/.cache/surgery/sha256.json under (path, size, mtime, inode), so converting a folder again costs nothing.
    """
    cache = _HashCache()
    for file in files:
        file = Path(file)
        digest = _hub_blob_digest(file) or cache.get(file)
        if digest is None:
            digest = sha256_file(file)
            cache.put(file, digest)
        yield file.name, digest
    cache.save()


def _hub_blob_digest(file: Path) -> str | None:
    if not file.is_symlink():
        return None
    target = file.resolve()
    if target.parent.name == "blobs" and len(target.name) == 64:
        return target.name
    return None


def _is_sha256(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


class _HashCache:
    PATH = Path(os.environ.get("SURGERY_CACHE", Path.home() / ".cache" / "surgery")) / "sha256.json"

    def __init__(self):
        self.entries: dict[str, str] = {}
        try:
            entries = json.loads(self.PATH.read_text())
        except (OSError, ValueError, RecursionError):
            entries = None
        if isinstance(entries, dict):  # a corrupt cache is ignored (and rewritten): hashes are recomputed
            self.entries = {k: v for k, v in entries.items() if isinstance(v, str) and _is_sha256(v)}
        self.changed = False

    @staticmethod
    def _key(file: Path) -> str:
        st = file.stat()
        return f"{file.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"

    def get(self, file: Path) -> str | None:
        return self.entries.get(self._key(file))

    def put(self, file: Path, digest: str) -> None:
        self.entries[self._key(file)] = digest
        self.changed = True

    def save(self) -> None:
        if not self.changed:
            return
        try:
            self.PATH.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.PATH.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.entries))
            os.replace(tmp, self.PATH)
        except OSError:
            pass  # a cache that cannot be written only costs time


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file with its I/O failures as OSError (and their errno): the Rust library raises
    SafetensorError, which the full-disk handling (`except OSError`) would let through as a traceback."""
    import re

    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:
        code = re.search(r"os error (\d+)", str(e))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from None
