"""Issue 41's distillation options on what users uptrain: custom kinds (SwitchHead, talking-heads: their own modeling
code, their own KV cache), LoRA adapters, and several processes (FSDP2 on 2 CPU processes, slow). The tiny pydoc
Llama is the source; each converted model distils from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from surgery.checkpoint.source import resolve_source
from surgery.testing.pydoc_llama import FAST, metrics
from surgery.training import UptrainOptions, uptrain
from surgery.training.teacher_pass import teacher_pass

RUN = FAST | dict(tokens=512 * 2, loss="kd")


def run(model: Path, out: Path, **kw) -> dict:
    return uptrain(UptrainOptions(model=str(model), out=out, **(RUN | kw)))


@pytest.fixture(scope="module")
def other(tokenizer, tmp_path_factory):
    """Another random Llama with the same tokenizer: converted, it is far from the tiny source (the teacher), so
    distilling from the source has work to do."""
    from surgery.testing.pydoc_llama import make_model

    return make_model(tmp_path_factory.mktemp("other") / "other", tokenizer, seed=2)


@pytest.fixture(scope="module")
def switchhead(other, tmp_path_factory):
    """`other` as SwitchHead, 2 heads of 2 experts, top-1 (its own modeling code and KV cache)."""
    from surgery.switchhead import convert_to_switchhead
    from surgery.switchhead.options import SwitchHeadOptions

    out = tmp_path_factory.mktemp("kinds") / "switchhead"
    options = SwitchHeadOptions(heads=2, experts=2, topk=1, calib=["pydoc"], calib_tokens=1024, device="cpu")
    convert_to_switchhead(resolve_source(str(other)), out, options, progress=False)
    return out


@pytest.fixture(scope="module")
def talking_heads(other, tmp_path_factory):
    from surgery.talking_heads import convert_to_talking_heads
    from surgery.talking_heads.options import TalkingHeadsOptions

    out = tmp_path_factory.mktemp("kinds") / "talking-heads"
    convert_to_talking_heads(resolve_source(str(other)), out, TalkingHeadsOptions(), progress=False)
    return out


@pytest.fixture(scope="module")
def store(tiny, tmp_path_factory):
    """The source's top-16 over RUN's windows."""
    out = tmp_path_factory.mktemp("stores") / "k16"
    teacher_pass(str(tiny), out, UptrainOptions(model=str(tiny), out=out, **RUN), 16, device="cpu", progress=False)
    return out


def kd_losses(out: Path) -> list[float]:
    return [m["kd_loss"] for m in metrics(out) if "kd_loss" in m]


def test_a_switchhead_conversion_distils_from_the_store_and_on_policy(switchhead, tiny, store, tmp_path):
    """SwitchHead (custom code): a stored pass of its source trains it with no teacher loaded; on-policy distillation
    generates with its own KV cache (greedy, every micro-batch) and trains on the result."""
    stored = run(switchhead, tmp_path / "stored", teacher_logprobs=str(store))
    assert stored["teacher"] is None and stored["teacher_logprobs"]["top_k"] == 16
    kd = kd_losses(tmp_path / "stored")
    assert len(kd) == 2 and kd[1] < kd[0]  # towards the source's distributions
    on = run(switchhead, tmp_path / "on", on_policy=1.0, gen_tokens=8, gen_temperature=0.0, teacher=str(tiny))
    rows = [m for m in metrics(tmp_path / "on") if "gen_s" in m]
    assert len(rows) == 2 and all(r["gen_s"] > 0 and 0 < r["gen_share"] < 1 for r in rows)
    kd = kd_losses(tmp_path / "on")
    assert on["on_policy"]["fraction"] == 1.0 and len(kd) == 2 and kd[1] < kd[0]


@pytest.mark.slow  # two LoRA runs (~20 s idle); the default suite keeps the SwitchHead test above
def test_lora_on_a_talking_heads_conversion_with_the_store_and_on_policy(talking_heads, tiny, store, tmp_path):
    """LoRA adapters on talking-heads: from the store (no teacher), and on-policy (the base model under peft's wrapper
    generates with its adapters active); only the adapted projections change in the merged output."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    for name, extra in (("stored", dict(teacher_logprobs=str(store))), ("on", dict(on_policy=0.5, gen_tokens=8, teacher=str(tiny)))):
        rec = run(talking_heads, tmp_path / name, lora_rank=2, **extra)
        assert rec["lora"]["modules"] == 2 * 4
        old = load_file(talking_heads / "model.safetensors")
        new = load_file(tmp_path / name / "model.safetensors")
        moved = {k for k in old if not torch.equal(old[k], new[k])}
        assert moved and all(k.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "o_proj") for k in moved), name
        kd = kd_losses(tmp_path / name)
        assert len(kd) == 2 and kd[1] < kd[0], name


