"""The safetensors dtype table covers every element type the format defines: tensors of each are written by the
checkpoint writer, read back by the reader and by safetensors' own loader, byte for byte; the sub-byte types are
one clear line."""

import json
import struct

import pytest
import torch

from surgery.checkpoint.tensors import (SAFETENSORS_DTYPES, SUBBYTE_DTYPES, CheckpointReader, PlannedTensor,
                                        write_checkpoint)
from surgery.errors import SurgeryError

# The codes of safetensors' Rust `Dtype` enum (the format's definition).
FORMAT_CODES = {"BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ",
                "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64"}


def test_every_format_code_is_read_or_has_its_reason():
    assert set(SAFETENSORS_DTYPES) | set(SUBBYTE_DTYPES) == FORMAT_CODES
    assert not set(SAFETENSORS_DTYPES) & set(SUBBYTE_DTYPES)


def test_each_dtype_round_trips_through_writer_and_reader(tmp_path):
    g = torch.Generator().manual_seed(0)
    values = {}
    for code, dtype in SAFETENSORS_DTYPES.items():
        raw = torch.randint(0, 256, (3, 2 * torch.empty((), dtype=dtype).element_size()), generator=g,
                            dtype=torch.uint8)
        values[code] = raw.view(dtype)  # arbitrary bit patterns of each dtype, shape (3, 2)
    planned = [PlannedTensor(code, t.dtype, tuple(t.shape), produce=lambda t=t: t) for code, t in values.items()]
    write_checkpoint(tmp_path, planned, max_shard_bytes=1 << 20)
    header_len = struct.unpack("<Q", (tmp_path / "model.safetensors").read_bytes()[:8])[0]
    header = json.loads((tmp_path / "model.safetensors").read_bytes()[8:8 + header_len])
    assert {name: header[name]["dtype"] for name in values} == {code: code for code in values}
    reader = CheckpointReader(tmp_path)
    for code, t in values.items():
        back = reader.load(code)
        assert back.dtype == t.dtype and back.shape == (3, 2)
        assert torch.equal(back.view(torch.uint8), t.view(torch.uint8)), code
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:  # the format's own reader agrees
        for code in ("U16", "U32", "U64", "C64"):
            assert torch.equal(f.get_tensor(code).view(torch.uint8), values[code].view(torch.uint8))


@pytest.mark.parametrize("code", sorted(SUBBYTE_DTYPES))
def test_subbyte_dtype_is_one_clear_line(tmp_path, code):
    header = json.dumps({code: {"dtype": code, "shape": [4], "data_offsets": [0, 2 if code == "F4" else 3]}}).encode()
    header += b" " * (-len(header) % 8)
    data = b"\x00" * (2 if code == "F4" else 3)
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + data)
    with pytest.raises(SurgeryError, match=f"dtype {code} .*torch cannot hold one value per element"):
        CheckpointReader(tmp_path)
