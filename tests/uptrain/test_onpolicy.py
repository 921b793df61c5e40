"""GKD's divergences (--kd-divergence, --kd-beta) and on-policy distillation (--on-policy): the student writes the
continuation of a window's prompt, the teacher scores it, KD counts the generated positions."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers as tf

from inprocess import uptrain_error
from recipe_files import write_recipe
from surgery.errors import SurgeryError
from surgery.testing.pydoc_llama import FAST, make_model, metrics, weights
from surgery.training import UptrainOptions, uptrain
from surgery.training.divergence import divergence_per_position
from surgery.training.loop import UptrainRecipe
from surgery.training.losses import Objective, kd_loss
from surgery.training.onpolicy import OnPolicy, generate, masks


def run(model, out, **kw) -> dict:
    return uptrain(UptrainOptions(model=str(model), out=out, **(FAST | kw)))


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, tokenizer):
    """A second tiny Llama (another seed) as the teacher of `tiny`: the two disagree, so KD has work to do."""
    return make_model(tmp_path_factory.mktemp("onpolicy") / "teacher", tokenizer, seed=1)


def logits_pair(seed: int = 0, positions: int = 40, vocab: int = 50):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, positions // 2, vocab, generator=g), 2 * torch.randn(2, positions // 2, vocab, generator=g)


def kl(p, q):
    return (p * (p.log() - q.log())).sum(-1)


# ---------------------------------------------------------------------------------------------------- divergences


def test_forward_kd_is_the_kd_loss_of_before_bit_for_bit():
    """The default (forward, no weights) computes what KD computed before --kd-beta existed, to the bit: the same
    kernel on the same log-probabilities; the generalized JSD at beta 0 / 1 is exactly forward / reverse KL."""
    a, b = logits_pair()
    for t in (1.0, 2.0):
        log_s, log_t = F.log_softmax(a.flatten(0, 1).float() / t, -1), F.log_softmax(b.flatten(0, 1).float() / t, -1)
        before = F.kl_div(log_s, log_t, log_target=True, reduction="sum") / log_s.shape[0] * (t * t)
        assert torch.equal(kd_loss(a, b, temperature=t), before)
        assert torch.equal(kd_loss(a, b, temperature=t, divergence="jsd", beta=0.0), before)
        reverse = F.kl_div(log_t, log_s, log_target=True, reduction="sum") / log_s.shape[0] * (t * t)
        assert torch.equal(kd_loss(a, b, temperature=t, divergence="reverse"), reverse)
        assert torch.equal(kd_loss(a, b, temperature=t, divergence="jsd", beta=1.0), reverse)


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_generalized_jsd_matches_its_definition_in_value_and_gradient(beta):
    """JSD(beta) = beta KL(p_t || m) + (1 - beta) KL(p_s || m), m = beta p_t + (1 - beta) p_s (TRL's convention),
    against a float64 computation from the definition, and its gradient."""
    a, b = logits_pair(1)
    s = a.double().clone().requires_grad_()
    p_s, p_t = F.softmax(s, -1), F.softmax(b.double(), -1)
    m = beta * p_t + (1 - beta) * p_s
    expected = (beta * kl(p_t, m) + (1 - beta) * kl(p_s, m)).mean()
    expected.backward()
    x = a.clone().requires_grad_()
    got = kd_loss(x, b, divergence="jsd", beta=beta)
    got.backward()
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert torch.allclose(x.grad.double(), s.grad, rtol=1e-4, atol=1e-7)
    assert got.item() <= -(beta * math.log(beta) + (1 - beta) * math.log(1 - beta)) + 1e-6  # bounded by H(beta)


def test_jsd_at_half_is_symmetric_and_the_ends_approach_forward_and_reverse_kl():
    a, b = logits_pair(2)
    assert kd_loss(a, b, divergence="jsd").item() == pytest.approx(kd_loss(b, a, divergence="jsd").item(), rel=1e-6)
    assert kd_loss(a, b, divergence="forward").item() != pytest.approx(kd_loss(b, a, divergence="forward").item(),
                                                                       rel=1e-3)
    # JSD(beta) / beta -> KL(p_t || p_s) as beta -> 0; JSD(beta) / (1 - beta) -> KL(p_s || p_t) as beta -> 1
    small = 1e-4
    assert (kd_loss(a, b, divergence="jsd", beta=small) / small).item() == pytest.approx(
        kd_loss(a, b, divergence="forward").item(), rel=1e-2)
    assert (kd_loss(a, b, divergence="jsd", beta=1 - small) / small).item() == pytest.approx(
        kd_loss(a, b, divergence="reverse").item(), rel=1e-2)
    with pytest.raises(ValueError, match="beta"):
        kd_loss(a, b, divergence="jsd", beta=1.5)


@pytest.mark.parametrize("divergence", ["forward", "reverse", "jsd"])
def test_weighted_kd_counts_only_the_weighted_positions(divergence):
    """`weights` [B, T]: the weighted sum of the per-position divergences over their number (ones: the mean);
    positions of weight 0 get no gradient."""
    a, b = logits_pair(3)
    w = torch.zeros(a.shape[:2])
    w[:, 12:19] = 3.0
    x = a.clone().requires_grad_()
    got = kd_loss(x, b, divergence=divergence, beta=0.3 if divergence == "jsd" else 0.5, weights=w)
    got.backward()
    per = divergence_per_position(F.log_softmax(a.flatten(0, 1), -1), F.log_softmax(b.flatten(0, 1), -1), divergence,
                                  0.3 if divergence == "jsd" else 0.5).view(2, -1)
    assert got.item() == pytest.approx(3 * per[:, 12:19].sum().item() / per.numel(), rel=1e-5)
    assert x.grad[:, :12].abs().sum() == 0 and x.grad[:, 19:].abs().sum() == 0 and x.grad[:, 12:19].abs().sum() > 0
    uniform = torch.ones(a.shape[:2])  # every position once: the mean
    assert kd_loss(a, b, divergence=divergence, weights=uniform).item() == pytest.approx(
        kd_loss(a, b, divergence=divergence).item(), rel=1e-5)


def test_beta_and_on_policy_options_are_checked():
    def refused(match, **kw):
        with pytest.raises(SurgeryError, match=match):
            UptrainOptions(model="x", out=Path("o"), tokens=1024, **kw)

    refused("--kd-beta .*needs --kd-divergence jsd", kd_beta=0.2)
    refused(r"--kd-beta must lie in \[0, 1\]", kd_beta=1.5, kd_divergence="jsd")
    refused(r"--on-policy must lie in \[0, 1\]", on_policy=1.5)
    refused("--gen-tokens must be below --seq-len 64", on_policy=0.5, seq_len=64, batch_tokens=512, gen_tokens=64)
    refused("--gen-temperature must not be negative", gen_temperature=-1.0)
    refused("--on-policy .*needs --loss kd or mix", on_policy=0.5, loss="lm")
    assert UptrainOptions(model="x", out=Path("o"), tokens=1024, seq_len=64, batch_tokens=512, gen_tokens=64).on_policy == 0


def test_the_command_line_refuses_bad_on_policy_options_in_one_line(tiny, tmp_path, monkeypatch, capsys):
    out = ["--out", tmp_path / "o", "--seq-len", "64", "--batch-tokens", "512", "--tokens", "512"]
    assert "needs --kd-divergence jsd" in uptrain_error(monkeypatch, capsys, tiny, "--kd-beta", "0.9", *out)
    assert "--gen-tokens must be below --seq-len 64" in uptrain_error(monkeypatch, capsys, tiny, "--on-policy", "0.5",
                                                                       "--gen-tokens", "64", *out)
    # a student without a known source has no teacher to score its text
    assert "--on-policy needs a teacher" in uptrain_error(monkeypatch, capsys, tiny, "--on-policy", "0.5",
                                                           "--gen-tokens", "16", *out)
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.run").exists()


# ---------------------------------------------------------------------------------------------------- generation


def test_greedy_generation_is_model_generate_s(tiny):
    model = tf.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    prompt = torch.randint(0, model.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    ours = generate(model, prompt, 16)
    theirs = model.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0,
                            attention_mask=torch.ones_like(prompt))[:, 20:]
    assert theirs.shape == (3, 16) and torch.equal(ours, theirs)


def test_sampling_is_a_function_of_the_generator_and_the_schedule_is_exact(tiny):
    model = tf.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    prompt = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    policy = OnPolicy(0.5, 12, 1.0, seed=7)
    first = generate(model, prompt, 12, 1.0, policy.generator(3, 1, 0, prompt.device))
    again = generate(model, prompt, 12, 1.0, policy.generator(3, 1, 0, prompt.device))
    other = generate(model, prompt, 12, 1.0, policy.generator(4, 1, 0, prompt.device))
    assert torch.equal(first, again) and not torch.equal(first, other)
    state = torch.get_rng_state()
    generate(model, prompt, 4, 1.0, policy.generator(0, 0, 0, prompt.device))
    assert torch.equal(torch.get_rng_state(), state)  # the run's own random stream is never drawn from
    for p, expected in ((0.5, 50), (0.3, 30), (1.0, 100), (0.25, 25)):
        slots = [OnPolicy(p, 1, 0, 0).generates(k) for k in range(100)]
        w = math.ceil(1 / p)  # evenly spread: every w consecutive slots hold one
        assert sum(slots) == expected and all(sum(slots[i:i + w]) >= 1 for i in range(100 - w))


def test_masks_cover_the_positions_that_predict_generated_tokens():
    m = masks(2, 10, 6, "cpu")
    assert m["lm_ignore"].tolist() == [[False] * 5 + [True] * 4 + [False]] * 2
    assert m["kd_mask"].tolist() == [[False] * 6 + [True] * 4] * 2
    # the KD term: the mean divergence over the positions predicting generated tokens, the LM term the other targets'
    a, b = logits_pair(5)
    ids = torch.randint(0, a.shape[-1], (2, 10), generator=torch.Generator().manual_seed(1))
    loss, parts = Objective("mix", kd_weight=0.5)(a[:, :10], ids, b[:, :10], **m)
    per = divergence_per_position(F.log_softmax(a[:, :10].flatten(0, 1), -1), F.log_softmax(b[:, :10].flatten(0, 1), -1))
    assert parts["kd"].item() == pytest.approx(per.view(2, 10)[:, 5:9].mean().item(), rel=1e-5)
    nll = F.cross_entropy(a[:, :9].flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view(2, 9)
    assert parts["lm"].item() == pytest.approx(nll[:, :5].mean().item(), rel=1e-5)


# ---------------------------------------------------------------------------------------------------- training


def test_generated_tokens_are_what_the_step_trains_on(tiny, teacher, tmp_path, monkeypatch):
    """--on-policy 1, greedy: every micro-batch's ids are its window's prompt followed by the student's own greedy
    continuation at that moment, and the KD term's weights cover exactly the positions predicting them."""
    seen = []
    original = UptrainRecipe._micro_step

    def spy(self, ids, last, loss_weights=None, **kw):
        student = self.run.acc.unwrap_model(self.models.model)
        was = student.training
        student.eval()
        greedy = generate(student, ids[:, :-16], 16)
        student.train(was)
        seen.append((ids.clone(), greedy, loss_weights))
        return original(self, ids, last, loss_weights=loss_weights, **kw)

    monkeypatch.setattr(UptrainRecipe, "_micro_step", spy)
    rec = run(tiny, tmp_path / "o", loss="kd", teacher=str(teacher), tokens=512 * 2, on_policy=1.0, gen_tokens=16,
              gen_temperature=0.0)
    assert len(seen) == 4  # 2 steps x 2 micro-batches, all on-policy
    for ids, greedy, m in seen:
        assert torch.equal(ids[:, -16:], greedy)
        assert m["lm_ignore"][:, 47:63].all() and m["lm_ignore"].sum() == ids.shape[0] * 16
        assert m["kd_mask"][:, -16:].all() and torch.equal(m["kd_mask"][:, 1:], m["lm_ignore"][:, :-1])
    rows = [r for r in metrics(tmp_path / "o") if "loss" in r]
    assert all(0 < r["gen_share"] < 1 and r["gen_s"] > 0 for r in rows)
    assert rec["on_policy"]["fraction"] == 1.0 and rec["on_policy"]["gen_tokens"] == 16


def test_on_policy_run_resumes_bitwise(tiny, teacher, tmp_path):
    """Sampling (temperature 1) on half the micro-batches with jsd: a run resumed from its step-2 checkpoint ends
    with the uninterrupted run's weights, bit for bit; a resume must repeat the on-policy options."""
    args = dict(loss="kd", teacher=str(teacher), tokens=512 * 3, save_every=1, keep_last=3, on_policy=0.5,
                gen_tokens=16, kd_divergence="jsd", kd_beta=0.3)
    out, run_dir = tmp_path / "o", tmp_path / "o.run"
    run(tiny, out, keep_run_dir=True, **args)
    straight = weights(out)
    off = {k: v for k, v in args.items() if k != "gen_tokens"} | {"on_policy": 0.0}  # (--gen-tokens needs it)
    plain = weights(tmp_path / "p") if run(tiny, tmp_path / "p", **off) else None
    assert any(not torch.equal(straight[k], plain[k]) for k in straight)  # the generations changed the training
    shutil.rmtree(run_dir / "checkpoints" / "step-00000003")
    run(tiny, out, resume=True, force=True, keep_run_dir=True, **args)
    resumed = weights(out)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    with pytest.raises(SurgeryError, match="on_policy: 0.5 -> 0.25"):
        run(tiny, tmp_path / "o2", run_dir=run_dir, resume=True, **(args | {"on_policy": 0.25}))


def test_bf16_on_policy_runs(tiny, teacher, tmp_path):
    rec = run(tiny, tmp_path / "o", loss="mix", teacher=str(teacher), tokens=512, on_policy=1.0, gen_tokens=8,
              precision="bf16")
    rows = [r for r in metrics(tmp_path / "o") if "loss" in r]
    assert rec["precision"] == "bf16" and all(math.isfinite(r["kd_loss"]) and math.isfinite(r["lm_loss"]) for r in rows)


def test_a_recipe_takes_the_on_policy_fields(tmp_path):
    from surgery.recipes import load_recipe
    from surgery.recipes.runner import command_line, plan_steps

    data = {"name": "t", "source": {"id": "smollm2"}, "output": "out",
            "steps": [{"convert": {"to": "mqa"}}, {"uptrain": {"tokens": 1024, "on_policy": 0.5, "gen_tokens": 32,
                                                                 "kd_divergence": "jsd", "kd_beta": 0.9}}]}
    r = load_recipe(write_recipe(tmp_path / "r.yaml", data))
    line = [str(x) for x in command_line(r, plan_steps(r, tmp_path / "out")[1])]
    assert line[line.index("--on-policy") + 1] == "0.5" and line[line.index("--kd-beta") + 1] == "0.9"
    data["steps"][1]["uptrain"]["kd_divergence"] = "forward"
    with pytest.raises(SurgeryError, match="kd_beta .*needs kd_divergence jsd"):
        load_recipe(write_recipe(tmp_path / "bad.yaml", data))
