"""`surgery bench --engine llama.cpp` on the files `surgery export` writes: which binding it drives (llama-cpp-python,
else the prebuilt llama-cpp-py-sync) and the one-line refusals when neither is usable; the KV cache it counts from a
GGUF's metadata (sliding layers at their window) and reads from llama.cpp's log; and, where llama-cpp-py-sync loads,
a run on the tiny Llama's and its swa output's exported files."""

from __future__ import annotations

import importlib.util

import pytest

from exported_files import exported  # noqa: F401 (a fixture)
from llama_cpp_run import llama_cpp_loads

import surgery.bench.llama_cpp_bindings as bindings
from surgery.errors import SurgeryError


def only_installed(monkeypatch, *modules: str) -> None:
    """find_spec as if of the llama.cpp bindings only `modules` were installed (the rest of Python untouched)."""
    real = importlib.util.find_spec
    names = {m for m, _ in bindings.BINDINGS}
    monkeypatch.setattr(bindings, "find_spec",
                        lambda name, *a: (real(name, *a) if name in modules else None) if name in names
                        else real(name, *a))


def write_package(monkeypatch, root, name: str, files: dict[str, str]) -> None:
    """A package `name` under `root` (first on sys.path), imported afresh: a real one already imported is set aside."""
    import sys

    for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.syspath_prepend(str(root))
    (root / name).mkdir()
    for file, text in {"__init__.py": "", **files}.items():
        (root / name / file).write_text(text)


def test_neither_binding_installed_is_one_line_before_anything_loads(monkeypatch, cli, tmp_path):
    only_installed(monkeypatch)
    with pytest.raises(SurgeryError, match=r"needs llama-cpp-python or llama-cpp-py-sync, and neither is installed"):
        bindings.pick_binding()
    code, _, err = cli("bench", tmp_path / "a.gguf", tmp_path / "b.gguf", "--engine", "llama.cpp")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "neither is installed" in lines[0] and "pip install" in lines[0]


def test_dtype_with_llama_cpp_is_one_line_and_the_report_names_each_files_own(monkeypatch, cli, tmp_path, exported):
    """llama.cpp runs a GGUF's weights as stored: `--dtype` is refused before a binding is looked for, and the
    report's dtype is the files' own (f32 here), not a torch dtype nobody used."""
    from surgery.bench.llama_cpp_engine import gguf_file_type, gguf_metadata

    only_installed(monkeypatch)
    code, _, err = cli("bench", tmp_path / "a.gguf", tmp_path / "b.gguf", "--engine", "llama.cpp", "--dtype", "float16")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "surgery export CHECKPOINT --gguf FILE --dtype" in lines[0], err
    assert gguf_file_type(gguf_metadata(exported["swa"][1])) == "f32"
    assert gguf_file_type({"general.file_type": 7}) == "q8_0" and gguf_file_type({}) == "unknown"


def test_an_installed_binding_that_does_not_load_is_named_with_its_reason(monkeypatch, tmp_path):
    """A llama-cpp-py-sync whose shared library fails to load (its wheels need glibc 2.38) is refused in one line
    naming it and llama.cpp's own reason; a llama-cpp-python that imports is preferred to it."""
    write_package(monkeypatch, tmp_path, "llama_cpp_py_sync", {"_cffi_bindings.py": (
        "def get_lib():\n    raise RuntimeError('libllama.so: version `GLIBC_2.38` not found\\nmore detail')\n")})
    only_installed(monkeypatch, "llama_cpp_py_sync")
    with pytest.raises(SurgeryError) as e:
        bindings.pick_binding()
    assert str(e.value) == ("--engine llama.cpp: llama-cpp-py-sync is installed but does not load (libllama.so: "
                            "version `GLIBC_2.38` not found)")
    write_package(monkeypatch, tmp_path, "llama_cpp", {})
    only_installed(monkeypatch, "llama_cpp", "llama_cpp_py_sync")
    assert bindings.pick_binding() == "llama_cpp"


