"""--to mla's cost model (surgery/mla/cost.py): its work counted against torch's on the real conversion, its terms
moving as the algorithm does, and the dry runs that print it."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from inprocess import run_cli
from mla_sources import CALIB, convert, tiny_llama

LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 32, "vocab_size": 128256,
            "max_position_embeddings": 131072, "tie_word_embeddings": False, "rope_theta": 500000.0}
LLAMA3_ROPE = {"rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192, "rope_type": "llama3"}}


class FlopsByDtype(TorchDispatchMode):
    """torch's flop count of every matrix product (FlopCounterMode's formulas), split by dtype: float32, and float64
    with complex128 products counted as the four real ones they are. The CPU's flash attention (not in torch's
    table) is counted as the full-square products FlopCounterMode counts for the other attention kernels."""

    def __init__(self):
        super().__init__()
        self.float32 = self.float64 = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet in flop_registry:
            n = flop_registry[packet](*args, **kwargs, out_val=out)
        elif packet is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
            q, k, v = args[:3]
            n = 2 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * (q.shape[3] + v.shape[3])
        else:
            return out
        dtype = args[0].dtype
        if dtype.is_complex:
            self.float64 += 4 * n
        elif dtype == torch.float64:
            self.float64 += n
        else:
            self.float32 += n
        return out


@pytest.mark.parametrize("kv_heads,rope_dim,rank", [(2, None, 24), (2, 8, 16), (1, 4, 8)])
def test_layer_flops_match_torch_on_the_real_conversion(tmp_path, kv_heads, rope_dim, rank):
    """Every matrix product of a whole tiny conversion (both passes when the frequencies are scored, the writer),
    counted by torch, equals the layers times the model's products per layer (its eigendecompositions and LU, which
    torch does not count, come on top)."""
    from surgery.estimate import layer_shape
    from surgery.mla.cost import frequency_pass, mla_layer_flops, mla_layer_products
    from surgery.mla.options import MLAOptions
    from surgery.checkpoint.source import resolve_source

    samples = MLAOptions.model_fields["query_samples"].default  # what the converter runs by default

    src = tiny_llama(tmp_path / "src", kv_heads=kv_heads)
    config = resolve_source(str(src)).config
    s = layer_shape(config)
    rope = rope_dim or s.head_dim
    with FlopsByDtype() as counted:
        convert(src, tmp_path / "out", rank=rank, rope_dim=rope_dim)
    window = min(CALIB, config["max_position_embeddings"])
    scored = frequency_pass(config, s.head_dim, rope)
    assert scored == (rope_dim is not None)  # default RoPE over the tiny head: a choice only for fewer dims
    per_layer = mla_layer_products(s, rank, rope, CALIB, window, scored, samples)
    assert counted.float32 == pytest.approx(s.layers * per_layer.float32, rel=0.02)
    assert counted.float64 == pytest.approx(s.layers * per_layer.float64, rel=0.02)
    total = mla_layer_flops(s, rank, rope, CALIB, window, scored, samples)
    assert total.float32 == per_layer.float32 and total.float64 > per_layer.float64


def test_the_terms_move_as_the_algorithm_does():
    """On Llama-3-8B's shapes: the latent rank adds float64 factor work and float32 latent expansion; tokens add
    both (second moments, attention, refit); the frequency pass adds the second moments, the complex scores (40 heads'
    rows x 64 frequencies, each a complex product with Sigma: 2 (4096^2 + 4096) complex flops, 4 real ones each)
    and a source forward; the fits' float64 matrices grow with the rank and hold the complex Sigma."""
    from surgery.estimate import layer_shape
    from surgery.mla.cost import frequency_score_flops, mla_fit_bytes, mla_layer_flops, second_moment_flops

    s = layer_shape(LLAMA_8B)
    base = mla_layer_flops(s, 512, 32, 1024, 512, False)
    rank = mla_layer_flops(s, 1024, 32, 1024, 512, False)
    tokens = mla_layer_flops(s, 512, 32, 4096, 512, False)
    scored = mla_layer_flops(s, 512, 32, 1024, 512, True)
    assert rank.float64 > base.float64 and rank.float32 > base.float32
    assert tokens.float64 > base.float64 and tokens.float32 > 3 * base.float32
    assert scored.float64 - base.float64 == pytest.approx(second_moment_flops(s, 1024) + frequency_score_flops(s))
    assert frequency_score_flops(s) == pytest.approx(4 * 40 * 64 * 2 * (4096**2 + 4096))
    assert scored.float32 > base.float32
    assert mla_fit_bytes(s, 1024, 32, False, 4096) > mla_fit_bytes(s, 512, 32, False, 4096) > 3 * 8 * 4096**2


