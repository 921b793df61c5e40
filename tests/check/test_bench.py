"""`surgery bench` on tiny models (nothing here is timed: the tests check what is measured and how it is reported),
the bench table in the model card, missing engines, and tokenizer files that transformers 4.x and 5.x both load."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from surgery.testing import tiny_models as tm
from surgery.bench.options import BenchOptions, parse_int_list
from surgery.bench.report import markdown_table
from surgery.bench.run import run_bench
from surgery.bench.stats import METRICS
from surgery.errors import SurgeryError
from surgery.checkpoint.source import copy_side_files, portable_tokenizer_config, resolve_source

REPO = Path(__file__).resolve().parents[2]


def surgery(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("surgery: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny Llama (8 query heads, 4 K/V heads) and its MQA conversion."""
    from surgery.kv.convert import convert_to_kv_heads
    from surgery.kv.options import MQAOptions

    root = tmp_path_factory.mktemp("bench")
    tm.make_tiny("llama", root / "llama")
    convert_to_kv_heads(resolve_source(str(root / "llama")), root / "mqa", MQAOptions(), progress=False)
    return root / "llama", root / "mqa"


def test_bench_json_has_every_field_and_ratios_come_from_the_rounds(pair, tmp_path):
    src, mqa = pair
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    result = surgery("bench", src, mqa, "--batch", "1,2", "--context", "8,16", "--new", "3", "--rounds", "3",
                     "--device", "auto", "--threads", "1", "--json", out, "--plot", png)
    assert result.returncode == 0, result.stderr
    assert "ratio" in result.stdout and "decode" in result.stdout
    report = json.loads(out.read_text())
    for key in ("command", "date", "engine", "dtype", "new_tokens", "rounds", "batches", "contexts", "machine",
                "models", "results"):
        assert key in report, key
    assert report["engine"] == "transformers" and report["new_tokens"] == 3 and report["rounds"] == 3
    assert report["machine"]["threads"] == 1 and report["machine"]["device"] == "cpu"
    assert report["models"]["source"]["attention"] == "sdpa" and not report["models"]["converted"]["custom_code"]
    assert [(r["batch"], r["context"]) for r in report["results"]] == [(1, 8), (1, 16), (2, 8), (2, 16)]
    layers, head_dim = 2, 8
    for row in report["results"]:
        b, t = row["batch"], row["context"]
        for role, kv_heads in (("source", 4), ("converted", 1)):
            rounds = row["rounds"][role]
            assert [r["round"] for r in rounds] == [0, 1, 2]
            for r in rounds:
                assert len(r["decode_steps_s"]) == 3 and all(s > 0 for s in r["decode_steps_s"])
                assert r["prefill_tokens_per_s"] == pytest.approx(b * t / r["prefill_s"])
                assert r["decode_tokens_per_s"] == pytest.approx(b * 3 / sum(r["decode_steps_s"]))
                # the cache after the prefill holds K and V of every layer and prompt token, float32
                assert r["kv_cache_bytes"] == 2 * layers * kv_heads * head_dim * b * t * 4
                assert r["peak_memory_bytes"] is None or r["peak_memory_bytes"] >= 0
            for key in METRICS:
                values = [r[key] for r in rounds if r[key] is not None]
                stats = row[role][key]
                if not values:
                    assert stats["median"] is None
                    continue
                assert stats["median"] == pytest.approx(statistics.median(values))
                assert stats["min"] == min(values) and stats["max"] == max(values)
        for key in METRICS:
            a, c = row["source"][key]["median"], row["converted"][key]["median"]
            if a and c is not None:
                assert row["ratio"][key] == pytest.approx(c / a)
        assert row["ratio"]["kv_cache_bytes"] == pytest.approx(0.25)  # 4 -> 1 K/V heads, measured on the cache
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = "\n".join(markdown_table(report))
    assert table.count("\n") == 1 + len(report["results"]) and "0.25x" in table


