"""Tracebacks that were (issue 31): each case ends in one line on stderr, exit 2, and nothing written — bench's
options and outputs, deeply nested JSON/YAML, a checkpoint without tensors, full disks, --max-shard-size, mistyped
fields of run state, manifests, recipe state and reports, push --json."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from inprocess import run_cli as run_in_process
from safetensors.torch import save_file

from surgery.testing import tiny_models as tm
from surgery.errors import SurgeryError
from surgery.testing.pydoc_llama import FAST

UPTRAIN = ["--seq-len", "64", "--batch-tokens", "512", "--micro-batch", "4", "--eval-tokens", "256", "--loss", "lm"]
REPO = Path(__file__).resolve().parents[2]
DEEP_JSON = "[" * 20000 + "]" * 20000


@pytest.fixture(scope="module")
def model(tiny):
    """A tiny llama with a real (BPE) tokenizer: what check, calibration and uptrain need (conftest's `tiny`)."""
    return tiny


@pytest.fixture(scope="module")
def converted(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("surface") / "mqa"
    subprocess.run([sys.executable, "-m", "surgery.cli", "convert", str(model), "--to", "mqa", "--out", str(out)],
                   check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    return out


@pytest.fixture(autouse=True)
def private_hash_cache(tmp_path, monkeypatch):
    import surgery.checkpoint.tensors

    monkeypatch.setattr(surgery.checkpoint.tensors._HashCache, "PATH", tmp_path / "cache" / "sha256.json")


@pytest.fixture
def run_cli(capsys):
    return lambda *args: run_in_process(capsys, *args)


def one_line(result, *fragments: str) -> str:
    code, _, err = result
    lines = [ln for ln in err.strip().splitlines()
             if not ln.startswith("surgery: warning: ") and " ETA " not in ln  # progress lines of a finished stage
             and "%|" not in ln]  # transformers' weight-loading bar (silenced by an earlier test in a whole run)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("surgery: error: "), err[-3000:]
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*"))


@pytest.fixture
def work(tmp_path):
    """An empty folder for a command's outputs (the case asserts it stays empty)."""
    (tmp_path / "w").mkdir()
    return tmp_path / "w"


# ---- bench -------------------------------------------------------------------------------------------------
BENCH = ["--batch", "1", "--context", "8", "--new", "2", "--rounds", "1"]


def test_bench_negative_threads(model, converted, run_cli, work):
    one_line(run_cli("bench", model, converted, "--threads", "-1", "--json", work / "b.json", *BENCH[:6]), "--threads")
    assert listing(work) == []


def test_bench_batch_times_context_that_cannot_fit_is_refused_before_allocating(model, converted, run_cli, work):
    one_line(run_cli("bench", model, converted, "--batch", str(10**9), "--context", "100", "--json", work / "b.json"),
             "lower --batch or --context")
    assert listing(work) == []


@pytest.mark.parametrize("option,name", [("--json", "missing/b.json"), ("--json", "."), ("--plot", "missing/b.png"),
                                         ("--plot", "."), ("--plot", "b.unknown")])
def test_bench_outputs_are_checked_before_the_run(model, converted, run_cli, work, option, name):
    one_line(run_cli("bench", model, converted, option, work / name, *BENCH), option)
    assert listing(work) == []


@pytest.mark.parametrize("command", [["convert", "{model}", "--to", "mqa", "--dry-run"],
                                     ["compare-merges", "{model}", "--to", "mqa", "--methods", "mean", "--tokens", "64",
                                      "--seq-len", "32"]])
@pytest.mark.parametrize("name", ["missing/x.json", "."])
def test_other_json_outputs_are_checked_before_the_work(model, run_cli, work, command, name):
    one_line(run_cli(*[a.format(model=model) for a in command], "--json", work / name), "--json")
    assert listing(work) == []


def test_bench_writes_json_and_plot_whole(model, converted, run_cli, work):
    code, _, err = run_cli("bench", model, converted, "--json", work / "b.json", "--plot", work / "b.png", *BENCH)
    assert code == 0, err
    assert listing(work) == ["b.json", "b.png"] and json.loads((work / "b.json").read_text())["results"]


# ---- deeply nested JSON and YAML ---------------------------------------------------------------------------
def test_deep_tokenizer_config(model, converted, run_cli, tmp_path, work):
    deep = tmp_path / "deep"
    shutil.copytree(model, deep)
    (deep / "tokenizer_config.json").write_text(DEEP_JSON)
    one_line(run_cli("convert", deep, "--to", "mqa", "--out", work / "o"), "tokenizer_config.json")
    one_line(run_cli("check", deep, converted, "--tokens", "64", "--seq-len", "32", "--json", work / "c.json"),
             "tokenizer_config.json")
    assert listing(work) == []


@pytest.mark.parametrize("text", ["[" * 5000 + "]" * 5000, "a:\n" + "".join("  " * i + "- \n" for i in range(2000))])
def test_deep_task_yaml(model, converted, run_cli, tmp_path, work, text):
    (tmp_path / "task.yaml").write_text(text)
    one_line(run_cli("check", model, converted, "--tokens", "64", "--seq-len", "32", "--tasks", tmp_path / "task.yaml",
                     "--json", work / "c.json"), "task.yaml", "nests deeper")
    assert listing(work) == []


def recipe(tmp_path: Path, source: Path, output: Path) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"source": {"path": str(source)}, "output": str(output),
                                    "steps": [{"convert": {"to": "mqa"}}]}, sort_keys=False))
    return path


