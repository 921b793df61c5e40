"""What an output carries and what reaches the hub: side files, machine paths, report text in the model card.

- Side files (tokenizer files, licences, generation config, the source's code) are copied beside the weights only
  when they are regular files inside the source folder: a link to a file elsewhere on this machine is refused in
  one line, before anything is written (copying follows links; `push` would upload that file).
- Nothing that names this machine's filesystem reaches the hub: every kind of record (convert, aligned merge with
  calibration, two uptrainings in a row, a check on several texts, a bench report) is pushed to the loopback hub
  (tests/hub_server.py) with its texts given as absolute and cwd-relative paths, and every byte stored is searched.
- Report text (names of texts, generations, a stranger's record) is escaped in the card: tables keep their columns,
  no HTML tag, heading or link opens.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hostile import cli_error, hostile_checkpoint, ran
from hub_server import TOKEN, LocalHub, download, hub_env
from inprocess import REPO, assert_one_line_error, surgery

from surgery.testing import tiny_models as tm
from surgery.testing.tiny_models import char_tokenizer

from surgery.data import pydoc_texts

SECRET = "SECRET-of-this-machine-0123456789"
UPTRAIN_FAST = ("--tokens", "128", "--seq-len", "32", "--batch-tokens", "128", "--micro-batch", "4",
                "--eval-tokens", "64", "--save-every", "0")


def source(folder: Path) -> Path:
    tm.make_tiny("llama", folder)
    char_tokenizer(folder)
    return folder


@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "elsewhere" / "id_secret"
    path.parent.mkdir()
    path.write_text(SECRET)
    return path


# ---- side files -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["LICENSE", "vocab.txt", "tokenizer_config.json"])
def test_convert_refuses_a_side_file_linking_outside_the_source(name, secret, tmp_path):
    src = source(tmp_path / "src")
    (src / name).unlink(missing_ok=True)
    (src / name).symlink_to(secret)
    assert (src / name).read_text() == SECRET  # the control: following the link reads the other file
    message = cli_error("convert", src, "--to", "mqa", "--out", tmp_path / "out")
    assert name in message and "outside the checkpoint folder" in message and str(secret) in message
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.slow  # 10-30 s: keeps the default suite under 25 minutes on 2 cores
def test_side_files_inside_the_source_are_copied_and_others_refused_in_one_line(secret, tmp_path):
    src = source(tmp_path / "src")
    (src / "legal").mkdir()
    (src / "legal" / "LICENSE.txt").write_text("MIT\n")
    (src / "LICENSE").symlink_to(Path("legal") / "LICENSE.txt")  # a link that stays inside: fine
    ok = surgery("convert", src, "--to", "mqa", "--out", tmp_path / "ok")
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "ok" / "LICENSE").read_text() == "MIT\n" and not (tmp_path / "ok" / "LICENSE").is_symlink()

    (src / "LICENSE").unlink()
    (src / "LICENSE").symlink_to(Path("..") / secret.relative_to(tmp_path).parent / secret.name)  # relative, escaping
    assert_one_line_error(surgery("convert", src, "--to", "mqa", "--out", tmp_path / "out"), "LICENSE",
                          "outside the checkpoint folder")
    (src / "LICENSE").unlink()
    os.mkfifo(src / "tokenizer.model")  # not a regular file: refused, not waited on
    assert "FIFO" in cli_error("convert", src, "--to", "mqa", "--out", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_uptrain_refuses_linked_side_files_and_code_before_training(secret, tmp_path):
    src = source(tmp_path / "src")
    (src / "LICENSE").symlink_to(secret)
    args = ("uptrain", src, "--out", tmp_path / "out", "--loss", "lm", *UPTRAIN_FAST)
    assert_one_line_error(surgery(*args), "LICENSE", "outside the checkpoint folder")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.run").exists()
    (src / "LICENSE").unlink()
    (src / "helpers.py").symlink_to(secret)  # uptrain carries every top-level .py of its input
    message = cli_error(*args)
    assert "helpers.py" in message and "outside the checkpoint folder" in message


def test_convert_refuses_custom_code_linking_outside_the_source(tmp_path):
    markers = tmp_path / "markers"
    src = hostile_checkpoint(tmp_path / "src", markers)
    outside = tmp_path / "elsewhere" / "modeling_x.py"
    outside.parent.mkdir()
    (src / "modeling_x.py").rename(outside)
    (src / "modeling_x.py").symlink_to(outside)
    message = cli_error("convert", src, "--to", "mqa", "--out", tmp_path / "out")
    assert "modeling_x.py" in message and "outside the checkpoint folder" in message
    assert ran(markers) == [] and not (tmp_path / "out").exists()


def test_a_hub_snapshot_links_into_its_blobs_and_nowhere_else(secret, tmp_path):
    """huggingface_hub's cache: snapshots/REV/NAME -> ../../blobs/SHA. Those links are the snapshot's own files."""
    from surgery.errors import SurgeryError
    from surgery.checkpoint.source import side_files

    repo = tmp_path / "hub" / "models--alice--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (repo / "blobs" / "abc").write_text("{}")
    (snapshot / "tokenizer_config.json").symlink_to(Path("..") / ".." / "blobs" / "abc")
    assert [p.name for p in side_files(snapshot)] == ["tokenizer_config.json"]
    (snapshot / "LICENSE").symlink_to(secret)
    with pytest.raises(SurgeryError, match="LICENSE .* outside the checkpoint folder"):
        side_files(snapshot)


# ---- nothing pushed names this machine ----------------------------------------------------------------------
@pytest.fixture
def hub(tmp_path):
    with LocalHub(tmp_path / "hub-data", {TOKEN: "alice"}) as h:
        yield h


def run_in(cwd: Path, *args) -> subprocess.CompletedProcess:
    """`surgery ARGS` run from `cwd` (for texts named relative to it)."""
    result = subprocess.run([sys.executable, "-m", "cli", *map(str, args)], cwd=cwd, capture_output=True, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}, timeout=300)
    assert result.returncode == 0, result.stderr
    return result


def machine_paths(tmp_path: Path) -> list[str]:
    return [str(tmp_path), str(tmp_path.resolve()), str(Path.home()), os.getcwd(), str(REPO), sys.prefix]


@pytest.mark.slow  # ~50 s
def test_nothing_pushed_names_this_machine(hub, tmp_path):
    work = tmp_path / "work"
    texts = work / "texts"
    texts.mkdir(parents=True)
    docs = pydoc_texts()
    for i, name in enumerate(["train-0.txt", "train-1.txt", "train-2.txt", "held.txt", "calib.txt", "other.txt"]):
        (texts / name).write_text("\n".join(docs[i * 3:(i + 1) * 3]))  # .txt: a document per file
    src = source(work / "src")
    run_in(work, "convert", src, "--to", "gqa", "--kv-heads", "2", "--merge", "aligned", "--calib",
           texts / "calib.txt", "--calib", "texts/other.txt", "--calib-tokens", "256", "--out", work / "aligned")
    run_in(work, "uptrain", work / "aligned", "--out", work / "up1", "--data", texts / "train-*.txt", "--eval-data",
           texts / "held.txt", "--loss", "lm", *UPTRAIN_FAST)
    run_in(work, "uptrain", "up1", "--out", "up2", "--data", "texts/train-*.txt", "--eval-data", "texts/*.txt",
           *UPTRAIN_FAST)  # KD from the source surgery.json names; the second uptraining nests the first
    run_in(work, "check", src, "up2", "--data", texts / "held.txt", "--data", "texts/other.txt", "--generate", "4",
           "--tokens", "128", "--seq-len", "32", "--json", "check.json")
    run_in(work, "bench", src, "up2", "--context", "8", "--new", "2", "--rounds", "1", "--threads", "1",
           "--json", "bench.json")
    record = json.loads((work / "up2" / "surgery.json").read_text())
    assert len(record["previous_uptraining"]) == 1 and record["calibration"]["mixture"]  # every kind is there
    assert str(texts) in json.dumps(record)  # the local record keeps the paths as typed (for local checks)

    # up2's record holds them all: the conversion's (with its calibration), both uptrainings'
    result = subprocess.run([sys.executable, "-m", "cli", "push", "up2", "alice/up2", "--check-report", "check.json",
                             "--bench-report", "bench.json"], cwd=work, capture_output=True, text=True, timeout=300,
                            env={**os.environ, **hub_env(hub, tmp_path), "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    card = (download(hub, "alice/up2", tmp_path / "dl") / "README.md").read_text()
    assert "held.txt\\[0:" in card and "other.txt\\[0:" in card  # the texts are named, by file name only
    assert "train-\\*.txt" in card

    stored = [p for p in (tmp_path / "hub-data").rglob("*") if p.is_file()]
    repo = hub.repos["alice/up2"]
    uploaded = set(repo.commits[repo.refs["main"]].files)
    assert {"surgery.json", "README.md", "config.json", "tokenizer_config.json", "uptrain_metrics.jsonl"} <= uploaded
    assert len(stored) >= len(uploaded)
    for path in stored:
        data = path.read_bytes().decode("utf-8", errors="ignore")
        for machine_path in machine_paths(tmp_path):
            assert machine_path not in data, (path.name, machine_path)


def test_push_refuses_a_file_linking_outside_the_folder(hub, secret, tmp_path):
    src = source(tmp_path / "src")
    assert surgery("convert", src, "--to", "mqa", "--out", tmp_path / "mqa").returncode == 0
    (tmp_path / "mqa" / "NOTES.txt").symlink_to(secret)  # not a weight, code or config file: no hash covers it
    result = surgery("push", tmp_path / "mqa", "alice/x", env=hub_env(hub, tmp_path))
    assert_one_line_error(result, "NOTES.txt", "outside the checkpoint folder")
    assert hub.repos == {}  # refused before the repository is created
    (tmp_path / "mqa" / "NOTES.txt").unlink()
    (tmp_path / "mqa" / "NOTES.txt").symlink_to("config.json")  # a link inside the folder goes up as its file
    result = surgery("push", tmp_path / "mqa", "alice/x", env=hub_env(hub, tmp_path))
    assert result.returncode == 0, result.stderr
    back = download(hub, "alice/x", tmp_path / "dl")
    assert (back / "NOTES.txt").read_bytes() == (tmp_path / "mqa" / "config.json").read_bytes()


# ---- card injection -----------------------------------------------------------------------------------------
HOSTILE = "<script>alert(1)</script> | col\n# Heading `code` [link](http://x) &amp; *em*"


def table_rows(card: str, header_start: str) -> list[str]:
    lines = card.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def cells(row: str) -> int:
    return len(re.split(r"(?<!\\)\|", row.strip())) - 2  # GFM splits on unescaped |


def test_report_text_is_escaped_in_the_card(tmp_path):
    from surgery.publish import validate_folder
    from surgery.publish.card import build_card

    src = source(tmp_path / "src")
    assert surgery("convert", src, "--to", "mqa", "--out", tmp_path / "mqa").returncode == 0
    row = {"tokens": 64, "max_abs_diff": 0.5, "kl": 0.1, "top1_agreement": 0.9, "ppl_source": 9.0,
           "ppl_converted": 10.0}
    report = row | {"texts": [row | {"data": HOSTILE, "text": HOSTILE}, row | {"data": "/home/u/a.txt"}],
                    "generation": {"prompts": 1, "new_tokens": 4, "token_agreement": 0.5, "mean_first_divergence": 2.0,
                                   "samples": [{"prompt": HOSTILE, "source": "</table><img src=x onerror=alert(1)>",
                                                "converted": "| a | b |\n|---|"}]},
                    "tasks": {HOSTILE: {"source": {"acc": 0.5}, "converted": {"acc": 0.6}}}}
    bench = {"engine": "<i>transformers</i>", "dtype": "float32 | x", "machine": {"processor": "<b>cpu</b>", "threads": 1},
             "date": "2026", "rounds": 1, "new_tokens": 2, "results": []}
    card = build_card(validate_folder(tmp_path / "mqa"), "alice/x", [(HOSTILE, report)], bench=bench)

    assert not re.search(r"<\s*/?\s*(script|img|table|b|i)\b", card, re.I)  # no raw HTML tag from the reports
    assert "/home/u" not in card and "a.txt\\[0:64]" in card  # a local text by its name (`[` escaped)
    headings = [line for line in card.splitlines() if line.startswith("#")]
    assert not any("Heading" in h for h in headings)  # no heading opened by a name
    assert "[link]" in card.replace("\\[", "[") and not re.search(r"(?<!\\)\[link\]", card)  # no link opens
    for header in ("| report | tokens", "| report | prompts", "| report | prompt |", "| report | task"):
        rows = table_rows(card, header)
        assert len(rows) >= 3 and len({cells(r) for r in rows}) == 1, rows  # every row has the header's columns
    check_rows = table_rows(card, "| report | tokens")
    assert len(check_rows) == 2 + 2  # header, rule, a row per text: no row added by a name's | or newline
    assert "&lt;script&gt;" in card and "&#124;" in card  # the characters are still there, as entities
