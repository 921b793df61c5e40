"""--to mla: tiny Llama-like models -> plain deepseek_v3 checkpoints that transformers loads with no custom code."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file

from inprocess import run_cli
from mla_sources import CALIB, convert, tiny_llama

from surgery.testing import tiny_models as tm
from surgery.testing.tiny_models import char_tokenizer

def max_error(src, out, ids) -> tuple[float, float]:
    a, b = tm.load(src), tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    la, lb = tm.logits(a, ids), tm.logits(b, ids)
    return float((la - lb).abs().max()), float(la.abs().max())


def test_mqa_source_at_full_rank_is_the_source(tmp_path):
    """One K/V head, full latent rank, every rotary dim: the output computes the source's logits up to the
    kv_a_layernorm's linear regime (the latent's mean square is 1e-4 x its epsilon on average: the norm divides by
    sqrt(eps)(1 + 5e-5), a relative error ~5e-5 per token, more on tokens with a larger latent; 2e-4 of the logits'
    scale bounds it with room for float32 rounding)."""
    src = tiny_llama(tmp_path / "src", kv_heads=1)
    record = convert(src, tmp_path / "out", rank=32)
    err, scale = max_error(src, tmp_path / "out", tm.sample_ids(length=64))
    assert err <= 2e-4 * scale, (err, scale)
    assert record["mla"]["rope_loss"] == 0 and record["mla"]["latent_loss"] < 1e-9


def test_output_is_a_plain_dense_deepseek_v3(tmp_path):
    src = tiny_llama(tmp_path / "src", kv_heads=2, tie_word_embeddings=True)
    convert(src, tmp_path / "out", rank=24, rope_dim=8)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert "auto_map" not in config and config["q_lora_rank"] is None
    assert config["first_k_dense_replace"] == config["num_hidden_layers"] == 2
    assert config["num_key_value_heads"] == config["num_attention_heads"] == 4
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"], config["qk_nope_head_dim"], config["v_head_dim"]) \
        == (24, 8, 16, 16)
    assert all(isinstance(config[k], int) for k in ("n_routed_experts", "num_experts_per_tok", "n_group",
                                                    "topk_group", "moe_intermediate_size"))
    assert config["n_group"] < config["n_routed_experts"]  # llama.cpp's loader asserts fewer groups than experts
    before, after = load_file(src / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    outside = [n for n in before if ".self_attn." not in n]
    assert outside and all(torch.equal(before[n], after[n]) for n in outside)  # MLP, norms, embeddings
    assert "lm_head.weight" not in before and not config["tie_word_embeddings"]
    assert torch.equal(after["lm_head.weight"], before["model.embed_tokens.weight"])  # the tied head, written
    model = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert not any(".mlp.experts" in n for n, _ in model.named_parameters())


def test_kept_rope_frequencies_are_the_sources(tmp_path):
    """DeepSeek has one rope_theta: the rope dims rotate at exactly the source frequencies the record names."""
    src = tiny_llama(tmp_path / "src", kv_heads=2)
    record = convert(src, tmp_path / "out", rank=64, rope_dim=6)
    kept = record["mla"]["rope_frequencies"]
    assert len(kept) == 3 and kept[0] == 0
    stride = kept[1]
    assert kept == [0, stride, 2 * stride]
    source = tm.load(src).model.rotary_emb.inv_freq
    converted = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out").model.rotary_emb.inv_freq
    torch.testing.assert_close(converted, source[kept], rtol=1e-5, atol=0)


def test_full_rope_keeps_the_source_theta_and_frequencies_bit_for_bit(tmp_path):
    """At rope_dim = head_dim the kept stride is 1: rope_theta is the source's own (not the float32-rounded one the
    frequencies imply), so DeepSeek's rotary computes the source's inv_freq exactly."""
    src = tiny_llama(tmp_path / "src", kv_heads=2, rope_theta=100000.0)
    convert(src, tmp_path / "out", rank=32)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    source = tm.load(src).model.rotary_emb.inv_freq
    assert torch.equal(tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out").model.rotary_emb.inv_freq, source)


def test_error_shrinks_with_the_latent_rank(tmp_path):
    """GQA source: the shared rope key loses the other K/V heads' rotation, so even the full rank is approximate;
    a smaller latent loses more."""
    src = tiny_llama(tmp_path / "src", kv_heads=2)
    ids = tm.sample_ids(length=64)
    errors = []
    for rank in (64, 16):
        convert(src, tmp_path / f"r{rank}", rank=rank)
        errors.append(max_error(src, tmp_path / f"r{rank}", ids)[0])
    assert errors[0] < errors[1], errors


def test_query_refit_brings_held_out_logits_closer_to_the_source(tmp_path):
    """GQA source with sharp attention (q/k scaled up), full rank: the shared rope key loses the K/V heads' rotation
    but their principal direction's, and the query refit (the aligned merge's, one head per group) wins part of it
    back. Measured on text the calibration did not read (pydoc's first documents; calibration reads the last): the
    KL to the source's next-token distribution at least a quarter lower than without the refit (measured: about
    half), and the record says the refit ran."""
    from pydoc_data.topics import topics

    src = tiny_llama(tmp_path / "src", kv_heads=4)
    model = tm.load(src)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(4)
    model.save_pretrained(src)
    text = "".join(topics[k] for k in sorted(topics)[:3])
    ids = torch.tensor(tf.AutoTokenizer.from_pretrained(src)(text)["input_ids"][:1024]).view(8, 128)
    reference = tm.logits(model, ids).log_softmax(-1)
    kl = {}
    for samples in (0, 128):
        record = convert(src, tmp_path / f"q{samples}", rank=128, refit_queries=samples > 0)  # 128: the default
        out = tf.AutoModelForCausalLM.from_pretrained(tmp_path / f"q{samples}", dtype=torch.float32).eval()
        kl[samples] = float(torch.nn.functional.kl_div(tm.logits(out, ids).log_softmax(-1), reference,
                                                       log_target=True, reduction="batchmean"))
        assert record["mla"]["query_refit"] == ({"samples": samples} if samples else False)
    assert kl[128] < 0.75 * kl[0], kl


def test_cli_convert_and_one_line_errors(tmp_path, capsys):
    src = tiny_llama(tmp_path / "src", kv_heads=2)
    code, out, err = run_cli(capsys, "convert", src, "--to", "mla", "--kv-rank", 32, "--calib-tokens", CALIB,
                             "--out", tmp_path / "out")
    assert code == 0, err
    assert "mla (latent rank 32 + rope key 16 per layer)" in out
    gemma = tmp_path / "gemma2"
    tm.make_tiny("gemma2", gemma)
    for args, fragment in (
        ([src, "--kv-rank", 0], "--kv-rank must be positive"),
        ([src, "--kv-rank", 65], "--kv-rank must be between 1 and 64"),
        ([src, "--kv-rank", 8, "--rope-dim", 5], "--rope-dim must be even"),
        ([src, "--kv-rank", 8, "--rope-dim", 32], "--rope-dim must be even (RoPE rotates pairs) and between 2 and"),
        ([src], "--kv-rank"),
        ([gemma, "--kv-rank", 8], "post-norms"),
    ):
        code, out, err = run_cli(capsys, "convert", *args, "--to", "mla", "--calib-tokens", CALIB,
                                 "--out", tmp_path / "bad")
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and fragment in lines[0], err
        assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("family,kw", [("MistralConfig", {"sliding_window": 8})])
def test_sliding_window_is_refused(tmp_path, family, kw):
    from surgery.errors import SurgeryError

    src = tiny_llama(tmp_path / "src", kv_heads=2, family=family, **kw)
    with pytest.raises(SurgeryError, match="sliding-window"):
        convert(src, tmp_path / "out", rank=8)


def _mla_families() -> list[str]:
    from surgery.arch import find_spec

    from surgery.mla.families import APPROXIMATE, mla_family
    from surgery.mla.refusals import REFUSES

    return [a for a in tm.ARCHS if (spec := find_spec(tm.ARCHS[a]().model_type)) is not None
            and spec.refusal("mla", tm.ARCHS[a]().to_dict(), REFUSES) is None
            and getattr(mla_family(spec.name), "verdict", None) != APPROXIMATE]  # test_mla_families.py measures those


@pytest.mark.parametrize("arch", _mla_families())
def test_every_supported_family_matches_its_source_at_full_rank(tmp_path, arch):
    """Each family `surgery convert --list` marks as mla-capable, with one K/V head (where the shared rope key is
    the source's own), at full rank: the source's logits within the tolerance of the MQA test above; a family
    whose config sets what DeepSeek-V3 lacks (a sliding window shorter than the context) is one error."""
    from surgery.errors import SurgeryError

    torch.manual_seed(0)
    config = tm.ARCHS[arch]()
    config.num_key_value_heads = 1
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path / "src")
    char_tokenizer(tmp_path / "src")
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if (getattr(config, "sliding_window", None) or 10**9) < config.max_position_embeddings:
        with pytest.raises(SurgeryError, match="sliding-window"):
            convert(tmp_path / "src", tmp_path / "out", rank=2 * d)
        return
    convert(tmp_path / "src", tmp_path / "out", rank=2 * d)
    err, scale = max_error(tmp_path / "src", tmp_path / "out", tm.sample_ids(length=64))
    assert err <= 2e-4 * scale, (err, scale)


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}


def test_llama3_rope_keeps_only_the_frequencies_it_leaves_unscaled(tmp_path):
    """Llama 3's RoPE rescales its low frequencies: all 8 of head_dim 16 are not one geometric progression (one
    line), the 4 highest are (unscaled below wavelength 1024/4), and the output rotates at exactly those."""
    from surgery.errors import SurgeryError

    src = tiny_llama(tmp_path / "src", kv_heads=1, rope_parameters=LLAMA3_ROPE, max_position_embeddings=128)
    with pytest.raises(SurgeryError, match="--rope-dim 16: no 8 of the source's rotary frequencies"):
        convert(src, tmp_path / "bad", rank=32)
    assert not (tmp_path / "bad").exists()
    record = convert(src, tmp_path / "out", rank=32, rope_dim=8)
    kept = record["mla"]["rope_frequencies"]
    assert kept == [0, 1, 2, 3]
    source = tm.load(src).model.rotary_emb.inv_freq
    converted = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out").model.rotary_emb.inv_freq
    torch.testing.assert_close(converted, source[kept], rtol=1e-5, atol=0)


def test_record_reads_back_typed_and_verifies_and_the_kind_is_found(tmp_path):
    from surgery.kinds import find_kind
    from surgery.checkpoint.record import Record, read_record, verify_record

    src = tiny_llama(tmp_path / "src", kv_heads=2)
    out = tmp_path / "out"
    convert(src, out, rank=8, rope_dim=4)
    record = read_record(out)
    typed = Record.model_validate(record)
    assert typed.kind == "mla" and typed.source.model_type == "llama"
    assert set(typed.output_sha256) == {p.name for p in out.iterdir() if p.name != "surgery.json"}
    verify_record(out, record)
    config = json.loads((out / "config.json").read_text())
    assert find_kind(None, config).name == "mla"  # by config key kv_lora_rank, as `surgery inspect` looks it up
    values = find_kind(None, config).kv_cache_values(_shape(config), config)
    assert values == {"transformers": 2 * (8 + 4), "vllm": 2 * (8 + 4), "llama.cpp": 2 * (8 + 4)}


def _shape(config):
    from surgery.kinds import AttentionShape

    return AttentionShape(config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"],
                          config["v_head_dim"], config["hidden_size"])


def test_bfloat16_output_keeps_the_tiny_latent_and_float16_is_refused(tmp_path):
    """The latent sits at ~1e-5 (kv_a_layernorm's linear regime): bfloat16 has float32's exponent range and keeps it
    (logits within bfloat16's rounding of the weights: measured 0.4%, bound 1% of their scale), float16 would not
    (one error)."""
    from surgery.errors import SurgeryError

    src = tiny_llama(tmp_path / "src", kv_heads=1)
    with pytest.raises(SurgeryError, match="float16's normal range"):
        convert(src, tmp_path / "bad", rank=32, dtype="float16")
    assert not (tmp_path / "bad").exists()
    convert(src, tmp_path / "out", rank=32, dtype="bfloat16")
    err, scale = max_error(src, tmp_path / "out", tm.sample_ids(length=64))
    assert err <= 1e-2 * scale, (err, scale)


def test_training_form_is_the_same_function_and_saves_back_to_the_stored_weights(tmp_path):
    """uptrain trains a converted MLA model in the form of surgery/mla/training.py: latent rows at the rope rows'
    scale, kv_a_layernorm's epsilon divided by s^2. Same logits as loaded; `restore` gives back the stored weights."""
    from surgery.kinds import find_kind
    from surgery.mla.training import LatentScale

    src = tiny_llama(tmp_path / "src", kv_heads=2)
    convert(src, tmp_path / "out", rank=16)
    model = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    stored = {k: v.clone() for k, v in model.state_dict().items()}
    ids = tm.sample_ids(length=48)
    before = tm.logits(model, ids)
    form = find_kind(None, model.config.to_dict()).training_form(model)
    assert isinstance(form, LatentScale) and len(form.scales) == model.config.num_hidden_layers
    attn = model.model.layers[0].self_attn
    rank = attn.kv_lora_rank
    latent, rope = attn.kv_a_proj_with_mqa.weight[:rank], attn.kv_a_proj_with_mqa.weight[rank:]
    assert 0.5 < float(latent.detach().pow(2).mean().sqrt() / rope.detach().pow(2).mean().sqrt()) < 2  # conditioned alike
    after = tm.logits(model, ids)
    assert float((after - before).abs().max()) <= 1e-4 * float(before.abs().max())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    form.restore(model, state)  # a gathered state dict (sharded training)
    form.restore(model)  # the model in place
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, stored[name], rtol=1e-6, atol=0)
        torch.testing.assert_close(state[name], stored[name], rtol=1e-6, atol=0)
    assert model.model.layers[0].self_attn.kv_a_layernorm.variance_epsilon == pytest.approx(1e-6)


def _kd_run(capsys, model, out) -> list[dict]:
    code, _, err = run_cli(capsys, "uptrain", model, "--data", "pydoc", "--tokens", 2048, "--seq-len", 64,
                           "--batch-tokens", 256, "--micro-batch", 2, "--lr", "1e-3", "--eval-tokens", 512,
                           "--eval-every", 4, "--save-every", 0, "--out", out)
    assert code == 0, err
    return [json.loads(line) for line in (out / "uptrain_metrics.jsonl").read_text().splitlines()]


def test_kd_uptraining_of_an_mla_output_stays_near_its_start_instead_of_exploding(tmp_path, capsys, monkeypatch):
    """Without the training form the first Adam steps move the ~1e-5-scaled latent rows by ~30x their size (on
    SmolLM2: KD loss 0.49 -> 22 in one step, gradient norm 1e11); the same run with it keeps the KD loss at the
    scale it started from, and the saved output is the stored format again (tiny latent rows, epsilon 1e-6)."""
    from surgery.mla.kind import MLA

    src = tiny_llama(tmp_path / "src", kv_heads=2)
    convert(src, tmp_path / "mla", rank=8)
    trained = _kd_run(capsys, tmp_path / "mla", tmp_path / "up")
    monkeypatch.setattr(MLA, "training_form", lambda self, model: None)
    stored = _kd_run(capsys, tmp_path / "mla", tmp_path / "up-stored-form")
    loss = {name: [r["loss"] for r in rows if "loss" in r] for name, rows in (("form", trained), ("stored", stored))}
    grad = {name: max(r["grad_norm"] for r in rows if "grad_norm" in r) for name, rows in
            (("form", trained), ("stored", stored))}
    assert max(loss["form"]) < 10 * loss["form"][0], loss
    assert max(loss["stored"]) > 100 * max(loss["form"]) or grad["stored"] > 1e3 * grad["form"], (loss, grad)
    config = json.loads((tmp_path / "up" / "config.json").read_text())
    assert config["rms_norm_eps"] == 1e-6 and config["model_type"] == "deepseek_v3"
    a = load_file(tmp_path / "up" / "model.safetensors")["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    assert float(a[:8].pow(2).mean().sqrt()) < 1e-2 * float(a[8:].pow(2).mean().sqrt())  # stored: tiny latent again


@pytest.mark.parametrize("kv_heads,pairs", [(2, "half"), (1, "interleaved")])
def test_factorisation_makes_every_tensor_on_its_inputs_device(kv_heads, pairs):
    """mla_layer runs on the calibration device (CUDA on a GPU, priced there by the dry run): every tensor it makes
    must be made on its inputs' device. With the default device set to meta, a tensor made without `device=` lands
    on meta and meets the CPU inputs in an error; made right, the weights are the CPU-default run's exactly."""
    from surgery.mla.factor import SourceAttention, mla_layer

    g = torch.Generator().manual_seed(0)
    h, d, H = 4, 8, 24
    x = torch.randn(256, H, generator=g, dtype=torch.float64)
    sigma = x.T @ x / 256
    src = SourceAttention(*(torch.randn(*s, generator=g, dtype=torch.float64) for s in
                            ((h * d, H), (kv_heads * d, H), (kv_heads * d, H), (H, h * d))), h, kv_heads, d)
    args = (src, sigma, [0, 2], pairs, 6, d**-0.5, 1e-5)
    expected = mla_layer(*args)
    torch.set_default_device("meta")
    try:
        got = mla_layer(*args)
    finally:
        torch.set_default_device(None)
    for name in ("q_proj", "kv_a", "kv_a_norm", "kv_b", "o_proj"):
        a, b = getattr(expected, name), getattr(got, name)
        assert b.device.type == "cpu" and torch.equal(a, b), name
    assert got.to("meta").kv_b.device.type == "meta"
