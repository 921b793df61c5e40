"""The model card's metadata as the hub reads it: huggingface_hub's own parser (`ModelCard.load`, `metadata_load`)
reads back the base model and its relation, the hub datasets the model was calibrated, trained and checked on, and
the check report's numbers as `model-index` results; untrusted text stays text in the metadata and escaped in the
body."""

import json
import shutil

import pytest
import torch
from huggingface_hub import ModelCard
from huggingface_hub.repocard import metadata_load

from surgery.testing import tiny_models as tm

EVIL = "check *x* | {{ 7*7 }}\n---\nlicense: evil"  # a report name: Markdown, a table separator, Jinja, YAML


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A real MQA conversion of a tiny llama whose surgery.json names a hub source, hub calibration and training
    data, and a real check report of it against its source."""
    from surgery.checking.compare import compare_models
    from surgery.checkpoint.source import resolve_source
    from surgery.kv.convert import convert_to_kv_heads
    from surgery.kv.options import MQAOptions

    root = tmp_path_factory.mktemp("card")
    tm.make_tiny("llama", root / "src")
    convert_to_kv_heads(resolve_source(str(root / "src")), root / "mqa", MQAOptions(), progress=False)
    record_path = root / "mqa" / "surgery.json"
    record = json.loads(record_path.read_text())
    record["source"]["spec"] = "someone/model"
    record["calibration"] = {"data": "someone/ds:cfg@train@v1 + pydoc", "tokens": 4096}
    record["uptraining"] = {"data": ["other/corpus@@main", str(root / "mine.jsonl")], "tokens": 8192}
    record_path.write_text(json.dumps(record))
    a, b = tm.load(root / "src"), tm.load(root / "mqa")
    ids = torch.randint(0, a.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0))
    report = compare_models(a, b, ids, seq_len=32, batch_size=2, causal=True) | {"data": "pydoc"}
    return root, json.loads(json.dumps(report))


def write_card(converted, tmp_path, name="check") -> tuple:
    from surgery.publish.card import build_card
    from surgery.publish.validate import validate_folder

    root, report = converted
    folder = tmp_path / "mqa"
    shutil.copytree(root / "mqa", folder)
    card = build_card(validate_folder(folder), "alice/tiny-mqa", [(name, report)])
    (tmp_path / "README.md").write_text(card)
    return tmp_path / "README.md", report, card


def test_the_hub_parser_reads_lineage_datasets_and_results(converted, tmp_path):
    path, report, _ = write_card(converted, tmp_path)
    data = ModelCard.load(path).data
    assert data.base_model == "someone/model" and data.base_model_relation == "finetune"
    assert data.datasets == ["someone/ds", "other/corpus"]  # hub datasets only: no pydoc, no local file
    assert data.library_name == "transformers" and {"surgery", "mqa"} <= set(data.tags)
    assert data.model_name == "tiny-mqa"
    results = {r.metric_type: r for r in data.eval_results}
    assert results["perplexity"].metric_value == report["ppl_converted"]
    assert results["kl_divergence"].metric_value == report["kl"]
    assert results["top1_agreement"].metric_value == report["top1_agreement"]
    assert {(r.dataset_name, r.dataset_args["tokens"]) for r in data.eval_results} == {("pydoc", report["tokens"])}
    meta = metadata_load(path)
    metrics = meta["model-index"][0]["results"][0]["metrics"]
    assert [m["value"] for m in metrics] == [report["ppl_converted"], report["kl"], report["top1_agreement"]]


def test_untrusted_text_stays_text_in_the_metadata_and_escaped_in_the_body(converted, tmp_path):
    from surgery.publish.card import text

    path, _, card = write_card(converted, tmp_path, name=EVIL)
    meta = metadata_load(path)
    assert "license" not in meta  # the name's "---" and "license:" opened nothing
    assert {r["task"]["name"] for r in meta["model-index"][0]["results"]} == {"surgery check: " + text(EVIL)}
    body = card.split("<!-- model card written by", 1)[1]
    assert "check \\*x\\* &#124; {{ 7\\*7 }} --- license: evil" in body  # the project's escaping, unchanged


@pytest.mark.parametrize("data", ["x" * 300, "a/" + "y" * 300, "nul\0byte"])
def test_a_report_naming_a_text_no_path_can_be_is_named_not_a_traceback(converted, tmp_path, data):
    """A 300-character name (longer than a file name may be) was an OSError from `Path.exists`; a NUL byte a
    ValueError."""
    root, report = converted
    _, _, card = write_card((root, report | {"data": data}), tmp_path)
    assert card.startswith("---\nbase_model: someone/model") and data.split("\0")[0][-100:] in card
