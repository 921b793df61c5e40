"""`surgery snapshot`: a step an uptraining run kept, as a model folder equal to what the run's output would have been
there; and the refusals (one line, exit 2, nothing written)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers as tf

from surgery.checkpoint.sha256 import sha256_file
from surgery.training import UptrainOptions, uptrain
from surgery.training.state import MANIFEST, read_model_file, shard_files
from surgery.testing.pydoc_llama import FAST, weights


def run(model, out, **kw) -> dict:
    return uptrain(UptrainOptions(model=str(model), out=out, **(FAST | kw)))


@pytest.fixture(scope="module")
def two_steps(tiny, tmp_path_factory):
    """`tiny` after 2 LM steps with a checkpoint at each, the run folder kept: (output, run folder)."""
    out = tmp_path_factory.mktemp("snapshot") / "trained"
    run(tiny, out, loss="lm", tokens=512 * 2, save_every=1, keep_run_dir=True)
    return out, out.with_name("trained.run")


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_the_last_step_is_the_run_s_output_and_an_earlier_one_is_not(tiny, two_steps, tmp_path, cli):
    out, run_dir = two_steps
    code, _, err = cli("snapshot", run_dir, "--out", tmp_path / "last")
    assert code == 0, err
    last = tmp_path / "last"
    assert same(weights(last), weights(out))  # the very tensors the run wrote at its end
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (last / name).read_bytes() == (out / name).read_bytes(), name
    model = tf.AutoModelForCausalLM.from_pretrained(last, dtype=torch.float32).eval()
    assert torch.isfinite(model(input_ids=torch.arange(32)[None]).logits).all()
    record = json.loads((last / "surgery.json").read_text())["uptraining"]
    assert record["snapshot"]["step"] == 2 and record["snapshot"]["intermediate"] is False
    assert record["tokens"] == 1024 and record["steps"] == 2 and record["run_options"]["lr"] == FAST["lr"]
    final = json.loads((out / "surgery.json").read_text())["uptraining"]
    assert record["eval_ppl"] == final["final_eval_ppl"]  # the held-out perplexity the run measured at the step

    code, _, err = cli("snapshot", run_dir, "--step", "1", "--out", tmp_path / "first")
    assert code == 0, err
    first, trained = weights(tmp_path / "first"), weights(out)
    assert first.keys() == trained.keys() and not same(first, trained) and not same(first, weights(tiny))
    record = json.loads((tmp_path / "first" / "surgery.json").read_text())["uptraining"]
    assert record["snapshot"] == record["snapshot"] | {"step": 1, "schedule_steps": 2, "intermediate": True}
    assert record["tokens"] == 512 and [m["step"] for m in map(json.loads, (
        tmp_path / "first" / "uptrain_metrics.jsonl").read_text().splitlines())] == [0, 1]
    # step 1's weights are the checkpoint's, written in the input's dtype and names
    saved = read_model_file(run_dir / "checkpoints" / "step-00000001" / "model.safetensors")
    assert all(torch.equal(first[k], saved[k].to(first[k].dtype)) for k in first)


def test_a_per_process_checkpoint_is_gathered(two_steps, tmp_path, cli):
    """FSDP's layout (each tensor's dim-0 shards, one file per process, torch.chunk's split), made from step 2."""
    out, run_dir = two_steps
    copy = tmp_path / "fsdp.run"
    shutil.copytree(run_dir, copy)
    step = copy / "checkpoints" / "step-00000002"
    whole = read_model_file(step / "model.safetensors")
    (step / "model.safetensors").unlink()
    from safetensors.torch import save_file

    files = {}
    for rank in range(2):
        model_file, optim_file, layout_file = shard_files(rank)
        save_file({k: t.chunk(2)[rank].contiguous() for k, t in whole.items()}, step / model_file)
        shutil.copyfile(step / "optimizer.safetensors", step / optim_file)  # (a snapshot reads no optimizer state)
        (step / layout_file).write_text(json.dumps({"rank": rank, "processes": 2, "model": {
            k: {"shape": list(t.shape), "placements": ["Shard(dim=0)"]} for k, t in whole.items()}}))
        files |= {name: step / name for name in (model_file, optim_file, layout_file)}
    (step / "optimizer.safetensors").unlink()
    manifest = json.loads((step / MANIFEST).read_text())
    manifest["files"] = {n: e for n, e in manifest["files"].items() if "model" not in n and "optimizer" not in n} | {
        n: {"size": p.stat().st_size, "sha256": sha256_file(p)} for n, p in files.items()}
    (step / MANIFEST).write_text(json.dumps(manifest | {"layout": "per-process", "processes": 2}))
    code, _, err = cli("snapshot", copy, "--out", tmp_path / "gathered")
    assert code == 0, err
    assert same(weights(tmp_path / "gathered"), weights(out))
    # a placement it cannot gather: one line
    layout = json.loads((step / shard_files(0)[2]).read_text())
    layout["model"]["model.norm.weight"]["placements"] = ["Shard(dim=1)"]
    (step / shard_files(0)[2]).write_text(json.dumps(layout))
    manifest["files"][shard_files(0)[2]] = {"size": (step / shard_files(0)[2]).stat().st_size,
                                            "sha256": sha256_file(step / shard_files(0)[2])}
    (step / MANIFEST).write_text(json.dumps(manifest | {"layout": "per-process", "processes": 2}))
    code, _, err = cli("snapshot", copy, "--out", tmp_path / "refused")
    assert code == 2 and "sharded as Shard(dim=1)" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "refused").exists()


