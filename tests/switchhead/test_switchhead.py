"""SwitchHead conversion on tiny random checkpoints: exactness with one expert per head, clusters and tensors,
conditional computation, KV cache and generation, loading without the toolkit, init on load, inspect, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file

from surgery.testing import tiny_models as tm
from surgery.errors import SurgeryError
from surgery.inspection import inspect_checkpoint
from surgery.checkpoint.source import resolve_source
from surgery.kinds import options_for
from surgery.switchhead import convert_to_switchhead
from surgery.switchhead.cluster import balanced_clusters
from surgery.switchhead.modeling_switchhead import SwitchHeadAttention, expert_outputs, expert_values
from surgery.training.params import new_parameter_names

REPO = Path(__file__).resolve().parents[2]
# every family SwitchHead converts (the others refuse in one line: see test_refused_families_say_why)
EXACT_ARCHS = [a for a in tm.ARCHS if tm.refused(a, "switchhead") is None]


@pytest.fixture(scope="module")
def tokenizer():
    return tm.tiny_tokenizer()


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tokenizer):
    """Tiny Llama: 8 query heads, 4 K/V heads of 8, hidden 64, with a tokenizer for calibration."""
    folder = tmp_path_factory.mktemp("src") / "llama"
    tm.make_tiny("llama", folder)
    tokenizer.save_pretrained(folder)
    return folder


ABLATIONS = ("respect_kv_groups", "qk_merge", "refit", "ridge", "calib_inputs")  # convert_to_switchhead's own


def convert(src: Path, out: Path, heads: int, experts: int, topk: int, **kw) -> dict:
    """`src` as SwitchHead on 1024 pydoc tokens unless told; `kw`: more of the kind's options (their rules raise
    SurgeryError, as for any library caller) and the converter's ablations."""
    ablations = {k: kw.pop(k) for k in ABLATIONS if k in kw}
    options = options_for("switchhead", heads=heads, experts=experts, topk=topk, calib=kw.pop("calib", ["pydoc"]),
                          calib_tokens=kw.pop("calib_tokens", 1024), **kw)
    return convert_to_switchhead(resolve_source(str(src)), out, options, progress=False, **ablations)


def load(folder: Path, **kw):
    return tf.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32, **kw).eval()


def attention_modules(model) -> list[SwitchHeadAttention]:
    return [m for m in model.modules() if type(m).__name__ == "SwitchHeadAttention"]


@pytest.mark.parametrize("arch", EXACT_ARCHS)
def test_one_expert_per_head_reproduces_the_source(arch, tmp_path):
    src = tmp_path / "src"
    source = tm.make_tiny(arch, src)
    heads = source.config.num_attention_heads
    record = convert(src, tmp_path / "sh", heads, 1, 1)
    assert record["heads"] == {"before": heads, "after": heads}
    assert record["exact_at_init"] and record["calibration"] is None
    model = load(tmp_path / "sh")
    assert len(attention_modules(model)) == source.config.num_hidden_layers
    ids = tm.sample_ids()
    diff = (tm.logits(tm.load(src), ids) - tm.logits(model, ids)).abs().max().item()
    assert diff <= 1e-4


def read_layer(tensors: dict, layer: int, d: int = 8, dim: int = 64):
    p = f"model.layers.{layer}.self_attn."
    q, k, v = (tensors[p + f"{n}_proj.weight"].view(-1, d, dim) for n in "qkv")
    return p, q, k, v, tensors[p + "o_proj.weight"].view(dim, -1, d)


