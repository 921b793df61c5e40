"""--data-workers auto: worker processes tokenize off the GPU's critical path on CUDA (2 per process), the CPU keeps
0 (its behaviour before auto), a resumed run keeps the number it started with, and the output records the number."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from surgery.errors import SurgeryError
from surgery.training import UptrainOptions, uptrain
from surgery.training.options import AUTO_DATA_WORKERS, resolve_data_workers
from surgery.testing.pydoc_llama import FAST, weights

STREAM = dict(FAST, loss="lm", data_mode="stream", batch_tokens=192, micro_batch=3, eval_tokens=256, tokens=192 * 4,
              save_every=1, keep_last=4, keep_run_dir=True)


def test_auto_is_two_workers_on_cuda_zero_on_cpu_and_a_resumed_run_keeps_its_own():
    assert AUTO_DATA_WORKERS == 2
    assert resolve_data_workers("auto", "cuda") == 2 and resolve_data_workers("auto", "cpu") == 0
    assert resolve_data_workers("auto", "cuda", recorded=0) == 0 and resolve_data_workers("auto", "cpu", recorded=2) == 2
    assert resolve_data_workers(3, "cuda", recorded=2) == 3 and resolve_data_workers(0, "cuda") == 0


def test_auto_is_the_default_and_never_streams_or_refuses_a_packed_run_by_itself(tiny, tmp_path):
    o = UptrainOptions(model=str(tiny), out=tmp_path / "o", tokens=1024)
    assert o.data_workers == "auto" and not o.streamed  # a small run stays packed, as before
    assert not UptrainOptions(model=str(tiny), out=tmp_path / "o", tokens=1024, data_mode="packed").streamed
    assert UptrainOptions(model=str(tiny), out=tmp_path / "o", tokens=1024, data_workers="2").data_workers == 2
    with pytest.raises(SurgeryError, match="--data-workers must be at least 0"):
        UptrainOptions(model=str(tiny), out=tmp_path / "o", tokens=1024, data_workers=-1)


def test_a_run_started_with_two_workers_resumes_under_auto_to_bitwise_equal_weights(tiny, tmp_path):
    straight = uptrain(UptrainOptions(model=str(tiny), out=tmp_path / "straight", data_workers=2, **STREAM))
    assert straight["data_workers"] == 2
    copy = tmp_path / "resumed.run"
    shutil.copytree(tmp_path / "straight.run", copy)
    for ckpt in (copy / "checkpoints").iterdir():
        if int(ckpt.name.split("-")[1]) > 2:
            shutil.rmtree(ckpt)
    resumed = uptrain(UptrainOptions(model=str(tiny), out=tmp_path / "resumed", resume=True, run_dir=copy, **STREAM))
    assert resumed["data_workers"] == 2  # on this CPU auto alone would be 0, which the checkpoint's position refuses
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    record = json.loads((tmp_path / "resumed" / "surgery.json").read_text())
    assert record["uptraining"]["data_workers"] == 2
