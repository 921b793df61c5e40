"""Uptraining on tiny random Llama models with a small BPE tokenizer trained on pydoc text."""

from __future__ import annotations

import json
import math
import shutil
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

from surgery.kv.convert import convert_to_kv_heads
from surgery.kv.options import MQAOptions
from surgery.checkpoint.source import resolve_source
from surgery.training import UptrainOptions, uptrain
from surgery.training.losses import kd_loss, lm_loss
from surgery.errors import SurgeryError
from surgery.training.params import select_trainable
from surgery.testing.pydoc_llama import FAST, make_model, metrics, weights

from inprocess import FSDP_CPU, cli_args, launch_uptrain, uptrain_error

REPO = Path(__file__).resolve().parents[2]


def run(model, out, **kw) -> dict:
    return uptrain(UptrainOptions(model=str(model), out=out, **(FAST | kw)))


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):
    """`tiny` after 12 steps of LM training (checked by the first training test): (folder, record)."""
    out = tmp_path_factory.mktemp("uptrain") / "trained"
    return out, run(tiny, out, loss="lm", tokens=512 * 12, eval_every=4)


@pytest.fixture(scope="module")
def tiny_mqa(trained, tmp_path_factory):
    """The trained tiny model converted to MQA by mean pooling: surgery.json names it as the source."""
    out = tmp_path_factory.mktemp("uptrain") / "tiny-mqa"
    convert_to_kv_heads(resolve_source(str(trained[0])), out, MQAOptions(), progress=False)
    return out


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


@pytest.mark.parametrize("divergence", ["forward", "reverse", "jsd"])
def test_kd_divergences_match_their_definitions_in_value_and_gradient(divergence):
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(2, 5, 11, generator=g), 2 * torch.randn(2, 5, 11, generator=g)  # student a, teacher b
    assert kd_loss(a, a.clone(), divergence=divergence).abs().item() < 1e-6
    for t in (1.0, 2.0):
        s = a.double().clone().requires_grad_()
        p_s, p_t = F.softmax(s / t, -1), F.softmax(b.double() / t, -1)
        kl = lambda p, q: (p * (p.log() - q.log())).sum(-1)  # noqa: E731
        m = (p_s + p_t) / 2
        d = {"forward": kl(p_t, p_s), "reverse": kl(p_s, p_t), "jsd": (kl(p_t, m) + kl(p_s, m)) / 2}[divergence]
        expected = d.mean() * t * t
        expected.backward()
        x = a.clone().requires_grad_()
        got = kd_loss(x, b, temperature=t, divergence=divergence)
        got.backward()
        assert got.item() == pytest.approx(expected.item(), rel=1e-5)
        assert torch.allclose(x.grad.double(), s.grad, rtol=1e-4, atol=1e-7)
    if divergence == "jsd":
        assert kd_loss(a, b, divergence="jsd").item() <= math.log(2) + 1e-6  # bounded, unlike either KL
    with pytest.raises(SurgeryError, match="--kd-divergence"):
        UptrainOptions(model="x", out=Path("o"), tokens=1024, kd_divergence="js")


def test_reverse_kd_run_is_recorded_and_a_resume_must_repeat_it(tiny_mqa, tmp_path):
    out, run_dir = tmp_path / "o", tmp_path / "o.run"
    rec = run(tiny_mqa, out, tokens=512 * 3, save_every=1, keep_run_dir=True, kd_divergence="reverse")
    assert rec["loss"] == "kd" and rec["kd_divergence"] == "reverse"
    assert json.loads((out / "surgery.json").read_text())["uptraining"]["kd_divergence"] == "reverse"
    kd = [m["kd_loss"] for m in metrics(out) if "kd_loss" in m]
    assert kd[0] > 1e-4 and all(math.isfinite(k) for k in kd)
    shutil.rmtree(run_dir / "checkpoints" / "step-00000003")  # a step left to resume
    with pytest.raises(SurgeryError, match=r"kd_divergence: 'reverse' -> 'forward'"):
        run(tiny_mqa, out, tokens=512 * 3, save_every=1, resume=True, force=True)
    assert run(tiny_mqa, out, tokens=512 * 3, save_every=1, resume=True, force=True, keep_run_dir=True,
               kd_divergence="reverse")["kd_divergence"] == "reverse"
    # a run saved before the option existed ran forward KL: its run.json without the key reads as 'forward'
    shutil.rmtree(run_dir / "checkpoints" / "step-00000003")
    saved = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps({k: v for k, v in saved.items() if k != "kd_divergence"}))
    with pytest.raises(SurgeryError, match=r"kd_divergence: 'forward' -> 'reverse'"):
        run(tiny_mqa, out, tokens=512 * 3, save_every=1, resume=True, force=True, kd_divergence="reverse")