@pytest.mark.slow  # two accelerate launches of 2 processes (~1-2 min)
@pytest.mark.parametrize("how", ["stored", "on-policy"])
def test_fsdp2_on_two_processes_matches_one_process(tiny, tokenizer, store, tmp_path, how):
    """FSDP2 over 2 CPU processes: from the store each rank reads its own windows' stored targets (checked against
    the ids it trains on); on-policy (every micro-batch, greedy), both ranks generate together, each its own windows'
    continuations. The losses follow the one-process run. (At P < 1 the generating slots are counted per process's
    micro-batches, so another number of processes trains on another, equally spread, schedule: onpolicy.py.)"""
    from inprocess import FSDP_CPU, cli_args, launch_uptrain
    from surgery.testing.pydoc_llama import make_model

    student = make_model(tmp_path / "student", tokenizer, seed=2)  # another random Llama: KD has work to do
    extra = dict(teacher_logprobs=str(store)) if how == "stored" else dict(on_policy=1.0, gen_tokens=8,
                                                                           gen_temperature=0.0, teacher=str(tiny))
    one = run(student, tmp_path / "one", **extra)
    result = launch_uptrain(FSDP_CPU + ["--main_process_port", "0"],
                            [student, "--out", tmp_path / "fsdp", *cli_args(RUN | extra)], OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    rec = json.loads((tmp_path / "fsdp" / "surgery.json").read_text())["uptraining"]
    assert kd_losses(tmp_path / "fsdp") == pytest.approx(kd_losses(tmp_path / "one"), rel=2e-3)
    assert rec["final_eval_ppl"] == pytest.approx(one["final_eval_ppl"], rel=1e-2)


@pytest.mark.slow  # one accelerate launch of 2 processes (~1 min)
def test_a_streamed_store_made_for_two_processes_serves_an_fsdp2_run(tiny, tokenizer, tmp_path):
    """Streamed data in 2 processes: each process streams its own windows; the store made with --processes 2 holds
    them in that order, and every window each rank trains on matches the hash the store holds for it (else the run
    stops with the store's refusal)."""
    from inprocess import FSDP_CPU, cli_args, launch_uptrain
    from surgery.testing.pydoc_llama import make_model

    streamed = RUN | dict(data_mode="stream")
    o = UptrainOptions(model=str(tiny), out=tmp_path / "store", **streamed)
    teacher_pass(str(tiny), tmp_path / "store", o, 16, device="cpu", progress=False, processes=2)
    student = make_model(tmp_path / "student", tokenizer, seed=2)
    result = launch_uptrain(FSDP_CPU + ["--main_process_port", "0"],
                            [student, "--out", tmp_path / "fsdp",
                             *cli_args(streamed | dict(teacher_logprobs=str(tmp_path / "store")))], OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    kd = kd_losses(tmp_path / "fsdp")
    assert len(kd) == 2 and kd[1] < kd[0]


def test_an_mla_conversion_distils_from_the_store_and_on_policy(other, tiny, store, tmp_path):
    """MLA (a deepseek_v3 checkpoint, trained in its latent-scaled training form): from the store with no teacher,
    and on-policy (the training form generates with its own latent KV cache)."""
    from surgery.mla.convert import convert_to_mla
    from surgery.mla.options import MLAOptions

    mla = tmp_path / "mla"
    convert_to_mla(resolve_source(str(other)), mla, MLAOptions(kv_rank=8, calib=["pydoc"], calib_tokens=512, device="cpu"),
                   progress=False)
    stored = run(mla, tmp_path / "stored", teacher_logprobs=str(store))
    assert stored["teacher"] is None and len(kd := kd_losses(tmp_path / "stored")) == 2 and kd[1] < kd[0]
    on = run(mla, tmp_path / "on", on_policy=1.0, gen_tokens=8, gen_temperature=0.0, teacher=str(tiny))
    assert on["on_policy"]["gen_seconds"] > 0 and len(kd := kd_losses(tmp_path / "on")) == 2 and kd[1] < kd[0]
    assert json.loads((tmp_path / "on" / "config.json").read_text())["model_type"] == "deepseek_v3"
