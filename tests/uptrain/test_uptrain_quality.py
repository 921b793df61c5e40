"""Uptraining recipes that close the gap: layer-local attention alignment, LoRA, a larger teacher (tiny models)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file

from surgery.kv.convert import convert_to_kv_heads
from surgery.kv.options import MQAOptions
from surgery.errors import SurgeryError
from surgery.checkpoint.source import resolve_source
from surgery.training import UptrainOptions, uptrain
from surgery.testing.pydoc_llama import FAST, make_model, metrics


@pytest.fixture(scope="module")
def mqa(tiny, tmp_path_factory):
    """`tiny` (4 query heads, 2 K/V heads) pooled to 1 K/V head: surgery.json names `tiny` as its source."""
    out = tmp_path_factory.mktemp("quality") / "mqa"
    convert_to_kv_heads(resolve_source(str(tiny)), out, MQAOptions(), progress=False)
    return out


def run(model, out, **kw) -> dict:
    return uptrain(UptrainOptions(model=str(model), out=out, **(FAST | kw)))


def load(folder):
    return tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def held_out_ids(tokenizer) -> torch.Tensor:
    """Two windows of 64 tokens from the first pydoc documents: the runs' held-out split (eval_tokens=1024)."""
    from surgery.data import pydoc_texts

    ids = tokenizer("".join(pydoc_texts()[:3]))["input_ids"][:128]
    return torch.tensor(ids).view(2, 64)


@torch.no_grad()
def attention_errors(teacher, students, ids) -> list[list[float]]:
    """Per layer, per student: mean squared error of the student's attention output to the teacher's on the
    teacher's attention inputs, over the variance of the teacher's output."""
    captured = []
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, kw, out: captured.append((a, kw, out[0])), with_kwargs=True)
             for layer in teacher.model.layers]
    teacher(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    errors = []
    for i, (args, kwargs, target) in enumerate(captured):
        errors.append([((s.model.layers[i].self_attn(*args, **kwargs)[0] - target).pow(2).mean() / target.var()).item()
                       for s in students])
    return errors


# ------------------------------------------------------------------------------------------------------- align


def test_align_reduces_each_layers_attention_error_on_held_out_tokens(tiny, mqa, tokenizer, tmp_path):
    rec = run(mqa, tmp_path / "aligned", stage="align", tokens=512 * 2, align_epochs=8, align_lr=3e-3)
    assert rec["stage"] == "align" and rec["steps"] == 0 and rec["loss"] is None
    align = rec["align"]
    assert align["tokens"] == 1024 and len(align["layers"]) == 2
    assert all(layer["after"] < layer["before"] for layer in align["layers"])
    record = json.loads((tmp_path / "aligned" / "surgery.json").read_text())
    assert record["uptraining"]["align"]["layers"] == align["layers"]
    # Measured again here, on held-out tokens, with the source's attention inputs fed to both students.
    errors = attention_errors(load(tiny), [load(mqa), load(tmp_path / "aligned")], held_out_ids(tokenizer))
    for before, after in errors:
        assert before > 1e-3 and after < 0.8 * before
    # Only attention parameters moved.
    old, new = load_file(mqa / "model.safetensors"), load_file(tmp_path / "aligned" / "model.safetensors")
    moved = {k for k in old if not torch.equal(old[k], new[k])}
    assert moved and all(".self_attn." in k for k in moved)


def test_align_then_kd_splits_the_token_budget(mqa, tmp_path):
    rec = run(mqa, tmp_path / "o", stage="align,kd", tokens=512 * 4, align_tokens=512)
    assert rec["tokens"] == 2048 and rec["kd_tokens"] == 1536 and rec["steps"] == 3 and rec["align"]["tokens"] == 512
    assert rec["loss"] == "kd" and rec["teacher"] == "surgery.json source"
    assert all(layer["after"] < layer["before"] for layer in rec["align"]["layers"])


def test_align_refuses_a_teacher_with_other_layers(mqa, tokenizer, tmp_path):
    big = make_sibling(tmp_path / "big", tokenizer)
    with pytest.raises(SurgeryError, match="needs a teacher with the student's layers"):
        run(mqa, tmp_path / "o", stage="align", teacher=str(big), tokens=512)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("bad, message", [
    (dict(stage="kd,align"), "unknown --stage"), (dict(stage="align", align_tokens=99999), "--align-tokens"),
    (dict(lora_targets="q_proj"), "needs --lora-rank"), (dict(lora_rank=-1), "--lora-rank")])
def test_bad_stage_and_lora_options_are_refused(bad, message, tmp_path):
    with pytest.raises(SurgeryError, match=message):
        UptrainOptions(model="x", out=tmp_path / "o", tokens=1024, **bad)


# -------------------------------------------------------------------------------------------------------- LoRA


def tensor_shapes(folder) -> dict:
    return {k: tuple(v.shape) for k, v in load_file(folder / "model.safetensors").items()}


LORA = dict(loss="lm", tokens=512 * 3, lora_rank=4)


def test_lora_merged_is_a_standard_checkpoint_that_trained(mqa, tmp_path):
    pytest.importorskip("peft")
    rec = run(mqa, tmp_path / "merged", **LORA)
    out = tmp_path / "merged"
    assert rec["lora"]["rank"] == 4 and rec["lora"]["merged"] and rec["lora"]["modules"] == 2 * 4  # q, k, v, o x 2
    assert tensor_shapes(out) == tensor_shapes(mqa) and not (out / "adapter").exists()
    ids = torch.arange(40)[None] % 300
    before, after = load(mqa)(ids).logits, load(out)(ids).logits  # plain transformers, no peft
    assert (before - after).abs().max() > 1e-3
    old, new = load_file(mqa / "model.safetensors"), load_file(out / "model.safetensors")
    moved = {k for k in old if not torch.equal(old[k], new[k])}
    assert moved and all(k.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "o_proj") for k in moved)


