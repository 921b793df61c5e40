"""One GGUF file written tensor by tensor: every tensor's name, shape and stored type first (the header, the
metadata and the tensor infos), then each tensor's data, loaded, converted and written one at a time, so memory
holds one tensor. The file is written beside OUT under a temporary name and renamed into place when complete."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import SurgeryError

# --dtype NAME -> the GGML type of the file's matrices (vectors stay f32: norms, sinks, as llama.cpp's converter does)
DTYPE_NAMES = ("f32", "f16", "bf16", "q8_0")


def ggml_type(name: str):
    import gguf

    return {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
            "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[name]


def file_type(name: str) -> int:
    """general.file_type for --dtype `name` (llama.cpp's LlamaFileType: what most of the tensors are)."""
    import gguf

    return {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
            "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[name]


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: its GGUF name, its shape in numpy order (GGUF lists the dimensions reversed), and how
    to load its float32 values (called once, when the tensor is written)."""

    name: str
    shape: tuple[int, ...]
    load: Callable[[], np.ndarray] = field(repr=False, compare=False)
    f32: bool = False  # a matrix llama.cpp reads as f32 only (a Mamba-2 convolution, its A and D, its group norm)

    def stored_type(self, dtype: str):
        """The GGML type it is stored as: vectors and `f32` matrices f32; other matrices the asked type, f16 where a
        q8_0 row does not fill whole 32-value blocks (llama.cpp's converter falls back the same way)."""
        import gguf

        if len(self.shape) == 1 or self.f32 or dtype == "f32":
            return gguf.GGMLQuantizationType.F32
        if dtype == "q8_0" and self.shape[-1] % 32:
            return gguf.GGMLQuantizationType.F16
        return ggml_type(dtype)


def stored_bytes(shape: tuple[int, ...], qtype) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape)) // block * size


def encode(values: np.ndarray, qtype) -> np.ndarray:
    """float32 `values` as the bytes (or numbers) of GGML type `qtype`."""
    import gguf

    values = np.ascontiguousarray(values, dtype=np.float32)
    if qtype == gguf.GGMLQuantizationType.F32:
        return values
    if qtype == gguf.GGMLQuantizationType.F16:
        return values.astype(np.float16)
    return gguf.quants.quantize(values, qtype)


def put_key(writer, key: str, value: Any) -> None:
    """One metadata key, typed by its Python value (bool, int as uint32, float as float32, str, list of one of those)."""
    import gguf

    if isinstance(value, list):
        writer.add_array(key, value)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_key_value(key, value, gguf.GGUFValueType.get_type(value))


def write_gguf(out: Path, arch: str, keys: dict[str, Any], tensors: list[GGUFTensor], dtype: str,
               extra: Callable[[Any], None] | None = None) -> int:
    """Write the GGUF file `out` (architecture `arch`, the metadata `keys`, then whatever `extra(writer)` adds: the
    tokenizer) with `tensors` stored as `dtype`; returns its size in bytes. Written beside `out` and renamed into
    place; on any failure nothing is left (a full disk: one line)."""
    import gguf

    from ..checkpoint.atomic import temp_prefix

    out = Path(out)
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=temp_prefix(out, "tmp"), suffix=".gguf", dir=out.absolute().parent)
    except OSError as e:
        raise SurgeryError(f"cannot write {out}: {e.strerror or e}") from None
    os.close(fd)
    tmp = Path(tmp_name)
    writer = None
    try:
        writer = gguf.GGUFWriter(tmp, arch=arch)
        for key, value in keys.items():
            put_key(writer, key, value)
        if extra is not None:
            extra(writer)
        for t in tensors:
            qtype = t.stored_type(dtype)
            writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), stored_bytes(t.shape, qtype), raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in tensors:
            values = t.load()
            if tuple(values.shape) != t.shape:  # a planning error, never the checkpoint's: the plan read its header
                raise AssertionError(f"{t.name}: loaded {tuple(values.shape)}, planned {t.shape}")
            writer.write_tensor_data(encode(values, t.stored_type(dtype)))
            del values
        writer.close()
        writer = None
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, out)
    except OSError as e:  # a full disk, a folder made read-only meanwhile
        raise SurgeryError(f"cannot write {out}: {e.strerror or e}; nothing was written") from None
    finally:
        if writer is not None:
            writer.close()
        tmp.unlink(missing_ok=True)
    return out.stat().st_size


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
