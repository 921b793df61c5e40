"""`surgery export --gguf` on the hybrid kind's output (`bamba`) as llama.cpp's `granitehybrid`: a tiny pydoc Llama
converted with `--to hybrid` (layer 1 keeps attention, layers 0 and 2 become Mamba-2 mixers, their tensors then set
to random values as training leaves them: every convolution tap, dt, A, D and norm weight acts). The file read back
with gguf-py where llama.cpp reads it (the default suite); the logits at every position in llama.cpp itself against
transformers (llama-cpp-py-sync, skipped where it does not load); the refusals; SmolLM2's hybrid at 2,048 tokens with
llama.cpp's cache and state against `surgery inspect` (slow)."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from gguf_read import hf_rotate_half_to_pairs, read, values
from llama_cpp_run import llama_cpp_library, llama_cpp_loads, llama_cpp_logits
from transformers_reference import pydoc_ids, transformers_logits

needs_llama_cpp = pytest.mark.skipif(not llama_cpp_loads(),
                                     reason="needs llama-cpp-py-sync (a prebuilt llama.cpp) loadable here")
LAYERS, ATTENTION = 3, 1  # layer 1 keeps attention; 0 and 2 are mixers


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """(the hybrid checkpoint folder, its f32 GGUF file)."""
    import torch
    from safetensors.torch import load_file as load_torch, save_file

    from surgery.checkpoint.source import resolve_source
    from surgery.commands.export import export_checkpoint
    from surgery.hybrid import convert_to_hybrid
    from surgery.hybrid.options import HybridOptions
    from surgery.testing.pydoc_llama import make_model, make_tokenizer

    root = tmp_path_factory.mktemp("export-hybrid")
    tiny = make_model(root / "tiny", make_tokenizer(), layers=LAYERS)
    folder = root / "hybrid"
    convert_to_hybrid(resolve_source(str(tiny)), folder, HybridOptions(attention_layers=f"[{ATTENTION}]", calib=["pydoc"],
                                                                       calib_tokens=128, calib_window=32), progress=False)
    weights = load_torch(folder / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name in [n for n in weights if ".mamba." in n and not n.endswith("out_proj.weight")]:
        noise = torch.randn(weights[name].shape, generator=g)
        if name.endswith("A_log"):  # decays between e^-0.05 and e^-1 per unit dt
            weights[name] = torch.empty(weights[name].shape).uniform_(0.05, 1.0, generator=g).log()
        else:
            weights[name] = weights[name] + (0.1 if name.endswith("in_proj.weight") else 0.5) * noise
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    out = root / "hybrid.gguf"
    export_checkpoint(str(folder), out)
    return folder, out


def test_bench_counts_the_hybrid_files_cache_and_state(hybrid):
    """`surgery bench --engine llama.cpp` counts a hybrid GGUF's K/V from its per-layer K/V head counts (the one
    attention layer) and adds the mixers' fixed state as llama.cpp keeps it (f32, the padded inner size): the state
    is the kind's own count (`inspect`) times the padding, whatever the context."""
    from surgery.api import inspect as inspect_checkpoints
    from surgery.bench.llama_cpp_engine import gguf_kv_values, gguf_metadata, gguf_state_bytes

    folder, path = hybrid
    config = json.loads((folder / "config.json").read_text())
    meta = gguf_metadata(path)
    inspected = dict(inspect_checkpoints(str(folder), context=64)[0])
    assert gguf_kv_values(meta, 64) * 2 * 64 == inspected["kv_cache_bytes_per_context"] // 2  # f16 here, f32 there
    pad = 2 * config["hidden_size"] // (config["mamba_n_heads"] * config["mamba_d_head"])
    assert gguf_state_bytes(meta) == pad * inspected["state_bytes"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    assert gguf_kv_values(meta) == 2 * config["num_key_value_heads"] * head_dim  # K and V of the one attention layer


def test_hybrid_round_trip(hybrid):
    """The metadata and tensors where llama.cpp's granitehybrid reads them (src/models/granite-hybrid.cpp,
    mamba-base.cpp): recurrent layers by a 0 K/V head count, identity multipliers, the mixers padded to llama.cpp's
    inner size (2 x hidden) with zero heads, each real row at the offset llama.cpp's split gives it."""
    folder, path = hybrid
    config = json.loads((folder / "config.json").read_text())
    keys, tensors = read(path)
    a = "granitehybrid"
    hidden, heads, groups, state = (config[k] for k in ("hidden_size", "mamba_n_heads", "mamba_n_groups",
                                                        "mamba_d_state"))
    inner = heads * config["mamba_d_head"]
    assert keys["general.architecture"] == a and inner == hidden  # the --to hybrid mixer: one x hidden
    assert keys[f"{a}.attention.head_count_kv"] == [0, config["num_key_value_heads"], 0]
    assert keys[f"{a}.ssm.inner_size"] == 2 * hidden  # llama.cpp asserts it
    pad = keys[f"{a}.ssm.inner_size"] // inner
    assert keys[f"{a}.ssm.time_step_rank"] == pad * heads and keys[f"{a}.ssm.group_count"] == pad * groups
    assert keys[f"{a}.ssm.state_size"] == state and keys[f"{a}.ssm.conv_kernel"] == config["mamba_d_conv"]
    head_dim = hidden // config["num_attention_heads"]
    assert keys[f"{a}.rope.dimension_count"] == head_dim and keys[f"{a}.rope.scaling.finetuned"] is True
    assert keys[f"{a}.attention.scale"] == pytest.approx(head_dim ** -0.5)
    assert all(keys[f"{a}.{k}"] == 1.0 for k in ("logit_scale", "embedding_scale", "residual_scale"))

    hf = load_file(folder / "model.safetensors")
    for i in range(LAYERS):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        assert np.array_equal(values(tensors[b + "ffn_gate.weight"]), hf[p + "feed_forward.gate_proj.weight"])
        assert np.array_equal(values(tensors[b + "ffn_norm.weight"]), hf[p + "pre_ff_layernorm.weight"])
        if i == ATTENTION:
            assert not any(n.startswith(b + "ssm_") for n in tensors)
            assert np.array_equal(values(tensors[b + "attn_k.weight"]),
                                  hf_rotate_half_to_pairs(hf[p + "self_attn.k_proj.weight"], 2))
            continue
        assert not any(n.startswith(b + "attn_") and n != b + "attn_norm.weight" for n in tensors)
        m = p + "mamba."
        n_in = values(tensors[b + "ssm_in.weight"])  # llama.cpp: z | x | B | C | dt at its own (padded) offsets
        big_inner, big_groups, big_heads = pad * inner, pad * groups, pad * heads
        offsets = {"z": 0, "x": big_inner, "B": 2 * big_inner, "C": 2 * big_inner + big_groups * state,
                   "dt": 2 * (big_inner + big_groups * state)}
        assert n_in.shape == (offsets["dt"] + big_heads, hidden)
        hf_in, real = hf[m + "in_proj.weight"], np.zeros(n_in.shape[0], bool)
        hf_offsets = {"z": 0, "x": inner, "B": 2 * inner, "C": 2 * inner + groups * state,
                      "dt": 2 * (inner + groups * state)}
        for part, count in (("z", inner), ("x", inner), ("B", groups * state), ("C", groups * state), ("dt", heads)):
            rows = slice(offsets[part], offsets[part] + count)
            assert np.array_equal(n_in[rows], hf_in[hf_offsets[part]:hf_offsets[part] + count]), part
            real[rows] = True
        assert not n_in[~real].any()  # the zero heads' rows
        conv = values(tensors[b + "ssm_conv1d.weight"])  # {taps, channels}: x | B | C
        assert conv.shape == (big_inner + 2 * big_groups * state, config["mamba_d_conv"])
        assert np.array_equal(conv[:inner], hf[m + "conv1d.weight"][:inner, 0])
        assert np.array_equal(conv[big_inner + big_groups * state:][:groups * state],
                              hf[m + "conv1d.weight"][inner + groups * state:, 0])  # C
        assert not conv[inner:big_inner].any()
        assert np.allclose(values(tensors[b + "ssm_a"])[:heads, 0], -np.exp(hf[m + "A_log"]))
        assert np.array_equal(values(tensors[b + "ssm_d"])[:heads, 0], hf[m + "D"])
        assert not values(tensors[b + "ssm_d"])[heads:].any()
        norm = values(tensors[b + "ssm_norm.weight"])  # {group size, groups}: transformers' grouping
        assert norm.shape == (big_groups, inner // groups)
        assert np.array_equal(norm[:groups].reshape(-1), hf[m + "norm.weight"]) and not norm[groups:].any()
        out = values(tensors[b + "ssm_out.weight"])
        assert np.array_equal(out[:, :inner], hf[m + "out_proj.weight"]) and not out[:, inner:].any()
        for name in ("ssm_conv1d.weight", "ssm_a", "ssm_d", "ssm_norm.weight"):  # llama.cpp reads these as f32
            assert tensors[b + name].tensor_type == gguf.GGMLQuantizationType.F32


def test_hybrid_f16_keeps_the_mixer_tensors_llama_cpp_reads_as_f32(hybrid, tmp_path):
    from surgery.commands.export import export_checkpoint

    folder, _ = hybrid
    export_checkpoint(str(folder), tmp_path / "f16.gguf", dtype="f16")
    _, tensors = read(tmp_path / "f16.gguf")
    assert tensors["blk.0.ssm_in.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert tensors["blk.0.ssm_conv1d.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert tensors["blk.0.ssm_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32


@pytest.mark.parametrize("change, message", [
    (lambda c: c["rope_parameters"].pop("partial_rotary_factor"), "partial rotary embeddings"),
    (lambda c: c.update(time_step_limit=[0.0, 0.5]), "clamps dt"),
    (lambda c: c.update(mamba_proj_bias=True), "mamba_proj_bias is set"),
    (lambda c: c.update(mamba_expand=3, mamba_n_heads=12), "exactly 2 x hidden"),
    (lambda c: c.update(attn_layer_indices=[1, 1]), "not distinct layers"),
    (lambda c: c.update(attn_layer_indices=[]), "no layer keeps attention"),
])
def test_hybrid_refusals_are_one_line_and_write_nothing(hybrid, tmp_path, cli, change, message):
    folder, _ = hybrid
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    config = json.loads((bad / "config.json").read_text())
    change(config)
    (bad / "config.json").write_text(json.dumps(config))
    code, _, err = cli("export", bad, "--gguf", tmp_path / "o.gguf")
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    assert list(tmp_path.iterdir()) == [bad]


@needs_llama_cpp
def test_hybrid_computes_the_same_logits_in_llama_cpp(hybrid):
    """Every one of 96 positions (beyond the conv window and into the state's decay) within 1e-3 of the logits'
    scale, f32, the same top-1 everywhere; llama.cpp caches K/V for the one attention layer and keeps a state."""
    llama_cpp_library()
    folder, path = hybrid
    ids = pydoc_ids(folder, 96)
    ref = transformers_logits(folder, ids)
    got, lines = llama_cpp_logits(path, ids, batch=32)
    scale = float(np.abs(ref).max())
    assert np.abs(got - ref).max() <= 1e-3 * scale, (np.abs(got - ref).max(), scale)
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    kv, state = cache_and_state(lines)
    assert [c["layers"] for c in kv] == [1] and kv[0]["cells"] >= len(ids)  # one attention layer's K/V
    assert state["s_mib"] > 0
    # what bench counts from the file is what llama.cpp allocated: one layer's K/V per cell, the mixers' state
    from surgery.bench.llama_cpp_engine import gguf_kv_values, gguf_metadata, gguf_state_bytes

    meta = gguf_metadata(path)
    size = {"f32": 4, "f16": 2}[kv[0]["type_k"]]  # the log rounds to 0.01 MiB
    assert kv[0]["mib"] * 2**20 == pytest.approx(gguf_kv_values(meta) * size * kv[0]["cells"], abs=0.005 * 2**20)
    assert state["mib"] * 2**20 == pytest.approx(gguf_state_bytes(meta), abs=0.005 * 2**20)


@needs_llama_cpp
@pytest.mark.parametrize("groups, expand, attention", [(2, 1, [1]), (1, 2, [1]), (4, 1, [0, 1, 2])])
def test_other_bamba_mixer_layouts_compute_the_same_logits_in_llama_cpp(hybrid, tmp_path, groups, expand, attention):
    """Random Bamba checkpoints beyond the --to hybrid layout: two heads per B/C group padded (the zero heads get
    zero groups after the real ones), one group shared by every head at llama.cpp's own inner size (no padding),
    and every layer attention (written as arch llama: granitehybrid aborts without a mixer)."""
    import torch
    from transformers import BambaConfig, BambaForCausalLM

    from surgery.commands.export import export_checkpoint

    folder, _ = hybrid
    torch.manual_seed(1)
    config = BambaConfig(vocab_size=json.loads((folder / "config.json").read_text())["vocab_size"], hidden_size=64,
                         intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         attn_layer_indices=attention, mamba_n_heads=4 * expand, mamba_d_head=16, mamba_n_groups=groups,
                         mamba_d_state=8, mamba_d_conv=3, mamba_expand=expand, max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0})
    model = BambaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mamba." in name and not name.endswith(("A_log", "out_proj.weight")):
                p.add_(0.3 * torch.randn_like(p))
    out = tmp_path / "bamba"
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, out / name)
    export_checkpoint(str(out), tmp_path / "b.gguf")
    assert read(tmp_path / "b.gguf")[0]["general.architecture"] == ("llama" if len(attention) == 3 else "granitehybrid")
    ids = pydoc_ids(folder, 64)
    ref = transformers_logits(out, ids)
    got, _ = llama_cpp_logits(tmp_path / "b.gguf", ids, batch=32)
    scale = float(np.abs(ref).max())
    assert np.abs(got - ref).max() <= 1e-3 * scale, (np.abs(got - ref).max(), scale)


def cache_and_state(lines: list[str]) -> tuple[list[dict], dict]:
    """(llama.cpp's KV caches as bench reads them, its recurrent state: {"mib", "r_mib", "s_mib"}), both from the
    lines bench's llama.cpp engine reads (`kv_cache_lines`)."""
    from surgery.bench.llama_cpp_bindings import kv_cache_lines

    found = kv_cache_lines(lines)
    state = [c for c in found if c.get("state")]
    assert len(state) == 1, "llama.cpp logged no recurrent state"
    return [c for c in found if not c.get("state")], {"mib": state[0]["mib"], "r_mib": state[0]["k_mib"],
                                                       "s_mib": state[0]["v_mib"]}


# ---- SmolLM2's hybrid at 2,048 tokens (slow) -------------------------------------------------------------------
TOKENS, UBATCH = 2048, 256
SMOLLM2_HYBRID = ["--to", "hybrid", "--attention-layers", "8"]


@pytest.mark.slow
@needs_llama_cpp
def test_smollm2_hybrid_in_llama_cpp_at_2048_tokens(tmp_path):
    """SmolLM2 with 8 of 30 layers kept: every position of 2,048 pydoc tokens within 1e-3 of the logits' scale,
    f32; llama.cpp's K/V is `surgery inspect --context 2048`'s and its recurrent state the padded mixers' (inspect's
    state times the padding). Takes $SURGERY_EXPORT_OUTPUTS/hybrid when it holds the conversion made beforehand."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from surgery.api import inspect as inspect_checkpoints
    from surgery.commands.export import export_checkpoint

    llama_cpp_library()
    given = os.environ.get("SURGERY_EXPORT_OUTPUTS")
    folder = Path(given) / "hybrid" if given else tmp_path / "hybrid"
    if not (folder / "config.json").is_file():
        done = subprocess.run([sys.executable, "-m", "surgery.cli", "convert", "smollm2", *SMOLLM2_HYBRID, "--out",
                               str(folder)], capture_output=True, text=True, timeout=3600)
        assert done.returncode == 0, done.stderr[-2000:]
    gguf_file = tmp_path / "hybrid.gguf"
    export_checkpoint(str(folder), gguf_file)
    config = json.loads((folder / "config.json").read_text())
    ids = pydoc_ids(folder, TOKENS)
    ref = transformers_logits(folder, ids)
    got, lines = llama_cpp_logits(gguf_file, ids, batch=UBATCH)
    delta, scale = np.abs(got - ref).max(-1), float(np.abs(ref).max())
    spans = {f"{a}-{b}": float(delta[a:b].max()) for a, b in ((0, 256), (256, 1024), (1024, TOKENS))}
    top1 = float((got.argmax(-1) == ref.argmax(-1)).mean())
    kv, state = cache_and_state(lines)
    inspected = dict(inspect_checkpoints(str(folder), context=TOKENS)[0])
    pad = 2 * config["hidden_size"] // (config["mamba_n_heads"] * config["mamba_d_head"])
    print(json.dumps({"kind": "hybrid", "max_abs_delta": spans, "logit_scale": scale, "top1": top1,
                      "llama_cpp_kv_mib": [c["mib"] for c in kv], "llama_cpp_state_mib": state,
                      "inspect_kv_mib": inspected["kv_cache_bytes_per_context"] / 2**20,
                      "inspect_state_mib": inspected["state_bytes"] / 2**20, "padding": pad}))
    assert max(spans.values()) <= 1e-3 * scale, spans
    assert top1 >= 0.99
    assert [c["layers"] for c in kv] == [len(config["attn_layer_indices"])] and kv[0]["cells"] == TOKENS
    assert kv[0]["mib"] * 2**20 == pytest.approx(inspected["kv_cache_bytes_per_context"], abs=TOKENS)
    assert (state["r_mib"] + state["s_mib"]) * 2**20 == pytest.approx(pad * inspected["state_bytes"], abs=2**14)
