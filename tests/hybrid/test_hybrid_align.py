"""`uptrain --stage align` on a `--to hybrid` output: each Mamba-2 mixer is trained alone to reproduce the source
layer's attention output from the same normed input; the layers kept as attention (the source's, copied exactly) are
skipped; everything but the mixers stays bit-identical, and the output is still a standard Bamba checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file

from surgery.checkpoint.source import resolve_source
from surgery.errors import SurgeryError
from surgery.hybrid import convert_to_hybrid
from surgery.hybrid.options import HybridOptions
from surgery.testing.pydoc_llama import FAST, make_model
from surgery.training import UptrainOptions, uptrain

ALIGN = dict(stage="align", tokens=1024, align_epochs=8, align_lr=3e-3)


@pytest.fixture(scope="module")
def source(tokenizer, tmp_path_factory):
    """The pydoc tiny Llama with 3 layers."""
    return make_model(tmp_path_factory.mktemp("hybrid-align") / "src", tokenizer, layers=3)


@pytest.fixture(scope="module")
def hybrid(source, tmp_path_factory):
    """`source` with layer 1 kept as attention, layers 0 and 2 Mamba-2 mixers. Their scan in chunks of 64 (the
    windows' length) rather than Bamba's 256: the same sums, without padding every window to 256 tokens."""
    out = tmp_path_factory.mktemp("hybrid-align") / "hyb"
    convert_to_hybrid(resolve_source(str(source)), out,
                      HybridOptions(attention_layers="[1]", calib=["pydoc"], calib_tokens=128, calib_window=32),
                      progress=False)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"mamba_chunk_size": 64}))
    return out


def run(model, out, **kw) -> dict:
    return uptrain(UptrainOptions(model=str(model), out=out, **(FAST | kw)))


def load(folder):
    return tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def held_out_ids(tokenizer) -> torch.Tensor:
    """Two windows of 64 tokens from the first pydoc documents: inside the runs' held-out split (eval_tokens=1024)."""
    from surgery.data import pydoc_texts

    ids = tokenizer("".join(pydoc_texts()[:3]))["input_ids"][:128]
    return torch.tensor(ids).view(2, 64)


@torch.no_grad()
def mixer_errors(teacher, students, ids, layers) -> dict[int, list[float]]:
    """Per mixer layer, per student: mean squared error of the student's mixer output to the teacher's attention
    output, both from the normed input the teacher's attention received, over the variance of the teacher's output."""
    captured = {}
    hooks = [teacher.model.layers[i].self_attn.register_forward_hook(
        lambda m, a, kw, out, i=i: captured.__setitem__(i, (kw["hidden_states"], out[0])), with_kwargs=True)
        for i in layers]
    teacher(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    return {i: [((s.model.layers[i].mamba(hidden_states=x) - target).pow(2).mean() / target.var()).item()
                for s in students] for i, (x, target) in captured.items()}


def test_align_trains_the_mixers_alone_and_skips_the_kept_attention(source, hybrid, tokenizer, tmp_path):
    assert json.loads((hybrid / "surgery.json").read_text())["hybrid"]["mixer_layers"] == [0, 2]
    rec = run(hybrid, tmp_path / "aligned", **ALIGN)
    layers = rec["align"]["layers"]
    assert [(layer["layer"], layer["module"]) for layer in layers] == [(0, "mixer"), (1, "attention"), (2, "mixer")]
    assert "skipped" in layers[1] and "before" not in layers[1]
    for layer in (layers[0], layers[2]):
        assert layer["kept"] and layer["after"] < 0.9 * layer["before"]
    # Measured again here on held-out text: the source's attention inputs fed to the mixers before and after.
    errors = mixer_errors(load(source), [load(hybrid), load(tmp_path / "aligned")], held_out_ids(tokenizer), [0, 2])
    for before, after in errors.values():
        assert before > 0.5 and after < 0.85 * before
    # Only the mixers moved; the kept attention, MLPs, norms and embeddings are bit-identical.
    old, new = load_file(hybrid / "model.safetensors"), load_file(tmp_path / "aligned" / "model.safetensors")
    assert old.keys() == new.keys()
    moved = {k for k in old if not torch.equal(old[k], new[k])}
    assert {k.split(".mamba.")[0] for k in moved} == {"model.layers.0", "model.layers.2"}
    assert all(".mamba." in k for k in moved)
    # Still a standard Bamba checkpoint.
    config = json.loads((tmp_path / "aligned" / "config.json").read_text())
    assert config["model_type"] == "bamba" and config["attn_layer_indices"] == [1]
    model = load(tmp_path / "aligned")
    assert type(model).__name__ == "BambaForCausalLM"
    assert torch.isfinite(model(input_ids=held_out_ids(tokenizer)).logits).all()


@pytest.mark.slow
def test_align_then_kd_with_train_new_moves_only_the_mixers(hybrid, tmp_path):
    rec = run(hybrid, tmp_path / "o", **(ALIGN | dict(stage="align,kd", tokens=512 * 3, align_tokens=1024,
                                                       align_epochs=2, train="new")))
    assert rec["loss"] == "kd" and rec["steps"] == 1 and rec["align"]["tokens"] == 1024
    assert [layer.get("skipped") is not None for layer in rec["align"]["layers"]] == [False, True, False]
    old, new = load_file(hybrid / "model.safetensors"), load_file(tmp_path / "o" / "model.safetensors")
    moved = {k for k in old if not torch.equal(old[k], new[k])}
    assert moved and all(".mamba." in k for k in moved)


def test_align_on_a_hybrid_refuses_a_teacher_with_other_layers(hybrid, tokenizer, tmp_path):
    other = make_model(tmp_path / "other", tokenizer, layers=2)
    with pytest.raises(SurgeryError, match="needs a teacher with the student's layers"):
        run(hybrid, tmp_path / "o", **(ALIGN | dict(teacher=str(other))))
    assert not (tmp_path / "o").exists()


def test_align_refuses_a_teacher_without_attention_in_every_layer(hybrid, tmp_path):
    with pytest.raises(SurgeryError, match="the teacher's layer 0 .* has no attention to reproduce"):
        run(hybrid, tmp_path / "o", **(ALIGN | dict(teacher=str(hybrid))))
    assert not (tmp_path / "o").exists()