def test_lora_unmerged_adapter_loads_in_peft_with_the_merged_logits(mqa, tmp_path):
    peft = pytest.importorskip("peft")
    run(mqa, tmp_path / "merged", **LORA)
    rec = run(mqa, tmp_path / "unmerged", merge_lora=False, **LORA)
    out = tmp_path / "unmerged"
    assert rec["lora"]["adapter"] == "adapter" and (out / "adapter" / "adapter_config.json").exists()
    assert load_file(out / "model.safetensors").keys() == load_file(mqa / "model.safetensors").keys()
    ids = torch.arange(40)[None] % 300
    base = load(out)
    torch.testing.assert_close(base(ids).logits, load(mqa)(ids).logits)  # the output keeps the input's weights
    with_adapter = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
    torch.testing.assert_close(with_adapter(ids).logits, load(tmp_path / "merged")(ids).logits, rtol=1e-4, atol=1e-4)


def test_lora_targets_pick_modules_and_refuse_unknown_ones(mqa, tmp_path):
    pytest.importorskip("peft")
    rec = run(mqa, tmp_path / "o", lora_targets="mlp.down_proj", **LORA)
    assert rec["lora"]["modules"] == 2
    old, new = load_file(mqa / "model.safetensors"), load_file(tmp_path / "o" / "model.safetensors")
    assert {k for k in old if not torch.equal(old[k], new[k])} == {f"model.layers.{i}.mlp.down_proj.weight" for i in (0, 1)}
    with pytest.raises(SurgeryError, match="matches no nn.Linear"):
        run(mqa, tmp_path / "p", lora_targets="nothing_here", **LORA)


# ----------------------------------------------------------------------------------------------------- teacher


def make_sibling(folder, tokenizer):
    """A larger model with the same tokenizer: 3 layers of width 96."""
    return make_model(folder, tokenizer, seed=5, hidden=96, intermediate=160, layers=3)


def test_a_larger_teacher_is_used_and_recorded(mqa, tokenizer, tmp_path):
    big = make_sibling(tmp_path / "big", tokenizer)
    rec = run(mqa, tmp_path / "o", loss="kd", teacher=str(big), tokens=512)
    assert rec["teacher"] == big.name  # the public name: no machine path in the record
    assert json.loads((tmp_path / "o" / "surgery.json").read_text())["uptraining"]["teacher"] == big.name
    own = run(mqa, tmp_path / "p", loss="kd", tokens=512)  # the source as teacher: another perplexity
    assert rec["teacher_eval_ppl"] != pytest.approx(own["teacher_eval_ppl"], rel=1e-3)


