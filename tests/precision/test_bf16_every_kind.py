"""Every kind, in bf16 on the CPU, through the same code a GPU runs: converted (calibrated kinds calibrate under bf16
autocast), uptrained a few steps under accelerate's bf16 mixed precision, and checked under bf16 autocast. bf16 on
the CPU is torch's CPU autocast, so a dtype bug of the GPU path (talking-heads' fp32 mask value written into bf16
scores, a head probe that bf16 rounding turns off) fails here."""

from __future__ import annotations

import math
from contextlib import contextmanager

import pytest
import torch

from surgery.checkpoint.record import read_record
from surgery.checkpoint.source import resolve_source
from surgery.commands.check import CheckOptions, check_checkpoints
from surgery.kinds import get_kind
from surgery.testing.pydoc_llama import FAST
from surgery.training import UptrainOptions, uptrain

CALIB = dict(calib=["pydoc"], calib_tokens=256, calib_window=64)
KINDS = {  # kind -> its options on the tiny Llama (4 query heads, 2 K/V heads)
    "mqa": {},
    "gqa-aligned": dict(kv_heads=1, merge="aligned", **CALIB),
    "mla": dict(kv_rank=16, **CALIB),
    "talking-heads": {},
    "switchhead": dict(heads=2, experts=2, topk=1, **CALIB),
}
CHECK = dict(data=["pydoc"], tokens=256, seq_len=64, batch_size=4, device="cpu")


@contextmanager
def output_dtypes():
    """{module class name: the dtypes of its tensor outputs} for every module forward inside the block."""
    seen: dict[str, set] = {}

    def hook(module, args, out):
        t = out[0] if isinstance(out, (tuple, list)) and out else out
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            seen.setdefault(type(module).__name__, set()).add(t.dtype)

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def bf16_attention(seen: dict) -> set:
    """The attention classes that produced bf16 outputs."""
    return {name for name, dtypes in seen.items() if "Attention" in name and torch.bfloat16 in dtypes}


@pytest.mark.parametrize("name", list(KINDS))
def test_every_kind_converts_uptrains_and_checks_in_bf16_on_cpu(name, tiny, tmp_path, capsys):
    kind = get_kind(name.removesuffix("-aligned"))
    options = KINDS[name] | ({"precision": "bf16"} if "calib" in KINDS[name] else {})
    converted = tmp_path / "converted"
    record = kind.convert(resolve_source(str(tiny)), converted, kind.options(**options))
    if "calib" in options:
        assert record["calibration"]["precision"] == "bf16"

    out = tmp_path / "trained"
    with output_dtypes() as seen:
        run = uptrain(UptrainOptions(model=str(converted), out=out, precision="bf16",
                                     **(FAST | dict(tokens=512 * 2, micro_batch=8, eval_tokens=256))))
    assert bf16_attention(seen), seen  # the converted attention really ran under bf16 autocast
    assert run["precision"] == read_record(out)["uptraining"]["precision"] == "bf16"
    assert run["loss"] == "kd" and math.isfinite(run["final_train_loss"])
    assert math.isfinite(run["initial_eval_ppl"]) and math.isfinite(run["final_eval_ppl"])
    assert run["final_eval_ppl"] < run["initial_eval_ppl"] * 1.05  # two steps toward the teacher: not away from it

    reports = {}
    for precision in ("bf16", "fp32"):
        with output_dtypes() as seen:
            reports[precision] = check_checkpoints(str(tiny), str(out), CheckOptions(**CHECK, precision=precision),
                                                   json_out=tmp_path / f"check-{precision}.json", warn=lambda s: None)
        assert bool(bf16_attention(seen)) == (precision == "bf16")
    bf16, fp32 = reports["bf16"], reports["fp32"]
    assert (bf16["precision"], fp32["precision"]) == ("bf16", "fp32")
    assert bf16["tolerance"] == 1e-1 and fp32["tolerance"] == 1e-4
    for key in ("kl", "ppl_source", "ppl_converted", "max_abs_diff"):
        assert math.isfinite(bf16[key]) and math.isfinite(fp32[key])
    # the same comparison at bf16's precision: close to the fp32 numbers, not equal to them
    assert bf16["ppl_converted"] == pytest.approx(fp32["ppl_converted"], rel=0.02)
    assert bf16["kl"] == pytest.approx(fp32["kl"], rel=0.25, abs=2e-3)
    assert bf16["mean_abs_diff"] != fp32["mean_abs_diff"]