def test_the_kv_cache_lines_llama_cpp_logs_are_read():
    log = ["llama_kv_cache_iswa: creating non-SWA KV cache, size = 2304 cells\n",
           "llama_kv_cache: size =   ", "13.50 MiB (  2304 cells,   8 layers,  1/1 seqs), K (f16):    6.75 MiB, V (f16):"
           "    6.75 MiB\n", "llama_kv_cache: size =    6.75 MiB (  2304 cells,  30 layers,  1/1 seqs), K (f16):    "
           "6.75 MiB, V (f16):    0.00 MiB\n"]  # pieces as the log callback gets them
    assert bindings.kv_cache_lines(log) == [
        {"mib": 13.5, "cells": 2304, "layers": 8, "type_k": "f16", "k_mib": 6.75, "v_mib": 6.75},
        {"mib": 6.75, "cells": 2304, "layers": 30, "type_k": "f16", "k_mib": 6.75, "v_mib": 0.0}]


def test_the_counted_cache_holds_sliding_layers_at_their_window(exported):
    """The swa output's GGUF (window 8, one of two layers global): its metadata counts the sliding layer at 8 tokens,
    as the kind's own count for llama.cpp does from config.json; the source's counts every token."""
    import json

    from surgery.arch import attention_shape
    from surgery.bench.llama_cpp_engine import gguf_kv_values, gguf_metadata
    from surgery.kinds import AttentionShape, kv_cache_values

    folder, gguf_file = exported["swa"]
    meta = gguf_metadata(gguf_file)
    config = json.loads((folder / "config.json").read_text())
    s = attention_shape(config)
    shape = AttentionShape(s["layers"], s["heads"], s["kv_heads"], s["head_dim"], s["hidden"])
    for context in (4, 8, 64):
        assert gguf_kv_values(meta, context) == kv_cache_values(shape, config, context=context)["llama.cpp"]
    source = gguf_metadata(exported["llama"][1])
    assert gguf_kv_values(source, 64) == gguf_kv_values(source) == 2 * gguf_kv_values(meta, 64) * 64 // (64 + 8)


@pytest.mark.skipif(not llama_cpp_loads(), reason="needs llama-cpp-py-sync (a prebuilt llama.cpp) loadable here")
def test_bench_drives_llama_cpp_py_sync_on_exported_files(exported, monkeypatch):
    """The tiny Llama against its swa output, 40 tokens: both through llama-cpp-py-sync (llama-cpp-python made
    invisible), the cache llama.cpp logged (the swa output's two caches: the full layer's, the sliding layer's) and
    the counted one, which is smaller for the swa output beyond its window."""
    from surgery.bench.options import BenchOptions
    from surgery.bench.run import run_bench

    only_installed(monkeypatch, "llama_cpp_py_sync")
    report = run_bench(BenchOptions(source=str(exported["llama"][1]), converted=str(exported["swa"][1]),
                                    contexts=[40], new=2, rounds=1, threads=1, engine="llama.cpp"))
    models = report["models"]
    assert all("llama-cpp-py-sync" in m["attention"] for m in models.values())
    assert report["dtype"] == "GGUF f32"
    assert [c["layers"] for c in models["source"]["llama_cpp_kv_cache"]] == [2]
    full, sliding = models["converted"]["llama_cpp_kv_cache"]
    # llama.cpp pads the context to 256 cells; the sliding layer holds min(that, window + one micro-batch)
    assert (full["layers"], sliding["layers"]) == (1, 1) and full["cells"] == 256
    assert sliding["cells"] == min(full["cells"], 8 + bindings.N_BATCH)
    row = report["results"][0]
    assert row["ratio"]["kv_cache_bytes"] == pytest.approx((1 + 8 / 40) / 2, rel=0.01)  # values per token rounded
    assert row["source"]["decode_tokens_per_s"]["median"] > 0 and row["converted"]["prefill_tokens_per_s"]["median"] > 0
