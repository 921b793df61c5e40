"""Per-process checkpoints under FSDP (surgery/training/state.py): each of 2 gloo processes saves only its shards,
as safetensors + JSON; a resume reads only its own process's files and ends bitwise where an uninterrupted run ends."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from surgery.testing.pydoc_llama import FAST, weights
from surgery.training.state import owner

from inprocess import FSDP_CPU, REPO, assert_one_line_error, cli_args, launch_uptrain, surgery


def launch_traced(args: list, trace: Path) -> subprocess.CompletedProcess:
    """`launch_uptrain(FSDP_CPU, args)` under strace: every process's file opens (system calls, so the Rust reads of
    safetensors too) and program starts, to `trace`."""
    cmd = ["strace", "-f", "-e", "trace=openat,execve", "-o", str(trace), sys.executable, "-m",
           "accelerate.commands.launch", *FSDP_CPU, "-m", "cli", "uptrain", *map(str, args)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})


def opened_by_worker(trace: Path, folder: Path) -> dict[int, set[str]]:
    """The files in `folder` each uptrain worker process opened, by the worker's pid. An open by any other thread or
    process (e.g. a thread of a worker) fails the test: then the trace could not tell whose it was."""
    workers, opened = set(), {}
    for line in trace.read_text().splitlines():
        if m := re.match(r'(\d+)\s+execve\("[^"]*", \[(.*?)\]', line):
            argv = m.group(2)
            if '"uptrain"' in argv and "accelerate" not in argv:  # the workers; not the launcher
                workers.add(int(m.group(1)))
        elif m := re.match(r'(\d+)\s+openat\(AT_FDCWD, "([^"]+)"', line):
            path = Path(m.group(2))
            if path.parent == folder:
                opened.setdefault(int(m.group(1)), set()).add(path.name)
    assert len(workers) == 2, workers
    assert set(opened) <= workers, (set(opened), workers)
    return opened


def is_pickle(path: Path) -> bool:
    head = path.read_bytes()[:2]
    return head[:1] == b"\x80" or head == b"PK"  # pickle protocol 2+, or torch.save's zip


@pytest.mark.slow  # two 2-process runs, one traced: about a minute on an idle 2-core machine, more when contended
def test_fsdp_checkpoints_hold_each_process_shards_and_resume_reads_only_its_own(tiny, tmp_path):
    if shutil.which("strace") is None:
        pytest.skip("strace is needed to see which process opens which file")
    args = dict(FAST, loss="lm", tokens=512 * 4, save_every=2, keep_last=4)
    out, run_dir = tmp_path / "fsdp", tmp_path / "fsdp.run"
    uptrain_args = [tiny, "--out", out, "--keep-run-dir", *cli_args(args)]
    result = launch_uptrain(FSDP_CPU, uptrain_args, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "parameters sharded by FSDP" in result.stdout
    straight = weights(out)

    # Each process's files hold its shards, and nothing else: together they are the model, each about half of it.
    last = run_dir / "checkpoints" / "step-00000004"
    manifest = json.loads((last / "manifest.json").read_text())
    assert manifest["layout"] == "per-process" and manifest["processes"] == 2
    assert not (last / "model.safetensors").exists() and not (last / "optimizer.safetensors").exists()
    assert set(manifest["files"]) == {p.name for p in last.iterdir()} - {"manifest.json"}
    shards = [load_file(last / f"model-rank{r}.safetensors") for r in range(2)]
    assert shards[0].keys() == shards[1].keys() == straight.keys()
    total = sum(t.numel() for t in straight.values())
    for r, shard in enumerate(shards):
        held = sum(t.numel() for t in shard.values())
        assert 0.4 * total < held < 0.6 * total, (r, held, total)
        layout = json.loads((last / f"shards-rank{r}.json").read_text())
        assert layout["processes"] == 2 and layout["rank"] == r
        for name, t in shard.items():
            assert layout["model"][name]["local_shape"] == list(t.shape)
            assert layout["model"][name]["shape"] == list(straight[name].shape)
            assert layout["model"][name]["placements"] == ["Shard(dim=0)"]
    for name, whole in straight.items():  # the output (gathered at the end) is the shards put together, bitwise
        assert torch.equal(torch.cat([shards[0][name], shards[1][name]]), whole), name
    for r in range(2):  # AdamW's moments: shards of the same shapes as the parameters'
        with safe_open(last / f"optim-rank{r}.safetensors", "pt") as f:
            moments = {k.split("\x1f")[0]: f.get_slice(k).get_shape() for k in f.keys() if k.endswith("exp_avg")}
        assert moments == {name: list(t.shape) for name, t in shards[r].items()}

    # Nothing in the run folder is a pickle: safetensors, JSON and JSON lines only.
    for path in (p for p in run_dir.rglob("*") if p.is_file()):
        assert not is_pickle(path), path
        if path.suffix == ".safetensors":
            with safe_open(path, "pt") as f:
                f.keys()
        elif path.suffix == ".jsonl":
            [json.loads(line) for line in path.read_text().splitlines()]
        else:
            assert path.suffix == ".json", path
            json.loads(path.read_text())

    # Resume from step 2: each process opens the run's files and its own, never the other process's shards.
    shutil.rmtree(out)
    shutil.rmtree(last)
    trace = tmp_path / "trace.txt"
    result = launch_traced([*uptrain_args, "--resume"], trace)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed at step 2 from step-00000002" in result.stdout
    resumed = weights(out)
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)
    opened = opened_by_worker(trace, run_dir / "checkpoints" / "step-00000002")
    ranks = {}
    for pid, names in opened.items():
        owners = {owner(name) for name in names} - {None}
        assert len(owners) == 1, (pid, sorted(names))  # one process's files only
        ranks[owners.pop()] = names
    assert set(ranks) == {0, 1}
    for r, names in ranks.items():
        assert {f"model-rank{r}.safetensors", f"optim-rank{r}.safetensors", f"rng-{r}.safetensors"} <= names


@pytest.mark.slow  # two 2-process runs
def test_a_per_process_checkpoint_damaged_in_one_process_files_is_skipped_by_all_and_refused_by_another_world(
        tiny, tmp_path):
    """Shards are not re-sharded: one process resuming 2 processes' FSDP checkpoint is refused in one line. A newest
    checkpoint whose damage only process 1 can see (its optimizer shard truncated) is skipped by both processes
    together: the resume starts from the older one and ends bitwise where the uninterrupted run ended."""
    args = dict(FAST, loss="lm", tokens=512 * 4, save_every=2)
    out, run_dir = tmp_path / "fsdp", tmp_path / "fsdp.run"
    uptrain_args = [tiny, "--out", out, "--keep-run-dir", *cli_args(args)]
    result = launch_uptrain(FSDP_CPU, uptrain_args, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    straight = weights(out)
    shutil.rmtree(out)
    single = surgery("uptrain", *uptrain_args, "--resume")
    assert_one_line_error(single, "holds FSDP shards of 2 processes", "resume it under FSDP with 2 processes")
    assert not out.exists()

    damaged = run_dir / "checkpoints" / "step-00000004" / "optim-rank1.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:100])
    result = launch_uptrain(FSDP_CPU, [*uptrain_args, "--resume"], OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"skipping a damaged checkpoint: {damaged}" in result.stderr
    assert "resumed at step 2 from step-00000002" in result.stdout
    resumed = weights(out)
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)
