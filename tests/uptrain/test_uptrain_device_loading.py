"""Weights read straight onto the run's device (the H100 run: a 1B KD run that loaded its student in fp32 and its
teacher on the host before moving them peaked at 17 GB of host memory)."""

from __future__ import annotations

import torch

from surgery.checkpoint.source import resolve_source
from surgery.testing.pydoc_llama import FAST
from surgery.training import UptrainOptions, model_io, uptrain
from surgery.training.model_io import load_causal_lm


def test_a_device_other_than_the_cpu_receives_every_weight_without_a_host_copy(tiny):
    """The meta device stands in for CUDA: had the weights been read onto the host first, they would be CPU tensors
    (or real values) here, not meta ones; buffers follow them."""
    model = load_causal_lm(resolve_source(str(tiny)), "model", device="meta")
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {b.device.type for b in model.buffers()} == {"meta"}
    on_host = load_causal_lm(resolve_source(str(tiny)), "model")
    assert {p.device.type for p in on_host.parameters()} == {"cpu"}


def test_a_run_without_fsdp_loads_student_and_teacher_onto_its_own_device(tiny, tmp_path, monkeypatch):
    """The run asks for its accelerator's device for both models (on this machine the CPU, which loads as before);
    the align stage keeps host loading (it moves the student itself)."""
    seen: dict[str, object] = {}
    real = model_io.load_causal_lm

    def recording(source, role, *args, **kw):
        seen[role] = kw.get("device")
        return real(source, role, *args, **kw)

    monkeypatch.setattr(model_io, "load_causal_lm", recording)
    uptrain(UptrainOptions(model=str(tiny), out=tmp_path / "o", **(FAST | dict(loss="kd", teacher=str(tiny),
                                                                              tokens=512))))
    assert seen == {"model": torch.device("cpu"), "teacher": torch.device("cpu")}
