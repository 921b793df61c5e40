"""Streamed uptraining data (surgery/training/stream.py): exact resume (one process, 2 workers, a mixture), mixture
shares, disjoint readers and held-out documents, and its bad inputs, on the tiny random Llama of conftest's `tiny`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from surgery.checkpoint.sha256 import sha256_file
from surgery.training import UptrainOptions, uptrain
from surgery.training.stream_held_out import hold_out
from surgery.training.stream_packing import Sequential
from surgery.training.stream_readers import Reader
from surgery.training.stream_sources import Plan, parse_weights, resolve_sources
from inprocess import uptrain_error
from surgery.testing.pydoc_llama import FAST, make_model, weights


def stream_error(monkeypatch, capsys, *args) -> str:
    return uptrain_error(monkeypatch, capsys, *args, warnings=True)


# 3 windows of 64 per step: a step leaves the 2 readers of a 2-worker run mid-round (the resume's rotation).
STREAM = dict(FAST, loss="lm", data_mode="stream", batch_tokens=192, micro_batch=3, eval_tokens=256, tokens=192 * 4,
              save_every=1, keep_last=4, keep_run_dir=True)



def write_shards(folder: Path, shards: int, docs: int, tag: str = "doc") -> str:
    """`shards` jsonl files of `docs` documents each, every document naming itself; returns their glob."""
    from surgery.data import pydoc_texts

    texts = pydoc_texts()
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        rows = [{"text": f"{tag} {s}-{d}: " + texts[(s * docs + d) % len(texts)][:400]} for d in range(docs)]
        (folder / f"part-{s:03d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(folder / "*.jsonl")


def run(model, out: Path, **kw) -> dict:
    return uptrain(UptrainOptions(model=str(model), out=out, **(STREAM | kw)))


def resume_from(run_dir: Path, step: int, copy: Path) -> None:
    """`copy` (a run folder) = `run_dir` with the checkpoints after `step` removed: a run killed after that step."""
    shutil.copytree(run_dir, copy)
    for ckpt in (copy / "checkpoints").iterdir():
        if int(ckpt.name.split("-")[1]) > step:
            shutil.rmtree(ckpt)


@pytest.mark.parametrize("case", ["one-process", "two-workers", "mixture"])
def test_killed_streamed_run_resumes_to_bitwise_equal_weights(tiny, tmp_path, case, monkeypatch):
    """Blocks of 5 windows (a step takes 3): the resumes land inside a shuffled block and cross into the next."""
    from surgery.training import stream_readers

    monkeypatch.setattr(stream_readers, "BLOCK_TOKENS", 64 * 5)
    extra = {"two-workers": dict(data_workers=2),
             "mixture": dict(data=["pydoc", write_shards(tmp_path / "shards", 3, 40)], data_weights="0.7,0.3",
                             data_workers=2)}.get(case, {})
    straight = run(tiny, tmp_path / "straight", **extra)
    run_dir = tmp_path / "straight.run"
    assert not (run_dir / "data.safetensors").exists()  # nothing of the data in the run folder but positions
    assert {p.name for p in (run_dir / "checkpoints" / "step-00000004").iterdir()} >= {"data-0.json"}
    for step in (1, 2):
        resume_from(run_dir, step, tmp_path / f"resumed{step}.run")
        resumed = run(tiny, tmp_path / f"resumed{step}", resume=True, run_dir=tmp_path / f"resumed{step}.run", **extra)
        a, b = weights(tmp_path / "straight"), weights(tmp_path / f"resumed{step}")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"resumed after step {step}"
        assert resumed["sources"] == straight["sources"]
    assert not torch.equal(weights(tiny)["model.norm.weight"], weights(tmp_path / "straight")["model.norm.weight"])
    if case == "mixture":
        assert [s["weight"] for s in straight["sources"]] == [0.7, 0.3]
        assert sum(s["windows"] for s in straight["sources"]) == 12
        from surgery.publish.card import uptraining_section
        from surgery.publish.validate import Validation

        record = json.loads((tmp_path / "straight" / "surgery.json").read_text())
        assert record["uptraining"]["sources"] == straight["sources"]
        card = "\n".join(uptraining_section(Validation(tmp_path / "straight", {}, record)))
        share = straight["sources"][1]["share"]
        assert f"| data pydoc | weight 0.7, {straight['sources'][0]['share']:.1%} of the windows |" in card
        assert f"| data \\*.jsonl | weight 0.3, {share:.1%} of the windows |" in card


def plan_for(tokenizer, sources, readers=1, seq_len=16, epochs=1000, eval_tokens=0, seed=0) -> Plan:
    args = dict(tokenizer=tokenizer, eos=tokenizer.eos_token_id, seq_len=seq_len, seed=seed, readers=readers,
                epochs=epochs)
    _, held = hold_out(args, sources, eval_tokens)
    return Plan(sources=tuple(sources), held=held, **args)


def test_mixture_shares_hold_within_two_percent_over_10000_windows(tokenizer, tmp_path):
    sources = resolve_sources(["pydoc", write_shards(tmp_path / "b", 2, 30)], parse_weights("0.7,0.3", 2))
    for seed in (0, 1):
        reader = iter(Reader(plan_for(tokenizer, sources, seed=seed), role=0, state=None))
        counts = np.bincount([next(reader)[1] for _ in range(10_000)], minlength=2)
        assert abs(counts[0] / 10_000 - 0.7) <= 0.02 and abs(counts[1] / 10_000 - 0.3) <= 0.02, counts


def reader_documents(plan: Plan, s: int, role: int) -> list[str]:
    return list(Sequential(plan, s, role, None)._raw(0))


@pytest.mark.parametrize("shards", [pytest.param(8, marks=pytest.mark.slow), 1], ids=["by-file", "by-document"])  # by-file: ~100 s
def test_readers_read_disjoint_documents_and_never_the_held_out_ones(tokenizer, tmp_path, shards):
    spec = write_shards(tmp_path / "c", shards, 48 // shards)
    sources = resolve_sources([spec], [1.0])
    plan = plan_for(tokenizer, sources, readers=4, eval_tokens=300)
    held = plan.held[0]
    assert sum(held) >= 2 and plan.cut(0) is None  # the first documents are held out, whole ones
    every = [f"doc {s}-{d}" for s in range(shards) for d in range(48 // shards)]
    held_docs = set(every[: sum(held)])  # the held-out documents are the first ones, in file order
    seen = [[t.split(":")[0] for t in reader_documents(plan, 0, role)] for role in range(4)]
    flat = [d for docs in seen for d in docs]
    assert len(flat) == len(set(flat))  # no document read by two readers
    assert set(flat) == set(every) - held_docs and not set(flat) & held_docs
    assert all(seen)  # every reader has some
    # the windows two readers make share no document, so no window: checked on the tokens of the document names
    first = {tuple(next(iter(Reader(plan, r, None)))[0]) for r in range(4)}
    assert len(first) == 4


@pytest.mark.slow  # ~50 s; the bitwise resume tests with 2 workers stay in the default suite
def test_two_workers_read_the_windows_of_two_readers_in_turn(tiny, tokenizer, tmp_path):
    """The DataLoader's workers each run their own reader: the process's windows alternate between them."""
    from surgery.training.stream import StreamedData

    sources = resolve_sources([write_shards(tmp_path / "w", 4, 12)], [1.0])
    plan = plan_for(tokenizer, sources, readers=2, seq_len=32)
    data = StreamedData(plan, torch.zeros(0, 32), rank=0, world=1, workers=2)
    got = data.take(6)
    data.close()
    alone = [iter(Reader(plan, role, None)) for role in range(2)]
    expect = torch.stack([torch.from_numpy(next(alone[i % 2])[0]).long() for i in range(6)])
    assert torch.equal(got, expect)
    assert set(data.states) == {0, 1} and data.consumed == 6


def test_eval_data_and_progress_of_a_mixture(tiny, tmp_path, capsys):
    """--eval-data is evaluated beside the sources' own held-out documents; progress lines show the tokens read,
    blank documents skipped and each source's share so far."""
    train = write_shards(tmp_path / "train", 2, 20, tag="train")
    (tmp_path / "train" / "part-000.jsonl").open("a").write(json.dumps({"text": "  "}) + "\n")  # a blank document
    other = write_shards(tmp_path / "other", 1, 30, tag="other")
    record = run(tiny, tmp_path / "o", data=[train, "pydoc"], data_weights="1,1", eval_data=other, tokens=192 * 6,
                 save_every=0, progress=True, progress_every=0)
    assert record["final_other_eval_ppl"] is not None and sum(s["windows"] for s in record["sources"]) == 18
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("uptrain: step ")]
    assert len(lines) == 6 and "read 1,152 tokens" in lines[-1] and "shares *.jsonl" in lines[-1]