# --------------------------------------------------------------------------------------------------------- CLI


def test_cli_runs_align_then_kd_with_unmerged_lora(mqa, tmp_path, monkeypatch):
    pytest.importorskip("peft")
    import sys

    import cli
    from inprocess import cli_args

    out = tmp_path / "o"
    args = cli_args(FAST | dict(tokens=512 * 3, align_tokens=512, lora_rank=2, lora_targets="q_proj,v_proj"))
    monkeypatch.setattr(sys, "argv", ["surgery", "uptrain", str(mqa), "--out", str(out), "--stage", "align,kd",
                                      "--no-merge-lora", *args])
    try:
        cli.main()
    except SystemExit as e:
        assert e.code in (0, None)
    rec = json.loads((out / "surgery.json").read_text())["uptraining"]
    assert rec["stage"] == "align,kd" and rec["align"]["tokens"] == 512 and rec["kd_tokens"] == 1024
    assert rec["lora"] == {"rank": 2, "alpha": 4, "targets": "q_proj,v_proj", "modules": 4, "merged": False,
                           "adapter": "adapter"}
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 2 and sorted(config["target_modules"]) == sorted(
        f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "v_proj"))


def test_lora_without_peft_is_one_clear_line(mqa, tmp_path, monkeypatch, capsys):
    import sys

    from inprocess import uptrain_error as cli_error

    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    err = cli_error(monkeypatch, capsys, mqa, "--out", tmp_path / "o", "--tokens", 512, "--seq-len", 64, "--lora-rank", 4)
    assert "needs peft" in err and "[lora]" in err and not (tmp_path / "o").exists()


def test_align_keeps_the_old_weights_of_a_layer_whose_validation_error_rose(mqa, tmp_path):
    rec = run(mqa, tmp_path / "o", stage="align", tokens=512 * 2, align_epochs=2, align_lr=0.3)
    layers = rec["align"]["layers"]
    assert [layer["kept"] for layer in layers] == [False, False]  # Adam at lr 0.3 overshoots on every layer
    old, new = load_file(mqa / "model.safetensors"), load_file(tmp_path / "o" / "model.safetensors")
    assert all(torch.equal(old[k], new[k]) for k in old)
    assert all(layer["after"] == pytest.approx(layer["before"], rel=1e-6) for layer in layers)


def test_align_and_lora_work_on_a_talking_heads_conversion(tiny, tmp_path):
    pytest.importorskip("peft")
    from surgery.talking_heads import convert_to_talking_heads
    from surgery.talking_heads.options import TalkingHeadsOptions

    th = tmp_path / "th"
    convert_to_talking_heads(resolve_source(str(tiny)), th, TalkingHeadsOptions(), progress=False)
    rec = run(th, tmp_path / "o", stage="align,kd", tokens=512 * 3, align_tokens=1024, align_lr=3e-3, lora_rank=2)
    assert rec["lora"]["modules"] == 2 * 4 and len(rec["align"]["layers"]) == 2
    # The conversion starts exact (identity mixing): nothing to align, and no layer is made worse.
    assert all(layer["before"] < 1e-10 and layer["after"] <= layer["before"] + 1e-12 for layer in rec["align"]["layers"])
    assert tensor_shapes(tmp_path / "o") == tensor_shapes(th)
    old, new = load_file(th / "model.safetensors"), load_file(tmp_path / "o" / "model.safetensors")
    moved = {k for k in old if not torch.equal(old[k], new[k])}  # the LoRA-trained projections, merged
    assert moved and all(k.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "o_proj") for k in moved)


def test_the_record_starts_from_the_perplexity_before_alignment(mqa, tmp_path):
    rec = run(mqa, tmp_path / "o", stage="align", tokens=512, align_lr=3e-3)
    assert rec["initial_eval_ppl"] == rec["align"]["eval_ppl_before"]
    assert rec["final_eval_ppl"] == pytest.approx(rec["align"]["eval_ppl"], rel=1e-6)  # metrics keep 7 digits
    assert rec["final_eval_ppl"] < 0.999 * rec["initial_eval_ppl"]


# ---------------------------------------------------------------------------------------------- hidden states


