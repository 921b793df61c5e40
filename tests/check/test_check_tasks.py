"""`surgery check --tasks`: lm-evaluation-harness tasks scored on both models, offline, with local task files.

The scores are recomputed here from each model's own log-likelihoods (a multiple-choice task: accuracy of the
argmax choice; a cloze task: is-greedy accuracy and perplexity of the target), so the test fails when lm-eval
scores another model, another tokenizer or other text than `check` holds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from inprocess import run_cli

from surgery.testing import tiny_models as tm
from surgery.testing.tiny_models import char_tokenizer

from surgery.checking.compare import compare_checkpoints
from surgery.checking.options import CheckOptions
from surgery.checking.tasks import parse_eval_tasks, rows
from surgery.kv.convert import convert_to_kv_heads
from surgery.kv.options import MQAOptions
from surgery.data import pydoc_texts
from surgery.errors import SurgeryError
from surgery.publish.card import tasks_section
from surgery.checkpoint.source import resolve_source

pytest.importorskip("lm_eval")

QUERIES = ["The cat sat on", "import numpy as", "def main():", "x = 1 + ", "for i in range", "Hello, wor"]
CHOICES = [" the mat", " np", " pass", "2", "(10)", "ld", " the dog", " pandas", " return", "3", "(3)", "lds"]
CLOZE = ["attention is all you need", "the quick brown fox jumps", "print the value of x", "one two three four"]


def write_tasks(folder: Path) -> Path:
    """A folder with two task YAML files (multiple choice and cloze) over JSON-lines data written beside them."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "mc.jsonl", "w") as f:
        for i, q in enumerate(QUERIES):
            f.write(json.dumps({"query": q, "choices": [CHOICES[i], CHOICES[i + 6], CHOICES[(i + 3) % 12]],
                                "gold": i % 3}) + "\n")
    with open(folder / "cloze.jsonl", "w") as f:
        for t in CLOZE:
            f.write(json.dumps({"text": t}) + "\n")
    (folder / "mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'mc.jsonl'}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{query}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list:
  - metric: acc
metadata:
  version: 1.0
""")
    (folder / "cloze.yaml").write_text(f"""task: tiny_cloze
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'cloze.jsonl'}
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""")
    return folder


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tasks")
    tm.make_tiny("llama", root / "src", seed=5)
    char_tokenizer(root / "src")
    convert_to_kv_heads(resolve_source(str(root / "src")), root / "mqa", MQAOptions(), progress=False)
    return {"src": root / "src", "mqa": root / "mqa", "tasks": write_tasks(root / "tasks")}


def ids(text: str) -> list[int]:
    return [ord(c) - 31 for c in text]  # the char tokenizer: id i >= 1 is chr(31 + i)


@torch.no_grad()
def loglikelihood(model, context: str, continuation: str) -> tuple[float, bool]:
    """log p(continuation | context) and whether it is the greedy continuation, straight from the model."""
    x = torch.tensor([ids(context + continuation)])
    logp = torch.log_softmax(model(x).logits[0, :-1].double(), -1)
    n = len(continuation)
    targets = x[0, -n:]
    rows_ = logp[-n:]
    return float(rows_.gather(1, targets[:, None]).sum()), bool((rows_.argmax(-1) == targets).all())


def expected_scores(folder: Path) -> dict[str, dict[str, float]]:
    model = tm.load(folder)
    mc = [max(range(3), key=lambda c: loglikelihood(model, q, [CHOICES[i], CHOICES[i + 6], CHOICES[(i + 3) % 12]][c])[0])
          == i % 3 for i, q in enumerate(QUERIES)]
    cloze = [loglikelihood(model, " ".join(t.split(" ")[:-1]), " " + t.split(" ")[-1]) for t in CLOZE]
    return {"tiny_mc": {"acc": sum(mc) / len(mc)},
            "tiny_cloze": {"acc": sum(g for _, g in cloze) / len(cloze),
                           "perplexity": math.exp(-sum(ll for ll, _ in cloze) / len(cloze))}}


@pytest.mark.slow  # 10-30 s: keeps the default suite under 25 minutes on 2 cores
def test_task_scores_are_each_models_own(pair):
    report = compare_checkpoints(resolve_source(str(pair["src"])), resolve_source(str(pair["mqa"])), pydoc_texts(),
                                 CheckOptions(tokens=256, seq_len=64, batch_size=2, device="cpu",
                                              tasks=str(pair["tasks"])), progress=False)
    tasks = report["tasks"]
    assert sorted(tasks) == ["tiny_cloze", "tiny_mc"]
    for side, folder in (("source", pair["src"]), ("converted", pair["mqa"])):
        for task, metrics in expected_scores(folder).items():
            for metric, value in metrics.items():
                assert tasks[task][side][metric] == pytest.approx(value, rel=1e-4), (side, task, metric)
        assert tasks["tiny_mc"][side]["samples"] == len(QUERIES)
    # the lossy merge moves the cloze perplexity: the two sides are two different models' scores
    assert tasks["tiny_cloze"]["source"]["perplexity"] != pytest.approx(tasks["tiny_cloze"]["converted"]["perplexity"])

    limited = compare_checkpoints(resolve_source(str(pair["src"])), resolve_source(str(pair["mqa"])), pydoc_texts(),
                                  CheckOptions(tokens=256, seq_len=64, batch_size=2, device="cpu",
                                               tasks=str(pair["tasks"] / "mc.yaml"), tasks_limit=2), progress=False)
    assert list(limited["tasks"]) == ["tiny_mc"] and limited["tasks"]["tiny_mc"]["source"]["samples"] == 2

    table = tasks_section([("check", report)])  # the model card's table
    assert any(line.startswith("| check | tiny\\_cloze | acc |") for line in table)  # escaped Markdown
    assert [r[:2] for r in rows(tasks)] == [("tiny_cloze", "acc"), ("tiny_mc", "acc")]


def test_cli_writes_the_scores_into_the_json(pair, tmp_path, capsys):
    out = tmp_path / "r.json"
    code, stdout, err = run_cli(capsys, "check", pair["src"], pair["mqa"], "--tokens", "128", "--seq-len", "64",
                                "--tasks", pair["tasks"] / "cloze.yaml", "--tasks-limit", "3", "--json", out)
    assert code == 0, err
    report = json.loads(out.read_text())
    assert report["tasks_limit"] == 3 and report["tasks"]["tiny_cloze"]["converted"]["samples"] == 3
    assert "lm-eval tasks" in stdout and "tiny_cloze" in stdout


@pytest.mark.parametrize("args, message", [
    (["--tasks", "no_such_task_anywhere"], "lm-eval knows no task no_such_task_anywhere"),
    (["--tasks", "lambada_openai"], "the data of lambada_openai could not be loaded"),  # a hub dataset, offline
    (["--tasks-limit", "3"], "--tasks-limit needs --tasks"),
    (["--tasks", "missing.yaml"], "missing.yaml does not exist"),
])
def test_bad_tasks_are_one_line_before_any_model_loads(pair, tmp_path, capsys, monkeypatch, args, message):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # offline for sure, wherever the test runs
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # both read their variables when first imported
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    out = tmp_path / "r.json"
    code, _, err = run_cli(capsys, "check", pair["src"], pair["mqa"], "--tokens", "128", "--seq-len", "64",
                           *args, "--json", out)
    assert code == 2 and message in err and "Traceback" not in err
    assert err.strip().count("\n") == 0 or err.strip().splitlines()[-1].startswith("surgery: error:")
    assert not out.exists()


def test_a_task_file_is_read_without_running_its_tags(tmp_path):
    hostile = tmp_path / "t.yaml"
    hostile.write_text("task: mine\nprocess_docs: !function utils.process\n")  # utils.py does not even exist
    assert parse_eval_tasks(f"hellaswag, {hostile}") == (["hellaswag", "mine"], [tmp_path])
    (tmp_path / "empty.yaml").write_text("dataset_path: json\n")
    with pytest.raises(SurgeryError, match="defines no task"):
        parse_eval_tasks(str(tmp_path / "empty.yaml"))