def test_kd_run_with_student_as_its_own_teacher_has_zero_loss(tiny, tmp_path):
    rec = run(tiny, tmp_path / "o", loss="kd", teacher=str(tiny), tokens=512)
    rows = [m for m in metrics(tmp_path / "o") if "loss" in m]
    assert rec["loss"] == "kd" and len(rows) == 1
    # The loss is exactly zero; its gradient is zero up to rounding (which AdamW, normalising, would still follow).
    assert rows[0]["kd_loss"] == 0.0 and rows[0]["grad_norm"] < 1e-6
    assert rec["teacher_eval_ppl"] == rec["initial_eval_ppl"]


# ----------------------------------------------------------------------------------------------- training


def test_lm_loss_decreases_and_the_output_is_a_complete_checkpoint(tiny, trained):
    out, rec = trained
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
    assert (out / "tokenizer.json").exists() and not out.with_name("trained.run").exists()
    before, after = weights(tiny), weights(out)
    assert before.keys() == after.keys() and all(after[k].dtype == before[k].dtype for k in before)
    assert not torch.equal(before["model.layers.0.self_attn.q_proj.weight"], after["model.layers.0.self_attn.q_proj.weight"])
    assert torch.isfinite(load(out)(input_ids=torch.arange(64)[None]).logits).all()


def sorted_pydoc() -> list[str]:
    from surgery.data import pydoc_texts

    return pydoc_texts()


def test_kd_is_the_default_for_a_converted_model_and_uses_its_source_as_teacher(trained, tiny_mqa, tmp_path):
    out = tmp_path / "o"
    rec = run(tiny_mqa, out, tokens=512 * 6, eval_every=3, keep_run_dir=True)
    assert rec["loss"] == "kd" and rec["teacher"] == "surgery.json source"
    # The teacher's held-out perplexity equals the source model's, recomputed on the run's held-out windows.
    held_out = load_file(tmp_path / "o.run" / "data.safetensors")["eval"].long()
    with torch.no_grad():
        nll = load(trained[0])(input_ids=held_out, labels=held_out).loss.item()
    assert rec["teacher_eval_ppl"] == pytest.approx(math.exp(nll), rel=1e-4)
    kd = [m["kd_loss"] for m in metrics(out) if "kd_loss" in m]
    assert kd[0] > 1e-4 and kd[-1] < 0.8 * kd[0]  # the teacher is not the student, and the student moves to it
    record = json.loads((out / "surgery.json").read_text())
    assert record["kind"] == "mqa" and record["local"]["source_folder"] == str(trained[0].absolute())  # the input's record
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


def test_gradient_checkpointing_gives_the_same_weights(tiny, tmp_path):
    run(tiny, tmp_path / "plain", loss="lm", tokens=1024)
    run(tiny, tmp_path / "ckpt", loss="lm", tokens=1024, gradient_checkpointing=True)
    plain, ckpt = weights(tmp_path / "plain"), weights(tmp_path / "ckpt")
    for k in plain:
        torch.testing.assert_close(ckpt[k], plain[k], atol=1e-5, rtol=1e-5)
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text()).get("use_cache") is not False


def test_tied_bf16_checkpoint_comes_back_tied_in_bf16(tokenizer, tmp_path):
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            tie_word_embeddings=True)
    tf.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path / "tied")
    tokenizer.save_pretrained(tmp_path / "tied")
    run(tmp_path / "tied", tmp_path / "out", loss="lm", tokens=1024)
    before, after = weights(tmp_path / "tied"), weights(tmp_path / "out")
    assert sorted(before) == sorted(after) and {t.dtype for t in after.values()} == {torch.bfloat16}
    assert not torch.equal(before["model.embed_tokens.weight"], after["model.embed_tokens.weight"])
    model = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.dtype == torch.bfloat16 and model.lm_head.weight is model.model.embed_tokens.weight


CUSTOM_CODE = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM


class ScaledConfig(LlamaConfig):
    model_type = "scaled_llama_test"


class ScaledForCausalLM(LlamaForCausalLM):
    config_class = ScaledConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed_scale = torch.nn.Parameter(torch.ones(config.hidden_size))  # introduced by the "conversion"

    def forward(self, input_ids=None, inputs_embeds=None, **kwargs):
        if inputs_embeds is None:
            inputs_embeds = self.model.embed_tokens(input_ids)
        return super().forward(inputs_embeds=inputs_embeds * self.embed_scale, **kwargs)
