"""`surgery export --gguf`: the files read back with gguf-py (architecture, metadata, the window pattern, the
tokenizer, every tensor equal to the checkpoint's after the layout changes llama.cpp needs, each dtype), and the
one-line refusals that leave nothing behind. On the tiny pydoc Llama and its swa and MLA outputs."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from exported_files import exported  # noqa: F401 (a fixture)
from gguf_read import hf_rotate_half_to_pairs, read, values
from surgery.export.llama import SINK_OFF


def test_llama_round_trip(exported):
    folder, path = exported["llama"]
    config = json.loads((folder / "config.json").read_text())
    keys, tensors = read(path)
    assert keys["general.architecture"] == "llama"
    assert keys["llama.block_count"] == config["num_hidden_layers"] == 2
    assert keys["llama.attention.head_count"] == 4 and keys["llama.attention.head_count_kv"] == 2
    assert keys["llama.embedding_length"] == config["hidden_size"]
    assert keys["llama.rope.dimension_count"] == config["hidden_size"] // 4
    assert keys["llama.rope.freq_base"] == pytest.approx(config["rope_parameters"]["rope_theta"])
    assert keys["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(config["rms_norm_eps"])
    hf = load_file(folder / "model.safetensors")
    assert np.array_equal(values(tensors["token_embd.weight"]), hf["model.embed_tokens.weight"])
    for i in range(2):
        p = f"model.layers.{i}.self_attn."
        assert np.array_equal(values(tensors[f"blk.{i}.attn_q.weight"]), hf_rotate_half_to_pairs(hf[p + "q_proj.weight"], 4))
        assert np.array_equal(values(tensors[f"blk.{i}.attn_k.weight"]), hf_rotate_half_to_pairs(hf[p + "k_proj.weight"], 2))
        assert np.array_equal(values(tensors[f"blk.{i}.attn_v.weight"]), hf[p + "v_proj.weight"])
        assert np.array_equal(values(tensors[f"blk.{i}.ffn_down.weight"]), hf[f"model.layers.{i}.mlp.down_proj.weight"])
    # untied: the output matrix is written; the file has exactly the tensors llama.cpp's llama loader reads
    assert np.array_equal(values(tensors["output.weight"]), hf["lm_head.weight"])
    assert len(tensors) == 3 + 9 * 2


def test_tokenizer_round_trip(exported):
    from transformers import AutoTokenizer

    folder, path = exported["llama"]
    tok = AutoTokenizer.from_pretrained(folder)
    keys, _ = read(path)
    assert keys["tokenizer.ggml.model"] == "gpt2" and keys["tokenizer.ggml.pre"] == "gpt-2"
    vocab = tok.get_vocab()
    assert keys["tokenizer.ggml.tokens"] == sorted(vocab, key=vocab.get)
    assert keys["tokenizer.ggml.token_type"][tok.eos_token_id] == gguf.TokenType.CONTROL
    assert keys["tokenizer.ggml.eos_token_id"] == tok.eos_token_id
    merges = json.loads((folder / "tokenizer.json").read_text())["model"]["merges"]
    assert keys["tokenizer.ggml.merges"] == [" ".join(m) if isinstance(m, list) else m for m in merges]


def test_swa_output_is_granite_swa_with_the_window_pattern(exported):
    folder, path = exported["swa"]
    config = json.loads((folder / "config.json").read_text())
    keys, tensors = read(path)
    a = "granite_swa"
    assert keys["general.architecture"] == a
    assert keys[f"{a}.attention.sliding_window"] == config["sliding_window"] == 8
    assert keys[f"{a}.attention.sliding_window_pattern"] == [t == "sliding_attention" for t in config["layer_types"]]
    assert keys[f"{a}.attention.sliding_window_pattern"] == [True, False]
    for key in ("logit_scale", "embedding_scale", "residual_scale"):  # identity multipliers: the Llama layer
        assert keys[f"{a}.{key}"] == 1.0
    assert keys[f"{a}.attention.scale"] == pytest.approx(keys[f"{a}.attention.key_length"] ** -0.5)
    for i in range(2):
        sinks = values(tensors[f"blk.{i}.attn_sinks.weight"])
        assert sinks.shape == (4,) and np.all(sinks == np.float32(SINK_OFF))
    hf = load_file(folder / "model.safetensors")
    assert np.array_equal(values(tensors["blk.1.attn_k.weight"]),
                          hf_rotate_half_to_pairs(hf["model.layers.1.self_attn.k_proj.weight"], 2))


def test_sinks_and_multipliers_of_a_granite_swa_checkpoint_are_carried_over(exported):
    folder, path = exported["sinks"]
    config = json.loads((folder / "config.json").read_text())
    keys, tensors = read(path)
    a = "granite_swa"
    assert keys["general.architecture"] == a and keys[f"{a}.attention.sliding_window_pattern"] == [True, False]
    assert keys[f"{a}.attention.scale"] == pytest.approx(config["attention_multiplier"])
    hf = load_file(folder / "model.safetensors")
    for i in range(2):
        stored = hf[f"model.layers.{i}.self_attn.sinks"]
        assert np.abs(stored - 1.0).max() > 0.1  # the fixture's trained-like sinks, not the written -12
        assert np.array_equal(values(tensors[f"blk.{i}.attn_sinks.weight"]), stored)


def test_mla_output_is_deepseek2_with_kv_b_split(exported):
    folder, path = exported["mla"]
    config = json.loads((folder / "config.json").read_text())
    keys, tensors = read(path)
    a = "deepseek2"
    R, D, nope, v, heads = (config["kv_lora_rank"], config["qk_rope_head_dim"], config["qk_nope_head_dim"],
                            config["v_head_dim"], config["num_attention_heads"])
    assert (R, D) == (32, 8)
    assert keys["general.architecture"] == a
    assert keys[f"{a}.attention.kv_lora_rank"] == R and keys[f"{a}.attention.q_lora_rank"] == 0
    assert keys[f"{a}.attention.key_length"] == R + D and keys[f"{a}.attention.value_length"] == R
    assert keys[f"{a}.attention.key_length_mla"] == nope + D and keys[f"{a}.attention.value_length_mla"] == v
    assert keys[f"{a}.attention.head_count_kv"] == 1 and keys[f"{a}.rope.dimension_count"] == D
    assert keys[f"{a}.leading_dense_block_count"] == 2
    hf = load_file(folder / "model.safetensors")
    for i in range(2):
        kv_b = hf[f"model.layers.{i}.self_attn.kv_b_proj.weight"]
        k_b, v_b = values(tensors[f"blk.{i}.attn_k_b.weight"]), values(tensors[f"blk.{i}.attn_v_b.weight"])
        assert k_b.shape == (heads, R, nope) and v_b.shape == (heads, v, R)
        for h in range(heads):
            rows = kv_b[h * (nope + v):(h + 1) * (nope + v)]
            assert np.array_equal(k_b[h], rows[:nope].T) and np.array_equal(v_b[h], rows[nope:])
        assert np.array_equal(values(tensors[f"blk.{i}.attn_kv_a_mqa.weight"]),
                              hf[f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight"])
        assert np.array_equal(values(tensors[f"blk.{i}.attn_q.weight"]), hf[f"model.layers.{i}.self_attn.q_proj.weight"])
    assert "blk.0.attn_kv_b.weight" not in tensors


@pytest.mark.parametrize("dtype, matrix_type, tolerance", [("f16", "F16", 1e-3), ("bf16", "BF16", 8e-3),
                                                             ("q8_0", "Q8_0", 1.5e-2)])
def test_dtypes(exported, tmp_path, cli, dtype, matrix_type, tolerance):
    folder, f32_path = exported["llama"]
    out = tmp_path / f"{dtype}.gguf"
    code, stdout, err = cli("export", folder, "--gguf", out, "--dtype", dtype)
    assert code == 0, err
    assert f"; {dtype};" in stdout
    _, exact = read(f32_path)
    keys, tensors = read(out)
    assert keys["general.file_type"] == {"f16": 1, "bf16": 32, "q8_0": 7}[dtype]
    assert tensors["blk.0.ffn_up.weight"].tensor_type.name == matrix_type
    assert tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"  # vectors stay f32
    for name in ("blk.0.ffn_up.weight", "blk.1.attn_q.weight", "token_embd.weight"):
        want, got = values(exact[name]), values(tensors[name])
        assert got.shape == want.shape
        assert np.abs(got - want).max() <= tolerance * np.abs(want).max()
        assert not np.array_equal(got, want)  # stored in fewer bits, not copied
    assert out.stat().st_size < f32_path.stat().st_size


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir())


def test_refusals_write_nothing(exported, tmp_path, cli):
    from surgery.checkpoint.tensors import save_safetensors

    folder, _ = exported["llama"]
    out = tmp_path / "o.gguf"
    code, _, err = cli("export", folder, "--gguf", out, "--dtype", "q4_k")
    assert code == 2 and "q4_k" in err and "Traceback" not in err
    code, _, err = cli("export", folder, "--gguf", tmp_path / "missing" / "o.gguf")
    assert code == 2 and "does not exist" in err and len(err.strip().splitlines()) == 1

    custom = tmp_path / "custom"
    custom.mkdir()
    config = json.loads((folder / "config.json").read_text())
    (custom / "config.json").write_text(json.dumps(config | {"auto_map": {"AutoModelForCausalLM": "m.M"}}))
    code, _, err = cli("export", custom, "--gguf", out)
    assert code == 2 and "custom code" in err and len(err.strip().splitlines()) == 1

    qwen = tmp_path / "qwen"
    qwen.mkdir()
    (qwen / "config.json").write_text(json.dumps(config | {"model_type": "qwen3", "sliding_window": 8,
                                                           "layer_types": ["sliding_attention", "full_attention"]}))
    code, _, err = cli("export", qwen, "--gguf", out)
    assert code == 2 and "sliding-window" in err and "qwen3" in err and len(err.strip().splitlines()) == 1

    # a tensor the exporter does not map (a bias): refused, not dropped
    biased = tmp_path / "biased"
    biased.mkdir()
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (biased / f.name).write_bytes(f.read_bytes())
    hf = {k: __import__("torch").from_numpy(v) for k, v in load_file(folder / "model.safetensors").items()}
    hf["model.layers.0.self_attn.q_proj.bias"] = hf["model.layers.0.input_layernorm.weight"].clone()
    save_safetensors(hf, biased / "model.safetensors")
    code, _, err = cli("export", biased, "--gguf", out)
    assert code == 2 and "q_proj.bias" in err and len(err.strip().splitlines()) == 1

    out.write_bytes(b"keep")
    code, _, err = cli("export", folder, "--gguf", out)
    assert code == 2 and "--force" in err and out.read_bytes() == b"keep"
    assert _leftovers(tmp_path) == ["biased", "custom", "o.gguf", "qwen"]  # no temporary file left anywhere


def test_a_failure_while_writing_leaves_nothing(exported, tmp_path, monkeypatch):
    """A tensor that cannot be read halfway through the file (a truncated shard): one SurgeryError, no OUT, no
    temporary file beside it, and an existing OUT (with --force) left as it was."""
    from surgery.commands.export import export_checkpoint
    from surgery.errors import SurgeryError
    from surgery.export.weights import Weights

    folder, _ = exported["llama"]
    real_load, calls = Weights.load, []

    def failing_load(self, name):
        calls.append(name)
        if len(calls) == 5:
            raise SurgeryError(f"truncated safetensors file while reading {name}")
        return real_load(self, name)

    monkeypatch.setattr(Weights, "load", failing_load)
    out = tmp_path / "o.gguf"
    with pytest.raises(SurgeryError, match="truncated"):
        export_checkpoint(str(folder), out)
    assert _leftovers(tmp_path) == []
    out.write_bytes(b"old")
    calls.clear()
    with pytest.raises(SurgeryError, match="truncated"):
        export_checkpoint(str(folder), out, force=True)
    assert _leftovers(tmp_path) == ["o.gguf"] and out.read_bytes() == b"old"
