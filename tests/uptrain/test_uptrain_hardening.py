"""uptrain against hostile run folders, divergence, full disks, damaged checkpoints; progress in logs; defaults."""

from __future__ import annotations

import errno
import json
import os
import pickle
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from inprocess import cli_args

from surgery.errors import SurgeryError
from surgery.testing.pydoc_llama import FAST
from surgery.training import UptrainOptions, uptrain
from surgery.training.losses import kd_loss, lm_loss

REPO = Path(__file__).resolve().parents[2]

ARGS = dict(FAST, loss="lm", tokens=512 * 4, save_every=1, keep_last=4)


def run(model, out, **kw) -> dict:
    return uptrain(UptrainOptions(model=str(model), out=out, **(ARGS | kw)))


def cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", "uptrain", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


def one_error_line(result) -> str:
    lines = [ln for ln in result.stderr.strip().splitlines() if not ln.startswith("surgery: warning: ")]
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("surgery: error: "), result.stderr[-2000:]
    return lines[0]


def strict_json(text: str):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


@pytest.fixture(scope="module")
def finished_run(tiny, tmp_path_factory):
    """A 4-step run with a checkpoint after every step, run folder kept: (out, run_dir)."""
    out = tmp_path_factory.mktemp("hardening") / "straight"
    run(tiny, out, keep_run_dir=True)
    return out, out.parent / "straight.run"


def copy_run(finished_run, tmp_path, drop_final: bool = True) -> tuple[Path, Path]:
    """A copy of the finished run's folder, its step-4 checkpoint removed (so a resume has a step to do)."""
    import shutil

    _, run_dir = finished_run
    out = tmp_path / "straight"
    shutil.copytree(run_dir, tmp_path / "straight.run")
    if drop_final:
        shutil.rmtree(tmp_path / "straight.run" / "checkpoints" / "step-00000004")
    return out, tmp_path / "straight.run"


# ---------------------------------------------------------------------------------------------- resume state