"""


def test_custom_code_checkpoint_trains_its_new_parameters_and_keeps_its_code(tiny, tmp_path):
    import importlib.util

    folder = tmp_path / "custom"
    folder.mkdir()
    (folder / "modeling_scaled.py").write_text(CUSTOM_CODE)
    spec = importlib.util.spec_from_file_location("modeling_scaled_for_test", folder / "modeling_scaled.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    base = tf.AutoConfig.from_pretrained(tiny).to_dict()
    config = module.ScaledConfig(**{k: v for k, v in base.items() if k not in ("model_type", "architectures")})
    torch.manual_seed(0)
    module.ScaledForCausalLM(config).save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "modeling_scaled.ScaledConfig", "AutoModelForCausalLM": "modeling_scaled.ScaledForCausalLM"}
    cfg["architectures"] = ["ScaledForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    for f in tiny.glob("tokenizer*"):
        (folder / f.name).write_bytes(f.read_bytes())
    (folder / "surgery.json").write_text(json.dumps({"kind": "test", "new_parameters": ["embed_scale"]}))

    out = tmp_path / "out"
    with pytest.raises(SurgeryError, match="modeling_scaled.py.*pass --trust-remote-code"):  # not without consent
        run(folder, out, loss="lm", train="new", tokens=1024)
    run(folder, out, loss="lm", train="new", tokens=1024, trust_remote_code=True)
    assert (out / "modeling_scaled.py").read_text() == CUSTOM_CODE
    before, after = weights(folder), weights(out)
    assert {k for k in before if not torch.equal(before[k], after[k])} == {"embed_scale"}
    model = tf.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32)
    assert type(model).__name__ == "ScaledForCausalLM" and torch.equal(model.embed_scale.detach(), after["embed_scale"])


def test_packing_holds_out_whole_documents_and_shards_steps_without_overlap(tokenizer, tmp_path):
    from surgery.data import load_texts
    from surgery.training.data import pack

    docs = [f"document {i}: " + "words " * (5 + 7 * i) for i in range(40)]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    packed = pack(load_texts(str(data), "body"), tokenizer, seq_len=16, eval_tokens=100, train_tokens=400)
    streamed = pack(load_texts(str(data), "body", streaming=True), tokenizer, seq_len=16, eval_tokens=100, train_tokens=400)
    assert torch.equal(packed.train, streamed.train) and torch.equal(packed.eval, streamed.eval)
    eos = tokenizer.eos_token_id
    ids = [tokenizer(d, add_special_tokens=False)["input_ids"] + [eos] for d in docs]
    flat = [t for doc in ids for t in doc]
    n_eval = next(i for i in range(1, len(ids)) if sum(map(len, ids[:i])) >= 112)  # 112 = 7 windows of 16
    assert packed.eval.flatten().tolist() == flat[:112]
    train_flat = [t for doc in ids[n_eval:] for t in doc]
    assert packed.train.flatten().tolist() == train_flat[: packed.train.numel()]
    assert packed.train.numel() >= 400
    # A step's 8 windows: 2 processes take disjoint halves whose union is the 1-process batch.
    one = packed.step_batch(3, 8, rank=0, world=1)
    two = torch.cat([packed.step_batch(3, 8, rank=r, world=2) for r in range(2)])
    assert torch.equal(one, two)
    seen = torch.cat([packed.window_indices(s * 8, 8) for s in range(packed.train.shape[0] // 8)])
    assert len(set(seen.tolist())) == seen.numel()  # no window twice within an epoch


# ------------------------------------------------------------------------------------- processes and resume


def test_two_processes_give_the_same_result_as_one(tiny, tmp_path):
    """accelerate launch with 2 CPU processes (DDP over gloo) vs 1 process with the same global batch."""
    args = dict(loss="lm", tokens=512 * 4)
    run(tiny, tmp_path / "one", **args)  # 1 process: 2 micro-batches of 4 per step
    result = launch_uptrain(["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                             "--dynamo_backend", "no"],
                            [tiny, "--out", tmp_path / "two", "--tokens", args["tokens"], "--loss", "lm", *cli_args(FAST)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 process(es) x 1 micro-batch(es) of 4" in result.stdout
    one, two = weights(tmp_path / "one"), weights(tmp_path / "two")
    for k in one:
        torch.testing.assert_close(two[k], one[k], atol=1e-4, rtol=1e-4)
    assert not torch.equal(one["model.norm.weight"], weights(tiny)["model.norm.weight"])
    loss_one = [m["loss"] for m in metrics(tmp_path / "one") if "loss" in m]
    loss_two = [m["loss"] for m in metrics(tmp_path / "two") if "loss" in m]
    assert loss_two == pytest.approx(loss_one, rel=1e-5)


def test_fsdp_on_cpu_gives_the_same_result_as_one_process_and_resumes_exactly(tokenizer, tmp_path):
    """accelerate launch with recipes/accelerate/fsdp-cpu.yaml: 2 processes, FSDP2 full sharding over gloo, vs
    1 process with the same global batch, on a model with tied embeddings (saved once, as the input has them);
    17 held-out windows split 9 / 8 (uneven evaluation shards); then a resume from the step-2 checkpoint
    (accelerate's save_state/load_state of the sharded model and optimizer) repeats the run exactly."""
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            tie_word_embeddings=True)
    tied = tmp_path / "tied"
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(tied)
    tokenizer.save_pretrained(tied)
    args = dict(FAST, loss="lm", tokens=512 * 4, eval_tokens=1088, eval_every=2, save_every=2)
    run(tied, tmp_path / "one", **args)
    uptrain_args = [tied, "--out", tmp_path / "fsdp", "--keep-run-dir", *cli_args(args)]
    result = launch_uptrain(FSDP_CPU, uptrain_args, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 process(es) x 1 micro-batch(es) of 4, 48 training / 17 held-out" in result.stdout
    assert "parameters sharded by FSDP" in result.stdout  # not accelerate's silent DDP fallback on CPU
    one, fsdp = weights(tmp_path / "one"), weights(tmp_path / "fsdp")
    assert one.keys() == fsdp.keys() == weights(tied).keys()  # no separate lm_head.weight
    for k in one:
        torch.testing.assert_close(fsdp[k], one[k], atol=1e-5, rtol=1e-5)
    assert not torch.equal(one["model.norm.weight"], weights(tied)["model.norm.weight"])
    rows_one, rows_fsdp = metrics(tmp_path / "one"), metrics(tmp_path / "fsdp")
    for key in ("loss", "eval_ppl"):
        expected = [m[key] for m in rows_one if key in m]
        assert [m[key] for m in rows_fsdp if key in m] == pytest.approx(expected, rel=1e-5)
    model = load(tmp_path / "fsdp")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.isfinite(model(input_ids=torch.arange(64)[None]).logits).all()

    shutil.rmtree(tmp_path / "fsdp")
    shutil.rmtree(tmp_path / "fsdp.run" / "checkpoints" / "step-00000004")
    result = launch_uptrain(FSDP_CPU, [*uptrain_args, "--resume"], OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed at step 2 from step-00000002" in result.stdout
    resumed = weights(tmp_path / "fsdp")
    assert all(torch.equal(resumed[k], fsdp[k]) for k in fsdp)


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


def test_bad_inputs_exit_2_with_one_line(tiny, tiny_mqa, tokenizer, tmp_path, monkeypatch, capsys):
    out = ["--out", tmp_path / "o", "--seq-len", "64", "--batch-tokens", "512", "--eval-tokens", "256"]
    assert "does not exist" in uptrain_error(monkeypatch, capsys, tiny, "--data", tmp_path / "none.jsonl", "--tokens", 512, *out)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert "no text" in uptrain_error(monkeypatch, capsys, tiny, "--data", empty, "--tokens", 512, *out)
    assert "longer than the context" in uptrain_error(monkeypatch, capsys, tiny, "--tokens", 512, "--out", tmp_path / "o",
                                                  "--seq-len", 512, "--batch-tokens", 512, "--micro-batch", 1)
    other = make_model(tmp_path / "other-vocab", small_tokenizer())
    assert "different vocabulary" in uptrain_error(monkeypatch, capsys, tiny_mqa, "--teacher", other, "--tokens", 512, *out)
    assert "needs a teacher" in uptrain_error(monkeypatch, capsys, tiny, "--loss", "kd", "--tokens", 512, *out)
    # refused before any text is opened: offline, the default text's fallback line would otherwise come first
    assert "introduced no new parameters" in uptrain_error(monkeypatch, capsys, tiny_mqa, "--train", "new",
                                                           "--tokens", 512, *out)
    assert "multiple of --seq-len" in uptrain_error(monkeypatch, capsys, tiny, "--tokens", 512, "--out", tmp_path / "o",
                                                "--seq-len", 64, "--batch-tokens", 500)
    assert "--resume" in uptrain_error(monkeypatch, capsys, tiny, "--tokens", 512, "--resume", *out)
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