@pytest.mark.parametrize("inputs", ["converted", "source"])
def test_each_layer_calibrates_on_the_hidden_states_it_is_given(llama, tmp_path, tokenizer, monkeypatch, inputs):
    """calib_inputs="converted": layer 1 calibrates on what the converted layer 0 outputs (as the written checkpoint
    computes it), not on the source's hidden states; "source": on the source's own."""
    from surgery.calibration.text import calibration_text
    from surgery.switchhead import layers

    seen = []
    original = layers.calibrate_layer

    def recording(layer, hidden, calls, *args, **kw):
        seen.append(torch.cat([h.clone() for h in hidden]))  # one window per chunk, on the host here
        return original(layer, hidden, calls, *args, **kw)

    monkeypatch.setattr(layers, "calibrate_layer", recording)
    out = tmp_path / "sh"
    convert(llama, out, heads=4, experts=2, topk=1, calib_tokens=256, calib_inputs=inputs)
    config = json.loads((llama / "config.json").read_text())
    windows = calibration_text("pydoc", tokenizer, 256, config.get("max_position_embeddings")).windows
    with torch.no_grad():
        hidden = {name: model(windows, output_hidden_states=True).hidden_states[1]
                  for name, model in (("converted", load(out)), ("source", tm.load(llama)))}
    other = "source" if inputs == "converted" else "converted"
    assert seen[1].shape == hidden[inputs].shape
    error = {name: (seen[1] - h).abs().max().item() for name, h in hidden.items()}
    assert error[inputs] < 1e-5 and error[other] > 100 * error[inputs], error


