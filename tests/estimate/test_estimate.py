"""The cost model behind `surgery convert --dry-run`: its counts agree with the code they estimate (torch's flop
counter, the assignment search's own calls, the streaming memory model), and the CLI prints it without converting."""

from __future__ import annotations

import json
import pytest
from inprocess import run_cli
import torch
from torch.utils.flop_counter import FlopCounterMode

from surgery.testing import tiny_models as tm
from surgery.estimate import LayerShape, Throughput, layer_shape, probe_throughput
from surgery.kv.cost import group_evaluations, group_merge_flops, group_score_flops, head_grams_flops
from surgery.kv.aligned.grams import head_grams
from surgery.kv.aligned.assign import assign_groups
from surgery.kv.aligned.fit import merge_group
from surgery.fitting.rotary import rotary_pairs

LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 32, "vocab_size": 128256,
            "max_position_embeddings": 131072, "tie_word_embeddings": False, "rope_theta": 500000.0}


def _layer_and_moments(din: int, d: int, kv_heads: int, queries_per_kv: int, rotary: int):
    """A one-layer shape, a seeded generator and the float64 second moments of random inputs."""
    s = LayerShape(layers=1, hidden=din, heads=kv_heads * queries_per_kv, kv_heads=kv_heads, head_dim=d,
                   intermediate=512, mlp_matrices=3, qkv_bias=False, rotary_dims=rotary)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * din, din, generator=g, dtype=torch.float64)
    return s, g, x.T @ x / x.shape[0]


@pytest.mark.parametrize("members,queries_per_kv,rotary", [(2, 4, 16), (3, 2, 8), (4, 1, 0)])
def test_group_merge_flops_match_torch_flop_counter(members, queries_per_kv, rotary):
    """The float64 work of one K/V group merge, as counted by torch, within 10% of the formula."""
    d, din = 16, 256
    s, g, sigma = _layer_and_moments(din, d, members, queries_per_kv, rotary)
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    with FlopCounterMode(display=False) as counter:
        merge_group(rnd(members, d, din), rnd(members, d, din), rnd(members, queries_per_kv, d, din),
                    rnd(members, queries_per_kv, din, d), sigma, rotary_pairs(d, rotary, "half"), True)
    counted = counter.get_total_flops()
    assert abs(group_merge_flops(s, members) / counted - 1) < 0.10, (group_merge_flops(s, members), counted)


@pytest.mark.parametrize("kv_heads,queries_per_kv,rotary", [(8, 4, 16), (4, 2, 8), (6, 1, 0)])
def test_head_grams_flops_match_torch_flop_counter(kv_heads, queries_per_kv, rotary):
    """The grouping search's shared products (grams.head_grams), as counted by torch, within 10% of the formula."""
    d, din = 16, 256
    s, g, sigma = _layer_and_moments(din, d, kv_heads, queries_per_kv, rotary)
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731  (float32, as the pipeline passes them)
    with FlopCounterMode(display=False) as counter:
        head_grams(rnd(kv_heads, queries_per_kv, d, din), rnd(kv_heads, d, din), rnd(kv_heads, d, din),
                   rnd(kv_heads, queries_per_kv, din, d), sigma, rotary_pairs(d, rotary, "half"), True)
    counted = counter.get_total_flops()
    assert abs(head_grams_flops(s) / counted - 1) < 0.10, (head_grams_flops(s), counted)


