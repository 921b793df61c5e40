"""`--merge aligned` on tiny random models of every architecture: exactness, quality against mean pooling,
query-head permutation, the output checkpoint and surgery.json, the CLI and its errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from surgery.testing import tiny_models as tm
from surgery.testing.aligned import CALIB, ROTARY_PAIRING, aligned, heldout_ids, kl_to_source, rotated_copy_heads
from surgery.testing.tiny_models import char_tokenizer, tiny
from surgery.kv.convert import convert_to_kv_heads
from surgery.kv.options import GQAOptions, MQAOptions
from surgery.kv.aligned import convert_aligned
from surgery.kv.aligned.pipeline import MergeOptions
from surgery.checkpoint.source import resolve_source

REPO = Path(__file__).resolve().parents[2]


# every family the aligned merge converts (the others refuse in one line: see test_refused_families_say_why)
ALIGNED = [a for a in tm.ARCHS if tm.refused(a, "mqa/gqa aligned") is None]
# the fewest K/V heads each architecture's grouped target allows (1 unless said here)
TARGET = {a: {"mistral": 2, "phi3": 2, "gpt_neox": 2}.get(a, 1) for a in ALIGNED if a != "gpt_bigcode_mq"}


@pytest.mark.parametrize("arch", ALIGNED)
def test_same_kv_heads_is_exact(arch, tmp_path):
    src = tiny(arch, tmp_path / "src")
    kv = tm.kv_heads_of(tm.load(src).config)
    record = aligned(src, tmp_path / "out", kv)
    kl, diff = kl_to_source(src, tmp_path / "out", heldout_ids(windows=2))
    assert diff <= 1e-5, diff
    assert record["method"] == "aligned" and record["kv_heads"] == {"before": kv, "after": kv}


@pytest.mark.parametrize("arch", list(TARGET))
def test_aligned_beats_mean_pooling(arch, tmp_path):
    """On held-out text the calibration never saw, aligned is far closer to the source than mean pooling."""
    src = tiny(arch, tmp_path / "src")
    g = TARGET[arch]
    record = aligned(src, tmp_path / "aligned", g)
    convert_to_kv_heads(resolve_source(str(src)), tmp_path / "mean", GQAOptions(kv_heads=g), progress=False)
    ids = heldout_ids()
    kl_aligned, _ = kl_to_source(src, tmp_path / "aligned", ids)
    kl_mean, _ = kl_to_source(src, tmp_path / "mean", ids)
    assert kl_aligned < 0.5 * kl_mean, (kl_aligned, kl_mean)
    # a standard checkpoint: plain transformers loads it, with the grouped K/V heads
    config = json.loads((tmp_path / "aligned" / "config.json").read_text())
    mean_config = json.loads((tmp_path / "mean" / "config.json").read_text())
    assert config == mean_config
    assert record["kv_heads"]["after"] == g and record["calibration"]["tokens"] == CALIB
    assert record["calibration"]["data"] == "pydoc"
    stored = json.loads((tmp_path / "aligned" / "surgery.json").read_text())
    assert stored["method"] == "aligned" and stored["groups"] == record["groups"]


def _duplicate_heads(folder: Path) -> None:
    """Tiny llama (8 query heads, 4 K/V heads) whose K/V heads 2 and 3 copy heads 0 and 1."""
    model = tm.make_tiny("llama", folder)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                w = proj.weight.view(4, -1, proj.weight.shape[1])
                w[2], w[3] = w[0].clone(), w[1].clone()
    model.save_pretrained(folder)
    char_tokenizer(folder)


def test_similar_heads_are_grouped_and_queries_permuted(tmp_path):
    """K/V heads {0, 2} and {1, 3} are identical: the merge groups them (not consecutively), permutes the query
    heads to match, and the grouped model computes exactly what the source does."""
    src = tmp_path / "src"
    _duplicate_heads(src)
    record = aligned(src, tmp_path / "out", 2)
    assert record["layer_groups"] == [[[0, 2], [1, 3]]] * 2
    assert record["query_permutation"]["0"] == [0, 1, 4, 5, 2, 3, 6, 7]
    assert record["groups"][0]["source_kv_heads"] == [0, 2]
    _, diff = kl_to_source(src, tmp_path / "out", heldout_ids(windows=2))
    assert diff < 1e-3, diff
    convert_to_kv_heads(resolve_source(str(src)), tmp_path / "mean", GQAOptions(kv_heads=2), progress=False)
    _, mean_diff = kl_to_source(src, tmp_path / "mean", heldout_ids(windows=2))
    assert mean_diff > 100 * diff


@pytest.mark.parametrize("arch", list(ROTARY_PAIRING))
def test_keys_equal_up_to_rope_commuting_maps_merge_exactly(arch, tmp_path):
    """Two K heads that differ by a per-pair complex scalar merge into one with no loss when the merge pairs dims as
    the family rotates them (half-split for Llama; interleaved (2i, 2i + 1) for Cohere, Cohere2 and GLM): the
    scalars fold into the queries. Mean pooling is far off on the same model."""
    src = tmp_path / "src"
    rotated_copy_heads(arch, src)
    kv = tm.kv_heads_of(tm.load(src).config) // 2
    record = aligned(src, tmp_path / "out", kv)
    assert record["layer_groups" if "layer_groups" in record else "groups"]  # the pairs were found, whatever order
    assert record["merge"]["key_loss"] < 1e-6, record["merge"]
    _, diff = kl_to_source(src, tmp_path / "out", heldout_ids(windows=2))
    assert diff < 1e-5, diff  # the query and output refits keep it exact (Cohere2's global layer has no RoPE)
    convert_to_kv_heads(resolve_source(str(src)), tmp_path / "mean", GQAOptions(kv_heads=kv), progress=False)
    _, mean_diff = kl_to_source(src, tmp_path / "mean", heldout_ids(windows=2))
    assert mean_diff > 100 * diff, (mean_diff, diff)


@pytest.mark.parametrize("arch,targets", [("smollm3", "local"), ("cohere2", "local"), ("cohere2", "source")])
def test_layers_without_rope_are_merged_as_such(arch, targets, tmp_path):
    """SmolLM3 (no_rope_layers) and Cohere2 (global layers) hand the rotary table to every layer and skip it in some:
    the merge reads from the source layer's own keys which layers rotate, and merges the others' keys by any linear
    map (and refits their queries without rotating them)."""
    src = tiny(arch, tmp_path / "src")
    config = tm.load(src).config
    if arch == "smollm3":
        rotates = [bool(flag) for flag in config.no_rope_layers]
    else:
        rotates = [kind == "sliding_attention" for kind in config.layer_types]
    assert True in rotates and False in rotates  # the tiny model has both kinds
    record = aligned(src, tmp_path / "out", 1, merge=MergeOptions(groups=1, targets=targets))
    head_dim = config.hidden_size // config.num_attention_heads  # full rotary in both families
    assert record["merge"]["layer_rotary_dims"] == [head_dim if r else 0 for r in rotates]


def test_output_dtype_and_untouched_tensors(tmp_path):
    """--dtype applies to every floating tensor; tensors outside attention are the source's, bit for bit."""
    from safetensors.torch import load_file

    src = tiny("llama", tmp_path / "src")
    aligned(src, tmp_path / "out", 2, dtype="bfloat16")
    before, after = load_file(src / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert {t.dtype for t in after.values()} == {torch.bfloat16}
    assert after["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 8, 64)
    mlp = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(after[mlp], before[mlp].to(torch.bfloat16))


def surgery(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600)


def test_cli_convert_aligned_and_errors(tmp_path):
    src = tiny("qwen2", tmp_path / "src")
    ok = surgery("convert", src, "--to", "mqa", "--merge", "aligned", "--calib-tokens", CALIB, "--out", tmp_path / "out")
    assert ok.returncode == 0, ok.stderr
    assert "aligned merge" in ok.stdout
    assert json.loads((tmp_path / "out" / "surgery.json").read_text())["method"] == "aligned"
    for args, fragment in (
        (["--calib-tokens", "0"], "--calib-tokens"),
        (["--calib", str(tmp_path / "missing.txt")], "does not exist"),
        (["--to", "gqa", "--kv-heads", "3"], "--kv-heads 3"),
    ):
        to = [] if "--to" in args else ["--to", "mqa"]
        bad = surgery("convert", src, *to, "--merge", "aligned", *args, "--out", tmp_path / "bad")
        assert bad.returncode == 2, bad.stderr
        lines = bad.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("surgery: error: ") and fragment in lines[0], bad.stderr
        assert not (tmp_path / "bad").exists()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".bad")]