def test_bad_mixtures_and_dry_sources_exit_2_with_one_line(tiny, tmp_path, monkeypatch, capsys):
    small = write_shards(tmp_path / "small", 1, 3)
    out = ["--out", tmp_path / "o", "--seq-len", "64", "--batch-tokens", "64", "--micro-batch", "1",
           "--eval-tokens", "64", "--tokens", "1920", "--data-mode", "stream"]
    assert "2 weight(s) for 1" in stream_error(monkeypatch, capsys, tiny, "--data-weights", "0.5,0.5", *out)
    for bad in ("0.7,0", "1,-1", "a,b", "1,nan"):
        stream_error(monkeypatch, capsys, tiny, "--data", "pydoc", "--data", small, "--data-weights", bad, *out)
    assert "matches no file" in stream_error(monkeypatch, capsys, tiny, "--data", str(tmp_path / "none*.jsonl"), *out)
    assert not (tmp_path / "o").exists()
    assert "ran dry" in stream_error(monkeypatch, capsys, tiny, "--data", small, *out, "--save-every", "5")
    assert not (tmp_path / "o").exists() and (tmp_path / "o.run" / "checkpoints").is_dir()  # the last checkpoint kept
    import sys

    import cli

    monkeypatch.setattr(sys, "argv", ["surgery", "uptrain", str(tiny), "--data", small, *map(str, out), "--save-every",
                                      "5", "--resume", "--data-epochs", "100"])  # the same source read again
    try:
        cli.main()
    except SystemExit as e:
        assert e.code in (0, None)
    assert "resumed at step" in capsys.readouterr().out and (tmp_path / "o" / "model.safetensors").exists()


