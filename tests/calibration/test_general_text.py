"""The default text of calibration and uptraining (surgery/general_text.py): C4 at a pinned revision, streamed from
the hub (here the loopback hub, serving a tiny shard under that name and commit); offline, pydoc with one line on
stderr and no request sent; and `check` warning when its only text is what the model was fitted to."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hub_server import LocalHub

from surgery import general_text as g
from surgery.checking.overlap import document_sha256
from surgery.testing.tiny_models import char_tokenizer, tiny

REPO = Path(__file__).resolve().parents[2]
DOCS = [f"Document {i} of the general text: the market opened at nine and the rain stopped by noon. " * 3
        for i in range(40)]


def shard(docs: list[str]) -> bytes:
    return gzip.compress("".join(json.dumps({"text": d, "url": f"https://example.org/{i}"}) + "\n"
                                 for i, d in enumerate(docs)).encode())


@pytest.fixture
def hub(tmp_path):
    with LocalHub(tmp_path / "hub-data", {}) as h:
        h.add_dataset(g.GENERAL_REPO, {g.GENERAL_FILE: shard(DOCS), "README.md": b"---\nlicense: odc-by\n---\n"},
                      sha=g.GENERAL_REVISION)
        yield h


def env_for(hub: LocalHub | None, tmp_path: Path, offline: bool) -> dict:
    return {**os.environ, "HF_ENDPOINT": hub.endpoint if hub else "http://127.0.0.1:9", "HF_HUB_DISABLE_XET": "1",
            "HF_HUB_OFFLINE": "1" if offline else "0", "HF_HOME": str(tmp_path / "hf-home"),
            "HF_DATASETS_CACHE": str(tmp_path / "ds-cache"), "OMP_NUM_THREADS": "1"}


def surgery(*args, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=600)


ONLINE = """
import json, sys
from transformers import AutoTokenizer
from surgery import general_text as g
from surgery.calibration.text import calibration_text
from surgery.data import load_texts
from surgery.kinds import get_kind
from surgery.training import UptrainOptions
calib = get_kind("mqa").options.model_validate({"merge": "aligned"}).calib
record = calibration_text(calib, AutoTokenizer.from_pretrained(sys.argv[1]), 512, None, window=64).record()
print(json.dumps({"calib": calib, "resolved": g.resolve_text("general"), "pydoc": g.resolve_text("pydoc"),
                  "docs": list(load_texts("general")), "record": record,
                  "uptrain": UptrainOptions(model="m", out=sys.argv[1], tokens=8, seq_len=4, batch_tokens=8).data}))