def test_hidden_state_loss_is_each_layers_cosine_distance_without_the_embeddings():
    from surgery.training.losses import hidden_state_loss

    torch.manual_seed(0)
    teacher = tuple(torch.randn(2, 5, 8) * (i + 1) for i in range(4))  # embeddings, then 3 layers' outputs
    assert hidden_state_loss(teacher, teacher).abs().item() < 1e-6
    student = tuple(t + 0.5 * torch.randn_like(t) for t in teacher)
    expect = sum((1 - (s * t).sum(-1) / (s.norm(dim=-1) * t.norm(dim=-1))).mean()
                 for s, t in zip(student[1:], teacher[1:])) / 3
    torch.testing.assert_close(hidden_state_loss(student, teacher), expect)
    assert expect > 0.01
    moved_embeddings = (student[0] + 5.0, *student[1:])
    torch.testing.assert_close(hidden_state_loss(moved_embeddings, teacher), expect)
    # One position whose activation is 1000x larger in the student (a massive activation at another place than the
    # teacher's) counts as one position: the loss stays bounded by 2 per position.
    scale = torch.ones(2, 5, 1)
    scale[0, 0] = 1000.0
    loud = hidden_state_loss(tuple(s * scale for s in student), teacher)
    torch.testing.assert_close(loud, expect)
    opposite = hidden_state_loss(tuple(-t for t in teacher), teacher)
    torch.testing.assert_close(opposite, torch.tensor(2.0))


@torch.no_grad()
def held_out_hidden_error(teacher, student, ids) -> float:
    from surgery.training.losses import hidden_state_loss

    return hidden_state_loss(student(input_ids=ids, output_hidden_states=True).hidden_states,
                             teacher(input_ids=ids, output_hidden_states=True).hidden_states).item()


def test_hidden_weight_pulls_every_layer_toward_the_teacher_on_held_out_tokens(tiny, mqa, tokenizer, tmp_path):
    kd = run(mqa, tmp_path / "kd", loss="kd", tokens=512 * 8, lr=1e-3)
    both = run(mqa, tmp_path / "both", loss="kd", tokens=512 * 8, lr=1e-3, hidden_weight=10.0)
    assert kd["hidden_weight"] is None and both["hidden_weight"] == 10.0
    assert json.loads((tmp_path / "both" / "surgery.json").read_text())["uptraining"]["hidden_weight"] == 10.0
    rows = metrics(tmp_path / "both")
    logged = [r for r in rows if "hidden_loss" in r]
    assert len(logged) == 8 and all(r["loss"] > r["kd_loss"] for r in logged)
    teacher, ids = load(tiny), held_out_ids(tokenizer)
    before = held_out_hidden_error(teacher, load(mqa), ids)
    after_kd = held_out_hidden_error(teacher, load(tmp_path / "kd"), ids)
    after_both = held_out_hidden_error(teacher, load(tmp_path / "both"), ids)
    # (measured: 0.066 before, 0.064 after KD alone, 0.052 with the hidden-state term)
    assert after_both < 0.9 * min(before, after_kd)


def test_hidden_weight_refuses_a_teacher_with_other_layers_and_negative_weights(mqa, tokenizer, tmp_path):
    big = make_sibling(tmp_path / "big", tokenizer)
    with pytest.raises(SurgeryError, match="--hidden-weight needs a teacher with the student's layers"):
        run(mqa, tmp_path / "o", teacher=str(big), tokens=512, hidden_weight=1.0)
    assert not (tmp_path / "o").exists()
    with pytest.raises(SurgeryError, match="--hidden-weight must not be negative"):
        UptrainOptions(model="x", out=tmp_path / "o", tokens=1024, hidden_weight=-1.0)


# ------------------------------------------------------------------------------------------- a second held-out text


def other_domain_text() -> str:
    """Text of another domain than pydoc's topics: the docstrings of a few standard-library modules."""
    import argparse
    import collections
    import decimal
    import email
    import json as json_module
    import logging

    return "\n\n".join(m.__doc__ for m in (argparse, collections, decimal, email, json_module, logging) if m.__doc__)


@torch.no_grad()
def perplexity(folder, windows: torch.Tensor) -> float:
    logits = load(folder)(input_ids=windows).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), windows[:, 1:].flatten()).exp().item()


