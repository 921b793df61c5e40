"""`uptrain --report-to`: accelerate's experiment trackers get the run's configuration and the metrics the run writes
to metrics.jsonl (TensorBoard read back from its event file; W&B offline, read back from its run files)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from surgery.errors import SurgeryError
from surgery.testing.pydoc_llama import FAST, metrics
from surgery.training import UptrainOptions, uptrain
from surgery.training.trackers import flat_config, parse_report_to, require_trackers


def run(model, out, **kw) -> dict:
    return uptrain(UptrainOptions(model=str(model), out=out, **(FAST | dict(loss="lm", tokens=512 * 4,
                                                                                eval_every=2) | kw)))


def test_report_to_parses_lists_and_refuses_unknown_names_in_one_line():
    assert parse_report_to("none") == []
    assert parse_report_to("tensorboard, wandb,tensorboard") == ["tensorboard", "wandb"]
    assert parse_report_to(["mlflow"]) == ["mlflow"]
    with pytest.raises(SurgeryError, match="unknown --report-to 'neptune'; choose from none, tensorboard"):
        parse_report_to("tensorboard,neptune")
    with pytest.raises(SurgeryError, match="none cannot be combined"):
        parse_report_to("none,wandb")
    with pytest.raises(SurgeryError, match="unknown --report-to 'comet'"):
        UptrainOptions(model="m", out="o", tokens=1, report_to="comet")


def test_a_missing_tracker_package_is_one_line_naming_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(SurgeryError) as e:
        require_trackers(["tensorboard", "mlflow"])
    assert str(e.value) == "--report-to mlflow needs the mlflow package: pip install mlflow"


def test_missing_tracker_is_refused_on_the_command_line_before_anything_is_written(cli, tiny, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trackio" else real(name, *a))
    code, out, err = cli("uptrain", tiny, "--out", tmp_path / "o", "--tokens", "512", "--data", "pydoc",
                         "--report-to", "trackio")
    assert code == 2 and err.strip().endswith("--report-to trackio needs the trackio package: pip install trackio")
    assert "Traceback" not in err and not (tmp_path / "o").exists() and not (tmp_path / "o.run").exists()


def test_flat_config_holds_only_what_tensorboard_hparams_take():
    flat = flat_config({"data": ["a", "b"], "lr": 1e-3, "teacher": None, "lora": {"rank": 4}, "x": float("nan"),
                        "train": True})
    assert flat == {"data": "a,b", "lr": 1e-3, "teacher": "None", "lora.rank": 4, "x": "nan", "train": True}


def test_tensorboard_gets_every_metrics_line_and_the_configuration(tiny, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "tb"
    run(tiny, out, report_to="tensorboard")
    rows = metrics(out)
    events = sorted((out / "runs").rglob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file in the output"
    scalars: dict[str, dict[int, float]] = {}
    for event_file in events:
        acc = EventAccumulator(str(event_file))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_ppl" in r]
    assert len(train) == 4 and len(evals) == 3  # steps 1-4; evaluations at 0, 2, 4
    assert scalars["loss"] == pytest.approx({r["step"]: r["loss"] for r in train}, rel=1e-5)
    assert scalars["lr"] == pytest.approx({r["step"]: r["lr"] for r in train}, rel=1e-5)
    assert scalars["eval_ppl"] == pytest.approx({r["step"]: r["eval_ppl"] for r in evals}, rel=1e-5)
    hparams = list((out / "runs").rglob("hparams.yml"))
    assert hparams and "lr: 0.003" in hparams[0].read_text() and "seq_len: 64" in hparams[0].read_text()
    assert not (tmp_path / "tb.run").exists()  # the run folder went; the output keeps the event files


def wandb_records(path):
    """The records of an offline W&B run file (leveldb's log format: 32 KiB blocks of chunks, each with a 7-byte
    header), parsed with wandb's own protobuf definition."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, buf = path.read_bytes(), 7, 32768, b""  # 7: the file's header (":W&B", magic, version)
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or a record's last chunk
            record = pb.Record()
            record.ParseFromString(buf)
            yield record
            buf = b""


def test_wandb_offline_gets_every_metrics_line_and_the_configuration(tiny, tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "wb"
    run(tiny, out, report_to="wandb")
    rows = metrics(out)
    files = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    history: dict[str, dict[int, float]] = {}
    config = {}
    for record in wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in record.history.item}
            for k, v in items.items():
                history.setdefault(k, {})[items["_step"]] = v
        elif kind == "config":
            config |= {(u.key or "/".join(u.nested_key)): u.value_json for u in record.config.update}
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_ppl" in r]
    assert history["loss"] == pytest.approx({r["step"]: r["loss"] for r in train}, rel=1e-5)
    assert history["eval_ppl"] == pytest.approx({r["step"]: r["eval_ppl"] for r in evals}, rel=1e-5)
    assert json.loads(config["seq_len"]) == {"value": 64} or json.loads(config["seq_len"]) == 64
    assert "report_to" in config


def test_a_tracker_that_cannot_start_is_one_line_and_leaves_no_run_folder(tiny, tmp_path, monkeypatch):
    """W&B without a login (or MLflow with a bad URI) raised from inside accelerate: a traceback, exit 1, and a run
    folder left behind before any step."""
    from accelerate import Accelerator

    def refuse(self, *a, **kw):
        raise RuntimeError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(Accelerator, "init_trackers", refuse)
    with pytest.raises(SurgeryError) as e:
        run(tiny, tmp_path / "o", report_to="tensorboard")
    assert str(e.value) == ("--report-to tensorboard: the tracker cannot start (No API key configured. Use `wandb "
                            "login` to log in.)")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.run").exists()