def test_bench_custom_code_needs_trust_remote_code(pair, tmp_path):
    from surgery.talking_heads import convert_to_talking_heads
    from surgery.talking_heads.options import TalkingHeadsOptions

    src, _ = pair
    th = tmp_path / "th"
    convert_to_talking_heads(resolve_source(str(src)), th, TalkingHeadsOptions(), progress=False)
    code = th / "modeling_talking_heads.py"  # edited: no longer the toolkit's own code, so only the flag runs it
    code.write_text(code.read_text() + "\n# edited\n")
    result = surgery("bench", src, th, "--context", "8", "--new", "2", "--rounds", "1")
    assert_one_line_error(result, "--trust-remote-code")
    report = run_bench(BenchOptions(source=str(src), converted=str(th), contexts=[8], new=2, rounds=1, threads=1,
                                    trust_remote_code=True))
    row = report["results"][0]
    assert report["models"]["converted"]["custom_code"] and report["models"]["converted"]["attention"] == "talking_heads"
    assert row["ratio"]["kv_cache_bytes"] == pytest.approx(1.0)  # talking-heads keeps the source's cache
    assert len(row["rounds"]["converted"]) == 1


@pytest.mark.parametrize("engine, packages, words", [("llama.cpp", ("llama_cpp", "llama_cpp_py_sync"),
                                                      "neither is installed"), ("vllm", ("vllm",), "not installed")])
def test_missing_engine_is_one_line_exit_2(pair, engine, packages, words):
    if any(importlib.util.find_spec(p) is not None for p in packages):
        pytest.skip(f"{' or '.join(packages)} is installed here")
    src, mqa = pair
    result = surgery("bench", src, mqa, "--engine", engine)
    assert_one_line_error(result, engine, words)


def test_bench_bad_lists_are_one_line(pair):
    src, mqa = pair
    assert_one_line_error(surgery("bench", src, mqa, "--batch", "1,x"), "--batch")
    with pytest.raises(SurgeryError, match="--context"):
        parse_int_list("0", "--context")
    with pytest.raises(SurgeryError, match="positions"):  # the tiny models have 128
        run_bench(BenchOptions(source=str(src), converted=str(mqa), contexts=[120], new=16, rounds=1))


def test_card_includes_the_bench_table(pair, tmp_path):
    from surgery.publish.card import build_card
    from surgery.publish.validate import validate_folder

    src, mqa = pair
    report = run_bench(BenchOptions(source=str(src), converted=str(mqa), contexts=[8], new=2, rounds=1, threads=1))
    card = build_card(validate_folder(mqa), "me/tiny-mqa", bench=report)
    assert "## Measured speed" in card and "| 1 | 8 |" in card and "0.25x" in card


def test_replicated_prefill_decodes_the_whole_batch(pair):
    src, mqa = pair
    report = run_bench(BenchOptions(source=str(src), converted=str(mqa), batches=[3], contexts=[8], new=2, rounds=1,
                                    threads=1, replicate_prefill=True))
    row = report["results"][0]
    assert row["prefill_batch"] == 1 and report["replicate_prefill"]
    r = row["rounds"]["source"][0]
    assert r["kv_cache_bytes"] == 2 * 2 * 4 * 8 * 3 * 8 * 4  # the cache decoded on holds all 3 rows
    assert r["prefill_tokens_per_s"] == pytest.approx(8 / r["prefill_s"])
    assert r["decode_tokens_per_s"] == pytest.approx(3 * 2 / sum(r["decode_steps_s"]))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_llama_cpp_engine_on_gguf_files(tmp_path):
    """Both SmolLM2 GGUF files through llama.cpp (the embedded one against itself: the ratio of KV bytes is 1)."""
    from surgery.checkpoint.source import embedded_smollm2_gguf

    gguf = embedded_smollm2_gguf()
    report = run_bench(BenchOptions(source=str(gguf), converted=str(gguf), contexts=[64], new=4, rounds=1,
                                    engine="llama.cpp", threads=1))
    row = report["results"][0]
    assert row["ratio"]["kv_cache_bytes"] == pytest.approx(1.0)
    assert row["source"]["decode_tokens_per_s"]["median"] > 0


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_flash_attn_reaches_llama_cpp_and_every_record(tmp_path, capsys):
    """--flash-attn builds llama.cpp's context with flash attention on (the default) or off, read back from the
    context llama-cpp-python built, and the JSON, the table title and the card say which path was measured. The
    embedded SmolLM2 GGUF against itself, 8 tokens: a second each."""
    from inprocess import run_cli
    from surgery.checkpoint.source import embedded_smollm2_gguf

    gguf = str(embedded_smollm2_gguf())
    for choice, expected in ((None, "on"), ("off", "off")):
        out = tmp_path / f"flash-{expected}.json"
        args = ["bench", gguf, gguf, "--engine", "llama.cpp", "--context", "8", "--new", "2", "--rounds", "1",
                "--threads", "1", "--json", out] + (["--flash-attn", choice] if choice else [])
        code, stdout, stderr = run_cli(capsys, *args)
        assert code == 0, stderr
        report = json.loads(out.read_text())
        assert report["flash_attn"] == expected
        for role in ("source", "converted"):
            assert report["models"][role]["flash_attn"] is (expected == "on")
            assert report["models"][role]["attention"].endswith(f"flash attention {expected})")
        assert f"flash attention {expected}" in " ".join(stdout.split())  # the table's title
    from surgery.publish.card import bench_section

    assert "llama.cpp, flash attention off," in "\n".join(bench_section(report))


