"""The one precision switch (surgery/precision.py): `--precision auto|bf16|fp32`, resolved once, refused once where
it contradicts --dtype, and honoured by bench (the models' dtype) and the calibrated conversions (their forward
passes under bf16 autocast, the statistics in float32/64)."""

from __future__ import annotations

import pytest
import torch

from inprocess import run_cli

from surgery.checkpoint.source import resolve_source
from surgery.kinds import get_kind
from surgery.precision import PrecisionOptions, resolve_precision
from surgery.testing import tiny_models as tm


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tm.tiny("llama", tmp_path_factory.mktemp("precision") / "llama")


def test_auto_is_bf16_only_where_the_device_computes_bf16():
    assert resolve_precision("auto", "cpu") == "fp32"
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"
    assert resolve_precision("bf16", "cpu") == "bf16"  # asked for: CPU autocast, the same path as CUDA's
    assert resolve_precision("fp32", "cpu") == "fp32"
    assert resolve_precision("auto", "auto") == ("bf16" if torch.cuda.is_available() and
                                                 torch.cuda.is_bf16_supported() else "fp32")
    with pytest.raises(ValueError):
        resolve_precision("fp16", "cpu")


def test_a_recipe_names_the_option_its_own_way():
    from pydantic import ValidationError

    from surgery.options import YAML
    from surgery.training.options import UptrainArgs

    recipe = UptrainArgs.model_validate({"tokens": 512, "precision": "bf16"}, context={"spelling": YAML})
    assert recipe.precision == "bf16"
    with pytest.raises(ValidationError, match="precision 'half': choose auto, bf16 or fp32"):
        UptrainArgs.model_validate({"tokens": 512, "precision": "half"}, context={"spelling": YAML})
    with pytest.raises(ValidationError, match="--precision 'half'"):
        PrecisionOptions.model_validate({"precision": "half"})


@pytest.mark.parametrize("args, fragment", [
    (["bench", "{src}", "{src}", "--precision", "fp32", "--dtype", "bfloat16"],
     "--precision fp32 contradicts --dtype bfloat16"),
    (["bench", "{src}", "{src}", "--precision", "bf16", "--dtype", "float16"],
     "--precision bf16 contradicts --dtype float16"),
    (["check", "{src}", "{src}", "--precision", "fp32", "--dtype", "bfloat16"],
     "--precision fp32 contradicts --dtype bfloat16"),
    (["convert", "{src}", "--out", "{out}", "--to", "mqa", "--precision", "bf16"],
     "--precision is calibration's precision"),
    (["uptrain", "{src}", "--out", "{out}", "--precision", "half"], "--precision"),
])
def test_contradictions_are_one_line_exit_2(llama, tmp_path, capsys, args, fragment):
    args = [a.format(src=llama, out=tmp_path / "out") for a in args]
    code, out, err = run_cli(capsys, *args)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_bench_runs_in_the_precision_s_dtype(llama):
    from surgery.bench.options import BenchOptions
    from surgery.bench.run import run_bench

    opts = dict(source=str(llama), converted=str(llama), contexts=[8], new=2, rounds=1, threads=1, device="cpu")
    assert run_bench(BenchOptions(**opts))["dtype"] == "float32"  # auto on a CPU
    report = run_bench(BenchOptions(**opts, precision="bf16"))
    assert (report["dtype"], report["precision"]) == ("bfloat16", "bf16")
    assert run_bench(BenchOptions(**opts, dtype="bfloat16"))["dtype"] == "bfloat16"  # --dtype alone still works


def test_a_bf16_calibration_runs_its_forward_passes_under_autocast_and_keeps_float32_statistics(llama, tmp_path,
                                                                                           monkeypatch):
    import surgery.calibration.stream as stream
    import surgery.calibration.capture as capture

    seen = {"autocast": set(), "queries": set()}
    real_first, real_attention = stream.first_output, capture._capture_attention

    def first_output(out):
        seen["autocast"].add(torch.is_autocast_enabled("cpu"))
        return real_first(out)

    monkeypatch.setattr(stream, "first_output", first_output)
    kind = get_kind("gqa")
    written = {}
    for precision in ("fp32", "bf16"):
        seen["autocast"].clear()
        options = kind.options(kv_heads=1, merge="aligned", calib=["pydoc"], calib_tokens=256, calib_window=64,
                               precision=precision)
        record = kind.convert(resolve_source(str(llama)), tmp_path / precision, options)
        assert record["calibration"]["precision"] == precision
        assert seen["autocast"] == {precision == "bf16"}  # every streamed layer forward, and only under bf16
        from safetensors.torch import load_file

        written[precision] = load_file(next((tmp_path / precision).glob("*.safetensors")))
    assert all(t.dtype == torch.float32 for t in written["bf16"].values())
    moved = [((written["fp32"][n] - t).norm() / written["fp32"][n].norm()).item() for n, t in written["bf16"].items()
             if n.endswith("proj.weight")]
    # bf16 activations move the merge a little (a bf16 rounding of the statistics' inputs), not a lot
    assert 0 < max(moved) < 0.1
