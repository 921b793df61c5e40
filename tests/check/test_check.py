"""`surgery check`: one model at a time with the numbers of a two-models-at-once comparison, greedy continuations,
per-layer errors, tokenizer agreement, trust and pickle policy, bad options, progress, calibration overlap."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from inprocess import run_cli
from recipe_files import pair_kv_heads
import torch
import torch.nn.functional as F
import transformers as tf

from surgery.testing import tiny_models as tm
from surgery.testing.tiny_models import char_tokenizer

from surgery.checking.compare import compare_checkpoints, compare_models
from surgery.checking.options import CheckOptions
from surgery.runtime import load_model
from surgery.checking import generate as gen
from surgery.checking.overlap import document_sha256
from surgery.checking.spill import SpillStore
from surgery.kv.convert import convert_to_kv_heads
from surgery.kv.options import GQAOptions, MQAOptions
from surgery.data import pydoc_texts, token_stream
from surgery.errors import SurgeryError
from surgery.publish.card import generation_section, positions_section
from surgery.checkpoint.source import resolve_source

METRICS = ("max_abs_diff", "mean_abs_diff", "kl", "top1_agreement", "ppl_source", "ppl_converted")


def paired_llama(folder: Path) -> Path:
    """A tiny llama (char tokenizer) whose 4 K/V heads come in identical pairs: merging them to 2 is exact."""
    model = tm.make_tiny("llama", folder)
    pair_kv_heads(model)
    model.save_pretrained(folder)
    char_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("check")
    paired_llama(root / "src")
    src = resolve_source(str(root / "src"))
    convert_to_kv_heads(src, root / "exact", GQAOptions(kv_heads=2), progress=False)
    tm.make_tiny("llama", root / "other", seed=3)  # unpaired K/V heads: merging them is lossy
    char_tokenizer(root / "other")
    convert_to_kv_heads(resolve_source(str(root / "other")), root / "lossy", GQAOptions(kv_heads=2), progress=False)
    return {"root": root, "src": root / "src", "exact": root / "exact", "other": root / "other", "lossy": root / "lossy"}


RUN = ("progress", "spill_bytes", "warn", "more_texts")  # compare_checkpoints' own arguments; the rest: CheckOptions


def check(source: Path, converted: Path, **kwargs) -> dict:
    kwargs = {"tokens": 1024, "seq_len": 64, "batch_size": 3, "device": "cpu", "progress": False} | kwargs
    run = {k: kwargs.pop(k) for k in RUN if k in kwargs}
    return compare_checkpoints(resolve_source(str(source)), resolve_source(str(converted)), pydoc_texts(),
                               CheckOptions(**kwargs), **run)


def surgery(capsys, *args, env: dict | None = None, monkeypatch=None) -> tuple[int, str, str]:
    """`surgery ARGS` in this process (no interpreter start-up): (exit code, stdout, stderr)."""
    return run_cli(capsys, *args)


def assert_one_line_error(result, *fragments: str) -> None:
    code, _, err = result
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("surgery: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# --- the same numbers, one model at a time -----------------------------------------------------------------------
def reference_metrics(source: Path, converted: Path, tokens: int, seq_len: int) -> dict:
    """The metrics straight from their definitions, both models' full logits in memory at once."""
    a_model, b_model = tm.load(source), tm.load(converted)
    tok = tf.AutoTokenizer.from_pretrained(source)
    ids = token_stream(pydoc_texts(), tok, tokens)
    x = ids[: ids.numel() // seq_len * seq_len].view(-1, seq_len)
    with torch.no_grad():
        a, b = a_model(input_ids=x).logits.double(), b_model(input_ids=x).logits.double()
    logp_a, logp_b = F.log_softmax(a, -1), F.log_softmax(b, -1)
    nll = [-lp[:, :-1].gather(-1, x[:, 1:, None]).mean().item() for lp in (logp_a, logp_b)]
    return {"max_abs_diff": (a - b).abs().max().item(), "mean_abs_diff": (a - b).abs().mean().item(),
            "kl": (logp_a.exp() * (logp_a - logp_b)).sum(-1).mean().item(),
            "top1_agreement": (a.argmax(-1) == b.argmax(-1)).double().mean().item(),
            "ppl_source": math.exp(nll[0]), "ppl_converted": math.exp(nll[1])}


@pytest.mark.parametrize("spill_bytes", [0, 1 << 30], ids=["scratch-disk", "memory"])
def test_sequential_check_gives_the_numbers_of_both_models_at_once(models, spill_bytes):
    report = check(models["other"], models["lossy"], spill_bytes=spill_bytes)
    assert report["scratch"] == ("disk" if spill_bytes == 0 else "memory")
    assert report["logits"] == "sliced"  # neither model returned whole logits
    assert report["tokens"] == 1024 and report["windows"] == 16 and report["seq_len"] == 64
    expected = reference_metrics(models["other"], models["lossy"], 1024, 64)
    cpu = torch.device("cpu")  # the old check: both models loaded as check loads them, compared at once
    a, b = (load_model(resolve_source(str(models[k])), cpu, "float32") for k in ("other", "lossy"))
    ids = token_stream(pydoc_texts(), tf.AutoTokenizer.from_pretrained(models["other"]), 1024)
    at_once = compare_models(a, b, ids, 64, 3, causal=True)
    assert expected["max_abs_diff"] > 0.05 and expected["top1_agreement"] < 0.95  # a real difference to measure
    for key in METRICS:
        assert report[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-7), key  # eager vs sdpa rounding
        assert report[key] == pytest.approx(at_once[key], rel=1e-6, abs=1e-12), key


def test_metrics_by_position_in_the_window_match_their_definitions(models, capsys, tmp_path):
    """Perplexity, KL and top-1 per bucket of positions (0-63, 64-127 for windows of 128), from both models' full
    logits at once, against the one-model-at-a-time check; the buckets add up to the whole-window numbers."""
    seq_len, tokens = 128, 1024
    report = check(models["other"], models["lossy"], tokens=tokens, seq_len=seq_len, spill_bytes=0)
    a_model, b_model = tm.load(models["other"]), tm.load(models["lossy"])
    ids = token_stream(pydoc_texts(), tf.AutoTokenizer.from_pretrained(models["other"]), tokens)
    x = ids[: tokens // seq_len * seq_len].view(-1, seq_len)
    with torch.no_grad():
        logp_a, logp_b = (F.log_softmax(m(input_ids=x).logits.double(), -1) for m in (a_model, b_model))
    kl = (logp_a.exp() * (logp_a - logp_b)).sum(-1)
    agree = (logp_a.argmax(-1) == logp_b.argmax(-1)).double()
    nll = [-lp[:, :-1].gather(-1, x[:, 1:, None])[..., 0] for lp in (logp_a, logp_b)]
    rows = report["by_position"]
    assert [r["positions"] for r in rows] == [[0, 64], [64, 128]]
    for row in rows:
        lo, hi = row["positions"]
        expected_ppl = [math.exp(n[:, lo:min(hi, seq_len - 1)].mean().item()) for n in nll]
        assert row["targets"] == x.shape[0] * (min(hi, seq_len - 1) - lo)
        assert row["ppl_source"] == pytest.approx(expected_ppl[0], rel=1e-4)
        assert row["ppl_converted"] == pytest.approx(expected_ppl[1], rel=1e-4)
        assert row["ppl_ratio"] == pytest.approx(expected_ppl[1] / expected_ppl[0], rel=1e-4)
        assert row["kl"] == pytest.approx(kl[:, lo:hi].mean().item(), rel=1e-4)
        assert row["top1_agreement"] == pytest.approx(agree[:, lo:hi].mean().item(), abs=1e-9)
    assert rows[0]["ppl_converted"] != pytest.approx(rows[1]["ppl_converted"], rel=1e-3)  # the buckets differ
    total = sum(r["targets"] * math.log(r["ppl_converted"]) for r in rows) / sum(r["targets"] for r in rows)
    assert math.exp(total) == pytest.approx(report["ppl_converted"], rel=1e-6)
    assert "by_position" not in check(models["other"], models["lossy"], tokens=512, seq_len=64)  # one bucket: none
    card = "\n".join(positions_section([("check", report)]))  # the model card's table
    assert f"| check | 64-127 | {rows[1]['ppl_source']:.3f} | {rows[1]['ppl_converted']:.3f} |" in card
    assert positions_section([("check", {"ppl_converted": 1.0})]) == []

    code, out, err = surgery(capsys, "check", models["other"], models["lossy"], "--tokens", "512", "--seq-len", "128")
    assert code == 0, err
    assert "by position in the window" in out and "64-127" in out


def test_encoders_are_compared_on_hidden_states_one_at_a_time(tmp_path):
    config = tf.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=128)
    torch.manual_seed(0)
    tf.BertModel(config).eval().save_pretrained(tmp_path / "a")
    changed = tf.BertModel.from_pretrained(tmp_path / "a")
    with torch.no_grad():
        w = changed.encoder.layer[1].attention.output.dense.weight
        w.add_(0.2 * torch.randn_like(w))
    changed.save_pretrained(tmp_path / "b")
    for folder in ("a", "b"):
        char_tokenizer(tmp_path / folder)
    report = check(tmp_path / "a", tmp_path / "b", tokens=512, spill_bytes=0)
    assert report["compared"] == "last_hidden_state"
    a, b = (tf.BertModel.from_pretrained(tmp_path / f).eval() for f in "ab")
    ids = token_stream(pydoc_texts(), tf.AutoTokenizer.from_pretrained(tmp_path / "a"), 512)
    at_once = compare_models(a, b, ids, 64, 3, causal=False)
    assert report["max_abs_diff"] > 1e-3
    assert report["max_abs_diff"] == pytest.approx(at_once["max_abs_diff"], rel=1e-6)
    assert report["mean_abs_diff"] == pytest.approx(at_once["mean_abs_diff"], rel=1e-6)


def test_spill_store_on_disk_gives_back_the_same_rows_and_cleans_up():
    t = torch.randn(3, 5, 7)
    with SpillStore(expected_bytes=10 << 20, memory_bytes=0) as store:
        assert not store.in_memory and store.folder.is_dir()
        folder = store.folder
        store.put("0", t)
        assert torch.equal(store.get("0"), t)
        assert torch.equal(store.rows("0", 4, 9), t.view(15, 7)[4:9])
    assert not folder.exists()


def test_scratch_space_is_checked_before_the_run(monkeypatch):
    import shutil as sh

    from surgery.checking import spill

    monkeypatch.setattr(spill.shutil, "disk_usage", lambda p: sh._ntuple_diskusage(100, 100, 10))
    with pytest.raises(SurgeryError, match="TMPDIR"):
        SpillStore(expected_bytes=1 << 30, memory_bytes=0)


# --- greedy continuations and per-layer errors ---------------------------------------------------------------------
def test_exact_conversion_agrees_everywhere(models, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def main():\n\nThe attention heads\n")
    report = check(models["src"], models["exact"], generate=6, prompts=str(prompts), layers=True, spill_bytes=0)
    assert report["max_abs_diff"] < 1e-4 and report["top1_agreement"] == 1.0
    g = report["generation"]
    assert g["prompts"] == 8 + 2 and g["new_tokens"] == 6
    assert g["token_agreement"] == 1.0 and g["exact_match_rate"] == 1.0 and g["mean_first_divergence"] == 6
    assert g["forced_agreement"] == 1.0 and sum(b["steps"] for b in g["forced_by_margin"]) == 10 * 6
    assert [s["origin"] for s in g["samples"]][:2] == ["prompts.txt:1", "prompts.txt:3"]
    assert all(s["source"] == s["converted"] for s in g["samples"])
    assert len(report["layers"]) == 2 and report["layers_tokens"] == 1024
    for row in report["layers"]:
        assert row["attention_rel_error"] < 1e-5 and row["hidden_rel_error"] < 1e-5


def test_lossy_conversion_shows_where_it_hurts(models):
    report = check(models["other"], models["lossy"], generate=8, layers=True)
    g = report["generation"]
    assert g["token_agreement"] < 1.0 and g["exact_match_rate"] < 1.0 and g["mean_first_divergence"] < 8
    assert 0 <= g["exact_match_rate"] <= g["token_agreement"]
    # every layer's attention is converted: the error starts at layer 0 and is there in every layer
    for row in report["layers"]:
        assert row["attention_rel_error"] > 1e-3 and row["hidden_rel_error"] > 1e-3
    # the continuations are the models' own greedy ones: argmax after argmax, recomputed without a KV cache here
    tok = tf.AutoTokenizer.from_pretrained(models["other"])
    x = token_stream(pydoc_texts(), tok, 1024)[None, :32]
    for model, key in ((tm.load(models["other"]), "source"), (tm.load(models["lossy"]), "converted")):
        ids = x
        with torch.no_grad():
            for _ in range(8):
                ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
        assert g["samples"][0]["origin"] == "text[0:32]"
        assert g["samples"][0][key] == tok.decode(ids[0, 32:].tolist())


def test_forced_agreement_is_the_converted_argmax_on_the_source_continuations_by_the_source_margin(models):
    report = check(models["other"], models["lossy"], generate=8, prompt_len=20)
    g = report["generation"]
    tok = tf.AutoTokenizer.from_pretrained(models["other"])
    source, lossy = tm.load(models["other"]), tm.load(models["lossy"])
    stream = token_stream(pydoc_texts(), tok, 1024)  # the text `check` cut its prompts from
    prompts = gen.prompts_from_stream(stream, length=20)
    assert [s["origin"] for s in g["samples"]] == [p.origin for p in prompts[:len(g["samples"])]]
    x = torch.tensor([p.ids for p in prompts])
    with torch.no_grad():
        path = torch.cat([x, gen.greedy(source, x, 8)], dim=1)  # the source's continuations, as `check` wrote them
        probs = source(input_ids=path).logits[:, 19:-1].softmax(-1)
        converted = lossy(input_ids=path).logits[:, 19:-1].argmax(-1)
    top2 = probs.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]
    same = converted == path[:, 20:]
    assert g["forced_agreement"] == pytest.approx(same.float().mean().item())
    assert 0 < g["forced_agreement"] < 1  # the lossy conversion disagrees somewhere, not everywhere
    for b in g["forced_by_margin"]:
        lo, hi = b["margin"]
        inside = (margin >= lo) & ((margin < hi) | (hi == 1.0))
        assert b["steps"] == int(inside.sum())
        if b["steps"]:
            assert b["agreement"] == pytest.approx(same[inside].float().mean().item())
    assert sum(b["steps"] for b in g["forced_by_margin"]) == same.numel()


def test_generate_longer_than_the_context_is_refused_before_the_run(models):
    with pytest.raises(SurgeryError, match="context"):
        check(models["src"], models["exact"], generate=200)


# --- tokenizers -----------------------------------------------------------------------------------------------------
def test_different_tokenizers_are_refused_unless_one_is_chosen(models, tmp_path):
    from tokenizers import Tokenizer
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    shuffled = tmp_path / "shuffled"
    shutil.copytree(models["exact"], shuffled)
    for f in shuffled.glob("tokenizer*"):
        f.unlink()
    chars = [chr(c) for c in range(32, 127)][::-1]  # same size, ids in reverse order
    vocab = {"<eos>": 0} | {c: i + 1 for i, c in enumerate(chars)}
    tok = Tokenizer(tok_models.BPE(vocab=vocab, merges=[], unk_token="<eos>"))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<eos>").save_pretrained(shuffled)
    with pytest.raises(SurgeryError, match="tokenizers differ.*--tokenizer source"):
        check(models["src"], shuffled)
    report = check(models["src"], shuffled, tokenizer="source")
    assert "using the source's" in report["tokenizer"] and report["max_abs_diff"] < 1e-4
    converted = check(models["src"], shuffled, tokenizer="converted")
    assert converted["ppl_source"] != pytest.approx(report["ppl_source"])  # other ids: other text for the models


# --- the command line: bad input, trust, pickle -----------------------------------------------------------------------
@pytest.mark.parametrize("option, value", [("--tokens", "0"), ("--tokens", "-3"), ("--seq-len", "0"),
                                           ("--seq-len", "-5"), ("--batch-size", "0"), ("--generate", "-1"),
                                           ("--prompt-len", "0")])
def test_bad_counts_fail_before_any_work(models, capsys, option, value):
    assert_one_line_error(surgery(capsys, "check", models["src"], models["exact"], option, value), option)


def test_prompt_length_reaches_the_check_from_the_command_line(models, capsys, tmp_path):
    code, out, _ = surgery(capsys, "check", models["src"], models["exact"], "--generate", "3", "--prompt-len", "24",
                           "--tokens", "1024", "--seq-len", "64", "--json", tmp_path / "r.json")
    assert code == 0 and "forced agreement" in out
    report = json.loads((tmp_path / "r.json").read_text())
    g = report["generation"]
    assert g["samples"][0]["origin"] == "text[0:24]" and g["forced_agreement"] == 1.0
    card = generation_section([("check", report)])  # the model card's table
    row = next(line for line in card if line.startswith("| check |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:5] == ["8 x 3", "100.0%", "3.0", "100.0%"]
    assert sum(int(c.split(" of ")[1]) for c in cells[5:] if c != "-") == 8 * 3  # every step in one margin bucket
    assert generation_section([("check", {"kl": 0.1})]) == []


def test_prompts_without_generate_is_one_line(models, capsys, tmp_path):
    (tmp_path / "p.txt").write_text("hello\n")
    assert_one_line_error(surgery(capsys, "check", models["src"], models["exact"], "--prompts", tmp_path / "p.txt"),
                          "--prompts needs --generate")


def test_json_into_a_missing_folder_fails_before_the_run(models, capsys, tmp_path):
    result = surgery(capsys, "check", models["src"], models["exact"], "--json", tmp_path / "nope" / "r.json")
    assert_one_line_error(result, "does not exist")  # one line: no progress line, no pass ran


def test_truncated_or_mismatched_converted_checkpoint(models, capsys, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "truncated"
    shutil.copytree(models["exact"], broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    assert_one_line_error(surgery(capsys, "check", models["src"], broken), "truncated")

    shaped = tmp_path / "shaped"
    shutil.copytree(models["exact"], shaped)
    state = load_file(shaped / "model.safetensors")
    state["model.layers.1.self_attn.k_proj.weight"] = state["model.layers.1.self_attn.k_proj.weight"][:8].clone()
    save_file(state, shaped / "model.safetensors", metadata={"format": "pt"})
    assert_one_line_error(surgery(capsys, "check", models["src"], shaped),
                          "model.layers.1.self_attn.k_proj.weight", "does not match its config")


def custom_code_copy(folder: Path, dest: Path, marker: Path) -> Path:
    """A copy of `folder` whose config names a configuration_x.py that writes `marker` when imported."""
    shutil.copytree(folder, dest)
    config = json.loads((dest / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (dest / "config.json").write_text(json.dumps(config))
    (dest / "configuration_x.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import LlamaConfig\nclass XConfig(LlamaConfig):\n    pass\n")
    (dest / "modeling_x.py").write_text(
        "from transformers import LlamaForCausalLM\nfrom .configuration_x import XConfig\n"
        "class XForCausalLM(LlamaForCausalLM):\n    config_class = XConfig\n")
    return dest


def test_each_model_needs_its_own_trust_flag(models, capsys, tmp_path):
    marker = tmp_path / "marker"
    src = custom_code_copy(models["src"], tmp_path / "src-code", marker)
    dst = custom_code_copy(models["exact"], tmp_path / "dst-code", marker)
    assert_one_line_error(surgery(capsys, "check", src, models["exact"]), "--trust-source-code", "configuration_x.py")
    # the converted model's flag does not trust the source
    assert_one_line_error(surgery(capsys, "check", src, models["exact"], "--trust-remote-code"), "--trust-source-code")
    assert_one_line_error(surgery(capsys, "check", models["src"], dst), "--trust-remote-code", "configuration_x.py")
    assert_one_line_error(surgery(capsys, "check", models["src"], dst, "--trust-source-code"), "--trust-remote-code")
    assert not marker.exists()  # no foreign code ran
    code, _, err = surgery(capsys, "check", src, models["exact"], "--trust-source-code", "--tokens", "256",
                           "--seq-len", "64")
    assert code == 0, err
    assert marker.exists()  # the user asked for it


def test_pickle_weights_need_allow_pickle(models, capsys, tmp_path):
    pickled = tmp_path / "pickled"
    shutil.copytree(models["exact"], pickled)
    model = tm.load(pickled)
    (pickled / "model.safetensors").unlink()
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")
    assert_one_line_error(surgery(capsys, "check", models["src"], pickled), "--allow-pickle")
    code, out, err = surgery(capsys, "check", models["src"], pickled, "--allow-pickle", "--tokens", "256",
                             "--seq-len", "64", "--json", "-", "--expect", "exact")
    assert code == 0, err
    assert json.loads(out[out.index("{"):])["max_abs_diff"] < 1e-4


# --- what the user sees -------------------------------------------------------------------------------------------
def test_progress_lines_and_labelled_perplexities(models, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SURGERY_PROGRESS_SECONDS", "0")
    code, out, err = surgery(capsys, "check", models["src"], models["exact"], "--tokens", "512", "--seq-len", "64",
                             "--batch-size", "2", "--json", tmp_path / "r.json")
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.startswith("check ")]
    assert [line.split(":")[0] for line in lines] == ["check source"] * 4 + ["check converted"] * 4
    assert lines[0].startswith("check source: 128/512 tokens (25%), ") and "tokens/s, ETA " in lines[0]
    assert lines[-1].startswith("check converted: 512/512 tokens (100%)")
    assert "perplexity, source (pydoc[0:512], windows 64)" in out
    assert "perplexity, converted (pydoc[0:512], windows 64)" in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["text"] == "pydoc[0:512]" and report["seq_len"] == 64 and report["data"] == "pydoc"


def test_overlap_with_the_calibration_text_is_warned(models, capsys, tmp_path):
    calibrated = tmp_path / "calibrated"
    shutil.copytree(models["exact"], calibrated)
    record = json.loads((calibrated / "surgery.json").read_text())
    first = next(t for t in pydoc_texts() if t)
    record["calibration"] = {"data": "pydoc", "documents_sha256": [document_sha256(first), "0" * 64]}
    (calibrated / "surgery.json").write_text(json.dumps(record))
    code, out, err = surgery(capsys, "check", models["src"], calibrated, "--tokens", "256", "--seq-len", "64",
                             "--json", "-")
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("surgery: warning:")]
    same_domain = ("surgery: warning: pydoc, the only text checked, is the text the model was calibrated on "
                   "(surgery.json): its numbers flatter the conversion; add a --data of another domain")
    assert len(warnings) == 2 and same_domain in warnings  # the same source, and these very documents:
    overlap = next(w for w in warnings if w != same_domain)
    assert "1 of the" in overlap and "calibration" in overlap
    assert json.loads(out[out.index("{"):])["calibration_overlap"]["documents"] == 1

    record["calibration"]["documents_sha256"] = [document_sha256(pydoc_texts()[-1])]  # read from the end only
    (calibrated / "surgery.json").write_text(json.dumps(record))
    code, out, err = surgery(capsys, "check", models["src"], calibrated, "--tokens", "256", "--seq-len", "64")
    assert code == 0 and [line for line in err.splitlines() if "warning" in line] == [same_domain]


# --- several texts in one run ----------------------------------------------------------------------------------------
def tail_text(folder: Path) -> Path:
    """pydoc's last documents in a file: another text than the check's default (pydoc's first documents)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tail.txt"
    path.write_text("\n\n".join(pydoc_texts()[-6:]))
    return path


@pytest.mark.parametrize("spill_bytes", [0, 1 << 30], ids=["scratch-disk", "memory"])
def test_several_texts_are_checked_in_one_run_with_each_texts_own_numbers(models, tmp_path, monkeypatch, spill_bytes):
    from surgery.checking import compare as check_module

    loads = []
    real_load = check_module.load_model
    monkeypatch.setattr(check_module, "load_model", lambda source, *a, **k: loads.append(source.spec) or
                        real_load(source, *a, **k))
    tail = tail_text(tmp_path)
    from surgery.data import load_texts

    report = check(models["other"], models["lossy"], tokens=512, seq_len=128, spill_bytes=spill_bytes, data="pydoc",
                   more_texts=[("tail", load_texts(str(tail)))])
    assert len(loads) == 2  # each model once, for both texts
    first, second = report["texts"]
    assert (first["data"], first["text"], second["data"], second["text"]) == ("pydoc", "pydoc[0:512]", "tail",
                                                                              "tail[0:512]")
    assert first["windows"] == second["windows"] == 4 and len(first["by_position"]) == 2
    for key in METRICS + ("tokens", "windows", "seq_len", "text"):
        assert report[key] == first[key], key  # the top level is the first text
    alone = [check(models["other"], models["lossy"], tokens=512, seq_len=128),
             compare_checkpoints(resolve_source(str(models["other"])), resolve_source(str(models["lossy"])),
                                 load_texts(str(tail)), CheckOptions(data=str(tail), tokens=512, seq_len=128,
                                                                     batch_size=3, device="cpu"), progress=False)]
    for text, single in zip((first, second), alone):  # each text's numbers are those of a check on it alone
        for key in METRICS:
            assert text[key] == pytest.approx(single[key], rel=1e-9, abs=1e-12), key
        assert [r["ppl_converted"] for r in text["by_position"]] == pytest.approx(
            [r["ppl_converted"] for r in single["by_position"]], rel=1e-9)
    assert abs(first["ppl_source"] - second["ppl_source"]) > 0.01  # two different texts


def test_several_texts_from_the_command_line(models, capsys, tmp_path):
    tail = tail_text(tmp_path / "texts")
    code, out, err = surgery(capsys, "check", models["other"], models["lossy"], "--data", "pydoc", "--data", tail,
                             "--tokens", "256", "--seq-len", "64", "--json", tmp_path / "r.json")
    assert code == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    assert [t["text"] for t in report["texts"]] == ["pydoc[0:256]", f"{tail}[0:256]"]
    assert "by text" in out
    for t in report["texts"]:  # a row per text (long paths wrap in the table: its ratio column is read instead)
        assert f"{t['ppl_converted']:.3f} │ {t['ppl_converted'] / t['ppl_source']:.3f}x" in out
    # --expect exact reads every text: the exact pair passes on both, the lossy one fails
    code, _, err = surgery(capsys, "check", models["src"], models["exact"], "--data", "pydoc", "--data", tail,
                           "--tokens", "256", "--seq-len", "64", "--expect", "exact")
    assert code == 0, err
    code, _, err = surgery(capsys, "check", models["other"], models["lossy"], "--data", "pydoc", "--data", tail,
                           "--tokens", "256", "--seq-len", "64", "--expect", "exact")
    assert code == 1 and "not exact" in err


def test_a_bad_second_text_fails_in_one_line_before_any_model(models, capsys, tmp_path, monkeypatch):
    from surgery.checking import compare as check_module

    monkeypatch.setattr(check_module, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    short = tmp_path / "short.txt"
    short.write_text("too short")
    for data, fragment in ((tmp_path / "missing.txt", "does not exist"),
                           (short, f"need at least 64 tokens, the text {short} gave")):
        result = surgery(capsys, "check", models["other"], models["lossy"], "--data", "pydoc", "--data", data,
                         "--tokens", "256", "--seq-len", "64", "--json", tmp_path / "r.json")
        assert_one_line_error(result, fragment)
        assert not (tmp_path / "r.json").exists()


def test_the_model_card_has_a_row_per_text(models, tmp_path):
    from surgery.publish.card import check_section

    tail = tail_text(tmp_path)
    from surgery.data import load_texts

    several = check(models["other"], models["lossy"], tokens=256, more_texts=[(str(tail), load_texts(str(tail)))],
                    data="pydoc")
    one = check(models["other"], models["lossy"], tokens=256, data="pydoc")
    lines = check_section([("domains", several), ("plain", one)])
    rows = [line for line in lines if line.startswith("| domains") or line.startswith("| plain")]
    # a local text by its file name only (no path of this machine on the hub), escaped for Markdown (see card.text)
    assert [r.split(" | ")[0] for r in rows] == ["| domains: pydoc\\[0:256]", f"| domains: {tail.name}\\[0:256]",
                                                 "| plain"]
    assert f"{several['texts'][1]['ppl_converted']:.3f}" in rows[1]


# --- the real model ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_mqa_sequential_check_matches_both_models_at_once(tmp_path):
    source = resolve_source("smollm2")
    convert_to_kv_heads(source, tmp_path / "mqa", MQAOptions(), progress=False)
    report = compare_checkpoints(source, resolve_source(str(tmp_path / "mqa")), pydoc_texts(),
                                 CheckOptions(tokens=2048, seq_len=512, batch_size=2, device="cpu"), progress=False,
                                 spill_bytes=0)
    assert report["scratch"] == "disk"
    a = load_model(source, torch.device("cpu"), "float32")
    b = load_model(resolve_source(str(tmp_path / "mqa")), torch.device("cpu"), "float32")
    from surgery.runtime import load_tokenizer

    ids = token_stream(pydoc_texts(), load_tokenizer(source), 2048)
    at_once = compare_models(a, b, ids, 512, 2, causal=True)
    for key in METRICS:
        assert report[key] == pytest.approx(at_once[key], rel=1e-6), key
    assert 5 < report["ppl_source"] < 40 and report["ppl_converted"] > report["ppl_source"]


@pytest.mark.parametrize("device, fragment", [("gpu", "use auto, cpu, cuda or cuda:N"), ("cuda:7", "cuda:7")])
def test_bad_devices_are_one_line(models, capsys, device, fragment):
    if device.startswith("cuda") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has that many GPUs")
    assert_one_line_error(surgery(capsys, "check", models["src"], models["exact"], "--device", device), fragment)


def test_windows_are_capped_at_the_context_and_at_tokens(models):
    report = check(models["src"], models["exact"], tokens=100, seq_len=1024)
    assert report["seq_len"] == 100 and report["tokens"] == 100 and report["text"] == "pydoc[0:100]"
    report = check(models["src"], models["exact"], tokens=1024, seq_len=1024)
    assert report["seq_len"] == 128 and report["windows"] == 8  # the tiny models' context: 128