def test_calib_window_cuts_the_calibration_text_into_windows_of_that_length(tmp_path):
    """--calib-window reaches the calibration: the same tokens of the same documents, cut into windows of 32 instead
    of the context's 128 (the default 512 capped by the tiny model's context), refit other queries; the record says
    which windows the fit saw."""
    src = tiny("llama", tmp_path / "src")
    long = aligned(src, tmp_path / "long", 1)
    ok = surgery("convert", src, "--to", "mqa", "--merge", "aligned", "--calib-tokens", CALIB, "--calib-window", 32,
                 "--device", "cpu", "--out", tmp_path / "short")
    assert ok.returncode == 0, ok.stderr
    short = json.loads((tmp_path / "short" / "surgery.json").read_text())
    assert (long["calibration"]["window_length"], long["calibration"]["windows"]) == (128, CALIB // 128)
    assert (short["calibration"]["window_length"], short["calibration"]["windows"]) == (32, CALIB // 32)
    assert short["calibration"]["documents_sha256"] == long["calibration"]["documents_sha256"]
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "long" / "model.safetensors"), load_file(tmp_path / "short" / "model.safetensors")
    q = next(n for n in a if n.endswith("layers.0.self_attn.q_proj.weight"))  # refitted under the windows' attention
    assert a[q].shape == b[q].shape and not torch.allclose(a[q], b[q])
    # both are fitted merges: each is far closer to the source than mean pooling on held-out text
    convert_to_kv_heads(resolve_source(str(src)), tmp_path / "mean", MQAOptions(), progress=False)
    ids = heldout_ids()
    kl_mean, _ = kl_to_source(src, tmp_path / "mean", ids)
    for name in ("long", "short"):
        kl, _ = kl_to_source(src, tmp_path / name, ids)
        assert kl < 0.5 * kl_mean, (name, kl, kl_mean)
    bad = surgery("convert", src, "--to", "mqa", "--merge", "aligned", "--calib-window", 1, "--out", tmp_path / "bad")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "surgery: error: --calib-window must be at least 2, got 1"], bad.stderr
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow  # 10-30 s: keeps the default suite under 25 minutes on 2 cores
def test_compare_merges_table(tmp_path):
    src = tiny("llama", tmp_path / "src")
    res = surgery("compare-merges", src, "--to", "gqa", "--kv-heads", "2", "--tokens", "1024", "--seq-len", "128",
                  "--calib-tokens", CALIB, "--json", tmp_path / "table.json")
    assert res.returncode == 0, res.stderr
    for method in ("mean", "first", "random", "aligned"):
        assert method in res.stdout
    table = json.loads((tmp_path / "table.json").read_text())
    kl = {row["method"]: row["kl"] for row in table["rows"]}
    assert kl["aligned"] < 0.5 * min(kl["mean"], kl["first"], kl["random"])
    assert table["tokens"] == 1024
    bad = surgery("compare-merges", src, "--to", "gqa", "--kv-heads", "2", "--methods", "mean,best")
    assert bad.returncode == 2 and "best" in bad.stderr