def test_the_source_pass_stops_after_the_attention_when_its_outputs_are_not_needed(llama, tmp_path, monkeypatch):
    """With calib_inputs="converted" the source layer's outputs are not read (the converted pass makes the next
    inputs): its forward ends after the attention, so each layer's MLP runs once per window (the converted pass),
    not twice; the checkpoint is the same as with the whole source forward."""
    import transformers.models.llama.modeling_llama as llama_code

    from surgery.switchhead import layers

    mlp_calls = []
    forward = llama_code.LlamaMLP.forward
    monkeypatch.setattr(llama_code.LlamaMLP, "forward", lambda self, x: mlp_calls.append(1) or forward(self, x))
    record = convert(llama, tmp_path / "skip", heads=4, experts=2, topk=1, calib_tokens=256)
    skipping = len(mlp_calls)
    windows = record["calibration"]["windows"]
    n_layers = json.loads((llama / "config.json").read_text())["num_hidden_layers"]
    assert skipping == windows * n_layers

    original = layers.calibrate_layer
    monkeypatch.setattr(layers, "calibrate_layer", lambda *a, **kw: original(*a, **(kw | {"keep_outputs": True})))
    mlp_calls.clear()
    convert(llama, tmp_path / "whole", heads=4, experts=2, topk=1, calib_tokens=256)
    assert len(mlp_calls) == 2 * skipping
    a, b = load_file(tmp_path / "skip" / "model.safetensors"), load_file(tmp_path / "whole" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("qk_merge, refit", [("medoid", True), ("mean", False)])
def test_clusters_tensors_and_record(llama, tmp_path, qk_merge, refit):
    out = tmp_path / "sh"
    record = convert(llama, out, heads=4, experts=2, topk=1, qk_merge=qk_merge, refit=refit)
    assert record["kind"] == "switchhead" and record["kv_mapping"]["mode"] == "within-groups"
    assert record["calibration"]["tokens"] == 1024 and record["qk_merge"] == qk_merge
    src = load_file(llama / "model.safetensors")
    new = load_file(out / "model.safetensors")
    for layer, clusters in enumerate(record["clusters"]):
        # balanced: every source head in exactly one cluster of E=2; within-groups: both members share a K/V head
        assert sorted(m for c in clusters for m in c) == list(range(8)) and all(len(c) == 2 for c in clusters)
        assert all(c[0] // 2 == c[1] // 2 for c in clusters)
        p, q, k, v, o = read_layer(src, layer)
        _, q_new, k_new, v_new, _ = read_layer({**new, p + "v_proj.weight": new[p + "k_proj.weight"],
                                                p + "o_proj.weight": torch.zeros(64, 32)}, layer)
        for c, members in enumerate(clusters):
            g = members[0] // 2
            assert torch.equal(k_new[c], k[g])  # the group's own K head
            if qk_merge == "medoid":
                pivot = record["qk_pivots"][layer][c]
                assert pivot in members and torch.equal(q_new[c], q[pivot])
            else:
                assert torch.allclose(q_new[c], q[members].mean(0))
            for e, m in enumerate(members):
                assert torch.equal(new[p + "v_experts.weight"][c, e], v[g] * 2)  # 2/k with k = 1
                if not refit:
                    assert torch.equal(new[p + "o_experts.weight"][c, e], o[:, m] * 2)
        assert new[p + "v_router.weight"].shape == (8, 64) and new[p + "v_router.weight"].abs().sum() > 0
    if refit:  # the refit lowers the error of the attention output on the calibration text, in every layer
        errors = record["output_refit"]["relative_error"]
        assert len(errors) == 2 and all(e["after"] < e["before"] for e in errors)
    else:
        assert record["output_refit"] is None
    config = json.loads((out / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 4, 8)
    assert config["switchhead"] == {"heads": 4, "experts": 2, "topk": 1, "head_dim": 8, "source_heads": 8,
                                    "source_kv_heads": 4, "bias": {"q": False, "k": False, "v": False, "o": False}}
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_switchhead.SwitchHeadLlamaForCausalLM"
    # the uptraining contract: the patterns select exactly the routers of the loaded model
    names = [n for n, _ in load(out).named_parameters()]
    selected = new_parameter_names(names, record)
    assert selected == {n for n in names if n.endswith(("v_router.weight", "o_router.weight"))} and len(selected) == 4


def test_calibration_clusters_heads_that_attend_alike(tmp_path, tokenizer):
    """Heads 2 and 3 are copies of heads 0 and 1 (same queries and keys, own values): the clustering pairs them."""
    src = tmp_path / "src"
    model = tm.make_tiny("mistral", src)  # 4 heads, 4 K/V heads of 16
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj, scale in ((attn.q_proj, 4.0), (attn.k_proj, 4.0)):
                w = proj.weight.view(4, 16, -1)
                w.mul_(scale)
                w[2], w[3] = w[0].clone(), w[1].clone()
    model.save_pretrained(src)
    tokenizer.save_pretrained(src)
    record = convert(src, tmp_path / "sh", heads=2, experts=2, topk=1)
    assert record["clusters"] == [[[0, 2], [1, 3]]] * 2
    assert all(dist < 1e-6 for dist in record["cluster_distance"])


def test_balanced_clusters_recover_planted_groups():
    gen = torch.Generator().manual_seed(0)
    labels = torch.arange(12) // 3
    perm = torch.randperm(12, generator=gen)
    labels = labels[perm]
    dist = (labels[:, None] != labels[None, :]).float() + 0.3 * torch.rand(12, 12, generator=gen)
    dist = (dist + dist.T) / 2
    dist.fill_diagonal_(0)
    clusters = balanced_clusters(dist, 3)
    assert sorted(sorted(int(labels[i]) for i in c) for c in clusters) == [[g] * 3 for g in range(4)]


def naive_values(w, b, x, gates, index):
    """Every expert computed for every token, then the unselected ones dropped: the reference (not conditional)."""
    y = torch.einsum("hedD,nD->nhed", w, x) + b
    chosen = torch.zeros(y.shape[:3]).scatter(2, index, gates)
    return (y * chosen.unsqueeze(-1)).sum(2)


@pytest.mark.parametrize("n", [1, 8, 200])  # 1 and 8: every expert, gates zero-padded; 200: tokens sorted by expert
def test_expert_computation_is_dense_for_few_tokens_and_conditional_beyond(n):
    from torch.utils.flop_counter import FlopCounterMode

    from surgery.switchhead import modeling_switchhead as msh
    from surgery.switchhead.modeling_switchhead import SigmaMoERouter, SwitchHeadExperts

    dense = n <= msh.DENSE_TOKENS
    assert dense == (n < 200)
    gen = torch.Generator().manual_seed(0)
    heads, n_exp, d, dim = 3, 4, 8, 32
    x = torch.randn(n, dim, generator=gen)
    v, o = SwitchHeadExperts(heads, n_exp, dim, d, bias=True), SwitchHeadExperts(heads, n_exp, d, dim, bias=False)
    with torch.no_grad():
        for p in (*v.parameters(), *o.parameters()):
            p.normal_(generator=gen)
    flops = {}
    for k in (1, 2, n_exp):
        router = SigmaMoERouter(dim, heads, n_exp, k)
        with torch.no_grad():
            router.weight.normal_(generator=gen)
        gates, index = router(x)
        a = torch.randn(n, heads, d, generator=gen)
        with FlopCounterMode(display=False) as counter:
            values = expert_values(v, x, gates, index)
            outputs = expert_outputs(o, a, gates, index)
        flops[k] = counter.get_total_flops()
        # each side: one (d x D) product for each of the n * heads * k selected (token, head, expert) triples; with
        # few tokens, for every expert of every head; routed, the rows of each expert are padded to whole blocks
        rows = n * heads * (n_exp if dense or index is None else k)
        pad = 0 if dense or index is None else (heads * n_exp + 1) * msh.expert_block_rows(rows, heads * n_exp)
        assert 2 * (2 * rows * d * dim) <= flops[k] <= 2 * (2 * (rows + pad) * d * dim)
        if index is None:
            index = torch.arange(n_exp).expand(n, heads, n_exp)
        assert torch.allclose(values, naive_values(v.weight, v.bias, x, gates, index), atol=1e-4)
        dense_o = torch.einsum("heDd,nhd->nheD", o.weight, a)
        chosen = torch.zeros(n, heads, n_exp).scatter(2, index, gates)
        assert torch.allclose(outputs, (dense_o * chosen.unsqueeze(-1)).sum((1, 2)), atol=1e-3)
    if not dense:
        assert flops[1] < flops[2] < flops[n_exp]


@pytest.fixture(scope="module")
def routed(llama, tmp_path_factory):
    """H=2 heads of E=4 experts, k=2 selected: every cluster spans two K/V groups (whole-groups)."""
    out = tmp_path_factory.mktemp("sh") / "routed"
    record = convert(llama, out, heads=2, experts=4, topk=2)
    return out, record


def test_attention_module_computes_only_selected_experts_beyond_few_tokens(routed):
    from torch.utils.flop_counter import FlopCounterMode

    from surgery.switchhead import modeling_switchhead as msh

    out, record = routed
    model = load(out)
    attn = attention_modules(model)[0]
    layers = model.config.num_hidden_layers
    for batch, length in ((2, 100), (1, 8)):  # 200 tokens a call: conditional; 8 (a decode step's size): dense
        ids = tm.sample_ids(batch=batch, length=length)
        flops = {}
        for k in (1, 2, 4):
            for m in attention_modules(model):
                m.topk = m.v_router.topk = m.o_router.topk = k
            with FlopCounterMode(display=False) as counter:
                with torch.no_grad():
                    model(input_ids=ids)
            flops[k] = counter.get_total_flops()
        n = batch * length
        per_expert = 2 * 2 * n * attn.num_heads * attn.head_dim * model.config.hidden_size  # V and O, per layer
        if n > msh.DENSE_TOKENS:  # the routed rows of each expert are padded to whole blocks: under one block each
            groups = attn.num_heads * attn.num_experts
            pad = [(groups + 1) * msh.expert_block_rows(n * attn.num_heads * k, groups) for k in (1, 2)]
            pad = [layers * 2 * 2 * p * attn.head_dim * model.config.hidden_size for p in pad]
            assert per_expert * layers - pad[0] <= flops[2] - flops[1] <= per_expert * layers + pad[1]
            assert 2 * layers * per_expert - pad[1] <= flops[4] - flops[2] <= 2 * layers * per_expert
        else:
            assert flops[1] == flops[2] == flops[4]


def test_kv_cache_holds_new_heads_and_generate_works(routed):
    out, record = routed
    model = load(out)
    ids = tm.sample_ids(batch=2, length=12)
    with torch.no_grad():
        full = model(input_ids=ids).logits
        first = model(input_ids=ids[:, :8], use_cache=True)
        cache = first.past_key_values
        assert cache.layers[0].keys.shape == (2, 2, 8, 8) and cache.layers[0].values.shape == (2, 2, 8, 8)
        step = model(input_ids=ids[:, 8:], past_key_values=cache, use_cache=True).logits
    assert (torch.cat([first.logits, step], 1) - full).abs().max() <= 1e-4
    prompt = ids[:1, :5]
    cached = model.generate(prompt, max_new_tokens=10, do_sample=False)
    uncached = model.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=False)
    assert cached.shape == (1, 15) and torch.equal(cached, uncached)


@pytest.mark.parametrize("keyword", ["cache", "past_key_values", "layer_past"])
def test_attention_takes_its_cache_under_every_name_decoder_layers_use(routed, keyword):
    """transformers 5.24's decoder layers pass the cache as `cache`, earlier 5.x as `past_key_values`, GPT-NeoX and
    GPTBigCode as `layer_past`: under each name the step must see the cached keys (an ignored cache still runs,
    attending to the new token alone)."""
    out, _ = routed
    model = load(out)
    ids = tm.sample_ids(batch=1, length=9)
    attn = attention_modules(model)[0]
    with torch.no_grad():
        x = model.get_input_embeddings()(ids)
        pos = model.model.rotary_emb(x, torch.arange(9)[None])
        mask = torch.full((9, 9), float("-inf")).triu(1)[None, None]
        full, _ = attn(x, pos, mask)
        cache = tf.DynamicCache(config=model.config)
        attn(x[:, :8], tuple(p[:, :8] for p in pos), mask[..., :8, :8], **{keyword: cache})
        step, _ = attn(x[:, 8:], tuple(p[:, 8:] for p in pos), None, **{keyword: cache})
    assert cache.layers[0].keys.shape[2] == 9
    assert (step - full[:, 8:]).abs().max() <= 1e-5


# fused q/k/v layouts, Conv1D, an output projection named `dense`: calibration finds them through the spec
@pytest.mark.parametrize("arch, module, causal_lm", [
    ("gpt2", "transformer.h.*.attn", "GPT2LMHeadModel"), ("phi3", "model.layers.*.self_attn", "Phi3ForCausalLM"),
    ("gpt_neox", "gpt_neox.layers.*.attention", "GPTNeoXForCausalLM"),
    ("phi", "model.layers.*.self_attn", "PhiForCausalLM"), ("gpt_bigcode", "transformer.h.*.attn", "GPTBigCodeForCausalLM"),
    ("mixtral", "model.layers.*.self_attn", "MixtralForCausalLM")])  # streamed layers of fused in-memory experts
def test_routed_experts_on_other_layouts(arch, module, causal_lm, tmp_path, tokenizer):
    src = tmp_path / arch
    source = tm.make_tiny(arch, src)  # 4 heads of 16
    tokenizer.save_pretrained(src)
    record = convert(src, tmp_path / "sh", heads=2, experts=2, topk=1)
    if arch == "gpt2":  # no K/V groups: clusters are free
        assert record["kv_mapping"]["mode"] == "whole-groups"
    assert record["output_refit"] is not None
    assert record["new_parameters"] == [f"{module}.v_router.weight", f"{module}.o_router.weight"]
    model = load(tmp_path / "sh")
    assert model.config.num_attention_heads == 2 and type(model).__name__ == f"SwitchHead{causal_lm}"
    ids = tm.sample_ids(batch=1, length=10)
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    assert cache.layers[0].keys.shape == (1, 2, 10, 16)
    diff = (tm.logits(source, ids) - tm.logits(model, ids)).abs().max().item()
    assert 0 < diff < 10  # two source heads per head now: close to the source, not equal
    cached = model.generate(ids[:, :4], max_new_tokens=8, do_sample=False)
    assert torch.equal(cached, model.generate(ids[:, :4], max_new_tokens=8, do_sample=False, use_cache=False))


def test_loads_with_remote_code_without_the_toolkit(routed, tmp_path):
    out, _ = routed
    ids = tm.sample_ids(batch=1, length=16)
    torch.save({"ids": ids, "logits": tm.logits(load(out), ids)}, tmp_path / "expected.pt")
    script = textwrap.dedent(f"""
        import importlib.abc, sys
        class Hide(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("surgery", "cli", "tiny_models"):
                    raise ImportError("hidden: " + name)
        sys.meta_path.insert(0, Hide())
        sys.path = [p for p in sys.path if p not in ("", {str(REPO)!r}, {str(REPO / 'tests')!r})]
        try:
            import surgery
            raise SystemExit("the toolkit is importable")
        except ImportError:
            pass
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True, dtype=torch.float32).eval()
        expected = torch.load({str(tmp_path / 'expected.pt')!r})
        with torch.no_grad():
            logits = model(input_ids=expected["ids"]).logits
        assert (logits - expected["logits"]).abs().max() <= 1e-5, "logits differ"
        stored = load_file({str(out / 'model.safetensors')!r})
        for name, param in model.named_parameters():
            if name in stored:
                assert torch.equal(param, stored[name]), name
        print(type(model).__name__, "ok")
    """)
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "PYTHONPATH": ""}
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "SwitchHeadLlamaForCausalLM ok" in result.stdout


def test_init_weights_leaves_loaded_parameters_alone(routed):
    out, _ = routed
    stored = load_file(out / "model.safetensors")
    model = load(out)
    checked = 0
    for name, param in model.named_parameters():
        if any(key in name for key in ("router", "experts", "q_proj", "k_proj")):
            assert torch.equal(param, stored[name]), name
            checked += 1
    assert checked == 2 * 6
    # a fresh model (no checkpoint) initialises the new modules: finite, non-zero, at initializer_range
    config = tf.AutoConfig.from_pretrained(out, trust_remote_code=True)
    fresh = tf.AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    router = attention_modules(fresh)[0].v_router.weight
    experts = attention_modules(fresh)[0].o_experts.weight
    for w in (router, experts):
        assert torch.isfinite(w).all() and 0.01 < w.std().item() < 0.04


def test_inspect_reports_switchhead_costs(llama, routed):
    out, _ = routed
    src, dst = inspect_checkpoint(llama), inspect_checkpoint(out)
    assert dst["surgery"] == "switchhead" and (dst["heads"], dst["kv_heads"], dst["head_dim"]) == (2, 2, 8)
    assert (dst["experts"], dst["topk"]) == (4, 2)
    assert dst["kv_cache_bytes_per_token"] * 2 == src["kv_cache_bytes_per_token"]  # 2 heads instead of 4 K/V heads
    L, D, H, E, k, d = 2, 64, 2, 4, 2, 8
    assert dst["attention_proj_macs_per_token"] == L * (2 * D * H * d + 2 * k * H * d * D + 2 * D * H * E)
    assert dst["attention_core_macs_per_token"] == L * 2 * H * d * dst["context"]
    tensors = load_file(out / "model.safetensors")
    assert dst["parameters"] == sum(t.numel() for t in tensors.values())


def surgery_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)