def rehash(ckpt: Path) -> None:
    """Re-write a checkpoint's manifest over its files as they are now (an attacker's or a careless edit)."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"] = {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
                         for p in sorted(ckpt.iterdir()) if p.name != "manifest.json"}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def test_resume_refuses_altered_positions_steps_and_changed_sources(tiny, tmp_path, monkeypatch, capsys):
    shards = write_shards(tmp_path / "s", 2, 30)
    args = ["--data", "pydoc", "--data", shards, "--data-weights", "0.7,0.3", "--seq-len", "64", "--batch-tokens",
            "192", "--micro-batch", "3", "--eval-tokens", "256", "--tokens", str(192 * 4), "--loss", "lm",
            "--save-every", "1", "--lr", "3e-3", "--eval-every", "0"]
    run(tiny, tmp_path / "o", data=["pydoc", shards], data_weights="0.7,0.3", data_epochs=1)
    base = tmp_path / "o.run"

    def case(name, edit, *extra):
        folder = tmp_path / f"{name}.run"
        resume_from(base, 2, folder)
        edit(folder / "checkpoints" / "step-00000002")
        return stream_error(monkeypatch, capsys, tiny, *args, *extra, "--out", tmp_path / name, "--run-dir", folder,
                         "--resume")

    def set_json(file, **values):
        data = json.loads(file.read_text())
        data.update(values)
        file.write_text(json.dumps(data))

    def step_beyond(ck):
        set_json(ck / "run-state.json", step=40)
        set_json(ck / "manifest.json", step=40)
        ck.rename(ck.parent / "step-00000040")
        rehash(ck.parent / "step-00000040")

    assert "beyond this run's 4 steps" in case("beyond", step_beyond)
    assert "altered" in case("step", lambda ck: (set_json(ck / "run-state.json", step=3), rehash(ck)))
    assert "does not match its step" in case("consumed", lambda ck: (set_json(ck / "data-0.json", consumed=3),
                                                                     rehash(ck)))
    assert "not valid" in case("position", lambda ck: (set_json(ck / "data-0.json", readers={"0": {"sources": 1}}),
                                                       rehash(ck)))
    assert "no intact checkpoint" in case("truncated", lambda ck: ((ck / "data-0.json").write_text("{"),
                                                                  shutil.rmtree(ck.parent / "step-00000001")))
    assert "same" in case("workers", lambda ck: None, "--data-workers", "2")

    def grow(ck):  # a source's files changed since the run started
        with open(tmp_path / "s" / "part-001.jsonl", "a") as f:
            f.write(json.dumps({"text": "one more"}) + "\n")
    assert "no longer matches" in case("changed", grow)
    resume_from(base, 2, tmp_path / "opts.run")
    assert "different options" in stream_error(monkeypatch, capsys, tiny, *args[:2], *args[6:], "--out", tmp_path / "opts",
                                            "--run-dir", tmp_path / "opts.run", "--resume")


@pytest.mark.slow
def test_two_processes_over_gloo_resume_a_streamed_mixture_to_bitwise_equal_weights(tiny, tmp_path):
    """accelerate launch, 2 CPU processes (DDP over gloo), a mixture read by 2 readers per process: a run resumed
    after step 1 (each rank's own position, data-0.json and data-1.json) ends with the uninterrupted run's weights."""
    from inprocess import launch_uptrain

    shards = write_shards(tmp_path / "shards", 8, 20)
    args = ["--data", "pydoc", "--data", shards, "--data-weights", "0.6,0.4", "--data-mode", "stream",
            "--data-workers", "2", "--seq-len", "64", "--batch-tokens", "256", "--micro-batch", "2", "--eval-tokens",
            "256", "--tokens", str(256 * 3), "--loss", "lm", "--save-every", "1", "--keep-last", "4", "--lr", "3e-3",
            "--eval-every", "0", "--keep-run-dir"]
    launch = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no"]
    done = launch_uptrain(launch, [tiny, *args, "--out", tmp_path / "straight"], OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr[-3000:]
    ckpt = tmp_path / "straight.run" / "checkpoints" / "step-00000003"
    assert (ckpt / "data-0.json").exists() and (ckpt / "data-1.json").exists()
    positions = [json.loads((ckpt / f"data-{r}.json").read_text())["readers"] for r in (0, 1)]
    assert set(positions[0]) == {"0", "1"} and set(positions[1]) == {"2", "3"}  # each rank its own readers
    resume_from(tmp_path / "straight.run", 1, tmp_path / "resumed.run")
    again = launch_uptrain(launch, [tiny, *args, "--out", tmp_path / "resumed", "--run-dir", tmp_path / "resumed.run",
                                    "--resume"], OMP_NUM_THREADS="1")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed at step 1" in again.stdout
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_recipe_mixture_loads_and_bad_weights_are_refused_when_it_loads(tmp_path):
    import yaml

    from surgery.errors import SurgeryError
    from surgery.recipes import load_recipe

    def recipe(**uptrain):
        path = tmp_path / "r.yaml"
        path.write_text(yaml.safe_dump({"source": {"path": "src"}, "output": "run",
                                        "steps": [{"convert": {"to": "mqa"}}, {"uptrain": {"tokens": 512, **uptrain}}]}))
        return path

    loaded = load_recipe(recipe(data=["pydoc", "a.jsonl"], data_weights=[0.7, 0.3], data_workers=2))
    step = loaded.steps[1]
    options = step.options if hasattr(step, "options") else step
    assert "0.7" in str(options)
    for bad in ([0.7], [1, 0], [1, -2]):
        with pytest.raises(SurgeryError) as e:
            load_recipe(recipe(data=["pydoc", "a.jsonl"], data_weights=bad))
        assert "data-weights" in str(e.value) or "data_weights" in str(e.value)


def test_packed_resume_checks_the_cache_against_the_sha256_its_checkpoint_recorded(tiny, tmp_path, monkeypatch,
                                                                                    capsys):
    """Packed data (the small-run path): a cache rebuilt from unchanged data is the same file and resumes exactly;
    a cache of other windows under the same key (replaced, or rebuilt from changed data) is refused."""
    from safetensors.torch import load_file, save_file

    args = dict(data_mode="packed", data_workers=0, tokens=192 * 4)
    run(tiny, tmp_path / "o", **args)
    cache = tmp_path / "o.run" / "data.safetensors"
    assert json.loads((tmp_path / "o.run" / "checkpoints" / "step-00000002" / "run-state.json").read_text())[
        "data_sha256"] == sha256_file(cache)

    resume_from(tmp_path / "o.run", 2, tmp_path / "cut.run")
    (tmp_path / "cut.run" / "data.safetensors").write_bytes(cache.read_bytes()[:1000])  # truncated: rebuilt, same
    run(tiny, tmp_path / "cut", run_dir=tmp_path / "cut.run", resume=True, **args)
    a, b = weights(tmp_path / "o"), weights(tmp_path / "cut")
    assert all(torch.equal(a[k], b[k]) for k in a)

    resume_from(tmp_path / "o.run", 2, tmp_path / "other.run")
    tensors = load_file(cache)
    tensors["train"] = tensors["train"].flip(0).contiguous()  # other windows, the same key in the metadata
    from safetensors import safe_open

    with safe_open(str(cache), "pt") as f:
        metadata = f.metadata()
    save_file(tensors, str(tmp_path / "other.run" / "data.safetensors"), metadata=metadata)
    from surgery.errors import SurgeryError

    with pytest.raises(SurgeryError) as e:
        run(tiny, tmp_path / "other", run_dir=tmp_path / "other.run", resume=True, **args)
    assert "not the data the checkpoint trained on" in str(e.value)


def test_a_streamed_dataset_with_enough_shards_is_split_by_shard(tokenizer, tmp_path, monkeypatch):
    """A dataset named like a hub one (here a local folder of 8 jsonl files, which `datasets` loads the same way),
    with --streaming: each of 4 readers streams its own contiguous shards, none the held-out documents."""
    write_shards(tmp_path / "corpus", 8, 6)
    monkeypatch.chdir(tmp_path)
    sources = resolve_sources(["corpus"], [1.0])
    args = dict(tokenizer=tokenizer, eos=tokenizer.eos_token_id, seq_len=16, seed=0, readers=4, epochs=1,
                streaming=True)
    _, held = hold_out(args, sources, 300)
    plan = Plan(sources=tuple(sources), held=held, **args)
    assert plan.hub_shards(0) == 8 and held[0][0] >= 2
    seen = [[t.split(":")[0] for t in Sequential(plan, 0, role, None)._raw(0)] for role in range(4)]
    every = [f"doc {s}-{d}" for s in range(8) for d in range(6)]
    flat = [d for docs in seen for d in docs]
    assert len(flat) == len(set(flat)) and set(flat) == set(every[held[0][0]:])
    assert seen[1] == every[12:24]  # reader 1: shards 2 and 3


@pytest.mark.slow
def test_fsdp_on_cpu_shards_the_teacher_and_gives_the_one_process_result(tiny, tokenizer, tmp_path):
    """KD under recipes/accelerate/fsdp-cpu.yaml (2 processes, FSDP2 over gloo): the teacher is sharded like the
    student (no gradients) and the run ends with the weights of one process with the same global batch."""
    from inprocess import FSDP_CPU, cli_args, launch_uptrain

    teacher = make_model(tmp_path / "teacher", tokenizer, seed=1)
    args = dict(FAST, loss="kd", teacher=str(teacher), tokens=512 * 3, eval_tokens=512)
    uptrain(UptrainOptions(model=str(tiny), out=tmp_path / "one", **args))
    result = launch_uptrain(FSDP_CPU, [tiny, "--out", tmp_path / "fsdp", *cli_args(args)], OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "parameters sharded by FSDP (the teacher's too)" in result.stdout
    one, fsdp = weights(tmp_path / "one"), weights(tmp_path / "fsdp")
    for k in one:
        torch.testing.assert_close(fsdp[k], one[k], atol=1e-5, rtol=1e-5)
    assert not torch.equal(one["model.norm.weight"], weights(tiny)["model.norm.weight"])


def one_file(tmp_path: Path, topics: int = 12) -> Path:
    """One .txt file of pydoc text with blank lines inside: several paragraphs, one document with --txt-unit file."""
    from surgery.data import pydoc_texts

    path = tmp_path / "one.txt"
    path.write_text("\n\n".join(t.strip() for t in pydoc_texts()[:topics]) + "\n")
    return path


def test_a_single_document_gives_its_first_tokens_to_the_held_out_split_and_the_rest_to_the_reader(tokenizer,
                                                                                                     tmp_path):
    """--txt-unit file on one file: the held-out windows are the document's first tokens, the reader trains on
    exactly the rest (no held-out token, none skipped), also from a resumed position inside it."""
    path = one_file(tmp_path)
    ids = tokenizer(path.read_text(), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    sources = resolve_sources([str(path)], [1.0])
    args = dict(tokenizer=tokenizer, eos=tokenizer.eos_token_id, seq_len=16, seed=0, readers=1, epochs=1,
                txt_unit="file")
    eval_windows, held = hold_out(args, sources, 40)  # 3 windows of 16: 48 tokens held out
    plan = Plan(sources=tuple(sources), held=held, **args)
    assert eval_windows.flatten().tolist() == ids[:48]
    assert plan.held == ((0,),) and plan.cut(0) == (0, 48)
    reader = Sequential(plan, 0, 0, None)
    got = [t for _ in range((len(ids) - 48) // 16) for t in reader.window().tolist()]
    assert got == ids[48 : 48 + len(got)] and len(ids) - 48 - len(got) < 16
    resumed = Sequential(plan, 0, 0, {"epoch": 0, "doc": 0, "offset": 21})
    assert resumed.window().tolist() == ids[48 + 21 : 48 + 21 + 16]
    # a source with documents after the held-out ones holds those out whole, as before
    paragraphs = Plan(sources=tuple(sources), held=hold_out(args | {"txt_unit": "paragraph"}, sources, 40)[1],
                      **(args | {"txt_unit": "paragraph"}))
    assert paragraphs.held[0][0] >= 1 and paragraphs.cut(0) is None


@pytest.mark.parametrize("mode", ["stream", "packed"])
def test_a_one_file_corpus_read_whole_trains_with_a_held_out_split(tiny, tmp_path, mode):
    path = one_file(tmp_path)
    out = run(tiny, tmp_path / mode, data=[str(path)], txt_unit="file", data_mode=mode, eval_tokens=512,
              tokens=192 * 2, save_every=0)
    assert out["eval_tokens"] == 512 and out["initial_eval_ppl"] > out["final_eval_ppl"] > 0
    assert not torch.equal(weights(tiny)["model.norm.weight"], weights(tmp_path / mode)["model.norm.weight"])


def test_stdlib_streams_offline_one_module_a_document_in_the_order_packed_reads_them(tokenizer):
    """`--data stdlib --data-mode stream` reads the standard library's modules from disk (never the hub), each
    module one document, in the same order as the packed path and `check --data stdlib`."""
    from surgery.data import stdlib_texts

    sources = resolve_sources(["stdlib"], [1.0])
    assert len(sources[0].units) > 100 and all(u.endswith(".py") for u in sources[0].units)
    plan = plan_for(tokenizer, sources, eval_tokens=0)
    first = [next(iter(plan.unit_texts(0, u))) for u in range(3)]
    expected = [str(d) for _, d in zip(range(3), stdlib_texts())]
    assert first == expected and all(first)
    text = tokenizer.decode(next(iter(Reader(plan, role=0, state=None)))[0])  # a window of a module's source
    assert len(text) > 16 and any(text in module for module in stdlib_texts())