def test_flash_attn_with_another_engine_or_value_is_one_line(pair, capsys, tmp_path):
    """A flash-attention choice the engine would not apply is refused, not ignored."""
    from inprocess import run_cli
    from surgery.bench.options import resolve_flash_attn

    src, mqa = pair
    code, _, stderr = run_cli(capsys, "bench", src, mqa, "--context", "8", "--flash-attn", "off")
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("surgery: error: --flash-attn works with --engine "
                                                                 "llama.cpp only"), stderr
    with pytest.raises(SurgeryError, match="--engine llama.cpp only"):
        run_bench(BenchOptions(source=str(src), converted=str(mqa), contexts=[8], new=2, rounds=1, flash_attn="on"))
    with pytest.raises(SurgeryError, match="choose on or off"):
        resolve_flash_attn("auto", "llama.cpp")
    assert resolve_flash_attn(None, "llama.cpp") == "on" and resolve_flash_attn(None, "vllm") is None
    report = run_bench(BenchOptions(source=str(src), converted=str(mqa), contexts=[8], new=2, rounds=1, threads=1))
    assert report["flash_attn"] is None  # transformers: no such switch, and the report does not pretend one
    from surgery.publish.reports import load_bench_report as load_report

    path = tmp_path / "bench.json"
    path.write_text(json.dumps(report | {"flash_attn": "sometimes"}))
    with pytest.raises(SurgeryError, match="flash_attn"):  # a report for the card names a path that exists
        load_report(path)


