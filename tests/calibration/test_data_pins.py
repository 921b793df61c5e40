"""Pins and lineage: `@revision` on hub dataset specs reaches `datasets`, and the commit each hub dataset and the
source resolved to is recorded (surgery.json's "source.commit", "calibration.data_commits"). The hub is not
reachable here: `datasets` and the hub client are replaced by fakes that record what they are asked."""

import json
from types import SimpleNamespace

import datasets
import pytest
from huggingface_hub import HfApi, constants

from surgery.calibration.text import calibration_text
from surgery.data import dataset_commit, dataset_commits, hub_dataset_id, parse_hub_spec

COMMIT = "0123456789abcdef0123456789abcdef01234567"
MOVED = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.mark.parametrize("spec,parsed", [
    ("someone/ds", ("someone/ds", None, "train", None)),
    ("someone/ds:cfg@test", ("someone/ds", "cfg", "test", None)),  # `@split` keeps its meaning
    ("someone/ds:cfg@test@v1.0", ("someone/ds", "cfg", "test", "v1.0")),
    ("someone/ds@@" + COMMIT, ("someone/ds", None, "train", COMMIT)),
])
def test_hub_specs_take_a_revision_after_the_split(spec, parsed):
    assert parse_hub_spec(spec) == parsed


def test_which_specs_are_hub_datasets(tmp_path):
    assert hub_dataset_id("someone/ds:cfg@test@v1") == "someone/ds"
    assert hub_dataset_id(f"hf://datasets/allenai/c4@{COMMIT}/en/x.json.gz") == "allenai/c4"
    for local in ("pydoc", "general", str(tmp_path / "a.jsonl"), "./data/*.txt", "notes.txt"):
        assert hub_dataset_id(local) is None, local
    assert dataset_commits(["pydoc", str(tmp_path / "a.jsonl")]) == {}


@pytest.fixture
def online(monkeypatch):
    """The hub as an answer to `dataset_info`: the commit a revision names now (MOVED for a branch)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    asked = []

    def dataset_info(self, repo_id, revision=None, **kw):
        asked.append((repo_id, revision))
        return SimpleNamespace(sha=MOVED)

    monkeypatch.setattr(HfApi, "dataset_info", dataset_info)
    return asked


def test_a_branch_is_resolved_on_the_hub_and_a_commit_is_kept_as_it_is(online):
    assert dataset_commit("someone/ds:cfg@test@main") == MOVED
    assert dataset_commit("someone/ds") == MOVED
    assert online == [("someone/ds", "main"), ("someone/ds", None)]
    assert dataset_commit(f"someone/ds@train@{COMMIT}") == COMMIT  # pinned: nothing to ask
    assert dataset_commit(f"hf://datasets/allenai/c4@{COMMIT}/en/x.json.gz") == COMMIT
    assert len(online) == 2


def test_offline_the_commit_is_unknown(online, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert dataset_commit("someone/ds@train@main") is None and online == []


def test_calibration_on_a_hub_dataset_reads_its_revision_and_records_its_commit(online, monkeypatch, tokenizer):
    from pydoc_data.topics import topics

    loads = []

    def load_dataset(name, config=None, split=None, streaming=False, revision=None, **kw):
        loads.append((name, config, split, revision))
        return datasets.Dataset.from_dict({"text": [topics[k] for k in sorted(topics)[:40]]})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    text = calibration_text("someone/ds:cfg@validation@v2", tokenizer, 512, None, window=128)
    assert loads == [("someone/ds", "cfg", "validation", "v2")]
    assert text.record()["data_commits"] == {"someone/ds:cfg@validation@v2": MOVED}
    mixed = calibration_text(["pydoc", f"other/ds@@{COMMIT}"], tokenizer, 512, None, window=128)
    assert loads[-1] == ("other/ds", None, "train", COMMIT)
    assert mixed.record()["data_commits"] == {f"other/ds@@{COMMIT}": COMMIT}
    assert "data_commits" not in calibration_text("pydoc", tokenizer, 256, None, window=128).record()


def test_the_source_commit_is_the_snapshot_the_hub_id_resolved_to(tmp_path, monkeypatch):
    import huggingface_hub

    from surgery.checkpoint.record import new_record
    from surgery.checkpoint.source import resolve_source
    from surgery.testing import tiny_models as tm

    snapshot = tmp_path / "hub" / "models--alice--tiny" / "snapshots" / COMMIT
    tm.make_tiny("llama", snapshot)
    calls = []

    def snapshot_download(repo_id, revision=None, **kw):
        calls.append((repo_id, revision))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    source = resolve_source("alice/tiny", revision="main")
    assert calls == [("alice/tiny", "main")] and source.commit == COMMIT
    record = new_record("mqa", source, {})
    assert record["source"]["revision"] == "main" and record["source"]["commit"] == COMMIT
    local = resolve_source(str(snapshot))  # the same folder named as a local path: not from the hub
    assert local.commit is None and new_record("mqa", local, {})["source"]["commit"] is None


def test_uptraining_on_a_hub_dataset_reads_its_revision_and_records_its_commit(online, monkeypatch, tiny, tmp_path):
    from pydoc_data.topics import topics

    from surgery.testing.pydoc_llama import FAST
    from surgery.training import UptrainOptions, uptrain

    loads = []

    def load_dataset(name, config=None, split=None, streaming=False, revision=None, **kw):
        loads.append((name, split, revision))
        return datasets.Dataset.from_dict({"text": [topics[k] for k in sorted(topics)]})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    spec = "someone/corpus@train@main"
    record = uptrain(UptrainOptions(model=str(tiny), out=tmp_path / "o", **(FAST | dict(data=[spec], loss="lm",
                                                                                       tokens=1024))))
    assert loads and set(loads) == {("someone/corpus", "train", "main")}
    assert record["data_commits"] == {spec: MOVED}
    saved = json.loads((tmp_path / "o" / "surgery.json").read_text())["uptraining"]
    assert saved["data_commits"] == {spec: MOVED}
