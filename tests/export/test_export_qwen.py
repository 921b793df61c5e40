"""`surgery export --gguf` on Qwen2 and Qwen3 bodies as llama.cpp's `qwen2` and `qwen3`: tiny random models of each
family (surgery/testing/tiny_models.py's, with the pydoc BPE tokenizer) and their `--to mqa` outputs. The files read
back with gguf-py (the default suite): the keys, every tensor named as gguf-py's MODEL_TENSORS names it for the arch,
queries and keys unpermuted (NEOX RoPE), qwen2's q/k/v biases, qwen3's q/k norms. The logits at every position in
llama.cpp itself against transformers (llama-cpp-py-sync, skipped where it does not load). The refusals: a sliding
window that bites, scaled RoPE, Qwen3 attention biases, another activation."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from gguf_read import read, values
from llama_cpp_run import llama_cpp_library, llama_cpp_loads, llama_cpp_logits
from transformers_reference import pydoc_ids, transformers_logits

ARCHS = ("qwen2", "qwen3")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, tokenizer):
    """name -> (checkpoint folder, its f32 GGUF file): `qwen2`, `qwen3` and their MQA outputs `qwen2-mqa`, ..."""
    from surgery import api
    from surgery.commands.export import export_checkpoint
    from surgery.testing.pydoc_llama import make_family_model

    root = tmp_path_factory.mktemp("export-qwen")
    folders = {}
    for arch in ARCHS:
        folders[arch] = make_family_model(root / arch, tokenizer, arch)
        folders[f"{arch}-mqa"] = root / f"{arch}-mqa"
        api.convert(str(folders[arch]), folders[f"{arch}-mqa"], to="mqa")
    files = {}
    for name, folder in folders.items():
        files[name] = root / f"{name}.gguf"
        export_checkpoint(str(folder), files[name])
    return {name: (folders[name], files[name]) for name in folders}


def _allowed_names(arch: str, layers: int) -> set[str]:
    """Every tensor name gguf-py's constants give llama.cpp's `arch` (blocks 0..layers-1)."""
    a = gguf.MODEL_ARCH[arch.upper()]
    names = set()
    for t in gguf.MODEL_TENSORS[a]:
        base = gguf.TENSOR_NAMES[t]
        for i in range(layers) if "{bid}" in base else [None]:
            stem = base.format(bid=i) if i is not None else base
            names |= {stem + ".weight", stem + ".bias"}
    return names


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "qwen2-mqa", "qwen3-mqa"])
def test_round_trip(qwen, name):
    folder, path = qwen[name]
    arch = name.split("-")[0]
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == arch
    keys, tensors = read(path)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    assert keys["general.architecture"] == arch
    assert kv_heads == (1 if name.endswith("mqa") else 2) and heads == 4
    assert keys[f"{arch}.attention.head_count"] == heads and keys[f"{arch}.attention.head_count_kv"] == kv_heads
    assert keys[f"{arch}.attention.key_length"] == keys[f"{arch}.rope.dimension_count"] == head_dim
    assert keys[f"{arch}.block_count"] == config["num_hidden_layers"] == 2
    assert keys[f"{arch}.context_length"] == config["max_position_embeddings"] == 256
    assert keys[f"{arch}.rope.freq_base"] == pytest.approx(config["rope_parameters"]["rope_theta"])
    assert keys[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(config["rms_norm_eps"])
    assert keys["tokenizer.ggml.model"] == "gpt2" and len(keys["tokenizer.ggml.tokens"]) == config["vocab_size"]
    assert set(tensors) <= _allowed_names(arch, 2)  # named where llama.cpp's loader looks for them
    hf = load_file(folder / "model.safetensors")
    per_layer = {"attn_norm.weight": "input_layernorm.weight", "attn_q.weight": "self_attn.q_proj.weight",
                 "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
                 "attn_output.weight": "self_attn.o_proj.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
                 "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
                 "ffn_down.weight": "mlp.down_proj.weight"}
    if arch == "qwen2":
        per_layer |= {f"attn_{x}.bias": f"self_attn.{x}_proj.bias" for x in "qkv"}
    else:
        per_layer |= {f"attn_{x}_norm.weight": f"self_attn.{x}_norm.weight" for x in "qk"}
    expected = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                **({} if config.get("tie_word_embeddings") else {"output.weight": "lm_head.weight"}),
                **{f"blk.{i}.{g}": f"model.layers.{i}.{h}" for i in range(2) for g, h in per_layer.items()}}
    assert set(tensors) == set(expected)  # every checkpoint tensor, nothing else
    for gguf_name, hf_name in expected.items():  # as stored: no permutation (NEOX RoPE), biases and norms as they are
        assert np.array_equal(values(tensors[gguf_name]), hf[hf_name]), gguf_name
    assert hf["model.layers.0.self_attn.k_proj.weight"].shape[0] == kv_heads * head_dim
    assert set(hf) == set(expected.values()) | ({"lm_head.weight"} if config.get("tie_word_embeddings") else set())


@pytest.mark.skipif(not llama_cpp_loads(), reason="needs llama-cpp-py-sync (a prebuilt llama.cpp) loadable here")
def test_qwen_files_compute_the_same_logits_in_llama_cpp(qwen):
    """Every position of 96 pydoc tokens, f32: llama.cpp within 1e-3 of the logits' scale of transformers, for the
    sources and their MQA outputs (which compute something else than their sources: far more than that apart)."""
    llama_cpp_library()
    ids = pydoc_ids(qwen["qwen2"][0], 96)
    measured = {}
    for arch in ARCHS:
        refs = {}
        for name in (arch, f"{arch}-mqa"):
            folder, gguf_file = qwen[name]
            refs[name] = transformers_logits(folder, ids)
            got, _ = llama_cpp_logits(gguf_file, ids, batch=32)
            scale = float(np.abs(refs[name]).max())
            measured[name] = float(np.abs(got - refs[name]).max())
            assert measured[name] <= 1e-3 * scale, (name, measured[name], scale)
        assert np.abs(refs[arch] - refs[f"{arch}-mqa"]).max() > 100 * max(measured[arch], measured[f"{arch}-mqa"])
    print(json.dumps({"max_abs_delta_logits": measured}))


def _config_only(tmp_path, base: dict, name: str, **changes) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(base | changes))
    return folder


def test_refusals_write_nothing(qwen, tmp_path, cli):
    """Refused in one line before any tensor is read (the folders hold a config.json alone), nothing written."""
    qwen2 = json.loads((qwen["qwen2"][0] / "config.json").read_text())
    qwen3 = json.loads((qwen["qwen3"][0] / "config.json").read_text())
    out = tmp_path / "o.gguf"
    cases = [
        (qwen2, "window", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
                           "layer_types": None}, "sliding-window layers (window 8 on layers [1])"),
        (qwen3, "types", {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
         "sliding-window layers (window 8 on layers [0])"),
        (qwen2, "yarn", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "'yarn'"),
        (qwen3, "bias", {"attention_bias": True}, "attention_bias"),
        (qwen2, "gelu", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ]
    for base, name, changes, says in cases:
        code, _, err = cli("export", _config_only(tmp_path, base, name, **changes), "--gguf", out)
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1, (name, err)
        assert base["model_type"] in err or name == "yarn"
    assert not out.exists() and not list(tmp_path.glob("*.gguf*"))


def test_a_window_that_does_not_bite_is_exported(qwen, tmp_path, cli):
    """A window no shorter than the context (or use_sliding_window off, as Qwen2.5's configs have it) changes
    nothing transformers computes within the context: exported as plain qwen2."""
    from transformers import AutoConfig

    source = qwen["qwen2"][0]
    for name, changes in {"wide": {"use_sliding_window": True, "sliding_window": 256, "max_window_layers": 0,
                                   "layer_types": None},
                          "off": {"use_sliding_window": False, "sliding_window": 8, "max_window_layers": 0,
                                  "layer_types": None}}.items():
        folder = tmp_path / name
        shutil.copytree(source, folder)
        config = json.loads((folder / "config.json").read_text()) | changes
        (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
        loaded = AutoConfig.from_pretrained(folder)  # what transformers makes of it
        assert ("sliding_attention" in loaded.layer_types) == (name == "wide")
        code, stdout, err = cli("export", folder, "--gguf", tmp_path / f"{name}.gguf")
        assert code == 0, err
        assert "qwen2: 4 query heads" in stdout
        assert read(tmp_path / f"{name}.gguf")[0]["general.architecture"] == "qwen2"