@pytest.mark.parametrize("kv_heads,groups", [(8, 2), (8, 4), (4, 2), (6, 3), (16, 2), (8, 1), (8, 8)])
def test_group_evaluations_count_the_assignment_search(kv_heads, groups):
    """As many group merges of each size as assign_groups scores, plus the final groups."""
    sizes = []
    assign_groups(lambda g: sizes.append(len(g)) or float(sum(g)) ** 0.5, kv_heads, groups)
    expected = sorted(sizes + [kv_heads // groups] * groups)
    assert sorted(group_evaluations(kv_heads, groups)) == expected
    assert group_evaluations(kv_heads, groups, assign=False) == [kv_heads // groups] * groups


def calibrated(kind: str, rate, **values):
    """The kind's own estimate (its cost model, surgery/kinds) of a calibrated conversion of Llama-3.1-8B."""
    from surgery.kinds import get_kind, options_for

    return get_kind(kind).calibration_estimate(LLAMA_8B, options_for(kind, **values), dtype="bfloat16", device="cpu",
                                               throughput=rate)


def test_llama_8b_costs_scale_as_the_algorithm_does():
    """Real Llama-3.1-8B shapes: the similarity search costs about one group merge plus its 70 scores (not 70
    merges); memory stays far below the model."""
    rate = Throughput("cpu", 10e9, 5e9)
    search = calibrated("gqa", rate, kv_heads=2, merge="aligned", calib_tokens=1024)
    plain = calibrated("gqa", rate, kv_heads=2, merge="aligned", grouping="consecutive", calib_tokens=1024)
    shape = layer_shape(LLAMA_8B)
    group = group_merge_flops(shape, 4)
    searched = search.flops_per_layer.float64 - plain.flops_per_layer.float64
    assert searched == pytest.approx(head_grams_flops(shape) + 70 * group_score_flops(shape, 4))
    assert 0.1 * 70 * group > searched > group  # scored from shared products: far below merging each candidate
    assert search.flops_per_layer.float32 == plain.flops_per_layer.float32
    more = calibrated("gqa", rate, kv_heads=2, merge="aligned", grouping="consecutive", calib_tokens=8192)
    assert 6 < more.flops_per_layer.float32 / plain.flops_per_layer.float32 < 8.5  # linear in the tokens
    assert more.host_bytes > plain.host_bytes  # the activations grow with the tokens
    bf16_model = 16.06e9
    assert plain.host_bytes < 0.35 * bf16_model  # one layer, not the model
    sh = calibrated("switchhead", rate, heads=8, experts=4, topk=2, calib_tokens=1024)
    assert sh.flops_per_layer.float32 > 0 and sh.host_bytes < 0.35 * bf16_model
    assert sh.seconds == pytest.approx(sh.seconds_per_layer * 32)


def test_probe_measures_a_positive_rate():
    t = probe_throughput("cpu", seconds=0.2)
    assert t.float32 > 1e8 and t.float64 > 1e8


def _surgery(capsys, *args) -> tuple[int, str, str]:
    """`surgery ARGS` in this process (no interpreter start-up): (exit code, stdout, stderr)."""
    return run_cli(capsys, *args)


def test_convert_dry_run_prints_the_estimate_and_writes_nothing(tmp_path, capsys):
    src = tmp_path / "llama"
    tm.make_tiny("llama", src)
    out = tmp_path / "out"
    code, stdout, err = _surgery(capsys, "convert", src, "--to", "gqa", "--kv-heads", "2", "--merge", "aligned",
                                 "--calib-tokens", "256", "--device", "cpu", "--out", out, "--dry-run", "--json", "-")
    assert code == 0, err
    assert "peak host memory" in stdout and "time per layer" in stdout
    report = json.loads(stdout[stdout.index("{"):])
    assert report["calibrated"] and report["layers"] == 2 and report["seconds_per_layer"] > 0
    assert report["host_bytes"] > report["memory_terms"]["layer (float32)"] > 0
    assert not out.exists()
    code, stdout, err = _surgery(capsys, "convert", src, "--to", "mqa", "--dry-run")
    assert code == 0 and "no calibration" in stdout, err
    code, _, err = _surgery(capsys, "convert", src, "--to", "mqa")
    assert code == 2 and err.strip().splitlines() == [
        "surgery: error: Missing option '--out'. (see `surgery convert --help`)"]
    code, _, err = _surgery(capsys, "convert", src, "--to", "gqa", "--merge", "aligned", "--dry-run")
    assert code == 2 and "--to gqa needs --kv-heads N" in err


def test_aligned_options_move_the_estimate_as_their_work_does():
    """--query-samples and --refit-values reach the cost model: more sampled queries cost more time, the value
    refit holds one hidden x hidden float64 matrix per query head (Llama-3-8B: 32 x 4096^2 x 8 bytes = 4.3 GB)."""
    from surgery.estimate import layer_shape
    from surgery.kv.cost import aligned_layer_flops, fit_bytes

    s = layer_shape(LLAMA_8B)
    base = aligned_layer_flops(s, 2, 1024)
    more = aligned_layer_flops(s, 2, 1024, query_samples=512)
    values = aligned_layer_flops(s, 2, 1024, refit_values=True)
    assert more.float32 > base.float32 and more.float64 == base.float64
    assert values.float64 > base.float64
    assert fit_bytes(s, refit_values=True) >= 32 * 4096**2 * 8 > fit_bytes(s)


def test_calib_window_reaches_the_estimate(tmp_path, capsys):
    """The dry run prices the windows the conversion will cut: the same tokens in longer windows cost more attention
    work per layer and larger attention maps in each chunk's scratch."""
    src = tmp_path / "llama"
    tm.make_tiny("llama", src)
    reports = {}
    for window in (32, 128):
        code, stdout, err = _surgery(capsys, "convert", src, "--to", "mqa", "--merge", "aligned", "--calib-tokens",
                                     "1024", "--calib-window", str(window), "--device", "cpu", "--dry-run", "--json",
                                     "-")
        assert code == 0, err
        reports[window] = json.loads(stdout[stdout.index("{"):])
    assert reports[128]["tokens"] == reports[32]["tokens"] == 1024
    assert reports[128]["flops_per_layer"]["float32"] > reports[32]["flops_per_layer"]["float32"]
    assert reports[128]["memory_terms"]["scratch"] > reports[32]["memory_terms"]["scratch"]


def test_the_kd_teacher_is_sharded_like_the_student_in_the_per_process_estimate():
    """Under FSDP the frozen teacher is sharded per decoder layer (surgery/training/accelerator.py): the dry run's
    memory per process holds its shard and one gathered layer, not the whole teacher as on one process."""
    from pathlib import Path

    from surgery import memory_estimate as est
    from surgery.recipes.schema import step_models

    config = json.loads((Path(__file__).parents[2] / "recipes/configs/llama-3-8b.json").read_text())
    student = teacher = est.stats_from_config(config)
    uptrain = step_models()["uptrain"](tokens=1 << 20, seq_len=2048, batch_tokens=1 << 20, micro_batch=1,
                                       loss="kd", gradient_checkpointing=True)
    whole = 4 * teacher.params
    one, eight = (est.uptrain_memory(student, uptrain, teacher, n) - est.uptrain_memory(student, uptrain, None, n)
                  for n in (1, 8))
    assert one == whole
    assert eight == whole // 8 + whole // teacher.layers
    assert eight < 0.2 * one  # an 8B teacher's 32 GB of fp32 weights become ~5 GB per GPU
