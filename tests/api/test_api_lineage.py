"""A loaded model's lineage (what `surgery.json` and the model card say it was converted from) and the API's
output folders (missing parents made, every check of `out` before any work) — on a tiny random Llama."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import surgery



@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama with a character tokenizer (made in a second; nothing here trains it)."""
    from surgery.testing import tiny_models as tm

    folder = tmp_path_factory.mktemp("lineage") / "tiny"
    tm.make_tiny("llama", folder)
    tm.char_tokenizer(folder)
    return folder


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """A private cache: loaded models and data objects are written here, not into ~/.cache/surgery."""
    import surgery.checkpoint.source as source

    monkeypatch.setattr(source, "CACHE_DIR", tmp_path / "cache")
    return tmp_path / "cache"


def test_a_model_built_in_memory_or_loaded_from_a_folder_says_so_and_invents_no_base_model(tiny, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny))
    loaded = AutoModelForCausalLM.from_pretrained(tiny)
    cards = {}
    for name, model in (("memory", built), ("folder", loaded)):
        result = surgery.convert(model, tmp_path / name, to="mqa", tokenizer=tok)
        source = result.record["source"]
        assert source["loaded"] == name and source["commit"] is None and source["revision"] is None
        assert source["spec"] == (None if name == "memory" else Path(tiny).name)  # a folder's name, never its path
        cards[name] = surgery.model_card(result, "me/x")
        assert "base_model" not in cards[name] and str(tmp_path) not in cards[name]
    assert "a model built in memory" in cards["memory"]
    assert f"local folder `{Path(tiny).name}`" in cards["folder"]


def test_a_lineage_file_outside_the_cache_claims_nothing(tiny, tmp_path):
    import shutil

    from surgery.checkpoint.source import LINEAGE_FILE

    fake = tmp_path / "fake"
    shutil.copytree(tiny, fake)
    (fake / LINEAGE_FILE).write_text(json.dumps({"loaded": "hub", "spec": "meta-llama/x", "commit": "a" * 40}))
    record = surgery.convert(fake, tmp_path / "o", to="mqa").record
    assert record["source"]["spec"] == "fake" and "loaded" not in record["source"]


def test_missing_parents_are_made_and_a_failed_run_leaves_none(tiny, tmp_path, cache):
    from transformers import AutoModelForCausalLM

    deep = tmp_path / "runs" / "x" / "mqa"
    result = surgery.convert(tiny, deep, to="mqa")  # as save_pretrained does
    assert (result.folder / "config.json").is_file()
    with pytest.raises(surgery.SurgeryError, match="kv-heads"):  # refused once the source is read: no folder made
        surgery.convert(tiny, tmp_path / "other" / "y" / "gqa", to="gqa", kv_heads=3)
    assert not (tmp_path / "other").exists()
    # the output is checked before a loaded model is saved into the cache
    model = AutoModelForCausalLM.from_pretrained(tiny)
    for out, message in ((deep, "already exists"), (result.folder / "config.json" / "z", "is not a folder")):
        with pytest.raises(surgery.SurgeryError, match=message):
            surgery.convert(model, out, to="mqa")
    assert not (cache / "loaded").exists()


def test_a_model_loaded_by_hub_id_records_the_cached_commit_holding_its_weights(tiny, tmp_path, monkeypatch):
    """In process: a model loaded from huggingface_hub's cache (its layout written here) is recorded by hub id and
    the commit whose snapshot holds its weights; a snapshot of other weights is not taken for it."""
    import shutil

    import huggingface_hub.constants as constants
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    repo = tmp_path / "hub" / "models--alice--tiny"
    good, other = "a" * 40, "b" * 40
    shutil.copytree(tiny, repo / "snapshots" / good)
    shutil.copytree(tiny, repo / "snapshots" / other)
    weights = repo / "snapshots" / other / "model.safetensors"
    tensors = load_file(weights)
    first = sorted(tensors)[0]
    tensors[first] = tensors[first] + 1
    save_file(tensors, weights)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    model = AutoModelForCausalLM.from_pretrained(repo / "snapshots" / good)
    model.name_or_path = "alice/tiny"  # what from_pretrained("alice/tiny") sets
    record = surgery.convert(model, tmp_path / "mqa", to="mqa").record
    assert {k: record["source"][k] for k in ("spec", "loaded", "commit", "revision")} == {
        "spec": "alice/tiny", "loaded": "hub", "commit": good, "revision": good}
    assert "base_model: alice/tiny" in surgery.model_card(tmp_path / "mqa", "me/x")
    with torch.no_grad():
        next(model.parameters()).add_(1)  # trained in the notebook: no cached snapshot holds these weights
    record = surgery.convert(model, tmp_path / "mqa2", to="mqa").record
    assert record["source"]["spec"] == "alice/tiny" and record["source"]["commit"] is None