def test_the_frequency_pass_is_predicted_from_the_config():
    """The conversion scores frequencies only when more than one stride of the source's frequencies is DeepSeek's
    progression: never at rope-dim = head_dim, and not under Llama 3's scaling at 32 dims (only stride 1 is
    unscaled), but with plain RoPE at 32 dims; Llama 3's every dim cannot be DeepSeek's RoPE: refused, as the
    conversion refuses it."""
    from surgery.errors import SurgeryError
    from surgery.mla.cost import frequency_pass

    assert not frequency_pass(LLAMA_8B, 128, 128)
    assert frequency_pass(LLAMA_8B, 128, 32)
    assert not frequency_pass(LLAMA_8B | LLAMA3_ROPE, 128, 32)
    with pytest.raises(SurgeryError, match="--rope-dim 128: no 64 of the source's rotary frequencies"):
        frequency_pass(LLAMA_8B | LLAMA3_ROPE, 128, 128)


def test_dry_run_prints_the_estimate_and_writes_nothing(tmp_path, capsys):
    src = tiny_llama(tmp_path / "src", kv_heads=2)
    out = tmp_path / "out"
    code, stdout, err = run_cli(capsys, "convert", src, "--to", "mla", "--kv-rank", 8, "--calib-tokens", 256,
                                "--device", "cpu", "--dry-run", "--out", out)
    assert code == 0, err
    assert "estimate for mla on cpu (2 layers, 256 calibration tokens):" in stdout
    assert "peak host memory" in stdout and "time per layer" in stdout and "CPU time per layer" in stdout
    assert not out.exists()
    reports = {}
    for rope in (16, 8):  # 8 of 16 dims: the frequency pass
        code, stdout, err = run_cli(capsys, "convert", src, "--to", "mla", "--kv-rank", 8, "--rope-dim", rope,
                                    "--calib-tokens", 256, "--device", "cpu", "--dry-run", "--json", "-")
        assert code == 0, err
        reports[rope] = json.loads(stdout[stdout.index("{"):])
    assert reports[16]["calibrated"] and reports[16]["kind"] == "mla" and reports[16]["seconds_per_layer"] > 0
    terms = reports[16]["memory_terms"]
    assert reports[16]["host_bytes"] > terms["layer (float32)"] > 0 and terms["fits (float64)"] > 0
    assert reports[8]["flops_per_layer"]["float64"] > reports[16]["flops_per_layer"]["float64"]
    # what the conversion would refuse, the dry run refuses (one line, exit 2)
    code, _, err = run_cli(capsys, "convert", src, "--to", "mla", "--kv-rank", 65, "--dry-run")
    assert code == 2 and err.strip().splitlines() == [
        "surgery: error: --kv-rank must be between 1 and 64 (2 x 2 K/V heads x head_dim 16: the source's keys and "
        "values), got 65"]


def test_a_recipe_with_an_mla_step_is_planned_with_its_estimate(tmp_path):
    """`surgery run --dry-run` sizes an mla convert step from the kind's cost model (it had none: the plan failed)."""
    from surgery.recipes import load_recipe
    from surgery.recipes.plan import build_plan
    from recipe_files import write_recipe

    src = tiny_llama(tmp_path / "src", kv_heads=2)
    recipe = write_recipe(tmp_path / "r.yaml", {"name": "t", "source": {"path": str(src)}, "output": "out",
                                                "steps": [{"convert": {"to": "mla", "kv_rank": 8,
                                                                       "calib_tokens": 256}}]})
    row = build_plan(load_recipe(recipe), tmp_path / "out")["steps"][0]
    assert row["memory"] > 0 and row["seconds_per_layer"] > 0