def refused(cli, *args) -> str:
    code, out, err = cli("snapshot", *map(str, args))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    return err


def test_refusals_are_one_line_and_write_nothing(two_steps, tmp_path, cli):
    out, run_dir = two_steps
    target = tmp_path / "x"
    assert "has no checkpoint of step 7; it has step(s) 1, 2" in refused(cli, run_dir, "--step", "7", "--out", target)
    assert "not an uptraining run folder (no run.json)" in refused(cli, out, "--out", target)
    assert "does not exist" in refused(cli, tmp_path / "none", "--out", target)
    assert "--step takes a step number or latest" in refused(cli, run_dir, "--step", "-1", "--out", target)
    assert not target.exists()
    target.mkdir()
    assert "already exists (use --force" in refused(cli, run_dir, "--out", target)
    assert "is the run folder; choose another --out" in refused(cli, run_dir, "--out", run_dir, "--force")
    assert "is inside the run folder" in refused(cli, run_dir, "--out", run_dir / "inside")
    copy = tmp_path / "copy.run"
    shutil.copytree(run_dir, copy)
    (copy / "metrics.jsonl").unlink()
    (copy / "metrics.jsonl").symlink_to(run_dir / "metrics.jsonl")
    assert "holds a symbolic link metrics.jsonl" in refused(cli, copy, "--out", tmp_path / "y")
    (copy / "metrics.jsonl").unlink()
    saved = (copy / "run.json").read_text()
    (copy / "run.json").write_text(json.dumps(json.loads(saved) | {"model": str(tmp_path / "gone")}))
    assert "input model" in refused(cli, copy, "--out", tmp_path / "y")  # its config and tokenizer are gone
    (copy / "run.json").write_text(saved)
    weights_file = copy / "checkpoints" / "step-00000002" / "model.safetensors"
    data = bytearray(weights_file.read_bytes())
    data[-1] ^= 1
    weights_file.write_bytes(bytes(data))
    err = refused(cli, copy, "--out", tmp_path / "y")
    assert "step 2" in err and "damaged" in err and "sha256 differs" in err
    shutil.rmtree(copy / "checkpoints" / "step-00000001")
    (copy / "checkpoints" / "step-00000002" / "run-state.json").unlink()  # a partial step
    assert "damaged" in refused(cli, copy, "--out", tmp_path / "y")
    assert not (tmp_path / "y").exists() and list(target.iterdir()) == []
    assert not list(tmp_path.glob(".y.*")) and not list(tmp_path.glob(".x.*"))  # no temporary folder left


@pytest.mark.slow  # its own LoRA run (~35 s on the shared CPU)
def test_a_lora_run_s_step_is_merged_as_its_output_is(tiny, tmp_path, cli):
    pytest.importorskip("peft")
    out = tmp_path / "lora"
    run(tiny, out, loss="lm", tokens=512 * 2, save_every=1, keep_run_dir=True, lora_rank=2)
    code, _, err = cli("snapshot", tmp_path / "lora.run", "--out", tmp_path / "snap")
    assert code == 0, err
    assert same(weights(tmp_path / "snap"), weights(out)) and not same(weights(out), weights(tiny))


def test_the_python_api_writes_the_same_folder(two_steps, tmp_path):
    import surgery

    out, run_dir = two_steps
    result = surgery.snapshot(run_dir, tmp_path / "api", step=1)
    assert result.uptraining["snapshot"]["step"] == 1 and [m["step"] for m in result.metrics] == [0, 1]
    saved = read_model_file(run_dir / "checkpoints" / "step-00000001" / "model.safetensors")
    assert all(torch.equal(t, saved[k]) for k, t in weights(result.folder).items())
    with pytest.raises(surgery.SurgeryError, match="--step takes a step number or latest"):
        surgery.snapshot(run_dir, tmp_path / "api2", step="first")
