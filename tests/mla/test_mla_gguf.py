"""MLA outputs in llama.cpp: the GGUF completion llama.cpp's loader needs, the cache llama.cpp allocates for a latent
GGUF, and (slow, where llama-cpp-python and llama.cpp's converter are present) the real SmolLM2 round trip."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest

from inprocess import surgery
from surgery.bench.llama_cpp_engine import gguf_kv_values
from surgery.bench.options import BenchOptions
from surgery.bench.run import run_bench
from surgery.errors import SurgeryError
from surgery.mla.gguf import Q_LORA_RANK, complete_for_llama_cpp


def write_gguf(path, arch: str, **keys) -> dict[str, np.ndarray]:
    """A small GGUF as llama.cpp's converter would lay it out: a few uint32 keys and two f32 tensors."""
    writer = gguf.GGUFWriter(path, arch=arch)
    writer.add_block_count(2)
    for key, value in keys.items():
        writer.add_uint32(f"{arch}.{key}", value)
    rng = np.random.default_rng(0)
    tensors = {"token_embd.weight": rng.standard_normal((8, 4), dtype=np.float32),
               "blk.0.attn_kv_a_mqa.weight": rng.standard_normal((6, 4), dtype=np.float32)}
    for name, t in tensors.items():
        writer.add_tensor(name, t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def fields(path) -> dict:
    reader = gguf.GGUFReader(path)
    return {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}


def test_completion_adds_only_the_missing_key_and_keeps_every_tensor(tmp_path):
    path = tmp_path / "mla.gguf"
    tensors = write_gguf(path, "deepseek2", **{"attention.kv_lora_rank": 64})
    before = fields(path)
    assert Q_LORA_RANK not in before
    assert complete_for_llama_cpp(path)
    after = fields(path)
    assert after.pop(Q_LORA_RANK) == 0 and after == before
    reader = gguf.GGUFReader(path)
    assert {t.name: np.asarray(t.data).reshape(tensors[t.name].shape).tolist() for t in reader.tensors} == \
        {n: t.tolist() for n, t in tensors.items()}
    assert not complete_for_llama_cpp(path)  # already complete: nothing rewritten
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mla.gguf"]  # no temporary file left


def test_completion_refuses_other_files_in_one_line(tmp_path):
    llama = tmp_path / "llama.gguf"
    write_gguf(llama, "llama")
    with pytest.raises(SurgeryError, match="llama GGUF"):
        complete_for_llama_cpp(llama)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    result = subprocess.run([sys.executable, "-m", "surgery.mla.gguf", str(junk)], capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"surgery: error: {junk}: not a readable GGUF file")
    assert junk.read_bytes() == b"not a gguf at all"


def test_llama_cpp_cache_of_a_latent_gguf_is_its_k_row_only():
    """Metadata as llama.cpp's converter writes it for SmolLM2 (30 layers, 9 heads): the source caches K and V of 3
    KV heads of 64; the MLA file one row of latent 64 + rope key 64 per layer (llama.cpp logs V 0.00 MiB)."""
    source = {"general.architecture": "llama", "llama.block_count": "30", "llama.attention.head_count": "9",
              "llama.attention.head_count_kv": "3", "llama.embedding_length": "576"}
    mla = {"general.architecture": "deepseek2", "deepseek2.block_count": "30", "deepseek2.attention.head_count": "9",
           "deepseek2.attention.head_count_kv": "1", "deepseek2.embedding_length": "576",
           "deepseek2.attention.key_length": "128", "deepseek2.attention.value_length": "64",
           "deepseek2.attention.kv_lora_rank": "64"}
    assert gguf_kv_values(source) == 30 * 2 * 3 * 64
    assert gguf_kv_values(mla) == 30 * (64 + 64)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None or not os.environ.get("LLAMA_CPP_CONVERT"),
                    reason="needs llama-cpp-python and LLAMA_CPP_CONVERT=path/to/llama.cpp/convert_hf_to_gguf.py")