"""


def test_calibration_and_uptraining_default_to_the_pinned_shard_streamed_from_the_hub(hub, tmp_path):
    char_tokenizer(tmp_path / "tok")
    run = subprocess.run([sys.executable, "-c", ONLINE, str(tmp_path / "tok")], cwd=REPO, capture_output=True,
                         text=True, env=env_for(hub, tmp_path, offline=False), timeout=300)
    assert run.returncode == 0, run.stderr
    assert "pydoc" not in run.stderr  # online: no line
    got = json.loads(run.stdout.splitlines()[-1])
    url = f"hf://datasets/allenai/c4@{g.GENERAL_REVISION}/{g.GENERAL_FILE}"
    assert got["calib"] == ["general"] and got["resolved"] == url and got["uptrain"] == [url]  # uptrain: a list (mixtures)
    assert got["pydoc"] == "pydoc"  # an explicit text is read as it always was
    assert got["docs"] == DOCS
    assert got["record"]["data"] == url  # surgery.json names the dataset, its revision and file
    from surgery.checkpoint.record import public_data

    assert public_data(url) == url  # and the card shows it whole (not as a local file's name)
    n = len(got["record"]["documents_sha256"])
    assert n > 1 and got["record"]["documents_sha256"] == [document_sha256(d) for d in DOCS[:n]]
    paths = [p for _, p, _ in hub.requests if "allenai/c4" in p]
    assert paths and all(g.GENERAL_REVISION in p for p in paths), paths  # only the pinned commit is read
    assert any(p.endswith(g.GENERAL_FILE) and "/resolve/" in p for p in paths)


def test_offline_reads_pydoc_says_so_once_and_sends_nothing(hub, tmp_path):
    src = tiny("llama", tmp_path / "src")
    run = surgery("convert", src, "--to", "mqa", "--merge", "aligned", "--calib-tokens", "256", "--device", "cpu",
                  "--out", tmp_path / "out", env=env_for(hub, tmp_path, offline=True))
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stderr.splitlines() if "pydoc" in line]
    assert lines == ["surgery: warning: HF_HUB_OFFLINE is set: reading the embedded pydoc text instead of allenai/c4 "
                     "(general web text)"]
    assert json.loads((tmp_path / "out" / "surgery.json").read_text())["calibration"]["data"] == "pydoc"
    assert hub.requests == []  # nothing reached the (loopback) network
    from surgery.publish.card import conversion_section
    from surgery.publish.validate import validate_folder

    card = conversion_section(validate_folder(tmp_path / "out"), {"base_model": None, "spec": str(src), "revision": None,
                                                                  "folder": src})
    assert "Calibrated on 256 tokens of pydoc." in card


def test_an_unreachable_hub_reads_pydoc_with_one_line_when_read(tmp_path, monkeypatch, caplog):
    import logging

    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    g.resolve_general.cache_clear()
    caplog.set_level(logging.INFO, logger="surgery")
    try:
        assert g.resolve_text("general") == g.resolve_text("general") == "pydoc"
        assert caplog.records == []  # decided, not yet read: a refusal now would print its line alone
        from surgery.data import load_texts

        assert list(load_texts("general")) == list(load_texts("general")) == list(load_texts("pydoc"))
    finally:
        g.resolve_general.cache_clear()
    said = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]  # the command line: a warning line
    assert len(said) == 1 and said[0][:2] == ("surgery.general_text", "WARNING")
    assert said[0][2].startswith("cannot read allenai/c4@1588ec45 from the hub (")
    assert said[0][2].endswith(": reading the embedded pydoc text instead of allenai/c4 (general web text)")


@pytest.mark.slow  # 10-30 s: keeps the default suite under 25 minutes on 2 cores
def test_dry_run_names_the_text_and_an_explicit_pydoc_is_kept(hub, tmp_path):
    src = tiny("llama", tmp_path / "src")
    env = env_for(hub, tmp_path, offline=False)
    run = surgery("convert", src, "--to", "mqa", "--merge", "aligned", "--dry-run", "--device", "cpu", env=env)
    assert run.returncode == 0, run.stderr
    assert (f"calibration text: general web text ({g.GENERAL_REPO}@{g.GENERAL_REVISION[:8]}, {g.GENERAL_FILE}, "
            "streamed)") in run.stdout.splitlines()
    offline = surgery("convert", src, "--to", "mqa", "--merge", "aligned", "--dry-run", "--device", "cpu",
                      env=env_for(None, tmp_path, offline=True))
    assert "calibration text: pydoc (the general default offline: HF_HUB_OFFLINE is set)" in offline.stdout.splitlines()
    run = surgery("convert", src, "--to", "mqa", "--merge", "aligned", "--calib", "pydoc", "--dry-run", "--device",
                  "cpu", env=env)
    assert "calibration text: pydoc" in run.stdout.splitlines()


@pytest.mark.slow  # 10-30 s: keeps the default suite under 25 minutes on 2 cores
def test_check_warns_when_its_only_text_is_what_the_model_was_fitted_to(tmp_path):
    src = tiny("llama", tmp_path / "src")
    env = env_for(None, tmp_path, offline=True)
    assert surgery("convert", src, "--to", "mqa", "--merge", "aligned", "--calib", "pydoc", "--calib-tokens", "256",
                   "--device", "cpu", "--out", tmp_path / "out", env=env).returncode == 0
    common = ("--tokens", "64", "--seq-len", "32", "--device", "cpu")
    warned = surgery("check", src, tmp_path / "out", *common, env=env)
    assert warned.returncode == 0, warned.stderr
    lines = [line for line in warned.stderr.splitlines() if "the only text checked" in line]
    assert lines == ["surgery: warning: pydoc, the only text checked, is the text the model was calibrated on "
                     "(surgery.json): its numbers flatter the conversion; add a --data of another domain"]
    other = tmp_path / "other.txt"
    other.write_text("A text of another domain, about boats and rivers and the weather on the coast. " * 20)
    for data in (["--data", other], ["--data", "pydoc", "--data", other]):
        quiet = surgery("check", src, tmp_path / "out", *data, *common, env=env)
        assert quiet.returncode == 0, quiet.stderr
        assert "the only text checked" not in quiet.stderr
