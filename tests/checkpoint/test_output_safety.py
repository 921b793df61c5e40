"""Where commands may write and what they may delete (issue 31): uptrain's --run-dir and a recipe's output are never
a folder the command reads, never inside one and never hold one; refusals come before any folder is made; the
stale-folder cleanup knows every temporary name the toolkit makes beside an output."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import transformers as tf
import yaml
from inprocess import run_cli as run_in_process

from surgery.errors import SurgeryError
from surgery.training import UptrainOptions, uptrain
from surgery.testing.pydoc_llama import FAST

ARGS = dict(FAST, loss="lm", tokens=512 * 2)


@pytest.fixture
def run_cli(capsys):
    return lambda *args: run_in_process(capsys, *args)


def one_line(result, *fragments: str) -> str:
    code, _, err = result
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("surgery: warning: ")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("surgery: error: "), err[-2000:]
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def run(model, out, **kw) -> dict:
    return uptrain(UptrainOptions(model=str(model), out=out, **(ARGS | kw)))


# ---- uptrain --run-dir -------------------------------------------------------------------------------------
def test_force_never_deletes_a_run_folder_that_holds_the_source(tiny, tmp_path):
    """An earlier run folder (run.json and all) that now holds the model: --force would have deleted the model."""
    runs = tmp_path / "runs"
    model = runs / "model"
    shutil.copytree(tiny, model)
    (runs / "run.json").write_text("{}\n")
    before = snapshot(runs)
    with pytest.raises(SurgeryError, match="contains the source folder"):
        run(model, tmp_path / "out", run_dir=runs, force=True)
    assert snapshot(runs) == before and not (tmp_path / "out").exists()


def test_a_run_folder_inside_the_source_is_refused_and_nothing_is_written_there(tiny, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny, model)
    before = snapshot(model)
    with pytest.raises(SurgeryError, match="is inside the source folder"):
        run(model, tmp_path / "out", run_dir=model / "run")
    assert snapshot(model) == before and not (model / "run").exists()


def test_a_run_folder_holding_the_teacher_is_refused(tiny, tmp_path):
    teacher = tmp_path / "runs" / "teacher"
    shutil.copytree(tiny, teacher)
    (tmp_path / "runs" / "run.json").write_text("{}\n")
    with pytest.raises(SurgeryError, match="contains the teacher folder"):
        run(tiny, tmp_path / "out", run_dir=tmp_path / "runs", force=True, loss="kd", teacher=str(teacher))
    assert (teacher / "model.safetensors").is_file()


@pytest.mark.parametrize("where", ["same", "inside", "holding"])
def test_run_dir_and_out_overlapping_are_refused_up_front(tiny, tmp_path, run_cli, where):
    """--run-dir == --out (or one inside the other): the run folder is deleted after success, so the output would
    go with it; refused before anything is made, so the corrected re-run is not 'an earlier run'."""
    out = tmp_path / "out"
    run_dir = {"same": out, "inside": out / "run", "holding": tmp_path}[where]
    one_line(run_cli("uptrain", tiny, "--out", out, "--run-dir", run_dir, "--force", "--tokens", "512",
                     "--seq-len", "64", "--batch-tokens", "512"), "--run-dir")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    run(tiny, out, run_dir=tmp_path / "elsewhere")  # the corrected run
    assert (out / "model.safetensors").is_file() and not (tmp_path / "elsewhere").exists()


def test_align_with_a_teacher_of_other_layers_is_refused_before_the_run_folder_exists(tiny, tokenizer, tmp_path):
    config = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    teacher = tmp_path / "teacher"
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(teacher)
    tokenizer.save_pretrained(teacher)
    out = tmp_path / "out"
    with pytest.raises(SurgeryError, match="needs a teacher with the student's layers"):
        run(tiny, out, stage="align", teacher=str(teacher))
    assert not out.exists() and not (tmp_path / "out.run").exists()


# ---- recipes -----------------------------------------------------------------------------------------------
def recipe_file(tmp_path: Path, source: Path, output: Path) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"source": {"path": str(source)}, "output": str(output),
                                    "steps": [{"convert": {"to": "mqa"}}]}, sort_keys=False))
    return path


@pytest.mark.parametrize("where", ["same", "inside", "holding"])
def test_a_recipe_output_overlapping_the_source_is_refused_before_anything_is_written(tiny, tmp_path, run_cli, where):
    model = tmp_path / "m" / "model"
    shutil.copytree(tiny, model)
    output = {"same": model, "inside": model / "out", "holding": tmp_path / "m"}[where]
    before = snapshot(tmp_path / "m")
    one_line(run_cli("run", recipe_file(tmp_path, model, tmp_path / "elsewhere"), "--set", f"output={output}"),
             "source folder")
    one_line(run_cli("run", recipe_file(tmp_path, model, output)), "source folder")
    one_line(run_cli("run", recipe_file(tmp_path, model, output), "--dry-run"), "source folder")
    assert snapshot(tmp_path / "m") == before and not (model / "out").exists()
    assert not (tmp_path / "elsewhere").exists()


# ---- temporary names ---------------------------------------------------------------------------------------
def test_every_temporary_name_is_one_the_stale_cleanup_removes(tmp_path):
    """The calibration store, the atomic output folder, the replaced output and a JSON file being written: each
    made by a process that is gone is removed by the next run's cleanup."""
    from surgery.checkpoint.atomic import TEMP_MARKERS, clean_stale_siblings, temp_prefix
    from surgery.calibration.store import LayerStore

    out = tmp_path / "out"
    script = ("import sys; from pathlib import Path; from surgery.calibration.store import LayerStore\n"
              "import os; s = LayerStore(Path(sys.argv[1])); print(s.dir); os._exit(0)")  # killed: no cleanup ran
    dead = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    store = Path(dead.stdout.strip())
    assert store.is_dir() and store.parent == tmp_path and store.name.startswith(".out.calib-"), dead.stderr
    for marker in TEMP_MARKERS:  # the others, as a process that is gone would have left them
        (tmp_path / (temp_prefix(out, marker).replace(str(os.getpid()), "999999999") + "x")).mkdir()
    (tmp_path / ".out.tmp-999999999-file").write_text("{}")
    kept = clean_stale_siblings(out)
    assert kept == [] and list(tmp_path.iterdir()) == []
    with LayerStore(out) as live:  # a live store of this process is never removed by its own cleanup
        assert clean_stale_siblings(out) == [] and live.dir.is_dir()


def test_a_killed_calibrated_conversions_store_is_removed_by_the_next_run(tiny, tmp_path, run_cli):
    """As SIGKILL leaves it: `.OUT.calib-PID-*` of a process that is gone, with a layer's tensors in it."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    store = tmp_path / f".out.calib-{int(dead.stdout)}-abc123" / "layer-00000"
    store.mkdir(parents=True)
    (store / "model.safetensors").write_bytes(b"x" * 1000)
    code, _, err = run_cli("convert", tiny, "--to", "mqa", "--merge", "aligned", "--calib-tokens", "256",
                           "--calib-window", "64", "--out", tmp_path / "out")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