def test_mla_output_runs_in_llama_cpp_with_the_same_logits(tmp_path):
    """SmolLM2 -> MLA (rank 64 + rope 64, MQA's cache) through llama.cpp's own converter and this completion, then the
    same real text through llama.cpp and transformers in float32: the logits agree to rounding, and llama.cpp's cache
    is a third of the source's."""
    from llama_cpp_roundtrip import convert_with_llama_cpp, logits_both_ways
    from surgery.checkpoint.source import embedded_smollm2_gguf

    out = tmp_path / "mla"
    done = surgery("convert", "smollm2", "--to", "mla", "--kv-rank", "64", "--rope-dim", "64", "--calib-tokens",
                   "2048", "--out", out)
    assert done.returncode == 0, done.stderr[-2000:]
    gguf_file = convert_with_llama_cpp(out, tmp_path / "mla-f32.gguf")
    assert complete_for_llama_cpp(gguf_file)
    ref, got, metadata = logits_both_ways(out, gguf_file, 256)
    assert metadata["deepseek2.attention.kv_lora_rank"] == "64"
    # f32 rounding only: measured 1.0e-4 over these 256 tokens (logits up to 40)
    assert np.abs(got - ref).max() <= 5e-3, np.abs(got - ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.98
    report = run_bench(BenchOptions(source=str(embedded_smollm2_gguf()), converted=str(gguf_file), contexts=[32],
                                    new=2, rounds=1, engine="llama.cpp", threads=1))
    assert report["results"][0]["ratio"]["kv_cache_bytes"] == pytest.approx(1 / 3)


# ---- the tool against hostile files (issue 40) -------------------------------------------------------------------
def tool(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "surgery.mla.gguf", str(path)], capture_output=True, text=True)


def one_error_line(result: subprocess.CompletedProcess, *fragments: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("surgery: error: "), result.stderr
    assert all(f in lines[0] for f in fragments), lines[0]


def test_a_symlink_is_followed_and_stays_a_link_and_the_mode_is_kept(tmp_path):
    target = tmp_path / "real.gguf"
    write_gguf(target, "deepseek2")
    target.chmod(0o640)
    link = tmp_path / "link.gguf"
    link.symlink_to(target)
    done = tool(link)
    assert done.returncode == 0, done.stderr
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert fields(target)[Q_LORA_RANK] == 0 and (target.stat().st_mode & 0o777) == 0o640
    loop = tmp_path / "loop.gguf"
    loop.symlink_to(loop)
    one_error_line(tool(loop), "symlink loop")
    assert loop.is_symlink()


def test_read_only_files_and_folders_are_refused_and_left_as_they_are(tmp_path):
    path = tmp_path / "ro.gguf"
    write_gguf(path, "deepseek2")
    before = path.read_bytes()
    path.chmod(0o444)
    one_error_line(tool(path), "read-only")
    assert path.read_bytes() == before and (path.stat().st_mode & 0o777) == 0o444
    folder = tmp_path / "folder.gguf"
    folder.mkdir()
    one_error_line(tool(folder), "a folder")


def test_a_truncated_gguf_is_one_line_at_every_length(tmp_path):
    path = tmp_path / "whole.gguf"
    write_gguf(path, "deepseek2")
    data = path.read_bytes()
    for cut in range(len(data)):  # every prefix (a 4-byte one was an IndexError)
        broken = tmp_path / f"cut{cut}.gguf"
        broken.write_bytes(data[:cut])
        with pytest.raises(SurgeryError):
            complete_for_llama_cpp(broken)
        assert broken.read_bytes() == data[:cut]
    one_error_line(tool(tmp_path / "cut4.gguf"), "not a readable GGUF file")


def test_a_gguf_on_a_read_only_mount_is_one_line(tmp_path):
    from hostile import small_tmpfs

    with small_tmpfs(tmp_path / "mnt") as mount:
        write_gguf(mount / "m.gguf", "deepseek2")
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        one_error_line(tool(mount / "m.gguf"), "read-only")
        assert Q_LORA_RANK not in fields(mount / "m.gguf")
