"""MQA/GQA conversion on tiny random models of every supported architecture."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from surgery.testing import tiny_models as tm
from surgery.kv.convert import convert_to_kv_heads
from surgery.kv.options import GQAOptions
from surgery.checkpoint.source import resolve_source

ARCHS = list(tm.ARCHS)


def convert(src, out, **kw):
    return convert_to_kv_heads(resolve_source(str(src)), out, GQAOptions(**kw), progress=False)


def kv_projections(model, layer: int):
    """(k, v) weights as [kv_heads, head_dim, in] and biases as [kv_heads, head_dim] (None when absent),
    read from the loaded model's modules; written independently of the library's split/join code."""
    cfg = model.config
    mt = cfg.model_type
    if mt == "gpt2":
        attn = model.transformer.h[layer].attn
        h, d = cfg.n_head, cfg.n_embd // cfg.n_head
        w, b = attn.c_attn.weight.T, attn.c_attn.bias  # Conv1D stores (in, out)
        k, v = w[h * d : 2 * h * d], w[2 * h * d :]
        kb, vb = b[h * d : 2 * h * d], b[2 * h * d :]
        return k.reshape(h, d, -1), v.reshape(h, d, -1), kb.reshape(h, d), vb.reshape(h, d)
    if mt == "gpt_bigcode":
        attn = model.transformer.h[layer].attn
        h, d = cfg.n_head, cfg.n_embd // cfg.n_head
        w, b = attn.c_attn.weight, attn.c_attn.bias
        if cfg.multi_query:
            return (w[h * d : h * d + d].reshape(1, d, -1), w[h * d + d :].reshape(1, d, -1),
                    b[h * d : h * d + d].reshape(1, d), b[h * d + d :].reshape(1, d))
        w, b = w.reshape(h, 3, d, -1), b.reshape(h, 3, d)
        return w[:, 1], w[:, 2], b[:, 1], b[:, 2]
    if mt == "gpt_neox":
        attn = model.gpt_neox.layers[layer].attention
        h, d = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
        w, b = attn.query_key_value.weight.reshape(h, 3, d, -1), attn.query_key_value.bias.reshape(h, 3, d)
        return w[:, 1], w[:, 2], b[:, 1], b[:, 2]
    if mt == "falcon":  # new_decoder_architecture: rows [kv head, (its query heads, k, v), head_dim]
        attn = model.transformer.h[layer].self_attention
        h, kv = cfg.num_attention_heads, cfg.num_kv_heads
        d = cfg.hidden_size // h
        w, b = attn.query_key_value.weight.reshape(kv, h // kv + 2, d, -1), attn.query_key_value.bias.reshape(kv, -1, d)
        return w[:, -2], w[:, -1], b[:, -2], b[:, -1]
    attn = next(m for m in model.modules() if getattr(m, "layer_idx", None) == layer and
                (hasattr(m, "k_proj") or hasattr(m, "qkv_proj")))
    h, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // h
    if mt == "phi3":
        w = attn.qkv_proj.weight
        return w[h * d : (h + kv) * d].reshape(kv, d, -1), w[(h + kv) * d :].reshape(kv, d, -1), None, None
    bias = lambda lin: None if lin.bias is None else lin.bias.reshape(kv, d)  # noqa: E731
    out = (attn.k_proj.weight.reshape(kv, d, -1), attn.v_proj.weight.reshape(kv, d, -1),
           bias(attn.k_proj), bias(attn.v_proj))
    norm = getattr(attn, "k_norm", None)
    if norm is not None and norm.weight.numel() == kv * d:  # a K norm over the whole projection: pooled as heads
        out += (norm.weight.reshape(kv, d),)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_same_kv_heads_is_exact(arch, tmp_path):
    src = tm.make_tiny(arch, tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "out", kv_heads=tm.kv_heads_of(src.config))
    out = tm.load(tmp_path / "out")
    ids = tm.sample_ids()
    assert (tm.logits(src, ids) - tm.logits(out, ids)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "gpt_bigcode_mq"])
def test_mqa_mean_pooling_matches_independent_recompute(arch, tmp_path):
    src = tm.make_tiny(arch, tmp_path / "src")
    record = convert(tmp_path / "src", tmp_path / "out", kv_heads=1)
    out = tm.load(tmp_path / "out")  # plain from_pretrained: no custom code
    assert out.config.model_type == ("gpt_bigcode" if arch == "gpt2" else src.config.model_type)
    assert record["kv_heads"]["after"] == 1
    for layer in range(2):
        src_kv, out_kv = kv_projections(src, layer), kv_projections(out, layer)
        for s, o in zip(src_kv, out_kv):
            if s is None:
                assert o is None
                continue
            expected = torch.stack([s[i] for i in range(s.shape[0])]).mean(0)
            for head in range(o.shape[0]):  # GPT-NeoX stores the pooled head once per query head
                torch.testing.assert_close(o[head], expected, rtol=0, atol=1e-6)
    # The model still runs and is no longer the source model.
    ids = tm.sample_ids()
    diff = (tm.logits(src, ids) - tm.logits(out, ids)).abs().max().item()
    assert 0 < diff < 1e3


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_gqa_groups_are_consecutive_heads(arch, tmp_path):
    src = tm.make_tiny(arch, tmp_path / "src")
    kv = tm.kv_heads_of(src.config)
    record = convert(tmp_path / "src", tmp_path / "out", kv_heads=kv // 2)
    out = tm.load(tmp_path / "out")
    assert out.config.num_key_value_heads == kv // 2
    k_src, k_out = kv_projections(src, 0)[0], kv_projections(out, 0)[0]
    for g in range(kv // 2):
        torch.testing.assert_close(k_out[g], (k_src[2 * g] + k_src[2 * g + 1]) / 2, rtol=0, atol=1e-6)
    h = src.config.num_attention_heads
    assert [grp["source_kv_heads"] for grp in record["groups"]] == [[2 * g, 2 * g + 1] for g in range(kv // 2)]
    assert record["groups"][-1]["query_heads"][-1] == h - 1


def test_first_and_random_methods(tmp_path):
    src = tm.make_tiny("llama", tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "first", kv_heads=2, merge="first")
    k_src, k_first = kv_projections(src, 1)[0], kv_projections(tm.load(tmp_path / "first"), 1)[0]
    torch.testing.assert_close(k_first, k_src[[0, 2]], rtol=0, atol=0)

    convert(tmp_path / "src", tmp_path / "r0", kv_heads=2, merge="random", seed=0)
    convert(tmp_path / "src", tmp_path / "r0b", kv_heads=2, merge="random", seed=0)
    convert(tmp_path / "src", tmp_path / "r1", kv_heads=2, merge="random", seed=1)
    r0, r0b, r1 = (kv_projections(tm.load(tmp_path / n), 1)[0] for n in ("r0", "r0b", "r1"))
    torch.testing.assert_close(r0, r0b, rtol=0, atol=0)  # seeded
    assert not torch.equal(r0, r1)
    assert not any(torch.allclose(r0[0], k_src[i]) for i in range(4))  # a fresh init, not a copied head
    assert abs(r0.std().item() - k_src.std().item()) < 0.3 * k_src.std().item()


def test_sharded_output_and_dtype(tmp_path):
    src = tm.make_tiny("qwen2", tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "out", kv_heads=2, max_shard_size="20000")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 3 and all((tmp_path / "out" / s).exists() for s in shards)
    ids = tm.sample_ids()
    assert (tm.logits(src, ids) - tm.logits(tm.load(tmp_path / "out"), ids)).abs().max().item() <= 1e-5

    convert(tmp_path / "out", tmp_path / "bf16", kv_heads=1, dtype="bfloat16")
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and cfg["num_key_value_heads"] == 1
    from safetensors import safe_open

    with safe_open(tmp_path / "bf16" / "model.safetensors", "pt") as f:
        assert {f.get_tensor(n).dtype for n in f.keys()} == {torch.bfloat16}


def test_sharded_input(tmp_path):
    src = tm.make_tiny("llama", tmp_path / "src", max_shard_size="30KB")
    assert (tmp_path / "src" / "model.safetensors.index.json").exists()
    convert(tmp_path / "src", tmp_path / "out", kv_heads=4)
    ids = tm.sample_ids()
    assert (tm.logits(src, ids) - tm.logits(tm.load(tmp_path / "out"), ids)).abs().max().item() == 0


def test_surgery_json_records_source_hashes_and_side_files(tmp_path):
    tm.make_tiny("llama", tmp_path / "src")
    (tmp_path / "src" / "tokenizer.json").write_text("{}")
    (tmp_path / "src" / "generation_config.json").write_text('{"max_new_tokens": 7}')
    record = convert(tmp_path / "src", tmp_path / "out", kv_heads=1)
    saved = json.loads((tmp_path / "out" / "surgery.json").read_text())
    assert saved == record
    digest = hashlib.sha256((tmp_path / "src" / "model.safetensors").read_bytes()).hexdigest()
    assert saved["source"]["shards_sha256"] == {"model.safetensors": digest}
    assert saved["method"] == "mean" and saved["kind"] == "mqa" and saved["version"]
    assert (tmp_path / "out" / "tokenizer.json").read_text() == "{}"
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text()) == {"max_new_tokens": 7}


def test_pickle_checkpoint_needs_allow_pickle(tmp_path):
    from surgery.errors import SurgeryError

    src = tm.make_tiny("mistral", tmp_path / "src")
    (tmp_path / "src" / "model.safetensors").unlink()
    torch.save(src.state_dict(), tmp_path / "src" / "pytorch_model.bin")
    with pytest.raises(SurgeryError, match="--allow-pickle"):
        resolve_source(str(tmp_path / "src"))
        convert(tmp_path / "src", tmp_path / "out", kv_heads=2)
    assert not (tmp_path / "out").exists()
    convert_to_kv_heads(resolve_source(str(tmp_path / "src")), tmp_path / "out",
                        GQAOptions(kv_heads=4, allow_pickle=True), progress=False)
    ids = tm.sample_ids()
    assert (tm.logits(src, ids) - tm.logits(tm.load(tmp_path / "out"), ids)).abs().max().item() == 0


def test_crash_mid_write_leaves_nothing(tmp_path, monkeypatch):
    import surgery.checkpoint.tensors as tensors

    tm.make_tiny("llama", tmp_path / "src")
    calls = {"n": 0}
    real = tensors._write_tensor

    def failing(fd, t):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt  # as Ctrl-C would
        real(fd, t)

    monkeypatch.setattr(tensors, "_write_tensor", failing)
    with pytest.raises(KeyboardInterrupt):
        convert(tmp_path / "src", tmp_path / "out", kv_heads=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_inspect_counts_match_the_loaded_model(arch, tmp_path):
    from surgery.inspection import inspect_checkpoint

    src = tm.make_tiny(arch, tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "out", kv_heads=1)
    out = tm.load(tmp_path / "out")
    before, after = inspect_checkpoint(tmp_path / "src"), inspect_checkpoint(tmp_path / "out")
    for stats, model in ((before, src), (after, out)):
        assert stats["parameters"] == sum(p.numel() for p in model.parameters())  # tied weights once
    heads = before["heads"]
    assert (before["kv_heads"], after["kv_heads"]) == (tm.kv_heads_of(src.config), 1)
    d, layers = before["head_dim"], before["layers"]
    assert after["kv_cache_bytes_per_token"] == 2 * layers * 1 * d * 4
    assert after["kv_cache_dtype"] == "float32"
    assert before["attention_core_macs_per_token"] == layers * 2 * heads * d * 4096


def test_source_hash_follows_file_changes(tmp_path):
    tm.make_tiny("llama", tmp_path / "src", seed=0)
    first = convert(tmp_path / "src", tmp_path / "a", kv_heads=1)["source"]["shards_sha256"]
    tm.make_tiny("llama", tmp_path / "src", seed=1)  # same size, new bytes: the cache must not answer
    second = convert(tmp_path / "src", tmp_path / "b", kv_heads=1)["source"]["shards_sha256"]
    digest = hashlib.sha256((tmp_path / "src" / "model.safetensors").read_bytes()).hexdigest()
    assert second == {"model.safetensors": digest} != first


def test_output_folder_has_ordinary_permissions(tmp_path):
    import os

    tm.make_tiny("llama", tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "out", kv_heads=1)
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~umask