def test_deep_recipe_state_and_set_value(model, run_cli, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "recipe-state.json").write_text(DEEP_JSON)
    for extra in ([], ["--dry-run"]):
        one_line(run_cli("run", recipe(tmp_path, model, out), *extra), "recipe-state.json", "nests deeper")
    one_line(run_cli("run", recipe(tmp_path, model, tmp_path / "other"), "--set", "convert.kv_heads=" + "[" * 3000),
             "--set convert.kv_heads")
    assert listing(out) == ["recipe-state.json"] and not (tmp_path / "other").exists()


def test_deep_reports_given_to_push(converted, run_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_unused")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing goes online: the report is refused first
    (tmp_path / "deep.json").write_text(DEEP_JSON)
    before = listing(converted)
    one_line(run_cli("push", converted, "me/x", "--check-report", tmp_path / "deep.json"), "deep.json", "nests deeper")
    one_line(run_cli("push", converted, "me/x", "--bench-report", tmp_path / "deep.json"), "deep.json", "nests deeper")
    assert listing(converted) == before


# ---- no tensors, full disks, shard size --------------------------------------------------------------------
def test_convert_dry_run_on_a_checkpoint_without_tensors(run_cli, tmp_path):
    src = tmp_path / "empty"
    tm.make_tiny("llama", src)
    save_file({}, str(src / "model.safetensors"))
    for to in (["--to", "mqa"], ["--to", "gqa", "--kv-heads", "2"], ["--to", "talking-heads"]):
        one_line(run_cli("convert", src, *to, "--dry-run"), "no tensors")


@pytest.fixture
def full_tmpfs(tmp_path):
    """A tmpfs filled to the last byte (where this user may mount one)."""
    from hostile import small_tmpfs

    with small_tmpfs(tmp_path / "full", full=True) as mount:
        yield mount


def test_full_disk_in_the_calibration_store(model, run_cli, full_tmpfs):
    (full_tmpfs / ".filler").unlink()
    (full_tmpfs / ".filler").write_bytes(b"\0" * 40_000)  # room for the folders, not for a layer's tensors
    one_line(run_cli("convert", model, "--to", "mqa", "--merge", "aligned", "--calib", "pydoc", "--calib-tokens", "256",
                     "--calib-window", "64", "--out", full_tmpfs / "out"), "disk full")
    assert listing(full_tmpfs) == [".filler"]


def test_full_disk_under_check_json(model, run_cli, full_tmpfs):
    one_line(run_cli("check", model, model, "--tokens", "64", "--seq-len", "32", "--json", full_tmpfs / "c.json"),
             "disk full")
    assert listing(full_tmpfs) == [".filler"]


def test_full_disk_at_an_uptrain_checkpoint_is_one_line(model, tmp_path, monkeypatch):
    """safetensors raises SafetensorError (not an OSError) for a full disk: the checkpoint's handling must see it."""
    import safetensors.torch
    from safetensors import SafetensorError

    from surgery.training import UptrainOptions, uptrain

    real = safetensors.torch.save_file

    def full(tensors, filename, metadata=None):
        if "checkpoints" in str(filename):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(SurgeryError, match="No space left on device; nothing of it was kept"):
        uptrain(UptrainOptions(model=str(model), out=tmp_path / "o", **(FAST | dict(loss="lm", tokens=1024,
                                                                                      save_every=1))))
    assert not (tmp_path / "o").exists()
    assert not list((tmp_path / "o.run" / "checkpoints").glob("*"))


def test_bad_max_shard_size_is_refused_before_training(model, run_cli, tmp_path):
    one_line(run_cli("uptrain", model, "--out", tmp_path / "o", "--tokens", "512", *UPTRAIN, "--max-shard-size", "5XB"),
             "--max-shard-size")
    assert listing(tmp_path) == []


# ---- mistyped fields ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def finished_run(model, tmp_path_factory):
    from surgery.training import UptrainOptions, uptrain

    out = tmp_path_factory.mktemp("surface") / "up"
    uptrain(UptrainOptions(model=str(model), out=out, keep_run_dir=True,
                           **(FAST | dict(loss="lm", tokens=1024, save_every=1, eval_tokens=256))))
    return out.parent / "up.run"


def damaged_run(finished_run: Path, tmp_path: Path, run_state=None, manifest=None) -> Path:
    """A copy of the run folder without its last checkpoint, the other's run-state.json / manifest.json replaced
    (re-hashed in the manifest, as someone editing it would)."""
    run_dir = tmp_path / "o.run"
    shutil.copytree(finished_run, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step-00000002")
    ck = run_dir / "checkpoints" / "step-00000001"
    m = json.loads((ck / "manifest.json").read_text())
    if run_state is not None:
        data = json.dumps(run_state).encode()
        (ck / "run-state.json").write_bytes(data)
        m["files"]["run-state.json"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ck / "manifest.json").write_text(json.dumps(manifest(m) if manifest else m))
    return run_dir


@pytest.mark.parametrize("run_state,field", [({"step": "1", "elapsed": 0.1, "data_key": "k"}, "step"),
                                             ({"step": [1], "elapsed": 0.1, "data_key": "k"}, "step"),
                                             ({"elapsed": 0.1, "data_key": "k"}, "step is missing"),
                                             ({"step": 1, "elapsed": "x", "data_key": "k"}, "elapsed"),
                                             ({"step": 1, "elapsed": 0.1, "data_key": 5}, "data_key"),
                                             ([1], "the top level")])
def test_mistyped_run_state_on_resume(model, finished_run, run_cli, tmp_path, run_state, field):
    run_dir = damaged_run(finished_run, tmp_path, run_state=run_state)
    line = one_line(run_cli("uptrain", model, "--out", tmp_path / "o", "--run-dir", run_dir, "--resume", "--tokens",
                            "1024", "--save-every", "1", "--lr", "0.003", *UPTRAIN), "run-state.json", field)
    assert "step-00000001" in line and not (tmp_path / "o").exists()


@pytest.mark.parametrize("edit,field", [(lambda m: {**m, "files": 5}, "files"),
                                        (lambda m: {**m, "files": {**m["files"], "model.safetensors": 5}},
                                         "files.model.safetensors"),
                                        (lambda m: {**m, "files": {**m["files"], "model.safetensors":
                                                                   {"size": "1", "sha256": "x"}}},
                                         "files.model.safetensors.size"),
                                        (lambda m: [m], "the top level")])
def test_mistyped_manifest_on_resume(model, finished_run, run_cli, tmp_path, edit, field):
    run_dir = damaged_run(finished_run, tmp_path, manifest=edit)
    one_line(run_cli("uptrain", model, "--out", tmp_path / "o", "--run-dir", run_dir, "--resume", "--tokens", "1024",
                     "--save-every", "1", "--lr", "0.003", *UPTRAIN), "manifest.json", field)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("field,value", [("kind", 5), ("source", "x"), ("source", {"spec": 5}), ("uptraining", 5),
                                         ("local", [1]), ("deep", json.loads("[" * 500 + "]" * 500))])
def test_mistyped_record_given_to_inspect_and_push(converted, run_cli, tmp_path, monkeypatch, field, value):
    monkeypatch.setenv("HF_TOKEN", "hf_unused")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / "c"
    shutil.copytree(converted, folder)
    record = json.loads((folder / "surgery.json").read_text())
    (folder / "surgery.json").write_text(json.dumps({**record, field: value}))
    before = listing(folder)
    one_line(run_cli("inspect", folder), "surgery.json", "deeper than" if field == "deep" else field)
    one_line(run_cli("push", folder, "me/x"), "surgery.json")
    assert listing(folder) == before


@pytest.mark.parametrize("field,value", [("finished", "yes"), ("scheme", "2"), ("scheme", [2]), ("output_digest", 5),
                                         ("fingerprint", 5), ("seconds", "x")])
def test_mistyped_recipe_state(model, run_cli, tmp_path, field, value):
    out = tmp_path / "run"
    out.mkdir()
    state = {"steps": {"convert": {"started": "a", "finished": True, "fingerprint": "a", "scheme": 2,
                                   "output": str(out / "01-convert"), "output_digest": "b", "seconds": 1.0,
                                   field: value}}}
    (out / "recipe-state.json").write_text(json.dumps(state))
    for extra in ([], ["--dry-run"]):
        one_line(run_cli("run", recipe(tmp_path, model, out), *extra), "recipe-state.json", f"steps.convert.{field}")
    assert listing(out) == ["recipe-state.json"]


@pytest.fixture(scope="module")
def check_report(model, converted, tmp_path_factory):
    from surgery.checking.compare import compare_checkpoints
    from surgery.checking.options import CheckOptions
    from surgery.data import load_texts
    from surgery.checkpoint.source import resolve_source

    report = compare_checkpoints(resolve_source(str(model)), resolve_source(str(converted)),
                                 load_texts("pydoc", "text", False), CheckOptions(tokens=64, seq_len=32),
                                 progress=False)
    return json.loads(json.dumps(report))


@pytest.mark.parametrize("field,value", [("kl", "0.1"), ("max_abs_diff", None), ("tokens", "many"), ("texts", 5),
                                         ("texts", [5]), ("generation", 5), ("by_position", [{"positions": 1}]),
                                         ("exact", "no")])
def test_mistyped_check_report_given_to_push(converted, check_report, run_cli, tmp_path, monkeypatch, field, value):
    monkeypatch.setenv("HF_TOKEN", "hf_unused")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = tmp_path / "report.json"
    path.write_text(json.dumps({**check_report, field: value}))
    before = listing(converted)
    one_line(run_cli("push", converted, "me/x", "--check-report", path), "report.json", field)
    assert listing(converted) == before


def test_push_json_into_a_missing_folder_is_refused_before_the_upload(converted, run_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_unused")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # an upload attempt would fail with another message
    one_line(run_cli("push", converted, "me/x", "--json", tmp_path / "missing" / "p.json"), "--json", "does not exist")


# ---- messages ----------------------------------------------------------------------------------------------
def test_a_relative_glob_that_matches_nothing_is_said_so_and_never_goes_online(model, run_cli, work, monkeypatch):
    import surgery.data

    def online(*a, **k):
        raise AssertionError("a local pattern went to the hub")

    monkeypatch.setattr(surgery.data, "_hub_texts", online)
    monkeypatch.chdir(work)
    for pattern in ("texts/*.md", "texts/*", "doc?.txt"):
        one_line(run_cli("check", model, model, "--data", pattern, "--tokens", "64", "--seq-len", "32"),
                 pattern, "matches no file", str(work))
    assert listing(work) == []


@pytest.mark.parametrize("args,fragment", [
    (["--to", "talking-heads", "--refit-values"], "--refit-values does nothing for --to talking-heads"),
    (["--to", "talking-heads", "--kv-heads", "2"], "--kv-heads does nothing for --to talking-heads"),
    (["--to", "talking-heads", "--device", "cpu"], "talking-heads runs none"),
    (["--to", "mqa", "--refit-values"], "nothing for the mean merge"),
    (["--to", "gqa", "--kv-heads", "1", "--merge", "first", "--refit-values"], "nothing for the first merge"),
    (["--to", "mqa", "--device", "cuda"], "the mean merge runs none"),
    (["--to", "mqa", "--device", "bogus"], "--device 'bogus'"),
    (["--to", "mqa", "--merge", "aligned", "--device", "tpu"], "--device 'tpu'"),
])
def test_options_that_would_do_nothing_are_refused_by_the_kinds_rules(model, run_cli, work, args, fragment):
    one_line(run_cli("convert", model, *args, "--out", work / "o"), fragment)
    one_line(run_cli("convert", model, *args, "--dry-run"), fragment)
    assert listing(work) == []


def test_device_cuda_without_cuda_is_refused_for_a_calibrated_merge(model, run_cli, work):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    one_line(run_cli("convert", model, "--to", "mqa", "--merge", "aligned", "--device", "cuda", "--out", work / "o"),
             "CUDA is not available")
    assert listing(work) == []


@pytest.mark.parametrize("step,fragment", [({"uptrain": {"tokens": 512, "lora_rank": -1}}, "lora_rank must not"),
                                           ({"uptrain": {"tokens": 512, "stage": "bogus"}}, "unknown stage 'bogus'"),
                                           ({"uptrain": {"tokens": 512, "max_shard_size": "5XB"}}, "max_shard_size '5XB'"),
                                           ({"uptrain": {"tokens": 512, "seq_len": 1}}, "seq_len must be at least 2"),
                                           ({"uptrain": {"tokens": 512, "data": ["pydoc", "pydoc"],
                                                         "data_weights": "1"}}, "data_weights gives 1 weight(s) for 2 "
                                                                                "data source(s)"),
                                           ({"push": {"repo_id": "me/..x"}}, "repo id 'me/..x'"),
                                           ({"push": {"repo_id": "me/../x"}}, "owner/name")])
def test_recipe_fields_are_refused_when_the_recipe_loads(model, run_cli, tmp_path, step, fragment):
    from surgery.recipes import load_recipe

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"source": {"path": str(model)}, "output": str(tmp_path / "out"),
                                    "steps": [{"convert": {"to": "mqa"}}, step]}, sort_keys=False))
    with pytest.raises(SurgeryError, match=r"r\.yaml:\d+: steps\[1\]"):
        load_recipe(path)
    for extra in (["--dry-run"], []):
        one_line(run_cli("run", path, *extra), fragment)
    assert not (tmp_path / "out").exists()


def test_the_teacher_refusal_names_the_folder_holding_the_code(model, run_cli, tmp_path):
    """A record naming its source by a spec (a hub id) and its folder on this machine: the code to read before
    trusting it is in the folder, so the refusal names the folder."""
    teacher, student = tmp_path / "teacher", tmp_path / "student"
    shutil.copytree(model, teacher)
    shutil.copytree(model, student)
    config = json.loads((teacher / "config.json").read_text())
    (teacher / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "modeling_x.X"}}))
    (teacher / "modeling_x.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    (student / "surgery.json").write_text(json.dumps({"toolkit": "surgery", "kind": "mqa",
                                                      "source": {"spec": "org/teacher"},
                                                      "local": {"source_folder": str(teacher)}}))
    one_line(run_cli("uptrain", student, "--out", tmp_path / "o", "--tokens", "512", *UPTRAIN[:6], "--loss", "kd"),
             f"the teacher {teacher} (from org/teacher) ships its own modeling code", "--trust-teacher-code")
    assert not (tmp_path / "ran").exists() and not (tmp_path / "o").exists() and not (tmp_path / "o.run").exists()