# --- tokenizer files -------------------------------------------------------------------------------------------
def test_copied_tokenizer_config_loads_in_transformers_4_and_5(tmp_path):
    """transformers 5 writes "TokenizersBackend", which transformers 4.x does not know: copies say
    PreTrainedTokenizerFast (which 4.x knows and 5.x maps to the same class) and still load here."""
    from tokenizers import Tokenizer, models
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    tok = Tokenizer(models.WordLevel({"<eos>": 0, "a": 1, "b": 2}, unk_token="<eos>"))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(src)
    written = json.loads((src / "tokenizer_config.json").read_text())
    written.update(tokenizer_class="TokenizersBackend", is_local=True, local_files_only=False)
    (src / "tokenizer_config.json").write_text(json.dumps(written))
    assert "tokenizer_config.json" in copy_side_files(src, dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "is_local" not in config and "local_files_only" not in config
    assert config["eos_token"] == "<eos>"
    assert json.loads((src / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    loaded = AutoTokenizer.from_pretrained(dst)
    assert loaded.eos_token == "<eos>" and loaded.convert_tokens_to_ids(["a", "b"]) == [1, 2]
    assert not portable_tokenizer_config(dst / "tokenizer_config.json")  # already portable: left as it is


def test_converted_output_has_a_portable_tokenizer_config(pair, tmp_path):
    from surgery.kv.convert import convert_to_kv_heads
    from surgery.kv.options import GQAOptions

    src, _ = pair
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend"}))
    try:
        convert_to_kv_heads(resolve_source(str(src)), tmp_path / "out", GQAOptions(kv_heads=2), progress=False)
    finally:
        (src / "tokenizer_config.json").unlink()
    out = tmp_path / "out"
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    hashes = json.loads((out / "surgery.json").read_text())["output_sha256"]
    import hashlib

    assert hashes["tokenizer_config.json"] == hashlib.sha256((out / "tokenizer_config.json").read_bytes()).hexdigest()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None or not os.environ.get("LLAMA_CPP_CONVERT"),
                    reason="needs llama-cpp-python and LLAMA_CPP_CONVERT=path/to/llama.cpp/convert_hf_to_gguf.py")
def test_mqa_output_converts_with_llama_cpp_and_gives_the_same_logits(tmp_path):
    """An MQA output as it is (tokenizer files included) through llama.cpp's own converter (it finds the gguf package
    of its llama.cpp in gguf-py/ beside itself, and imports sentencepiece), then the same tokens of real text through
    llama.cpp and transformers in float32 (weights and KV cache): the logits agree to rounding."""
    import numpy as np

    from llama_cpp_roundtrip import convert_with_llama_cpp, logits_both_ways

    out = tmp_path / "mqa"
    assert surgery("convert", "smollm2", "--to", "mqa", "--out", out).returncode == 0
    gguf = convert_with_llama_cpp(out, tmp_path / "mqa-f32.gguf")
    ref, got, metadata = logits_both_ways(out, gguf, 96)
    assert metadata["llama.attention.head_count_kv"] == "1"
    # f32 rounding only: measured 2.5e-3 over 256 tokens (llama.cpp's default f16 cache: 0.2)
    assert np.abs(got - ref).max() <= 5e-3, np.abs(got - ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.98
    report = run_bench(BenchOptions(source=str(gguf), converted=str(gguf), contexts=[32], new=2, rounds=1,
                                    engine="llama.cpp", threads=1))
    assert report["results"][0]["ratio"]["kv_cache_bytes"] == pytest.approx(1.0)


def test_compile_runs_both_models_through_dynamo_and_says_so(pair):
    import torch._dynamo

    src, mqa = pair
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    report = run_bench(BenchOptions(source=str(src), converted=str(mqa), batches=[1], contexts=[8], new=2, rounds=1,
                                    device="cpu", threads=1, compile="eager"))
    assert report["compile"] == "eager"
    assert all(report["models"][role]["compiled"] == "eager" for role in ("source", "converted"))
    row = report["results"][0]
    assert set(row["compile_warmup_s"]) == {"source", "converted"} and min(row["compile_warmup_s"].values()) > 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2  # at least one graph per model
    assert len(row["rounds"]["converted"][0]["decode_steps_s"]) == 2
    torch._dynamo.reset()


def test_compile_that_cannot_run_is_one_line(pair, monkeypatch):
    import torch

    from surgery.bench.options import require_compile

    src, mqa = pair
    assert_one_line_error(surgery("bench", src, mqa, "--compile", "no_such_backend", "--context", "8"),
                          "--compile no_such_backend: not a torch.compile backend")
    with pytest.raises(SurgeryError, match="transformers engine only"):
        require_compile("inductor", "llama.cpp", torch.device("cpu"))
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    with pytest.raises(SurgeryError, match="needs a C\\+\\+ compiler"):
        require_compile("inductor", "transformers", torch.device("cpu"))


def test_every_timed_region_is_read_between_device_syncs_and_the_cache_copy_is_not_timed(pair, monkeypatch):
    """On CUDA the clock must be read after a sync on both sides of a region, or it times what the queue held
    (the batch > 1 cache copy landed in the first decode step). The device sync is recorded here on CPU."""
    import torch
    import transformers

    from surgery.bench import measure
    from surgery.bench.transformers_engine import TransformersEngine

    events = []
    monkeypatch.setattr(measure, "_sync", lambda device: events.append("sync"))
    clock = iter(range(10**6))

    def perf_counter():
        events.append("clock")
        return float(next(clock))

    monkeypatch.setattr(measure.time, "perf_counter", perf_counter)
    repeat = transformers.DynamicCache.batch_repeat_interleave
    monkeypatch.setattr(transformers.DynamicCache, "batch_repeat_interleave",
                        lambda self, n: (events.append("copy"), repeat(self, n))[1])
    src, _ = pair
    engine = TransformersEngine(torch.device("cpu"), "float32", {"source": False})
    handle = engine.load(str(src), "source")
    forward = handle["model"].forward
    monkeypatch.setattr(handle["model"], "forward", lambda *a, **k: (events.append("forward"), forward(*a, **k))[1])
    ids = torch.randint(0, 90, (3, 8), generator=torch.Generator().manual_seed(0))
    events.clear()
    raw = engine.measure(handle, ids, ids[:, :3], replicate=True)
    clocks = [i for i, e in enumerate(events) if e == "clock"]
    assert len(clocks) == 2 * (1 + 3) and len(raw["decode_steps_s"]) == 3  # the prefill and three steps
    for start, stop in zip(clocks[::2], clocks[1::2]):
        assert events[start - 1] == "sync" and events[stop - 1] == "sync"
        assert events[start + 1:stop - 1] == ["forward"]  # nothing else inside a timed region
    assert "copy" in events and events.index("copy") < clocks[2]  # before the first step's clock starts