@pytest.mark.slow
def test_a_model_loaded_by_hub_id_pushes_a_card_whose_base_model_is_that_id(tiny, tmp_path):
    """A notebook on the loopback hub: from_pretrained("alice/tiny"), convert, push; the card's base_model is
    alice/tiny and surgery.json records the commit transformers loaded (transformers 5 keeps it nowhere on the
    model: found as the cached snapshot holding its weights). Slow (17 s: a fresh process, upload and download);
    the in-process test above covers the same path without the hub."""
    from hub_server import TOKEN, USER, LocalHub, download, run_script

    script = tmp_path / "notebook.py"
    script.write_text(
        "import json, sys, surgery\n"
        "from huggingface_hub import HfApi\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "tiny, out = sys.argv[1], sys.argv[2]\n"
        "HfApi().create_repo('alice/tiny')\n"
        "commit = HfApi().upload_folder(folder_path=tiny, repo_id='alice/tiny').oid\n"
        "model = AutoModelForCausalLM.from_pretrained('alice/tiny')\n"
        "mqa = surgery.convert(model, out, to='mqa', tokenizer=AutoTokenizer.from_pretrained('alice/tiny'))\n"
        "surgery.push(mqa, 'alice/tiny-mqa')\n"
        "print(json.dumps({'commit': commit, 'record': mqa.record}))\n")
    with LocalHub(tmp_path / "hub-data", {TOKEN: USER}) as hub:
        out = run_script(hub, tmp_path, script, tiny, tmp_path / "mqa")
        card = (download(hub, "alice/tiny-mqa", tmp_path / "dl") / "README.md").read_text()
    from huggingface_hub import ModelCard

    assert ModelCard(card).data.base_model == "alice/tiny"
    source = out["record"]["source"]
    assert len(out["commit"]) == 40 and source["commit"] == out["commit"] == source["revision"]
    assert source["spec"] == "alice/tiny" and source["loaded"] == "hub"
    assert f"revision `{out['commit']}`" in card
    assert str(tmp_path) not in card and str(tmp_path) not in json.dumps({k: v for k, v in out["record"].items()
                                                                          if k != "local"})


def _api_calls(tiny, root, afile):
    """(name, call, the message's fragment): bad arguments of the API's own (not a command's options)."""
    c, u, t, card = surgery.convert, surgery.uptrain, surgery.teacher, surgery.model_card
    return [
        ("convert out=123", lambda: c(tiny, 123, to="mqa"), "out is a path"),
        ("convert out=''", lambda: c(tiny, "", to="mqa"), "out is a path"),
        ("convert out inside a file", lambda: c(tiny, afile / "x", to="mqa"), "is not a folder"),
        ("convert dry_run='yes'", lambda: c(tiny, root / "o", to="mqa", dry_run="yes"), "dry_run is True or False"),
        ("convert tokenizer with a folder", lambda: c(tiny, root / "o", to="mqa", tokenizer="x"),
         "tokenizer goes with a loaded model"),
        ("convert calib rows without text", lambda: c(tiny, root / "o", to="mqa", merge="aligned", calib=[{}]),
         "has no 'text'"),
        ("check json_out=123", lambda: surgery.check(tiny, tiny, json_out=123), "json_out is a path"),
        ("check show='x'", lambda: surgery.check(tiny, tiny, show="x"), "show is True or False"),
        ("inspect context='a'", lambda: surgery.inspect(tiny, context="a"), "context is an integer"),
        ("inspect allow_pickle='x'", lambda: surgery.inspect(tiny, allow_pickle="x"), "allow_pickle is True or False"),
        ("uptrain teacher_logprobs=5", lambda: u(tiny, root / "u", tokens=256, teacher_logprobs=5),
         "teacher_logprobs is a path"),
        ("uptrain progress='x'", lambda: u(tiny, root / "u", tokens=256, progress="x"), "progress is True or False"),
        ("teacher revision=5", lambda: t(tiny, root / "t", tokens=256, revision=5), "revision is a branch"),
        ("model_card check_reports=[5]", lambda: card(tiny, "a/b", check_reports=[5]), "check_reports[0] is a path"),
        ("model_card one report, not a list", lambda: card(tiny, "a/b", check_reports="r.json"), "r.json cannot"),
        ("model_card bench_report=5", lambda: card(tiny, "a/b", bench_report=5), "bench_report is a path"),
        ("run_recipe None", lambda: surgery.run_recipe(None), "recipe is a path"),
        ("run_recipe from_step=[]", lambda: surgery.run_recipe({}, from_step=[]), "from_step is a step's name"),
    ]


def test_the_api_s_own_bad_arguments_are_one_line_before_any_work(tiny, tmp_path, cache):
    """Each was a TypeError from inside, a string read letter by letter, or a silent ignore."""
    afile = tmp_path / "afile.txt"
    afile.write_text("x")
    for name, call, fragment in _api_calls(tiny, tmp_path, afile):
        with pytest.raises(surgery.SurgeryError) as e:
            call()
        assert fragment in str(e.value) and "\n" not in str(e.value), name
    assert {p.name for p in tmp_path.iterdir()} <= {"afile.txt", "cache"}  # no output, nothing half-written


def test_a_recipe_whose_first_step_fails_leaves_no_output_folder(tiny, tmp_path):
    """Its output folder (and the folders above it) were left holding only the recipe's state; a step that ran
    keeps its output, for the next run to skip."""
    recipe = {"source": {"path": str(tiny)}, "output": str(tmp_path / "runs" / "r"),
              "steps": [{"uptrain": {"tokens": 256, "seq_len": 32, "teacher_logprobs": str(tmp_path / "nowhere")}}]}
    with pytest.raises(surgery.SurgeryError, match="not a teacher store"):
        surgery.run_recipe(recipe)
    assert not (tmp_path / "runs").exists()
    recipe["steps"].insert(0, {"convert": {"to": "mqa"}})
    with pytest.raises(surgery.SurgeryError, match="not a teacher store"):
        surgery.run_recipe(recipe)
    assert (tmp_path / "runs" / "r" / "recipe-state.json").is_file() and len(list((tmp_path / "runs" / "r").iterdir())) > 1
