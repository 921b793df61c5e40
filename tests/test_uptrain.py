"""Uptraining on tiny random Llama models with a small BPE tokenizer trained on pydoc text."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from safetensors.torch import load_file

from surgery.convert_kv import KVOptions, convert_to_kv_heads
from surgery.source import resolve_source
from surgery.uptrain import UptrainOptions, uptrain
from surgery.uptrain.losses import kd_loss, lm_loss
from surgery.uptrain.params import select_trainable

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# A short run: 64-token windows, 8 windows (512 tokens) per optimizer step.
FAST = dict(data="pydoc", seq_len=64, batch_tokens=512, micro_batch=4, eval_tokens=1024, eval_every=0, save_every=0,
            lr=3e-3, progress=False)


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from surgery.data import pydoc_texts

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(pydoc_texts(), trainer)
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def make_model(folder: Path, tokenizer, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    config = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    return make_model(tmp_path_factory.mktemp("uptrain") / "tiny", tokenizer)


@pytest.fixture(scope="module")
def tiny_mqa(tiny, tmp_path_factory):
    """The tiny model converted to MQA by mean pooling: surgery.json names `tiny` as its source."""
    out = tmp_path_factory.mktemp("uptrain") / "tiny-mqa"
    convert_to_kv_heads(resolve_source(str(tiny)), out, KVOptions(kv_heads=1), progress=False)
    return out


def run(model, out, **kw) -> dict:
    return uptrain(UptrainOptions(model=str(model), out=out, **(FAST | kw)))


def metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "uptrain_metrics.jsonl").read_text().splitlines()]


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def load(folder: Path):
    return tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


# ---------------------------------------------------------------------------------------------------- losses


def test_kd_loss_is_zero_for_identical_logits_and_matches_kl_otherwise():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    assert kd_loss(a, a.clone(), temperature=2.0).item() == 0.0
    for t in (1.0, 2.0):
        p = F.softmax(b.double() / t, -1)  # teacher b, student a
        expected = (p * (p.log() - F.log_softmax(a.double() / t, -1))).sum(-1).mean() * t * t
        assert kd_loss(a, b, temperature=t).item() == pytest.approx(expected.item(), rel=1e-5)
    ids = torch.randint(0, 11, (2, 5), generator=g)
    manual = -F.log_softmax(a[:, :-1], -1).gather(-1, ids[:, 1:, None]).mean()
    assert lm_loss(a, ids).item() == pytest.approx(manual.item(), rel=1e-6)


def test_kd_run_with_student_as_its_own_teacher_has_zero_loss_and_changes_nothing(tiny, tmp_path):
    rec = run(tiny, tmp_path / "o", loss="kd", teacher=str(tiny), tokens=1024, weight_decay=0.0)
    rows = [m for m in metrics(tmp_path / "o") if "loss" in m]
    assert rec["loss"] == "kd" and len(rows) == 2
    assert all(m["kd_loss"] == 0.0 and m["grad_norm"] == 0.0 for m in rows)
    before, after = weights(tiny), weights(tmp_path / "o")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


# ----------------------------------------------------------------------------------------------- training


def test_lm_loss_decreases_and_the_output_is_a_complete_checkpoint(tiny, tmp_path):
    out = tmp_path / "o"
    rec = run(tiny, out, loss="lm", tokens=512 * 12, eval_every=4)
    rows = metrics(out)
    train = [m["loss"] for m in rows if "loss" in m]
    evals = [m for m in rows if "eval_ppl" in m]
    assert len(train) == 12 and [m["step"] for m in evals] == [0, 4, 8, 12]
    assert sum(train[-3:]) / 3 < sum(train[:3]) / 3 - 0.3
    assert evals[-1]["eval_ppl"] < 0.7 * evals[0]["eval_ppl"]
    # The output: loadable, trained, with tokenizer, record, metrics and plot; the run folder is gone.
    assert rec["final_eval_ppl"] == evals[-1]["eval_ppl"] and rec["tokens"] == 512 * 12 and rec["steps"] == 12
    record = json.loads((out / "surgery.json").read_text())
    assert record["uptraining"]["final_eval_ppl"] == evals[-1]["eval_ppl"] and record["uptraining"]["loss"] == "lm"
    assert (out / "uptrain.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "tokenizer.json").exists() and not (tmp_path / "o.run").exists()
    before, after = weights(tiny), weights(out)
    assert before.keys() == after.keys() and all(after[k].dtype == before[k].dtype for k in before)
    assert not torch.equal(before["model.layers.0.self_attn.q_proj.weight"], after["model.layers.0.self_attn.q_proj.weight"])
    assert torch.isfinite(load(out)(input_ids=torch.arange(64)[None]).logits).all()


def sorted_pydoc() -> list[str]:
    from surgery.data import pydoc_texts

    return pydoc_texts()


def test_kd_is_the_default_for_a_converted_model_and_uses_its_source_as_teacher(tiny, tiny_mqa, tmp_path):
    out = tmp_path / "o"
    rec = run(tiny_mqa, out, tokens=512 * 6, eval_every=3, keep_run_dir=True)
    assert rec["loss"] == "kd" and rec["teacher"] == "surgery.json source"
    # The teacher's held-out perplexity equals the source model's, recomputed on the run's held-out windows.
    held_out = torch.load(tmp_path / "o.run" / "data.pt", weights_only=True)["eval"].long()
    with torch.no_grad():
        nll = load(tiny)(input_ids=held_out, labels=held_out).loss.item()
    assert rec["teacher_eval_ppl"] == pytest.approx(math.exp(nll), rel=1e-4)
    assert rec["initial_eval_ppl"] != pytest.approx(rec["teacher_eval_ppl"], rel=1e-3)  # the conversion changed it
    kd = [m["kd_loss"] for m in metrics(out) if "kd_loss" in m]
    assert kd[-1] < kd[0]
    record = json.loads((out / "surgery.json").read_text())
    assert record["kind"] == "mqa" and record["source"]["folder"] == str(tiny.absolute())  # the input's record kept
    assert load(out).config.num_key_value_heads == 1


def test_train_selection_freezes_the_rest(tiny, tmp_path):
    folder = tmp_path / "marked"
    folder.mkdir()
    for f in tiny.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    (folder / "surgery.json").write_text(json.dumps({"kind": "test", "new_parameters": ["layers.*.self_attn.o_proj.weight"]}))
    run(folder, tmp_path / "new", train="new", tokens=1024, loss="lm")
    run(folder, tmp_path / "attn", train="attention", tokens=1024, loss="lm")
    before = weights(tiny)
    for name, trained in (("new", lambda k: ".o_proj." in k), ("attn", lambda k: ".self_attn." in k)):
        after = weights(tmp_path / name)
        changed = {k for k in before if not torch.equal(before[k], after[k])}
        assert changed == {k for k in before if trained(k)}, name
    model = load(tiny)
    assert select_trainable(model, "all", {}) == [n for n, _ in model.named_parameters()]
    with pytest.raises(Exception, match="introduced no new parameters"):
        select_trainable(model, "new", {"kind": "mqa"})
    with pytest.raises(Exception, match="no parameter matching"):
        select_trainable(model, "new", {"new_parameters": ["layers.*.self_attn.mixer"]})


# ------------------------------------------------------------------------------------- processes and resume


def test_two_processes_give_the_same_result_as_one(tiny, tmp_path):
    """accelerate launch with 2 CPU processes (DDP over gloo) vs 1 process with the same global batch."""
    args = dict(loss="lm", tokens=512 * 4)
    run(tiny, tmp_path / "one", **args)  # 1 process: 2 micro-batches of 4 per step
    cmd = [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "cli", "uptrain", str(tiny), "--out",
           str(tmp_path / "two"), "--tokens", str(args["tokens"]), "--loss", "lm", *cli_args(FAST)]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 process(es) x 1 micro-batch(es) of 4" in result.stdout
    one, two = weights(tmp_path / "one"), weights(tmp_path / "two")
    for k in one:
        torch.testing.assert_close(two[k], one[k], atol=1e-4, rtol=1e-4)
    assert not torch.equal(one["model.norm.weight"], weights(tiny)["model.norm.weight"])
    loss_one = [m["loss"] for m in metrics(tmp_path / "one") if "loss" in m]
    loss_two = [m["loss"] for m in metrics(tmp_path / "two") if "loss" in m]
    assert loss_two == pytest.approx(loss_one, rel=1e-5)


def cli_args(options: dict) -> list[str]:
    out = []
    for k, v in options.items():
        if k != "progress":
            out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def test_sigkill_and_resume_gives_bitwise_identical_weights(tiny, tmp_path):
    args = dict(FAST, loss="lm", tokens=512 * 24, save_every=2, keep_last=2, eval_every=5)
    run(tiny, tmp_path / "straight", **args)
    cmd = [sys.executable, "-m", "cli", "uptrain", str(tiny), "--out", str(tmp_path / "killed"), *cli_args(args)]
    ckpts = tmp_path / "killed.run" / "checkpoints"
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while not (ckpts.is_dir() and len([p for p in ckpts.iterdir() if p.name.startswith("step-")]) >= 2):
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "log").read_text()[-2000:]
            time.sleep(0.01)
        time.sleep(0.15)  # somewhere in the next steps, possibly while a checkpoint is being written
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
    assert not (tmp_path / "killed").exists()
    result = subprocess.run(cmd + ["--resume"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = int(result.stdout.split("resumed at step ")[1].split()[0])
    assert 4 <= resumed < 24
    straight, killed = weights(tmp_path / "straight"), weights(tmp_path / "killed")
    assert straight.keys() == killed.keys() and all(torch.equal(straight[k], killed[k]) for k in straight)
    steps = [m["step"] for m in metrics(tmp_path / "killed") if "loss" in m]
    assert steps == list(range(1, 25))  # lines past the checkpoint were dropped, none repeated


# ------------------------------------------------------------------------------------------------ bad input


def cli_error(monkeypatch, capsys, *args) -> str:
    import cli

    monkeypatch.setattr(sys, "argv", ["surgery", "uptrain", *map(str, args)])
    with pytest.raises(SystemExit) as e:
        cli.main()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("surgery: error: "), err
    return err[0]


def test_bad_inputs_exit_2_with_one_line(tiny, tiny_mqa, tokenizer, tmp_path, monkeypatch, capsys):
    out = ["--out", tmp_path / "o", "--seq-len", "64", "--batch-tokens", "512", "--eval-tokens", "256"]
    assert "does not exist" in cli_error(monkeypatch, capsys, tiny, "--data", tmp_path / "none.jsonl", "--tokens", 512, *out)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert "no text" in cli_error(monkeypatch, capsys, tiny, "--data", empty, "--tokens", 512, *out)
    assert "longer than the context" in cli_error(monkeypatch, capsys, tiny, "--tokens", 512, "--out", tmp_path / "o",
                                                  "--seq-len", 512, "--batch-tokens", 512)
    other = make_model(tmp_path / "other-vocab", small_tokenizer())
    assert "different vocabulary" in cli_error(monkeypatch, capsys, tiny_mqa, "--teacher", other, "--tokens", 512, *out)
    assert "needs a teacher" in cli_error(monkeypatch, capsys, tiny, "--loss", "kd", "--tokens", 512, *out)
    assert "introduced no new parameters" in cli_error(monkeypatch, capsys, tiny_mqa, "--train", "new", "--tokens", 512, *out)
    assert "multiple of --seq-len" in cli_error(monkeypatch, capsys, tiny, "--tokens", 512, "--out", tmp_path / "o",
                                                "--seq-len", 64, "--batch-tokens", 500)
    assert "--resume" in cli_error(monkeypatch, capsys, tiny, "--tokens", 512, "--resume", *out)
    assert not (tmp_path / "o").exists()


def small_tokenizer():
    """A tokenizer with another vocabulary (fewer merges) than the fixture's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(sorted_pydoc()[:50], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
