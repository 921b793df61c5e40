"""`--calib A --calib B`: calibration text mixed from several domains, each an equal share of the windows, read as it
would be alone; the record names every text and every document, so `check` warns about any of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from surgery.calibration.text import calibration_text
from surgery.checking.overlap import calibration_overlap, document_sha256
from surgery.data import pydoc_texts, token_stream
from surgery.errors import SurgeryError
from surgery.testing.tiny_models import char_tokenizer, tiny

REPO = Path(__file__).resolve().parents[2]


def char_ids(text: str) -> list[int]:
    return [ord(c) - 31 if 32 <= ord(c) < 127 else 0 for c in text]


@pytest.fixture
def tokenizer(tmp_path):
    from transformers import AutoTokenizer

    char_tokenizer(tmp_path / "tok")
    return AutoTokenizer.from_pretrained(tmp_path / "tok")


@pytest.fixture
def licenses(tmp_path):
    """Another domain: three documents of legal-sounding text, long enough for several windows each."""
    folder = tmp_path / "lic"
    folder.mkdir()
    for i in range(3):
        (folder / f"{i}.txt").write_text(f"License {i}. " + "Permission is hereby granted, free of charge. " * 30)
    return str(folder / "*.txt")


def test_each_text_gives_an_equal_share_of_the_windows_read_as_it_would_be_alone(tokenizer, licenses):
    alone = {spec: calibration_text(spec, tokenizer, 1024, None, window=64) for spec in ("pydoc", licenses)}
    mixed = calibration_text(["pydoc", licenses], tokenizer, 1024, None, window=64)
    assert mixed.windows.shape == (16, 64)
    # pydoc's share is the first 8 windows pydoc alone gives (from its last document), the licenses' the first 8 of
    # theirs (from the first file)
    assert torch.equal(mixed.windows[:8], alone["pydoc"].windows[:8])
    assert torch.equal(mixed.windows[8:], alone[licenses].windows[:8])
    record = mixed.record()
    assert record["data"] == f"pydoc + {licenses}" and record["tokens"] == 1024 and record["window_length"] == 64
    assert record["mixture"] == [{"data": "pydoc", "tokens": 512, "windows": 8},
                                 {"data": licenses, "tokens": 512, "windows": 8}]
    assert record["split"].startswith("mixture: pydoc: pydoc documents read from the last one backwards")
    last = next(t for t in reversed(pydoc_texts()) if t)
    lic0 = Path(licenses.replace("*", "0")).read_text()
    assert {document_sha256(last), document_sha256(lic0)} <= set(record["documents_sha256"])
    assert mixed.windows[8, :20].tolist() == char_ids(lic0)[:20]


def test_windows_that_do_not_divide_go_to_the_first_texts(tokenizer, licenses):
    mixed = calibration_text(["pydoc", licenses, "pydoc"], tokenizer, 64 * 7, None, window=64)
    assert [m["windows"] for m in mixed.mixture] == [3, 2, 2]
    assert mixed.windows.shape == (7, 64)


def test_a_mixture_refuses_what_it_cannot_share(tokenizer, licenses, tmp_path):
    with pytest.raises(SurgeryError, match="fewer windows of 64 than the 3 calibration texts"):
        calibration_text(["pydoc", licenses, "pydoc"], tokenizer, 128, None, window=64)
    (tmp_path / "tiny.txt").write_text("too short")
    with pytest.raises(SurgeryError, match=r"tiny.txt gave only 10 token\(s\), less than one window of 64"):
        calibration_text(["pydoc", str(tmp_path / "tiny.txt")], tokenizer, 256, None, window=64)


def test_cli_mixes_and_check_warns_about_any_text_of_the_mixture(tmp_path, licenses):
    src = tiny("llama", tmp_path / "src")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-m", "cli", "convert", str(src), "--to", "mqa", "--merge", "aligned",
                          "--calib", "pydoc", "--calib", licenses, "--calib-tokens", "512", "--device", "cpu",
                          "--out", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    calibration = json.loads((tmp_path / "out" / "surgery.json").read_text())["calibration"]
    assert [m["data"] for m in calibration["mixture"]] == ["pydoc", licenses]
    assert [m["tokens"] for m in calibration["mixture"]] == [256, 256]
    lic0 = Path(licenses.replace("*", "0")).read_text()
    overlap = calibration_overlap(tmp_path / "out", [document_sha256(lic0), document_sha256("unrelated")])
    assert overlap == {"documents": 1, "of": 2, "calibration": f"pydoc + {licenses}"}
    assert calibration_overlap(tmp_path / "out", [document_sha256(next(t for t in pydoc_texts() if t))]) is None


def test_a_recipe_takes_one_text_or_a_list(tmp_path):
    from surgery.kinds import get_kind

    options = get_kind("mqa").options
    assert options.model_validate({"merge": "aligned", "calib": "pydoc"}).calib == ["pydoc"]
    assert options.model_validate({"merge": "aligned", "calib": ["pydoc", "a/*.txt"]}).calib == ["pydoc", "a/*.txt"]
    with pytest.raises(ValueError, match="needs at least one text"):
        options.model_validate({"merge": "aligned", "calib": []})