def test_cli_refuses_bad_head_counts(llama, tmp_path):
    result = surgery_cli("convert", llama, "--to", "switchhead", "--heads", "3", "--experts", "2", "--topk", "1",
                         "--out", tmp_path / "bad")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("surgery: error:"), result.stderr
    assert "--heads 3 x --experts 2 must equal the source's 8 heads" in lines[0] and "--heads 4 --experts 2" in lines[0]
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("kw, message", [
    (dict(heads=4, experts=2, topk=3), "--topk must lie between 1 and --experts 2"),
    (dict(heads=0, experts=8, topk=1), "--heads and --experts must be at least 1"),
    (dict(heads=4, experts=2, topk=1, calib="/nonexistent/x.txt"), "does not exist"),
    (dict(heads=4, experts=2, topk=1, dtype="int8"), "Input should be 'auto', 'float32'"),
    (dict(heads=4, experts=2, topk=1, calib_inputs="teacher"), "unknown calibration inputs 'teacher'"),
])
def test_bad_options(llama, tmp_path, kw, message):
    with pytest.raises(SurgeryError, match=message.replace("(", r"\(")):
        convert(llama, tmp_path / "out", **kw)
    assert list(tmp_path.iterdir()) == []


def test_bad_sources(llama, tmp_path):
    convert(llama, tmp_path / "sh", 8, 1, 1)
    with pytest.raises(SurgeryError, match="already a SwitchHead checkpoint"):
        convert(tmp_path / "sh", tmp_path / "again", 8, 1, 1)
    tm.make_tiny("olmo2", tmp_path / "olmo2")  # a family SwitchHead refuses, in one line
    with pytest.raises(SurgeryError, match="cannot convert 'olmo2': q/k norms over the whole projection"):
        convert(tmp_path / "olmo2", tmp_path / "olmo2-sh", 4, 1, 1)
    no_tokenizer = tmp_path / "bare"
    tm.make_tiny("llama", no_tokenizer)
    with pytest.raises(SurgeryError, match="cannot load the tokenizer"):
        convert(no_tokenizer, tmp_path / "bare-sh", 4, 2, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare", "olmo2", "sh"]


def test_routers_in_one_matmul_follow_weight_changes():
    """Both routers run as one matmul on a stacked weight kept between calls: it must equal the two routers run
    apart, and follow in-place changes of either weight (uptraining, refits)."""
    from transformers.models.llama.modeling_llama import LlamaAttention

    config = tm.ARCHS["llama"]()
    config.switchhead = {"heads": 2, "experts": 4, "topk": 2, "head_dim": 8}
    attn = SwitchHeadAttention(LlamaAttention(config, layer_idx=0), config, config.switchhead)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, config.hidden_size, generator=gen)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(generator=gen)
        for step in range(2):
            (gv, iv), (go, io) = attn.route(x)
            for (g, i), router in (((gv, iv), attn.v_router), ((go, io), attn.o_router)):
                g_ref, i_ref = router(x)
                assert torch.equal(i.sort(-1).values, i_ref.sort(-1).values)
                assert torch.allclose(g.sort(-1).values, g_ref.sort(-1).values)
            attn.o_router.weight.mul_(-1)  # in place: the next step checks the stacked weight was rebuilt


def test_calib_window_reaches_the_switchhead_calibration(llama, tmp_path, capsys):
    """`surgery convert --to switchhead --calib-window 32`: the calibration reads the same 256 tokens as four
    windows of 64 -> eight windows of 32, and the record says so."""
    from inprocess import run_cli

    code, _, err = run_cli(capsys, "convert", llama, "--to", "switchhead", "--heads", "4", "--experts", "2", "--topk",
                           "1", "--calib-tokens", "256", "--calib-window", "32", "--device", "cpu", "--out",
                           tmp_path / "sh")
    assert code == 0, err
    calibration = json.loads((tmp_path / "sh" / "surgery.json").read_text())["calibration"]
    assert (calibration["tokens"], calibration["windows"], calibration["window_length"]) == (256, 8, 32)