def test_eval_data_is_a_second_held_out_text_measured_for_the_student_and_the_teacher(tiny, mqa, tokenizer, tmp_path):
    text = tmp_path / "other.txt"
    text.write_text(other_domain_text())
    rec = run(mqa, tmp_path / "o", loss="mix", tokens=512 * 3, eval_data=str(text), eval_every=1, txt_unit="file")
    # The first 1,024 tokens of the file (one document, then EOS) in windows of 64, computed here independently.
    ids = tokenizer(text.read_text(), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    windows = torch.tensor(ids[:1024]).view(16, 64)
    assert rec["eval_data"] == str(text)
    assert rec["initial_other_eval_ppl"] == pytest.approx(perplexity(mqa, windows), rel=1e-5)
    assert rec["final_other_eval_ppl"] == pytest.approx(perplexity(tmp_path / "o", windows), rel=1e-5)
    assert rec["teacher_other_eval_ppl"] == pytest.approx(perplexity(tiny, windows), rel=1e-5)
    assert rec["final_other_eval_ppl"] != pytest.approx(rec["final_eval_ppl"], rel=1e-3)  # another text than pydoc's
    rows = metrics(tmp_path / "o")
    evals = [r for r in rows if "eval_ppl" in r]
    assert [r["step"] for r in evals] == [0, 1, 2, 3] and all("other_eval_ppl" in r for r in evals)
    record = json.loads((tmp_path / "o" / "surgery.json").read_text())
    assert record["uptraining"]["final_other_eval_ppl"] == rec["final_other_eval_ppl"]
    from surgery.publish.card import uptraining_section
    from surgery.publish.validate import Validation

    card = "\n".join(uptraining_section(Validation(tmp_path / "o", {}, record)))
    assert f"| second held-out text (--eval-data) | {text.name} |" in card  # by its name: no machine path
    assert str(text.parent) not in card
    assert f"| its perplexity after | {rec['final_other_eval_ppl']:.3f} |" in card


def test_eval_data_before_an_alignment_is_the_models_perplexity_before_it(mqa, tokenizer, tmp_path):
    text = tmp_path / "other.txt"
    text.write_text(other_domain_text())
    rec = run(mqa, tmp_path / "o", stage="align,kd", tokens=512 * 2, align_tokens=512, eval_data=str(text),
              txt_unit="file")  # the text as one document, as the windows below are cut
    ids = tokenizer(text.read_text(), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    windows = torch.tensor(ids[:1024]).view(16, 64)
    assert rec["initial_other_eval_ppl"] == pytest.approx(perplexity(mqa, windows), rel=1e-5)
    assert rec["align"]["other_eval_ppl_before"] == rec["initial_other_eval_ppl"]
    assert rec["final_other_eval_ppl"] == pytest.approx(perplexity(tmp_path / "o", windows), rel=1e-5)


def test_eval_data_survives_the_data_cache_that_resume_reads(tokenizer, tmp_path):
    from surgery.training.data import PackedData, pack_held_out, read_cache, write_cache

    other = pack_held_out([other_domain_text()], tokenizer, 64, 1000)
    assert other.shape == (16, 64)  # 1,000 tokens rounded up to whole windows
    data = PackedData(torch.arange(640, dtype=torch.int32).view(10, 64), torch.zeros(2, 64, dtype=torch.int32),
                      other=other)
    write_cache(tmp_path / "c", "k", data)
    back = read_cache(tmp_path / "c", "k", seed=0)
    assert torch.equal(back.other, other) and torch.equal(back.train, data.train)
    write_cache(tmp_path / "d", "k", PackedData(data.train, data.eval))
    assert read_cache(tmp_path / "d", "k", seed=0).other is None


def test_eval_data_too_short_or_without_held_out_tokens_is_refused(mqa, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("A few words only.")
    with pytest.raises(SurgeryError, match="--eval-data holds only .* tokens, fewer than --eval-tokens 1024"):
        run(mqa, tmp_path / "o", tokens=512, eval_data=str(short))
    with pytest.raises(SurgeryError, match="--eval-data needs held-out tokens"):
        run(mqa, tmp_path / "o", tokens=512, eval_data=str(short), eval_tokens=0)
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.run").exists()
