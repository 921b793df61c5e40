"""`convert --to swa --global-layers auto` calibrates on windows of 4 W unless --calib-window is given, and a given
--calib-window is honoured even at its default's value (512): the options model knows what was given
(`model_fields_set`), from the command line as from the Python API."""

from __future__ import annotations

import json

import pytest

import surgery
from surgery.testing import tiny_models as tm

WINDOW = 64  # 4 W = 256, not --calib-window's default of 512
RUN = ["--window", str(WINDOW), "--global-layers", "auto:1", "--layer-score", "mass", "--calib", "pydoc",
       "--calib-tokens", "1024"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The tiny Llama (character tokenizer) with 1,024 positions, so that 4 W and 512 both fit."""
    folder = tm.tiny("llama", tmp_path_factory.mktemp("swa-calib") / "llama")
    config = json.loads((folder / "config.json").read_text()) | {"max_position_embeddings": 1024}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def window_length(out) -> int:
    return json.loads((out / "surgery.json").read_text())["calibration"]["window_length"]


def test_the_default_s_value_given_is_honoured_and_not_given_is_4w(llama, tmp_path, cli):
    code, _, err = cli("convert", llama, "--to", "swa", *RUN, "--calib-window", "512", "--out", tmp_path / "given")
    assert code == 0, err
    assert window_length(tmp_path / "given") == 512
    code, _, err = cli("convert", llama, "--to", "swa", *RUN, "--out", tmp_path / "default")
    assert code == 0, err
    assert window_length(tmp_path / "default") == 4 * WINDOW
    api = surgery.convert(str(llama), tmp_path / "api", to="swa", window=WINDOW, global_layers="auto:1",
                          layer_score="mass", calib="pydoc", calib_tokens=1024, calib_window=512)
    assert window_length(api.folder) == 512
