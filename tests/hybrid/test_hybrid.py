"""`--to hybrid`: a Llama body written as a standard Bamba checkpoint, some layers keeping attention, the others
Mamba-2 mixers initialised from it. With every layer kept the output computes the source's function; a mixer computes
the gated, normed causal linear attention its docstring (surgery/hybrid/init.py) describes; a mixed output loads with
no custom code and decodes with a cache; refusals come in one line before anything is read or written."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from surgery.hybrid.layers import evenly_spaced, parse_attention_layers
from surgery.testing import tiny_models as tm

CALIB = ("--calib", "pydoc", "--calib-tokens", "128", "--calib-window", "32")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tm.tiny("llama", tmp_path_factory.mktemp("hybrid") / "llama")


@pytest.fixture(scope="module")
def mixed(llama, tmp_path_factory):
    """The tiny Llama with layer 1 kept and layer 0 a mixer (converted once per module)."""
    from surgery.checkpoint.source import resolve_source
    from surgery.hybrid import convert_to_hybrid
    from surgery.hybrid.options import HybridOptions

    out = tmp_path_factory.mktemp("hybrid-mixed") / "o"
    convert_to_hybrid(resolve_source(str(llama)), out,
                      HybridOptions(attention_layers="1", calib=["pydoc"], calib_tokens=128, calib_window=32),
                      progress=False)
    return out


def _load(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def _json(folder, name="config.json") -> dict:
    return json.loads((Path(folder) / name).read_text())


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_every_layer_kept_computes_the_source_function_as_a_standard_bamba(arch, tmp_path, cli):
    src = tm.tiny(arch, tmp_path / arch)
    code, out, err = cli("convert", src, "--to", "hybrid", "--attention-layers", "2", "--out", tmp_path / "o")
    assert code == 0, err
    config = _json(tmp_path / "o")
    assert config["model_type"] == "bamba" and config["attn_layer_indices"] == [0, 1]
    assert config["rope_parameters"]["partial_rotary_factor"] == 1.0
    assert not any((tmp_path / "o").glob("*.py"))
    model, source = _load(tmp_path / "o"), _load(src)
    assert type(model).__name__ == "BambaForCausalLM"
    ids = tm.sample_ids(length=24)
    assert torch.allclose(tm.logits(model, ids), tm.logits(source, ids), atol=1e-5)
    record = _json(tmp_path / "o", "surgery.json")
    assert record["hybrid"]["mixer_layers"] == [] and "new_parameters" not in record and "calibration" not in record


def test_a_mixer_is_the_gated_normed_linear_attention_of_the_layer_it_replaces(llama, mixed):
    """Layer 0's mixer, run by transformers, against the form written out by hand from the source's q/k/v/o:
    y_t = sum_{s<=t} (silu(q_t) . silu(k_s)) decay^(t-s) silu(X v_s) per query head (K/V repeated under GQA), times
    one gate per token, RMS-normed per head, scaled per channel, through o_proj."""
    from surgery.hybrid.init import X_SCALE

    source, model = _load(llama), _load(mixed)
    attn, mixer = source.model.layers[0].self_attn, model.model.layers[0].mamba
    heads, kv, d = 8, 4, 8
    in_proj = mixer.in_proj.weight
    z_rows = in_proj[:heads * d]
    assert torch.equal(z_rows, z_rows[:1].expand_as(z_rows)) and z_rows.abs().sum() > 0  # one gate per token
    assert torch.equal(in_proj[3 * heads * d:4 * heads * d], attn.q_proj.weight)  # C <- q
    assert torch.equal(mixer.out_proj.weight, attn.o_proj.weight)
    assert torch.isfinite(mixer.norm.weight).all() and mixer.norm.weight.abs().sum() > 0  # fitted to attention

    torch.manual_seed(0)
    h = torch.randn(2, 12, 64)
    with torch.no_grad():
        got = mixer(h)
        q = (h @ attn.q_proj.weight.T).view(2, 12, heads, d)
        k = (h @ attn.k_proj.weight.T).view(2, 12, kv, d).repeat_interleave(heads // kv, dim=2)
        v = (h @ attn.v_proj.weight.T).view(2, 12, kv, d).repeat_interleave(heads // kv, dim=2)
        decay = torch.exp(-torch.exp(mixer.A_log) * F.softplus(mixer.dt_bias))  # [heads]
        t = torch.arange(12)
        weights = torch.einsum("bthd,bshd->bhts", F.silu(q), F.silu(k))
        weights = weights * decay[None, :, None, None] ** (t[:, None] - t[None, :]).clamp(min=0) * (t[:, None] >= t)
        y = torch.einsum("bhts,bshd->bthd", weights, F.silu(X_SCALE * v)).reshape(2, 12, heads * d)
        gate = F.silu(h @ z_rows[0])[..., None]
        y = (y * gate).view(2, 12, heads, d)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps)
        want = (y.reshape(2, 12, heads * d) * mixer.norm.weight) @ attn.o_proj.weight.T
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_a_mixed_output_loads_without_code_and_decodes_with_its_cache(llama, mixed):
    config, record = _json(mixed), _json(mixed, "surgery.json")
    assert config["attn_layer_indices"] == [1] and config["mamba_n_groups"] == config["mamba_n_heads"] == 8
    assert record["hybrid"]["mixer_layers"] == [0] and record["new_parameters"] == ["model.layers.{layer}.mamba.*"]
    assert 0 < record["hybrid"]["gate_open"]["0"] <= 1 and record["calibration"]["window_length"] == 32
    model = _load(mixed)
    assert sorted(n for n, _ in model.named_parameters() if ".mamba." in n)[0].startswith("model.layers.0.mamba.")
    ids = tm.sample_ids(batch=1, length=10)
    with torch.no_grad():
        full = model(input_ids=ids).logits
        first = model(input_ids=ids[:, :6], use_cache=True)
        cache, steps = first.past_key_values, [first.logits]
        for i in range(6, 10):
            step = model(input_ids=ids[:, i:i + 1], past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            steps.append(step.logits)
    # transformers' torch path of Bamba itself (a randomly initialised one too) differs by ~1e-3 between its chunked
    # scan and its one-token recurrence: the cache carries the state, it does not restart it
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=5e-2)
    assert not torch.allclose(steps[-1], model(input_ids=ids[:, -1:]).logits, atol=5e-2)
    cached = model.generate(ids, max_new_tokens=4, do_sample=False)
    uncached = model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False)
    assert cached.shape == (1, 14) and torch.equal(cached[:, :10], ids) and torch.equal(cached, uncached)


def test_auto_keeps_the_layers_whose_replacement_moves_the_stream_most(llama, tmp_path, cli):
    code, out, err = cli("convert", llama, "--to", "hybrid", "--attention-layers", "auto:1", *CALIB,
                         "--out", tmp_path / "o")
    assert code == 0, err
    hybrid = _json(tmp_path / "o", "surgery.json")["hybrid"]
    scores = hybrid["scores"]
    assert len(scores) == 2 and all(s > 0 for s in scores)
    assert hybrid["attention_layers"] == [max(range(2), key=lambda i: scores[i])]
    assert _json(tmp_path / "o")["attn_layer_indices"] == hybrid["attention_layers"]


@pytest.mark.parametrize("arch, args, message", [
    ("qwen2", ("--attention-layers", "1"), "hybrid cannot convert 'qwen2': it has q/k/v biases"),
    ("phi", ("--attention-layers", "1"), "hybrid cannot convert 'phi'"),
    ("gemma", ("--attention-layers", "1"), "hybrid cannot convert 'gemma'"),
    ("llama", ("--attention-layers", "0,2"), "--attention-layers: layer 2 is out of range"),
    ("llama", ("--attention-layers", "1,1"), "--attention-layers: layer 1 is listed twice"),
    ("llama", ("--attention-layers", "3"), "--attention-layers 3: the model has 2 layers"),
    ("llama", ("--conv-kernel", "5"), "--conv-kernel 5: Bamba's runtimes take a convolution of 2, 3, 4 taps"),
])
def test_refusals_are_one_line_and_write_nothing(arch, args, message, tmp_path, cli):
    src = tm.tiny(arch, tmp_path / arch)
    code, _, err = cli("convert", src, "--to", "hybrid", *args, "--out", tmp_path / "o")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert not (tmp_path / "o").exists()


def test_heads_that_do_not_tile_the_hidden_size_are_refused(tmp_path):
    from surgery.errors import SurgeryError
    from surgery.hybrid.family import check_family

    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 8, "num_hidden_layers": 2}
    with pytest.raises(SurgeryError, match=r"^hybrid cannot hold this llama's mixer: 4 heads of 8 make 32"):
        check_family(config, 4)
    windowed = config | {"head_dim": 16, "model_type": "mistral", "sliding_window": 32, "max_position_embeddings": 128}
    with pytest.raises(SurgeryError, match="sliding window"):
        check_family(windowed, 4)


def test_layer_specs():
    assert parse_attention_layers("auto").auto and parse_attention_layers("auto:3").count == 3
    assert parse_attention_layers("7,0").indices == (0, 7) and parse_attention_layers([4]).describe() == "[4]"
    assert evenly_spaced(8, 30) == [2, 6, 10, 14, 17, 21, 25, 29] and evenly_spaced(0, 30) == []
    for bad in ("x", "-1", "1,x", "auto:y", True):
        with pytest.raises(ValueError):
            parse_attention_layers(bad)


def test_the_hybrid_package_imports_no_other_kind():
    package = Path(__file__).resolve().parents[2] / "surgery" / "hybrid"
    others = ("surgery.kv", "surgery.swa", "surgery.mla", "surgery.switchhead", "surgery.talking_heads")
    for path in package.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        names = {("surgery." + m.lstrip(".")) if m.startswith(".") or not m.startswith("surgery") else m
                 for m in names}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not {n for n in names for o in others if n == o or n.startswith(o + ".")}, path


def test_inspect_counts_the_kept_layers_k_v_and_the_mixers_fixed_state_as_the_runtime_holds_them(mixed):
    """inspect's state is what transformers' cache holds for the mixer after a forward (its convolution window less
    the one tap transformers keeps beyond llama.cpp's and vLLM's), whatever the context; the K/V is one layer's."""
    from surgery.inspection import inspect_checkpoint

    model = _load(mixed)
    with torch.no_grad():
        cache = model(input_ids=tm.sample_ids(batch=1, length=10), use_cache=True).past_key_values
    conv, ssm = cache.get_conv_state(0, state_idx=0), cache.get_recurrent_state(0, state_idx=0)
    kernel = conv.shape[-1]
    held = (ssm.numel() + conv.numel() * (kernel - 1) // kernel) * 4  # float32 weights, float32 state
    short, long = inspect_checkpoint(mixed, context=64), inspect_checkpoint(mixed, context=4096)
    assert short["state_bytes"] == long["state_bytes"] == held
    assert long["kv_cache_bytes_per_token"] == 2 * 1 * 4 * 8 * 4  # one kept layer, 4 K/V heads of 8, float32
    assert long["cache_and_state_bytes_per_context"] == long["kv_cache_bytes_per_token"] * 4096 + held