class Marker:
    """Unpickling this writes the file `path`: proof that a pickle ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (Path(self.path).write_text, ("pickle ran",))


def test_checkpoints_hold_no_pickles_and_planted_pickles_never_run(tiny, finished_run, tmp_path):
    out, run_dir = copy_run(finished_run, tmp_path)
    ckpt = run_dir / "checkpoints" / "step-00000003"
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == ["manifest.json", "model.safetensors", "optimizer.safetensors", "rng-0.safetensors",
                     "run-state.json"]
    for f in ckpt.iterdir():
        assert not f.read_bytes().startswith(b"\x80"), f  # no pickle protocol header anywhere
    marker = tmp_path / "marker"
    for name in ("custom_checkpoint_0.pkl", "random_states_0.pkl", "optimizer.bin", "pytorch_model.bin",
                 "scheduler.bin"):
        (ckpt / name).write_bytes(pickle.dumps(Marker(marker)))
    (run_dir / "data.safetensors").write_bytes(pickle.dumps(Marker(marker)))  # the data cache, too (safetensors)
    result = cli(tiny, "--out", out, *cli_args(ARGS), "--resume")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resumed at step 3 from step-00000003" in result.stdout
    assert not marker.exists()
    resumed, straight = weights(out), weights(finished_run[0])
    assert resumed.keys() == straight.keys() and all(torch.equal(resumed[k], straight[k]) for k in straight)


def test_truncated_newest_checkpoint_falls_back_to_the_older_intact_one(tiny, finished_run, tmp_path):
    out, run_dir = copy_run(finished_run, tmp_path)
    model = run_dir / "checkpoints" / "step-00000003" / "model.safetensors"
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    result = cli(tiny, "--out", out, *cli_args(ARGS), "--resume")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resumed at step 2 from step-00000002" in result.stdout
    assert "damaged checkpoint" in result.stderr and "model.safetensors" in result.stderr
    assert "older intact checkpoint step-00000002" in result.stderr
    resumed, straight = weights(out), weights(finished_run[0])
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)


@pytest.mark.parametrize("damage", ["missing", "garbage"])
def test_damaged_optimizer_without_an_older_checkpoint_is_one_line(tiny, finished_run, tmp_path, damage):
    import shutil

    out, run_dir = copy_run(finished_run, tmp_path)
    for old in ("step-00000001", "step-00000002"):
        shutil.rmtree(run_dir / "checkpoints" / old)
    optimizer = run_dir / "checkpoints" / "step-00000003" / "optimizer.safetensors"
    if damage == "missing":
        optimizer.unlink()
    else:
        optimizer.write_bytes(os.urandom(optimizer.stat().st_size))
    line = one_error_line(cli(tiny, "--out", out, *cli_args(ARGS), "--resume"))
    assert "no intact checkpoint" in line and str(optimizer) in line
    assert not out.exists()


@pytest.mark.slow  # 10-30 s: keeps the default suite under 25 minutes on 2 cores
def test_corrupt_run_json_is_one_line_naming_it(tiny, finished_run, tmp_path):
    out, run_dir = copy_run(finished_run, tmp_path)
    for text in (b"{not json", b"[1, 2]", b"\x00\xff"):
        (run_dir / "run.json").write_bytes(text)
        line = one_error_line(cli(tiny, "--out", out, *cli_args(ARGS), "--resume"))
        assert "corrupt" in line and str(run_dir / "run.json") in line
    assert not out.exists()


# --------------------------------------------------------------------------------------------- divergence


def test_non_finite_lr_is_refused_before_anything_is_written(tiny, tmp_path):
    for value in ("inf", "nan"):
        line = one_error_line(cli(tiny, "--out", tmp_path / "o", *cli_args(ARGS | {"lr": value})))
        assert "--lr must be a finite number" in line
    assert list(tmp_path.iterdir()) == []


def test_divergence_stops_with_one_line_and_keeps_the_last_good_checkpoint(tiny, tmp_path):
    """lr 1e30: the first step is finite, its update overflows the weights; nothing non-finite is ever written."""
    out = tmp_path / "o"
    result = cli(tiny, "--out", out, *cli_args(ARGS | {"lr": 1e30, "warmup_steps": 0, "save_every": 1}))
    line = one_error_line(result)
    assert "not finite" in line and "lower --lr" in line
    assert not out.exists() and not list(tmp_path.glob(".o.tmp-*"))
    run_dir = tmp_path / "o.run"
    for ckpt in (run_dir / "checkpoints").iterdir():
        assert ckpt.name.startswith("step-"), ckpt  # no partial checkpoint
        for name, t in load_file(ckpt / "model.safetensors").items():
            assert torch.isfinite(t).all(), (ckpt, name)
        assert ckpt.name in line or "no checkpoint was written" in line
    for text in (run_dir / "metrics.jsonl").read_text().splitlines():
        strict_json(text)  # no NaN / Infinity: every line is valid JSON


# ---------------------------------------------------------------------------------------------- full disks


def enospc_after(calls: int):
    from safetensors import torch as st

    real = st.save_file
    count = {"n": 0}

    def save_file(*args, **kw):
        count["n"] += 1
        if count["n"] > calls:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args, **kw)
    return save_file


def test_full_disk_at_a_checkpoint_is_one_line_and_leaves_no_partial_checkpoint(tiny, tmp_path, monkeypatch, capsys):
    import cli as cli_module
    from safetensors import torch as st

    monkeypatch.setattr(st, "save_file", enospc_after(3 * 2 + 1))  # steps 1 and 2 saved (3 files each), 3 fails
    monkeypatch.setattr(sys, "argv", ["surgery", "uptrain", str(tiny), "--out", str(tmp_path / "o"), *cli_args(ARGS)])
    with pytest.raises(SystemExit) as e:
        cli_module.main()
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("surgery: warning: ")]
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("surgery: error: "), err
    assert "No space left on device" in err[0] and "step-00000002" in err[0]
    ckpts = tmp_path / "o.run" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000001", "step-00000002"]
    assert not (tmp_path / "o").exists()


def test_full_disk_writing_the_output_is_one_line_and_resume_finishes_it(tiny, finished_run, tmp_path, monkeypatch,
                                                                        capsys):
    import cli as cli_module
    import transformers.modeling_utils as mu

    out, run_dir = copy_run(finished_run, tmp_path, drop_final=False)

    def full(*args, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(mu, "safe_save_file", full)
    monkeypatch.setattr(sys, "argv", ["surgery", "uptrain", str(tiny), "--out", str(out), *cli_args(ARGS), "--resume"])
    with pytest.raises(SystemExit) as e:
        cli_module.main()
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("surgery: warning: ")]
    assert e.value.code == 2 and len(err) == 1 and "disk full" in err[0] and "--resume" in err[0], err
    assert not out.exists() and not list(tmp_path.glob(".straight.tmp-*"))
    monkeypatch.undo()
    result = cli(tiny, "--out", out, *cli_args(ARGS), "--resume")
    assert result.returncode == 0, result.stderr[-2000:]
    assert all(torch.equal(weights(out)[k], v) for k, v in weights(finished_run[0]).items())


# ------------------------------------------------------------------------------------------ what users see


def test_output_files_have_ordinary_permissions(finished_run):
    out, _ = finished_run
    umask = os.umask(0)
    os.umask(umask)
    for f in out.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask, f


def test_progress_lines_in_a_log_and_default_evaluations_and_few_steps_warning(tiny, tmp_path):
    args = {k: v for k, v in (ARGS | {"save_every": 0, "tokens": 512 * 20}).items() if k != "eval_every"}
    result = cli(tiny, "--out", tmp_path / "o", *cli_args(args), "--progress-every", "0")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("uptrain: step ")]
    assert len(lines) == 20
    assert lines[4].startswith("uptrain: step 5/20, 2,560/10,240 tokens, ") and "tokens/s, ETA " in lines[4]
    assert "warning" not in result.stderr
    evals = [m["step"] for m in map(json.loads, (tmp_path / "o" / "uptrain_metrics.jsonl").read_text().splitlines())
             if "eval_ppl" in m]
    assert evals == [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20]  # about ten evaluations, not only the two ends

    result = cli(tiny, "--out", tmp_path / "few", *cli_args(ARGS | {"tokens": 1500}))
    assert result.returncode == 0, result.stderr[-2000:]
    warning = [ln for ln in result.stderr.splitlines() if ln.startswith("surgery: warning:")]
    assert len(warning) == 1 and "only 3 optimizer steps" in warning[0]


def test_chunked_losses_equal_the_whole_batch_formulas_with_logits_or_projected_hidden_states():
    """600 positions: chunks of 256, 256, 88; hidden states [3, 200, 16] projected by W [50, 16] inside the chunks."""
    torch.manual_seed(0)
    hidden = torch.randn(3, 200, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    teacher_hidden, teacher_weight = torch.randn(3, 200, 16), torch.randn(50, 16)
    ids = torch.randint(0, 50, (3, 200))
    t = 2.0

    def whole(kind):
        logits = hidden @ weight.T
        if kind == "lm":
            return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        log_s = torch.log_softmax(logits / t, -1).flatten(0, 1)
        log_t = torch.log_softmax(teacher_hidden @ teacher_weight.T / t, -1).flatten(0, 1)
        return (log_t.exp() * (log_t - log_s)).sum(-1).mean() * t * t

    project = lambda x: torch.nn.functional.linear(x, weight)  # noqa: E731
    project_teacher = lambda x: torch.nn.functional.linear(x, teacher_weight)  # noqa: E731
    chunked = {
        "lm": [lambda: lm_loss(hidden @ weight.T, ids), lambda: lm_loss(hidden, ids, project)],
        "kd": [lambda: kd_loss(hidden @ weight.T, teacher_hidden @ teacher_weight.T, t),
               lambda: kd_loss(hidden, teacher_hidden, t, project, project_teacher)],
    }
    for kind, variants in chunked.items():
        expect = whole(kind)
        expect_grads = torch.autograd.grad(expect, (hidden, weight))
        for variant in variants:
            got = variant()
            torch.testing.assert_close(got, expect)
            for g, e in zip(torch.autograd.grad(got, (hidden, weight)), expect_grads):
                torch.testing.assert_close(g, e)


def test_output_projection_moves_into_the_losses_only_where_it_reproduces_the_logits():
    import transformers as tf

    from surgery.training.heads import OutputHead

    torch.manual_seed(0)
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1)
    llama = tf.LlamaForCausalLM(tf.LlamaConfig(**small))
    head = OutputHead.of(llama, 64)
    ids = torch.arange(10)[None]
    with head.returning_hidden():
        hidden = llama(input_ids=ids).logits
    assert hidden.shape == (1, 10, 32)
    torch.testing.assert_close(head.project(hidden), llama(input_ids=ids).logits)  # and the patch is undone
    capped = tf.Gemma2ForCausalLM(tf.Gemma2Config(**small, head_dim=16, final_logit_softcapping=0.05))
    assert OutputHead.of(capped, 64) is None  # soft-capped logits: whole logits, as the model computes them
